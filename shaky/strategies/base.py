"""What every strategy shares: the Strategy protocol, its step statistics, the
SGD update, and the traffic patterns of its exchanges (RPS's two-phase block
exchange, a ring all-reduce)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, Protocol, TypeVar

import numpy as np
import torch

from shaky.comm.base import Comm, block_sizes
from shaky.config import OptimConfig, StrategyConfig
from shaky.network.clock import PhaseTraffic
from shaky.network.model import LinkSample

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class StepStats:
    """The exchange a step launched, phase by phase, for the counters and the clock."""

    phases: tuple[PhaseTraffic, ...] = ()
    """The exchange's rounds of messages, in order (empty: the step sends nothing)."""
    delay: int = 1
    """The exchange is needed at the end of step n + delay - 1 (1: at the end of this step, synchronous)."""

    @property
    def bytes_sent(self) -> int:
        return sum(p.bytes_sent for p in self.phases)

    @property
    def messages_sent(self) -> int:
        return sum(p.messages for p in self.phases)

    @property
    def messages_dropped(self) -> int:
        return sum(p.dropped for p in self.phases)


class Strategy(Protocol[S]):
    """A distributed algorithm as a pair of functions over [w, D] tensors.

    ``step`` never modifies ``params`` or the tensors of ``state``; ``grads`` is
    the step's to consume: it may overwrite it (and return its storage as the new
    parameters), so the caller must not read ``grads`` after the call. Reusing
    that buffer saves a full-size allocation and a pass over memory every step,
    which is most of what a memory-bound round costs (``docs/performance.md``).
    """

    name: str

    def init(self, params: torch.Tensor) -> S: ...

    def step(self, params: torch.Tensor, grads: torch.Tensor, state: S, comm: Comm,
             links: LinkSample) -> tuple[torch.Tensor, S, StepStats]: ...


class SGDState(NamedTuple):
    count: int
    """Updates applied so far; drives the learning-rate schedule."""
    momentum: torch.Tensor | None
    """Per-worker heavy-ball buffer [w, D]; None when momentum is 0."""


class SGD:
    """SGD with optional momentum and weight decay (torch.optim.SGD's rule), warm-up and step decay."""

    def __init__(self, cfg: OptimConfig) -> None:
        self.cfg = cfg

    def lr(self, count: int) -> float:
        c = self.cfg
        lr = c.lr * min(1.0, (count + 1) / c.warmup_steps) if c.warmup_steps else c.lr
        return lr * c.decay_factor ** sum(count >= s for s in c.decay_steps)

    def init(self, params: torch.Tensor) -> SGDState:
        return SGDState(0, torch.zeros_like(params) if self.cfg.momentum else None)

    def _direction(self, params: torch.Tensor, grads: torch.Tensor,
                   state: SGDState) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The descent direction (gradient, weight decay, momentum) and the new momentum buffer."""
        c = self.cfg
        d = grads.add(params, alpha=c.weight_decay) if c.weight_decay else grads
        buf = state.momentum
        if buf is not None:
            # torch.optim.SGD seeds the buffer with the first gradient; d + m * 0 is the same.
            # One fused pass over [w, D] (torch.optim's mul_ then add_ takes two).
            buf = torch.add(d, buf, alpha=c.momentum)
            d = buf
        return d, buf

    def update(self, params: torch.Tensor, grads: torch.Tensor, state: SGDState, *,
               overwrite_grads: bool = False) -> tuple[torch.Tensor, SGDState]:
        """``params - lr * direction`` and the new state.

        With ``overwrite_grads`` the result is written into ``grads``'s storage (when it
        has ``params``'s shape, dtype and a dense layout) instead of a new tensor.
        """
        d, buf = self._direction(params, grads, state)
        lr = self.lr(state.count)
        if overwrite_grads and _same_dense_layout(grads, params):
            return torch.add(params, d, alpha=-lr, out=grads), SGDState(state.count + 1, buf)
        return params.add(d, alpha=-lr), SGDState(state.count + 1, buf)

    def in_place(self, params: torch.Tensor, state: SGDState) -> tuple[Callable[[slice, torch.Tensor], None], SGDState]:
        """``update`` applied in place, one column slice at a time: ``apply(columns, grad)`` sets
        ``params[:, columns]`` (and the momentum buffer's columns) to what ``update`` gives for them, with the
        same operations, so the numbers are identical. ``grad`` is consumed (it may be overwritten).

        For the optimizer-in-backward path (``shaky.train.train_step``): the caller owns ``params``
        and the state, and calls ``apply`` once for every column.
        """
        c, buf, lr = self.cfg, state.momentum, self.lr(state.count)

        def apply(columns: slice, grad: torch.Tensor) -> None:
            p = params[:, columns]
            d = grad.add_(p, alpha=c.weight_decay) if c.weight_decay else grad
            if buf is not None:
                b = buf[:, columns]
                torch.add(d, b, alpha=c.momentum, out=b)
                d = b
            p.add_(d, alpha=-lr)

        return apply, SGDState(state.count + 1, buf)

    def delta(self, params: torch.Tensor, grads: torch.Tensor, state: SGDState) -> tuple[torch.Tensor, SGDState]:
        """The change ``update`` would make to ``params`` (-lr * direction), for strategies that exchange updates."""
        d, buf = self._direction(params, grads, state)
        return d.mul(-self.lr(state.count)), SGDState(state.count + 1, buf)


def _same_dense_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` can take ``b``'s values in place: same shape and dtype, contiguous, not a broadcast view."""
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.is_contiguous() \
        and not a.requires_grad


class SGDStrategy:
    """Base of the strategies built on per-worker SGD: the optimizer, the averaging weights, and the two ways
    of averaging (reliable mean, lossy block exchange) with failed workers left out."""

    name = ""

    def __init__(self, sgd: SGD, cfg: StrategyConfig | None = None,
                 sample_weights: torch.Tensor | None = None) -> None:
        self.sgd = sgd
        self.cfg = cfg or StrategyConfig(name=self.name)
        self.sample_weights = sample_weights
        """float [W]: each worker's weight in an average (its batch size), or None for equal weights."""

    def init(self, params: torch.Tensor) -> SGDState:
        return self.sgd.init(params)

    def weights(self, links: LinkSample) -> torch.Tensor | None:
        """Averaging weights of this round: the sample weights, 0 for a dead worker."""
        if links.live is None:
            return self.sample_weights
        live = links.live.to(torch.float64)
        return live if self.sample_weights is None else live * self.sample_weights

    def reliable_mean(self, x: torch.Tensor, comm: Comm, links: LinkSample) -> tuple[torch.Tensor, StepStats]:
        """The exact (weighted) average over live workers: a ring all-reduce over a transport that resends."""
        return comm.mean(x, self.weights(links)), StepStats(ring_allreduce_traffic(x, comm.num_workers, links))

    def lossy_average(self, x: torch.Tensor, comm: Comm, links: LinkSample, *,
                      overwrite: bool = False) -> tuple[torch.Tensor, StepStats]:
        """RPS's two-phase block average over the lossy network, with failed servers' blocks moved on.

        ``overwrite``: ``x`` is the caller's to give up; the average may be computed in its storage.
        """
        out = comm.block_average(x, links.up, links.down, weights=self.weights(links), servers=links.servers,
                                 overwrite=overwrite)
        return out, StepStats(block_exchange_traffic(x, comm.num_workers, links, reliable=False))


@lru_cache(maxsize=64)
def _block_link_bytes(dim: int, num_workers: int, itemsize: int, servers: tuple[int, ...] | None,
                      live: tuple[bool, ...] | None) -> tuple[np.ndarray, np.ndarray]:
    sizes = np.asarray(block_sizes(dim, num_workers), dtype=np.float64) * itemsize
    if servers is None and live is None:
        off_diagonal = ~np.eye(num_workers, dtype=bool)
        up = np.where(off_diagonal, sizes[None, :], 0.0)    # worker i -> server j carries block j
        down = np.where(off_diagonal, sizes[:, None], 0.0)  # server j -> worker i carries block j
    else:
        srv = np.asarray(servers if servers is not None else range(num_workers))
        alive = np.asarray(live if live is not None else [True] * num_workers)
        # [worker i, block j]: i sends block j to its server (and gets it back) if i lives and is not the server.
        carries = alive[:, None] & (np.arange(num_workers)[:, None] != srv[None, :])
        up = np.zeros((num_workers, num_workers))
        np.add.at(up, (np.nonzero(carries)[0], srv[np.nonzero(carries)[1]]), sizes[np.nonzero(carries)[1]])
        down = up.T.copy()
    up.flags.writeable = down.flags.writeable = False
    return up, down


def block_exchange_traffic(params: torch.Tensor, num_workers: int, links: LinkSample,
                           *, reliable: bool) -> tuple[PhaseTraffic, PhaseTraffic]:
    """The two phases of a block exchange of a [.., D] tensor among ``num_workers``.

    A reliable all-reduce (reduce-scatter then all-gather) moves the same blocks as
    RPS's two phases: (W-1)/W of the vector out of and into each worker per phase.
    """
    servers = tuple(links.servers.tolist()) if links.servers is not None else None
    live = tuple(links.live.tolist()) if links.live is not None else None
    up, down = _block_link_bytes(params.shape[-1], num_workers, params.element_size(), servers, live)
    return PhaseTraffic(up, links.up, reliable), PhaseTraffic(down, links.down, reliable)


@lru_cache(maxsize=64)
def _ring_link_bytes(dim: int, num_workers: int, itemsize: int,
                     order: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """Bytes on each link in each of the 2(n-1) hops of a ring all-reduce over the workers ``order``."""
    n = len(order)
    sizes = np.asarray(block_sizes(dim, n), dtype=np.float64) * itemsize
    hops = []
    # Reduce-scatter hop s: the k-th worker of the ring passes its partial sum of chunk k - s on;
    # all-gather hop s: it passes the finished chunk k + 1 - s on.
    for first_chunk in (0, 1):
        for s in range(n - 1):
            link = np.zeros((num_workers, num_workers))
            for k in range(n):
                link[order[k], order[(k + 1) % n]] = sizes[(k + first_chunk - s) % n]
            link.flags.writeable = False
            hops.append(link)
    return tuple(hops)


def ring_allreduce_traffic(x: torch.Tensor, num_workers: int, links: LinkSample) -> tuple[PhaseTraffic, ...]:
    """The 2(n-1) hops of a reliable ring all-reduce (reduce-scatter, then all-gather) of a [.., D] tensor.

    The ring runs over the n live workers in index order; in every hop each sends one
    chunk of about D/n values to the next, so a hop lasts as long as the ring's slowest
    link. Messages, bytes and losses match the block exchange (2n(n-1) messages of a
    chunk each). Whether a hop's message arrived is read from the round's masks: hop s
    of the reduce-scatter takes sender i's draw in ``up`` towards the (s+1)-th live
    worker after it, the all-gather the same in ``down``, so every draw is used once
    (with a per-link drop matrix, a ring message is lost at the rate of one of its
    sender's links in turn; see docs/clock.md).
    """
    order = tuple(range(num_workers)) if links.live is None else tuple(torch.nonzero(links.live)[:, 0].tolist())
    n = len(order)
    if n < 2:
        return ()
    hops = _ring_link_bytes(x.shape[-1], num_workers, x.element_size(), order)
    ring = torch.tensor(order)
    senders, receivers = ring, ring.roll(-1)
    phases = []
    for h, link in enumerate(hops):
        mask = links.up if h < n - 1 else links.down
        s = h % (n - 1)
        delivered = torch.ones(num_workers, num_workers, dtype=torch.bool)
        delivered[senders, receivers] = mask[senders, ring.roll(-(s + 1))]
        phases.append(PhaseTraffic(link, delivered, True))
    return tuple(phases)
