"""The `trainflow` command and `python -m trainflow`: `trainflow train --help` answers here, before anything heavy
loads; every other command goes to trainflow.cli."""

from __future__ import annotations

import sys

from trainflow.config.help import help_requested, print_help


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"] and help_requested(argv[1:]):
        print_help(argv[1:])
        return
    from trainflow.cli import main as cli_main  # torch and Hydra's composition: only for a command that needs them

    cli_main(argv)


if __name__ == "__main__":
    main()
