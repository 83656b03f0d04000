"""Where a run's record goes: metric sinks (every run writes ``metrics.jsonl`` in its run folder; other sinks add
to that) and the run's log lines in ``<run dir>/train.log`` (:func:`log_file`)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlhf.errors import UserError


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

    def start(self, run_dir: str, config: dict[str, Any], resume_step: int | None = None) -> None:
        """A new run starts a new file; a run resumed from the checkpoint of ``resume_step`` keeps the lines up to
        that step and continues after them (the lines logged after the checkpoint are logged again)."""
        self.path = Path(run_dir) / self.filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= resume_step:
                        kept.append(line + "\n")
                except (ValueError, KeyError, TypeError):
                    break  # a line cut short by the kill: it and whatever follows are dropped
        staging = self.path.with_name(self.path.name + ".tmp")
        staging.write_text("".join(kept))
        os.replace(staging, self.path)

    def log(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")

    def finish(self) -> None:
        pass


class WandbLogger(JsonlLogger):
    """``metrics.jsonl`` plus Weights & Biases. Runs offline (synced later with ``wandb sync``) when no API key
    is configured, so it works without network; see :func:`wandb_mode` for which mode wins.

    Args:
        project: W&B project.
        entity: W&B team or user (``None``: your default).
        name: run name (``None``: the run folder's name).
        tags: run tags.
        mode: ``online``, ``offline`` or ``disabled``; ``None``: ``WANDB_MODE`` if set, else online if an API key
            is set, else offline.
        rewind: on resume, rewind the W&B run to the checkpoint's step (W&B's ``resume_from``, a preview feature
            that the server must support, online only), so that the steps the stopped attempt logged after its
            checkpoint are replaced by the resumed run's. ``False``: continue the W&B run under its id, which keeps
            the stopped attempt's values for those steps and drops the resumed run's (W&B ignores a step below
            its current one); ``metrics.jsonl`` is right either way.
    """

    def __init__(self, project: str = "rlhf", entity: str | None = None, name: str | None = None,
                 tags: list[str] | None = None, mode: str | None = None, rewind: bool = False) -> None:
        super().__init__()
        self.project, self.entity, self.name, self.tags, self.mode = project, entity, name, tags, mode
        self.rewind = rewind
        self.run = None

    def start(self, run_dir: str, config: dict[str, Any], resume_step: int | None = None) -> None:
        import wandb

        super().start(run_dir, config, resume_step)
        # The run's W&B id lives in the run folder: a resumed run continues the same W&B run.
        id_file = Path(run_dir) / "wandb_run_id.txt"
        run_id = id_file.read_text().strip() if resume_step is not None and id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        mode = wandb_mode(self.mode)
        if resume_step is not None and self.rewind:
            if mode != "online":
                raise UserError(f"logger.rewind=true needs W&B online (the mode is {mode}): W&B rewinds a run on its "
                                "server. Fix: log in (wandb login) and drop WANDB_MODE, or logger.rewind=false.")
            where = {"resume_from": f"{run_id}?_step={resume_step}"}  # W&B's rewind: history cut back to the step
        else:
            where = {"id": run_id, "resume": "allow"}
        self.run = wandb.init(project=self.project, entity=self.entity, name=self.name or Path(run_dir).name,
                              tags=self.tags, config=config, dir=run_dir, mode=mode, **where)

    def log(self, metrics: dict[str, float], step: int) -> None:
        super().log(metrics, step)
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


def wandb_mode(configured: str | None) -> str:
    """The W&B mode of a run: ``logger.mode`` when set, else the environment's ``WANDB_MODE`` (so that
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
