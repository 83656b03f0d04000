"""rlhf: post-training language models (SFT, DPO, ...) with one Accelerate loop and Hydra configs."""

import logging as _logging


def _drop_kernels_notice(record: _logging.LogRecord) -> bool:
    """bitsandbytes, when imported on a CPU with AVX512-BF16, offers a faster 4-bit CPU kernel from the optional
    `kernels` package and warns on every run that it is not installed. rlhf uses bitsandbytes for its 8-bit
    optimizers only, never for 4-bit matmuls, so the notice means nothing here. Other bitsandbytes warnings show."""
    return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


# Installed before anything imports bitsandbytes (peft and transformers do); a filter sits on the logger object
# itself, which Hydra's logging configuration leaves in place.
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
