"""Errors a user can fix: printed as one sentence, without a traceback."""

from pathlib import Path


class TrainflowError(Exception):
    """A problem with the user's input or environment, explained in one line with the fix."""

    exit_code = 2  # the usage-error code: the command cannot work as typed


class ConfigError(TrainflowError):
    """A config value that cannot work; the message starts with the key."""


class DataError(TrainflowError):
    """Missing, empty or too-short data."""


class RunDirError(TrainflowError):
    """The run directory stopped taking writes (a full disk, a lost mount); the message names it and the fix."""


class CheckpointError(TrainflowError):
    """A checkpoint that cannot be written, read or used; the message names its path and the fix."""


class NonFiniteError(TrainflowError):
    """Training produced a non-finite loss or gradient norm; the message names the step and the way out."""


def unwritable_reason(folder: Path, exc: OSError) -> str:
    """Why `folder` could not be written, in words: a file standing where a folder must be, or the system's reason."""
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    return f"{blocker} is a file, not a folder" if blocker else exc.strerror or str(exc)


def home_note(configured: str) -> str:
    """For a configured path starting with ~: which home it expanded to (HOME may be the thing to fix)."""
    return f" (~ is HOME={Path.home()})" if configured.startswith("~") else ""
