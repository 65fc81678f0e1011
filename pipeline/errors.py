"""Errors a user can act on. The CLI prints them without a traceback and exits with their code."""
from __future__ import annotations


class BatchgenError(Exception):
    exit_code = 1


class ConfigError(BatchgenError):
    """The job spec, an input file or the model is wrong (exit 1)."""

    exit_code = 1


class InputError(ConfigError):
    """Bad input data: names the file, row and column."""


class OutputError(BatchgenError):
    """The output path cannot be used or written (exit 1): names the path and what was kept."""

    exit_code = 1


class LockedError(BatchgenError):
    """Another run of the same job holds the lock (exit 3)."""

    exit_code = 3


class DiskFullError(OutputError):
    """No space left on the device, or over quota (exit 74, sysexits' EX_IOERR): names the path
    and the rows kept; rerun once there is room."""

    exit_code = 74


class Interrupted(BatchgenError):
    """Stopped by a signal after flushing finished rows; rerun to resume (exit 75)."""

    exit_code = 75


class Aborted(BatchgenError):
    """Ctrl-C twice: stopped at the next safe point without draining (exit 130); committed rows are kept."""

    exit_code = 130
