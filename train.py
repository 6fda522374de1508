"""trainflow's entry point: `python train.py [group=option ...] [key=value ...]`."""

import sys

import hydra
from omegaconf import DictConfig

from trainflow.cli import check_config_dir, register_with_hydra, run_from_hydra

register_with_hydra()  # before @hydra.main composes the config


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return run_from_hydra(cfg)


if __name__ == "__main__":
    check_config_dir(sys.argv[1:])  # a broken YAML file of one's own is one line, not Hydra's traceback
    main()
