"""How a run that stops says so: one line naming what was kept (the last checkpoint) and how to go on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from shaky.errors import Stop
from shaky.interrupt import Stopped
from shaky.job.env import JobEnv
from shaky.rundir import CHECKPOINT_FILE, WriteError, load_checkpoint


@contextlib.contextmanager
def stopping(run_dir: Path, command: str, *, writer: bool = True, fresh: bool = False) -> Iterator[None]:
    """Turns a run that stops early into one line saying what was kept and how to go on (see shaky.interrupt).
    ``fresh``: this process made ``run_dir``; stopped at once before it wrote a file there, the empty directory is
    removed again (nothing was written, and the same command can be run again)."""
    local = run_dir if writer else None     # a rank > 0 says where rank 0's checkpoint is, not what it sees here
    try:
        yield
    except Stopped as exc:
        raise Stop(f"{exc}; `{command} --resume {run_dir}` continues from there and ends as the uninterrupted "
                   "run would" if writer else "", exc.exit_code) from None
    except KeyboardInterrupt:
        if fresh and writer and _remove_if_empty(run_dir):
            raise Stop("interrupted at once, before the run wrote anything", 130) from None
        raise Stop(f"interrupted at once; last checkpoint: {checkpoint_note(run_dir, command, local)}", 130) from None
    except WriteError as exc:
        raise Stop(f"error: {exc}; last checkpoint: {checkpoint_note(run_dir, command, local)}", 1) from None


def launcher(env: JobEnv) -> str:
    """What started this rank: ``shaky launch`` or torchrun."""
    return "shaky launch" if dist_command(env).startswith("shaky launch") else "torchrun"


def dist_command(env: JobEnv) -> str:
    """How a rank's command line is written in the lines that say how to go on."""
    return env.launched_by or "torchrun ... -m shaky train"


def checkpoint_note(run_dir: Path, command: str, local: Path | None = None) -> str:
    """Where the last checkpoint is, and how to resume. ``local``: the run directory as this process may read it
    (default ``run_dir``); None on a machine other than rank 0's, which may have no copy of it, or a stale one."""
    if local is None:
        return f"rank 0's, on its machine; resume with `{command} --resume {run_dir}`"
    path = local / CHECKPOINT_FILE
    if not path.exists():
        return f"none yet (`{command} --resume {run_dir}` starts the run again from step 0)"
    try:
        step = load_checkpoint(local)["counters"]["step"]
    except ValueError as exc:
        return f"none usable ({exc})"
    return f"{path} at step {step}; resume with `{command} --resume {run_dir}`"


def _remove_if_empty(run_dir: Path) -> bool:
    try:
        run_dir.rmdir()     # only an empty directory goes
    except OSError:
        return False
    return True
