"""A rank that dies or hangs: the survivors say which and where to resume, and resume finishes the run.

Four processes are started the way torchrun starts them on several machines
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), without torchrun's local agent,
which would kill the survivors itself. The fault is injected deterministically:
SHAKY_INJECT_FAULT=exit:2:25 makes rank 2 exit when it reaches step 25.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import finish, launch_ranks, make_config, run

ARGS = ["--workers", "4", "--steps", "60", "--eval-every", "10", "--checkpoint-every", "10", "--quiet",
        "--set", "network.compute_ms=1.0"]


def _launch(args: list[str], cwd: Path, fault: str = "") -> list[subprocess.Popen]:
    return launch_ranks(args, cwd, fault)


_finish = finish


@pytest.mark.parametrize("fault", ["exit", pytest.param("hang", marks=pytest.mark.kill)])  # hang: make test-kill
@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_failed_rank_is_named_and_resume_finishes(fault: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    procs = _launch(["--backend", "dist", *ARGS, "--set", "dist_timeout_s=5", "--out", str(run_dir)], tmp_path,
                    fault=f"{fault}:2:25")
    survivors = [procs[r] for r in (0, 1, 3)]
    try:
        results = _finish(survivors, timeout=90)    # the injected hang would outlast this: it is killed after
    finally:
        procs[2].kill()                             # also when the survivors fail: no rank outlives the test
    for code, err in results:
        lines = [line for line in err.splitlines() if line.startswith("shaky: error:")]
        assert code == 3 and len(lines) == 1, err[-1500:]
        assert "rank 2 stopped answering after step 24" in lines[0]
        assert f"{run_dir / 'checkpoint.pt'} at step 20" in lines[0]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 10, 20]  # nothing past the failure was committed

    resumed = _finish(_launch(["--resume", str(run_dir)], tmp_path), timeout=120)
    assert [code for code, _ in resumed] == [0, 0, 0, 0], resumed[0][1][-1500:]
    final = json.loads((run_dir / "summary.json").read_text())
    uninterrupted, _, _ = run(make_config(num_workers=4, steps=60, eval_every=10, batch_size=32,
                                          network={"compute_ms": 1.0}), tmp_path / "sim")
    assert abs(final["final_test_accuracy"] - uninterrupted["final_test_accuracy"]) <= 0.005
    assert final["steps"] == 60


def test_a_rank_killed_for_real_is_named(tmp_path: Path) -> None:
    """kill -9 of one rank (no injected fault): every survivor names that rank, not the lowest one."""
    run_dir = tmp_path / "run"
    args = ["--workers", "4", "--steps", "5000", "--eval-every", "10", "--checkpoint-every", "10", "--quiet",
            "--set", "network.compute_ms=1.0", "--set", "dist_timeout_s=5"]
    procs = _launch(["--backend", "dist", *args, "--out", str(run_dir)], tmp_path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (run_dir / "checkpoint.pt").exists():
            time.sleep(0.05)
        assert (run_dir / "checkpoint.pt").exists(), "the run never reached its first checkpoint"
        procs[1].send_signal(signal.SIGKILL)
        results = _finish([procs[r] for r in (0, 2, 3)], timeout=60)
    finally:
        for p in procs:
            p.kill()
    for code, err in results:
        lines = [line for line in err.splitlines() if line.startswith("shaky: error:")]
        assert code == 3 and len(lines) == 1, err[-1500:]
        assert "shaky: error: rank 1 stopped answering after step" in lines[0], lines[0]


def test_a_resume_whose_checkpoint_is_not_the_runs_model_stops_every_rank_in_one_line(tmp_path: Path) -> None:
    """A checkpoint whose checksum holds but whose parameters are another model's: rank 0 finds it before the
    group trains and every rank stops at once with status 2 (rank 0 says why, once); nothing is changed."""
    import hashlib
    import io

    import torch

    from shaky.rundir import load_checkpoint

    run_dir = tmp_path / "run"
    args = ["--workers", "2", "--steps", "10", "--eval-every", "5", "--checkpoint-every", "5", "--quiet",
            "--set", "network.compute_ms=1.0"]
    made = finish(launch_ranks(["--backend", "dist", *args, "--out", str(run_dir)], tmp_path, workers=2), 120)
    assert [code for code, _ in made] == [0, 0], made[0][1][-1500:]
    ckpt = load_checkpoint(run_dir)
    ckpt["params"] = ckpt["params"][:, :-3]
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    (run_dir / "checkpoint.pt").write_bytes(b"shaky checkpoint 1 sha256=" + hashlib.sha256(buf.getvalue()).hexdigest()
                                            .encode() + b"\n" + buf.getvalue())
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    resumed = finish(launch_ranks(["--resume", str(run_dir)], tmp_path, workers=2), 120)
    assert [code for code, _ in resumed] == [2, 2], resumed
    said = [line for _, err in resumed for line in err.splitlines()]
    assert len(said) == 1 and "holds parameters" in said[0] and "Traceback" not in "".join(e for _, e in resumed), said
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
