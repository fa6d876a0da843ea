"""A simulator run in this process: its directory claimed, and its signals watched from then until its summary is
written, so that a stop at any moment after the claim ends after a step with a checkpoint (or the run finishes
and says so), and never leaves a directory half made."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from shaky.errors import BadInput
from shaky.interrupt import SignalWatch, ended
from shaky.job import checks
from shaky.job.env import JobEnv
from shaky.job.stop import stopping
from shaky.progress import say
from shaky.rundir import BadCheckpoint
from shaky.train import train


def train_here(env: JobEnv, setup: Any, run_dir: Path, *, resume: bool, quiet: bool) -> dict[str, Any]:
    """Trains ``setup`` into ``run_dir`` (resumed: from its checkpoint) and returns the summary. A signal that comes
    while the directory is made is kept for the loop, which stops after its first step with a checkpoint; one
    that comes once the last step is done lets the run finish, and is said."""
    with SignalWatch(announce=not quiet) as signals:
        checks.claim_run_dir(run_dir, resume=resume)
        setup.machines = {0: checks.read_here(setup, run_dir, resume=resume)}
        with stopping(run_dir, "shaky train", fresh=not resume):
            try:
                summary = train(setup, run_dir, resume=resume, label=setup.cfg.strategy.name, progress=not quiet,
                                faults=checks.faults(env), signals=signals)
            except BadCheckpoint as exc:     # found before the run changed anything
                raise BadInput(str(exc)) from None
        ended(f"the run had finished (its results are in {run_dir})")
        if signals.received:
            say(f"shaky: {signal.Signals(signals.received).name} received as the run was ending; it finished "
                f"(its results are in {run_dir})")
    return summary
