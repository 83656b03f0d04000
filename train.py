"""Entry point: compose the config with Hydra, then run `rlhf.train(cfg)`. See README.md and `--help`."""

import logging
import sys

import hydra
from omegaconf import DictConfig

from rlhf import train
from rlhf.errors import UserError


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    try:
        metrics = train(cfg)
    except UserError as error:  # a problem with the input: one message, no traceback
        logging.getLogger("rlhf").error("error: %s", error)
        sys.exit(1)
    return metrics.get("eval/loss")


if __name__ == "__main__":
    main()
