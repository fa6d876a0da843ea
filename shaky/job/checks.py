"""Every rank runs the same config on the same data: the checks a rank makes before it trains (a new run's, a
resumed run's, a rank taken back's), each failure one line (BadInput, status 2; ForgedRecord, status 3, where
what the rendezvous store held was not the run's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shaky.comm.gloo import broadcast_object, gather_object
from shaky.membership.quorum import ForgedRecord
from shaky.config import MACHINE_SETTINGS, first_difference, machine_settings, to_dict
from shaky.errors import BadInput
from shaky.inject import FaultInjector
from shaky.job.env import JobEnv
from shaky.rundir import claim_dir
from shaky import resumable
from shaky.resumable import check_resume, input_path, other_inputs, read_inputs
from shaky.setup import inputs_digest


def faults(env: JobEnv) -> FaultInjector | None:
    """The faults that ``SHAKY_INJECT_FAULT`` asks for (tests start processes with it), or None."""
    try:
        return FaultInjector.parse(env.inject_fault) if env.inject_fault else None
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def claim_run_dir(run_dir: Path, *, resume: bool) -> None:
    """This process becomes the run directory's one writer (two at once would interleave their files)."""
    try:
        claim_dir(run_dir, fresh=not resume)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    except OSError as exc:
        flag = "--resume" if resume else "--out"
        raise BadInput(f"{flag} {str(run_dir)!r} cannot be used: {exc.strerror or exc}"
                       + (f" ({exc.filename})" if exc.filename and str(exc.filename) != str(run_dir) else "")) from None


def read_here(setup: Any, run_dir: Path, *, resume: bool) -> dict[str, Any]:
    """A simulator run's machine settings and the digests of what it read (:func:`shaky.setup.inputs_digest`);
    resumed, the rest of the resume check (``shaky.resumable.check_resume``: the checkpoint fits the model, the
    data and trace are what the run's last start read), BadInput where it fails."""
    try:
        return check_resume(setup, run_dir) if resume else read_inputs(setup)
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def check_as_trained(cfg: Any, here: dict[str, Any], recorded: dict[str, Any] | None, who: str) -> None:
    """:func:`shaky.resumable.check_as_trained`, BadInput where it fails."""
    try:
        resumable.check_as_trained(cfg, here, recorded, who)
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def check_same_config(cfg: Any, *, resumed: bool, inputs: dict[str, str] | None = None,
                      recorded: dict[str, Any] | None = None, restarts: str | None = None,
                      refused: str | None = None) -> dict[int, Any]:
    """Every rank runs rank 0's config (but :data:`~shaky.config.MACHINE_SETTINGS`): each compares its own with
    rank 0's, sent over the process group, and all learn of any difference (a collective), so that every rank
    stops alike. In a new run each machine reads its own command line (BadInput, status 2); in a resumed run the
    ranks > 0 took theirs from the rendezvous store, which takes writes from whoever reaches it (ForgedRecord).

    ``inputs``: the digests of what this rank read from its own paths (:func:`shaky.setup.inputs_digest`), which
    must be rank 0's too: two machines whose data.path holds other data would train apart, silently (BadInput).
    ``recorded`` (rank 0 of a resumed run): what rank 0 read at the run's last start (``machines.json``); its
    data must be the same now (BadInput). ``restarts``: this rank's shaky launch's --max-restarts
    (:attr:`JobEnv.max_restarts`), which must be rank 0's. ``refused`` (rank 0 of a resumed run): why its
    checkpoint cannot be resumed (``shaky.resumable.check_params``), which every rank learns, to stop at once.
    Returns every rank's machine settings and digests, by rank (rank 0 records them in the run directory)."""
    mine = json.loads(json.dumps(to_dict(cfg)))
    machine = {"settings": machine_settings(cfg), "inputs": inputs or {}}
    rank0_config, recorded, refused = broadcast_object((mine, recorded, refused))
    if refused is not None:
        raise BadInput(refused)
    found = gather_object((first_difference(mine, rank0_config, ignore=MACHINE_SETTINGS), machine, restarts))
    rank, theirs = next(((r, n) for r, (_, _, n) in enumerate(found) if n != found[0][2]), (None, None))
    if rank is not None:
        raise BadInput(f"rank {rank}'s shaky launch has --max-restarts {theirs or '(none: not shaky launch)'}, rank "
                       f"0's {found[0][2] or '(none: not shaky launch)'}: give every machine's launcher the same")
    found = [(d, m) for d, m, _ in found]       # (its config's first difference, its machine) by rank
    rank, differs = next(((r, d) for r, (d, _) in enumerate(found) if d is not None), (None, None))
    if differs is not None:
        name, got, theirs = differs
        if resumed:
            raise ForgedRecord(f"rank {rank}: the resumed run's config in the rendezvous store is not rank 0's (its "
                               f"{name} is {got!r}, rank 0's {theirs!r}): something outside the run wrote it")
        raise BadInput(f"rank {rank}'s {name} is {got!r}, rank 0's is {theirs!r}: every machine must run the same "
                       f"command line (only {', '.join(MACHINE_SETTINGS)} may differ)")
    rank0 = found[0][1]
    check_as_trained(cfg, rank0, recorded, "--resume: rank 0's")
    for rank, (_, theirs) in enumerate(found):
        differs = other_inputs(cfg, theirs, rank0, whose="rank 0's")
        if differs is None:
            continue
        name, what, sums = differs
        if name == "data" and not theirs["settings"]["data.path"] and not rank0["settings"]["data.path"]:
            raise BadInput(f"rank {rank} loads other {cfg.data.dataset} data than rank 0 ({sums}: another version of "
                           "the library that ships it?); every machine must train on the same data")
        raise BadInput(f"rank {rank}'s {what} than rank 0's {input_path(rank0, name)!r} ({sums}); every machine "
                       f"must read the same {'data' if name == 'data' else 'trace'}")
    return {rank: theirs for rank, (_, theirs) in enumerate(found)}


def check_taken_back(cfg: Any, setup: Any, run: dict[str, Any], rank: int) -> None:
    """A rank taken back checks its config and data against the run's, which came with the survivors' welcome
    (sealed with the run's key): the record it started from came from the rendezvous store, which anyone can
    write (ForgedRecord, status 3: it leaves the run before its model is averaged)."""
    differs = first_difference(json.loads(json.dumps(to_dict(cfg))), run.get("config"), ignore=MACHINE_SETTINGS)
    if differs is not None:
        name, mine, theirs = differs
        raise ForgedRecord(f"rank {rank} was taken back into a run whose {name} is {theirs!r}, not {mine!r} as the "
                           "run's record in the rendezvous store said: something outside the run wrote it")
    other = other_inputs(cfg, {"settings": machine_settings(cfg), "inputs": inputs_digest(setup)}, run,
                         whose="the run's")
    if other is not None:
        raise ForgedRecord(f"rank {rank} was taken back into a run that read other data: its {other[1]} ({other[2]}), "
                           "though the run's record in the rendezvous store said otherwise: something outside the "
                           "run wrote it")
