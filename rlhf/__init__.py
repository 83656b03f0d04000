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

from rlhf import config as _config  # noqa: E402,F401  (registers the config resolvers)
from rlhf import logging as _logging_sinks  # noqa: E402,F401  (registers rlhf.sweep_group, the W&B group of a sweep)
from rlhf import slurm as _slurm  # noqa: E402,F401  (registers the launcher resolvers: rlhf.slurm_cpus, ...)
from rlhf.launch import train  # noqa: E402

__all__ = ["StepTrainer", "train"]


def __getattr__(name: str):
    """``rlhf.StepTrainer`` is imported on first use: it pulls in the loop, the data and model modules, which
    ``train.py --help`` and a sweep's parent process never need."""
    if name == "StepTrainer":
        from rlhf.step_trainer import StepTrainer

        return StepTrainer
    raise AttributeError(f"module 'rlhf' has no attribute {name!r}")
__version__ = "0.1.0"
