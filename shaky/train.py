"""One training loop for both backends, read top to bottom.

``prepare`` does everything that can fail on user input (data, shards, model,
network, strategy) before anything is written. ``train`` then runs the loop:
each step draws every local worker's mini-batch, computes all their gradients
at once (one batched computation over the [w, D] parameter rows, see
``shaky.vectorized``), samples the network for the round, lets the strategy
update and exchange, and advances the simulated clock. Metrics, checkpoints and
the delivery trace go to the run directory; only the writer process (rank 0 in
torch.distributed) writes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import vmap

from shaky.comm.base import Comm
from shaky.comm.sim import SimComm
from shaky.config import RunConfig, config_from_dict, load_toml, to_dict, to_toml
from shaky.data import Dataset, assign_chunks, coverage, load_dataset, partition, shard_summary
from shaky.models import FlatParams, build_model
from shaky.network.clock import Clock, ClockState
from shaky.network.faults import FailureSchedule
from shaky.network.model import LinkSample, MaskLog, NetworkModel, TraceNetwork, load_trace, save_trace
from shaky.strategies import Strategy, build_strategy
from shaky.strategies.base import StepStats
from shaky.vectorized import fused_update, make_functions

CONFIG_FILE = "config.toml"
CHECKPOINT_FILE = "checkpoint.pt"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
SHARDS_FILE = "shards.json"

# Keeps the mini-batch stream apart from the other streams seeded by the run seed.
_BATCH_STREAM = 0x626174


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (not a scalar: arrays wrap modulo 2**64 silently)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _permuted(pos: np.ndarray, n: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Where a keyed random permutation of ``range(n)`` sends each position (arrays of one shape).

    Four rounds of bijections on the m-bit integers, 2**m the smallest power of two >= n
    (xor with a round key, multiplication by an odd round key modulo 2**m, an xor-shift
    by half the width), applied again to the images that land at n or beyond ("cycle
    walking", under two rounds on average), then a keyed rotation: a bijection of
    ``range(n)`` evaluated at just the positions a step needs, with no permutation
    stored or sorted. Where a position lands is uniform over the keys (chi-square
    checked for n = 2 to 1000), and so are pairs of positions where checked
    (n = 22); the orders of shards of a few samples come from a smaller family,
    which matters little since a batch then spans the whole shard.
    """
    n = n.astype(np.uint64)
    bits = np.ceil(np.log2(np.maximum(n, 2).astype(np.float64))).astype(np.uint64)
    mask = (np.uint64(1) << bits) - np.uint64(1)
    half = (bits + np.uint64(1)) // np.uint64(2)
    round_keys = [_mix(key + np.uint64(r)) for r in (1, 2, 3, 4)]
    x = pos.astype(np.uint64)
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        y, m, h = x[todo], mask[todo], half[todo]
        for k in round_keys:
            y = (y ^ k[todo]) & m
            y = (y * (k[todo] | np.uint64(1))) & m
            y = y ^ (y >> h)
        x[todo] = y
        todo[todo] = y >= n[todo]
    # A final keyed rotation of range(n) makes where each position lands uniform over the keys,
    # which the rounds alone do not for small n (they draw from few bijections of few bits).
    return ((x + _mix(key) % n) % n).astype(np.int64)


class BatchSampler:
    """Mini-batch indices per worker: a pure function of (seed, worker, step).

    Worker i walks through its shard in a fresh random order each epoch, the order a
    keyed permutation of (seed, i, epoch) (see ``_permuted``), so a resumed run, the
    simulator and every torch.distributed rank draw the same batches without saving
    any state. A step computes just the positions it needs, for all workers at once:
    a fixed number of array operations on [w, batch] arrays, whatever the number of
    workers or the size of their shards.
    """

    def __init__(self, shards: list[np.ndarray], rows: list[int], batch_sizes: tuple[int, ...] | list[int],
                 seed: int) -> None:
        self.rows = rows
        self.batch_sizes = np.asarray([batch_sizes[r] for r in rows], dtype=np.int64)
        self.width = max(batch_sizes)
        self.seed = seed
        self.lengths = np.asarray([len(shards[r]) for r in rows], dtype=np.int64)
        if (self.lengths == 0).any():
            raise ValueError(f"worker {rows[int(np.argmin(self.lengths))]} has no training samples")
        self._padded = np.zeros((len(rows), int(self.lengths.max())), dtype=np.int64)  # shard k in row k
        for k, r in enumerate(rows):
            self._padded[k, :len(shards[r])] = shards[r]
        run_key = _mix(np.array([seed ^ _BATCH_STREAM], dtype=np.uint64))
        self._worker_keys = _mix(run_key + np.asarray(rows, dtype=np.uint64))
        # Which slots of the padded [w, width] batch are real samples (workers may differ in batch size).
        self.mask = torch.from_numpy((np.arange(self.width)[None, :] < self.batch_sizes[:, None]).astype(np.float32))

    def indices(self, step: int) -> torch.Tensor:
        """int64 [w, width]: each local worker's samples at ``step``, padded (see ``mask``) to the widest batch."""
        slots = np.arange(self.width)[None, :]
        real = slots < self.batch_sizes[:, None]
        epochs, offsets = np.divmod(step * self.batch_sizes[:, None] + slots, self.lengths[:, None])
        keys = _mix(self._worker_keys[:, None] + epochs.astype(np.uint64))
        lengths = np.broadcast_to(self.lengths[:, None], offsets.shape)
        picked = self._padded[np.arange(len(self.rows))[:, None], _permuted(offsets, lengths, keys)]
        return torch.from_numpy(np.where(real, picked, 0))


@dataclass
class Setup:
    """Everything a run needs, built and checked before anything is written."""

    cfg: RunConfig
    data: Dataset
    shards: list[np.ndarray]
    model: torch.nn.Module
    flat: FlatParams
    network: NetworkModel
    strategy: Strategy[Any]
    compute_ms: float
    dtype: torch.dtype
    grad_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    forward_fn: Callable[..., torch.Tensor] = field(repr=False)


# Measured compute times, per (dataset, model, batch size, dtype), shared by the runs of one process
# so that runs compared side by side (the demo, a sweep) are charged the same compute time.
_COMPUTE_MS: dict[tuple[Any, ...], float] = {}


def _measure_compute_ms(setup: Setup, params: torch.Tensor) -> float:
    """Fastest of a few timed forward+backward passes of one worker at its batch size, on this machine.

    The minimum, not the mean, because everything else running on the machine only ever adds time.
    """
    cfg = setup.cfg
    key = (cfg.data.dataset, cfg.data.path, cfg.model.name, cfg.model.hidden, cfg.batch_size, cfg.dtype)
    if key not in _COMPUTE_MS:
        n = min(cfg.batch_size, len(setup.data.y_train))
        x, y = setup.data.x_train[None, :n], setup.data.y_train[None, :n]
        mask = torch.ones(1, n, dtype=x.dtype if x.is_floating_point() else setup.dtype)
        times = []
        for i in range(10):
            t0 = time.perf_counter()
            setup.grad_fn(params[:1], x, y, mask)
            if i >= 3:  # the first calls pay for allocation and dispatch warm-up
                times.append(time.perf_counter() - t0)
        _COMPUTE_MS[key] = float(min(times) * 1e3)
    return _COMPUTE_MS[key]


def prepare(cfg: RunConfig) -> Setup:
    """Loads data, cuts shards, builds the model, network and strategy; raises ValueError on bad input."""
    dtype = getattr(torch, cfg.dtype)
    data = load_dataset(cfg.data.dataset, seed=cfg.seed, path=cfg.data.path,
                        test_fraction=cfg.data.test_fraction, max_len=cfg.data.max_len)
    if data.x_train.is_floating_point():
        data = dataclasses.replace(data, x_train=data.x_train.to(dtype), x_test=data.x_test.to(dtype))
    chunks = partition(data.y_train.numpy(), cfg.num_workers, kind=cfg.data.partition, seed=cfg.seed,
                       alpha=cfg.data.dirichlet_alpha)
    shards = assign_chunks(chunks, cfg.strategy.redundancy)
    model = build_model(cfg.model.name, input_shape=data.input_shape, num_classes=data.num_classes,
                        vocab_size=data.vocab_size, hidden=cfg.model.hidden, seed=cfg.seed).to(dtype)
    flat = FlatParams(model)
    if cfg.network.trace:
        up, down = load_trace(cfg.network.trace, cfg.num_workers, cfg.steps)
        network: NetworkModel = TraceNetwork(cfg.network, cfg.num_workers, cfg.seed, up, down)
    else:
        network = NetworkModel(cfg.network, cfg.num_workers, cfg.seed)
    grad_fn, forward_fn = make_functions(model, flat)
    setup = Setup(cfg, data, shards, model, flat, network, build_strategy(cfg), cfg.network.compute_ms,
                  dtype, grad_fn, forward_fn)
    if setup.compute_ms < 0:
        setup.compute_ms = _measure_compute_ms(setup, flat.flatten(model)[None])
    return setup


def train_step(grad_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], strategy: Strategy[Any],
               params: torch.Tensor, state: Any, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
               comm: Comm, links: LinkSample, *, need_grads: bool = False,
               marks: list[float] | None = None) -> tuple[torch.Tensor, Any, StepStats, torch.Tensor,
                                                          torch.Tensor | None]:
    """One step of every worker: gradients on the batch ``x, y, mask``, then ``strategy``'s update.

    Where the model has a fused backward pass (``shaky.vectorized.fused_update``)
    and the strategy a local update that can run inside it (the model-averaging
    strategies), the local SGD update is applied to ``params`` in place, parameter
    by parameter, as the backward pass produces the gradients, and the average
    follows in place: no ``[W, D]`` gradient is assembled (at W = 64 that saved
    a sixth of the MLP's round, see docs/performance.md). The numbers are
    identical either way (tests/test_train.py). The fused path is skipped when
    the caller needs the gradients (``need_grads``: the gradient-diversity
    metric) and when a worker is down this step (a dead worker's row must not
    change, which the functional path handles).

    ``params`` is consumed: the caller must use the returned tensor and not read
    ``params`` afterwards (it may have been updated in place). ``marks``, if
    given, gets the time after the gradients (and fused update) and after the
    rest of the step appended (the benchmark's split of a round).

    Returns ``(params, state, stats, losses, grads)``; ``grads`` is None on the fused path.
    """
    fused = fused_update(grad_fn)
    local_update = getattr(strategy, "local_update", None)
    if fused is not None and local_update is not None and not need_grads and links.live is None:
        update, state = local_update(params, state)
        losses = fused(params, x, y, mask, update)
        if marks is not None:
            marks.append(time.perf_counter())
        params, state, stats = strategy.after_local_update(params, state, comm, links)  # type: ignore[attr-defined]
        if marks is not None:
            marks.append(time.perf_counter())
        return params, state, stats, losses, None
    grads, losses = grad_fn(params, x, y, mask)
    if marks is not None:
        marks.append(time.perf_counter())
    # Read what the caller needs from the gradients before the step: it may reuse their buffer (see Strategy).
    kept = grads.clone() if need_grads else None
    new_params, new_state, stats = strategy.step(params, grads, state, comm, links)
    if links.live is not None:  # a failed worker neither computes nor changes
        live_rows = links.live[comm.rows]
        new_params = torch.where(live_rows[:, None], new_params, params)
        new_state = _keep_dead_rows(new_state, state, live_rows)
    if marks is not None:
        marks.append(time.perf_counter())
    return new_params, new_state, stats, losses, kept


def gradient_diversity(grads: torch.Tensor, comm: Comm, weights: torch.Tensor | None) -> float:
    """sum_i ||g_i||^2 / ||sum_i g_i||^2 over the live workers (Yin et al. 2018): 1/n for equal gradients."""
    n = comm.num_workers if weights is None else float(weights.sum())
    mean_sq = comm.mean(grads.pow(2).sum(dim=1, keepdim=True), weights)[0, 0]
    mean_grad = comm.mean(grads, weights)[0]
    return float(mean_sq / (n * mean_grad.pow(2).sum()))


def _map_rows(tree: Any, num_rows: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Applies ``fn`` to every tensor with a leading worker axis of ``num_rows`` in a (Named)tuple tree."""
    if isinstance(tree, torch.Tensor) and tree.dim() > 0 and tree.shape[0] == num_rows:
        return fn(tree)
    if isinstance(tree, tuple):
        mapped = [_map_rows(t, num_rows, fn) for t in tree]
        return type(tree)(*mapped) if hasattr(tree, "_fields") else type(tree)(mapped)
    return tree


def _keep_dead_rows(new: Any, old: Any, live_rows: torch.Tensor) -> Any:
    """``new`` with the rows of dead workers taken from ``old``, through any tuple/NamedTuple of tensors."""
    if isinstance(new, torch.Tensor) and new.dim() > 0 and new.shape[0] == live_rows.shape[0]:
        return torch.where(live_rows.reshape(-1, *([1] * (new.dim() - 1))), new, old)
    if isinstance(new, tuple) and isinstance(old, tuple) and len(new) == len(old):
        kept = [_keep_dead_rows(n, o, live_rows) for n, o in zip(new, old)]
        return type(new)(*kept) if hasattr(new, "_fields") else type(new)(kept)
    return new


def evaluate(setup: Setup, params: torch.Tensor, comm: Comm, weights: torch.Tensor | None = None,
             chunk: int = 2048) -> dict[str, float]:
    """Test metrics of the averaged model and of each worker, and the consensus distance (over live workers)."""
    mean = comm.mean(params, weights)[:1]
    consensus = comm.mean((params - mean).pow(2).sum(dim=1, keepdim=True), weights)[0, 0]
    x, y = setup.data.x_test, setup.data.y_test
    avg_correct = avg_loss = 0.0
    worker_correct = torch.zeros(params.shape[0], dtype=torch.float64)
    per_worker = vmap(setup.forward_fn, in_dims=(0, None))
    with torch.no_grad():
        for s in range(0, len(y), chunk):
            xs, ys = x[s:s + chunk], y[s:s + chunk]
            out = setup.forward_fn(mean[0], xs)
            avg_loss += float(F.cross_entropy(out, ys, reduction="sum"))
            avg_correct += float((out.argmax(-1) == ys).sum())
            worker_correct += (per_worker(params, xs).argmax(-1) == ys).sum(dim=1).double()
    worker_acc = comm.mean((worker_correct / len(y))[:, None], weights)[0, 0]
    return {"test_accuracy": avg_correct / len(y), "test_loss": avg_loss / len(y),
            "worker_test_accuracy": float(worker_acc), "consensus_distance": float(consensus)}


def _atomic_write(path: Path, write: Callable[[Any], None], mode: str = "w") -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


class Progress:
    """A progress bar on a terminal, plain lines otherwise (logs, CI, pipes)."""

    def __init__(self, total: int, initial: int, label: str, enabled: bool) -> None:
        self.enabled = enabled
        self.label = label
        self.total = total
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm  # noqa: PLC0415

            self.bar = tqdm(total=total, initial=initial, desc=label, unit="step", leave=False, dynamic_ncols=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def report(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        msg = (f"acc {row['test_accuracy']:.4f} loss {row['test_loss']:.4f} "
               f"consensus {row['consensus_distance']:.3g} sim {row['sim_time_s']:.1f}s")
        if self.bar is not None:
            self.bar.set_postfix_str(msg, refresh=True)
        else:
            print(f"{self.label} step {row['step']}/{self.total} {msg}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class InterruptedRun(RuntimeError):
    """Raised by an injected fault (``stop_at``)."""


@dataclass
class Counters:
    """Cumulative totals that a checkpoint carries."""

    step: int = 0
    sim_time_s: float = 0.0
    wall_time_s: float = 0.0
    bytes_sent: int = 0
    messages_sent: int = 0
    messages_dropped: int = 0
    train_loss_sum: float = 0.0
    train_loss_count: int = 0
    comm_rounds: int = 0
    rounds_to_target: int = -1


def new_run_dir(base: str | Path) -> Path:
    """``base`` if it does not exist yet, else ``base-1``, ``base-2``, ...: never overwrites a run."""
    base = Path(base)
    candidate, i = base, 0
    while candidate.exists():
        i += 1
        candidate = base.with_name(f"{base.name}-{i}")
    return candidate


def train(setup: Setup, run_dir: Path, *, comm: Comm | None = None, resume: bool = False,
          writer: bool = True, label: str = "train", progress: bool = True,
          stop_at: int | None = None) -> dict[str, Any]:
    """Runs (or resumes) training into ``run_dir`` and returns the summary.

    ``stop_at`` injects a crash: the run stops right after that step without a
    final checkpoint or summary, as a killed process would, and raises
    ``InterruptedRun``. Tests use it to check that resume is bit-identical.
    """
    cfg = setup.cfg
    comm = comm or SimComm(cfg.num_workers)
    rows = comm.rows.tolist()
    sampler = BatchSampler(setup.shards, rows, cfg.worker_batch_sizes(), cfg.seed)
    batch_mask = sampler.mask.to(setup.dtype)
    failures = FailureSchedule(cfg.failures, cfg.num_workers, cfg.steps)
    held = [set(s.tolist()) for s in setup.shards] if cfg.failures else None
    clock = Clock(setup.network, setup.compute_ms, cfg.network.retransmit_timeout_ms)
    x_train, y_train = setup.data.x_train, setup.data.y_train
    strategy = setup.strategy

    if resume:
        ckpt = torch.load(run_dir / CHECKPOINT_FILE, weights_only=False)
        params = ckpt["params"][rows]
        state = _map_rows(ckpt["state"], cfg.num_workers, lambda t: t[rows])
        counters = Counters(**ckpt["counters"])
        # Exchanges still in flight at the checkpoint arrive after the resume as they would have without it.
        clock.state = ckpt.get("clock") or ClockState(counters.step, counters.sim_time_s, counters.sim_time_s)
        masks = MaskLog(cfg.num_workers, cfg.steps)
        for r in range(counters.step):
            masks.append(setup.network.sample(r))
        if writer:
            _truncate_metrics(run_dir / METRICS_FILE, counters.step)
    else:
        params = setup.flat.flatten(setup.model)[None].repeat(len(rows), 1)
        state = strategy.init(params)
        counters = Counters()
        masks = MaskLog(cfg.num_workers, cfg.steps)
        if writer:
            run_dir.mkdir(parents=True, exist_ok=True)
            if any(run_dir.iterdir()):
                raise FileExistsError(f"run directory {str(run_dir)!r} is not empty")
            (run_dir / CONFIG_FILE).write_text(to_toml(cfg))
            summary = shard_summary(setup.shards, setup.data.y_train.numpy(), setup.data.num_classes)
            for entry, shard in zip(summary, setup.shards):
                entry["indices"] = [int(i) for i in shard]
            (run_dir / SHARDS_FILE).write_text(json.dumps(summary))
            (run_dir / METRICS_FILE).write_text("")

    def log(row: dict[str, Any]) -> None:
        if writer:
            with open(run_dir / METRICS_FILE, "a") as f:
                f.write(json.dumps(row) + "\n")
        bar.report(row)

    def metrics_row(diversity: float | None, live_weights: torch.Tensor | None) -> dict[str, Any]:
        c = counters
        train_loss = c.train_loss_sum / c.train_loss_count if c.train_loss_count else None
        live = failures.live(max(c.step - 1, 0))
        return {"step": c.step, "sim_time_s": c.sim_time_s, "bytes_sent": c.bytes_sent,
                "messages_sent": c.messages_sent, "messages_dropped": c.messages_dropped,
                "comm_rounds": c.comm_rounds, "live_workers": int(live.sum()),
                "coverage": 1.0 if held is None else
                len(set().union(*(h for h, alive in zip(held, live.tolist()) if alive))) / len(y_train),
                "gradient_diversity": diversity,
                "train_loss": train_loss, **evaluate(setup, params, comm, live_weights),
                "lr": strategy.sgd.lr(max(c.step - 1, 0)) if hasattr(strategy, "sgd") else None,
                "wall_time_s": c.wall_time_s + time.perf_counter() - t_start}

    def save_checkpoint() -> None:
        full_params, full_state = comm.gather(params), _map_rows(state, len(rows), comm.gather)
        if not writer:
            return
        blob = {"params": full_params, "state": full_state, "counters": {**vars(counters),
                "wall_time_s": counters.wall_time_s + time.perf_counter() - t_start}, "config": to_dict(cfg),
                "clock": clock.state}
        _atomic_write(run_dir / CHECKPOINT_FILE, lambda f: torch.save(blob, f), "wb")
        save_trace(run_dir, masks.packed(), cfg.num_workers)

    t_start = time.perf_counter()
    bar = Progress(cfg.steps, counters.step, label, progress and writer)
    last = None
    if counters.step == 0:
        last = metrics_row(None, None)
        log(last)
    while counters.step < cfg.steps:
        step = counters.step
        comm.on_step(step)
        rejoined = failures.rejoined(step)
        if bool(rejoined.any()):  # a returning worker starts from the live workers' average model
            synced = comm.mean(params, failures.live(step - 1).to(params.dtype))
            params = torch.where(rejoined[rows][:, None], synced, params)
        idx = sampler.indices(step)
        raw_links = setup.network.sample(step)
        masks.append(raw_links)
        links = failures.apply(raw_links)
        evaluating = (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps
        live_weights = None if links.live is None else links.live.to(params.dtype)
        params, state, stats, losses, grads = train_step(setup.grad_fn, strategy, params, state, x_train[idx],
                                                         y_train[idx], batch_mask, comm, links,
                                                         need_grads=evaluating)
        diversity = gradient_diversity(grads, comm, live_weights) if grads is not None else None

        counters.step = step + 1
        counters.sim_time_s = clock.advance(stats.phases, stats.delay)
        counters.bytes_sent += stats.bytes_sent
        counters.messages_sent += stats.messages_sent
        counters.messages_dropped += stats.messages_dropped
        counters.comm_rounds += 1 if stats.phases else 0
        counters.train_loss_sum += float(comm.mean(losses.detach()[:, None], live_weights)[0, 0])
        counters.train_loss_count += 1
        bar.advance()

        if evaluating:
            last = metrics_row(diversity, live_weights)
            log(last)
            counters.train_loss_sum, counters.train_loss_count = 0.0, 0
            if cfg.target_accuracy and counters.rounds_to_target < 0 and \
                    last["test_accuracy"] >= cfg.target_accuracy:
                counters.rounds_to_target = counters.comm_rounds
            if not math.isfinite(last["test_loss"]):
                bar.close()
                raise FloatingPointError(f"training diverged at step {counters.step} (loss is not finite); "
                                         f"lower optim.lr (now {cfg.optim.lr})")
        if cfg.checkpoint_every and counters.step % cfg.checkpoint_every == 0 and counters.step < cfg.steps:
            save_checkpoint()
        if stop_at is not None and counters.step == stop_at:
            bar.close()
            raise InterruptedRun(f"stopped after step {stop_at} (injected fault)")
    bar.close()
    save_checkpoint()

    if last is None:  # resumed from a finished run: report its last evaluation
        last = _read_metrics(run_dir / METRICS_FILE)[-1]
    summary = {
        "final_test_accuracy": last["test_accuracy"], "final_test_loss": last["test_loss"],
        "final_train_loss": last["train_loss"], "final_worker_test_accuracy": last["worker_test_accuracy"],
        "consensus_distance": last["consensus_distance"], "bytes_sent": counters.bytes_sent,
        "comm_rounds": counters.comm_rounds,
        "rounds_to_target": counters.rounds_to_target if counters.rounds_to_target >= 0 else None,
        "target_accuracy": cfg.target_accuracy, "live_workers": last["live_workers"], "coverage": last["coverage"],
        "messages_sent": counters.messages_sent, "messages_dropped": counters.messages_dropped,
        "sim_time_s": counters.sim_time_s, "wall_time_s": last["wall_time_s"], "steps": counters.step,
        # Throughput over W times that of one worker that never communicates (docs/clock.md).
        "scalability": counters.step * setup.compute_ms / 1e3 / counters.sim_time_s if counters.sim_time_s else None,
        "compute_ms": setup.compute_ms, "strategy": cfg.strategy.name, "num_workers": cfg.num_workers,
        "dataset": cfg.data.dataset, "model": cfg.model.name, "seed": cfg.seed,
        "drop_rate": cfg.network.drop_rate if isinstance(cfg.network.drop_rate, float) else "matrix",
        "num_parameters": setup.flat.dim,
    }
    if writer:
        _atomic_write(run_dir / SUMMARY_FILE, lambda f: f.write(json.dumps(summary, indent=2) + "\n"))
    return summary


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _truncate_metrics(path: Path, step: int) -> None:
    """Drops metrics lines written after the checkpoint, so a resumed run does not repeat them."""
    rows = [r for r in _read_metrics(path) if r["step"] <= step] if path.exists() else []
    _atomic_write(path, lambda f: f.writelines(json.dumps(r) + "\n" for r in rows))


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The resolved config saved in a run directory, checked that a checkpoint is there to resume."""
    d = Path(run_dir)
    if not (d / CONFIG_FILE).is_file():
        raise ValueError(f"resume: {str(d)!r} is not a run directory (no {CONFIG_FILE})")
    if not (d / CHECKPOINT_FILE).is_file():
        raise ValueError(f"resume: {str(d)!r} has no {CHECKPOINT_FILE} to resume from")
    return config_from_dict(load_toml(d / CONFIG_FILE))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The evaluations a run wrote, in order."""
    return _read_metrics(Path(run_dir) / METRICS_FILE)
