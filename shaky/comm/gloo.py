"""gloo's Comm: one worker per torch.distributed process, rows of shape [1, ...].

RPS's two phases are an ``all_to_all_single`` (block j goes to the rank that serves it) and point-to-point sends of
each server's average to every rank: the messages of the paper's two phases, on the same links (a server of two
blocks averages each over the senders whose message of that block arrived: the masks are per block). Every rank holds the
same global delivery masks (drawn from the run seed), so the receiving side applies them (:mod:`shaky.comm.rps`): a
block that "did not arrive" is simply left out of the average, exactly as in the simulator, and both backends agree
round by round. The udp transport (:mod:`shaky.comm.udp.comm`) moves the block averages to datagrams.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from shaky.comm import rps
from shaky.geometry import block_sizes


class _Reduced:
    """An all-reduce in flight; ``wait`` gives the mean."""

    settled = False     # each rank sees it complete at its own time
    carried = False

    def __init__(self, comm: DistComm, work: dist.Work, total: torch.Tensor,
                 denominator: torch.Tensor | float) -> None:
        self._comm, self._work, self._total, self._denominator = comm, work, total, denominator

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        self._work.wait()
        self._comm.wait_s += time.perf_counter() - t0
        return self._total / self._denominator


def world_timeout() -> timedelta:
    """The default process group's timeout (init_process_group's), for the groups this module makes: a new group
    would otherwise wait torch's 30 minutes for a rank that died."""
    try:
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):      # another torch's internals: its default
        return dist.default_pg_timeout


class _InFlight:
    """An exchange (or a control round) running in a thread of its comm; ``wait()`` gives its result: the first
    call completes it (``complete(future)``: waits, counts, and on udp gathers or takes in the masks), later
    calls return the same tensor."""

    def __init__(self, future: Any, complete: Callable[[Any], torch.Tensor]) -> None:
        self._future, self._complete = future, complete
        self._value: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._complete(self._future)
        return self._value


def rendezvous_store() -> dist.Store:
    """The rendezvous store itself (MASTER_ADDR:MASTER_PORT's), under the prefixes torch's process groups add:
    shaky's keys live there, where a process started again for a dead rank, which has no process group, reads
    them with a plain client."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class JoinStore(NamedTuple):
    """What a process started again for a dead rank has instead of a process group: the rendezvous store."""

    store: dist.Store
    """The rendezvous store (:func:`rendezvous_store`)."""
    rank: int
    num_workers: int
    record: dict[str, Any]
    """The run record rank 0 published (``shaky.job.rendezvous.publish_run``)."""


class DistComm:
    """Comm for one worker per torch.distributed process (gloo on CPU, NCCL on GPU): data only. Who is in is
    :mod:`shaky.membership`'s (the failure schedule; a :class:`~shaky.membership.heartbeat.Heartbeat` names a rank
    that stopped)."""

    def __init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DistComm needs torch.distributed to be initialised (start with torchrun)")
        self.rank, self.num_workers = dist.get_rank(), dist.get_world_size()
        self.store = rendezvous_store()
        """The rendezvous store (heartbeats, the run record for a process started again, the udp addresses)."""
        self.rows = torch.tensor([self.rank])
        self._buffers: dict[str, torch.Tensor] = {}
        self._data: dist.ProcessGroup | None = None
        self._data_thread: ThreadPoolExecutor | None = None
        self.wait_s = 0.0
        """Seconds spent blocked waiting for exchanges (a gloo block average blocks for all of it)."""

    def close(self) -> None:
        """Stops the exchange thread (before the process group is destroyed)."""
        if self._data_thread is not None:
            self._data_thread.shutdown(wait=False, cancel_futures=True)

    def _buffer(self, name: str, size: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < size or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = like.new_empty(size)
        return buf[:size]

    def barrier(self) -> None:
        """Every rank got here."""
        dist.barrier()

    def mean(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        if weights is None:
            total = x.clone()
            dist.all_reduce(total)
            return total / self.num_workers
        w = weights.to(x.dtype)
        total = x * w[self.rank]
        dist.all_reduce(total)
        return total / w.sum()

    def start_mean(self, x: torch.Tensor, weights: torch.Tensor | None = None, *,
                   deferred: bool = False) -> _Reduced:
        """:meth:`mean` as gloo's asynchronous all-reduce: it runs while the caller goes on (``deferred``, a
        mean nobody needs soon, changes nothing here)."""
        if weights is None:
            total, denominator = x.clone(), float(self.num_workers)
        else:
            w = weights.to(x.dtype)
            total, denominator = x * w[self.rank], w.sum()
        return _Reduced(self, dist.all_reduce(total, async_op=True), total, denominator)

    def start_block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                            weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                            overwrite: bool = False) -> _InFlight:
        """:meth:`block_average`, in the background: a thread runs its two phases on a process group of their
        own, in launch order (the default group's collectives, such as the loss mean and evaluation, go on
        meanwhile), and ``wait()`` blocks only for what has not arrived. The first call creates that group, a
        collective: every rank starts its exchanges at the same steps, as a schedule makes them. Unless the
        caller gives ``x`` up (``overwrite``), the thread reads a copy of it."""
        if self._data is None:
            self._data = dist.new_group(backend=dist.get_backend(), timeout=world_timeout())
            self._data_thread = ThreadPoolExecutor(1, thread_name_prefix="shaky-exchange")
        future = self._data_thread.submit(self._block_average, x if overwrite else x.clone(), up, down, weights,
                                          servers, self._data, "background")
        return _InFlight(future, self._waited)

    def _waited(self, future: Future) -> torch.Tensor:
        t0 = time.perf_counter()
        value = future.result()
        self.wait_s += time.perf_counter() - t0
        return value

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All workers' rows, [W, ...], on every rank (for checkpoints)."""
        parts = [torch.empty_like(x) for _ in range(self.num_workers)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (pickled, over gloo: every rank is there when a run resumes)."""
        return broadcast_object(value)

    def block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                      weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                      overwrite: bool = False) -> torch.Tensor:
        # ``overwrite`` is allowed, not required: the result here is always a fresh tensor (phase 2
        # receives into it while ``x`` still supplies the blocks whose average was lost).
        t0 = time.perf_counter()
        out = self._block_average(x, up, down, weights, servers, None, "received")
        self.wait_s += time.perf_counter() - t0
        return out

    def _block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor | None,
                       servers: torch.Tensor | None, group: dist.ProcessGroup | None, staging: str) -> torch.Tensor:
        """RPS's two phases on ``group`` (None: the default one), staged in the buffer named ``staging``."""
        w, me = self.num_workers, self.rank
        row = x[0]
        sizes = block_sizes(row.numel(), w)
        srv = servers.tolist() if servers is not None else list(range(w))
        if servers is not None:     # (the masks are per block; a server's own part never travels)
            up, down = rps.own_parts_delivered(up, down, servers)
        # all_to_all_single lays data out by destination rank: order the blocks by their server.
        order = sorted(range(w), key=lambda j: srv[j])
        per_rank = [sum(sizes[j] for j in range(w) if srv[j] == r) for r in range(w)]
        starts = [sum(sizes[:j]) for j in range(w)]
        if order != list(range(w)):
            row = torch.cat([row[starts[j]:starts[j] + sizes[j]] for j in order])
        mine = per_rank[me]

        # Phase 1: every rank sends me the blocks I serve; I average those that arrived.
        # The staging buffer persists across calls: fresh large tensors cost a page fault
        # per 4 KiB, which on a busy machine takes longer than the exchange itself.
        received = self._buffer(staging, w * mine, row)
        dist.all_to_all_single(received, row.contiguous(), output_split_sizes=[mine] * w,
                               input_split_sizes=per_rank, group=group)

        # Phase 2: I send my average to every rank and get every server's back, in ``order`` layout: the
        # average is computed straight into my piece of the result and sent from there, and every server's
        # arrives straight into its piece, with no staging copies. (An all_to_all_single would need the
        # average copied w times into a send buffer; gloo's all-gather allocates and page-faults a
        # full-size buffer on every call: both took longer on the benchmark.)
        out = row.new_empty(row.numel())
        piece = [sum(per_rank[:r]) for r in range(w)]
        avg = out[piece[me]:piece[me] + mine]
        # Each block I serve is a message of its own: its average is over the senders whose block arrived.
        offset = 0
        for j in (j for j in order if srv[j] == me):
            share = rps.shares(up[:, j:j + 1], weights, x.dtype)   # [1, 1, senders]: each arrival's weight
            rps.server_average(share, received.view(1, w, mine)[:, :, offset:offset + sizes[j]],
                               out=avg[offset:offset + sizes[j]].view(1, sizes[j]))
            offset += sizes[j]
        requests = []
        for r in range(w):
            if r != me:
                if mine:
                    requests.append(dist.isend(avg, r, group=group))
                if per_rank[r]:
                    requests.append(dist.irecv(out[piece[r]:piece[r] + per_rank[r]], r, group=group))
        for request in requests:
            request.wait()
        # Where a server's average was lost, keep my own block (only those blocks: no full-size mask).
        pos, lost = 0, torch.ones(1, 1, 1, dtype=torch.bool)
        for j in order:
            if not down[j, me]:
                rps.keep_own_where_lost(None, row[pos:pos + sizes[j]].view(1, 1, sizes[j]), lost,
                                        out=out[pos:pos + sizes[j]].view(1, 1, sizes[j]))
            pos += sizes[j]
        if order != list(range(w)):
            unpermuted = torch.empty_like(out)
            pos = 0
            for j in order:
                unpermuted[starts[j]:starts[j] + sizes[j]] = out[pos:pos + sizes[j]]
                pos += sizes[j]
            out = unpermuted
        return out[None]


def broadcast_object(value: object) -> object:
    """Rank 0's ``value`` on every rank (a run directory, a measured compute time)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_object(value: object) -> list[object]:
    """Every rank's ``value``, by rank, on every rank."""
    values: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
