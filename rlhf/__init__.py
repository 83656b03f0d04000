"""rlhf: post-training language models (SFT, DPO, ...) with one Accelerate loop and Hydra configs."""

import logging as _logging


def _drop_kernels_notice(record: _logging.LogRecord) -> bool:
    """bitsandbytes 0.50, when imported on a CPU with AVX-512 BF16, looks for a faster 4-bit CPU kernel on the Hugging
    Face Hub through the optional ``kernels`` package, and warns on every import that the package is not installed.
    Without it nothing is fetched and bitsandbytes' own CPU path runs its 4-bit layers (QLoRA's; the 8-bit optimizers
    and LLM.int8() never use that kernel), so this one notice is dropped. With ``kernels`` installed, bitsandbytes asks
    the Hub at import (``HF_HUB_OFFLINE=1`` stops it) and any failure of that still shows, as do its other warnings."""
    return "No module named 'kernels'" not in record.getMessage()


# Installed before anything imports bitsandbytes (peft and transformers do; a tool that imports them first imports
# rlhf before them); a filter sits on the logger object itself, which Hydra's logging configuration leaves in place.
_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_drop_kernels_notice)

from rlhf import old_paths as _old_paths  # noqa: E402

_old_paths.install()  # rlhf.loop, rlhf.logging, ...: the module paths from before the layer packages still import

from rlhf.config import checks as _config  # noqa: E402,F401  (registers the config resolvers)
from rlhf.core import VERSION as __version__  # noqa: E402,F401
from rlhf.launch import slurm as _slurm  # noqa: E402,F401  (registers the launcher resolvers: rlhf.slurm_cpus, ...)
from rlhf.launch.processes import train  # noqa: E402
from rlhf.telemetry import loggers as _logging_sinks  # noqa: E402,F401  (registers rlhf.sweep_group, the W&B group of a sweep)

__all__ = ["StepTrainer", "train"]


def __getattr__(name: str):
    """``rlhf.StepTrainer`` is imported on first use: it pulls in the loop, the data and model modules, which
    ``train.py --help`` and a sweep's parent process never need."""
    if name == "StepTrainer":
        from rlhf.launch.step_trainer import StepTrainer

        return StepTrainer
    raise AttributeError(f"module 'rlhf' has no attribute {name!r}")
