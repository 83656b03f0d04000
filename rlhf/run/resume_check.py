"""A resume continues one optimization: what a checkpoint records of its run, and the check that a resume keeps it.

Every checkpoint holds ``config.json`` (written before ``meta.json``): the run's resolved config, flattened to
dotted keys, minus what cannot change the optimization (:data:`NOT_OPTIMIZING`: where the run writes and how it
reports, when it evaluates and saves, where its processes run, and whether it compiles what it computes), with ``hardware.device: auto``,
``hardware.mixed_precision: auto`` and ``hardware.num_processes: null`` replaced by what they mean on the machine
that wrote it; plus a fingerprint of the
tokenized training split (:func:`rlhf.data.fingerprint.data_fingerprint`). Everything else is compared on resume: the whole config is
the list, so a key added to any component is covered without a change here.

- :func:`check_config` (before any process is started, before the model or data load) refuses a resume whose config
  differs from the checkpoint's, naming each changed key with both values, unless the key is listed in
  ``resume_changes`` (a listed key covers the keys below it: ``resume_changes=[optimizer]``).
- :func:`check_data` (once the data is tokenized) refuses training rows other than the checkpoint's, unless
  ``resume_changes`` lists ``tokenized_data``.

A checkpoint written before configs were recorded (no ``config.json``) resumes with a warning, unchecked.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf.core.errors import UserError
from rlhf.core.limits import show
from rlhf.hardware.precision import computes_in_bf16, model_dtype
from rlhf.old_paths import MOVED
from rlhf.run.checkpoint import CONFIG as FILE  # in each checkpoint folder, beside meta.json

log = logging.getLogger(__name__)

DATA = "tokenized_data"  # the fingerprint's name in the record, in messages and in resume_changes

# What cannot change the optimization, so a resume may change it freely: where the run writes and reports
# (output_dir, logger, hydra, launcher, objective), how it was started (resume, resume_changes), when and how it logs,
# evaluates and saves (evaluation, eval=generate's too, runs in eval mode in a forked random state), where its
# processes run, and options that compute the same functions another way. The one list of what a resume does not
# compare; a key below one of these is excluded with it.
NOT_OPTIMIZING = (
    "output_dir", "resume", "resume_changes", "logger", "hydra", "launcher", "objective", "eval",
    "train.log_every_steps", "train.eval_every_steps", "train.eval_at_start", "train.eval_batch_size",
    "train.save_every_steps", "train.save_every_minutes", "train.keep_last", "train.save_final",
    "train.empty_cache_every_steps", "train.profile_steps", "train.profile_memory", "train.memory_check",
    "train.nonfinite_on_device",  # the same steps skipped, the others the same bit for bit; only when a stop acts
    "data.num_workers",  # the batches are the same with any count of workers (rlhf.data.loaders.train_loader)
    "hardware.timeout_s", "hardware.rdzv_endpoint", "hardware.node_rank",
    "model.gradient_checkpointing",  # recomputes the same activations: the same gradients bit for bit (tested)
    # The same functions computed faster: the numbers agree to float rounding, not bit for bit (kernels fused and
    # reordered, as on another GPU), so a resume may turn it on or off, and a checkpoint that recorded `false` (or
    # nothing) resumes whatever `auto` means now.
    "hardware.compile",  # compiled and eager train alike (tests/hardware/test_compiling.py)
)
# Options added after checkpoints were first written, each with the value that does what a run did before the
# option existed: a checkpoint without the key is compared as having it (any other key a checkpoint lacks is a change,
# e.g. an option a command line adds with +key=value).
ADDED_SINCE = {"algo.generation": "auto"}
THREADS = "hardware.threads_per_process"  # recorded as the count a CPU run in bf16 used: it changes those numbers
# Leaf names that say where files are kept, wherever they appear (the tiny model's warm-start cache, $RLHF_CACHE).
WHERE_FILES_ARE = ("cache_dir",)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{"train.max_steps": 300, ...}``: every leaf of a nested dict under its dotted key (lists are leaves)."""
    if isinstance(node, dict) and node:
        flat: dict[str, Any] = {}
        for key, value in node.items():
            flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: node}


def optimizing(key: str) -> bool:
    """Whether a change of ``key`` can change the optimization (see :data:`NOT_OPTIMIZING`)."""
    return not (any(key == k or key.startswith(k + ".") for k in NOT_OPTIMIZING)
                or key.rsplit(".", 1)[-1] in WHERE_FILES_ARE)


def recorded_config(cfg: DictConfig, strategy) -> dict[str, Any]:
    """What a checkpoint records of ``cfg``: the optimizing keys, resolved, as JSON reads them back. ``strategy``
    (built from ``cfg.hardware``) says what ``device: auto``, ``mixed_precision: auto`` and ``num_processes: null``
    mean here."""
    flat = {k: v for k, v in flatten(OmegaConf.to_container(cfg, resolve=True)).items() if optimizing(k)}
    if "hardware.device" in flat:
        flat["hardware.device"] = "cuda" if strategy.uses_cuda() else "cpu"
    if flat.get("hardware.mixed_precision") == "auto":
        flat["hardware.mixed_precision"] = strategy.mixed_precision  # resolved when the strategy was built
    if "hardware.num_processes" in flat:
        flat["hardware.num_processes"] = strategy.processes_per_node()
    if THREADS in flat:  # bf16 steps on a CPU differ with the thread count; float32's and a GPU's do not (docs/threads/)
        if strategy.uses_cuda() or not computes_in_bf16(flat.get("hardware.mixed_precision"),
                                                        model_dtype(cfg.get("model"))):
            del flat[THREADS]
        else:
            flat[THREADS] = getattr(strategy, "threads_settled", None) or flat[THREADS]
    return json.loads(json.dumps(flat))


def recorded_threads(folder: Path) -> int | None:
    """The torch threads per process of the run that wrote the checkpoint ``folder``, recorded where they change the
    numbers (a CPU run in bf16; else None): what a resume uses unless told otherwise
    (:func:`rlhf.hardware.cpus.choose_threads`)."""
    recorded = read(folder)
    value = recorded["config"].get(THREADS) if recorded else None
    return value if isinstance(value, int) else None


def record(cfg: DictConfig, strategy, fingerprint: str) -> dict[str, Any]:
    """The content of a checkpoint's ``config.json``."""
    return {"config": recorded_config(cfg, strategy), DATA: fingerprint}


def read(folder: Path) -> dict[str, Any] | None:
    file = Path(folder) / FILE
    return json.loads(file.read_text()) if file.is_file() else None


def listed_changes(cfg: DictConfig) -> list[str]:
    """``resume_changes`` as a list of keys (a single key is a list of one)."""
    value = cfg.get("resume_changes")
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def _allowed(key: str, listed: list[str]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in listed)


def check_config(cfg: DictConfig, strategy, folder: Path) -> None:
    """Refuse resuming ``cfg`` from the checkpoint ``folder`` when an optimizing key differs, unless listed in
    ``resume_changes``; log the listed changes that were made."""
    recorded = read(folder)
    if recorded is None:
        log.warning("%s records no config (written by an older version of rlhf): this resume is not checked "
                    "against the run's config", folder)
        return
    before = {k: v for k, v in recorded["config"].items() if optimizing(k)}  # a key a newer version ignores
    before = {k: current_path(v) if k.endswith("_target_") else v for k, v in before.items()}
    now, listed = recorded_config(cfg, strategy), listed_changes(cfg)
    _check_listed(folder, listed, [*before, *flatten(OmegaConf.to_container(cfg, resolve=True))])
    if THREADS not in before or THREADS not in now:  # compared where both runs compute in bf16 on a CPU (or an older
        before.pop(THREADS, None)  # checkpoint, which recorded no count)
        now.pop(THREADS, None)
    # an option added since the checkpoint was written reads as the value that does what the run did without it
    predates = {k: v for k, v in ADDED_SINCE.items() if k in now and k not in before}
    if predates:
        log.info("resume from %s: the checkpoint predates %s (compared as %s)", folder, ", ".join(predates),
                 ", ".join(f"{k}={v}" for k, v in predates.items()))
    before = {**before, **predates}
    missing = object()
    changed = [k for k in sorted(before.keys() | now.keys()) if before.get(k, missing) != now.get(k, missing)]
    refused = [k for k in changed if not _allowed(k, listed)]
    if refused:
        pairs = "; ".join(f"{k} (checkpoint: {_shown(before, k)}, now: {_shown(now, k)}{_source(cfg, k)})"
                          for k in refused)
        schedule = (" A longer train.max_steps stretches cosine and linear schedules: the steps already taken "
                    "followed the shorter one." if any(k in ("train.max_steps", "train.num_epochs") for k in refused)
                    else "")
        raise UserError(
            f"resume from {folder}: the config differs from the checkpoint's in {_keys(refused)}: {pairs}. A resume "
            f"continues the same optimization, and these would change it. Fix: resume with the checkpoint's values "
            f"({_how_to_keep(cfg, Path(folder))}), or, to change them deliberately, add "
            f"resume_changes=[{','.join(refused)}].{schedule}")
    if changed:
        log.info("resume from %s with the changes listed in resume_changes: %s", folder,
                 "; ".join(f"{k} {_shown(before, k)} -> {_shown(now, k)}" for k in changed))


def current_path(target: Any) -> Any:
    """A ``_target_`` recorded before the layer packages under its module's path now (``rlhf.models.tiny.TinySpec``
    -> ``rlhf.embedded.tiny_model.TinySpec``: :mod:`rlhf.old_paths`), so that the move is no change of config."""
    if not isinstance(target, str):
        return target
    for old in sorted(MOVED, key=len, reverse=True):
        if target.startswith(old + "."):
            return MOVED[old] + target[len(old):]
    return target


def check_data(cfg: DictConfig, fingerprint: str, folder: Path) -> None:
    """Refuse resuming from ``folder`` on other tokenized training rows, unless ``resume_changes`` lists them."""
    recorded = read(folder)
    if recorded is None or recorded.get(DATA) == fingerprint:
        return
    if DATA in listed_changes(cfg):
        log.info("resume from %s on other training rows (resume_changes lists %s)", folder, DATA)
        return
    listed = [*listed_changes(cfg), DATA]
    raise UserError(
        f"resume from {folder}: the tokenized training data differs from the checkpoint's ({DATA} "
        f"{recorded.get(DATA)}, now {fingerprint}): the rows, or how they are tokenized, have changed since (a data "
        "file edited in place, a new version of a Hub dataset, another tokenizer or length limit). The data order "
        "and position would not continue. Fix: resume with the data it was trained on, or, to train on these rows "
        f"deliberately, resume_changes=[{','.join(listed)}].")


def _check_listed(folder: Path, listed: list[str], keys: list[str]) -> None:
    """Refuse a name in ``resume_changes`` that is no key of the config (a typo would allow nothing)."""
    for name in listed:
        if name == DATA or any(k == name or k.startswith(name + ".") for k in keys):
            continue
        close = difflib.get_close_matches(name, [*keys, DATA], n=1)
        hint = f" Did you mean {close[0]}?" if close else ""
        raise UserError(f"resume from {folder}: resume_changes lists {name}, which is not a key of the run's config "
                        f"(nor {DATA}).{hint} Fix: the key as you would override it, e.g. "
                        "resume_changes=[train.max_steps].")


def _how_to_keep(cfg: DictConfig, folder: Path) -> str:
    source = folder.parent.parent  # <run dir>/checkpoints/step_<N>
    if source.resolve() == Path(str(cfg.get("output_dir", ""))).resolve():
        return f"`python train.py hydra.run.dir={source} resume=auto` alone re-applies the run's own overrides"
    return f"the overrides of the run that wrote it are in {source}/.hydra/"


def _source(cfg: DictConfig, key: str) -> str:
    """Where a refused value comes from when not from the config: the thread count from ``OMP_NUM_THREADS``."""
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if key == THREADS and omp.isdigit() and OmegaConf.select(cfg, THREADS) is None:
        return f", from OMP_NUM_THREADS={omp}: unset it to keep the checkpoint's"
    return ""


def _shown(values: dict[str, Any], key: str) -> str:
    return show(values[key]) if key in values else "(absent)"


def _keys(keys: list[str]) -> str:
    return f"{len(keys)} key{'s' if len(keys) > 1 else ''}"
