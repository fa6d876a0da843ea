"""`shaky train --backend dist --transport udp`: training over a network that really loses packets.

Each test makes a private network namespace (``unshare --net``, as root) and runs torchrun inside it on the
namespace's own loopback (``tests/netns.py``), with an iptables rule that drops a fraction of the UDP
datagrams, or with an attacker on the path (``tests/udp_attacker.py``). Without root, unshare or iptables
they skip with one line that says why (the README says how to enable them).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shaky.rundir import load_checkpoint, load_trace, read_summary

from test_udp import _real_loss_unavailable

TESTS = Path(__file__).resolve().parent
WORKERS = 4


FLOAT64 = ("--set", 'dtype="float64"')
"""The replay tests' runs are in float64. The transport averages in another order than the simulator (numpy
against torch: 1.2e-7 apart after 40 float32 steps), and in float32 that rounding now and then flips a ReLU whose
input is within it of zero: one unit's weights then differ by 4e-5 to 2e-4 (about 1 run in 10 failed allclose
1e-5, the differing elements one unit's fan-in row). In float64 the two are 2e-16 apart, so the replay can be
checked to 1e-12, and a single segment averaged over other senders than its recorded mask says still shows."""
REPLAY_ATOL = 1e-12


def _torchrun(out: Path, *args: str, workers: int = WORKERS, resume: bool = False) -> list[str]:
    """torchrun of a udp run into ``out`` (or of its ``--resume``), inside a namespace: any port will do."""
    run = ["--resume", str(out)] if resume else ["--backend", "dist", "--transport", "udp", "--workers",
                                                 str(workers), "--out", str(out), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(workers), "--master-addr",
            "127.0.0.1", "--master-port", "29400", "-m", "shaky", "train", "--quiet", *run]


def _in_namespace(command: list[str], *, loss: float = 0.0, also: list[list[str]] = (), cwd: Path,
                  timeout: float = 240, proto: str = "udp") -> subprocess.CompletedProcess:
    why = _real_loss_unavailable()
    if why:
        pytest.skip(why)
    wrapper = ["unshare", "--net", sys.executable, str(TESTS / "netns.py"), "--loss", str(loss), "--proto", proto,
               *[arg for cmd in also for arg in ("--also", json.dumps(cmd))], "--", *command]
    return subprocess.run(wrapper, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _replayed(out: Path, tmp_path: Path, *extra: str) -> Path:
    """The simulator replaying run ``out``'s trace (on gloo, in ``tmp_path/replay``): it ends at the run's
    parameters (to REPLAY_ATOL, in float64). Returns the replay's directory."""
    replay = tmp_path / "replay"
    sim = subprocess.run([sys.executable, "-m", "shaky", "train", "--config", str(out / "config.toml"),
                          "--backend", "sim", "--transport", "gloo", *extra, "--replay-trace", str(out), "--quiet",
                          "--out", str(replay)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert sim.returncode == 0, sim.stderr[-2000:]
    torch.testing.assert_close(load_checkpoint(replay)["params"], load_checkpoint(out)["params"],
                               rtol=0, atol=REPLAY_ATOL)
    return replay


@pytest.mark.kill  # 24 s, multi-process (make test-kill; the every-packet run below replays in make test)
def test_a_real_lossy_udp_run_replays_in_the_simulator(tmp_path: Path) -> None:
    """10% of the datagrams really lost, and rank 1 is told to stop (SIGTERM, as a preemption) before step 30:
    every rank stops after that step with a checkpoint, the run is resumed and finishes, its trace holds what
    arrived (segment by segment) before and after the resume, and the simulator replaying that trace ends at
    the same parameters (to 1e-12, in float64: see FLOAT64). (A rank that dies is tests/test_membership.py's.)"""
    out = tmp_path / "udp"
    args = ("--strategy", "rps", "--steps", "40", "--eval-every", "10", "--checkpoint-every", "20", *FLOAT64)
    os.environ["SHAKY_INJECT_FAULT"] = "term:1:30"
    try:
        died = _in_namespace(_torchrun(out, *args), loss=0.1, cwd=tmp_path)
    finally:
        del os.environ["SHAKY_INJECT_FAULT"]
    assert died.returncode != 0 and "stopped by SIGTERM after step 31 of 40" in died.stderr, died.stderr[-3000:]
    done = _in_namespace(_torchrun(out, resume=True), loss=0.1, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = read_summary(out)
    assert summary["transport"] == "udp" and summary["drop_rate"] == "real"
    udp = summary["udp"]
    assert 0.05 < udp["observed_loss"] < 0.2, udp            # what the rule dropped, as the ranks counted it
    assert summary["messages_dropped"] == udp["datagrams_sent"] - udp["datagrams_received"], (summary, udp)
    assert summary["final_test_accuracy"] > 0.5

    replay = _replayed(out, tmp_path)
    assert read_summary(replay)["messages_dropped"] == summary["messages_dropped"]


@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
@pytest.mark.parametrize("value_dtype", ["int8", "bfloat16"])
def test_rounded_values_over_real_loss_replay_in_the_simulator(value_dtype: str, tmp_path: Path) -> None:
    """strategy.value_dtype on udp: 10% of the datagrams really lost, each rank sends rounded differences where
    it holds its block's stream and whole values elsewhere; the simulator replaying the trace ends at the same
    parameters (to 1e-12, in float64), and the run sent fewer bytes than the same run with whole values."""
    args = ("--strategy", "rps", "--steps", "30", "--eval-every", "10", *FLOAT64)
    runs = {}
    for kind in (value_dtype, ""):
        out = tmp_path / (kind or "whole")
        done = _in_namespace(_torchrun(out, *args, *(("--value-dtype", kind) if kind else ())), loss=0.1,
                             cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[kind] = read_summary(out)
    out = tmp_path / value_dtype
    replay = _replayed(out, tmp_path)
    assert read_summary(replay)["bytes_sent"] == runs[value_dtype]["bytes_sent"]
    assert runs[value_dtype]["bytes_sent"] < 0.8 * runs[""]["bytes_sent"], runs
    assert runs[value_dtype]["final_test_accuracy"] > 0.5


def test_with_every_packet_lost_a_run_finishes_and_replays_in_the_simulator(tmp_path: Path) -> None:
    """5% of every packet dropped, TCP included (the rendezvous, gloo's setup, the control store, the heartbeats),
    as a real lossy network drops them: the run finishes on every rank, its control rounds went by mail (no TCP
    round trip on the training path), and the simulator replaying its trace ends at the same parameters (to
    1e-12, in float64) with the same losses."""
    out = tmp_path / "udp"
    done = _in_namespace(_torchrun(out, "--strategy", "rps", "--steps", "30", "--eval-every", "15", *FLOAT64),
                         loss=0.05, proto="all", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = read_summary(out)
    udp = summary["udp"]
    assert summary["steps"] == 30 and summary["messages_dropped"] > 0, udp
    assert udp["control_rounds_by_mail"] >= 30 > udp["control_rounds_by_store"], udp
    replay = _replayed(out, tmp_path)
    assert read_summary(replay)["messages_dropped"] == summary["messages_dropped"]


@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_a_udp_run_with_a_failure_replays_in_the_simulator(tmp_path: Path) -> None:
    """Worker 1 is down from step 8 to step 20 (the schedule's failure, on udp) and rank 2 serves its block too,
    with 10% of the datagrams really lost: each of rank 2's blocks is a message of its own, so the trace holds
    what arrived of each (block 1's column shows its own losses, not block 2's), and the simulator replaying it
    ends at the same parameters (to 1e-12, in float64) with the same losses."""
    out = tmp_path / "udp"
    args = ("--strategy", "rps", "--steps", "30", "--eval-every", "10", "--set",
            "failures=[{worker=1,step=8,rejoin=20}]", *FLOAT64)
    done = _in_namespace(_torchrun(out, *args), loss=0.1, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = read_summary(out)
    assert summary["messages_dropped"] > 0, summary["udp"]
    trace = load_trace(str(out), WORKERS, 30)
    assert trace.by_block
    plane = (WORKERS * WORKERS + 7) // 8
    segments = trace.up.shape[1] // plane
    up = np.unpackbits(trace.up.reshape(30, segments, plane), axis=2, count=WORKERS * WORKERS).reshape(
        30, segments, WORKERS, WORKERS).astype(bool)                       # [step, segment, sender, block]
    to_rank_2 = up[8:20][:, :, [0, 3]]                          # what the live senders' blocks 1 and 2 did
    assert not to_rank_2[..., 1].all() and (to_rank_2[..., 1] != to_rank_2[..., 2]).any()

    replay = _replayed(out, tmp_path)
    assert read_summary(replay)["messages_dropped"] == summary["messages_dropped"]


@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_a_delayed_exchange_in_the_background_replays_in_the_simulator(tmp_path: Path) -> None:
    """dts with t = 4 over udp: each exchange runs in the background while the next three steps compute, over
    links with an emulated one-way latency of 20 ms and 10% of the datagrams really lost, with a checkpoint
    (every exchange in flight then completes early) and the run's end (three in flight) in between. The trace
    holds each exchange's masks at the step that launched it, so the simulator's replay ends at the same
    parameters (to 1e-12, in float64) with the same losses; the time spent waiting is in the summary, and the run's
    simulated clock counts the control rounds that the replay, on gloo, does not have."""
    out = tmp_path / "dts"
    args = ("--strategy", "dts", "--set", "strategy.delay=4", "--steps", "40", "--eval-every", "20",
            "--checkpoint-every", "15", "--set", "network.latency_ms=20", "--set", "dist.emulate_latency=true",
            *FLOAT64)
    done = _in_namespace(_torchrun(out, *args), loss=0.1, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = read_summary(out)
    udp = summary["udp"]
    assert 0.05 < udp["observed_loss"] < 0.2, udp
    assert summary["messages_dropped"] == udp["datagrams_sent"] - udp["datagrams_received"], (summary, udp)
    assert summary["wait_s"] >= 0 and summary["sim_wait_s"] > 0, summary

    replay = _replayed(out, tmp_path, "--set", "dist.emulate_latency=false")
    assert read_summary(replay)["messages_dropped"] == summary["messages_dropped"]
    assert read_summary(replay)["wait_s"] is None
    # The run's simulated clock counts each exchange's control round (by mail: one one-way latency, 20 ms here),
    # which the replay on gloo has none of: with t = 4 every four steps wait for one, 0.2 s in 40 steps.
    assert summary["sim_time_s"] - read_summary(replay)["sim_time_s"] == pytest.approx(0.2, rel=0.05), \
        (summary, read_summary(replay))


@pytest.mark.kill  # slow, multi-process: make test-kill (.ci/run runs it)
def test_an_attacker_on_the_path_changes_nothing(tmp_path: Path) -> None:
    """Random, truncated, forged-tag, wrong-address and replayed datagrams at every rank's ports (its data
    plane's and its control rounds' mail) during a 4-process run at zero loss and a generous deadline: the final
    parameters are those of the same run without the attacker, bit for bit, and the ranks rejected the
    attacker's datagrams, on both sockets."""
    args = ("--strategy", "rps", "--steps", "30", "--eval-every", "10", "--deadline-ms", "20000",
            "--set", 'dist.ports="31000-31007"')     # each rank's data port, and its control rounds' mail
    quiet = _in_namespace(_torchrun(tmp_path / "quiet", *args), cwd=tmp_path)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    counts = tmp_path / "attacks.json"
    attacker = [sys.executable, str(TESTS / "udp_attacker.py"), "31000", "31007", "200", str(counts)]
    attacked = _in_namespace(_torchrun(tmp_path / "attacked", *args), also=[attacker], cwd=tmp_path)
    assert attacked.returncode == 0, attacked.stderr[-3000:]
    sent = json.loads(counts.read_text())
    assert all(sent[kind] > 0 for kind in ("random", "truncated", "forged_tag", "wrong_address", "replayed")), sent
    assert torch.equal(load_checkpoint(tmp_path / "attacked")["params"], load_checkpoint(tmp_path / "quiet")["params"])
    udp = read_summary(tmp_path / "attacked")["udp"]
    assert udp["rejected"] > 0 and udp["control_mail_rejected"] > 0 and udp["observed_loss"] == 0.0, udp
    assert read_summary(tmp_path / "quiet")["udp"]["rejected"] == 0


def _torchrun_plain(tmp_path: Path, *args: str, workers: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers),
           "-m", "shaky", "train", "--backend", "dist", "--workers", str(workers), "--steps", "3", "--quiet",
           "--out", str(tmp_path / "run"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _one_error(proc: subprocess.CompletedProcess) -> str:
    """The one line of a torchrun job whose ranks found bad input (torchrun itself exits 1; the ranks exit 2)."""
    ours = [line for line in proc.stderr.splitlines() if line.startswith("shaky: error:")]
    assert proc.returncode != 0 and len(ours) == 1 and "exitcode  : 2" in proc.stderr, proc.stderr[-2000:]
    return ours[0]


@pytest.mark.parametrize("content", [None, b"  \n"], ids=["unreadable", "empty"])
def test_a_bad_key_file_is_one_line(tmp_path: Path, content: bytes | None) -> None:
    key = tmp_path / "shaky.key"
    if content is not None:
        key.write_bytes(content)
    line = _one_error(_torchrun_plain(tmp_path, "--transport", "udp", "--key-file", str(key)))
    assert "dist.key_file" in line and str(key) in line, line
    assert ("cannot be read" if content is None else "no key") in line, line
    assert not (tmp_path / "run").exists()


def test_a_key_file_is_a_small_regular_file(tmp_path: Path) -> None:
    """A device (/dev/zero: read until memory ran out) or a FIFO (blocked until written) is refused before it is
    opened, and a file over the limit after reading one byte more than it: one line naming the file."""
    from shaky.comm.udp.comm import MAX_KEY_FILE_BYTES, load_key  # noqa: PLC0415

    fifo, big, good = tmp_path / "fifo", tmp_path / "big.key", tmp_path / "shaky.key"
    os.mkfifo(fifo)
    big.write_bytes(b"k" * (MAX_KEY_FILE_BYTES + 1))
    good.write_bytes(b"k" * MAX_KEY_FILE_BYTES)
    for path, why in (("/dev/zero", "is not a regular file"), (str(fifo), "is not a regular file"),
                      (str(big), f"more than {MAX_KEY_FILE_BYTES} bytes"), (str(tmp_path / "none"), "cannot be read")):
        with pytest.raises(ValueError, match=why) as error:
            load_key(path)
        assert str(error.value).startswith(f"dist.key_file {path!r}"), error.value
    assert len(load_key(str(good))) == 32


def test_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        line = _one_error(_torchrun_plain(tmp_path, "--transport", "udp", "--set", f'dist.ports="{port}"',
                                          "--set", 'dist.host="127.0.0.1"'))
    assert f"ports {port}-{port}" in line and "dist.ports" in line, line
    assert not (tmp_path / "run").exists()


def test_no_free_tcp_port_for_the_control_store_is_one_line(tmp_path: Path) -> None:
    """With live membership rank 0 also listens on the first free TCP port of dist.ports (the control plane's
    store): where the range's UDP ports are free but its TCP ports are taken, one line names the range."""
    for base in range(31200, 32200, 2):   # two ports free for UDP, whose TCP ports this test then takes
        taken = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(2)]
        try:
            for port, sock in zip((base, base + 1), taken):
                sock.bind(("127.0.0.1", port))
                sock.listen(1)
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            for sock in taken:
                sock.close()
            continue
        break
    else:
        pytest.skip("no two consecutive ports free here")
    try:
        line = _one_error(_torchrun_plain(tmp_path, "--transport", "udp", "--set", f'dist.ports="{base}-{base + 1}"',
                                          "--set", 'dist.host="127.0.0.1"'))
    finally:
        for sock in taken:
            sock.close()
    assert "control plane's TCP port" in line and f"no free TCP port on 127.0.0.1 in ports {base}-{base + 1}" in line
    assert "dist.ports" in line and not (tmp_path / "run").exists(), line


AVERAGER_SCRIPT = r"""
import sys
import torch, torch.distributed as dist
import shaky
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)
model = torch.nn.Sequential(torch.nn.Linear(300, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3)).double()
model[2].float()                      # two dtypes: two vectors, each its own exchange
averager = shaky.RPSAverager(model, transport="udp", deadline_ms=10000, key_file=sys.argv[1])
for _ in range(3):
    before = [p.detach().clone() for p in model.parameters()]
    averager.step()
    for p, b in zip(model.parameters(), before):
        mean = b.clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(p.detach(), mean / world, rtol=1e-6, atol=1e-7)
observed = averager.comm.observed
assert observed.up.all() and observed.down.all() and averager.messages_dropped == 0
assert averager.messages_sent > 0 and averager.comm.last_stats.received == sum(averager.comm.last_stats.expected)
print(f"averaged rank {rank}", flush=True)
averager.comm.close()
dist.destroy_process_group()
"""


def test_rps_averager_over_udp(tmp_path: Path) -> None:
    """A user's own loop: RPSAverager(model, transport="udp") with a key file gives the exact mean when nothing
    is lost (two processes on 127.0.0.1, a float64 and a float32 group)."""
    script, key = tmp_path / "averager.py", tmp_path / "shaky.key"
    script.write_text(AVERAGER_SCRIPT)
    key.write_bytes(os.urandom(32))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           str(key)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(re.findall(r"averaged rank (\d)", proc.stdout)) == ["0", "1"], (proc.stdout, proc.stderr[-2000:])
    assert "not encrypted" not in proc.stderr        # the key came from the file
