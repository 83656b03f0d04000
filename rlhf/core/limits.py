"""What a config value may be, declared once next to the component that takes it; checked before anything runs.

- :class:`Range`: the numbers one argument accepts (bounds, whole numbers, a list of them), what the value means
  and a value that works. A value outside it is refused with one message naming the key as the user types it::

      algo.beta=-1 must be > 0 (the KL penalty's strength; 0.1-0.5 is common). Fix: algo.beta=0.1

- :func:`limits`: attaches ranges (and checks across arguments) to a class or function that a ``_target_`` names,
  e.g. ``@limits(beta=Range(gt=0, ...))`` above :class:`rlhf.algos.dpo.DPO`. Third-party targets (optimizers,
  schedulers) get the limits their config group shares, by argument name, from :mod:`rlhf.optim`.
- :func:`rlhf.config.checks.check_config` applies all of it to every ``_target_`` node, refuses NaN and infinity
  anywhere, and runs the whole-run checks below (top-level keys, the run folder, float16 on a CPU).
- :class:`rlhf.config.checks.CheckBeforeRun`: a Hydra callback (declared in ``conf/config.yaml``) that runs
  ``check_config`` before Hydra creates the run folder, so a bad command line leaves nothing behind.
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlhf.core.errors import UserError

# The config folder next to the package (a checkout or an editable install); Hydra's own source wins when known.
_PACKAGE_CONF = Path(__file__).resolve().parents[2] / "conf"


def show(value: Any) -> str:
    """A value as the user would type it on the command line (``1e-05``, ``[0.9,0.999]``, ``null``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(show(v) for v in value) + "]"
    return str(value)


def _key(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


@dataclass(frozen=True)
class Range:
    """The values one numeric argument accepts. Bounds are optional; NaN and infinity are never accepted.

    Args:
        gt, ge, lt, le: exclusive / inclusive lower and upper bounds.
        meaning: what the value does, shown in the error (with a common value, if there is one).
        fix: a value that works, shown as ``Fix: <key>=<fix>``.
        integer: only whole numbers (step counts).
        each: the argument takes a list of such numbers (``betas``); a single number is checked as is.
        null: what ``null`` means for this argument, when rlhf gives it one that its type does not (a schedule's
            ``num_training_steps``: the run's length); ``null`` is then accepted whatever the annotation says.
    """

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    meaning: str = ""
    fix: Any = None
    integer: bool = False
    each: bool = False
    null: str = ""

    def describe(self) -> str:
        """The allowed values in words: ``> 0``, ``in [0, 1)``, ``a whole number >= 0``."""
        lower = (self.ge, "[", ">=") if self.ge is not None else (self.gt, "(", ">") if self.gt is not None else None
        upper = (self.le, "]", "<=") if self.le is not None else (self.lt, ")", "<") if self.lt is not None else None
        if lower and upper:
            bounds = f"in {lower[1]}{show(lower[0])}, {show(upper[0])}{upper[1]}"
        elif lower or upper:
            bound, _, operator = lower or upper
            bounds = f"{operator} {show(bound)}"
        else:
            bounds = ""
        if self.integer:
            return f"a whole number {bounds}".strip()
        return bounds or "a finite number"

    def contains(self, value: float) -> bool:
        return (math.isfinite(value) and (self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
                and (self.lt is None or value < self.lt) and (self.le is None or value <= self.le)
                and (not self.integer or float(value).is_integer()))

    def check(self, key: str, value: Any) -> None:
        """Raise UserError unless `value` (a number, a list of numbers when ``each``, or null) is allowed."""
        if value is None:
            return  # "not set": whether null is allowed is the type check's business
        if isinstance(value, (list, tuple)):
            if not self.each:
                raise UserError(sweep_message(key, value, "integer" if self.integer else "number"))
            for i, item in enumerate(value):
                self._check_one(f"{key}[{i}]", item, key)
            return
        self._check_one(key, value, key)

    def _check_one(self, name: str, value: Any, key: str) -> None:
        meaning = f" ({self.meaning})" if self.meaning else ""
        fix = f" Fix: {key}={show(self.fix)}" if self.fix is not None else ""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{name}={value!r} is not a number; it must be {self.describe()}{meaning}.{fix}")
        if not math.isfinite(value):
            raise UserError(f"{name}={show(value)} is not a finite number; it must be {self.describe()}{meaning}.{fix}")
        if not self.contains(value):
            raise UserError(f"{name}={show(value)} must be {self.describe()}{meaning}.{fix}")


Check = Callable[[Mapping[str, Any], str], None]
"""A check across arguments: ``check(values, where)`` raises UserError (``where`` is the node's key, e.g. ``algo``)."""


def limits(*checks: Check, **ranges: Range) -> Callable:
    """Declare the allowed values of a class's or function's arguments, for :func:`rlhf.config.checks.check_config`.

    ``@limits(beta=Range(gt=0, meaning=..., fix=0.1))`` above a class checks ``beta`` of every config node whose
    ``_target_`` is that class (or a subclass). Positional arguments are checks across arguments.
    """

    def attach(target: Callable) -> Callable:
        target.__limits__ = {**getattr(target, "__limits__", {}), **ranges}
        target.__checks__ = (*getattr(target, "__checks__", ()), *checks)
        return target

    return attach


def check_limits(values: Mapping[str, Any], target: Callable, where: str,
                 shared: Mapping[str, Range] | None = None) -> None:
    """Raise UserError if a value in `values` (one config node) is outside the limits of its `target`, or of the
    `shared` limits of its config group (by argument name: an optimizer's ``lr``, whatever its class)."""
    ranges = {**(shared or {}), **getattr(target, "__limits__", {})}
    for name, allowed in ranges.items():
        if name in values:
            allowed.check(_key(where, name), values[name])
    checks = getattr(target, "__checks__", ())
    if checks:
        try:
            defaults = {name: p.default for name, p in inspect.signature(target).parameters.items()
                        if p.default is not inspect.Parameter.empty}
        except (TypeError, ValueError):
            defaults = {}
        for check in checks:
            check({**defaults, **values}, where)


def check_finite(key: str, value: Any) -> None:
    """Refuse NaN and infinity: no field of this project gives them a meaning."""
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{key}={show(value)} is not a finite number; {key} takes one. Fix: a finite value "
                        "(python train.py --cfg job shows the defaults).")


def sweep_message(key: str, value: Any, takes: str) -> str:
    """The message for a list given where one value belongs: most often a sweep written as a list."""
    if isinstance(value, Mapping):
        return f"{key}={show(dict(value))} is a group of fields, but {key} takes one {takes}. Fix: e.g. {key}=<{takes}>"
    items = list(value)
    return (f"{key}={items} is a list, but {key} takes one {takes}. To sweep: python train.py -m "
            f"{key}={','.join(show(v) for v in items)}")


# --- the run as a whole ----------------------------------------------------------------------------------------
def conf_dir() -> Path | None:
    """The folder of the primary config: Hydra's, when Hydra composed this run, else ``conf/`` next to the package."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            for source in HydraConfig.get().runtime.config_sources:
                if source.provider == "main" and source.schema == "file" and Path(source.path).is_dir():
                    return Path(source.path)
    except Exception:  # not under Hydra
        pass
    return _PACKAGE_CONF if _PACKAGE_CONF.is_dir() else None


def known_top_level(folder: Path | None = None) -> dict[str, str]:
    """The top-level names ``conf/config.yaml`` defines: ``{name: "group" or "key"}``, read from its defaults
    list (groups) and its own keys (``seed``, ``train``, ...). Empty when there is no such file."""
    folder = folder or conf_dir()
    if folder is None or not (folder / "config.yaml").is_file():
        return {}
    primary = OmegaConf.to_container(OmegaConf.load(folder / "config.yaml"), resolve=False)
    names: dict[str, str] = {}
    for entry in primary.pop("defaults", []):
        if isinstance(entry, dict):
            for group in entry:
                group = str(group).removeprefix("optional ").strip().lstrip("/")
                if not group.startswith("override "):
                    names[group.split("@")[0]] = "group"
    names.update({str(k): "key" for k in primary})
    return names


def check_top_level(config: Mapping[str, Any], folder: Path | None = None) -> None:
    """Refuse a top-level key that ``conf/config.yaml`` does not define (``+optimiser=lion``, ``+foo=1``): added
    with ``+``, it would be ignored while the run trains with the defaults."""
    known = known_top_level(folder)
    if not known:
        return
    for key, value in config.items():
        if key in known or key == "hydra":
            continue
        typed = _as_override(str(key), value)
        raise UserError(f"{key} is not a config group or key: +{typed} would be ignored and the run would train with "
                        f"the defaults. {unknown_name_hint(str(key), typed, known, f'drop +{typed}')}")


def unknown_name_hint(name: str, typed: str, known: Mapping[str, str], fix: str) -> str:
    """``Did you mean optimizer=lion?`` for a top-level `name` typed as `typed` (``optimiser=lion``), or the
    known groups and keys and `fix`."""
    close = difflib.get_close_matches(name, list(known), n=1)
    if close:
        return f"Did you mean {close[0]}{typed[len(name):]}?"
    groups = ", ".join(sorted(k for k, kind in known.items() if kind == "group"))
    keys = ", ".join(sorted(k for k, kind in known.items() if kind == "key"))
    return f"Config groups: {groups}; keys: {keys}. Fix: {fix}."


def _as_override(key: str, value: Any) -> str:
    """``key=value`` for the first leaf of `value` (``optimizer.lr=0.001`` for ``{"lr": 0.001}``)."""
    while isinstance(value, Mapping) and value:
        first = next(iter(value))
        key, value = f"{key}.{first}", value[first]
    return f"{key}={show(value)}"


def check_run_dir(folder: Any, key: str) -> None:
    """Refuse a run folder that is empty or is the current folder or the checkout: the run would write its
    ``.hydra/``, logs, checkpoints and model among the user's own files."""
    conf = conf_dir()
    fix = (f" Fix: leave {key} at its default (a new folder under outputs/), or name a folder of its own, e.g. "
           f"{key}=outputs/my-run")
    if folder is None or not str(folder).strip():
        raise UserError(f"{key} is empty, so the run would write into the current folder ({os.getcwd()}).{fix}")
    path = Path(os.path.expanduser(str(folder))).resolve()
    for place, what in ((Path.cwd().resolve(), "the current folder"),
                        (conf.parent.resolve() if conf else None, "the checkout, where train.py is")):
        if place is not None and path == place:
            raise UserError(f"{key}={folder} is {what} ({path}): the run would write among its files.{fix}")
    check_writable(folder, key)


def check_writable(folder: Any, key: str) -> None:
    """Refuse a run folder that cannot be made or written: below a file, or where this user may not write (a
    read-only file system, ``/proc``). Tried for real (a folder made and removed where the run folder would go),
    since permission bits do not tell, e.g. for root."""
    path = Path(os.path.expanduser(str(folder))).absolute()
    fix = f" Fix: a folder you may write to, e.g. {key}=outputs/my-run"
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == path else f"is below {existing}, which is a file"
        raise UserError(f"{key}={folder} {where}, not a folder.{fix}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rlhf-write-test-", dir=existing))
    except OSError as error:
        raise UserError(f"{key}={folder}: cannot write in {existing} ({error.strerror or error}).{fix}") from None


def uses_cpu(hardware: Mapping[str, Any]) -> bool:
    """Whether a ``hardware`` node trains on the CPU: ``device: cpu``, or ``auto`` where torch sees no GPU."""
    device = hardware.get("device", "auto")
    if device == "cpu":
        return True
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return False


def check_float16_on_cpu(config: Mapping[str, Any]) -> None:
    """Refuse ``model.dtype=float16`` on a CPU: float16 weights and optimizer updates there end in NaN."""
    model, hardware = config.get("model"), config.get("hardware")
    if not isinstance(model, Mapping) or not isinstance(hardware, Mapping):
        return
    if model.get("dtype") == "float16" and uses_cpu(hardware):
        device = hardware.get("device", "auto")
        where = "hardware.device=cpu" if device == "cpu" else f"hardware.device={device} and torch sees no GPU"
        raise UserError(f"model.dtype=float16 trains on the CPU here ({where}), where float16 weights turn to NaN "
                        "within a few steps. Fix: model.dtype=float32 (add hardware.mixed_precision=bf16 for "
                        "half-precision compute), or run on a GPU.")


def check_resume_changes(config: Mapping[str, Any]) -> None:
    """``resume_changes`` is a list of config keys (or one key): ``[train.max_steps,optimizer.lr]``."""
    value = config.get("resume_changes")
    items = [value] if isinstance(value, str) else value if isinstance(value, (list, tuple)) else None
    if value is not None and (items is None or not all(isinstance(k, str) and k for k in items)):
        raise UserError(f"resume_changes={show(value)} is not a list of config keys. Fix: e.g. "
                        "resume_changes=[train.max_steps] (the keys a resume may change on purpose).")
