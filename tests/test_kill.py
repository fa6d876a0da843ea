"""Kill tests: a run and a sweep stopped by SIGINT, SIGTERM or SIGKILL at 20 seeded random moments each, and
resumed after every one; the result equals the run never interrupted in every number but the wall time.

Each moment is a delay after the process starts, drawn from the seed over the whole of a process's life
(starting Python, loading data, training, checkpointing), and the signal is drawn with it. A run that
reaches its end between moments (a fast machine) is checked against the reference and a new one is started,
so every machine sees 20 stops. Slow (several minutes: every moment starts Python and torch again), so they
carry the ``kill`` marker: ``make test`` leaves them out and ``make test-kill`` (which .ci/run runs) runs them.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from conftest import assert_same_run, child_pids, default_sigint, wait_gone

pytestmark = pytest.mark.kill

MOMENTS = 20
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
SEED = 20261123


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "shaky", *args], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)


def _kill_at(proc: subprocess.Popen[str], delay: float, signum: int,
             before: Callable[[], object] = lambda: None) -> tuple[int, str] | None:
    """Sends ``signum`` after ``delay`` seconds (``before`` runs just before); None if the process ended first
    (it ran to the end)."""
    try:
        proc.wait(timeout=delay)
        return None
    except subprocess.TimeoutExpired:
        before()
        proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def _check_stop(signum: int, code: int, err: str) -> None:
    assert "Traceback" not in err, err[-2000:]
    if signum == signal.SIGKILL:
        assert code == -signal.SIGKILL
    else:  # stopped cleanly (130/143), or by the signal before Python's handlers were installed
        assert code in (128 + signum, -signum, 130, 2, 0), (signum, code, err[-2000:])


TRAIN = ["train", "--workers", "4", "--steps", "15000", "--eval-every", "500", "--checkpoint-every", "500",
         "--drop-rate", "0.1", "--set", "network.compute_ms=1.0", "--quiet"]


def test_a_run_stopped_at_20_random_moments_ends_identical(tmp_path: Path) -> None:
    reference = _start([*TRAIN, "--out", "ref"], tmp_path)
    assert reference.wait(timeout=600) == 0
    rng = random.Random(SEED)
    kills, runs = [], 0
    while len(kills) < MOMENTS:
        run = tmp_path / f"run{runs}"
        fresh = not (run / "config.toml").exists()
        proc = _start([*TRAIN, "--out", run.name] if fresh else ["train", "--resume", run.name, "--quiet"], tmp_path)
        delay, signum = rng.uniform(0.0, 9.0), rng.choice(SIGNALS)
        stopped = _kill_at(proc, delay, signum)
        if stopped is None:  # the run finished before this moment (a fast machine): check it, start another
            assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
            assert_same_run(run, tmp_path / "ref")
            runs += 1
            assert runs <= MOMENTS, kills  # bounded, however fast the machine
            continue
        _check_stop(signum, *stopped)
        kills.append((round(delay, 2), signal.Signals(signum).name, stopped[0]))
    final = _start(["train", "--resume", f"run{runs}", "--quiet"], tmp_path)
    assert final.wait(timeout=600) == 0, final.stderr.read() if final.stderr else ""
    assert_same_run(tmp_path / f"run{runs}", tmp_path / "ref")


SWEEP = """
[base]
steps = 10000
num_workers = 4
eval_every = 500
checkpoint_every = 500
network = {compute_ms = 1.0, drop_rate = 0.1}
[grid]
seed = [0, 1, 2, 3]
"""


def _same_sweeps(out: Path, ref: Path) -> None:
    for s in range(4):
        assert_same_run(out / "grid" / f"seed={s}", ref / "grid" / f"seed={s}")


def test_a_sweep_stopped_at_20_random_moments_ends_identical(tmp_path: Path) -> None:
    (tmp_path / "grid.toml").write_text(SWEEP)
    sweep = ["sweep", "grid.toml", "--jobs", "2", "--quiet"]
    reference = _start([*sweep, "--out", "ref"], tmp_path)
    assert reference.wait(timeout=900) == 0
    rng = random.Random(SEED + 1)
    kills, sweeps = [], 0
    while len(kills) < MOMENTS:
        proc = _start([*sweep, "--out", f"out{sweeps}"], tmp_path)
        delay, signum = rng.uniform(0.0, 12.0), rng.choice(SIGNALS)
        children: list[int] = []
        stopped = _kill_at(proc, delay, signum, before=lambda: children.extend(child_pids(proc.pid)))
        if stopped is None:  # the sweep finished before this moment (a fast machine): check it, start another
            assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
            _same_sweeps(tmp_path / f"out{sweeps}", tmp_path / "ref")
            sweeps += 1
            assert sweeps <= MOMENTS, kills
            continue
        code, err = stopped
        assert "Traceback" not in err, err[-2000:]
        wait_gone(children)  # no worker outlives its sweep, whatever stopped it
        kills.append((round(delay, 2), signal.Signals(signum).name, code))
    final = _start([*sweep, "--out", f"out{sweeps}"], tmp_path)
    assert final.wait(timeout=900) == 0, final.stderr.read() if final.stderr else ""
    _same_sweeps(tmp_path / f"out{sweeps}", tmp_path / "ref")
