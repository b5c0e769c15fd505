"""Exception types of wna16ctl.

Every error carries one line that names the file or tensor at fault and, where one exists, the fix.
The CLI prints that line to stderr and exits with the error's code; nothing here prints.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # the checkpoint would not load / the output did not verify
EXIT_BAD_INPUT = 2  # unusable input or usage
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as a shell reports a process stopped by it)


class WnaError(Exception):
    """Base class: a one-line, user-facing message and an exit code."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class BadInput(WnaError):
    """The checkpoint (or another input file) is missing, corrupt or contradicts itself."""


class UsageError(WnaError):
    """Options that cannot work together, or an output location that must not be touched."""


class OutputError(WnaError):
    """Writing the output failed (disk full, permission denied, ...); nothing was left behind."""


class LayoutMismatch(WnaError):
    """A repacked tensor does not invert back to the checkpoint (verify's bit-exact check)."""

    exit_code = EXIT_FAILED


class NotLoadable(WnaError):
    """The planner says the checkpoint cannot be produced/loaded in the requested configuration."""

    exit_code = EXIT_FAILED
    settings: dict | None = None  # the repack settings refused, when a repack plan refused them
