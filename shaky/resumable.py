"""The one resume check: what a run directory must hold to be continued, and what a finished one must hold to be
taken as finished. ``shaky train --resume``, a sweep's resume and ``shaky launch``'s restarts all call it, so
that none of them continues what it should not.

In two parts, because the second needs the run's model and data:

- :func:`shaky.rundir.load_run_config` (before anything is prepared): config.toml readable and valid; the
  checkpoint whole (its checksum) and trained with that config (but a machine's own settings); its counters
  within the run's steps; metrics.jsonl holding every evaluation up to the checkpoint (a last line cut short
  by the stop may be dropped).
- :func:`check_resume` (once the run is prepared): the checkpoint's parameters are the model's shape and dtype;
  the data and the trace are what the run's last start read (their digests, ``machines.json``): a path may
  move, what it holds may not, and a run may not start or stop replaying a trace half way.

:func:`check_finished`: a finished run's summary.json is the summary of its own config;
:func:`check_finished_data`: and it was trained on the data its config reads today (a text file, a CIFAR-10
directory or a library's set may have changed since).

Every failure is a ValueError in one line naming the file and what differs (the command line turns it into
status 2), raised before anything is changed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from collections.abc import Callable
from typing import Any

from shaky.config import MACHINE_SETTINGS, RunConfig, machine_settings, to_dict
from shaky.rundir import (CHECKPOINT_FILE, CONFIG_FILE, SUMMARY_FILE, BadCheckpoint, load_checkpoint, read_machines,
                          read_summary)

INPUT_SETTING = {"data": "data.path", "network.trace": "network.trace"}
"""The setting that names the file behind each of :func:`shaky.setup.inputs_digest`'s digests."""


def check_resume(setup: Any, run_dir: Path) -> dict[str, Any]:
    """The second part of the check (the module's docstring), for a run resumed in this process; returns what this
    process read (its machine settings and the digests of its inputs), for ``machines.json``."""
    here = read_inputs(setup)   # other data first: it may size the model otherwise (a text vocabulary)
    check_as_trained(setup.cfg, here, read_machines(run_dir).get(0), f"--resume {run_dir}: its")
    if (run_dir / CHECKPOINT_FILE).is_file():
        check_params(run_dir, load_checkpoint(run_dir).get("params"), setup)
    return here


def read_inputs(setup: Any) -> dict[str, Any]:
    """This process's machine settings and the digests of what it read (:func:`shaky.setup.inputs_digest`)."""
    from shaky.setup import inputs_digest  # noqa: PLC0415 (torch)

    return {"settings": machine_settings(setup.cfg), "inputs": inputs_digest(setup)}


def check_params(run_dir: Path, params: Any, setup: Any) -> None:
    """The checkpoint's parameters are one row of the model per worker, in the run's dtype (BadCheckpoint)."""
    import torch  # noqa: PLC0415

    want = (setup.cfg.num_workers, setup.flat.dim)
    if not isinstance(params, torch.Tensor) or tuple(params.shape) != want or params.dtype != setup.dtype:
        got = f"{list(params.shape)} {params.dtype}" if isinstance(params, torch.Tensor) else type(params).__name__
        raise BadCheckpoint(f"resume: {run_dir / CHECKPOINT_FILE} holds parameters {got}, but this run's model has "
                            f"{list(want)} {setup.dtype} (the file was not written by this run); nothing was resumed")


def check_as_trained(cfg: Any, here: dict[str, Any], recorded: dict[str, Any] | None, who: str) -> None:
    """A resumed run reads the data (and trace) its last start read (``recorded``; None: not known), else
    ValueError, its line starting with ``who``."""
    differs = other_inputs(cfg, here, recorded, whose="then")
    if differs is not None:
        name, what, sums = differs
        if name == "network.trace" and (recorded or {}).get("inputs", {}).get(name) is None:
            raise ValueError(f"{who} network.trace {input_path(here, name)!r} would replay masks, but the run drew "
                             "its masks from its seed: a resume goes on as the run began (start a new run to replay "
                             "a trace)")
        if name == "network.trace" and here["inputs"].get(name) is None:
            raise ValueError(f"{who} network.trace is not set, but the run replays the trace at "
                             f"{input_path(recorded or {}, name)!r}: a resume goes on as the run began (give "
                             "--replay-trace with that trace)")
        raise ValueError(f"{who} {what} than the run was trained on ({sums} at {input_path(recorded or {}, name)!r}); "
                         "a resume goes on with the same data")


def input_path(machine: dict[str, Any], name: str) -> str:
    return str(machine.get("settings", {}).get(INPUT_SETTING[name], ""))


def other_inputs(cfg: Any, machine: dict[str, Any], reference: dict[str, Any] | None, *,
                 whose: str) -> tuple[str, str, str] | None:
    """The first of ``machine``'s inputs (the data, a trace) that is not what ``reference`` read (each
    ``{"settings", "inputs"}``; ``reference``'s settings are not needed): its name, "data.path '...' holds
    other text data" and "sha256 ..., <whose> ..."; None where they agree (or ``reference`` is not known). A trace
    on one side only differs too: the masks would switch from drawn to replayed half way (or back)."""
    if reference is None or "inputs" not in reference:
        return None
    theirs_all = reference["inputs"]
    for name in sorted({*machine["inputs"], *theirs_all}, key=list(INPUT_SETTING).index):
        digest, theirs = machine["inputs"].get(name), theirs_all.get(name)
        if digest == theirs:
            continue
        what = f"{cfg.data.dataset} data" if name == "data" else "masks"
        if digest is None:
            return (name, f"{INPUT_SETTING[name]} is not set, and so it reads no {what}",
                    f"{whose} sha256 {theirs[:12]}")
        if theirs is None:
            return (name, f"{INPUT_SETTING[name]} {input_path(machine, name)!r} holds other {what}",
                    f"sha256 {digest[:12]}, {whose} none")
        return (name, f"{INPUT_SETTING[name]} {input_path(machine, name)!r} holds other {what}",
                f"sha256 {digest[:12]}, {whose} {theirs[:12]}")
    return None


# ---------------------------------------------------------------------------------------------------------------
# A finished run

def config_digest(cfg: RunConfig) -> str:
    """The sha256 of the run's config but its machine settings (which may differ between its starts): a summary
    records it, so that a finished run is known to be the result of its own config."""
    values = json.loads(json.dumps(to_dict(cfg)))
    for name in MACHINE_SETTINGS:
        *parents, leaf = name.split(".")
        node = values
        for part in parents:
            node = node.get(part, {})
        node.pop(leaf, None)
    return values_digest(values)


def values_digest(values: dict[str, Any]) -> str:
    """The sha256 of a config's values as JSON, keys sorted."""
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


def check_finished(run_dir: Path, digest: str, fields: dict[str, Any]) -> None:
    """``run_dir``'s summary.json is the summary of the config whose digest is ``digest`` (the run's config.toml:
    :func:`config_digest` of a training run), else ValueError. A summary written before shaky recorded digests is
    checked by what it says of its config: ``fields`` (summary key: the config's value)."""
    summary = read_summary(run_dir)
    path = run_dir / SUMMARY_FILE
    recorded = summary.get("config_sha256")
    if recorded is not None:
        if recorded != digest:
            raise ValueError(f"{path} is the summary of another config than {run_dir / CONFIG_FILE} (config sha256 "
                             f"{str(recorded)[:12]}, the run's {digest[:12]}): it was not written by this run; "
                             "delete it to run the run again")
        return
    for name, value in fields.items():
        if name in summary and summary[name] != value:
            raise ValueError(f"{path} is the summary of a run with {name} {summary[name]!r}, but "
                             f"{run_dir / CONFIG_FILE} says {value!r}: it was not written by this run; delete it to "
                             "run the run again")


def check_finished_data(run_dir: Path, cfg: RunConfig, digest_now: Callable[[RunConfig], str]) -> None:
    """``run_dir``, a finished run, was trained on the data that ``cfg`` reads now (``digest_now(cfg)``:
    :func:`shaky.setup.data_digest` of it), as its last start recorded in ``machines.json``, else ValueError. A run
    without that record (one finished before shaky kept it) is taken as it is."""
    recorded = (read_machines(run_dir).get(0) or {}).get("inputs", {}).get("data")
    if recorded is None:
        return
    now = digest_now(cfg)
    if now != recorded:
        where = f"data.path {cfg.data.path!r}" if cfg.data.path else f"data.dataset {cfg.data.dataset!r}"
        raise ValueError(f"{run_dir} finished on other {cfg.data.dataset} data than {where} gives now (sha256 "
                         f"{recorded[:12]} then, {now[:12]} now): its results are not this sweep's; delete it to "
                         "run the run again")


def summary_fields(cfg: RunConfig) -> dict[str, Any]:
    """What a training run's summary says of its config (:func:`check_finished`'s ``fields``)."""
    return {"seed": cfg.seed, "strategy": cfg.strategy.name, "num_workers": cfg.num_workers,
            "dataset": cfg.data.dataset, "model": cfg.model.name}
