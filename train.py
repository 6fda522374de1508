"""trainflow's entry point in a checkout: `python train.py [group=option ...] [key=value ...]` (installed, the same
is `trainflow train ...` from any folder)."""

import hydra
from omegaconf import DictConfig

from trainflow.cli import register_with_hydra, run_from_hydra
from trainflow.conf import CONFIG_PATH

register_with_hydra()  # before @hydra.main composes the config


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="train")
def main(cfg: DictConfig) -> float | None:
    return run_from_hydra(cfg)


if __name__ == "__main__":
    main()
