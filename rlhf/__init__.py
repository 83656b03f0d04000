"""rlhf: post-training language models (SFT, DPO, ...) with one Accelerate loop and Hydra configs."""

from rlhf import config as _config  # noqa: F401  (registers the config resolvers)
from rlhf import slurm as _slurm  # noqa: F401  (registers the launcher resolvers: rlhf.slurm_cpus, ...)
from rlhf.launch import train

__all__ = ["train"]
__version__ = "0.1.0"
