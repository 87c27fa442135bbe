"""The KilnError family: every expected mistake a user can make maps to one of these.

It lives in `runtime` because every package may import `runtime` and `runtime` imports
nothing of ours; compiler, quant and gates raise these too.

A message names the input (file, key or path), the problem, and the fix. The CLI prints
the message without a traceback and exits with the class's exit code.
"""

from __future__ import annotations


class KilnError(Exception):
    """Base class: an expected failure with a message meant for the user."""

    exit_code = 3

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UsageError(KilnError):
    """Bad command-line use or bad input: a recipe, a path, an option (exit 2)."""

    exit_code = 2


class SourceError(UsageError):
    """A model source that cannot be resolved or is not supported (exit 2)."""


class CalibrationDataError(UsageError):
    """Calibration data that is missing, empty or malformed (exit 2)."""


class PreflightError(UsageError):
    """A recipe that is valid YAML but cannot work on this model or machine (exit 2)."""


class VerdictFailure(KilnError):
    """A gate verdict that blocks promotion (exit 1)."""

    exit_code = 1


class StageFailure(KilnError):
    """A stage that failed while running: a library error, out of memory (exit 3)."""

    exit_code = 3


class ArtifactError(KilnError):
    """An artifact that is missing, malformed, or whose digests do not verify (exit 3)."""

    exit_code = 3
