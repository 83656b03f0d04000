"""Module paths from before the layer packages, kept importable: a ``_target_`` in a user's own YAML
(``rlhf.logging.JsonlLogger``, ``rlhf.rewards.exact_match``, ``rlhf.models.tiny.TinySpec``), a script's
``from rlhf.loop import ...``, a pickle that names an old module.

:class:`OldPaths` (installed by ``import rlhf``) answers an import of an old module name with the module that
holds its code now, the same object, and warns once with the new path (a ``FutureWarning``: the old names go in a
later release). ``rlhf.config`` and ``rlhf.launch`` are packages now: their ``__getattr__`` resolves the old
module's names (``rlhf.config.CheckBeforeRun``, ``rlhf.launch.train``) through :func:`attribute`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

# old module -> the module that holds its code now
MOVED = {
    "rlhf.errors": "rlhf.core.errors",
    "rlhf.validate": "rlhf.core.limits",
    "rlhf.state": "rlhf.core.train_state",
    "rlhf.files": "rlhf.core.file_io",
    "rlhf.hub": "rlhf.core.hub",
    "rlhf.algos.token_logps": "rlhf.ops.token_logps",
    "rlhf.models.output_layer": "rlhf.ops.output_layer",
    "rlhf.models.tiny": "rlhf.embedded.tiny_model",
    "rlhf.logging": "rlhf.telemetry.loggers",
    "rlhf.metrics": "rlhf.telemetry.metrics",
    "rlhf.perf": "rlhf.telemetry.mfu",
    "rlhf.profiling": "rlhf.telemetry.profiling",
    "rlhf.memory": "rlhf.telemetry.memory_preflight",
    "rlhf.loop": "rlhf.run.loop",
    "rlhf.built_run": "rlhf.run.components",
    "rlhf.checkpoint": "rlhf.run.checkpoint",
    "rlhf.resume_check": "rlhf.run.resume_check",
    "rlhf.run_folder": "rlhf.run.folder",
    "rlhf.signals": "rlhf.run.signals",
    "rlhf.nonfinite": "rlhf.run.nonfinite",
    "rlhf.settings": "rlhf.run.train_settings",
    "rlhf.sweep": "rlhf.sweeps.points",
    "rlhf.search": "rlhf.sweeps.search",
    "rlhf.results": "rlhf.sweeps.results",
    "rlhf.report": "rlhf.sweeps.report",
    "rlhf.report_plots": "rlhf.sweeps.plots",
    "rlhf.trl_names": "rlhf.config.trl_names",
    "rlhf.command_line": "rlhf.config.command_line",
    "rlhf.launchers": "rlhf.launch.sweep_launchers",
    "rlhf.slurm": "rlhf.launch.slurm",
    "rlhf.step_trainer": "rlhf.launch.step_trainer",
    "rlhf.rewards": "rlhf.algos.reward_funcs",
}
# old modules whose name is a package now -> the modules their names live in, searched in order
BECAME_PACKAGES = {
    "rlhf.config": ("rlhf.config.checks", "rlhf.core.instantiate"),
    "rlhf.launch": ("rlhf.launch.processes",),
}
_warned: set[str] = set()


def _warn(old: str, new: str, stacklevel: int) -> None:
    if old not in _warned:
        _warned.add(old)
        warnings.warn(f"{old} is now {new}; the old path works for now and goes in a later release",
                      FutureWarning, stacklevel=stacklevel)


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the import system set the old name's spec on the shared module object


class OldPaths(importlib.abc.MetaPathFinder):
    """Imports an old module name as the module that holds its code now (see the module docstring)."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        _warn(fullname, new, stacklevel=3)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def attribute(package: str, name: str):
    """``package.name`` for a name of the module ``package`` was before it became a package; AttributeError as
    Python would raise it otherwise."""
    for module in BECAME_PACKAGES.get(package, ()):
        value = getattr(importlib.import_module(module), name, _missing)
        if value is not _missing:
            _warn(f"{package}.{name}", f"{module}.{name}", stacklevel=4)
            return value
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


_missing = object()


def install() -> None:
    """Put :class:`OldPaths` on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(OldPaths())
