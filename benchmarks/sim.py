"""How close is the simulator to the hardware limit? One training round, four ways, measured in one run.

    .venv/bin/python benchmarks/sim.py            # the full table (a few minutes on 2 cores)
    .venv/bin/python benchmarks/sim.py --quick    # fewer cases and repeats
    .venv/bin/python benchmarks/sim.py --models mlp --workers 16 --no-gloo
    .venv/bin/python benchmarks/sim.py --threads 1 --profile   # one thread; then profiles of (a) and (c)

One round is every worker's forward, backward and SGD update on its own batch of
``--batch`` samples, plus the averaging of the models:

a. shaky's simulator: ``shaky.train.train_step``, the step ``shaky train`` runs:
   ``shaky.vectorized.make_functions``'s gradients over the ``[W, D]`` parameters
   and one RPS step (the registry's ``rps`` composition: shaky's SGD stage and
   ``lossy_block_average`` over masks drawn by ``NetworkModel`` at drop rate
   0.1); for the MLP the SGD update runs inside the backward pass
   (``FusedGradFn.update_in_place``, the loop's one fused branch). ``a_grad`` is the gradient part (with that
   fused update), ``a_step`` the rest; ``a_vmap`` is the same round with the
   generic ``vmap(grad_and_value)`` path.
b. a naive loop: W ``nn.Module`` copies, each with its own ``torch.optim.SGD``,
   stepped one after another, then every parameter averaged across the copies.
c. the limit: one model at batch ``W * B``, forward, backward and an SGD step.
d. W torch.distributed gloo processes on 127.0.0.1, one worker each (one thread
   each), forward/backward/SGD at batch B and an all_reduce average of the flat
   parameters; the time of a round is measured inside the processes between
   barriers (W = 4 and 16 only).

a, b and c run interleaved in one process, so load from other programs hits them
alike: in bursts of ``BURST`` rounds (a a a a, b b b b, c c c c, a ...), timing all
but the first round of each burst, so each variant runs as a training loop does,
with its own data in the caches (rounds over a second: one at a time, all timed).
The table shows medians, and ratios of each
column's fastest round ("min"), which is what a quiet machine shows. ``peak MB``
is the growth of the peak resident set of a fresh process while it runs two
rounds of (a): ``VmHWM`` from /proc/self/status (the peak-RSS mark, reset just
before the rounds through /proc/self/clear_refs) minus ``VmRSS`` just before.
Inputs are random tensors of the datasets' shapes: timing does not depend on
the values (``--models lstm``: random token ids, right-padded to 32; ``--models gpt``: random bytes, a target
byte at every position, the model's mean next-token loss).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

# torch reads OMP_WAIT_POLICY when it loads; this benchmark does not adapt the wait as a shaky command does
# (shaky/waiting.py): note what this process runs with. (Spawned gloo processes run one thread each.)
OMP_POLICY = os.environ.get("OMP_WAIT_POLICY") or "unset (spin, then sleep)"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shaky.comm.sim import SimComm  # noqa: E402
from shaky.config import NetworkConfig, OptimConfig, StrategyConfig  # noqa: E402
from shaky.models import FlatParams, build_model  # noqa: E402
from shaky.network.faults import Membership, Round  # noqa: E402
from shaky.network.model import NetworkModel  # noqa: E402
from shaky.strategies import REGISTRY, SGD  # noqa: E402
from shaky.train import train_step  # noqa: E402
import shaky.vectorized as vectorized  # noqa: E402
from shaky.setup import deterministic_cuda, resolve_device  # noqa: E402
from shaky.vectorized import _GroupedGrad, fast_path, generic_functions, make_functions, tune_allocator  # noqa: E402

NUM_CLASSES = 10
LR = 0.05
DROP_RATE = 0.1

# name -> (model, input shape of one example, what it stands for)
CASES: dict[str, tuple[str, tuple[int, ...], str]] = {
    "mlp": ("mlp", (64,), "digits 8x8"),
    "cnn": ("cnn", (784,), "28x28 (MNIST-sized), Conv2d"),
    "cnn1d": ("cnn", (40,), "mnist1d, Conv1d"),
    "resnet20": ("resnet20", (3, 32, 32), "CIFAR 3x32x32"),
    "resnet110": ("resnet110", (3, 32, 32), "CIFAR 3x32x32"),
    "lstm": ("lstm", (32,), "text, 32 token ids, 2 to 32 real"),
    "gpt": ("gpt", (32,), "bytes, 32-byte context, next-byte targets"),
}
VOCAB = 1000
"""The lstm case's vocabulary (its token ids are drawn from 1 to VOCAB - 1; 0 pads)."""
BYTES = 256
"""The gpt case's vocabulary: bytes, as the bytes data set's."""
CUDA_PLAN: dict[str, tuple[int, ...]] = {"mlp": (16, 64, 256), "cnn": (16, 64, 256), "resnet20": (16, 64),
                                         "resnet110": (16,)}
"""--device cuda's default cases: each model at these W."""
DEVICE = torch.device("cpu")
"""Where the cases run (--device)."""
GLOO_WORKERS = (4, 16)


BURST = 4
"""Consecutive rounds of one variant between the others' (the first of a burst is not timed)."""
CLOCK: Callable[[], float] = time.perf_counter


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def _setup(case: str, workers: int, batch: int, seed: int = 0, channels_last: bool = False) -> dict[str, Any]:
    """Model, layout and a random batch per worker, on ``DEVICE``. ``channels_last``: 2-D conv nets (their
    weights and inputs) in channels-last memory format, the layout oneDNN runs fastest, for the baselines b, c
    and d."""
    name, shape, _ = CASES[case]
    classes, vocab = (BYTES, BYTES) if name == "gpt" else (NUM_CLASSES, VOCAB)
    model = build_model(name, input_shape=shape, num_classes=classes, vocab_size=vocab, seed=seed).to(DEVICE)
    flat = FlatParams(model)
    gen = torch.Generator().manual_seed(seed)
    if name == "gpt":    # a window of bytes and the next byte at every position
        x = torch.randint(0, BYTES, (workers, batch, *shape), generator=gen).to(DEVICE)
        y = torch.randint(0, BYTES, (workers, batch, *shape), generator=gen).to(DEVICE)
        return {"model": model, "flat": flat, "x": x, "y": y, "mask": torch.ones(workers, batch, device=DEVICE)}
    if name == "lstm":   # right-padded sentences of 2 to L tokens
        ids = torch.randint(1, VOCAB, (workers, batch, *shape), generator=gen)
        lengths = torch.randint(2, shape[0] + 1, (workers, batch, 1), generator=gen)
        x = torch.where(torch.arange(shape[0]) < lengths, ids, 0).to(DEVICE)
    else:
        x = torch.randn(workers, batch, *shape, generator=gen).to(DEVICE)
    y = torch.randint(0, NUM_CLASSES, (workers, batch), generator=gen).to(DEVICE)
    image_shape = tuple(getattr(model, "shape", ()))
    if channels_last and len(image_shape) == 3:
        model = model.to(memory_format=torch.channels_last)
        x = x.reshape(workers * batch, *image_shape).contiguous(memory_format=torch.channels_last)
        x = x.view(workers, batch, *image_shape)
    return {"model": model, "flat": flat, "x": x, "y": y, "mask": torch.ones(workers, batch, device=DEVICE)}


class SimRound:
    """(a): the simulator's round, ``shaky.train.train_step`` with RPS, exactly what train.py runs."""

    def __init__(self, s: dict[str, Any], workers: int, generic: bool = False, compile: bool = False,
                 channels_last: bool | None = None) -> None:
        model, flat = s["model"], s["flat"]
        if channels_last is not None:   # the grouped conv path in the layout given (a_alt)
            self.grad_fn: Any = _GroupedGrad(model, flat, channels_last=channels_last)
        else:
            self.grad_fn = (generic_functions(model, flat) if generic else
                            make_functions(model, flat, compile=compile))[0]
        self.params = flat.flatten(model)[None].repeat(workers, 1).contiguous()
        self.strategy = REGISTRY["rps"](StrategyConfig(name="rps"), SGD(OptimConfig(lr=LR)))
        self.state = self.strategy.init(self.params)
        self.comm = SimComm(workers)
        network = NetworkModel(NetworkConfig(drop_rate=DROP_RATE), workers, seed=0)
        members = Membership.everyone(workers)
        self.rounds = [Round(r, network.sample(r), members) for r in range(8)]
        self.x, self.y, self.mask = s["x"], s["y"], s["mask"]
        self.round = 0
        self.grad_s: list[float] = []
        self.step_s: list[float] = []
        self.labelled = False
        """Label the round for the profiler (``--profile``). Off when timing: an open record_function slows
        every op inside it (0.2 ms a round for the MLP at W = 64 here), and train.py opens none."""

    def _label(self, name: str) -> contextlib.AbstractContextManager:
        return torch.profiler.record_function(name) if self.labelled else contextlib.nullcontext()

    def __call__(self) -> None:
        # train.py's step function, so (a) is what `shaky train` runs (for the MLP: the optimizer inside the
        # backward pass, then the average in place); marks split it into the gradient part and the rest.
        # (On a GPU the marks would time the launches, not the work: no split there.)
        marks = [CLOCK()] if DEVICE.type == "cpu" else None
        rnd = self.rounds[self.round % len(self.rounds)]
        with self._label("a: train_step"):
            self.params, self.state, _, _, _ = train_step(self.grad_fn, self.strategy, self.params, self.state,
                                                          self.x, self.y, self.mask, self.comm, rnd, marks=marks)
        self.round += 1
        self.grad_s.append(marks[1] - marks[0] if marks else float("nan"))
        self.step_s.append(marks[2] - marks[1] if marks else float("nan"))


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of a batch: per sample, or (gpt) per token of ``[N, T, V]`` against ``[N, T]``."""
    return F.cross_entropy(logits.flatten(0, -2), y.reshape(-1))


class LoopRound:
    """(b): W separate model copies and optimizers in a Python loop, then a parameter average."""

    def __init__(self, s: dict[str, Any], workers: int) -> None:
        self.models = [copy.deepcopy(s["model"]) for _ in range(workers)]
        self.opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in self.models]
        self.params = [list(m.parameters()) for m in self.models]
        self.x, self.y = s["x"], s["y"]

    def __call__(self) -> None:
        for i, (m, opt) in enumerate(zip(self.models, self.opts)):
            opt.zero_grad()
            _loss(m(self.x[i]), self.y[i]).backward()
            opt.step()
        with torch.no_grad():
            for group in zip(*self.params):
                mean = torch.stack(group).mean(dim=0)
                for p in group:
                    p.copy_(mean)


class LimitRound:
    """(c): one model at batch W * B: forward, backward, SGD step."""

    def __init__(self, s: dict[str, Any], workers: int) -> None:
        self.model = copy.deepcopy(s["model"])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.x = s["x"].reshape(-1, *s["x"].shape[2:])
        self.y = s["y"].reshape(-1, *s["y"].shape[2:])

    def __call__(self) -> None:
        self.opt.zero_grad()
        _loss(self.model(self.x), self.y).backward()
        self.opt.step()


def _budget(quick: bool) -> tuple[float, int, int]:
    """(seconds of timed rounds per case, fewest rounds, most rounds)."""
    return (1.5, 3, 100) if quick else (6.0, 3, 300)


def bench_in_process(case: str, workers: int, batch: int, quick: bool, with_vmap: bool,
                     with_loop: bool, channels_last: bool = False, with_alt: bool = False) -> dict[str, Any]:
    """a, b, c (and a_vmap, a_alt) interleaved in bursts of rounds; medians and minimums in ms."""
    s = _setup(case, workers, batch)
    base = _setup(case, workers, batch, channels_last=channels_last) if channels_last else s
    runs: dict[str, Callable[[], None]] = {"a": SimRound(s, workers), "c": LimitRound(base, workers)}
    if with_loop:
        runs["b"] = LoopRound(base, workers)
    if with_vmap:
        runs["a_vmap"] = SimRound(s, workers, generic=True)
    a_fn = runs["a"].grad_fn if isinstance(runs["a"], SimRound) else None
    if with_alt and isinstance(a_fn, _GroupedGrad):   # the grouped conv path in its other memory layout
        runs["a_alt"] = SimRound(s, workers, channels_last=not a_fn.channels_last)
    budget_s, fewest, most = _budget(quick)
    times: dict[str, list[float]] = {k: [] for k in runs}
    a = runs["a"]
    if not isinstance(a, SimRound):
        raise TypeError("runs['a'] must be a SimRound")
    t0 = time.perf_counter()
    a()
    # Rounds that take seconds: one at a time (the first of each is timed too); fast ones: in bursts of
    # BURST, timing all but the first, so that each variant runs as a training loop does, round after
    # round with its own data in the caches, not just after another variant has evicted them.
    slow = time.perf_counter() - t0 > 1.0
    burst = 1 if slow else BURST
    t_start = time.perf_counter()
    grad_s, step_s = [], []
    for r in range(most):
        for key, fn in runs.items():
            for k in range(burst):
                t0 = CLOCK()
                fn()
                if burst == 1 or k > 0:
                    times[key].append(CLOCK() - t0)
                    if key == "a":
                        grad_s.append(a.grad_s[-1])
                        step_s.append(a.step_s[-1])
        if r >= fewest - 1 and time.perf_counter() - t_start > budget_s:
            break
    out: dict[str, Any] = {k: _median_ms(v) for k, v in times.items()}
    out.update({f"{k}_min": min(v) * 1e3 for k, v in times.items()})
    out["a_grad"] = _median_ms(grad_s)
    out["a_step"] = _median_ms(step_s)
    out["a_grad_min"] = min(grad_s) * 1e3
    out["a_step_min"] = min(step_s) * 1e3
    out["rounds"] = len(times["a"])
    if a_fn is not None and isinstance(a_fn, _GroupedGrad):
        out["a_layout"] = "channels-last" if a_fn.channels_last else "NCHW"
    return out


def cuda_peak_memory(case: str, workers: int, batch: int) -> dict[str, Any]:
    """Peak GPU memory of (a): the most PyTorch's allocator held during two rounds (data, parameters, state and
    activations), and its growth over what was allocated before them."""
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        s = _setup(case, workers, batch)
        run = SimRound(s, workers)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del run, s
        return {"peak_mb": (peak - before) / 2**20, "gpu_peak_mb": peak / 2**20}
    except torch.cuda.OutOfMemoryError as e:
        return {"error": f"out of memory ({' '.join(str(e).split())[:80]})"}


def profile_round(case: str, workers: int, batch: int, rounds: int = 5, row_limit: int = 18) -> None:
    """Print torch.profiler's table of (a), by operator, and of (c) beside it."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    s = _setup(case, workers, batch)
    a, c = SimRound(s, workers), LimitRound(s, workers)
    a.labelled = True
    for _ in range(2):
        a()
        c()
    cuda = DEVICE.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    for name, fn in (("a", a), ("c", c)):
        with profile(activities=activities, record_shapes=False) as prof:
            for _ in range(rounds):
                fn()
            if cuda:
                torch.cuda.synchronize()
        where = "GPU" if cuda else "CPU"
        print(f"\nprofile of ({name}) {case} W={workers}, {rounds} rounds, {where} time by operator:")
        print(prof.key_averages().table(sort_by=key, row_limit=row_limit, max_name_column_width=45))


# ---------------------------------------------------------------------------------------------------------- memory

def _status_mb(field: str) -> float:
    """A memory line of /proc/self/status (VmRSS: resident now, VmHWM: its peak), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _memory_child(case: str, workers: int, batch: int, rounds: int, threads: int, allocator: str,
                  queue: Any) -> None:
    try:
        torch.set_num_threads(threads)
        if allocator != "off":
            tune_allocator(keep_large_blocks=allocator == "keep")
        s = _setup(case, workers, batch)
        run = SimRound(s, workers)
        # Reset the peak-RSS mark (VmHWM) to the resident set now. ru_maxrss would not do: a spawned child
        # inherits its parent's peak through fork and exec.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_mb("VmRSS")
        for _ in range(rounds):
            run()
        peak = _status_mb("VmHWM")
        queue.put({"peak_mb": peak - before, "rss_before_mb": before, "peak_rss_mb": peak})
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put({"error": f"{type(e).__name__}: {e}"})


def peak_memory(case: str, workers: int, batch: int, threads: int, allocator: str,
                timeout_s: float) -> dict[str, Any]:
    """Peak resident-set growth of (a) in a fresh process (VmHWM after the rounds - VmRSS before them)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_memory_child, args=(case, workers, batch, 2, threads, allocator, queue), daemon=True)
    proc.start()
    try:
        return queue.get(timeout=timeout_s)
    except Exception:  # noqa: BLE001
        return {"error": f"no answer within {timeout_s:.0f} s"}
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()


# ------------------------------------------------------------------------------------------------------------ gloo

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gloo_worker(rank: int, world: int, port: int, cases: list[str], batch: int, quick: bool, allocator: str,
                 result_file: str, channels_last: bool = False) -> None:
    import torch.distributed as dist  # noqa: PLC0415 - only the dist baseline needs it

    torch.set_num_threads(1)
    if allocator != "off":
        tune_allocator(keep_large_blocks=allocator == "keep")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results: dict[str, float] = {}
    try:
        for case in cases:
            s = _setup(case, world, batch, channels_last=channels_last)
            model = s["model"]
            flat = s["flat"]
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            x, y = s["x"][rank], s["y"][rank]
            budget_s, fewest, most = _budget(quick)
            warm, times = 2, []
            t_start = time.perf_counter()
            for r in range(warm + most):
                dist.barrier()
                t0 = time.perf_counter()
                opt.zero_grad()
                _loss(model(x), y).backward()
                opt.step()
                vec = flat.flatten(model)
                dist.all_reduce(vec)
                flat.load(model, vec / world)
                dist.barrier()
                if r >= warm:
                    times.append(time.perf_counter() - t0)
                elif r == warm - 1:
                    t_start = time.perf_counter()
                # Every rank must run the same number of rounds: rank 0 decides when to stop.
                stop = torch.tensor([float(r >= warm + fewest - 1 and time.perf_counter() - t_start > budget_s)])
                dist.broadcast(stop, src=0)
                if stop.item():
                    break
            # A round ends when the slowest process is done: take the maximum over the ranks.
            t = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            results[case] = _median_ms(t.tolist())
        if rank == 0:
            Path(result_file).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def bench_gloo(world: int, cases: list[str], batch: int, quick: bool, allocator: str, timeout_s: float,
               scratch: Path, channels_last: bool = False) -> dict[str, float]:
    """(d) for every case at once with one group of ``world`` processes; {} (and a message) on failure."""
    result_file = scratch / f"gloo-{world}-{os.getpid()}.json"
    result_file.unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_gloo_worker, args=(r, world, port, cases, batch, quick, allocator, str(result_file),
                                                          channels_last), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        for p in procs:
            p.join(timeout=5)
    if alive:
        print(f"  gloo W={world}: timed out after {timeout_s:.0f} s; killed {len(alive)} processes", flush=True)
    if not result_file.exists():
        codes = [p.exitcode for p in procs]
        print(f"  gloo W={world}: no result (exit codes {codes})", flush=True)
        return {}
    out = json.loads(result_file.read_text())
    result_file.unlink()
    return out


# ----------------------------------------------------------------------------------------------------------- table

def _fmt(v: float | None, digits: int = 2) -> str:
    if v is None or v != v:
        return "-"
    if v >= 100:
        return f"{v:.0f}"
    return f"{v:.{digits}f}" if v < 10 else f"{v:.1f}"


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None else num / den


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["model", "W", "a ms", "a_grad", "a_step", "a_vmap", "a_alt", "b ms", "c ms", "d ms", "a/c", "b/a",
            "d/a", "vmap/a", "alt/a", "a/c min", "b/a min", "peak MB", "GPU MB", "k tok/s"]
    lines = [cols]
    for r in rows:
        a = r.get("a")
        peak = _fmt(r.get("peak_mb"), 0) if r.get("peak_mb") is not None else ("err" if "peak_error" in r else "-")
        lines.append([r["case"], str(r["W"]), _fmt(a), _fmt(r.get("a_grad")), _fmt(r.get("a_step")),
                      _fmt(r.get("a_vmap")), _fmt(r.get("a_alt")), _fmt(r.get("b")), _fmt(r.get("c")),
                      _fmt(r.get("d")), _fmt(_ratio(a, r.get("c"))), _fmt(_ratio(r.get("b"), a)),
                      _fmt(_ratio(r.get("d"), a)), _fmt(_ratio(r.get("a_vmap"), a)), _fmt(_ratio(r.get("a_alt"), a)),
                      _fmt(_ratio(r.get("a_min"), r.get("c_min"))),
                      _fmt(_ratio(r.get("b_min"), r.get("a_min"))), peak, _fmt(r.get("gpu_peak_mb"), 0),
                      _fmt(None if r.get("tokens_per_s") is None else r["tokens_per_s"] / 1e3, 0)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(cols))]
    for i, line in enumerate(lines):
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for r in rows:
        if "peak_error" in r:
            print(f"peak memory of {r['case']} W={r['W']}: {r['peak_error']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="mlp, cnn1d and cnn at W = 4 and 16 only, with shorter timing budgets")
    parser.add_argument("--models", nargs="+", choices=list(CASES), default=None,
                        help="default: mlp cnn cnn1d resnet20 (on a GPU: mlp cnn resnet20 resnet110); lstm and gpt "
                             "only when named")
    parser.add_argument("--workers", nargs="+", type=int, default=None)
    parser.add_argument("--batch", type=int, default=32, help="samples per worker")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for a/b/c (0: torch's default)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time a, b, c by wall clock, or by this process's CPU time (less sensitive to other "
                             "programs on the machine, but it also counts threads spinning in OpenMP barriers); "
                             "d is always wall clock")
    parser.add_argument("--no-gloo", action="store_true", help="skip (d)")
    parser.add_argument("--channels-last", action="store_true",
                        help="run the 2-D conv nets of the baselines b, c and d in channels-last memory format "
                             "(oneDNN's fastest layout, the one (a) uses); default: the modules as written (NCHW)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement of (a)")
    parser.add_argument("--no-vmap", action="store_true", help="skip a_vmap, the generic vmap path")
    parser.add_argument("--all", action="store_true",
                        help="also run b and a_vmap for resnet20 at W = 64 (most of a minute a round each)")
    parser.add_argument("--allocator", choices=("keep", "cap", "off"), default="keep",
                        help="glibc malloc settings for every variant (shaky.vectorized.tune_allocator): keep = "
                             "reuse every freed block (default), cap = reuse blocks up to 32 MiB, off = glibc's "
                             "defaults")
    parser.add_argument("--profile", action="store_true",
                        help="after the table, print torch.profiler tables of (a) and (c) for every case")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default), cuda or cuda:N: where every case runs (with shaky train's settings "
                             "for a GPU: deterministic algorithms); on a GPU there is no (d), and the default "
                             f"cases are {', '.join(f'{m} at W = {list(w)}' for m, w in CUDA_PLAN.items())}")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="on a GPU, run the conv nets' and the lstm's gradients eagerly instead of replaying a "
                             "CUDA graph")
    args = parser.parse_args(argv)

    global CLOCK, DEVICE
    try:
        DEVICE = resolve_device(args.device)
    except ValueError as exc:
        parser.error(f"--device: {exc}")
    cuda = DEVICE.type == "cuda"
    if cuda:
        deterministic_cuda()
        torch.cuda.set_device(DEVICE)
        if args.no_cuda_graphs:
            vectorized.CUDA_GRAPHS = False
        args.no_gloo = True
        if args.clock != "wall":
            parser.error("--clock cpu times the host alone; on a GPU use the wall clock")

        def cuda_clock() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()

        CLOCK = cuda_clock
    else:
        CLOCK = time.perf_counter if args.clock == "wall" else time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    tuned = args.allocator != "off" and tune_allocator(keep_large_blocks=args.allocator == "keep")
    allocator = args.allocator if tuned else "off"
    models = args.models or ((list(CUDA_PLAN) if cuda else ["mlp", "cnn", "cnn1d", "resnet20"]) if not args.quick
                             else ["mlp", "cnn1d", "cnn"])
    workers = args.workers or ([4, 16, 64] if not args.quick else [4, 16])
    threads = torch.get_num_threads()
    graphs = "conv and lstm gradients " + ("as CUDA graphs" if vectorized.CUDA_GRAPHS else "eager") + ", "
    gpu = f"{torch.cuda.get_device_name(DEVICE)} ({DEVICE}), {graphs}" if cuda else ""
    print(f"shaky benchmarks/sim.py: {gpu}{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {threads} threads (interop {torch.get_num_interop_threads()}), "
          f"OMP_WAIT_POLICY {OMP_POLICY}, "
          f"allocator: {allocator}, batch {args.batch} per worker, random inputs, {args.clock} clock, "
          f"baselines' conv nets {'channels-last' if args.channels_last else 'as written (NCHW)'}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for case in models:
        for w in (CUDA_PLAN.get(case, (16, 64)) if cuda and not args.workers else workers):
            name, shape, what = CASES[case]
            # The naive loop and the generic vmap path of ResNet-20 at W = 64 take most of a minute a round (on
            # the CPU); ResNet-110's and W = 256's take long on a GPU too.
            heavy = ((case.startswith("resnet") and w > 16) or case == "resnet110" or w > 64) and not args.all
            vmap_ok = not args.no_vmap and not heavy and not (case == "resnet20" and w > 4 and args.quick)
            t0 = time.perf_counter()
            row: dict[str, Any] = {"case": case, "model": name, "input": list(shape), "what": what, "W": w,
                                   "fast_path": fast_path(_setup(case, 1, 1)["model"])}
            row.update(bench_in_process(case, w, args.batch, args.quick, vmap_ok, with_loop=not heavy,
                                        channels_last=args.channels_last, with_alt=cuda and not heavy))
            if not args.no_memory:
                mem = (cuda_peak_memory(case, w, args.batch) if cuda else
                       peak_memory(case, w, args.batch, threads, allocator, timeout_s=600))
                if "error" in mem:
                    row["peak_error"] = mem["error"]
                else:
                    row.update(mem)
            if case == "gpt":    # every worker's batch of B windows, a target token at each of T positions
                row["tokens_per_s"] = w * args.batch * shape[0] / (row["a"] / 1e3)
            rows.append(row)
            print(f"  {case} W={w}: a {row['a']:.2f} ms, c {row['c']:.2f} ms, b {row.get('b', float('nan')):.2f} ms "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if not args.no_gloo:
        scratch = Path(os.environ.get("TMPDIR", "/tmp"))
        for w in [w for w in workers if w in GLOO_WORKERS]:
            t0 = time.perf_counter()
            res = bench_gloo(w, models, args.batch, args.quick, allocator, timeout_s=300, scratch=scratch,
                             channels_last=args.channels_last)
            for row in rows:
                if row["W"] == w and row["case"] in res:
                    row["d"] = res[row["case"]]
            print(f"  gloo W={w}: {res} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print()
    print_table(rows)
    if cuda:
        print("\non the GPU: a_grad/a_step not split (the marks would time the launches); a_alt: a with the "
              "grouped conv path in its other memory layout; peak MB: the GPU memory (a) allocates beyond its "
              "inputs; GPU MB: the most it held")
    print(f"\nmedians in ms per round (a = a_grad + a_step; a_vmap: a with the generic vmap grad_fn); "
          f"'min' ratios use each column's fastest round,\nwhich is what a quiet machine would show; peak MB = "
          f"growth of the peak resident set while (a) runs; k tok/s (gpt): thousands of tokens (a) trains on "
          f"per second; load average now {os.getloadavg()[0]:.1f}; "
          f"total {time.perf_counter() - t_start:.0f} s")
    if args.profile:
        for case in models:
            for w in workers:
                profile_round(case, w, args.batch, rounds={"mlp": 50, "cnn1d": 20}.get(case, 2))
    if args.json:
        args.json.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                                                     "device": str(DEVICE), "gpu": gpu.split(" (")[0],
                                                     "threads": threads, "allocator": allocator,
                                                     "clock": args.clock},
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.exit(130)
