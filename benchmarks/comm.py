"""One RPS exchange against torch.distributed.all_reduce, and one local-SGD averaging round
against torch's PeriodicModelAverager, with 4 gloo processes on this machine.

    .venv/bin/python benchmarks/comm.py [--repeats 15] [--sizes 1e5 1e6 1e7]

Prints the median seconds of each operation and the ratios, all measured in this run
(the machine is noisy: compare ratios, not absolute times across runs).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])  # the first two warm buffers and connections up


def _worker(rank: int, port: int, sizes: list[int], repeats: int, results) -> None:
    torch.set_num_threads(1)
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager  # noqa: PLC0415

    from shaky.averager import ModelAverager  # noqa: PLC0415
    from shaky.comm.dist import DistComm  # noqa: PLC0415
    from shaky.config import NetworkConfig  # noqa: PLC0415
    from shaky.network.model import NetworkModel  # noqa: PLC0415

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))
    comm = DistComm()
    links = NetworkModel(NetworkConfig(drop_rate=0.1), WORLD, seed=0).sample(0)
    out = {}
    for n in sizes:
        x = torch.randn(1, n)
        out[("rps", n)] = _median_time(lambda: comm.block_average(x, links.up, links.down), repeats)
        y = x.clone()
        out[("all_reduce", n)] = _median_time(lambda: dist.all_reduce(y), repeats)

    # One local-SGD averaging round of a ~1M-parameter model: shaky's averager vs torch's.
    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.ReLU(), torch.nn.Linear(1000, 10))
    ours = ModelAverager(model, network={"drop_rate": 0.1}, period=1)
    theirs = PeriodicModelAverager(period=1, warmup_steps=0)
    params = list(model.parameters())
    for p in params:  # torch's averager only averages parameters that have a gradient
        p.grad = torch.zeros_like(p)

    def torch_round() -> None:
        theirs.step = 1  # PeriodicModelAverager averages when step >= warmup and step % period == 0
        theirs.average_parameters(params)

    out["shaky_averager"] = _median_time(ours.step, repeats)
    out["torch_averager"] = _median_time(torch_round, repeats)
    if rank == 0:
        results.update(out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e5, 1e6, 1e7])
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(_free_port(), sizes, args.repeats, results), nprocs=WORLD,
                           start_method="spawn", join=True)
        results = dict(results)
    print(f"{WORLD} gloo processes on 127.0.0.1, torch {torch.__version__}, medians of {args.repeats} repeats\n")
    print(f"{'float32 values':>15} | {'RPS exchange (s)':>16} | {'all_reduce (s)':>14} | RPS / all_reduce")
    print(f"{'-' * 15}-|-{'-' * 16}-|-{'-' * 14}-|-----------------")
    for n in sizes:
        rps, ar = results[("rps", n)], results[("all_reduce", n)]
        print(f"{n:>15.0e} | {rps:>16.5f} | {ar:>14.5f} | {rps / ar:.2f}")
    ours, theirs = results["shaky_averager"], results["torch_averager"]
    print(f"\nlocal-SGD averaging round, 1.01M-parameter MLP: shaky ModelAverager {ours:.5f} s, "
          f"torch PeriodicModelAverager {theirs:.5f} s, ratio {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
