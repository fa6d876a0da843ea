"""One RPS exchange against torch.distributed.all_reduce, and one local-SGD averaging round
against torch's PeriodicModelAverager, with 4 gloo processes on this machine.

    .venv/bin/python benchmarks/comm.py [--repeats 15] [--sizes 1e5 1e6 1e7]
    .venv/bin/python benchmarks/comm.py --udp                 # also RPS over the udp transport (loss 0)
    python3 benchmarks/comm.py --udp --device cuda           # and udp with the rows on a GPU
    .venv/bin/python benchmarks/comm.py --udp --no-gloo --sizes 1e8 --repeats 1   # a large udp round alone

``--udp`` adds the udp transport's RPS round (``UdpDistComm.block_average``, the masks it observed; no loss
but the machine's). ``--no-gloo`` leaves gloo's operations out (``--udp`` only), so that each rank's peak memory is the udp round's
alone: it is printed beside the memory a rank held before its first round (Python, torch, the gloo group and
the row). ``--device cuda`` adds the same round with each rank's row on the GPU
(``StagedComm``: copied to pinned host memory, exchanged, copied back, as a GPU rank of ``shaky train``
does); every rank uses the one GPU, as ranks on a machine with one would.

Prints the median seconds of each operation and the ratios, all measured in this run with
the operations interleaved (the machine is noisy: compare ratios, not absolute times across runs).
"""

from __future__ import annotations

import argparse
import os
import resource
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


def _rss_mb() -> float:
    """This process's resident memory now, MB (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker(rank: int, port: int, sizes: list[int], repeats: int, results, udp_too: bool = False,
            device: str = "cpu", gloo: bool = True) -> None:
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
    udp = staged = None
    if udp_too:
        from shaky.comm.staged import StagedComm  # noqa: PLC0415
        from shaky.comm.udp.comm import UdpDistComm  # noqa: PLC0415

        udp = UdpDistComm(host="127.0.0.1", announce=False)
        if device != "cpu":
            staged = StagedComm(udp, torch.device(device))
    for n in sizes:
        x = torch.randn(1, n)
        y = x.clone() if gloo else None
        results[("before_mb", rank, n)] = _rss_mb()
        fns = {"rps": lambda x=x: comm.block_average(x, links.up, links.down),
               "all_reduce": lambda y=y: dist.all_reduce(y)} if gloo else {}
        if udp is not None:
            seg = udp.segment_bytes
            masks = NetworkModel(NetworkConfig(segment_bytes=seg), WORLD, seed=0, dim=n, itemsize=4).sample(0)
            fns["udp_rps"] = lambda x=x: udp.block_average(x, masks.up, masks.down, segment_bytes=seg)
            if staged is not None:
                xg = x.to(device)

                def on_gpu(xg=xg, masks=masks, seg=seg) -> None:
                    staged.block_average(xg, masks.up, masks.down, segment_bytes=seg)
                    torch.cuda.synchronize()
                fns["udp_rps_gpu"] = on_gpu
        measured = _times(fns, repeats)
        for name, t in measured.items():
            out[(name, n)] = t
        del x, y, fns
    # The peak resident set of every rank over the rounds (before the averagers' part): Python, torch and the
    # largest size's rows with whatever each operation allocates.
    results[("peak_mb", rank)] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

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
    if udp is not None:
        udp.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e5, 1e6, 1e7])
    parser.add_argument("--udp", action="store_true", help="also RPS over the udp transport")
    parser.add_argument("--no-gloo", action="store_true", help="with --udp: the udp round alone (its memory)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]: with --udp, also udp RPS "
                                                        "with the rows on that GPU, staged through pinned memory")
    args = parser.parse_args()
    if args.no_gloo and not args.udp:
        parser.error("--no-gloo needs --udp (otherwise nothing is measured)")
    if args.device != "cpu":
        if not args.udp:
            parser.error("--device needs --udp (the GPU rows are exchanged by the udp transport)")
        if not torch.cuda.is_available():
            parser.error(f"--device {args.device}: torch sees no CUDA device")
    sizes = [int(s) for s in args.sizes]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(_free_port(), sizes, args.repeats, results, args.udp, args.device,
                                          not args.no_gloo),
                           nprocs=WORLD, start_method="spawn", join=True)
        results = dict(results)
    med, fastest = statistics.median, min
    gpu = f", GPU {torch.cuda.get_device_name(torch.device(args.device))}" if args.device != "cpu" else ""
    print(f"{WORLD} gloo processes on 127.0.0.1, torch {torch.__version__}, {os.cpu_count()} CPUs{gpu}, "
          f"{args.repeats} repeats, interleaved; load average {os.getloadavg()[0]:.1f}\n")
    if not args.no_gloo:
        print(f"{'float32 values':>15} | {'RPS exchange (s)':>16} | {'all_reduce (s)':>14} | RPS / all_reduce | "
              f"fastest / fastest")
        print(f"{'-' * 15}-|-{'-' * 16}-|-{'-' * 14}-|------------------|------------------")
        for n in sizes:
            rps, ar = results[("rps", n)], results[("all_reduce", n)]
            print(f"{n:>15.0e} | {med(rps):>16.5f} | {med(ar):>14.5f} | {med(rps) / med(ar):>16.2f} | "
                  f"{fastest(rps) / fastest(ar):.2f}")
    for op, what in (("udp_rps", "udp RPS, host rows"), ("udp_rps_gpu", "udp RPS, GPU rows (staged)")):
        if (op, sizes[0]) not in results:
            continue
        print(f"\n{'float32 values':>15} | {what + ' (s)':>30} | {'/ all_reduce':>12} | {'Gbit/s, all ranks':>17}")
        for n in sizes:
            t, ar = results[(op, n)], results.get(("all_reduce", n))
            # A round moves 2 (W - 1) / W of the row out of every rank (each rank's blocks to their servers, and
            # each server's average back): the payload, all ranks together, over the round's time.
            gbit = WORLD * 2 * (WORLD - 1) / WORLD * n * 4 * 8 / med(t) / 1e9
            ratio = f"{med(t) / med(ar):>12.2f}" if ar else f"{'-':>12}"
            print(f"{n:>15.0e} | {med(t):>30.5f} | {ratio} | {gbit:>17.2f}")
    peaks = [results[("peak_mb", r)] for r in range(WORLD)]
    before = [results[("before_mb", r, max(sizes))] for r in range(WORLD)]
    print(f"\npeak resident memory of each rank over the rounds: {', '.join(f'{m:.0f}' for m in peaks)} MB "
          f"(a {max(sizes):.0e}-value float32 row is {max(sizes) * 4 / 2**20:.1f} MB; before the first round of "
          f"that size each rank held {', '.join(f'{m:.0f}' for m in before)} MB)")
    ours, theirs = results["shaky_averager"], results["torch_averager"]
    print(f"\nlocal-SGD averaging round, 1.01M-parameter MLP: shaky ModelAverager {med(ours):.5f} s, "
          f"torch PeriodicModelAverager {med(theirs):.5f} s, ratio {med(ours) / med(theirs):.2f} "
          f"(fastest {fastest(ours) / fastest(theirs):.2f})")
    print("medians in seconds; 'fastest' compares each operation's fastest repeat, what a quiet machine shows")

if __name__ == "__main__":
    main()
