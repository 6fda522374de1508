"""Errors a user can fix: printed as one sentence, without a traceback."""


class TrainflowError(Exception):
    """A problem with the user's input or environment, explained in one line with the fix."""

    exit_code = 2  # the usage-error code: the command cannot work as typed


class ConfigError(TrainflowError):
    """A config value that cannot work; the message starts with the key."""


class DataError(TrainflowError):
    """Missing, empty or too-short data."""


class CheckpointError(TrainflowError):
    """A checkpoint that cannot be written, read or used; the message names its path and the fix."""


class NonFiniteError(TrainflowError):
    """Training produced a non-finite loss or gradient norm; the message names the step and the way out."""
