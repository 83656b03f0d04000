"""Entry point: compose the config with Hydra, then run `rlhf.train(cfg)`. See README.md and `--help`."""

import logging
import os
import sys

import hydra
from omegaconf import DictConfig

from rlhf import train
from rlhf.errors import UserError
from rlhf.launch import hydra_overrides_for_this_rank


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    try:
        metrics = train(cfg)
    except UserError as error:  # a problem with the input: one message, no traceback
        logging.getLogger("rlhf").error("error: %s", error)
        if "SUBMITIT_EXECUTOR" in os.environ:  # a submitit job (launcher=slurm, submitit_local): Hydra hands the
            raise  # error to the sweep, which raises it where the sweep was started; an exit would read as a crash
        sys.exit(1)
    return metrics.get("eval/loss")


if __name__ == "__main__":
    sys.argv += hydra_overrides_for_this_rank()  # under torchrun, only rank 0 writes .hydra/ and train.log
    main()
