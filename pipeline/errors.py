"""Errors a user can act on. The CLI prints them without a traceback and exits with their code."""
from __future__ import annotations


class BatchgenError(Exception):
    exit_code = 1


class ConfigError(BatchgenError):
    """The job spec, an input file or the model is wrong (exit 1)."""

    exit_code = 1


class InputError(ConfigError):
    """Bad input data: names the file, row and column."""


class LockedError(BatchgenError):
    """Another run of the same job holds the lock (exit 3)."""

    exit_code = 3


class Interrupted(BatchgenError):
    """Stopped by a signal after flushing finished rows; rerun to resume (exit 75)."""

    exit_code = 75
