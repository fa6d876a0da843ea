"""Shared helpers for the tests: small, fast runs on the bundled digits data."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from shaky.config import RunConfig, config_from_dict
from shaky.geometry import LinkSample
from shaky.inject import Fault, FaultInjector
from shaky.launch import free_port  # noqa: F401 (the tests import it from here)
from shaky.models import build_model
from shaky.network.faults import Membership, Round
from shaky.rundir import load_checkpoint
from shaky.train import BatchSampler, prepare, read_metrics, train


# Measured compute times go to a cache of the test session's own (processes the tests start inherit it),
# never to the user's ~/.cache.
if "SHAKY_CACHE_DIR" not in os.environ:
    os.environ["SHAKY_CACHE_DIR"] = tempfile.mkdtemp(prefix="shaky-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SHAKY_CACHE_DIR"], True)


DEVICE = "cpu"
"""The device of :func:`make_config`'s runs: tests/test_gpu.py sets cuda to run the equivalence tests there."""


def make_config(**overrides: Any) -> RunConfig:
    """A digits/mlp config for tests; dotted keys via dict nesting (network={"drop_rate": 0.1})."""
    values: dict[str, Any] = {"num_workers": 4, "steps": 50, "batch_size": 16, "eval_every": 25,
                              "network": {"compute_ms": 1.0}, "device": DEVICE}
    for key, value in overrides.items():
        if isinstance(value, dict):
            values[key] = {**values.get(key, {}), **value}
        else:
            values[key] = value
    return config_from_dict(values)


def run(cfg: RunConfig, run_dir: Path, **kwargs: Any) -> tuple[dict[str, Any], torch.Tensor, list[dict[str, Any]]]:
    """Trains and returns (summary, final params [W, D], metrics rows)."""
    summary = train(prepare(cfg), run_dir, progress=False, **kwargs)
    params = load_checkpoint(run_dir)["params"]
    return summary, params, read_metrics(run_dir)


MEASURED = ("wall_time_s", "eval_time_s")
"""The fields of a metrics row or a summary that are seconds of this machine's clock."""


def unmeasured(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics row or summary without the seconds of this machine's clock (``MEASURED``)."""
    return {k: v for k, v in record.items() if k not in MEASURED}


def without_wall_time(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [unmeasured(r) for r in rows]


def assert_same_run(got: Path, want: Path) -> None:
    """Two run directories hold the same results: summary.json and every metrics row, in every number but
    the wall time (a measurement of the machine, not a result)."""
    summaries = [json.loads((d / "summary.json").read_text()) for d in (got, want)]
    assert without_wall_time(summaries[:1]) == without_wall_time(summaries[1:])
    assert without_wall_time(read_metrics(got)) == without_wall_time(read_metrics(want))


def everyone(links: LinkSample, step: int | None = None) -> Round:
    """A round in which every worker lives, with these delivery masks."""
    return Round(links.round if step is None else step, links, Membership.everyone(links.up.shape[0]))


def stop_at(step: int) -> FaultInjector:
    """Faults that end a run after ``step`` steps, as a killed process would (no final checkpoint)."""
    return FaultInjector((Fault("stop", step),))




def launch_ranks(args: list[str], cwd: Path, fault: str = "", workers: int = 4,
                 env: dict[str, str] | None = None, *, port: int | None = None,
                 ranks: list[int] | None = None, command: list[str] | None = None) -> list[subprocess.Popen]:
    """``workers`` processes of ``shaky train args`` started the way torchrun starts them on as many machines
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), without a local agent that would kill the survivors of a
    failure itself; ``fault`` is SHAKY_INJECT_FAULT. ``port``: MASTER_PORT (a free one if None); ``ranks``:
    start only these (all if None); ``command``: what runs with ``args`` (None: ``shaky train``)."""
    port = str(port or free_port())
    procs = []
    for rank in range(workers) if ranks is None else ranks:
        rank_env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(workers), "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
                    "SHAKY_INJECT_FAULT": fault, **(env or {})}
        procs.append(subprocess.Popen([*(command or [sys.executable, "-m", "shaky", "train"]), *args], cwd=cwd,
                                      env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Each process's exit status and stderr, in order; every one of them is killed on the way out."""
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            out.append((p.returncode, err))
    finally:
        for p in procs:
            p.kill()
    return out


def train_by_hand(cfg: RunConfig, make_opt: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], *,
                  lr_at: Callable[[int], float] | None = None,
                  after_step: Callable[[list[torch.nn.Parameter]], Callable[[int], None]] | None = None
                  ) -> torch.Tensor:
    """Worker 0 of ``cfg`` trained with torch's own optimizer on an ordinary module, on the batches shaky draws;
    ``lr_at(t)`` sets step t's learning rate; ``after_step(params)``, called before the first step, gives a
    function run after each step t. Returns the flat parameters."""
    setup = prepare(cfg)
    model = build_model(cfg.model.name, input_shape=setup.data.input_shape, num_classes=setup.data.num_classes,
                        seed=cfg.seed).to(setup.device)
    params = list(model.parameters())
    opt = make_opt(params)
    after = after_step(params) if after_step is not None else None
    sampler = BatchSampler(setup.shards, [0], [cfg.batch_size], cfg.seed)
    for t in range(cfg.steps):
        if lr_at is not None:
            for group in opt.param_groups:
                group["lr"] = lr_at(t)
        idx = sampler.indices(t)[0].to(setup.device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(setup.data.x_train[idx]), setup.data.y_train[idx]).backward()
        opt.step()
        if after is not None:
            after(t)
    return torch.cat([p.detach().reshape(-1) for p in params]).cpu()


@pytest.fixture
def tmp_run(tmp_path: Path):
    counter = iter(range(1000))
    return lambda: tmp_path / f"run{next(counter)}"


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout: float = 90.0) -> None:
    """Waits until none of ``pids`` runs; AssertionError naming the rest after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return
        time.sleep(0.1)
    raise AssertionError(f"processes {[p for p in pids if alive(p)]} still run after {timeout:.0f} s")


def default_sigint() -> None:
    """``preexec_fn`` for a process a test sends SIGINT: a shell that runs the tests in the background leaves
    SIGINT ignored, children inherit that, and shaky (like any program) keeps an ignored signal ignored."""
    import signal  # noqa: PLC0415

    signal.signal(signal.SIGINT, signal.SIG_DFL)
