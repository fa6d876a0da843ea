"""One training loop for both backends, read top to bottom.

``shaky.setup.prepare`` builds and checks everything first. ``train`` then runs
the loop: each step draws every local worker's mini-batch, computes all their
gradients at once (one batched computation over the [w, D] parameter rows, see
``shaky.vectorized``), takes the round's delivery masks and membership, lets the
strategy update and exchange, and advances the simulated clock. Metrics,
checkpoints and the delivery trace go to the run directory (``shaky.rundir``);
only the writer process writes: rank 0 in torch.distributed, and with live membership the first live rank
of :class:`Writers`.
"""

from __future__ import annotations

import collections
import contextlib
import math
import signal
import time
from pathlib import Path
from typing import Any, Callable

import torch

from shaky.comm.base import Comm, Done, MeanHandle, Observed, observer, on_device
from shaky.comm.sim import SimComm
from shaky.config import RunConfig, to_dict
from shaky.data import shard_summary
from shaky.geometry import LinkSample
from shaky.inject import FaultInjector, InterruptedRun
from shaky.interrupt import SignalWatch, Stopped
from shaky.membership import Members, Scheduled
from shaky.network.clock import Clock, ClockState
from shaky.network.faults import FailureSchedule, Membership, Round
from shaky.network.model import MaskLog, NetworkModel, TraceNetwork
from shaky.progress import Progress, say
from shaky.resumable import check_params, config_digest
from shaky.rundir import (CHECKPOINT_FILE, METRICS_FILE, SHARDS_FILE, Counters, Summary, append_metrics,
                          claim_dir, create, load_checkpoint, load_run_config, load_trace, new_run_dir, read_metrics,
                          record_start, save_checkpoint, save_trace, truncate_metrics)
from shaky.sampler import BatchSampler
from shaky.setup import Setup, evaluate, inputs_digest, prepare, start_gradient_diversity
from shaky.strategies import AverageModels, Strategy, sample_weights
from shaky.strategies.exchange import StepStats, observed
from shaky.strategies.state import map_rejoined, map_rows, map_synced, zip_rows
from shaky.vectorized import FusedGradFn

__all__ = ["CHECKPOINT_FILE", "SHARDS_FILE", "BatchSampler", "InterruptedRun", "can_fuse", "load_run_config",
           "new_run_dir", "prepare", "read_metrics", "schedule_of", "train", "train_step"]


def schedule_of(cfg: RunConfig) -> FailureSchedule:
    """The run's failure schedule, which every :class:`~shaky.membership.Members` keeps (and with live membership
    adds what the survivors agreed on to)."""
    return FailureSchedule(cfg.failures, cfg.num_workers, cfg.steps, sample_weights(cfg))


def can_fuse(grad_fn: Callable[..., Any], strategy: Strategy[Any]) -> bool:
    """Whether a step can run the local optimizer inside the backward pass: the gradient function can hand
    over each parameter's gradient as it is computed, and the strategy's local step runs column by column."""
    return isinstance(grad_fn, FusedGradFn) and isinstance(strategy, AverageModels) and strategy.columnwise


def _rows_where(rows: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``fn(a, b)``: a's rows where ``rows`` is True, b's elsewhere, for tensors of any rank with a worker axis."""
    return lambda a, b: torch.where(on_device(rows, a.device).reshape(-1, *([1] * (a.dim() - 1))), a, b)


def train_step(grad_fn: Callable[..., Any], strategy: Strategy[Any], params: torch.Tensor, state: Any,
               x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, comm: Comm, rnd: Round, *,
               need_grads: bool = False, marks: list[float] | None = None,
               on_losses: Callable[[torch.Tensor], None] | None = None
               ) -> tuple[torch.Tensor, Any, StepStats, torch.Tensor, torch.Tensor | None]:
    """One step of every worker: gradients on the batch ``x, y, mask``, then ``strategy``'s update.

    Where the two can fuse (:func:`can_fuse`), the local update is applied to
    ``params`` in place, parameter by parameter, as the backward pass produces
    the gradients, and the average follows in place: no ``[W, D]`` gradient is
    assembled (at W = 64 that saved a sixth of the MLP's round, see
    docs/performance.md); the numbers are identical either way. Not when the
    caller needs the gradients (``need_grads``: the gradient-diversity metric) or
    a worker is down (its row must not change, which the functional path keeps).

    ``params`` is consumed: use the returned tensor. ``marks``, if given, gets the
    time after the gradients and after the rest of the step (the benchmark's split).
    ``on_losses(losses)``, if given, is called as soon as the losses are known,
    before the strategy's exchange (the loop starts the loss mean there).
    Returns ``(params, state, stats, losses, grads)``; ``grads`` is None on the fused path.
    """
    if not need_grads and rnd.members.all_live and can_fuse(grad_fn, strategy):
        apply, state = strategy.columns(params, state)  # type: ignore[attr-defined]
        losses = grad_fn.update_in_place(params, x, y, mask, apply)
        _mark(marks)
        if on_losses is not None:
            on_losses(losses)
        params, state, stats = strategy.after_local(params, state, comm, rnd)  # type: ignore[attr-defined]
        _mark(marks)
        return params, state, stats, losses, None
    grads, losses = grad_fn(params, x, y, mask)
    _mark(marks)
    if on_losses is not None:
        on_losses(losses)
    kept = grads.clone() if need_grads else None  # read before the step, which may reuse the buffer
    new_params, new_state, stats = strategy.step(params, grads, state, comm, rnd)
    if not rnd.members.all_live:  # a failed worker neither computes nor changes
        keep = _rows_where(rnd.members.live[comm.rows])
        new_params, new_state = keep(new_params, params), zip_rows(new_state, state, keep)
    _mark(marks)
    return new_params, new_state, stats, losses, kept


def _mark(marks: list[float] | None) -> None:
    if marks is not None:
        marks.append(time.perf_counter())


def train(setup: Setup, run_dir: Path, *, comm: Comm | None = None, resume: bool = False, writer: bool = True,
          label: str = "train", progress: bool = True, faults: FaultInjector | None = None,
          welcome: dict[str, Any] | None = None, members: Members | None = None,
          signals: SignalWatch | None = None, writers: Writers | None = None) -> dict[str, Any]:
    """Runs (or resumes) training into ``run_dir`` and returns the summary.

    ``welcome``: this process was started again for a dead rank and taken back by the survivors
    (``QuorumControl.await_welcome``): it goes on from their state at the step they took it back.

    SIGINT and SIGTERM (in the main thread) stop the run after the step in progress, with a checkpoint:
    :class:`shaky.interrupt.Stopped` is raised, and ``--resume`` continues as if nothing had happened.
    ``faults`` injects deterministic faults (``shaky.inject``): e.g. a ``stop`` at
    step s ends the run there without a final checkpoint, as a killed process would.
    ``members``: who is in each step (``shaky.membership``; its schedule from :func:`schedule_of`); None: the
    config's failure schedule. ``signals``: a watch the caller entered before it made the run directory (a signal
    while it was made stops the run after its first step); None: the loop watches for its own. ``writer``: this
    process writes the run directory from the start; ``writers``: with live membership, which rank writes it
    later (the first live one of its order: the run directory outlives the death of rank 0).
    """
    cfg = setup.cfg
    comm = comm or SimComm(cfg.num_workers)
    sampler = BatchSampler(setup.shards, comm.rows.tolist(), cfg.worker_batch_sizes(), cfg.seed)
    batch_mask = sampler.mask.to(setup.device, setup.dtype)
    members = members or Scheduled(schedule_of(cfg))
    seen = observer(comm)
    clock = Clock(setup.network, setup.compute_ms, cfg.network.retransmit_timeout_ms,
                  exchange_compute_ms=cfg.network.exchange_compute_ms,
                  control_round_s=seen.control_round_seconds(setup.network.latency_ms))
    masks = _Masks(MaskLog(cfg.num_workers, cfg.steps), seen, observing=_observes_losses(cfg))
    last: dict[str, Any] | None = None     # a resumed run's last evaluation
    if welcome is not None:
        params, state, counters = _rejoin(setup, welcome, clock, masks, members.schedule)
        if writers is not None and "writers" in welcome:
            writers.order, writers.now = welcome["writers"]
    else:
        params, state, counters, last = _start(setup, run_dir, comm, clock, masks, resume=resume, writer=writer)
    t_start = time.perf_counter()
    bar = Progress(cfg.steps, counters.step, label, progress and writer)
    metrics = _Metrics(setup, members.schedule, comm, run_dir, bar, writer, counters, t_start, last, writers)
    if counters.step == 0:
        metrics.log(params, None, None)
    with contextlib.nullcontext(signals) if signals else SignalWatch(announce=writer and progress) as signals:
        params, state = _loop(setup, comm, sampler, batch_mask, members, clock, masks, params, state, counters,
                              metrics, bar, faults, signals)
    bar.close()
    _checkpoint(setup, run_dir, comm, params, state, counters, clock, masks, metrics.writes(), t_start, trace=True,
                transport_before=metrics.transport_before)
    # transport_stats is a collective on the dist backend: every rank calls it.
    udp = seen.transport_stats(metrics.transport_before)
    if udp.get("membership_changes"):   # the run's membership as failures, which the simulator replays
        udp["failures"] = members.schedule.failures
    summary = metrics.summary(udp=udp)
    if metrics.writes():
        summary.write(run_dir)
    return summary.to_dict()


def _loop(setup: Setup, comm: Comm, sampler: BatchSampler, batch_mask: torch.Tensor, members: Members,
          clock: Clock, masks: _Masks, params: torch.Tensor, state: Any, counters: Counters, metrics: _Metrics,
          bar: Progress, faults: FaultInjector | None, signals: SignalWatch) -> tuple[torch.Tensor, Any]:
    """The steps from ``counters.step`` to the end (or to a stop on a signal, which raises Stopped)."""
    cfg, strategy, rank = setup.cfg, setup.strategy, getattr(comm, "rank", 0)
    x_train, y_train = setup.data.x_train, setup.data.y_train
    losses = _LossMeans(comm, signals)
    while counters.step < cfg.steps:
        step = counters.step
        if faults is not None:  # before the step's start: a rank that fails at step s never reports reaching it
            faults.check(step, rank)
        masks.seen.on_step(step)

        def handover(joiners: tuple[int, ...]) -> dict[str, Any]:
            # The joiners take part in the next control round: nothing of the survivors' may ride in it.
            nonlocal state
            losses.take(counters, settle=True)
            state = map_rows(state, lambda t: t)     # every exchange in flight, completed
            handed = _handover(members.schedule, clock, masks, counters, state, setup)
            if metrics.writers is not None:     # who writes the run directory, and who may after it
                handed["writers"] = (metrics.writers.order, metrics.writers.now)
            return handed

        turn = members.step(step, handover)   # who is in this step (and who is taken back at its start)
        rnd = Round(step, _masks_of(setup.network, step, turn.members), turn.members)
        if rnd.members.any_rejoined:  # a returning worker takes the live workers' average model and state
            params, state = _take_back(rnd.members, members.schedule.live(step - 1), comm, params, state)
        evaluating = (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps
        idx = on_device(sampler.indices(step), x_train.device)
        live_weights = None if rnd.members.all_live else rnd.members.live.to(params.dtype)
        params, state, stats, _, grads = train_step(setup.grad_fn, strategy, params, state, _take(x_train, idx),
                                                    _take(y_train, idx), batch_mask, comm, rnd,
                                                    need_grads=evaluating,
                                                    on_losses=lambda step_losses: losses.start(step_losses,
                                                                                               live_weights))
        masks.record(step, rnd.links, stats, counters)
        masks.settle(counters)

        counters.step = step + 1
        counters.sim_time_s = clock.advance(stats.phases, stats.delay)
        counters.sim_wait_s += clock.last_wait_s
        counters.wait_s = metrics.wait_before + comm.wait_s
        counters.bytes_sent += stats.bytes_sent
        counters.messages_sent += stats.messages_sent
        counters.comm_rounds += 1 if stats.phases else 0
        checkpointing = bool(cfg.checkpoint_every) and counters.step % cfg.checkpoint_every == 0
        stop = losses.take(counters, settle=evaluating or checkpointing or counters.step == cfg.steps)
        bar.advance()

        if evaluating:
            row = metrics.log(params, grads, live_weights)
            if not math.isfinite(row["test_loss"]):
                bar.close()
                error = (f"training diverged at step {counters.step} (loss is not finite); "
                         f"lower optim.lr (now {cfg.optim.lr})")
                if metrics.writes():
                    metrics.summary(diverged=True, error=error).write(metrics.run_dir)
                raise FloatingPointError(error)
        stop = stop if counters.step < cfg.steps else None
        if stop is not None:    # every pending mean is taken in before the checkpoint (its counters)
            losses.take(counters, settle=True)
        if stop is not None or (checkpointing and counters.step < cfg.steps):
            _checkpoint(setup, metrics.run_dir, comm, params, state, counters, clock, masks, metrics.writes(),
                        metrics.t_start, trace=stop is not None, transport_before=metrics.transport_before)
        if stop is not None:
            bar.close()
            raise Stopped(stop, counters.step, cfg.steps)
    return params, state


def _take(data: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``data[idx]`` for an index tensor of any shape (index_select: a third of advanced indexing's time)."""
    return data.index_select(0, idx.reshape(-1)).view(*idx.shape, *data.shape[1:])


def _handover(schedule: FailureSchedule, clock: Clock, masks: _Masks, counters: Counters, state: Any,
              setup: Setup) -> dict[str, Any]:
    """What processes started again for dead ranks, which the survivors agreed to take back, are handed at this
    step's start (every exchange in flight has completed): what a checkpoint holds, less the model
    (:func:`_take_back` gives them the live workers' average of it and of their state), and the run's config and
    data digests (``run``), which a joiner checks its own against: the record it started from came from an
    unauthenticated store."""
    masks.settle(counters)
    return {"counters": dict(vars(counters)), "clock": clock.state, "masks": masks.log.packed(),
            "failures": schedule.failures, "state": map_rows(state, lambda t: t.cpu()),
            "run": {"config": to_dict(setup.cfg), "inputs": inputs_digest(setup)}}


def _take_back(joined: Membership, was_live: torch.Tensor, comm: Comm, params: torch.Tensor,
               state: Any) -> tuple[torch.Tensor, Any]:
    """The rows of the workers that rejoin take the average of the workers that were live (``was_live``): the
    model and the state declared SYNC_ON_REJOIN, and for a worker restarted as a new process (its memory lost)
    all its worker-axis state. Each average is a collective, so every rank walks the same fields."""
    weights, rows = was_live.to(params.dtype), comm.rows.tolist()

    def averaged(who: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        keep = _rows_where(who[rows])
        return lambda t: keep(comm.mean(t, weights), t)

    synced = averaged(joined.rejoined)
    if not joined.any_restarted:
        return synced(params), map_synced(state, synced)
    return synced(params), map_rejoined(state, synced, averaged(joined.restarted))


MAX_PENDING_LOSSES = 8
"""Steps a training-loss mean (and the stop signal with it) may wait to be taken in before a round is made for it."""


class _LossMeans:
    """The live workers' mean training loss of each step, and the signal that asks the run to stop, agreed by
    every rank: taken in by every rank at the same step.

    A step's mean starts as soon as its losses are known (``start``, train_step's ``on_losses``), before the
    exchange, with the step's weights and this rank's signal flag, and is taken in (:meth:`take`) once it has
    arrived alike on every rank, without waiting for it: on the simulator at once; with live membership once a
    control round carried it, in the records that round exchanges anyway (rps makes one every step, local SGD
    at each average), so steps that exchange nothing make no round. It is waited for at the latest
    :data:`MAX_PENDING_LOSSES` steps after it started (unless a round on its way carries it: a delayed
    exchange's, which brings it in when the exchange is applied, t - 1 steps on), and at an evaluation, a
    checkpoint, the end, and before ranks are taken back (``settle``): on gloo, where an all-reduce's
    completion is not alike on every rank, only then. Any rank's signal in a mean taken in stops every rank
    after the same step; a rank that received none reports SIGTERM. On the simulator the signal is this
    process's own, at every step.
    """

    def __init__(self, comm: Comm, signals: SignalWatch) -> None:
        self.comm, self.signals = comm, signals
        self._pending: collections.deque[MeanHandle] = collections.deque()

    def start(self, losses: torch.Tensor, weights: torch.Tensor | None) -> None:
        losses = losses.detach()[:, None]
        if isinstance(self.comm, SimComm):
            self._pending.append(Done(self.comm.mean(losses, weights)))
            return
        flags = torch.full_like(losses, float(bool(self.signals.received)))
        self._pending.append(self.comm.start_mean(torch.cat([losses, flags], dim=1), weights, deferred=True))

    def take(self, counters: Counters, *, settle: bool) -> int | None:
        """Adds the means that are in (all of them with ``settle``, or where the oldest is
        :data:`MAX_PENDING_LOSSES` steps old) to ``counters``; returns the agreed stop signal, or None."""
        # A mean that a round on its way carries (a delayed exchange's) is taken in when its exchange is.
        settle = settle or (len(self._pending) >= MAX_PENDING_LOSSES and not self._pending[0].carried)
        stop = None
        while self._pending and (settle or self._pending[0].settled):
            both = self._pending.popleft().wait()
            counters.train_loss_sum += float(both[0, 0])
            counters.train_loss_count += 1
            if both.shape[1] > 1 and float(both[0, 1]) > 0:
                stop = self.signals.received or int(signal.SIGTERM)
        if isinstance(self.comm, SimComm) and self.signals.received:
            stop = self.signals.received
        return stop


def _start(setup: Setup, run_dir: Path, comm: Comm, clock: Clock, masks: _Masks, *, resume: bool,
           writer: bool) -> tuple[torch.Tensor, Any, Counters, dict[str, Any] | None]:
    """The parameters, strategy state and counters to start from, and the last evaluation row before them:
    fresh, or from the checkpoint.

    A resumed run's checkpoint is read by the writer (rank 0) alone and handed to every other rank
    (``comm.broadcast``): the run directory need not be on their machines, and a stale copy of it there is
    never read."""
    cfg, rows = setup.cfg, comm.rows.tolist()
    found = comm.broadcast(_resume_point(setup, run_dir) if writer else None) if resume else None
    if found is not None:
        counters = Counters(**found["counters"])
        setup.compute_ms = found["compute_ms"]  # the run's own compute time, not a new measurement: its clock goes on alike
        clock.compute_s = setup.compute_ms / 1e3
        # Exchanges still in flight at the checkpoint arrive after the resume as they would have without it.
        clock.state = found["clock"]
        masks.log.restore(found["masks"])
        if writer:
            truncate_metrics(run_dir, counters.step)
            record_start(run_dir, cfg, setup.machines)
        device = setup.device
        return (found["params"][rows].to(device), map_rows(found["state"], lambda t: t[rows].to(device)), counters,
                found["last"])
    params = setup.flat.flatten(setup.model)[None].repeat(len(rows), 1)
    if writer:
        shards = shard_summary(setup.shards, setup.data.y_train.cpu().numpy(), setup.data.num_classes)
        for entry, shard in zip(shards, setup.shards):
            entry["indices"] = [int(i) for i in shard]
        create(run_dir, cfg, shards, again=resume, machines=setup.machines)  # resume without a checkpoint: anew
    return params, setup.strategy.init(params), Counters(), None


def _resume_point(setup: Setup, run_dir: Path) -> dict[str, Any] | None:
    """What a resumed run goes on from, read from ``run_dir`` (None: no checkpoint, the run starts again): the
    checkpoint's parameters, state, counters, clock and compute time, and the delivery masks of the rounds
    before it (a udp run's as recorded in its trace, others' drawn again from the seed), and the last row of
    metrics.jsonl (the summary of a run resumed when it had finished reads it)."""
    if not (run_dir / CHECKPOINT_FILE).is_file():
        return None
    ckpt = load_checkpoint(run_dir)
    counters = Counters(**ckpt["counters"])
    check_params(run_dir, ckpt.get("params"), setup)
    log = MaskLog(setup.cfg.num_workers, counters.step)
    recorded = _recorded_masks(setup, run_dir, counters.step) if _observes_losses(setup.cfg) else setup.network
    schedule = schedule_of(setup.cfg)
    for r in range(counters.step):
        log.append(_masks_of(recorded, r, schedule.membership(r)))
    return {"params": ckpt["params"], "state": ckpt["state"], "counters": ckpt["counters"],
            "clock": ckpt.get("clock") or ClockState(counters.step, counters.sim_time_s, counters.sim_time_s),
            "compute_ms": float(ckpt["compute_ms"]) if "compute_ms" in ckpt else setup.compute_ms,
            "masks": log.packed(), "last": _last_row(run_dir, counters.step)}


def _last_row(run_dir: Path, step: int) -> dict[str, Any] | None:
    """The last evaluation row of metrics.jsonl at or before ``step``."""
    rows = [r for r in read_metrics(run_dir, trim_torn=True) if r["step"] <= step]
    return rows[-1] if rows else None


def _rejoin(setup: Setup, welcome: dict[str, Any], clock: Clock, masks: _Masks,
            members: FailureSchedule) -> tuple[torch.Tensor, Any, Counters]:
    """A rank taken back: the survivors' counters, clock, masks, membership and state (a peer's rows, which the
    first step replaces with the live workers' average, as it does the model)."""
    counters = Counters(**welcome["counters"])
    clock.state = welcome["clock"]
    masks.log.restore(welcome["masks"])
    members.adopt(welcome["failures"])
    params = setup.flat.flatten(setup.model)[None]
    return params, map_rows(welcome["state"], lambda t: t.to(setup.device)), counters


def _checkpoint(setup: Setup, run_dir: Path, comm: Comm, params: torch.Tensor, state: Any, counters: Counters,
                clock: Clock, masks: _Masks, writer: bool, t_start: float, *, trace: bool,
                transport_before: dict[str, Any]) -> None:
    """Gathers every worker's rows (a collective on the dist backend) and writes the checkpoint, and with
    ``trace`` the delivery trace (a resume draws the masks again from the seed, so the periodic checkpoints
    skip it: it grows with the run, and writing it every time would make checkpoints quadratic)."""
    # Gathering the state waits for the exchanges still in flight: their masks and losses are then known.
    full_params, full_state = comm.gather(params), map_rows(state, comm.gather)
    masks.settle(counters)
    observed = _observes_losses(setup.cfg)
    if observed:
        counters.transport = masks.seen.transport_stats(transport_before)
    if writer and observed:   # first: a checkpoint always has the masks of the rounds before it
        save_trace(run_dir, masks.log.packed(), setup.cfg.num_workers)
    if writer:
        save_checkpoint(run_dir, {   # on the host: a checkpoint resumes on any device
            "params": full_params.cpu(), "state": map_rows(full_state, lambda t: t.cpu()),
            "config": to_dict(setup.cfg), "clock": clock.state,
            "compute_ms": setup.compute_ms,
            "counters": {**vars(counters), "wall_time_s": counters.wall_time_s + time.perf_counter() - t_start}})
        if trace and not observed:
            save_trace(run_dir, masks.log.packed(), setup.cfg.num_workers)


class _Masks:
    """The delivery masks of every step, for the run's trace, and the losses they count.

    A step records the masks drawn for it; on a transport that observes its losses (udp) they are replaced by
    what arrived once the step's exchange completes, which for an exchange running in the background is steps
    later (``Observed.take_observed``), and only then are its lost messages counted.
    """

    def __init__(self, log: MaskLog, seen: Observed, *, observing: bool) -> None:
        self.log, self.seen, self.observing = log, seen, observing
        self._launched: dict[int, tuple[StepStats, LinkSample]] = {}

    def record(self, step: int, drawn: LinkSample, stats: StepStats, counters: Counters) -> None:
        self.log.append(drawn)
        if not self.observing:
            counters.messages_dropped += stats.messages_dropped
        elif any(not p.reliable for p in stats.phases):     # a lossy exchange: counted when it completes
            self._launched[step] = (stats, drawn)
        else:                                                 # a reliable one (gloo) loses nothing
            counters.messages_dropped += stats.messages_dropped

    def settle(self, counters: Counters) -> None:
        """Takes in the observed masks of the exchanges that completed since the last call."""
        for step, seen in self.seen.take_observed():
            self.log.put(step, seen)
            launched = self._launched.pop(step, None)
            if launched is not None:
                counters.messages_dropped += observed(launched[0], launched[1], seen).messages_dropped


def _masks_of(network: NetworkModel, step: int, members: Membership) -> LinkSample:
    """The delivery masks of ``step`` under ``members``: per block, each block on its server's links."""
    return network.sample(step, None if members.all_live else members.servers)


def _observes_losses(cfg: RunConfig) -> bool:
    """Whether the run's delivery masks are what a real lossy transport observed (udp), not drawn from the seed:
    then every checkpoint writes them, and a resume reads them back instead of drawing them."""
    return cfg.backend == "dist" and cfg.dist.transport == "udp"


def _recorded_masks(setup: Setup, run_dir: Path, rounds: int) -> TraceNetwork:
    """The masks a udp run recorded up to its checkpoint, from its own trace.npz."""
    cfg = setup.cfg
    return TraceNetwork(cfg.network, cfg.num_workers, cfg.seed,
                        *load_trace(str(run_dir), cfg.num_workers, rounds, segment_bytes=cfg.network.segment_bytes))


class Writers:
    """Which rank writes the run directory with live membership, the same on every rank: rank 0 at the start,
    and while the writer is live it stays the writer; once it is left out, the first live rank of ``order``
    (rank 0, then the other ranks that see the run directory, by rank). Every rank computes every row, gathers
    every checkpoint and keeps the whole trace, so the rank that takes over writes what rank 0 would have: a
    dead rank 0 costs the run directory nothing but a checkpoint it was writing (the last one stands) or, dead
    between an evaluation and its row, that row, which the new writer appends first."""

    def __init__(self, rank: int, order: list[int]) -> None:
        self.rank, self.order = rank, order
        self.now: int | None = order[0] if order else None
        """The rank that writes as of the last look."""

    @property
    def mine(self) -> bool:
        """Whether this rank writes as of the last look."""
        return self.now == self.rank

    def pick(self, live: torch.Tensor) -> int | None:
        """The rank that writes where ``live`` (bool [W]) are live; None: no live rank can."""
        if self.now is not None and bool(live[self.now]):
            return self.now
        return next((r for r in self.order if bool(live[r])), None)


class _Metrics:
    """The evaluation rows of metrics.jsonl and the summary built from the last one."""

    def __init__(self, setup: Setup, members: FailureSchedule, comm: Comm, run_dir: Path, bar: Progress,
                 writer: bool, counters: Counters, t_start: float, last: dict[str, Any] | None = None,
                 writers: Writers | None = None) -> None:
        self.setup, self.members, self.comm, self.run_dir = setup, members, comm, run_dir
        self.bar, self.writer, self.counters, self.t_start = bar, writer, counters, t_start
        self.writers = writers
        self._unwritten = False
        """No live rank can write the run directory (said once)."""
        self.transport_before = dict(counters.transport)
        self.wait_before = counters.wait_s
        """Seconds waited for exchanges up to the checkpoint this run resumed from."""
        """The real transport's counts up to the checkpoint this run resumed from (empty: a fresh run)."""
        self.held = [set(s.tolist()) for s in setup.shards] if setup.cfg.failures else None
        self.last = last

    def writes(self) -> bool:
        """Whether this rank writes the run directory now (the step just done's membership): with
        :class:`Writers`, the first live rank of its order, which takes over where the one before it was left
        out."""
        if self.writers is None:
            return self.writer
        live = self.members.live(max(self.counters.step - 1, 0))
        first = self.writers.pick(live)
        if first == self.writers.rank and not self.writer:
            self._take_over()
        if first is None and not self._unwritten and self.writers.rank == next(
                r for r in range(len(live)) if live[r]):
            say(f"shaky: warning: after step {self.counters.step} no live rank is on the run directory's machine: "
                "the survivors train on, and nothing more is written to it")
            self._unwritten = True
        self.writer, self.writers.now = first == self.writers.rank, first
        return self.writer

    def _take_over(self) -> None:
        """This rank writes the run directory from now on: the ranks before it in :class:`Writers`' order were
        left out. metrics.jsonl is made to end with the last row every rank computed (a torn line dropped, a row
        its writer died before writing appended)."""
        step = self.counters.step
        back = bool(self.writers.order) and self.writers.rank == self.writers.order[0]   # rank 0, started again
        say(f"shaky: rank {self.writers.rank} writes the run directory from step {step} on "
            f"({'taken back' if back else 'the ranks before it were left out'})")
        with contextlib.suppress(ValueError):     # a writer that stands still (SIGSTOP) still holds the claim
            claim_dir(self.run_dir)
        last = self.last
        if last is not None:
            rows = read_metrics(self.run_dir, trim_torn=True) if (self.run_dir / METRICS_FILE).exists() else []
            truncate_metrics(self.run_dir, last["step"])
            if not rows or rows[-1]["step"] < last["step"]:
                append_metrics(self.run_dir, last)

    def log(self, params: torch.Tensor, grads: torch.Tensor | None,
            live_weights: torch.Tensor | None) -> dict[str, Any]:
        c, cfg, setup = self.counters, self.setup.cfg, self.setup
        writes = self.writes()
        t0 = time.perf_counter()
        live = self.members.live(max(c.step - 1, 0))
        covered = None if self.held is None else set().union(*(h for h, a in zip(self.held, live.tolist()) if a))
        # The diversity's means ride in the evaluation's first round (two rounds in all, with live membership).
        diversity = None if grads is None else start_gradient_diversity(grads, self.comm, live_weights)
        evaluated = evaluate(setup, params, self.comm, live_weights)
        row = {"step": c.step, "sim_time_s": c.sim_time_s, "bytes_sent": c.bytes_sent,
               "messages_sent": c.messages_sent, "messages_dropped": c.messages_dropped,
               "comm_rounds": c.comm_rounds, "live_workers": int(live.sum()),
               "coverage": 1.0 if covered is None else len(covered) / len(setup.data.y_train),
               "gradient_diversity": None if diversity is None else diversity(),
               "train_loss": c.train_loss_sum / c.train_loss_count if c.train_loss_count else None,
               **evaluated,
               "lr": setup.strategy.opt.lr(max(c.step - 1, 0))}
        now = time.perf_counter()
        c.eval_s += now - t0
        row["wall_time_s"] = c.wall_time_s + now - self.t_start
        if writes:
            append_metrics(self.run_dir, row)
        self.bar.report(row)
        c.train_loss_sum, c.train_loss_count = 0.0, 0
        if cfg.target_accuracy and c.rounds_to_target < 0 and c.step and row["test_accuracy"] >= cfg.target_accuracy:
            c.rounds_to_target = c.comm_rounds
        self.last = row
        return row

    def summary(self, *, diverged: bool = False, error: str = "", udp: dict[str, Any] | None = None) -> Summary:
        if self.last is None:
            raise ValueError(f"{self.run_dir}: no evaluation row to summarise (metrics.jsonl is empty)")
        return Summary.from_run(self.setup.cfg, self.last, self.counters, compute_ms=self.setup.compute_ms,
                                num_parameters=self.setup.flat.dim, diverged=diverged, error=error, udp=udp,
                                config_sha256=config_digest(self.setup.cfg))
