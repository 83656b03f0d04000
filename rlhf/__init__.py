"""rlhf: post-training language models (SFT, DPO, ...) with one Accelerate loop and Hydra configs."""

from rlhf.loop import train

__all__ = ["train"]
__version__ = "0.1.0"
