"""Live membership on the udp transport: a rank that dies or freezes is left out and the survivors train on.

Four processes are started the way torchrun starts them on four machines (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, one process each), without a local torchrun agent, which would kill the survivors itself. Faults
are injected deterministically at a step (``SHAKY_INJECT_FAULT``): ``kill`` sends the rank SIGKILL, ``freeze``
SIGSTOP. The data plane is UDP on 127.0.0.1 (nothing is lost on purpose); the control plane is the rendezvous
store, hosted by rank 0.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shaky.cli import main
from shaky.rundir import load_checkpoint, load_run_config, load_trace

from conftest import finish, free_port, launch_ranks, make_config, run

WORKERS = 4
ARGS = ["--backend", "dist", "--transport", "udp", "--workers", str(WORKERS), "--steps", "60", "--eval-every",
        "10", "--checkpoint-every", "20", "--quiet", "--set", "network.compute_ms=1.0"]


ENV = {"SHAKY_KEY": "a test key of at least sixteen bytes"}


def _launch(args: list[str], cwd: Path, fault: str) -> list[subprocess.Popen]:
    return launch_ranks(args, cwd, fault, WORKERS, env=ENV)


_finish = finish


def _simulated(tmp_path: Path, **config) -> dict:
    summary, _, _ = run(make_config(**{"num_workers": WORKERS, "steps": 60, "eval_every": 10, "batch_size": 32,
                                       "network": {"compute_ms": 1.0}, **config}), tmp_path / "sim")
    return summary


def _started_again(args: list[str], tmp_path: Path, rank: int) -> list[tuple[int, str]]:
    """The run of ``args`` with ``rank`` killed (SIGKILL) before step 25 and started again at once with the same
    command line: each rank's (status, stderr)."""
    port = free_port()
    procs = launch_ranks(args, tmp_path, f"kill:{rank}:25", WORKERS, env=ENV, port=port)
    try:
        assert procs[rank].wait(timeout=120) == -signal.SIGKILL
        procs[rank] = launch_ranks(args, tmp_path, "", WORKERS, env=ENV, port=port, ranks=[rank])[0]
    finally:
        results = _finish(procs, timeout=240)
    return results


def _replayed(run_dir: Path, tmp_path: Path, failures: list[dict]) -> Path:
    """The simulator replaying ``run_dir``'s trace with its membership (``failures``: the run's
    ``udp.failures``), in ``tmp_path/replay``."""
    replay = tmp_path / "replay"
    toml = "[" + ",".join("{worker=%d,step=%d,rejoin=%d,restart=%s}" % (
        f["worker"], f["step"], f["rejoin"], str(f.get("restart", False)).lower()) for f in failures) + "]"
    sim = subprocess.run([sys.executable, "-m", "shaky", "train", "--config", str(run_dir / "config.toml"),
                          "--backend", "sim", "--transport", "gloo", "--replay-trace", str(run_dir), "--quiet",
                          "--set", f"failures={toml}", "--out", str(replay)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert sim.returncode == 0, sim.stderr[-2000:]
    return replay


def test_survivors_of_a_sigkill_train_on(tmp_path: Path) -> None:
    """Rank 2 is killed with SIGKILL before step 25: the three survivors leave it out at one round boundary,
    serve its block, finish all 60 steps with exit status 0 and end within a point of the simulator's run
    with the failure {worker = 2, step = 25}."""
    run_dir = tmp_path / "run"
    procs = _launch([*ARGS, "--out", str(run_dir)], tmp_path, fault="kill:2:25")
    results = _finish(procs, timeout=180)
    assert results[2][0] == -signal.SIGKILL
    for rank in (0, 1, 3):
        code, err = results[rank]
        assert code == 0, f"rank {rank}: {err[-2000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["live_workers"] == 3
    changes = summary["udp"]["membership_changes"]
    assert [(c["step"], c["live"]) for c in changes] == [(26, [0, 1, 3])], changes
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["live_workers"] for r in rows] == [4, 4, 4, 3, 3, 3, 3]
    simulated = _simulated(tmp_path, failures=[{"worker": 2, "step": 25}])
    assert abs(summary["final_test_accuracy"] - simulated["final_test_accuracy"]) <= 0.01, (summary, simulated)


@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_a_frozen_rank_is_left_out_and_taken_back_when_it_wakes(tmp_path: Path) -> None:
    """Rank 2 freezes itself (SIGSTOP) before step 25: the survivors leave it out (its heartbeat stopped, so
    after dist.heartbeat_timeout_s, never a transport timeout) and train on. Woken (SIGCONT) once they have, it
    learns that it was left out, says so in one line, asks to be taken back in the same process, and is: the run
    ends with four live workers, every rank with status 0, and the membership it records (left out, then back
    as a restarted worker) is what the simulator replays."""
    run_dir = tmp_path / "run"
    args = [*ARGS, "--steps", "600", "--checkpoint-every", "100", "--out", str(run_dir)]
    procs = _launch(args, tmp_path, fault="freeze:2:25")
    try:
        # Woken once the others have left it out (a metrics row with 3 live workers) and still train.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _rows_with(run_dir, live_workers=3):
            time.sleep(0.05)
        assert _rows_with(run_dir, live_workers=3), "the survivors never left the frozen rank out"
    finally:
        procs[2].send_signal(signal.SIGCONT)
    results = _finish(procs, timeout=240)
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank}: {err[-2000:]}"
    err = results[2][1]
    assert "rank 2 was declared dead by the others" in err and "it asks to be taken back" in err, err[-2000:]
    assert not [line for line in err.splitlines() if line.startswith("shaky: error:")], err[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 600 and summary["live_workers"] == 4
    (left, back), = [(f["step"], f["rejoin"]) for f in summary["udp"]["failures"] if f["worker"] == 2]
    assert 25 <= left < back < 600, summary["udp"]["failures"]
    assert [f["restart"] for f in summary["udp"]["failures"]] == [True]
    simulated = _simulated(tmp_path, steps=600, failures=summary["udp"]["failures"])
    assert abs(summary["final_test_accuracy"] - simulated["final_test_accuracy"]) <= 0.01, (summary, simulated)
    rows = [r["live_workers"] for r in _rows_with(run_dir)]
    assert rows[0] == 4 and 3 in rows and rows[-1] == 4 and rows == sorted(rows[:rows.index(3)], reverse=True) + \
        rows[rows.index(3):], rows


@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_a_frozen_rank_0_is_left_out_and_taken_back_when_it_wakes(tmp_path: Path) -> None:
    """Rank 0 freezes itself (SIGSTOP) before step 25 and this test wakes it 6 s later, twice the heartbeat
    timeout. The store is the keeper's, not rank 0's: the others leave rank 0 out and train on, rank 1 writing
    the run directory; woken, rank 0 learns it was left out, asks to be taken back in the same process and is.
    Every rank ends with status 0, the run with four live workers, and the membership it records is what the
    simulator replays (within a point)."""
    run_dir = tmp_path / "run"
    procs = _launch([*ARGS, "--steps", "600", "--checkpoint-every", "100", "--out", str(run_dir)], tmp_path,
                    fault="freeze:0:25")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and Path(f"/proc/{procs[0].pid}/stat").read_text().split()[2] != "T":
            time.sleep(0.05)
        assert Path(f"/proc/{procs[0].pid}/stat").read_text().split()[2] == "T", "rank 0 never froze"
        time.sleep(6.0)
    finally:
        procs[0].send_signal(signal.SIGCONT)
    results = _finish(procs, timeout=240)
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank}: {err[-2000:]}"
    err = results[0][1]
    assert "rank 0 was declared dead by the others" in err and "it asks to be taken back" in err, err[-2000:]
    assert "shaky: rank 1 writes the run directory from step" in results[1][1], results[1][1][-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 600 and summary["live_workers"] == 4
    (left, back), = [(f["step"], f["rejoin"]) for f in summary["udp"]["failures"] if f["worker"] == 0]
    assert 25 <= left < back < 600, summary["udp"]["failures"]
    rows = [r["step"] for r in _rows_with(run_dir)]
    assert rows == list(range(0, 601, 10)), rows
    simulated = _simulated(tmp_path, steps=600, failures=summary["udp"]["failures"])
    assert abs(summary["final_test_accuracy"] - simulated["final_test_accuracy"]) <= 0.01, (summary, simulated)


@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_a_process_started_again_for_rank_0_is_taken_back(tmp_path: Path) -> None:
    """Rank 0 is killed with SIGKILL before step 25 and started again with the same command line. It finds its
    run's keeper still serving MASTER_PORT, asks to be taken back and is, at a step's start; rank 1 keeps
    writing the run directory (the writer moves only when it is left out). Every rank ends with status 0, and
    the simulator replaying the trace with that membership ends at the live workers' parameters (float64)."""
    run_dir = tmp_path / "run"
    args = [*ARGS, "--steps", "400", "--eval-every", "50", "--checkpoint-every", "100", "--set", 'dtype="float64"',
            "--out", str(run_dir)]
    for rank, (code, err) in enumerate(_started_again(args, tmp_path, 0)):
        assert code == 0, f"rank {rank}: {err[-3000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 400 and summary["live_workers"] == 4, summary
    (failure,) = summary["udp"]["failures"]
    assert failure["worker"] == 0 and failure["restart"] and 25 < failure["step"] < failure["rejoin"], failure
    assert [r["step"] for r in _rows_with(run_dir)] == list(range(0, 401, 50))
    replay = _replayed(run_dir, tmp_path, [failure])
    torch.testing.assert_close(load_checkpoint(replay)["params"], load_checkpoint(run_dir)["params"],
                               rtol=0, atol=1e-12)


def _rows_with(run_dir: Path, **values) -> list[dict]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:      # a line being written
            continue
    return [r for r in rows if all(r.get(k) == v for k, v in values.items())]


@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_ri_sgd_with_redundancy_keeps_its_coverage_through_two_failures(tmp_path: Path) -> None:
    """RI-SGD with q = 3 of the 4 chunks per worker: ranks 1 and 3 are killed (steps 20 and 40), the other two
    still hold every training sample (coverage 1.0), and the run ends within a point of the same run without
    failures (simulated)."""
    run_dir = tmp_path / "run"
    args = [*ARGS, "--strategy", "ri-sgd", "--set", "strategy.redundancy=3", "--set", "strategy.period=4"]
    procs = _launch([*args, "--out", str(run_dir)], tmp_path, fault="kill:1:20,kill:3:40")
    results = _finish(procs, timeout=180)
    for rank in (0, 2):
        assert results[rank][0] == 0, results[rank][1][-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["live_workers"] == 2 and summary["coverage"] == 1.0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["live_workers"] for r in rows] == [4, 4, 4, 3, 3, 2, 2]
    assert all(r["coverage"] == 1.0 for r in rows)
    clean = _simulated(tmp_path, strategy={"name": "ri-sgd", "redundancy": 3, "period": 4})
    assert abs(summary["final_test_accuracy"] - clean["final_test_accuracy"]) <= 0.01, (summary, clean)


@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_a_rank_started_again_is_taken_back(tmp_path: Path) -> None:
    """DTS (t = 4, momentum): rank 2 is killed with SIGKILL before step 25 and started again with the same
    command line. The survivors take it back at a step's start (their exchanges in flight complete first; it
    gets their average model and state), the run ends with 4 live workers, and the simulator replaying its
    trace with its membership (udp.failures: a restart) ends at the same parameters."""
    run_dir = tmp_path / "run"
    args = [*ARGS, "--steps", "1500", "--eval-every", "100", "--checkpoint-every", "500", "--strategy", "dts",
            "--set", "strategy.delay=4", "--momentum", "0.9", "--out", str(run_dir)]
    for rank, (code, err) in enumerate(_started_again(args, tmp_path, 2)):
        assert code == 0, f"rank {rank}: {err[-3000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1500 and summary["live_workers"] == 4, summary
    changes = summary["udp"]["membership_changes"]
    assert [c["live"] for c in changes] == [[0, 1, 3], [0, 1, 2, 3]], changes
    # Its death shows in the first control round it did not write. Those of the exchanges it launched at steps
    # 22 to 24 run in the background and are taken in 3 steps later: it may have written them or not.
    left = changes[0]["step"]
    assert 26 <= left <= 29 and changes[1]["rejoined"] == [2], changes
    back = changes[1]["step"]
    assert summary["udp"]["failures"] == [{"worker": 2, "step": left, "rejoin": back, "restart": True}]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["live_workers"] == 4 for r in rows if r["step"] >= back)
    # Once back, rank 2 serves its block again: its averages reach the others (the loopback loses almost none).
    _, down, _ = load_trace(str(run_dir), WORKERS, 1500)
    served = np.unpackbits(down[back + 4:], axis=1).reshape(len(down) - back - 4, -1, WORKERS, WORKERS)[:, :, 2]
    assert served.mean() > 0.99, served.mean()
    replay = _replayed(run_dir, tmp_path, summary["udp"]["failures"])
    # To float rounding, which grows to 1e-4 over 1,500 steps even without a failure (the transport adds in
    # another order than the simulator: 8.8e-5 measured for rps); replayed with the rank keeping its own
    # momentum (restart = false) the same run is 0.17 off.
    torch.testing.assert_close(load_checkpoint(replay)["params"], load_checkpoint(run_dir)["params"],
                               rtol=0, atol=1e-3)


@pytest.mark.parametrize(("transport", "extra", "expected"), [
    ("gloo", [], "it uses the gloo transport, on which a failure stops every rank"),
    ("udp", ["--lr", "0.07"], "its optim.lr is 0.07, the run's is 0.05"),
])
@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_a_process_that_cannot_rejoin_says_why_in_one_line(transport: str, extra: list[str], expected: str,
                                                            tmp_path: Path) -> None:
    """A process started for rank 1 of a run in progress that cannot take it (a gloo run, or another config)
    stops with one line and status 2, and the run goes on."""
    run_dir = tmp_path / "run"
    args = ["--backend", "dist", "--transport", transport, "--workers", "2", "--steps", "100000", "--quiet",
            "--lr", "0.05", "--eval-every", "1000", "--out", str(run_dir)]
    port = free_port()
    procs = launch_ranks(args, tmp_path, "", 2, env=ENV, port=port)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _rows_with(run_dir, step=1000):
            time.sleep(0.05)
        assert _rows_with(run_dir, step=1000), "the run never got going"
        again = launch_ranks([*args[:-2], *extra, "--out", str(run_dir)], tmp_path, "", 2, env=ENV, port=port,
                             ranks=[1])
        (code, err), = _finish(again, timeout=60)
        assert all(p.poll() is None for p in procs), "the run stopped"
    finally:
        for p in procs:
            p.kill()
        _finish(procs, timeout=30)
    lines = [line for line in err.splitlines() if line.startswith("shaky: error:")]
    assert code == 2 and len(lines) == 1 and expected in lines[0], err[-2000:]


def test_survivors_of_rank_0_s_sigkill_train_on_and_keep_the_run_directory(tmp_path: Path) -> None:
    """Rank 0 is killed with SIGKILL by this test, once the evaluation at step 20 is written (a moment the test
    chooses, not a step an injector picks: it may fall in the checkpoint that follows). The run's store lives in
    the keeper (shaky.job.keeper), so the three survivors leave rank 0 out, rank 1 takes over the run directory,
    and they finish all 60 steps with status 0. The run directory is complete (every evaluation row once, the
    final checkpoint, trace and summary) and passes the resume check, and the simulator replaying its trace with
    that failure ends at the same parameters (to 1e-12, in float64) and the same accuracy."""
    run_dir = tmp_path / "run"
    procs = _launch([*ARGS, "--set", 'dtype="float64"', "--out", str(run_dir)], tmp_path, fault="")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _rows_with(run_dir, step=20):
            time.sleep(0.01)
        assert _rows_with(run_dir, step=20), "the run never reached step 20"
        procs[0].send_signal(signal.SIGKILL)
    finally:
        results = _finish(procs, timeout=180)
    assert results[0][0] == -signal.SIGKILL
    for rank in (1, 2, 3):
        code, err = results[rank]
        assert code == 0, f"rank {rank}: {err[-2000:]}"
    assert "shaky: rank 1 writes the run directory from step" in results[1][1], results[1][1][-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["live_workers"] == 3, summary
    (failure,) = summary["udp"]["failures"]
    assert failure["worker"] == 0 and 20 <= failure["step"] <= 30 and failure["rejoin"] == -1, failure
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(0, 61, 10)), rows
    assert rows[-1]["test_accuracy"] == summary["final_test_accuracy"]
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(
        ["checkpoint.pt", "config.toml", "machines.json", "metrics.jsonl", "shards.json", "summary.json",
         "trace.npz"])
    load_run_config(run_dir)       # what --resume checks first: config, checkpoint and rows agree
    assert load_checkpoint(run_dir)["counters"]["step"] == 60
    replay = _replayed(run_dir, tmp_path, [failure])
    # The live workers' rows (a dead worker's row is, in a udp checkpoint, the live ones' mean: what it would
    # take back; in the simulator's, its row when it died).
    torch.testing.assert_close(load_checkpoint(replay)["params"][1:], load_checkpoint(run_dir)["params"][1:],
                               rtol=0, atol=1e-12)
    assert json.loads((replay / "summary.json").read_text())["final_test_accuracy"] == \
        summary["final_test_accuracy"]


@pytest.mark.parametrize(("strategy", "setting", "per_20_steps"), [
    ("rps", "strategy.period=1", 20), ("local-sgd", "strategy.period=5", 4), ("local-sgd", "strategy.period=20", 3),
    ("dts", "strategy.delay=12", 20)])
def test_control_rounds_are_the_exchanges_and_the_loss_means_ride_in_them(strategy: str, setting: str,
                                                                        per_20_steps: int, tmp_path: Path) -> None:
    """With live membership the control plane is rounds through the control store, each a wait on it. A step's
    loss mean rides in the next round an exchange makes anyway: rps's masks every step; local SGD's average
    every ``period`` steps, so that the steps between make none, unless a mean has waited MAX_PENDING_LOSSES
    (8) steps or the run ends (period 20, 30 steps: rounds of their own after steps 8, 16, 28 and 30, the
    average's at 20; 10 steps: after 8 and 10). The carried losses are the right ones: the simulator replaying
    the run's trace gets the same training loss. dts with t = 12: a mean rides in the next exchange's round,
    which runs in the background and is taken in 11 steps later, with that exchange: no round of its own."""
    rounds, losses = {}, {}
    for steps in (10, 30):
        run_dir = tmp_path / f"run{steps}"
        args = ["--backend", "dist", "--transport", "udp", "--workers", "2", "--strategy", strategy, "--steps",
                str(steps), "--eval-every", str(steps), "--quiet", "--out", str(run_dir),
                "--set", setting]
        results = finish(launch_ranks(args, tmp_path, "", 2, env=ENV), timeout=120)
        assert all(code == 0 for code, _ in results), results
        summary = json.loads((run_dir / "summary.json").read_text())
        rounds[steps], losses[steps] = summary["udp"]["control_rounds"], summary["final_train_loss"]
    assert rounds[30] - rounds[10] == per_20_steps, rounds
    real = tmp_path / "run30"
    assert main(["train", "--config", str(real / "config.toml"), "--backend", "sim", "--transport", "gloo",
                 "--replay-trace", str(real), "--quiet", "--out", str(tmp_path / "replay")]) == 0
    replayed = json.loads((tmp_path / "replay" / "summary.json").read_text())["final_train_loss"]
    assert losses[30] == pytest.approx(replayed, rel=1e-5), (losses, replayed)


@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_with_every_packet_lossy_a_finished_run_ends_cleanly_on_every_rank(tmp_path: Path) -> None:
    """5% of every packet on the loopback dropped, the store's TCP included (a namespace of the test's own), and
    the store hosted by rank 0's process: every rank of a finished run exits 0. Rank 0 waits until the others
    are done with the store (they stopped with "rank 0, which hosts the run's store, is gone" when it left
    first), and no rank exits with its heartbeat thread inside a store call (that aborted it, SIGABRT)."""
    from test_udp import _real_loss_unavailable  # noqa: PLC0415

    why = _real_loss_unavailable()
    if why:
        pytest.skip(why)
    run_dir = tmp_path / "run"
    args = ["--backend", "dist", "--transport", "udp", "--workers", str(WORKERS), "--steps", "30",
            "--eval-every", "30", "--quiet", "--out", str(run_dir)]
    launcher = ("import json, sys; sys.path.insert(0, sys.argv[1]); from conftest import finish, launch_ranks; "
                "from pathlib import Path; "
                "results = finish(launch_ranks(json.loads(sys.argv[2]), Path(sys.argv[3]), '', int(sys.argv[4]), "
                "env=json.loads(sys.argv[5]), port=29400), timeout=200); print(json.dumps(results))")
    done = subprocess.run(["unshare", "--net", sys.executable, str(Path(__file__).parent / "netns.py"), "--loss",
                           "0.05", "--proto", "all", "--", sys.executable, "-c", launcher,
                           str(Path(__file__).parent), json.dumps(args), str(tmp_path), str(WORKERS),
                           json.dumps(ENV)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert [code for code, _ in results] == [0] * WORKERS, [(code, err[-300:]) for code, err in results]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 30


def test_under_an_agent_hosted_rendezvous_store_the_rounds_progress_and_heartbeats_are_kept_elsewhere(
        tmp_path: Path) -> None:
    """torchrun's agent hosts the rendezvous store in a process shaky cannot tune (its answers wait TCP's 200 ms
    after a loss): here the test hosts it, as the agent does (TORCHELASTIC_USE_AGENT_STORE). The control rounds,
    the per-step progress marks and the heartbeats go to the store rank 0 hosts (its address published in the
    rendezvous store, on a port of its own): after the run the rendezvous store holds none of their keys."""
    from datetime import timedelta  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    from shaky.job.rendezvous import keys  # noqa: PLC0415

    run_key = keys("0").run     # the attempt 0's, which the environment below names

    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    run_dir = tmp_path / "run"
    steps = 12
    args = ["--backend", "dist", "--transport", "udp", "--workers", "2", "--steps", str(steps), "--eval-every",
            str(steps), "--quiet", "--out", str(run_dir)]
    env = {**ENV, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    results = finish(launch_ranks(args, tmp_path, "", 2, env=env, port=port), timeout=120)
    assert all(code == 0 for code, _ in results), results
    summary = json.loads((run_dir / "summary.json").read_text())
    rounds = summary["udp"]["control_rounds"]
    assert rounds >= steps, summary["udp"]
    assert agent.check(["shaky/udp/1/control"])
    status, host, control_port = agent.get("shaky/udp/1/control").decode().split(" ")
    assert status == "ok" and host == "127.0.0.1" and int(control_port) != port
    assert agent.check(["shaky/udp/1/addr/1", run_key])          # what does belong there
    rounds_keys = [f"shaky/udp/1/q/{n}/{r}" for n in range(rounds) for r in (0, 1)]
    for key in [*rounds_keys, "shaky/step/0", "shaky/step/1", "shaky/beat/0", "shaky/beat/1"]:
        assert not agent.check([key]), key


def test_a_control_record_written_from_outside_the_run_stops_the_rank_and_is_never_used() -> None:
    """The control store takes writes from whoever reaches it: every value the control plane writes carries a
    tag of the run's key (bound to the run and the key's name), and a value that does not verify stops the
    rank with ForgedRecord instead of being averaged, whether it stands in for another rank's record, for a
    tombstone of this rank's own key, or is a genuine record moved to another key."""
    import threading  # noqa: PLC0415
    from datetime import timedelta  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    from shaky.membership.quorum import ForgedRecord, Quorum  # noqa: PLC0415

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    attacker = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    key, run = b"k" * 32, 7

    def quorum(rank: int, prefix: str) -> Quorum:
        return Quorum(lambda r: 0.0, rank, 2, prefix, 3.0, 10.0, ("127.0.0.1", server.port), key, run)

    def play(q: Quorum, record: bytes) -> dict[int, bytes]:    # the next round, with every rank live
        return q.round(q.take_seq(), record, q.live, admit=False).records

    # The honest round: each rank gets the other's record.
    zero, one = quorum(0, "honest"), quorum(1, "honest")
    got: dict[int, dict[int, bytes]] = {}
    thread = threading.Thread(target=lambda: got.__setitem__(1, play(one, b"from 1")))
    thread.start()
    got[0] = play(zero, b"from 0")
    thread.join(timeout=10)
    assert got[0] == got[1] == {0: b"from 0", 1: b"from 1"}

    # Another rank's record, forged (no valid tag): rank 0 stops instead of using it.
    attacker.set("forged/0/1", b"R" + b"evil" + bytes(16))
    with pytest.raises(ForgedRecord, match="'forged/0/1' does not verify"):
        play(quorum(0, "forged"), b"mine")
    # A forged tombstone in rank 0's own key, before rank 0's record: not taken for being left out, by either.
    attacker.set("tomb/0/0", b"D" + bytes(16))
    raised: list[BaseException] = []
    thread = threading.Thread(target=lambda: raised.append(pytest.raises(ForgedRecord, play, quorum(1, "tomb"),
                                                                          b"from 1").value))
    thread.start()
    with pytest.raises(ForgedRecord, match="'tomb/0/0' does not verify"):
        play(quorum(0, "tomb"), b"mine")
    thread.join(timeout=10)
    assert len(raised) == 1 and "'tomb/0/0' does not verify" in str(raised[0]), raised
    # A genuine record replayed under another key (another round) does not verify there either.
    attacker.set("replay/0/1", quorum(1, "replay").entry("replay/0/1", b"R" + b"round 0 of rank 1"))
    attacker.set("replay/1/1", attacker.get("honest/0/1"))
    zero = quorum(0, "replay")
    play(zero, b"round 0")      # the record sealed for replay/0/1 verifies there
    with pytest.raises(ForgedRecord, match="'replay/1/1' does not verify"):
        play(zero, b"round 1")


def test_a_ranks_control_rounds_run_at_once_in_threads_and_each_agrees_on_its_own_records() -> None:
    """A delayed exchange's control round runs in its lane's control thread while the training loop goes on
    and submits the next: one rank's rounds can be in flight at once, each in a thread with a store client of
    its own. Here rank 1 runs rounds 0 and 1 at once (round 1 written first) while rank 0 runs them one after
    the other: every round ends with the same records on both ranks, and a rank's three threads used three
    clients of the store."""
    import threading  # noqa: PLC0415
    from datetime import timedelta  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    from shaky.membership.quorum import Quorum  # noqa: PLC0415

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    zero, one = (Quorum(lambda r: 0.0, rank, 2, "at-once", 3.0, 10.0, ("127.0.0.1", server.port), b"k" * 32, 7)
                 for rank in (0, 1))
    first, second = one.take_seq(), one.take_seq()
    got: dict[tuple[int, int], dict[int, bytes]] = {}
    clients: list[object] = [one.client()]     # held: a thread's client goes with the thread

    def run(seq: int) -> None:
        clients.append(one.client())
        got[1, seq] = one.round(seq, f"1 in {seq}".encode(), (0, 1), admit=False).records

    later = threading.Thread(target=run, args=(second,))
    later.start()
    server.wait([f"at-once/{second}/1"], timedelta(seconds=10))     # round 1's record is in before round 0's
    earlier = threading.Thread(target=run, args=(first,))
    earlier.start()
    for seq in (zero.take_seq(), zero.take_seq()):
        got[0, seq] = zero.round(seq, f"0 in {seq}".encode(), (0, 1), admit=False).records
    for thread in (later, earlier):
        thread.join(timeout=10)
    for seq in (0, 1):
        assert got[0, seq] == got[1, seq] == {0: f"0 in {seq}".encode(), 1: f"1 in {seq}".encode()}, got
    assert len({id(c) for c in clients}) == 3


def _mailed_quorums(prefix: str, num_workers: int = 2) -> tuple[Any, list[Any], list[Any]]:
    """A control store, and the Quorums of ranks 0 and 1 of ``num_workers`` with mail between them (the run's
    key): (server, quorums, mails). The caller closes the mails."""
    from datetime import timedelta  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    from shaky.membership.mail import RoundMail  # noqa: PLC0415
    from shaky.membership.quorum import Quorum  # noqa: PLC0415

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    key, run_id = b"k" * 32, 7
    quorums = [Quorum(lambda r: 0.0, rank, num_workers, prefix, 1.0, 10.0, ("127.0.0.1", server.port), key, run_id)
               for rank in (0, 1)]
    mails = [RoundMail(rank, num_workers, key, run_id.to_bytes(8, "big"), "127.0.0.1", range(32000, 32100))
             for rank in (0, 1)]
    addresses = {rank: m.address for rank, m in enumerate(mails)}
    for q, m in zip(quorums, mails):
        m.set_peers(addresses)
        q.mail, q.live = m, (0, 1)
    return server, quorums, mails


def _round_on_both(quorums: list[Any], seq: int, records: tuple[bytes, bytes], *, admit: bool = False) -> list[Any]:
    """Round ``seq`` of ranks 0 and 1 (live: both) at once, each in a thread: their RoundResults."""
    import threading  # noqa: PLC0415

    got: list[Any] = [None, None]

    def run(rank: int) -> None:
        got[rank] = quorums[rank].round(seq, records[rank], (0, 1), admit=admit)
    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    return got


def test_rounds_go_by_mail_ask_again_for_a_lost_record_reject_strangers_and_fall_back_to_the_store() -> None:
    """Two ranks' Quorums with mail (shaky.membership.mail): a round's records come by mail, and the round
    waits for no store request; a record whose datagrams were all lost is asked for again and comes; a datagram
    from outside the run (a stranger's address, a forged tag) is rejected and never used; and a rank whose mail
    cannot get through (the other holds a wrong address for it) still ends its rounds, through the store, once
    it has waited the heartbeat timeout, with the same records on both ranks."""
    import socket  # noqa: PLC0415

    from shaky.membership import mail as mail_module  # noqa: PLC0415
    from shaky.membership.mail import RoundMail  # noqa: PLC0415

    _, quorums, mails = _mailed_quorums("mail")
    addresses = {rank: m.address for rank, m in enumerate(mails)}
    run_id = 7      # _mailed_quorums' run

    def both(seq: int, records: tuple[bytes, bytes]) -> list[dict[int, bytes]]:
        return [result.records for result in _round_on_both(quorums, seq, records)]

    try:
        assert both(0, (b"zero", b"one")) == [{0: b"zero", 1: b"one"}] * 2
        assert [q.mail_rounds for q in quorums] == [1, 1] and [q.store_rounds for q in quorums] == [0, 0]

        # Rank 1's record of round 1 is lost on its way (every copy): rank 0 asks again, and it comes.
        real_send = mails[1]._send
        dropped: list[int] = []
        mails[1]._send = lambda data, r: dropped.append(r) if not dropped or len(dropped) < 2 else real_send(data, r)
        assert both(1, (b"a", b"b")) == [{0: b"a", 1: b"b"}] * 2
        mails[1]._send = real_send
        assert dropped and mails[0].asked >= 1 and quorums[0].mail_rounds == 2

        # Strangers: a datagram from another socket, and one from nowhere with a tag under another key.
        stranger = RoundMail(1, 2, b"x" * 32, run_id.to_bytes(8, "big"), "127.0.0.1", range(32000, 32100))
        stranger.set_peers(addresses)
        stranger.post(2, b"forged", [0])
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
            raw.sendto(b"noise" * 10, addresses[0])
        deadline = time.monotonic() + 5
        while mails[0].rejected < 1 + mail_module.COPIES and time.monotonic() < deadline:
            time.sleep(0.01)
        stranger.close()
        assert mails[0].rejected == 1 + mail_module.COPIES
        assert both(2, (b"c", b"d")) == [{0: b"c", 1: b"d"}] * 2      # the forged record of round 2 never used

        # Rank 0 holds a wrong address for rank 1 (its datagrams are rejected, its asks go nowhere): both end
        # round 3 through the store after the heartbeat timeout (1 s here), with the same records.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as nowhere:
            nowhere.bind(("127.0.0.1", 0))
            mails[0].set_peers({1: nowhere.getsockname()})
            t0 = time.monotonic()
            assert both(3, (b"e", b"f")) == [{0: b"e", 1: b"f"}] * 2
        assert time.monotonic() - t0 >= 1.0 and quorums[0].store_rounds == 1
    finally:
        for m in mails:
            m.close()


def test_a_record_of_many_datagrams_goes_by_mail_in_fragments_lost_ones_are_asked_for_and_bad_ones_rejected() -> None:
    """A record larger than a datagram (an evaluation's mean of the model) travels by mail in fragments: the
    round waits for no store request, fragments lost on their way are asked for by number and come, and the
    records are whole on both ranks. Fragments that no sender following the protocol makes (a count that
    disagrees with the others', an index past the count, a short fragment before the last, more fragments than
    any record by mail has) are rejected even sealed with the run's key, and never used. A record of one
    datagram goes in more copies while the network is lossy. A record over MAIL_RECORD_BYTES goes by the
    store."""
    from shaky.membership import mail as mail_module  # noqa: PLC0415
    from shaky.membership.mail import FRAGMENT_BYTES, MAIL_RECORD_BYTES  # noqa: PLC0415

    _, quorums, mails = _mailed_quorums("frag")

    def both(seq: int, records: tuple[bytes, bytes]) -> list[dict[int, bytes]]:
        return [result.records for result in _round_on_both(quorums, seq, records)]

    rng = np.random.default_rng(0)
    big = [rng.bytes(40 * FRAGMENT_BYTES + 17), rng.bytes(40 * FRAGMENT_BYTES + 17)]
    try:
        # Rank 1's fragments 3 and 39 are lost the first time they are sent: rank 0 asks for them by number.
        real_send = mails[1]._send
        sent: list[int] = []

        def lossy(data: bytes, r: int) -> None:
            index = mail_module._HEADER.unpack_from(data)[4]
            sent.append(index)
            if index in (3, 39) and sent.count(index) == 1:
                return
            real_send(data, r)
        mails[1]._send = lossy
        assert both(0, (big[0], big[1])) == [{0: big[0], 1: big[1]}] * 2
        mails[1]._send = real_send
        assert sent.count(3) == 2 and sent.count(39) == 2 and sent.count(0) == 1   # only the lost ones again
        assert mails[0].asked >= 1 and [q.mail_rounds for q in quorums] == [1, 1]
        assert [q.store_rounds for q in quorums] == [0, 0]

        # Bad fragments sealed with the run's key, from rank 1's address: each is rejected, none is used.
        forger = mails[1]
        bad = [forger._seal(b"R", 1, b"x" * FRAGMENT_BYTES, 0, 3),          # count 3 ...
               forger._seal(b"R", 1, b"x" * FRAGMENT_BYTES, 1, 4),          # ... then count 4 for the same record
               forger._seal(b"R", 1, b"x" * 10, 5, 5),                      # an index past the count
               forger._seal(b"R", 1, b"x" * 10, 0, 5),                      # a short fragment before the last
               forger._seal(b"R", 1, b"x" * (FRAGMENT_BYTES + 1), 0, 1),    # longer than a fragment
               forger._seal(b"R", 1, b"x", 0, MAIL_RECORD_BYTES // FRAGMENT_BYTES + 2)]   # too many fragments
        rejected = mails[0].rejected
        for datagram in bad:
            real_send(datagram, 0)
        deadline = time.monotonic() + 5
        while mails[0].rejected < rejected + len(bad) - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mails[0].rejected == rejected + len(bad) - 1     # the first (count 3) was taken, as a fragment
        assert both(1, (b"c", b"d")) == [{0: b"c", 1: b"d"}] * 2   # round 1 is rank 1's real record, whole

        # A record of one datagram goes COPIES times, LOSSY_COPIES while the data plane finds the network lossy.
        sends: list[int] = []
        mails[1]._send = lambda data, r: sends.append(r)
        mails[1].post(90, b"x", [0])
        mails[1]._lossy = lambda: True
        mails[1].post(91, b"y", [0])
        mails[1]._send = real_send
        assert len(sends) == mail_module.COPIES + mail_module.LOSSY_COPIES == 5

        # A record over MAIL_RECORD_BYTES goes by the store.
        huge = b"h" * (MAIL_RECORD_BYTES + 1)
        assert both(2, (huge, huge)) == [{0: huge, 1: huge}] * 2
        assert [q.store_rounds for q in quorums] == [1, 1]
    finally:
        for m in mails:
            m.close()


def test_a_round_that_may_take_a_rank_back_goes_by_mail_and_every_survivor_takes_back_the_same() -> None:
    """Rank 2 is out of a 3-rank run; ranks 0 and 1 run a round that may take ranks back (a step's first). The
    heartbeat thread's look finds a process started again asking for rank 2 (its join key); a round in which
    any survivor saw it takes rank 2 back on both, by mail, with no store round; one in which nobody saw it
    takes nobody back; and the records come back as they were written."""
    server, quorums, mails = _mailed_quorums("admit", num_workers=3)

    def both(seq: int) -> list[tuple[dict[int, bytes], tuple[int, ...]]]:
        return [(result.records, result.admitted)
                for result in _round_on_both(quorums, seq, (b"r0", b"r1"), admit=True)]

    try:
        assert both(0) == [({0: b"r0", 1: b"r1"}, ())] * 2
        quorums[0].look_for_joins(server)
        assert quorums[0].asking == frozenset()
        server.set(quorums[0].join_key(2), "asks")
        quorums[0].look_for_joins(server)       # rank 1 has not looked yet: rank 0's record alone names rank 2
        assert quorums[0].asking == {2} and quorums[1].asking == frozenset()
        assert both(1) == [({0: b"r0", 1: b"r1"}, (2,))] * 2
        assert [q.mail_rounds for q in quorums] == [2, 2] and [q.store_rounds for q in quorums] == [0, 0]
    finally:
        for m in mails:
            m.close()


def test_the_store_sockets_get_a_minimum_retransmission_timeout_of_milliseconds_and_no_other_socket_does() -> None:
    """shorten_store_retransmits sets TCP_RTO_MIN_US on the store's listening socket, on the connections it
    accepted, and on its clients' (found by port), and on no other socket of the process: not on a TCP
    connection to another port, not on a UDP socket of the same port number."""
    import socket  # noqa: PLC0415
    from datetime import timedelta  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    from shaky.membership.quorum import _TCP_RTO_MIN_US, STORE_RTO_MIN_MS, shorten_store_retransmits  # noqa: PLC0415

    def rto_min_ms(sock: socket.socket) -> float:
        return sock.getsockopt(socket.IPPROTO_TCP, _TCP_RTO_MIN_US) / 1000

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    before = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    with socket.create_server(("127.0.0.1", 0)) as other, socket.socket(type=socket.SOCK_DGRAM) as udp:
        elsewhere = socket.create_connection(other.getsockname())
        accepted, _ = other.accept()
        try:
            default = rto_min_ms(elsewhere)
        except OSError:
            pytest.skip("this kernel has no TCP_RTO_MIN_US (Linux 6.11 on)")
        held = shorten_store_retransmits(port)
        assert held is not None and STORE_RTO_MIN_MS <= held < default == 200.0, (held, default)
        made_before = _sockets_on(port)     # the listener, and both ends of the master's client and of the other
        assert len(made_before) >= 5 and set(made_before.values()) == {held}, made_before
        after = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        after.set("k", "v")
        # The store accepted it with the listener's minimum; the new client's own end is its own to set.
        new = {ends: ms for ends, ms in _sockets_on(port).items() if ends not in made_before}
        assert sorted(new.values()) == [held, default], new
        assert {ms for (local, _), ms in new.items() if local == port} == {held}, new
        assert shorten_store_retransmits(port) == held and set(_sockets_on(port).values()) == {held}
        assert rto_min_ms(elsewhere) == rto_min_ms(accepted) == default
        udp.bind(("127.0.0.1", port))      # a UDP socket on the store's port number is not the store's
        assert shorten_store_retransmits(port) == held
        elsewhere.close()
        accepted.close()
    del server, before, after



def _sockets_on(port: int) -> dict[tuple[int, int | None], float]:
    """Every TCP socket of this process to or from ``port``: (local port, remote port) -> TCP_RTO_MIN_US in ms."""
    import socket  # noqa: PLC0415

    from shaky.membership.quorum import _TCP_RTO_MIN_US, store_sockets  # noqa: PLC0415

    found = {}
    for sock in store_sockets(port):
        try:
            remote = sock.getpeername()[1]
        except OSError:
            remote = None
        found[(sock.getsockname()[1], remote)] = sock.getsockopt(socket.IPPROTO_TCP, _TCP_RTO_MIN_US) / 1000
    return found


def test_a_rank_paused_past_the_heartbeat_timeout_asks_whether_it_was_left_out_before_its_next_round() -> None:
    """Rank 2 of 3 stood still (SIGSTOP) longer than dist.heartbeat_timeout_s, and the others left it out
    meanwhile (the live set says 0,1) and went on. Its next round asks first and stops with LeftBehind before it
    writes anything, where it used to write its record and wait for the others' (as long as their heartbeats
    look fresh, up to the whole timeout), by which time a short run's store can be gone. Not paused, the same
    rank writes its record first (and finds out after its wait)."""
    from datetime import timedelta  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    from shaky.membership.quorum import LeftBehind, Quorum  # noqa: PLC0415

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))

    def quorum(rank: int, prefix: str, paused: float) -> Quorum:
        return Quorum(lambda r: 0.0, rank, 3, prefix, 0.5, 10.0, ("127.0.0.1", server.port), b"k" * 32, 7,
                       paused_s=lambda reset=False: paused)

    for prefix, paused in (("paused", 10.0), ("awake", 0.0)):
        quorum(0, prefix, 0.0).publish_live([0, 1])      # what the survivors wrote when they left rank 2 out
        woken = quorum(2, prefix, paused)
        with pytest.raises(LeftBehind, match="rank 2 was declared dead by the others"):
            woken.round(woken.take_seq(), b"late", (0, 1, 2), admit=False)
        assert server.check([f"{prefix}/0/2"]) == (paused == 0.0)


@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
@pytest.mark.parametrize("victim", [2, 0])
def test_a_users_loop_with_the_udp_averager_survives_a_sigkilled_rank(victim: int, tmp_path: Path) -> None:
    """examples/rps_averager.py --transport udp, three ranks started by hand (as its docstring and the README
    say survivors need): a rank, rank 0 too (its store is the keeper's: shaky.init_process_group), is SIGKILLed
    when it reports step 100, a moment this test chooses, not an injected fault at a step. The other two go on
    with two live workers, finish all 400 steps with status 0, and learn (test accuracy above 0.8, as the gloo
    example's test asks)."""
    script = Path(__file__).resolve().parents[1] / "examples" / "rps_averager.py"
    procs = launch_ranks(["--transport", "udp", "--steps", "400", "--log-every", "20"], tmp_path, workers=3,
                         env={**ENV, "TORCH_CPP_LOG_LEVEL": "ERROR"}, command=[sys.executable, str(script)])
    survivors = [r for r in range(3) if r != victim]
    try:
        seen = []
        for line in procs[victim].stdout:      # type: ignore[union-attr]
            seen.append(line)
            if line.startswith(f"rank {victim}: step 100,"):
                procs[victim].kill()
                break
        else:
            pytest.fail(f"rank {victim} never reached step 100: {''.join(seen)[-1000:]} "
                        f"{procs[victim].stderr.read()[-2000:]}")
        assert "live workers 3" in seen[-1]
        outs = [procs[r].communicate(timeout=120) for r in survivors]
    finally:
        for p in procs:
            p.kill()
    assert procs[victim].wait() == -signal.SIGKILL
    for rank, p, (out, err) in zip(survivors, [procs[r] for r in survivors], outs):
        assert p.returncode == 0, f"rank {rank}: {err[-2000:]}"
        logged = [int(n) for n in re.findall(rf"rank {rank}: step \d+, loss [\d.]+, live workers (\d)", out)]
        assert len(logged) == 400 // 20 and logged[:5] == [3] * 5 and logged[-1] == 2, out
        assert logged == sorted(logged, reverse=True), out       # left out once, for good
        final = re.search(rf"rank {rank}: test accuracy ([\d.]+), messages dropped \d+ of \d+, live workers 2", out)
        assert final is not None and float(final[1]) > 0.8, out
