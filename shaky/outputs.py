"""Where a command may write: checks that name the flag and the path in one line (BadInput) before anything is
written. No torch here."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from shaky.errors import BadInput


def no_file_below(flag: str, path: Path) -> None:
    blocker = next((p for p in [path, *path.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise BadInput(f"{flag} {str(path)!r} cannot be created: {str(blocker)!r} is a file")


def check_writable(flag: str, path: Path, *, directory: bool) -> None:
    """BadInput unless files can be written at ``path`` (a directory, or a file that may replace one there).

    Permission bits do not tell (root ignores them; a read-only mount or /proc does not), so this tries:
    it creates what is missing of the directory and a probe file in it, then removes all of it again,
    leaving the file system as it was.
    """
    no_file_below(flag, path if directory else path.parent)
    if not directory and path.is_dir():
        raise BadInput(f"{flag} {str(path)!r} is a directory; name a file")
    folder = path if directory else path.parent
    created: list[Path] = []
    try:
        for p in reversed([folder, *folder.parents]):
            if not p.exists():
                p.mkdir()
                created.append(p)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".shaky-probe-")
        os.close(fd)
        os.unlink(probe)
        if not directory and path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise BadInput(f"{flag} {str(path)!r} cannot be written: {exc.strerror or exc}") from None
    finally:
        for p in reversed(created):
            p.rmdir()
