"""One RPS exchange against torch.distributed.all_reduce, and one local-SGD averaging round
against torch's PeriodicModelAverager, with 4 gloo processes on this machine.

    .venv/bin/python benchmarks/comm.py [--repeats 15] [--sizes 1e5 1e6 1e7]

Prints the median seconds of each operation and the ratios, all measured in this run with
the operations interleaved (the machine is noisy: compare ratios, not absolute times across runs).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each operation per repeat, the operations interleaved (a, b, a, b, ...) between barriers,
    so that load from other programs hits them alike. The first two repeats warm buffers and connections."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeats + 2):
        for name, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    return times


def _worker(rank: int, port: int, sizes: list[int], repeats: int, results) -> None:
    torch.set_num_threads(1)
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager  # noqa: PLC0415

    from shaky.averager import ModelAverager  # noqa: PLC0415
    from shaky.comm.gloo import DistComm  # noqa: PLC0415
    from shaky.config import NetworkConfig  # noqa: PLC0415
    from shaky.network.model import NetworkModel  # noqa: PLC0415

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))
    comm = DistComm()
    links = NetworkModel(NetworkConfig(drop_rate=0.1), WORLD, seed=0).sample(0)
    out = {}
    for n in sizes:
        x = torch.randn(1, n)
        y = x.clone()
        measured = _times({"rps": lambda x=x: comm.block_average(x, links.up, links.down),
                           "all_reduce": lambda y=y: dist.all_reduce(y)}, repeats)
        for name, t in measured.items():
            out[(name, n)] = t

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

    out.update(_times({"shaky_averager": ours.step, "torch_averager": torch_round}, repeats))
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
    med, fastest = statistics.median, min
    print(f"{WORLD} gloo processes on 127.0.0.1, torch {torch.__version__}, {args.repeats} repeats, interleaved; "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print(f"{'float32 values':>15} | {'RPS exchange (s)':>16} | {'all_reduce (s)':>14} | RPS / all_reduce | "
          f"fastest / fastest")
    print(f"{'-' * 15}-|-{'-' * 16}-|-{'-' * 14}-|------------------|------------------")
    for n in sizes:
        rps, ar = results[("rps", n)], results[("all_reduce", n)]
        print(f"{n:>15.0e} | {med(rps):>16.5f} | {med(ar):>14.5f} | {med(rps) / med(ar):>16.2f} | "
              f"{fastest(rps) / fastest(ar):.2f}")
    ours, theirs = results["shaky_averager"], results["torch_averager"]
    print(f"\nlocal-SGD averaging round, 1.01M-parameter MLP: shaky ModelAverager {med(ours):.5f} s, "
          f"torch PeriodicModelAverager {med(theirs):.5f} s, ratio {med(ours) / med(theirs):.2f} "
          f"(fastest {fastest(ours) / fastest(theirs):.2f})")
    print("medians in seconds; 'fastest' compares each operation's fastest repeat, what a quiet machine shows")

if __name__ == "__main__":
    main()
