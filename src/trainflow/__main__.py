"""`python -m trainflow train ...` (and the other `trainflow` commands), for environments without the console script."""

from trainflow.cli import main

main()
