"""A drop-in model averager for your own torch.distributed training loop.

In the style of torch's ``PeriodicModelAverager``: keep your model, data
loader, loss and optimizer, and add two lines::

    averager = shaky.RPSAverager(model, network={"drop_rate": 0.1})
    ...
    optimizer.step()
    averager.step()

Every ``period`` steps the model goes through RPS's two-phase block exchange
(Yu et al., ICML 2019) among all ranks, with the delivery masks drawn from the
seed exactly as the simulator draws them, so a dropped message is a block that
is left out of the average, identically on every rank. ``period`` > 1 is local
SGD; steps before ``warmup_steps`` average exactly every step (unlike
PeriodicModelAverager, whose warm-up leaves the averaging to DDP). With
``outer_optimizer`` (for example ``shaky.OuterSGD(lr=0.7, momentum=0.9)``) the
averaged model goes through DiLoCo's outer step:
``ModelAverager(model, period=H, outer_optimizer=...)`` is DiLoCo around your
own inner optimizer.

Parameters keep their dtypes, devices and storage: the tensors of one dtype
and device form one flat vector, and on gloo every such group is exchanged in
the same round with the same delivery masks (see :class:`ModelAverager`; on
udp each group is an exchange of its own datagrams). Floating
buffers (BatchNorm's running statistics) are averaged with them unless
``average_buffers=False``. ``state_dict()`` / ``load_state_dict()`` let a
restarted job go on with the same drop pattern; ``average_parameters(params)``
and ``torch_averager()`` fit torch's ``PostLocalSGDOptimizer``.

Nothing here changes process-wide settings (threads, OpenMP, malloc): those are
the command line's; ``docs/performance.md`` says which ones pay off and how to
set them in your own process.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers

from shaky.comm.base import DRAWN, observer
from shaky.comm.gloo import DistComm, rendezvous_store
from shaky.comm.udp.comm import udp_comm
from shaky.config import DIST_TIMEOUT_S, HEARTBEAT_TIMEOUT_S, UDP_PORTS, DistConfig, NetworkConfig, _build
from shaky.job.env import JobEnv
from shaky.network.clock import PhaseTraffic
from shaky.membership import Agreed
from shaky.membership.heartbeat import Heartbeat
from shaky.network.faults import FailureSchedule, Membership, Round
from shaky.network.model import NetworkModel
from shaky.schedule import Schedule
from shaky.geometry import LinkSample, segment_counts, segment_length
from shaky.strategies.exchange import StepStats, lossy_block_average, observed
from shaky.strategies.optim import OuterSGD, OuterState

_STATE_VERSION = 1
_MATRIX_SETTINGS = ("drop_rate", "latency_ms", "bandwidth_mbps")


def init_process_group(*, timeout_s: float = DIST_TIMEOUT_S, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
    """``torch.distributed.init_process_group("gloo")`` from the environment torchrun sets (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), where rank 0 puts the rendezvous store in a keeper process of its own
    (``shaky.job.keeper``) instead of hosting it itself: with ``RPSAverager(transport="udp")`` any rank, rank 0
    included, may then die and the others train on (with torch's own, rank 0's death takes the store with it).
    Under torchrun's agent, whose store is used as torch would, it is torch's. ``heartbeat_timeout_s``: the
    averager's (the keeper goes once no heartbeat has moved for four of them, at least 10 s)."""
    from shaky.job.rendezvous import init_group  # noqa: PLC0415 (the job layer, for a user's process)

    init_group(JobEnv.from_environ(os.environ), timeout_s, heartbeat_timeout_s)


def _network_config(network: NetworkConfig | dict[str, Any] | str | None, world_size: int) -> NetworkConfig:
    """The network settings, checked against the world size (a per-link matrix must be world_size x world_size)."""
    if isinstance(network, NetworkConfig):
        cfg = network
    elif network is None:
        cfg = NetworkConfig()
    elif isinstance(network, (str, dict)):
        values = {"preset": network} if isinstance(network, str) else dict(network)
        # The network section alone: a whole RunConfig would check the matrices against its default 8 workers.
        cfg = _build(NetworkConfig, values, prefix="network.")
    else:
        raise TypeError(f"network must be a NetworkConfig, a dict of its settings or a preset name, "
                        f"got {type(network).__name__}")
    for name in _MATRIX_SETTINGS:
        value = getattr(cfg, name)
        if isinstance(value, tuple) and len(value) != world_size:
            raise ValueError(f"network.{name} is a {len(value)}x{len(value)} matrix but the world size is "
                             f"{world_size}; give one number or a {world_size}x{world_size} matrix")
    if cfg.trace:
        raise ValueError(f"network.trace is not supported by the averager (it draws the delivery masks from the "
                         f"seed), got {cfg.trace!r}")
    if cfg.segment_bytes:
        raise ValueError(f"network.segment_bytes is not supported by the averager yet (it loses whole blocks), "
                         f"got {cfg.segment_bytes}")
    return cfg


@dataclass(frozen=True, slots=True)
class _Group:
    """The tensors of one dtype and device, averaged as one flat vector: the parameters, then the buffers."""

    params: tuple[torch.Tensor, ...]
    buffers: tuple[torch.Tensor, ...]

    @property
    def num_param_values(self) -> int:
        """Length of the parameters' part of the vector (its prefix; the outer step applies to it alone)."""
        return sum(p.numel() for p in self.params)

    def flatten(self) -> torch.Tensor:
        """[1, D]: a copy of the group's values (parameters_to_vector's order: tensor by tensor, each flattened)."""
        return torch.cat([t.detach().reshape(-1) for t in self.params + self.buffers])[None]

    def write(self, values: torch.Tensor) -> None:
        """Copies a [1, D] vector back into the tensors, in place: dtype, device, storage and layout stay."""
        offset = 0
        for t in self.params + self.buffers:
            t.copy_(values[0, offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _groups(params: list[torch.Tensor], buffers: list[torch.Tensor]) -> list[_Group]:
    """Tensors grouped by (dtype, device), in order of first appearance: the same order on every rank."""
    keyed: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for kind, tensors in enumerate((params, buffers)):
        for t in tensors:
            keyed.setdefault((t.dtype, t.device), ([], []))[kind].append(t)
    return [_Group(tuple(p), tuple(b)) for p, b in keyed.values()]


def _in_layout(links: LinkSample, v: torch.Tensor, segment_bytes: int) -> LinkSample:
    """``links`` as masks of ``v``'s segments of ``segment_bytes`` (every one delivered: a transport cut in
    segments observes its own losses, and the drawn masks are not used); ``links`` itself where the unit of loss
    is a block."""
    if not segment_bytes:
        return links
    w = links.up.shape[0]
    segments = max(1, *segment_counts(v.shape[1], w, segment_length(segment_bytes, v.element_size())))
    every = torch.ones(w, w, segments, dtype=torch.bool)
    return LinkSample(links.round, every, every.clone(), segment_bytes)


def _merge_stats(stats: list[StepStats]) -> StepStats:
    """The traffic of several groups exchanged in one round: one message per link and phase carries every
    group's block, so bytes add up and each link's message is counted (and lost) once."""
    if len(stats) == 1:
        return stats[0]
    phases = tuple(PhaseTraffic(np.sum([p.link_bytes for p in same], axis=0), same[0].delivered, same[0].reliable,
                                same[0].route) for same in zip(*(s.phases for s in stats)))
    return StepStats(phases)


def _param_list(params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]) -> list[torch.Tensor]:
    """The tensors of ``params`` (tensors, or optimizer param groups), once each, that require a gradient."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or of param-group dicts, got one tensor")
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for item in params:
        if isinstance(item, torch.Tensor):
            tensors: Iterable[Any] = (item,)
        elif isinstance(item, dict) and "params" in item:
            tensors = item["params"]
        else:
            raise TypeError(f"params must hold tensors or param-group dicts with a 'params' entry, "
                            f"got {type(item).__name__}")
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"a param group's 'params' must hold tensors, got {type(t).__name__}")
            if t.requires_grad and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


class ModelAverager:
    """Averages a module's parameters (and floating buffers) across torch.distributed ranks over a simulated
    lossy network.

    Every rank draws the same delivery masks from ``seed`` and the round index. The tensors of one dtype and
    device form one flat vector (a model of one dtype is one vector, as ``parameters_to_vector`` lays it out),
    and on gloo every group is block-averaged in the same round with the same masks: the message from rank i to
    server j carries block j of every group, so a lost message leaves block j of every group out, and the
    counters count it once. On udp a datagram carries values of one dtype (its header names it, and its server
    averages in it), so each group is an exchange of its own datagrams, with the masks of what arrived of them
    and its own count (README, "What is averaged"). Values are copied back in place, so every tensor keeps its
    dtype, device and storage.

    Buffers: floating ones (BatchNorm's running mean and variance) are averaged with the parameters, by the
    same exchange; the outer optimizer steps the parameters alone. Integer buffers (BatchNorm's
    ``num_batches_tracked``) are counters that every rank advances alike, so they are left alone.

    Attributes:
        steps: Calls of ``step()`` / ``average_parameters()`` so far; with the schedule it fixes the round
            whose masks the next exchange uses (``rounds``).
        bytes_sent, messages_sent, messages_dropped: The lossy exchanges' traffic so far, all ranks together.
    """

    def __init__(self, model: torch.nn.Module, *, network: NetworkConfig | dict[str, Any] | str | None = None,
                 period: int = 1, warmup_steps: int = 0, seed: int = 0,
                 outer_optimizer: OuterSGD | None = None, average_buffers: bool = True, transport: str = "gloo",
                 deadline_ms: float | None = None, key_file: str = "", ports: str = UDP_PORTS,
                 host: str = "", heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        """Args:
            model: The module whose parameters every rank averages (same architecture on every rank).
            network: A NetworkConfig, a dict of its settings (``{"drop_rate": 0.1}``), or a preset name. A
                per-link matrix must be world_size x world_size.
            period: Average every this many calls of ``step()`` (1 = RPS, more = local SGD).
            warmup_steps: Calls of ``step()`` that average exactly (no drops) every time.
            seed: Seeds the delivery masks; use the same on every rank.
            outer_optimizer: DiLoCo's outer step on the averaged model (``shaky.OuterSGD``); None: the average
                itself.
            average_buffers: Average the model's floating buffers (BatchNorm's running statistics) with its
                parameters; False leaves every buffer alone.
            transport: "gloo": every block over gloo, the losses drawn from ``network`` and ``seed``; "udp":
                the lossy exchanges travel as UDP datagrams that are never resent, and the losses are the
                network's (``network`` then sets no drop rate). Warm-up averages stay exact, on gloo.
            deadline_ms: udp: a phase's deadline in milliseconds; None adapts it from recent rounds.
            key_file: udp: a file of at least 16 bytes that every rank holds, keying the datagrams' tags;
                empty: ``$SHAKY_KEY``, else rank 0 makes a key and hands it out through the (unencrypted)
                rendezvous store, and every rank says so on stderr.
            ports: udp: the UDP ports a rank may bind ("FIRST-LAST" or one port); it binds the first free one.
            host: udp: this rank's IPv4 address as the others reach it (empty: the route to MASTER_ADDR).
            heartbeat_timeout_s: udp: a rank whose heartbeat has been silent this long (SIGKILLed, crashed,
                frozen) is left out, and the others train on without it: its blocks move to live ranks and its
                values leave the averages (README, "Survivors train on"). Start the ranks with ``shaky launch``
                or by hand, not under torchrun's agent, which stops every worker when one fails. A rank left out
                stays out: a user's loop has no state to hand a process started again.
            The udp settings are ``shaky train``'s ``[dist]`` settings, checked alike (a ValueError names the
            setting); setting one with transport "gloo" is an error.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.schedule = Schedule(period=period, warmup_steps=warmup_steps)
        if outer_optimizer is not None and not isinstance(outer_optimizer, OuterSGD):
            raise TypeError(f"outer_optimizer must be a shaky.OuterSGD, got {type(outer_optimizer).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        if not isinstance(average_buffers, bool):
            raise TypeError(f"average_buffers must be True or False, got {average_buffers!r}")
        settings = DistConfig(transport=transport, deadline_ms="adaptive" if deadline_ms is None else deadline_ms,
                              key_file=key_file, ports=ports, host=host, heartbeat_timeout_s=heartbeat_timeout_s)
        if not dist.is_initialized():
            raise RuntimeError("the averager needs torch.distributed to be initialised (start with torchrun)")
        cfg = _network_config(network, dist.get_world_size())
        if transport == "udp":
            if cfg.drop_rate or cfg.burst_enter:
                raise ValueError(f"network drop_rate/burst_enter ({cfg.drop_rate!r}/{cfg.burst_enter!r}) are drawn "
                                 "losses; with transport=\"udp\" the losses are the network's (leave them unset)")
            # A user's torchrun process: the averager is its entry point, and reads $SHAKY_KEY and MASTER_ADDR
            # as the command line does (JobEnv), for the comm below it.
            env = JobEnv.from_environ(os.environ)
            # Live membership, as ``shaky train --transport udp``: the heartbeat tells a dead rank from a slow one,
            # and the survivors agree in the control rounds on who is in (shaky.membership.Agreed).
            self._heartbeat: Heartbeat | None = Heartbeat(dist.get_rank(), dist.get_world_size(), rendezvous_store())
            self.comm: DistComm = udp_comm(settings, heartbeat=self._heartbeat, key_text=env.key,
                                           master_addr=env.route_to)
            self._agreed: Agreed | None = Agreed(self.comm.agreement, FailureSchedule((), self.comm.num_workers, 0))
        else:
            self._heartbeat, self._agreed = None, None
            self.comm = DistComm()
        self._closed = False
        self.transport = transport
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.average_buffers = average_buffers
        self.seed = int(seed)
        self.network = NetworkModel(cfg, self.comm.num_workers, self.seed)
        self.exchange = lossy_block_average()
        self.members = Membership.everyone(self.comm.num_workers)
        self.outer = outer_optimizer
        # The anchor of the first outer step, one per group: the model as it is now, before any local step
        # (construct the averager before training, as torch's averagers are).
        groups = _groups(self.params, [])
        self.outer_state: list[OuterState] | None = None if outer_optimizer is None else \
            _outer_init(outer_optimizer, groups, [g.flatten() for g in groups])
        self.steps = 0
        self.bytes_sent = 0
        self.messages_sent = 0
        self.messages_dropped = 0

    @property
    def rounds(self) -> int:
        """Lossy exchanges so far: the round index (of the delivery masks) of the next one."""
        return self._rounds_before(self.steps)

    def _rounds_before(self, step: int) -> int:
        # The exchanges after the warm-up at steps s < step: s + 1 a multiple of the period, s >= warmup_steps.
        p, w = self.schedule.period, self.schedule.warmup_steps
        return max(0, step // p - w // p)

    def _buffers(self) -> list[torch.Tensor]:
        # Read from the module at each exchange: ``model.to(...)`` replaces buffer tensors.
        if not self.average_buffers:
            return []
        return [b for b in self.model.buffers() if b is not None and b.is_floating_point()]

    @torch.no_grad()
    def step(self) -> None:
        """Call after ``optimizer.step()``; averages when this step's turn comes."""
        self._step(self.params)

    @torch.no_grad()
    def average_parameters(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]) -> None:
        """``step()`` for the parameters given, in the form torch's model averagers take (once per optimizer step).

        Counts the step and averages when its turn comes, like ``step()``; the model's floating buffers are
        averaged with them (unless ``average_buffers=False``). ``params``: tensors (``model.parameters()``) or an
        optimizer's param groups; those that do not require a gradient are left out, and every rank must give
        the same ones. With an outer optimizer they must be the model's parameters (its anchor is theirs).
        For ``torch.distributed.optim.PostLocalSGDOptimizer`` pass ``torch_averager()``, which keeps the step
        counter where that optimizer's ``state_dict`` looks for it.
        """
        given = _param_list(params)
        if {id(p) for p in given} == {id(p) for p in self.params}:
            given = self.params  # the model's own: in the model's order, whatever order the groups list them in
        elif self.outer is not None:
            raise ValueError(f"average_parameters got {len(given)} parameters that are not the model's "
                             f"{len(self.params)}; with an outer optimizer they must be (its anchor is the model's)")
        self._step(given)

    def _step(self, params: list[torch.Tensor]) -> None:
        step = self.steps
        self.steps += 1
        if not self.schedule.launches(step):
            return
        groups = _groups(params, self._buffers())
        vecs = [g.flatten() for g in groups]
        if self.schedule.in_warmup(step):
            averaged = [self.comm.mean(v) for v in vecs]
            if self.outer is not None:  # warm-up averages exactly; the outer step starts after it
                self.outer_state = _outer_init(self.outer, groups, averaged)
        else:
            index = self._rounds_before(step)
            if self._agreed is not None:    # who is in (udp): the changes the survivors agreed on so far
                self.members = self._agreed.step(index, None).members
            servers = None if self.members.all_live else self.members.servers
            rnd = Round(index, self.network.sample(index, servers), self.members)
            seen_by = observer(self.comm)
            averaged, stats = [], []
            for v in vecs:  # every group in the same round, with the same masks (udp: what each one's got)
                # ``shaky train``'s exchange stage; on a transport that observes its losses (udp) the masks are in
                # its segments' layout and the traffic is counted again with what arrived, as the training loop does
                links = _in_layout(rnd.links, v, getattr(self.comm, "segment_bytes", 0))
                avg, _, st = self.exchange(v, self.comm, Round(rnd.step, links, rnd.members), ())
                for _, seen in seen_by.take_observed():
                    st = observed(st, links, seen)
                averaged.append(avg)
                stats.append(st)
            if seen_by is not DRAWN:   # udp: each group was an exchange of its own datagrams
                for st in stats:
                    self._count(st)
            elif stats:
                self._count(_merge_stats(stats))
            if self.outer is not None and self.outer_state is not None:
                averaged, self.outer_state = _outer_step(self.outer, self.outer_state, groups, averaged)
        for g, a in zip(groups, averaged):
            g.write(a)

    @property
    def live_workers(self) -> int:
        """The ranks in the last exchange: every rank, but on udp after ranks were left out."""
        return int(self.members.live.sum())

    def close(self) -> None:
        """Closes the transport: on udp its sockets, control plane and heartbeat. Call it on every rank when
        training is done, before ``dist.destroy_process_group()``: its threads end first (a thread still in a
        store call when the interpreter exits aborts the process), and where rank 0's process holds the control
        rounds' store (torch's own ``init_process_group``, not :func:`init_process_group`'s keeper) rank 0
        waits there (at most ``heartbeat_timeout_s``) for the other live ranks to be done with it. Calling it
        again does nothing; ``with averager:`` calls it at the block's end."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._agreed is not None:     # udp: every live rank is done with the last round first
                self.comm.barrier()
            self.comm.close()
        finally:
            if self._heartbeat is not None:
                self._heartbeat.close()

    def __enter__(self) -> ModelAverager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count(self, stats: StepStats) -> None:
        self.bytes_sent += stats.bytes_sent
        self.messages_sent += stats.messages_sent
        self.messages_dropped += stats.messages_dropped

    # ----------------------------------------------------------------------------------------------------------
    # Checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's averager state: with it a restarted job's next step equals an uninterrupted run's.

        The step count (which fixes the round, so the delivery masks go on where they were), the outer
        optimizer's anchor and momentum (this rank's own), the traffic counters, and the settings that must
        match on load. Plain values and tensors only: ``torch.save`` it, and ``torch.load`` reads it with
        ``weights_only=True``. Each rank saves its own (as it does its optimizer's).
        """
        outer = None if self.outer_state is None else [
            {"anchor": s.anchor.clone(), "momentum": None if s.momentum is None else s.momentum.clone()}
            for s in self.outer_state]
        return {"version": _STATE_VERSION, "steps": self.steps, "seed": self.seed,
                "world_size": self.comm.num_workers, "period": self.schedule.period,
                "warmup_steps": self.schedule.warmup_steps, "bytes_sent": self.bytes_sent,
                "messages_sent": self.messages_sent, "messages_dropped": self.messages_dropped, "outer": outer}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores ``state_dict()``'s state (from an averager built with the same settings on the same world)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        missing = [k for k in ("version", "steps", "seed", "world_size", "period", "warmup_steps", "bytes_sent",
                               "messages_sent", "messages_dropped", "outer") if k not in state_dict]
        if missing:
            raise ValueError(f"state_dict lacks {', '.join(missing)}: not a shaky averager's state_dict")
        if state_dict["version"] != _STATE_VERSION:
            raise ValueError(f"state_dict version must be {_STATE_VERSION}, got {state_dict['version']!r}")
        here = {"seed": self.seed, "world_size": self.comm.num_workers, "period": self.schedule.period,
                "warmup_steps": self.schedule.warmup_steps}
        for key, value in here.items():
            if state_dict[key] != value:
                raise ValueError(f"state_dict was saved with {key} = {state_dict[key]!r}, but this averager has "
                                 f"{key} = {value!r}")
        steps = state_dict["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"state_dict steps must be an integer >= 0, got {steps!r}")
        outer = state_dict["outer"]
        if (outer is None) != (self.outer_state is None):
            raise ValueError(f"state_dict was saved {'without' if outer is None else 'with'} an outer optimizer, "
                             f"but this averager has {'one' if outer is None else 'none'}")
        if outer is not None and self.outer_state is not None:
            self.outer_state = self._load_outer(outer, self.outer_state)
        self.steps = steps
        self.bytes_sent = int(state_dict["bytes_sent"])
        self.messages_sent = int(state_dict["messages_sent"])
        self.messages_dropped = int(state_dict["messages_dropped"])

    @staticmethod
    def _load_outer(saved: Any, current: list[OuterState]) -> list[OuterState]:
        def layout(states: list[Any]) -> list[tuple[str, tuple[int, ...]]]:
            return [(str(s["anchor"].dtype), tuple(s["anchor"].shape)) for s in states]

        now = layout([{"anchor": s.anchor} for s in current])
        if not isinstance(saved, list) or not all(isinstance(s, dict) and isinstance(s.get("anchor"), torch.Tensor)
                                                  and "momentum" in s for s in saved):
            raise ValueError(f"state_dict outer must be a list of {{'anchor', 'momentum'}} dicts, got {saved!r}")
        if layout(saved) != now:
            raise ValueError(f"state_dict outer anchors {layout(saved)} do not fit this model's parameters {now}")
        return [OuterState(s["anchor"].to(c.anchor.device, copy=True),
                           None if s["momentum"] is None else s["momentum"].to(c.anchor.device, copy=True))
                for s, c in zip(saved, current)]

    def __getstate__(self) -> Any:
        raise TypeError("a shaky averager cannot be pickled (it holds the process group): save averager.state_dict(); "
                        "with PostLocalSGDOptimizer pass averager.torch_averager(), whose step counter it can save")

    # ----------------------------------------------------------------------------------------------------------
    # torch's model-averager interface

    def torch_averager(self) -> TorchAverager:
        """This averager in the shape of torch's model averagers, for ``PostLocalSGDOptimizer(optim, ...)``."""
        return TorchAverager(self)


class TorchAverager(torch_averagers.ModelAverager):
    """A shaky averager seen as a ``torch.distributed.algorithms.model_averaging.averagers.ModelAverager``.

    torch's averagers keep their step counter in the attribute ``step``: PostLocalSGDOptimizer's
    ``state_dict()`` saves it and its ``load_state_dict()`` sets it. On a shaky averager ``step`` is the method a
    plain loop calls, so this view carries the counter instead (it reads and sets the averager's ``steps``,
    which also fixes the round of the masks) and holds no state of its own. The outer optimizer's state is
    in the averager's own ``state_dict()``.
    """

    def __init__(self, averager: ModelAverager) -> None:
        # Not torch's __init__: it would set the step counter, which is the averager's, to 0.
        self.averager = averager
        self.process_group = dist.group.WORLD

    @property  # type: ignore[override]
    def step(self) -> int:
        return self.averager.steps

    @step.setter
    def step(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"step must be an integer >= 0, got {value!r}")
        self.averager.steps = value

    def average_parameters(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]) -> None:
        self.averager.average_parameters(params)


class RPSAverager(ModelAverager):
    """RPS: average every step (``period`` = 1)."""

    def __init__(self, model: torch.nn.Module, *, network: NetworkConfig | dict[str, Any] | str | None = None,
                 warmup_steps: int = 0, seed: int = 0, average_buffers: bool = True, transport: str = "gloo",
                 deadline_ms: float | None = None, key_file: str = "", ports: str = UDP_PORTS,
                 host: str = "", heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        super().__init__(model, network=network, period=1, warmup_steps=warmup_steps, seed=seed,
                         average_buffers=average_buffers, transport=transport, deadline_ms=deadline_ms,
                         key_file=key_file, ports=ports, host=host, heartbeat_timeout_s=heartbeat_timeout_s)


def _outer_init(outer: OuterSGD, groups: list[_Group], averaged: list[torch.Tensor]) -> list[OuterState]:
    """One outer state per group with parameters (those come first: ``_groups`` orders them so)."""
    return [outer.init(a[:, :g.num_param_values]) for g, a in zip(groups, averaged) if g.params]


def _outer_step(outer: OuterSGD, states: list[OuterState], groups: list[_Group],
                averaged: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[OuterState]]:
    """The outer optimizer's step on each group's parameters (its buffers pass through as averaged)."""
    with_params = [(g, a) for g, a in zip(groups, averaged) if g.params]
    anchors = [(str(s.anchor.dtype), s.anchor.shape[1]) for s in states]
    now = [(str(a.dtype), g.num_param_values) for g, a in with_params]
    if anchors != now:
        raise ValueError(f"the model's parameters changed since the averager was built (outer anchors "
                         f"{anchors}, parameters now {now}); build it after model.to(...)")
    out, new_states = list(averaged), []
    for k, ((g, a), state) in enumerate(zip(with_params, states)):
        n = g.num_param_values
        new, state = outer.update(a[:, :n], state)
        out[k] = torch.cat([new, a[:, n:]], dim=1) if g.buffers else new
        new_states.append(state)
    return out, new_states
