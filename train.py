"""trainflow's entry point in a checkout: `python train.py [group=option ...] [key=value ...]`; installed, the same
command is `trainflow train ...`, from any folder."""

import sys

from trainflow.__main__ import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])
