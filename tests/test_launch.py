"""``shaky launch``: a rank that dies is started again alone, and the survivors are left to train on."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from shaky.cli import main
from shaky import launch
from shaky.launch import (LAUNCHED_BY, NO_RESTARTS_LEFT, NOT_TOLD, NOT_WRITTEN, ONLY_UDP_TAKES_BACK,
                          RUN_GOES_ON, Launcher, LaunchConfig, exit_status, group_restart_decision,
                          free_port, restart_decision, resume_args, train_command)

ARGS = ["--transport", "udp", "--workers", "3", "--eval-every", "100", "--quiet", "--set", "network.compute_ms=1.0"]


def _launch(tmp_path: Path, steps: int, fault: str = "", restarts: int = 1,
            launch_args: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("SHAKY_KEY", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    return subprocess.Popen([sys.executable, "-m", "shaky", "launch", "--nproc-per-node", "3", "--max-restarts",
                             str(restarts), *launch_args, "train", *ARGS, "--steps", str(steps), "--out",
                             str(tmp_path / "run")],
                            cwd=tmp_path, env={**env, "SHAKY_INJECT_FAULT": fault}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, err


@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_a_killed_rank_is_started_again_alone_and_taken_back(tmp_path: Path) -> None:
    """Rank 2 gets SIGKILL before step 25: the launcher starts it again (and only it), the survivors take it
    back, and the run ends with 3 live workers and status 0. The udp key reached the ranks from the launcher,
    not through the rendezvous store (no rank warns of that)."""
    code, err = _finish(_launch(tmp_path, 200, "kill:2:25"))
    assert code == 0, err[-3000:]
    assert "shaky launch: rank 2 killed by SIGKILL; starting it again (1 of 1)" in err, err
    assert "handed out through the rendezvous store" not in err, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 200 and summary["live_workers"] == 3, summary
    changes = summary["udp"]["membership_changes"]
    assert [c["live"] for c in changes] == [[0, 1], [0, 1, 2]] and changes[1]["rejoined"] == [2], changes


def test_log_dir_keeps_each_rank_s_output_behind_a_header_per_process_and_still_shows_it(tmp_path: Path) -> None:
    """--log-dir: each rank's output goes to logs/rank-R.log as well as to the launcher's own (a tee), a header
    line before each process the rank is started as: rank 2, killed and started again, has two; the launcher's
    stdout still carries rank 0's last line, which its log holds too."""
    proc = _launch(tmp_path, 60, "kill:2:25", launch_args=("--log-dir", "logs"))
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "shaky launch: rank 2 killed by SIGKILL; starting it again (1 of 1)" in err, err
    logs = {rank: (tmp_path / "logs" / f"rank-{rank}.log").read_text() for rank in range(3)}
    headers = {rank: [line for line in text.splitlines() if line.startswith(f"shaky launch: rank {rank}, process ")]
               for rank, text in logs.items()}
    assert [len(h) for h in headers.values()] == [1, 1, 2], headers
    assert headers[2][1].startswith("shaky launch: rank 2, process 2, pid "), headers
    assert logs[2].startswith(headers[2][0]), logs[2]
    line = f"run directory: {tmp_path / 'run'}"
    assert line in out.splitlines() and line in logs[0].splitlines(), (out, logs[0])


@pytest.mark.parametrize("restarts", [0, 1])
@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_a_dead_rank_0_is_started_again_alone_and_the_others_train_on(restarts: int, tmp_path: Path) -> None:
    """udp: rank 0 gets SIGKILL before step 25. The run's store is the keeper's, so the others train on (rank 1
    writes the run directory from its next row on, if rank 0 is still out then); with a restart left the
    launcher starts rank 0 again alone and it is taken back (often the step after it was left out, before the
    next row: it writes again, and says so), without one it says so. Either way the run finishes all its
    steps, with every row once, and the launcher's status is 0 (a rank lost on the way is membership)."""
    code, err = _finish(_launch(tmp_path, 200, "kill:0:25", restarts=restarts))
    assert code == 0, err[-3000:]
    assert "is gone" not in err and "--resume" not in err, err[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 200, summary
    rows = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [0, 100, 200], rows
    changes = summary["udp"]["membership_changes"]
    if restarts:
        assert "shaky launch: rank 0 killed by SIGKILL; starting it again (1 of 1)" in err, err
        assert summary["live_workers"] == 3 and [c["live"] for c in changes] == [[1, 2], [0, 1, 2]], changes
        assert changes[1]["rejoined"] == [0], changes
    else:
        assert ("shaky launch: rank 0 killed by SIGKILL; not started again: "
                f"{NO_RESTARTS_LEFT} (0 of --max-restarts 0)") in err, err
        assert summary["live_workers"] == 2 and [c["live"] for c in changes] == [[1, 2]], changes
    _check_the_writer(err, changes, rows)


def _check_the_writer(err: str, changes: list[dict], writes: list[int]) -> None:
    """Which rank said it writes the run directory after rank 0 was left out (``changes[0]``, and taken back at
    ``changes[1]`` if there is one). Each step in ``writes`` (rows, checkpoints) is written by the first live
    rank of the step before it: if one fell while rank 0 was out, rank 1 took over and stays the writer; else
    rank 0, taken back first (often the step after it was left out: take-backs ride in the round's records),
    writes again from the first one after."""
    back = changes[1]["step"] if len(changes) > 1 else max(writes) + 1
    if any(changes[0]["step"] <= step - 1 < back for step in writes):
        assert "shaky: rank 1 writes the run directory from step" in err, err[-3000:]
        assert "shaky: rank 0 writes" not in err, err[-3000:]
    else:
        first = min(step for step in writes if step - 1 >= back)
        assert f"shaky: rank 0 writes the run directory from step {first} on (taken back)" in err, err[-3000:]


@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_two_launchers_one_a_machine_make_one_run_and_the_second_starts_its_dead_rank_again(tmp_path: Path) -> None:
    """The README's two-machine command, both machines played by this one: 2 ranks each, a key file on both.
    Rank 3 (the second launcher's) dies at step 40 and that launcher starts it again; the run ends with 4 live
    workers, both launchers with status 0, and only rank 0's machine prints the run directory."""
    env = {k: v for k, v in os.environ.items() if k not in ("SHAKY_KEY", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    (tmp_path / "shaky.key").write_text(os.urandom(32).hex())
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--nproc-per-node",
              "2", "--max-restarts", "1", "train", *ARGS[:2], "--workers", "4", *ARGS[4:], "--steps", "200",
              "--key-file", str(tmp_path / "shaky.key"), "--out", str(tmp_path / "run")]
    procs = [subprocess.Popen([sys.executable, "-m", "shaky", "launch", "--node-rank", str(node), *common],
                              cwd=tmp_path, env={**env, "SHAKY_INJECT_FAULT": "kill:3:40"}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for node in (1, 0)]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=120))
        finally:
            proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0], outs
    (out1, err1), (out0, _) = outs
    assert "shaky launch: rank 3 killed by SIGKILL; starting it again (1 of 1)" in err1, err1
    assert out0.strip() == f"run directory: {tmp_path / 'run'}" and not out1.strip(), outs
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["live_workers"] == 4 and summary["udp"]["membership_changes"][-1]["rejoined"] == [3], summary


@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_on_gloo_the_launcher_resumes_every_rank_and_the_run_ends_as_one_never_stopped(tmp_path: Path) -> None:
    """gloo: rank 1 dies at step 30 and takes the run with it; with --max-restarts 1 the launcher starts every rank
    again from the step-20 checkpoint (rank 1 once, without the injected fault), and the run's metrics and
    summary equal those of a run never stopped, in every number but the measured seconds (the compute time is
    fixed: a run measures its own otherwise)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SHAKY_KEY", "RANK", "WORLD_SIZE", "MASTER_PORT")}

    def launch(out: Path, restarts: str, fault: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "shaky", "launch", "--nproc-per-node", "2", "--max-restarts",
                               restarts, "train", "--workers", "2", "--steps", "60", "--checkpoint-every", "20",
                               "--set", "network.compute_ms=1.0", "--quiet", "--out", str(out)], cwd=tmp_path,
                              env={**env, "SHAKY_INJECT_FAULT": fault},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    err = launch(tmp_path / "stopped", "1", "kill:1:30")
    assert ("shaky launch: rank 1 killed by SIGKILL and the run stopped; starting every rank again from its last "
            f"checkpoint: train --resume {tmp_path / 'stopped'} (1 of 1)") in err, err
    launch(tmp_path / "whole", "0", "")

    def numbers(out: Path) -> tuple[list[dict], dict]:
        measured = ("wall_time_s", "eval_time_s", "wait_s")    # seconds of this machine's clock
        rows = [{k: v for k, v in json.loads(line).items() if k not in measured}
                for line in (out / "metrics.jsonl").read_text().splitlines()]
        summary = {k: v for k, v in json.loads((out / "summary.json").read_text()).items() if k not in measured}
        return rows, summary

    assert numbers(tmp_path / "stopped") == numbers(tmp_path / "whole")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL])
def test_a_signal_to_the_launcher_stops_every_rank_after_the_same_step_with_a_checkpoint(
        signum: int, tmp_path: Path) -> None:
    """SIGINT is passed on to every rank (status 130); a launcher killed outright takes its ranks with it, each
    told by SIGTERM (PR_SET_PDEATHSIG), so no rank outlives it and the checkpoint is written either way."""
    proc = _launch(tmp_path, 1_000_000)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.exists() and metrics.stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signum)
    code, err = _finish(proc, timeout=60)
    assert code == (130 if signum == signal.SIGINT else -signal.SIGKILL), err[-3000:]
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    deadline = time.monotonic() + 30
    while not checkpoint.exists() and time.monotonic() < deadline:   # (SIGKILL: the ranks stop on their own)
        time.sleep(0.1)
    assert checkpoint.exists(), err[-3000:]
    # (communicate returned: every rank, which shares the launcher's stderr, has exited)
    assert f"stopped by {'SIGINT' if signum == signal.SIGINT else 'SIGTERM'} after step" in err, err
    assert "`shaky launch --nproc-per-node 3" in err, err


@pytest.mark.parametrize(("rank", "status", "used", "rank0_running", "stopping", "expected"), [
    (2, -signal.SIGKILL, 0, True, False, None),
    (2, -signal.SIGKILL, 0, True, False, ONLY_UDP_TAKES_BACK),   # gloo (the transport is the test's)
    (2, -signal.SIGKILL, 0, True, False, "unknown"),              # before rank 0 said the transport
    (2, 17, 0, True, False, None),                 # a crash
    (2, 3, 0, True, False, None),                  # left out after a freeze: taken back when started again
    (2, -signal.SIGKILL, 1, True, False, NO_RESTARTS_LEFT),
    (2, -signal.SIGKILL, 0, False, False, "rank 0 has ended"),
    (0, -signal.SIGKILL, 0, True, False, None),    # udp: rank 0 too (the store is the keeper's)
    (0, -signal.SIGKILL, 0, True, False, ONLY_UDP_TAKES_BACK),   # gloo
    (2, 0, 0, True, False, "it finished"),
    (2, 2, 0, True, False, "bad input"),
    (2, 4, 0, True, False, "diverged"),
    (2, 130, 0, True, False, "stopping on request"),
    (2, -signal.SIGTERM, 0, True, False, "stopping on request"),
    (2, -signal.SIGKILL, 0, True, True, "stopping on request"),
    (2, 3, 0, True, False, "stopped with the run"),  # rank 0 on another machine went: the rank said so
])
def test_restart_decision(rank: int, status: int, used: int, rank0_running: bool, stopping: bool,
                          expected: str | None) -> None:
    transport = {ONLY_UDP_TAKES_BACK: "gloo", "unknown": None}.get(str(expected), "udp")
    why = restart_decision(rank, status, restarts_used=used, max_restarts=1, rank0_running=rank0_running,
                           stopping=stopping, transport=transport, run_stopped=expected == "stopped with the run")
    expected = "the run stopped: there is no run to rejoin" if expected == "stopped with the run" else expected
    assert why is None if expected is None else (ONLY_UDP_TAKES_BACK if expected == "unknown" else expected) in why


@pytest.mark.parametrize(("statuses", "expected"), [
    ({0: 0, 1: 0, 2: -signal.SIGKILL}, 0),      # the run finished; the rank lost on the way is membership
    ({0: -signal.SIGKILL, 1: 3, 2: 3}, 137),
    ({0: -signal.SIGKILL, 1: 0, 2: 0}, 0),      # udp: the survivors of rank 0 finished the run
    ({0: 2, 1: 2}, 2),
    ({3: 3, 4: 0}, 0),                          # a machine without rank 0, one of whose ranks finished
    ({3: 3, 4: -signal.SIGKILL}, 3),
])
def test_exit_status(statuses: dict[int, int], expected: int) -> None:
    assert exit_status(statuses) == expected


@pytest.mark.parametrize(("argv", "expected"), [
    (["--nproc-per-node", "2", "demo"], "the command to launch must be `train ...`"),
    (["--nproc-per-node", "2"], "got 'nothing'"),
    (["--nproc-per-node", "0", "train"], "nproc-per-node must be an integer >= 1, got 0"),
    (["--nproc-per-node", "2", "--max-restarts", "-1", "train"], "max-restarts must be an integer >= 0, got -1"),
    (["--nproc-per-node", "2", "--nnodes", "2", "train"], "master-port must be given with nnodes > 1"),
    (["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", "--master-port", "29500", "train"],
     "node-rank must be below nnodes (2), got 2"),
    (["--nproc-per-node", "2", "train", "--backend", "sim"], "--backend must be dist under shaky launch"),
    (["--nproc-per-node", "2", "train", "--backend=sim"], "--backend must be dist under shaky launch"),
])
def test_bad_launch_input_is_one_line_and_status_2(argv: list[str], expected: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


def test_a_run_stopped_by_a_dead_rank_resumes_with_the_line_it_printed(tmp_path: Path) -> None:
    """gloo: rank 1 dies at step 30, rank 0 stops (status 3) with the launcher's resume line, and that line, run
    as it says (the launcher adds no --backend to a resumed run), finishes the run from the step-20 checkpoint."""
    env = {k: v for k, v in os.environ.items() if k not in ("SHAKY_KEY", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    launch = [sys.executable, "-m", "shaky", "launch", "--nproc-per-node", "2", "train"]
    run = tmp_path / "run"
    first = subprocess.run([*launch, "--workers", "2", "--steps", "60", "--checkpoint-every", "20", "--quiet",
                            "--out", str(run)], cwd=tmp_path, env={**env, "SHAKY_INJECT_FAULT": "kill:1:30"},
                           capture_output=True, text=True, timeout=120)
    assert first.returncode == 3, first.stderr
    assert f"at step 20; resume with `shaky launch --nproc-per-node 2 train ... --resume {run}`" in first.stderr
    second = subprocess.run([*launch, "--resume", str(run), "--quiet"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 60


def test_the_launcher_adds_backend_dist_except_to_a_resumed_run() -> None:
    assert train_command(["train", "--workers", "2"]) == ["--workers", "2", "--backend", "dist"]
    assert train_command(["train", "--resume", "runs/x"]) == ["--resume", "runs/x"]
    assert train_command(["train", "--resume=runs/x"]) == ["--resume=runs/x"]


def test_a_simulator_run_is_not_resumed_by_the_launchers_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main(["train", "--workers", "2", "--steps", "2", "--quiet", "--out", str(run)]) == 0
    monkeypatch.setenv(LAUNCHED_BY, "shaky launch --nproc-per-node 1 train ...")
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--quiet"]) == 2
    assert capsys.readouterr().err == (f"shaky: error: --resume {run}: a run on backend 'sim', and shaky launch runs "
                                       f"backend 'dist' (resume it with `shaky train --resume {run}`)\n")


def _hiding(path: Path) -> list[str]:
    """A command prefix that runs the command where ``path`` is an empty directory (a private mount namespace with
    a tmpfs over it): another machine, with no copy of what is there."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"',
            str(path)]


def _why_no_mount_namespace() -> str:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare (a mount namespace plays a machine without the run directory)"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    return "" if probe.returncode == 0 else "unshare --mount is refused here"


def _two_machines(tmp_path: Path, train_args: list[str], fault: str = "", restarts: int = 0,
                  during: Callable[[int], None] | None = None) -> list[tuple[int, str]]:
    """Two launchers (--nnodes 2, 2 ranks each) on this machine: node 0 works in tmp_path/a, node 1 in tmp_path/b
    and sees tmp_path/a empty; ``during(port)``, given MASTER_PORT, runs once both are started. Returns each
    node's (status, stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SHAKY_KEY", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    port = free_port()
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--nproc-per-node",
              "2", "--max-restarts", str(restarts), "train", *train_args]
    (tmp_path / "a").mkdir(exist_ok=True)
    (tmp_path / "b").mkdir(exist_ok=True)
    launch = [sys.executable, "-m", "shaky", "launch"]
    procs = [subprocess.Popen([*_hiding(tmp_path / "a"), *launch, "--node-rank", "1", *common], cwd=tmp_path / "b",
                              env={**env, "SHAKY_INJECT_FAULT": fault}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True),
             subprocess.Popen([*launch, "--node-rank", "0", *common], cwd=tmp_path / "a",
                              env={**env, "SHAKY_INJECT_FAULT": fault}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)]
    if during is not None:
        try:
            during(port)
        except BaseException:
            for proc in procs:
                proc.kill()
            raise
    ends = []
    for proc in procs[::-1]:
        try:
            ends.append((proc.communicate(timeout=150)[1], proc.returncode))
        finally:
            proc.kill()
    return [(code, err) for err, code in ends]


GLOO_RUN = ["--workers", "4", "--steps", "60", "--checkpoint-every", "20", "--set", "network.compute_ms=1.0", "--quiet"]
"""A gloo run of 4 ranks with checkpoints at steps 20 and 40 (the compute time fixed: a run measures its own)."""


def _numbers(out: Path) -> tuple[list[dict], dict]:
    """Every number of a run's metrics.jsonl and summary.json but the seconds of this machine's clock."""
    measured = ("wall_time_s", "eval_time_s", "wait_s")
    rows = [{k: v for k, v in json.loads(line).items() if k not in measured}
            for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, {k: v for k, v in json.loads((out / "summary.json").read_text()).items() if k not in measured}


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict]:
    """The numbers of :data:`GLOO_RUN` never stopped, on one launcher."""
    out = tmp_path_factory.mktemp("whole") / "run"
    whole = subprocess.run([sys.executable, "-m", "shaky", "launch", "--nproc-per-node", "4", "train", *GLOO_RUN,
                            "--out", str(out)], capture_output=True, text=True, timeout=150,
                           env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")})
    assert whole.returncode == 0, whole.stderr
    return _numbers(out)


@pytest.mark.kill   # (make test-kill: minutes of restarts over two machines)
@pytest.mark.skipif(bool(_why_no_mount_namespace()), reason=_why_no_mount_namespace() or "-")
def test_a_run_over_two_machines_resumes_where_only_rank_0_s_machine_has_its_directory(
        tmp_path: Path, never_stopped: tuple[list[dict], dict]) -> None:
    """gloo over two launchers, the second of which never sees the run directory: rank 3 dies at step 30 and
    stops the run; `--resume run` on both machines (the second's `run` does not exist) finishes it, rank 0 handing
    the config and the checkpoint to the others, and every number of metrics.jsonl and summary.json equals that
    of a run never stopped but the measured seconds."""
    stopped = _two_machines(tmp_path, [*GLOO_RUN, "--out", "run"], "kill:3:30")
    assert [code for code, _ in stopped] == [3, 3], stopped
    assert "rank 3 stopped answering after step 29" in stopped[0][1], stopped
    resumed = _two_machines(tmp_path, ["--resume", "run", "--quiet"])
    assert [code for code, _ in resumed] == [0, 0], resumed
    assert _numbers(tmp_path / "a" / "run") == never_stopped
    assert not (tmp_path / "b" / "run").exists()


@pytest.mark.kill   # (make test-kill: minutes of restarts over two machines)
@pytest.mark.skipif(bool(_why_no_mount_namespace()), reason=_why_no_mount_namespace() or "-")
def test_over_two_machines_each_launcher_starts_its_ranks_again_and_the_run_ends_as_one_never_stopped(
        tmp_path: Path, never_stopped: tuple[list[dict], dict]) -> None:
    """gloo, --max-restarts 1 on both launchers: rank 3, on the machine without the run directory, dies at step
    30 and stops the run; each launcher starts its ranks again with --resume of rank 0's directory (which the
    second one does not have: its ranks take what they need from rank 0), and the run ends as one never stopped,
    both launchers with status 0."""
    (code0, err0), (code1, err1) = _two_machines(tmp_path, [*GLOO_RUN, "--out", "run"], "kill:3:30", restarts=1)
    assert (code0, code1) == (0, 0), (err0, err1)
    again = f"starting the ranks here again from its last checkpoint: train --resume {tmp_path / 'a' / 'run'} (1 of 1)"
    assert f"shaky launch: rank 3 killed by SIGKILL and the run stopped; {again}" in err1, err1
    assert f"shaky launch: the run stopped (rank 0 exited with status 3); {again}" in err0, err0
    assert _numbers(tmp_path / "a" / "run") == never_stopped


@pytest.mark.skipif(bool(_why_no_mount_namespace()), reason=_why_no_mount_namespace() or "-")
@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_over_two_machines_each_resumes_with_its_own_data_path(tmp_path: Path) -> None:
    """The same command line on both machines names a data file by a relative path, so each machine's data.path
    is its own (tmp_path/a/data.tsv, tmp_path/b/data.tsv: the second machine cannot see the first's). Rank 3 dies
    at step 30 and both launchers start their ranks again with --resume alone: the second machine's ranks read
    their own file again (recorded in machines.json at the run's start), not rank 0's, and the run ends."""
    from test_train import write_text_set

    for machine in ("a", "b"):
        (tmp_path / machine).mkdir()
        write_text_set(tmp_path / machine / "data.tsv")
    args = [*GLOO_RUN, "--dataset", "text", "--model", "lstm", "--batch-size", "8", "--set", "model.hidden=16",
            "--set", "data.max_len=8", "--data-path", "data.tsv", "--out", "run"]
    (code0, err0), (code1, err1) = _two_machines(tmp_path, args, "kill:3:30", restarts=1)
    assert (code0, code1) == (0, 0), (err0, err1)
    assert "starting the ranks here again from its last checkpoint" in err1, err1
    machines = json.loads((tmp_path / "a" / "run" / "machines.json").read_text())
    assert [machines[r]["settings"]["data.path"] for r in "0123"] == [str(tmp_path / m / "data.tsv") for m in "aabb"]
    assert len({m["inputs"]["data"] for m in machines.values()}) == 1, machines
    assert json.loads((tmp_path / "a" / "run" / "summary.json").read_text())["steps"] == 60


@pytest.mark.kill   # (make test-kill: minutes of restarts over two machines)
@pytest.mark.skipif(bool(_why_no_mount_namespace()), reason=_why_no_mount_namespace() or "-")
def test_over_two_machines_a_dead_rank_0_is_started_again_alone_and_the_others_train_on(tmp_path: Path) -> None:
    """udp, --max-restarts 1: rank 0 gets SIGKILL at step 40. Its launcher starts it again alone and it is
    taken back; rank 1, on the same machine, writes the run directory meanwhile and after if a row or a
    checkpoint fell while rank 0 was out, else rank 0 writes again (the second machine sees no such directory:
    its ranks are never in line to write it), and the second machine's launcher starts nothing. The run ends with 4 live workers and both launchers with status 0."""
    (tmp_path / "shaky.key").write_text(os.urandom(32).hex())
    args = [*ARGS[:2], "--workers", "4", *ARGS[4:], "--steps", "200", "--checkpoint-every", "20", "--key-file",
            str(tmp_path / "shaky.key"), "--out", "run"]
    (code0, err0), (code1, err1) = _two_machines(tmp_path, args, "kill:0:40", restarts=1)
    assert (code0, code1) == (0, 0), (err0, err1)
    assert "shaky launch: rank 0 killed by SIGKILL; starting it again (1 of 1)" in err0, err0
    assert "starting" not in err1 and "writes the run directory" not in err1, err1
    summary = json.loads((tmp_path / "a" / "run" / "summary.json").read_text())
    assert summary["steps"] == 200 and summary["live_workers"] == 4, summary
    changes = summary["udp"]["membership_changes"]
    assert [c["live"] for c in changes] == [[1, 2, 3], [0, 1, 2, 3]], summary
    rows = [json.loads(line)["step"] for line in (tmp_path / "a" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [0, 100, 200], rows
    _check_the_writer(err0, changes, sorted({*rows, *range(20, 200, 20)}))     # rows and checkpoints


def _kill_the_keeper_after(run_dir: Path, step: int) -> Callable[[int], None]:
    """Kills the keeper of MASTER_PORT (as if rank 0's machine died with it) once ``run_dir`` has the
    evaluation at ``step``."""
    def kill(port: int) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and f'"step": {step},' not in _text(run_dir / "metrics.jsonl"):
            time.sleep(0.05)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as door:     # the keeper's (shaky.job.keeper)
            door.connect(f"\0shaky-keeper-{port}")
            pid, _, _ = struct.unpack("3i", door.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        assert Path("/proc", str(pid), "comm").read_text().strip() == "shaky-keeper"
        os.kill(pid, signal.SIGKILL)
    return kill


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.mark.kill   # (make test-kill: minutes of restarts over two machines)
@pytest.mark.skipif(bool(_why_no_mount_namespace()), reason=_why_no_mount_namespace() or "-")
def test_over_two_machines_a_rank_taken_back_stops_with_the_run_and_starts_again_with_the_others(
        tmp_path: Path) -> None:
    """udp, --max-restarts 2: rank 3 dies at step 30 and is started again alone and taken back; then the run's
    store goes (its keeper is killed after step 100, as if rank 0's machine died). Every rank stops with the run
    (one line, not a traceback) and says so to its launcher, which starts its ranks again from the last
    checkpoint, the one taken back with the others, not alone into the next attempt: the run ends with 4 live
    workers and both launchers with status 0."""
    (tmp_path / "shaky.key").write_text(os.urandom(32).hex())
    args = [*ARGS[:2], "--workers", "4", *ARGS[4:], "--steps", "200", "--checkpoint-every", "20", "--key-file",
            str(tmp_path / "shaky.key"), "--out", "run"]
    (code0, err0), (code1, err1) = _two_machines(tmp_path, args, "kill:3:30", restarts=2,
                                                 during=_kill_the_keeper_after(tmp_path / "a" / "run", 100))
    assert (code0, code1) == (0, 0), (err0, err1)
    assert "shaky launch: rank 3 killed by SIGKILL; starting it again (1 of 2)" in err1, err1
    assert "starting it again (2 of 2)" not in err1 and "Traceback" not in err1, err1
    assert "is gone" in err0 and "is gone" in err1, (err0, err1)
    assert "starting the ranks here again from its last checkpoint" in err0, err0
    assert "shaky launch: the run stopped (rank 2 exited with status 3); starting the ranks here again" in err1, err1
    summary = json.loads((tmp_path / "a" / "run" / "summary.json").read_text())
    assert summary["steps"] == 200 and summary["live_workers"] == 4, summary


def test_a_simulator_run_resumes_where_rank_and_master_port_are_set(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster's job step (or a torchrun worker) has RANK and MASTER_PORT set: resuming a simulator run there
    is a simulator run as anywhere, on any rank, not a wait for a rank 0 that hands out a config."""
    run = tmp_path / "run"
    assert main(["train", "--workers", "2", "--steps", "4", "--checkpoint-every", "2", "--quiet", "--out",
                 str(run)]) == 0
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--resume", str(run), "--quiet"]) == 0


@pytest.mark.skipif(bool(_why_no_mount_namespace()), reason=_why_no_mount_namespace() or "-")
def test_bad_input_in_a_resumed_run_reaches_the_machines_without_its_directory(tmp_path: Path) -> None:
    """Rank 0 finds that the run to resume is a simulator run: it says so in one line, and the ranks of the machine
    that has no copy of the directory learn it from rank 0 and stop with status 2 too (not after waiting for a
    process group that never forms), the first of them saying the same line there."""
    assert main(["train", "--workers", "4", "--steps", "2", "--quiet", "--out", str(tmp_path / "a" / "run")]) == 0
    (node0, err0), (node1, err1) = _two_machines(tmp_path, ["--resume", "run", "--quiet"])
    assert (node0, node1) == (2, 2), (err0, err1)
    line = ("shaky: error: --resume run: a run on backend 'sim', and shaky launch runs backend 'dist' (resume it with "
            "`shaky train --resume run`)")
    for err in (err0, err1):
        assert [e for e in err.splitlines() if e.startswith("shaky: error:")] == [line], err


def test_a_config_in_the_store_that_is_not_rank_0_s_stops_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rendezvous store takes writes from anyone: a resumed rank's config, taken there, is checked against rank
    0's own, sent over the process group, and every rank stops naming the rank and the setting that differs."""
    from shaky.membership.quorum import ForgedRecord
    from shaky.config import RunConfig, to_dict
    from shaky.job import checks

    ours = RunConfig(backend="dist", num_workers=2)
    rank0 = json.loads(json.dumps(to_dict(ours)))
    rank0["optim"]["lr"] = 0.5
    monkeypatch.setattr(checks, "broadcast_object", lambda value: (rank0, None, None))
    monkeypatch.setattr(checks, "gather_object", lambda value: [(None, *value[1:]), value])     # as rank 1 of 2
    with pytest.raises(ForgedRecord, match=r"rank 1: .*\(its optim\.lr is 0\.1, rank 0's 0\.5\)"):
        checks.check_same_config(ours, resumed=True)
    rank0["optim"]["lr"], rank0["dist"]["host"], rank0["data"]["path"] = 0.1, "10.0.0.1", "/elsewhere/data.npz"
    checks.check_same_config(ours, resumed=True)      # settings of a machine's own may differ


def test_a_machine_whose_data_is_not_rank_0_s_stops_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """data.path and network.trace may differ between machines, what they hold may not: each rank's digest of the
    data it loaded (and of a replayed trace) is compared with rank 0's, and a difference names the rank, the
    setting and both paths; the same data under another path trains."""
    from shaky.config import DataConfig, ModelConfig, RunConfig, machine_settings, to_dict
    from shaky.errors import BadInput
    from shaky.job import checks

    plain = RunConfig(backend="dist", num_workers=2)
    ours = dataclasses.replace(plain, data=DataConfig(dataset="text", path="/here/data.txt"),
                               model=ModelConfig(name="lstm"))
    rank0 = json.loads(json.dumps(to_dict(ours)))
    rank0["data"]["path"] = "/there/data.txt"
    digests = {"data": "ab" * 32}
    monkeypatch.setattr(checks, "broadcast_object", lambda value: (rank0, None, None))

    def rank0_read(data: tuple[str, str], trace: tuple[str, str] | None = None) -> None:
        """rank 0's data (path, digest) and trace, as rank 1 of 2 gathers them"""
        settings = {"data.path": data[0], "network.trace": trace[0] if trace else ""}
        inputs = {"data": data[1], **({"network.trace": trace[1]} if trace else {})}
        monkeypatch.setattr(checks, "gather_object",
                            lambda value: [(None, {"settings": settings, "inputs": inputs}, value[2]), value])

    rank0_read(("/there/data.txt", "cd" * 32))
    with pytest.raises(BadInput, match=(r"^rank 1's data.path '/here/data.txt' holds other text data than rank "
                                            r"0's '/there/data.txt' \(sha256 abababababab, rank 0's cdcdcdcdcdcd\)")):
        checks.check_same_config(ours, resumed=False, inputs=digests)
    rank0_read(("/there/data.txt", "ab" * 32), ("t0.npz", "00" * 32))
    with pytest.raises(BadInput, match=r"rank 1's network.trace 't1.npz' holds other masks than rank 0's 't0.npz'"):
        checks.check_same_config(dataclasses.replace(ours, network=dataclasses.replace(ours.network, trace="t1.npz")),
                               resumed=False, inputs={**digests, "network.trace": "11" * 32})
    ours = plain
    monkeypatch.setattr(checks, "broadcast_object", lambda value: (json.loads(json.dumps(to_dict(plain))), None, None))
    rank0_read(("", "cd" * 32))
    with pytest.raises(BadInput, match=r"^rank 1 loads other digits data than rank 0 \(sha256 abababababab, "):
        checks.check_same_config(ours, resumed=True, inputs=digests)   # the machine's data, not a forged record
    rank0_read(("/there", "ab" * 32))
    machines = checks.check_same_config(ours, resumed=False, inputs=digests)    # the same data, wherever it lies
    assert machines[1] == {"settings": machine_settings(ours), "inputs": digests}, machines


def test_a_rank_with_other_data_is_not_taken_back(tmp_path: Path) -> None:
    """A process started again for a dead rank of a udp run compares its data's digest with the one rank 0
    published with the run, and stops alone with one line before it asks to be taken back."""
    from types import SimpleNamespace

    from shaky.config import RunConfig, to_dict
    from shaky.errors import AloneBadInput
    from shaky.job import rank
    from shaky.job.env import JobEnv
    from shaky.setup import inputs_digest, prepare

    cfg = RunConfig(backend="dist", num_workers=2)
    setup = prepare(cfg, measure=False)
    record = {"transport": "udp", "config": json.loads(json.dumps(to_dict(cfg))), "run_dir": str(tmp_path),
              "compute_ms": 1.0, "inputs": {"data": "cd" * 32}}
    with pytest.raises(AloneBadInput, match=(r"rank 1 cannot rejoin the run in progress at .*: its data.path '' "
                                                 r"holds other digits data than the run's \(sha256 [0-9a-f]{12}, "
                                                 r"the run's cdcdcdcdcdcd\)")):
        rank.rejoin(JobEnv(), setup, SimpleNamespace(record=record, rank=1), quiet=True)
    assert inputs_digest(setup) == inputs_digest(prepare(cfg, measure=False))   # a digest is the data's, each time


def test_a_rank_taken_back_checks_its_config_and_data_against_the_welcome() -> None:
    """The record a process started again for a dead rank read came from the rendezvous store, which anyone can
    write; the survivors' welcome is sealed with the run's key and carries the run's config and data digests: a
    rank whose own differ from those leaves before its model is averaged (ForgedRecord)."""
    from shaky.membership.quorum import ForgedRecord
    from shaky.config import RunConfig, to_dict
    from shaky.job.checks import check_taken_back
    from shaky.setup import inputs_digest, prepare

    cfg = RunConfig(backend="dist", num_workers=2)
    setup = prepare(cfg, measure=False)
    run = {"config": json.loads(json.dumps(to_dict(cfg))), "inputs": inputs_digest(setup)}
    run["config"]["device"] = "cuda:3"          # a machine's own setting may differ
    check_taken_back(cfg, setup, run, 1)
    run["config"]["optim"]["lr"] = 0.7
    with pytest.raises(ForgedRecord, match=r"^rank 1 was taken back into a run whose optim.lr is 0.7, not 0.1 as the "
                                           r"run's record in the rendezvous store said"):
        check_taken_back(cfg, setup, run, 1)
    run["config"]["optim"]["lr"] = 0.1
    run["inputs"] = {"data": "ab" * 32}
    with pytest.raises(ForgedRecord, match=r"^rank 1 was taken back into a run that read other data: its data.path '' "
                                           r"holds other digits data \(sha256 [0-9a-f]{12}, the run's abababababab\)"):
        check_taken_back(cfg, setup, run, 1)


TEXT = "\n".join(f"{'good' if i % 2 else 'bad'}\t{'a fine day' if i % 2 else 'a poor day'} number {i}"
                 for i in range(40)) + "\n"


@pytest.mark.parametrize("differs", ["lr", "data", "max-restarts"])
def test_machines_that_run_different_command_lines_stop_before_they_train(differs: str, tmp_path: Path) -> None:
    """Two launchers whose command lines differ in a setting the run shares (optim.lr), whose data.path holds
    other data (one line of a text file changed), or that were given different --max-restarts: every rank stops
    with status 2, rank 0 and the other machine's first rank saying which rank and setting differ; nothing is
    written."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--nproc-per-node",
              "1", "train", "--workers", "2", "--steps", "5", "--quiet", "--out", str(tmp_path / "run")]
    launcher: list[list[str]] = [[], []]
    if differs == "max-restarts":
        own, launcher = [[], []], [["--max-restarts", "1"], ["--max-restarts", "2"]]
        line = ("shaky: error: rank 1's shaky launch has --max-restarts 2, rank 0's 1: give every machine's launcher "
                "the same")
    elif differs == "lr":
        own = [["--lr", "0.1"], ["--lr", "0.2"]]
        line = ("shaky: error: rank 1's optim.lr is 0.2, rank 0's is 0.1: every machine must run the same command "
                "line (only data.path, network.trace, dist.key_file, dist.ports, dist.host, device may differ)")
    else:
        (tmp_path / "a.txt").write_text(TEXT)
        (tmp_path / "b.txt").write_text(TEXT.replace("number 7", "number 8"))
        own = [["--dataset", "text", "--model", "lstm", "--batch-size", "8", "--data-path", str(tmp_path / name)]
               for name in ("a.txt", "b.txt")]
        line = (f"shaky: error: rank 1's data.path '{tmp_path / 'b.txt'}' holds other text data than rank 0's "
                f"'{tmp_path / 'a.txt'}' (sha256 {{}}, rank 0's {{}}); every machine must read the same data")
    procs = [subprocess.Popen([sys.executable, "-m", "shaky", "launch", "--node-rank", str(node), *launcher[node],
                               *common[:-2], *own[node], *common[-2:]], env=env, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    errs = []
    for proc in procs:
        try:
            errs.append(proc.communicate(timeout=120)[1])
        finally:
            proc.kill()
    assert [proc.returncode for proc in procs] == [2, 2], errs
    for err in errs:
        said = [e for e in err.splitlines() if e.startswith("shaky: error:")]
        assert len(said) == 1, errs
        if differs == "data":   # the digests: 12 hex digits each, and not the same
            sums = said[0].split("(sha256 ")[1].split(")")[0]
            mine, theirs = sums.split(", rank 0's ")
            assert len(mine) == len(theirs) == 12 and mine != theirs, said
            said = [said[0].replace(mine, "{}", 1).replace(theirs, "{}", 1)]
        assert said == [line], errs
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("statuses", "used", "stopping", "run_dir", "transport", "expected"), [
    ({0: -signal.SIGKILL, 1: 3}, 0, False, "runs/x", "udp", None),
    ({0: 3, 1: -signal.SIGKILL}, 0, False, "runs/x", "gloo", None),   # stopped because rank 1 died
    ({0: 3, 1: 3}, 1, False, "runs/x", "gloo", NO_RESTARTS_LEFT),
    ({0: 3, 1: 3}, 0, False, None, "gloo", NOT_WRITTEN),
    ({0: 0, 1: 0}, 0, False, "runs/x", "udp", "it finished"),
    ({0: 2, 1: 2}, 0, False, "runs/x", "udp", "bad input"),
    ({0: 130, 1: 130}, 0, False, "runs/x", "udp", "stopping on request"),
    ({0: -signal.SIGKILL, 1: 3}, 0, True, "runs/x", "udp", "stopping on request"),
    ({0: 4, 1: 4}, 0, False, "runs/x", "gloo", "diverged"),
    # rank 0 on another machine: these ranks stopped with the run, or were lost alone
    ({2: 3, 3: 3}, 0, False, "runs/x", "udp", None),                    # rank 0 went
    ({2: 3, 3: -signal.SIGKILL}, 0, False, "runs/x", "gloo", None),
    ({2: -signal.SIGKILL}, 0, False, "runs/x", "gloo", None),             # on gloo its death stopped the run
    ({2: -signal.SIGKILL}, 0, False, "runs/x", "udp", RUN_GOES_ON),       # on udp the others train on
    ({0: -signal.SIGKILL, 1: 0, 2: 0}, 0, False, "runs/x", "udp", RUN_GOES_ON),   # rank 0 too
    ({2: 0, 3: -signal.SIGKILL}, 0, False, "runs/x", "udp", "it finished"),
    ({2: 3, 3: 3}, 1, False, "runs/x", "udp", NO_RESTARTS_LEFT),
    ({2: 3, 3: 3}, 0, False, None, None, NOT_TOLD),
])
def test_group_restart_decision(statuses: dict[int, int], used: int, stopping: bool, run_dir: str | None,
                                transport: str | None, expected: str | None) -> None:
    why = group_restart_decision(statuses, restarts_used=used, max_restarts=1, stopping=stopping, run_dir=run_dir,
                                 transport=transport)
    assert why is None if expected is None else expected in str(why), why


class FakeRank:
    """A rank process whose end the test decides."""

    def __init__(self, *_args: object, **_kwargs: object) -> None:
        self.status: int | None = None
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.status

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)


def _fake_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transport: str = "udp") -> tuple[Launcher, list]:
    monkeypatch.setattr(launch.subprocess, "Popen", FakeRank)
    lines: list[str] = []
    launcher = Launcher(LaunchConfig(nproc_per_node=3, max_restarts=1), ["--quiet"], env={}, say=lines.append)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text("")
    launcher.run_files = str(tmp_path)
    (tmp_path / "run-1.json").write_text(json.dumps({"run_dir": str(tmp_path / "run"), "transport": transport}))
    for rank in range(3):
        launcher._start(rank)
    return launcher, lines


def _stopped_with_the_run(tmp_path: Path, launcher: Launcher, ranks: Sequence[int]) -> None:
    """``ranks`` end as a rank does whose run stopped (its store went): status 3, having told their launcher
    (``shaky.job.rank.run_stopped``)."""
    for rank in ranks:
        (tmp_path / f"run-{rank}.json").write_text(json.dumps({"run_dir": str(tmp_path / "run"), "transport": "udp",
                                                               "stopped": True}))
        launcher.procs[rank].status = 3


def test_the_group_restart_names_the_rank_that_stopped_the_run(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """udp: rank 1 dies and is started again alone; later rank 0 dies and the run stops with it (its store went:
    the others stop with status 3 and say so). The line names rank 0, not the rank that was taken back long
    before; rank 0 is not started again alone, and every rank goes on with --resume."""
    launcher, lines = _fake_launcher(tmp_path, monkeypatch)
    launcher.procs[1].status = -signal.SIGKILL
    launcher._watch()
    assert lines[-1].startswith("rank 1 killed by SIGKILL; starting it again (1 of 1)") and not launcher.statuses
    launcher.procs[0].status = -signal.SIGKILL
    _stopped_with_the_run(tmp_path, launcher, [1, 2])
    launcher._watch()
    assert launcher._restart_group()
    assert lines[-1] == ("rank 0 killed by SIGKILL and the run stopped; starting every rank again from its last "
                         f"checkpoint: train --resume {tmp_path / 'run'} (1 of 1)")
    assert launcher.args == ["--resume", str(tmp_path / "run"), "--quiet"] and not launcher.statuses


def test_on_udp_the_group_restart_names_rank_0_even_after_a_rank_was_lost_for_good(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """udp: rank 2 dies twice (its one restart used, it stays down: the run goes on without it), then rank 0
    dies and the run stops with it (the others say so): the line names rank 0."""
    launcher, lines = _fake_launcher(tmp_path, monkeypatch)
    launcher.procs[2].status = -signal.SIGKILL
    launcher._watch()
    launcher.procs[2].status = -signal.SIGKILL
    launcher._watch()
    assert lines[-1].startswith("rank 2 killed by SIGKILL; not started again: it has no restarts left")
    launcher.procs[0].status = -signal.SIGABRT     # rank 0 crashed, and its store went with it
    _stopped_with_the_run(tmp_path, launcher, [1])
    launcher._watch()
    assert launcher._restart_group()
    assert lines[-1].startswith("rank 0 killed by SIGABRT and the run stopped; starting every rank again"), lines


def test_on_a_machine_without_rank_0_a_udp_group_restart_names_the_run_s_stop_not_a_rank_lost_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """udp, ranks 3-5 here, rank 0 elsewhere: rank 5 dies twice (lost for good), then rank 0 goes and ranks 3 and 4
    stop with the run: the line says the run stopped, as rank 3 saw it, not that rank 5 stopped it."""
    monkeypatch.setattr(launch.subprocess, "Popen", FakeRank)
    lines: list[str] = []
    launcher = Launcher(LaunchConfig(nproc_per_node=3, nnodes=2, node_rank=1, master_port=29500, max_restarts=1),
                        ["--quiet"], env={}, say=lines.append)
    launcher.run_files = str(tmp_path)
    (tmp_path / "run-3.json").write_text(json.dumps({"run_dir": "/abs/run", "transport": "udp", "stopped": False}))
    for rank in range(3, 6):
        launcher._start(rank)
    for _ in range(2):
        launcher.procs[5].status = -signal.SIGKILL
        launcher._watch()
    for rank in (3, 4):     # what a rank that rank 0's end stopped tells its launcher (shaky.job.rank.run_stopped)
        (tmp_path / f"run-{rank}.json").write_text(json.dumps({"run_dir": "/abs/run", "transport": "udp",
                                                               "stopped": True}))
        launcher.procs[rank].status = 3
    launcher._watch()
    assert launcher._restart_group()
    assert lines[-1] == ("the run stopped (rank 3 exited with status 3); starting the ranks here again from its last "
                         "checkpoint: train --resume /abs/run (1 of 1)"), lines


def test_a_stop_signal_reaches_a_rank_started_after_it_and_every_rank_once(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    launcher, _ = _fake_launcher(tmp_path, monkeypatch)
    launcher._pass_on(signal.SIGINT, None)      # during the starts: ranks 0-2 are in procs, rank 2 starts again
    launcher._start(2)
    assert [launcher.procs[rank].signals for rank in range(3)] == [[signal.SIGINT]] * 3


def test_a_diverged_rank_is_not_started_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launcher, lines = _fake_launcher(tmp_path, monkeypatch)
    for proc in launcher.procs.values():
        proc.status = 4
    launcher._watch()
    assert not launcher._restart_group() and not lines and exit_status(launcher.statuses) == 4


def test_every_rank_goes_on_with_resume_and_quiet_only() -> None:
    assert resume_args(["--workers", "2", "--out", "runs/x", "--quiet", "--backend", "dist"], "/abs/x") == [
        "--resume", "/abs/x", "--quiet"]
    assert resume_args(["--resume", "runs/x"], "/abs/x") == ["--resume", "/abs/x"]
    assert resume_args(["--qui", "--workers", "2"], "/abs/x") == ["--resume", "/abs/x", "--quiet"]   # argparse's


def test_the_ranks_are_numbered_as_torchrun_numbers_them() -> None:
    cfg = LaunchConfig(nproc_per_node=4, nnodes=3, node_rank=1, master_port=29500)
    assert cfg.world_size == 12 and list(cfg.ranks) == [4, 5, 6, 7]


SAY_WRITER = """
import sys
from shaky.progress import say
for i in range(2000):
    say(f"shaky: rank {sys.argv[1]} line {i} " + "x" * 300)
"""


def test_lines_of_ranks_that_share_a_pipe_never_run_into_each_other() -> None:
    """The ranks of ``shaky launch`` share its stderr. Two processes each write 2,000 lines of 330 bytes at once to
    one pipe; every line comes out whole (``print`` to stderr writes the text and its newline separately, and then
    two ranks' lines could join: CI saw it)."""
    read, write = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", SAY_WRITER, str(rank)], stderr=write) for rank in (1, 2)]
    os.close(write)
    with os.fdopen(read) as pipe:
        lines = pipe.read().splitlines()
    assert [proc.wait(timeout=60) for proc in procs] == [0, 0]
    expected = {f"shaky: rank {rank} line {i} " + "x" * 300 for rank in (1, 2) for i in range(2000)}
    assert len(lines) == 4000 and set(lines) == expected


def test_a_log_that_can_no_longer_be_written_is_said_once_and_never_stops_the_run(tmp_path: Path) -> None:
    """A rank's log file whose writes fail (a full disk): said once, then that rank's output goes on without it;
    the other rank's log is still written."""
    lines: list[str] = []
    logs = launch.RankLogs(tmp_path, [0, 1], lines.append)

    class Full:
        name = str(tmp_path / "rank-0.log")

        def write(self, _data: bytes) -> int:
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            pass

    logs.files[0] = Full()
    for _ in range(3):
        logs._to_file(0, b"a line\n")
        logs._to_file(1, b"a line\n")
    logs.close()
    assert lines == [f"cannot write {tmp_path / 'rank-0.log'}: No space left on device; rank 0's output goes on to "
                     "this terminal only"], lines
    assert (tmp_path / "rank-1.log").read_bytes() == b"a line\n" * 3


def test_a_log_dir_that_cannot_hold_the_logs_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / "logs" / "rank-1.log").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "shaky", "launch", "--nproc-per-node", "2", "--log-dir",
                           str(tmp_path / "logs"), "train", "--workers", "2", "--out", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr == (
        f"shaky: error: log-dir '{tmp_path / 'logs'}' cannot hold the ranks' logs: Is a directory "
        f"({tmp_path / 'logs' / 'rank-1.log'})\n"), proc.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "logs" / "rank-0.log").exists()


@pytest.mark.parametrize("node", [0, 1])
def test_a_rank_whose_process_group_never_forms_stops_with_one_line(node: int, tmp_path: Path) -> None:
    """The other machine never starts: rank 0 waits dist_timeout_s for it (node 0), or rank 1 for rank 0's store
    (node 1), then says so in one line (no traceback, none of torch's C++ stack traces), status 3, and nothing is
    written."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "shaky", "launch", "--nnodes", "2", "--node-rank", str(node),
                           "--master-port", str(free_port()), "--nproc-per-node", "1", "train", "--workers", "2",
                           "--steps", "5", "--set", "dist_timeout_s=2", "--quiet", "--out", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("shaky: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"shaky: error: rank {node}: the process group did not form (rank 0's store at 127.0.0.1:"), proc.stderr
    assert "Traceback" not in proc.stderr and "frame #" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_two_launchers_given_one_node_rank_do_not_both_join_as_its_ranks(tmp_path: Path) -> None:
    """Three launchers of a 2-machine run, two of them given --node-rank 1: the first rank 1 to claim its rank in
    the store trains with rank 0; the other stops at once with one line naming both claimants (status 2), not
    joining the group as a second rank 1."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    common = ["--nnodes", "2", "--master-port", str(free_port()), "--nproc-per-node", "1", "train", "--workers",
              "2", "--steps", "3000", "--eval-every", "1000", "--set", "dist_timeout_s=30", "--quiet", "--out",
              str(tmp_path / "run")]
    procs = [subprocess.Popen([sys.executable, "-m", "shaky", "launch", "--node-rank", str(node), *common], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (1, 1, 0)]
    ends = []
    for proc in procs:
        try:
            ends.append((proc.communicate(timeout=120)[1], proc.returncode))
        finally:
            proc.kill()
    assert ends[2][1] == 0 and sorted(code for _, code in ends[:2]) == [0, 2], ends
    err = next(err for err, code in ends[:2] if code == 2)
    assert [line for line in err.splitlines() if line.startswith("shaky: error:")] == [err.strip()], err
    assert err.startswith("shaky: error: rank 1 is held by another process (host ") and err.strip().endswith(
        "give each machine its own --node-rank and every machine the same --nproc-per-node"), err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3000


def test_bad_input_on_a_machine_without_rank_0_is_said_before_it_waits_for_rank_0(tmp_path: Path) -> None:
    """Rank 0 is never started: a rank on another machine that finds bad input in its own command line says so
    at once (status 2), not after waiting dist_timeout_s for rank 0's store."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "shaky", "launch", "--nnodes", "2", "--node-rank", "1",
                           "--master-port", str(free_port()), "--nproc-per-node", "1", "train", "--workers", "2",
                           "--batch-size", "100000", "--set", "dist_timeout_s=600", "--quiet"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("shaky: error:")]
    assert len(errors) == 1 and errors[0].startswith("shaky: error: batch_size 100000 is larger"), proc.stderr


def test_rank_0_on_a_port_in_use_stops_at_once_with_one_line(tmp_path: Path) -> None:
    """The store's port is taken (here by a listening socket; a second launcher given --node-rank 0 takes it the
    same way): rank 0 cannot host the rendezvous store and says so in one line naming --master-port, status 2,
    at once, not after a timeout and not as "the process group did not form"; nothing is written."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "shaky", "launch", "--nnodes", "2", "--node-rank", "0",
                               "--master-port", str(port), "--nproc-per-node", "1", "train", "--workers", "2",
                               "--set", "dist_timeout_s=600", "--quiet", "--out", str(tmp_path / "run")],
                              env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        f"shaky: error: rank 0 cannot host the rendezvous store: --master-port {port} is in use on this machine "
        "(another run or program on it, or a second launcher given --node-rank 0); give a free --master-port, and "
        "--node-rank 0 to one launcher only"), proc.stderr
    assert not (tmp_path / "run").exists()
