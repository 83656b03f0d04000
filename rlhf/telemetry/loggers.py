"""Where a run's record goes: metric sinks (:class:`Loggers`: every run writes ``metrics.jsonl`` in its run folder;
W&B and TensorBoard add to that, one or several at once) and the run's log lines in ``<run dir>/train.log``
(:func:`log_file`)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from rlhf.core.errors import UserError
from rlhf.core.instantiate import in_a_sweep


@contextlib.contextmanager
def log_file(run_dir: Path, enabled: bool) -> Iterator[None]:
    """Log to ``<run dir>/train.log`` for the duration of the run, unless a handler already does (Hydra's)."""
    path = (run_dir / "train.log").resolve()
    root = logging.getLogger()
    if not enabled or any(getattr(h, "baseFilename", None) == str(path) for h in root.handlers):
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    handler.setLevel(logging.INFO)
    root.addHandler(handler)
    package = logging.getLogger("rlhf")
    level = package.level
    if package.getEffectiveLevel() > logging.INFO:
        package.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()
        package.setLevel(level)


class JsonlLogger:
    """Appends one JSON object per call to ``<run dir>/metrics.jsonl``: ``{"step": N, "train/loss": ...}``."""

    def __init__(self, filename: str = "metrics.jsonl") -> None:
        self.filename = filename
        self.path: Path | None = None
        self.resume_step: int | None = None
        self.tables_started: set[str] = set()

    def start(self, run_dir: str, config: dict[str, Any], resume_step: int | None = None) -> None:
        """A new run starts a new file; a run resumed from the checkpoint of ``resume_step`` keeps the lines up to
        that step and continues after them (the lines logged after the checkpoint are logged again)."""
        self.path = Path(run_dir) / self.filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.resume_step, self.tables_started = resume_step, set()
        _keep_lines_up_to(self.path, resume_step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        """Append ``rows`` to ``<run dir>/<name>.jsonl``, one JSON line each with the step. Its first write in a run
        starts the file anew (a new run) or cuts it back to the resumed checkpoint's step, as ``metrics.jsonl``."""
        path = self.path.with_name(f"{name}.jsonl")
        if name not in self.tables_started:
            self.tables_started.add(name)
            _keep_lines_up_to(path, self.resume_step)
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")

    def finish(self) -> None:
        pass


def _keep_lines_up_to(path: Path, step: int | None) -> None:
    """Rewrite the JSON-lines file ``path`` with its lines of steps up to ``step`` (none when ``step`` is None)."""
    kept = []
    if step is not None and path.exists():
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                break  # a line cut short by the kill: it and whatever follows are dropped
    staging = path.with_name(path.name + ".tmp")
    staging.write_text("".join(kept))
    os.replace(staging, path)


class Loggers:
    """The run's metric sinks as one: ``metrics.jsonl`` always (the ``JsonlLogger`` among ``loggers``, else one
    with its defaults), first, then the others in the order given (``logger=[wandb,tensorboard]``)."""

    def __init__(self, loggers: list[Any]) -> None:
        jsonl = [one for one in loggers if isinstance(one, JsonlLogger)]
        self.jsonl = jsonl[0] if jsonl else JsonlLogger()
        self.loggers = [self.jsonl] + [one for one in loggers if not isinstance(one, JsonlLogger)]

    @property
    def filename(self) -> str:
        return self.jsonl.filename

    def start(self, run_dir: str, config: dict[str, Any], resume_step: int | None = None) -> None:
        for one in self.loggers:
            one.start(run_dir, config, resume_step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for one in self.loggers:
            one.log(metrics, step)

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        """Rows of a table (:meth:`rlhf.algos.base.Algorithm.tables`), to every logger that keeps tables."""
        for one in self.loggers:
            if hasattr(one, "log_table"):
                one.log_table(name, rows, step)

    def finish(self) -> None:
        for one in self.loggers:
            one.finish()


class TensorBoardLogger:
    """Scalars for TensorBoard (``torch.utils.tensorboard``) in ``<run dir>/<folder>``, and the resolved config as
    text (tab TEXT): ``tensorboard --logdir <run dir or sweep folder>``.

    A new run in a folder starts a new record (the folder's earlier event files are removed, as ``metrics.jsonl``
    starts anew). A run resumed from the checkpoint of step N writes a new event file that begins with TensorBoard's
    purge mark at step N+1: TensorBoard hides the values the stopped attempt logged after its checkpoint, and shows
    the resumed run's in their place (the stopped attempt's event file itself keeps them; ``metrics.jsonl`` is the
    record without them).

    Args:
        folder: the event files' folder inside the run folder.
    """

    def __init__(self, folder: str = "tensorboard") -> None:
        self.folder = folder
        self.writer = None

    def start(self, run_dir: str, config: dict[str, Any], resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        path = Path(run_dir) / self.folder
        if resume_step is None:
            shutil.rmtree(path, ignore_errors=True)
        self.writer = SummaryWriter(log_dir=str(path), purge_step=None if resume_step is None else resume_step + 1)
        text = OmegaConf.to_yaml(OmegaConf.create(config))
        self.writer.add_text("config", "".join("    " + line + "\n" for line in text.splitlines()),  # Markdown code
                             global_step=resume_step or 0)
        self.writer.flush()

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # on disk as metrics.jsonl is: a killed run keeps what it logged

    def finish(self) -> None:
        self.writer.close()


class WandbLogger:
    """Weights & Biases (beside ``metrics.jsonl``, which :class:`Loggers` always writes). Runs offline (synced later with ``wandb sync``) when no API key
    is configured, so it works without network; see :func:`wandb_mode` for which mode wins.

    Args:
        project: W&B project.
        entity: W&B team or user (``None``: your default).
        name: run name (``None``: the run folder's name).
        tags: run tags.
        group: the W&B group, which W&B's run table groups by; ``conf/logger/wandb.yaml`` sets it to the sweep's
            folder (``hydra.sweep.dir``) for the points of a multirun (:func:`sweep_group`), else none.
        mode: ``online``, ``offline`` or ``disabled``; ``None``: ``WANDB_MODE`` if set, else online if an API key
            is set, else offline.
        rewind: on resume, rewind the W&B run to the checkpoint's step (W&B's ``resume_from``, a preview feature
            that the server must support, online only), so that the steps the stopped attempt logged after its
            checkpoint are replaced by the resumed run's. ``False``: continue the W&B run under its id, which keeps
            the stopped attempt's values for those steps and drops the resumed run's (W&B ignores a step below
            its current one); ``metrics.jsonl`` is right either way.
    """

    def __init__(self, project: str = "rlhf", entity: str | None = None, name: str | None = None,
                 tags: list[str] | None = None, group: str | None = None, mode: str | None = None,
                 rewind: bool = False) -> None:
        self.project, self.entity, self.name, self.tags, self.mode = project, entity, name, tags, mode
        self.group = group
        self.rewind = rewind
        self.run = None

    def start(self, run_dir: str, config: dict[str, Any], resume_step: int | None = None) -> None:
        import wandb

        Path(run_dir).mkdir(parents=True, exist_ok=True)
        # The run's W&B id lives in the run folder: a resumed run continues the same W&B run.
        id_file = Path(run_dir) / "wandb_run_id.txt"
        run_id = id_file.read_text().strip() if resume_step is not None and id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        mode = wandb_mode(self.mode)
        if resume_step is not None and self.rewind:
            if mode != "online":
                raise UserError(f"logger.wandb.rewind=true needs W&B online (the mode is {mode}): W&B rewinds a run on its "
                                "server. Fix: log in (wandb login) and drop WANDB_MODE, or logger.wandb.rewind=false.")
            where = {"resume_from": f"{run_id}?_step={resume_step}"}  # W&B's rewind: history cut back to the step
        else:
            where = {"id": run_id, "resume": "allow"}
        self.run = wandb.init(project=self.project, entity=self.entity, name=self.name or Path(run_dir).name,
                              tags=self.tags, group=self.group, config=config, dir=run_dir, mode=mode, **where)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        """``rows`` as a W&B table ``name`` at ``step`` (columns: the union of the rows' keys, in order)."""
        import wandb

        columns = list(dict.fromkeys(key for row in rows for key in row))
        self.run.log({name: wandb.Table(columns=["step", *columns],
                                        data=[[step, *(row.get(c) for c in columns)] for row in rows])}, step=step)

    def finish(self) -> None:
        self.run.finish()


def wandb_mode(configured: str | None) -> str:
    """The W&B mode of a run: ``logger.wandb.mode`` when set, else the environment's ``WANDB_MODE`` (so that
    ``WANDB_MODE=offline`` keeps a machine with ``WANDB_API_KEY`` in its environment off the network), else online
    when an API key is configured (``WANDB_API_KEY`` or ``~/.netrc``), else offline."""
    if configured:
        return configured
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):  # the older switch
        return "disabled"
    return "online" if os.environ.get("WANDB_API_KEY") or _has_netrc_key() else "offline"


def _has_netrc_key() -> bool:
    netrc = Path(os.path.expanduser("~/.netrc"))
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def sweep_group(limit: int = 128) -> str | None:
    """``${rlhf.sweep_group:}``: the sweep's folder (``hydra.sweep.dir`` as configured, at most ``limit``
    characters, W&B's limit for a group) in a point of a multirun sweep, under any launcher; else None."""
    if not in_a_sweep():
        return None
    folder = str(HydraConfig.get().sweep.dir)
    if len(folder) <= limit:
        return folder
    return "..." + folder[-(limit - 3):]  # the end names the sweep


OmegaConf.register_new_resolver("rlhf.sweep_group", sweep_group, replace=True)
