"""trainflow's entry point: `python train.py [group=option ...] [key=value ...]`."""

import hydra
from omegaconf import DictConfig

import trainflow  # noqa: F401  (registers the config schemas and resolvers)
from trainflow.cli import run_from_hydra


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return run_from_hydra(cfg)


if __name__ == "__main__":
    main()
