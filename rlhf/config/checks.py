"""Checks on the composed config that turn mistakes into one clear message before anything is built.

:func:`check_config` is the one entry point, run once per process: by :class:`CheckBeforeRun` for ``train.py``
(before Hydra makes the run folder), by ``rlhf.train`` for a sweep's job or a Python caller; never by the ranks a
run starts (they receive the checked config). It raises :class:`rlhf.core.errors.UserError` naming the key as the user
types it and the fix for:

- a top-level key ``conf/config.yaml`` does not define (``+optimiser=lion``), and a run folder that is empty, the
  current folder or the checkout (``hydra.run.dir=``);
- in every node with a ``_target_``: a field the target does not take, a value of the wrong type for an annotated
  ``int``/``float``/``bool``/``str`` argument (``algo.beta=abc``), a list where one value belongs (a sweep written
  ``[0.1,0.2]``), and a value outside its range: the target's own :func:`rlhf.core.limits.limits`, or for optimizers
  and schedulers the limits their group shares (:data:`GROUP_LIMITS`, from :mod:`rlhf.optim`);
- NaN or infinity anywhere; ``model.dtype=float16`` on a CPU; ``model.attn_implementation=flex_attention`` where torch
  cannot train through it; a ``resume_changes`` that is not a list of keys.
- an ``objective`` whose metric the run does not report (:func:`rlhf.sweeps.points.check_objective`);
- a reference strategy that needs the policy's LoRA adapter (``algo/reference=adapter``, ``ref_adapter``) with
  ``peft=none``;
- the algorithm's options against the rest of the run (its ``check_run``: e.g. an online algorithm's rollout that
  does not split into ``steps_per_generation`` micro-batches);
- an optimizer that needs whole matrices (``optimizer=muon``) under a sharding strategy (``hardware=fsdp``,
  ``zero1``-``zero3``).
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import difflib
import functools
import hashlib
import inspect
import logging
import os
import sys
import types
import typing
from collections.abc import Callable
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

from rlhf import optim
from rlhf.config.optimizer_hardware import check_optimizer_with_hardware
from rlhf.config.reward_fit import check_rewards_fit_the_data
from rlhf.config.signatures import signature_of
from rlhf.core import limits as validate
from rlhf.core.errors import UserError
from rlhf.run import folder as run_folder
from rlhf.run.train_settings import TOP_LEVEL_LIMITS, TrainSettings
from rlhf.sweeps import points as sweep

# Limits shared by every target of a config group, by argument name (the targets are third-party classes).
GROUP_LIMITS = {"optimizer": optim.OPTIMIZER_LIMITS, "scheduler": optim.SCHEDULER_LIMITS}

_SCALARS = (bool, int, float, str, type(None))


def short_name(text: str, limit: int = 96) -> str:
    """`text` if it fits in `limit` characters, else its start plus a hash of the whole (for folder names)."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 9]}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


# ${rlhf.short:...} in conf/config.yaml keeps multirun folder names under the file-system limit.
OmegaConf.register_new_resolver("rlhf.short", short_name, replace=True)


def _allowed_types(annotation: Any) -> tuple[type, ...] | None:
    """The plain types an annotation admits, or None when it is not a simple scalar annotation."""
    if annotation in _SCALARS:
        return (annotation,)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if all(isinstance(a, type) for a in args) and any(a in _SCALARS[:-1] for a in args):
            return args
    return None


def _takes_a_function(annotation: Any) -> bool:
    """Whether an annotation is a function's (``Callable``, ``Callable | None``): a config gives it as a node."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_takes_a_function(a) for a in typing.get_args(annotation))
    return annotation is collections.abc.Callable or typing.get_origin(annotation) is collections.abc.Callable


def _matches(value: Any, allowed: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int) and float in allowed:
        return True
    return isinstance(value, allowed)


def check_fields(values: dict[str, Any], target: Callable, where: str, nullable: set[str] = frozenset()) -> None:
    """Raise UserError if `values` has a field `target` does not accept, or a scalar of the wrong type. A field in
    `nullable` may be null whatever its annotation (rlhf gives that null a meaning: :attr:`rlhf.core.limits.Range.null`)."""
    found = signature_of(target)
    if found is None:
        return
    signature, hints = found
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key, value in values.items():
        if key.startswith("_"):
            continue
        name = f"{where}.{key}" if where else key
        if key not in params:
            if not takes_any:
                names = [k for k, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
                near = difflib.get_close_matches(key, names, n=1)
                fields = (f"Fix: {where + '.' if where else ''}{near[0]} (the field it resembles). " if near else "") + (
                    f"Valid fields: {', '.join(names)}." if names else f"It takes none. Fix: leave {name} out.")
                raise UserError(f"{name}: {target.__module__}.{target.__qualname__} has no argument {key!r}. {fields}")
            continue
        if _takes_a_function(hints.get(key)) and value is not None and not isinstance(value, dict):
            function = value if isinstance(value, str) else "<module.function>"
            raise UserError(f"{name}={value!r}: {target.__qualname__} takes a function for {key!r}, not a "
                            f"{type(value).__name__}. Fix: '{name}={{_target_:{function},_partial_:true}}' (the "
                            "function, built by Hydra; quoted for the shell)")
        allowed = _allowed_types(hints.get(key, inspect.Parameter.empty))
        if allowed is None or (value is None and key in nullable):
            continue
        expected = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
        if isinstance(value, (dict, list)):
            if not _matches(value, allowed):  # most often a sweep written as a list: algo.beta=[0.1,0.2]
                one = " or ".join(t.__name__ for t in allowed if t in _SCALARS[:-1])
                raise UserError(validate.sweep_message(name, value, one))
            continue
        if not _matches(value, allowed):
            default = params[key].default
            example = f" Fix: e.g. {name}={default}" if default not in (inspect.Parameter.empty, None) else ""
            raise UserError(f"{name}={value!r} is a {type(value).__name__}, but {target.__qualname__} expects "
                            f"{expected} for {key!r}.{example}")


def check_config(cfg: DictConfig) -> None:
    """Check `cfg` as a whole, then every ``_target_`` node (recursively); see the module docstring."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:  # ``???`` in a YAML: a value the option cannot guess
        raise UserError(f"{', '.join(missing)}: no value (the option's YAML leaves it to you: ???). Fix: add "
                        + " ".join(f"{key}=<value>" for key in missing) + " to the command.")
    try:
        container = OmegaConf.to_container(cfg, resolve=True)
    except Exception as error:  # an interpolation that cannot resolve
        raise UserError(f"config: {error}") from error
    validate.check_top_level(container)
    validate.check_limits(container, None, "", TOP_LEVEL_LIMITS)
    if "output_dir" in container:
        validate.check_run_dir(container["output_dir"], "output_dir")
    if isinstance(container.get("train"), dict):  # first: the schedule's length and others derive from train.*
        check_fields(container["train"], TrainSettings, "train")
        validate.check_limits(container["train"], TrainSettings, "train")
    _walk(container, "")
    validate.check_float16_on_cpu(container)
    _check_attention(container)
    validate.check_resume_changes(container)
    _check_data_columns(container)
    _check_peft(container)
    _check_algorithm_with_run(container)
    check_optimizer_with_hardware(container)
    check_rewards_fit_the_data(container)
    sweep.check_objective(container)


def _check_data_columns(container: dict) -> None:
    """The data's columns against the algorithm's, before anything loads: a data source that can tell them
    cheaply (``check_columns``, e.g. from a local file's first row) refuses a file without them."""
    algo, data = container.get("algo"), container.get("data")
    if not (isinstance(algo, dict) and isinstance(data, dict)):
        return
    columns = getattr(get_object(algo["_target_"]), "columns", ()) if "_target_" in algo else ()
    check = getattr(get_object(data["_target_"]), "check_columns", None) if "_target_" in data else None
    if columns and check is not None:
        check(data, columns)


def _check_algorithm_with_run(container: dict) -> None:
    """The algorithm's options against the rest of the config (:meth:`rlhf.algos.base.Algorithm.check_run`)."""
    algo = container.get("algo")
    if isinstance(algo, dict) and "_target_" in algo:
        check = getattr(get_object(algo["_target_"]), "check_run", None)
        if check is not None:
            check(algo, container)


def _check_attention(container: dict) -> None:
    """Flex attention where torch cannot train through it, before anything loads
    (:func:`rlhf.models.attention.check_trains`; imported only when asked for)."""
    model = container.get("model")
    if isinstance(model, dict) and model.get("attn_implementation") == "flex_attention":
        from rlhf.models.attention import check_trains

        check_trains(model, container.get("hardware") or {})


def _check_peft(container: dict) -> None:
    """The peft option against the reference strategy, before anything loads
    (:func:`rlhf.models.adapters.check_combination`)."""
    from rlhf.models.adapters import check_combination

    def target(node: Any) -> Any:
        return get_object(node["_target_"]) if isinstance(node, dict) and "_target_" in node else None

    algo = container.get("algo") if isinstance(container.get("algo"), dict) else {}
    check_combination(target(container.get("peft")), target(algo.get("reference")))


def _with_option_defaults(shared: dict[str, validate.Range] | None, group: str,
                          target: str) -> dict[str, validate.Range] | None:
    """A group's shared limits with each fix taken from the defaults of the group's option that builds `target`
    (``conf/optimizer/sgd.yaml``'s ``lr: 3.0e-2`` for ``torch.optim.SGD``), where there is exactly one such value:
    a learning rate that suits Adam is no fix for SGD."""
    if not shared:
        return shared
    defaults = _option_defaults(group, target)
    return {name: dataclasses.replace(allowed, fix=defaults[name]) if name in defaults else allowed
            for name, allowed in shared.items()}


@functools.lru_cache(maxsize=64)
def _option_defaults(group: str, target: str) -> dict[str, Any]:
    """The values that every option of `group` building `target` agrees on (usually one option)."""
    folder = validate.conf_dir()
    found: list[dict] = []
    for path in sorted((folder / group).glob("*.yaml")) if folder is not None else ():
        try:
            node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        except Exception:  # not ours to judge here: Hydra reports a broken file
            continue
        if isinstance(node, dict) and node.get("_target_") == target:
            found.append(node)
    return {k: v for k, v in found[0].items() if all(other.get(k) == v for other in found)} if found else {}


@contextlib.contextmanager
def _quiet(logger: logging.Logger):
    """``logger``'s messages below CRITICAL dropped for the block."""
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _not_importable(where: str, target: str, error: Exception) -> str:
    """Why ``target`` cannot be imported, and the fix: a module of the user's own is importable from the folder
    ``train.py`` runs in, or from ``PYTHONPATH``."""
    cause = error.__cause__ or error
    if isinstance(cause, ModuleNotFoundError) and cause.name:
        from rlhf.optim.support import missing_library

        library = missing_library(cause.name.split(".")[0], f"{where}._target_={target}")
        if library is not None:
            return library
    if isinstance(cause, ModuleNotFoundError) and cause.name == target.split(".")[0]:  # no such top-level module
        return (f"{where}._target_={target}: no module named {cause.name!r}. A module of your own (e.g. {cause.name}"
                f".py with the function) is importable from the folder you run train.py in (now {os.getcwd()}) or "
                f"from a folder on PYTHONPATH. Fix: run from the folder that holds it, or PYTHONPATH=<that folder> "
                f"python train.py ...; a package: pip install it")
    return (f"{where}._target_={target}: cannot import it ({str(cause).strip()}). Fix: check the name (module.function"
            f" or module.Class), or install the package that provides it.")


def _walk(node: Any, where: str) -> None:
    if isinstance(node, dict):
        target = node.get("_target_")
        if isinstance(target, str):
            try:
                with _quiet(logging.getLogger("hydra.utils")):  # which logs the error: ours is the one message
                    obj = get_object(target)
            except Exception as error:
                raise UserError(_not_importable(where, target, error)) from error
            shared = _with_option_defaults(GROUP_LIMITS.get(where), where, target)
            ranges = {**(shared or {}), **getattr(obj, "__limits__", {})}
            # optimizer.partition is the run's (rlhf.optim.partition.from_config), not the optimizer's argument
            own = {k: v for k, v in node.items() if not (where == "optimizer" and k == "partition")}
            check_fields(own, obj, where, nullable={k for k, r in ranges.items() if r.null})
            validate.check_limits(node, obj, where, shared)
            if isinstance(inspect.getattr_static(obj, "check_options", None), staticmethod):
                obj.check_options(node, where)  # a component's own check of its values, before it is built
        for key, value in node.items():
            _walk(value, f"{where}.{key}" if where else str(key))
    elif isinstance(node, (list, ListConfig)):
        for i, value in enumerate(node):
            _walk(value, f"{where}[{i}]")
    else:
        validate.check_finite(where, node)


# --- before Hydra makes the run folder ---------------------------------------------------------------------------
try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - Hydra is a dependency
    Callback = object  # type: ignore[misc,assignment]


class CheckBeforeRun(Callback):
    """Hydra callback: check the composed config before Hydra creates the run (or sweep) folder, so that a bad
    command line stops with one message and leaves no folder behind.

    A single run is checked here, once: ``train.py`` then calls :func:`rlhf.launch.processes.run`, which does not check again
    (:func:`checked_by_callback`). The jobs of a sweep differ from the sweep's base config, so each is checked in
    its own process, by :func:`rlhf.launch.processes.train`."""

    checked_run = False  # this process's single run was checked by on_run_start

    def on_run_start(self, config, **kwargs: Any) -> None:
        self._check(config, "hydra.run.dir")
        CheckBeforeRun.checked_run = True
        folder = os.path.abspath(os.path.expanduser(str(OmegaConf.select(config, "hydra.run.dir"))))
        first = folder
        while not os.path.lexists(os.path.dirname(first)) and os.path.dirname(first) != first:
            first = os.path.dirname(first)
        run_folder.made_by_hydra(None if os.path.lexists(folder) else (folder, first))

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        self._check(config, "hydra.sweep.dir")

    @staticmethod
    def _check(config, dir_key: str) -> None:
        from hydra.core.hydra_config import HydraConfig

        try:
            folder = OmegaConf.select(config, dir_key)
            validate.check_run_dir(folder, dir_key)
            HydraConfig.instance().set_config(config)  # ${hydra:...} resolves; Hydra sets it again for the job
            job = OmegaConf.to_container(config, resolve=False)
            job.pop("hydra", None)
            if str(job.get("output_dir", "")).startswith("${hydra:"):  # the default: the run folder, which Hydra
                job["output_dir"] = os.path.abspath(str(folder))  # fills in later; a value the user gave is checked
            job = OmegaConf.create(job)
            check_config(job)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(1)


def checked_by_callback() -> bool:
    """Whether :class:`CheckBeforeRun` has checked this process's single run (the same config the job gets)."""
    return CheckBeforeRun.checked_run
