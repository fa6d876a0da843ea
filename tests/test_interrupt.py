"""Stopping on purpose: SIGINT and SIGTERM end a run or a sweep with a checkpoint and one line saying how to
go on, a sweep's workers never outlive it (even a SIGKILL of the sweep), and the resumed results are those of
the run never interrupted, in every number but the wall time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import assert_same_run, child_pids, default_sigint, make_config, stop_at, wait_gone
from shaky.inject import InterruptedRun
from shaky.rundir import CHECKPOINT_FILE, read_metrics
from shaky.sweep import load_sweep, run_sweeps
from shaky.train import prepare, train

TRAIN = ["train", "--workers", "4", "--steps", "1500", "--eval-every", "100", "--quiet",
         "--set", "network.compute_ms=1.0", "--drop-rate", "0.1"]


def _shaky(args: list[str], cwd: Path, **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "shaky", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint,
                            **kwargs)  # type: ignore[call-overload]


def _wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _rows(run_dir: Path) -> int:
    try:
        return len(read_metrics(run_dir, trim_torn=True))
    except ValueError:
        return 0


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_a_run_with_a_checkpoint_and_the_resume_ends_identical(signum: int, tmp_path: Path) -> None:
    ref = _shaky([*TRAIN, "--out", "ref"], tmp_path)
    proc = _shaky([*TRAIN, "--out", "run"], tmp_path)
    _wait_for(lambda: _rows(tmp_path / "run") >= 2, 120, "the run's second evaluation")
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    last = err.strip().splitlines()[-1]
    name = signal.Signals(signum).name
    assert last.startswith(f"shaky: stopped by {name} after step "), err
    assert "`shaky train --resume run` continues from there" in last
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "checkpoint.pt", "config.toml", "machines.json", "metrics.jsonl", "shards.json", "trace.npz"]
    step = int(last.split("after step ")[1].split()[0])
    assert 0 < step < 1500

    resumed = _shaky(["train", "--resume", "run", "--quiet"], tmp_path)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read() if resumed.stderr else ""
    assert ref.wait(timeout=300) == 0
    assert_same_run(tmp_path / "run", tmp_path / "ref")


def test_a_run_stopped_before_its_first_checkpoint_starts_again_on_resume(tmp_path: Path) -> None:
    cfg = make_config(steps=30, eval_every=10, checkpoint_every=0)
    train(prepare(cfg), tmp_path / "whole", progress=False)
    with pytest.raises(InterruptedRun):
        train(prepare(cfg), tmp_path / "cut", progress=False, faults=stop_at(15))
    assert not (tmp_path / "cut" / CHECKPOINT_FILE).exists()
    train(prepare(cfg), tmp_path / "cut", resume=True, progress=False)
    assert_same_run(tmp_path / "cut", tmp_path / "whole")


SWEEP = """
[base]
steps = 800
num_workers = 4
eval_every = 100
checkpoint_every = 100
network = {compute_ms = 1.0, drop_rate = 0.1}
[grid]
seed = [0, 1, 2]
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_a_stopped_sweep_leaves_no_workers_and_resumes_identical(signum: int, tmp_path: Path) -> None:
    (tmp_path / "grid.toml").write_text(SWEEP)
    proc = _shaky(["sweep", "grid.toml", "--out", "out", "--jobs", "2", "--quiet"], tmp_path)
    runs = [tmp_path / "out" / "grid" / f"seed={s}" for s in range(3)]
    _wait_for(lambda: sum(_rows(r) >= 2 for r in runs) >= 2, 180, "two runs under way")
    workers = [p for p in child_pids(proc.pid) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(workers) == 2, workers
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=90)
    wait_gone(workers, 60)
    if signum == signal.SIGTERM:
        assert proc.returncode == 143 and err.strip().splitlines()[-1].startswith(
            "shaky: sweep stopped by SIGTERM; the runs under way wrote checkpoints"), err
    # The runs under way stopped after a step with a checkpoint (SIGKILL: the kernel sent their SIGTERM).
    stopped = [r for r in runs if (r / CHECKPOINT_FILE).exists() and not (r / "summary.json").exists()]
    assert stopped, "no run was stopped with a checkpoint"
    assert not list((tmp_path / "out").rglob("*.tmp"))

    again = _shaky(["sweep", "grid.toml", "--out", "out", "--jobs", "2", "--quiet"], tmp_path)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    if signum != signal.SIGKILL:
        return  # the same resume as after a SIGKILL, compared below
    reference = run_sweeps([load_sweep(tmp_path / "grid.toml")], tmp_path / "ref", jobs=1, progress=False)
    assert reference.ran == 3 and not reference.failed
    for r in runs:
        assert_same_run(r, tmp_path / "ref" / "grid" / r.name)


def test_ctrl_c_of_a_sweep_stops_its_workers_which_ignore_it(tmp_path: Path) -> None:
    """A Ctrl-C reaches every process of the terminal's group: the parent stops the workers (they ignore
    SIGINT themselves and write their checkpoints on the parent's SIGTERM)."""
    (tmp_path / "grid.toml").write_text(SWEEP)
    proc = _shaky(["sweep", "grid.toml", "--out", "out", "--jobs", "2", "--quiet"], tmp_path,
                  start_new_session=True)
    runs = [tmp_path / "out" / "grid" / f"seed={s}" for s in range(3)]
    _wait_for(lambda: sum(_rows(r) >= 2 for r in runs) >= 2, 180, "two runs under way")
    workers = child_pids(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=90)
    wait_gone(workers, 60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("shaky: interrupted; the runs under way wrote checkpoints"), err
    assert "Traceback" not in err
    assert sum((r / CHECKPOINT_FILE).exists() for r in runs) >= 2


@pytest.fixture
def small_disk(tmp_path: Path) -> object:
    """A 100 KB tmpfs (root and a mount namespace allowed, as on the dev machine and CI; skipped elsewhere)."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_stops_with_one_line_and_the_run_resumes_once_there_is_room(small_disk: Path,
                                                                                  tmp_path: Path) -> None:
    args = ["train", "--workers", "4", "--steps", "60", "--eval-every", "20", "--quiet",
            "--set", "network.compute_ms=1.0"]
    full = subprocess.run([sys.executable, "-m", "shaky", *args, "--out", str(small_disk / "run")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert full.returncode == 1, full.stderr
    lines = full.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in full.stderr, full.stderr
    assert lines[0].startswith(f"shaky: error: cannot write {small_disk / 'run' / 'checkpoint.pt'}: "
                               "No space left on device; last checkpoint: none yet"), lines[0]
    assert not list(small_disk.rglob("*.tmp"))  # nothing half-written left behind
    subprocess.run(["mount", "-o", "remount,size=20m", str(small_disk)], check=True)
    resumed = subprocess.run([sys.executable, "-m", "shaky", "train", "--resume", str(small_disk / "run"),
                              "--quiet"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    ref = subprocess.run([sys.executable, "-m", "shaky", *args, "--out", "ref"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr
    assert_same_run(small_disk / "run", tmp_path / "ref")


def test_a_read_only_out_is_one_line_and_nothing_written(small_disk: Path, tmp_path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    (tmp_path / "grid.toml").write_text(SWEEP)
    for args in (["train", "--steps", "5", "--quiet", "--out", str(small_disk / "run")],
                 ["sweep", "grid.toml", "--quiet", "--out", str(small_disk / "sweeps")],
                 ["scale", "--out", str(small_disk / "scale.png")]):
        done = subprocess.run([sys.executable, "-m", "shaky", *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode in (1, 2) and len(lines) == 1 and "Traceback" not in done.stderr, (args, done.stderr)
        assert str(small_disk) in lines[0] and "Read-only file system" in lines[0], lines[0]
        assert not any(small_disk.iterdir())
