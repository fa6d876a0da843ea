"""What a command reports in one line: bad input (status 2) and a command that ends early (its own status).

No torch here: every command, ``shaky launch`` and ``shaky --version`` included, imports it."""

from __future__ import annotations


class BadInput(Exception):
    """User input the CLI reports in one line with exit status 2."""


class AloneBadInput(BadInput):
    """Bad input of one process alone (a rank started again for a dead one): it says it itself, whatever its
    rank."""


class Stop(Exception):
    """A command that ends early on purpose or for want of room, with its one line and exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code
