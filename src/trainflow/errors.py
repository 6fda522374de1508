"""Errors a user can fix: printed as one sentence, without a traceback, with the exit code that says so.

Imports nothing of trainflow, so that every module (and the Hydra plugins) can raise or print these.
"""

import os
import sys
from pathlib import Path
from typing import NoReturn

EXIT_USER_ERROR = 2
# A command line that names a key, option or group no config has, or a value not of its key's type: nothing ran.
# Exit 1 as Hydra exits for a command line it rejects, whether Hydra or trainflow found it (README: exit codes).
EXIT_COMMAND_LINE = 1
EXIT_INTERRUPTED = 130  # the shell's code for a process ended by Ctrl-C (128 + SIGINT)


class TrainflowError(Exception):
    """A problem with the user's input or environment, explained in one line with the fix."""

    exit_code = EXIT_USER_ERROR  # the command cannot work as typed


class ConfigError(TrainflowError):
    """A config value that cannot work; the message starts with the key."""


class UnknownKeyError(ConfigError):
    """A key that no schema has and no `_target_` of yours takes, however it was given (`key=`, `+key=`, `++key=`,
    an experiment file): one kind, one exit code, Hydra's for its own "Could not override"."""

    exit_code = EXIT_COMMAND_LINE


class DataError(TrainflowError):
    """Missing, empty or too-short data."""


class RunDirError(TrainflowError):
    """The run directory stopped taking writes (a full disk, a lost mount); the message names it and the fix."""


class CheckpointError(TrainflowError):
    """A checkpoint that cannot be written, read or used; the message names its path and the fix."""


class StageError(TrainflowError):
    """A stage of the config's `stages` list raised; the message names the stage, its hook and the step."""

    exit_code = 1  # the run failed; what it committed stays


class ReceivedFileError(TrainflowError):
    """A file of a run folder, ledger or checkpoint that is not what trainflow writes there (not a regular file, too
    large, of the wrong shape); the message names the file, and the field where one is wrong."""


class NonFiniteError(TrainflowError):
    """Training produced a non-finite loss or gradient norm; the message names the step and the way out."""


def unwritable_reason(folder: Path, exc: OSError) -> str:
    """Why `folder` could not be written, in words: a file standing where a folder must be, or the system's reason."""
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    return f"{blocker} is a file, not a folder" if blocker else exc.strerror or str(exc)


def home_note(configured: str) -> str:
    """For a configured path starting with ~: which home it expanded to (HOME may be the thing to fix)."""
    return f" (~ is HOME={Path.home()})" if configured.startswith("~") else ""


def typed_command() -> str:
    """The command this process was started as, for a message to quote back: `python train.py` in a checkout,
    `python -m trainflow train`, else the installed `trainflow train`."""
    started_as = Path(sys.argv[0]).name if sys.argv else ""
    return {"train.py": "python train.py", "__main__.py": "python -m trainflow train"}.get(started_as,
                                                                                            "trainflow train")


def traceback_wanted() -> bool:
    """HYDRA_FULL_ERROR=1: re-raise user errors with their traceback, as Hydra does for its own."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def print_error(message: str) -> None:
    """Write `Error: message` in one write: ranks that fail alike share one stderr, and print's two writes (text,
    then newline) let their lines run into each other."""
    sys.stderr.write(f"Error: {message}\n")
    sys.stderr.flush()


def user_error(message: str) -> NoReturn:
    """Stop with one line and exit code 2, as trainflow does for every input a user can fix."""
    if traceback_wanted():
        raise ConfigError(message)
    print_error(message)
    sys.exit(EXIT_USER_ERROR)
