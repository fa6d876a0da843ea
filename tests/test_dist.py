"""The torch.distributed backend against the simulator: same config and seed, same metrics.

Four gloo processes on 127.0.0.1 run every strategy once; rank 0 writes each run
directory, and the simulator's run of the same config must match it at every
evaluation (allclose 1e-5: the two backends sum in different orders).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shaky.rundir import load_checkpoint
from shaky.train import read_metrics

from conftest import free_port, make_config, run

WORKERS = 4
CASES: dict[str, dict] = {
    "allreduce": dict(strategy={"name": "allreduce"}, optim={"momentum": 0.9}),
    "lossy-allreduce": dict(strategy={"name": "lossy-allreduce"}),
    "rps": dict(strategy={"name": "rps"}),
    "local-sgd": dict(strategy={"name": "local-sgd", "period": 3}),
    "ri-sgd": dict(strategy={"name": "ri-sgd", "period": 3, "redundancy": 2}, data={"partition": "label-skew"}),
    "rps-failures": dict(strategy={"name": "rps"}, failures=[{"worker": 1, "step": 4, "rejoin": 12},
                                                             {"worker": 3, "step": 8}]),
    "allreduce-weighted": dict(strategy={"name": "allreduce", "weighted": True}, batch_sizes=[4, 8, 12, 16]),
    "dts": dict(strategy={"name": "dts", "delay": 3, "period": 2}),
}


def _config(case: str):
    return make_config(num_workers=WORKERS, steps=16, eval_every=4, network={"drop_rate": 0.25, "compute_ms": 1.0},
                       **CASES[case])


def _worker(rank: int, port: int, out: str) -> None:
    from shaky.comm.gloo import DistComm  # noqa: PLC0415
    from shaky.train import prepare, train  # noqa: PLC0415

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS,
                            timeout=timedelta(seconds=60))
    comm = DistComm()
    for case in CASES:
        train(prepare(_config(case)), Path(out) / case, comm=comm, writer=rank == 0, progress=False)
        dist.barrier()
    _exchange_results(comm, rank, Path(out))
    dist.destroy_process_group()


# (length, weighted, servers): equal blocks (length a multiple of 4), unequal ones, and a dead server's
# block moved to another rank (servers differ in how much they serve).
EXCHANGES = [(4000, False, None), (4001, True, None), (4000, False, (0, 2, 2, 3)), (7, True, (1, 1, 2, 3))]


def _exchange_results(comm, rank: int, out: Path) -> None:
    """Every rank's block_average of every EXCHANGES case, gathered; rank 0 saves them with their inputs."""
    from shaky.config import NetworkConfig  # noqa: PLC0415
    from shaky.network.model import NetworkModel  # noqa: PLC0415

    saved = []
    for i, (length, weighted, servers) in enumerate(EXCHANGES):
        links = NetworkModel(NetworkConfig(drop_rate=0.5), WORKERS, seed=i).sample(0)
        x = torch.randn(WORKERS, length, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        weights = torch.tensor([1.0, 2.0, 3.0, 4.0]) if weighted else None
        srv = torch.tensor(servers) if servers else None
        got = comm.gather(comm.block_average(x[rank:rank + 1], links.up, links.down, weights=weights, servers=srv))
        saved.append((x, links.up, links.down, weights, srv, got))
    if rank == 0:
        torch.save(saved, out / "exchanges.pt")


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    torch.set_num_threads(1)
    mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=WORKERS, start_method="spawn", join=True)
    return out


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5) or (math.isnan(a) and math.isnan(b))
    return a == b


@pytest.mark.parametrize("case", list(CASES))
def test_dist_backend_matches_the_simulator(case: str, dist_runs: Path, tmp_path: Path) -> None:
    _, sim_params, sim_rows = run(_config(case), tmp_path / "sim")
    dist_rows = read_metrics(dist_runs / case)
    assert len(dist_rows) == len(sim_rows) == 5
    for s, d in zip(sim_rows, dist_rows):
        for key in s:
            if key == "wall_time_s":
                continue
            assert _close(s[key], d[key]), (case, s["step"], key, s[key], d[key])
    dist_params = load_checkpoint(dist_runs / case)["params"]
    torch.testing.assert_close(dist_params, sim_params, atol=1e-5, rtol=1e-5)


def test_block_exchange_matches_the_simulator(dist_runs: Path) -> None:
    """DistComm.block_average (all_to_all, then point-to-point sends) against SimComm's: equal and unequal blocks,
    weights, and servers that serve more than one block."""
    from shaky.comm.sim import SimComm  # noqa: PLC0415

    saved = torch.load(dist_runs / "exchanges.pt", weights_only=False)
    assert len(saved) == len(EXCHANGES)
    for x, up, down, weights, servers, got in saved:
        assert bool((~up).any()) and bool((~down).any())  # some messages were lost
        expected = SimComm(WORKERS).block_average(x, up, down, weights=weights, servers=servers)
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)


def test_torchrun_trains_like_the_simulator(tmp_path: Path) -> None:
    """The README's torchrun command, with 2 processes, ends where the simulator does, simulated time included:
    the compute time is measured once on the machine (here by the dist run's rank 0) and both charge it."""
    out = tmp_path / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "shaky", "train", "--backend", "dist", "--workers", "2", "--steps", "30", "--eval-every", "10",
           "--drop-rate", "0.1", "--set", "network.compute_ms=-1", "--quiet", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = make_config(num_workers=2, steps=30, eval_every=10, batch_size=32,
                      network={"drop_rate": 0.1, "compute_ms": -1.0})
    summary, _, _ = run(cfg, tmp_path / "sim")
    dist_final = read_metrics(out)[-1]
    assert math.isclose(dist_final["test_accuracy"], summary["final_test_accuracy"], abs_tol=1e-9)
    assert dist_final["sim_time_s"] == summary["sim_time_s"] > 0


def test_bad_input_under_torchrun_is_said_once(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "shaky", "train", "--backend", "dist", "--workers", "3", "--steps", "5", "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("shaky: error:")]
    assert ours == ["shaky: error: num_workers is 3 but torchrun started 2 processes; they must match "
                    "(one worker per process)"], proc.stderr[-2000:]
    assert not (tmp_path / "runs").exists()


def test_example_script_runs_under_torchrun(tmp_path: Path) -> None:
    """examples/rps_averager.py: a user's own loop with RPSAverager, 2 gloo processes, 10% drops."""
    script = Path(__file__).resolve().parents[1] / "examples" / "rps_averager.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), "--steps", "150", "--drop-rate", "0.1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.findall(r"rank (\d): test accuracy ([\d.]+), messages dropped (\d+) of (\d+)", proc.stdout)
    assert sorted(rank for rank, *_ in found) == ["0", "1"], proc.stdout
    for _, accuracy, dropped, sent in found:
        assert float(accuracy) > 0.8 and int(sent) == 150 * 2 * 2 and 0 < int(dropped) < int(sent)


@pytest.mark.parametrize("extra", [["--drop-rate", "0.1"], pytest.param(["--diloco", "10"], marks=pytest.mark.kill),
                                   ["--transport", "udp"]], ids=["rps-gloo", "diloco-gloo", "rps-udp"])
def test_transformer_example_runs_under_torchrun(extra: list[str], tmp_path: Path) -> None:
    """examples/transformer_averager.py: a user's own transformer loop with RPSAverager (gloo, drawn losses; udp,
    the loopback's own) and ModelAverager with DiLoCo's outer step, 2 processes; the byte perplexity falls from
    about 256 and both ranks report the exchanges."""
    script = Path(__file__).resolve().parents[1] / "examples" / "transformer_averager.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), "--steps", "40", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.findall(r"rank (\d): test perplexity ([\d.]+), messages dropped (\d+) of (\d+)", proc.stdout)
    assert sorted(rank for rank, *_ in found) == ["0", "1"], proc.stdout
    for _, perplexity, dropped, sent in found:
        assert float(perplexity) < 20 and int(sent) > 0 and int(dropped) <= int(sent)
        if extra[0] == "--drop-rate":
            assert int(sent) == 40 * 2 * 2 and int(dropped) > 0
