"""The torch.distributed backend: one worker per process, rows of shape [1, ...].

This is the only module that imports torch.distributed. RPS's two phases are
an ``all_to_all_single`` (block j goes to the rank that serves it) and
point-to-point sends of each server's average to every rank: the messages of
the paper's two phases, on the same links. Every rank holds the same global
delivery masks (drawn from the run seed), so the receiving side applies them:
a block that "did not arrive" is simply left out of the average, exactly as in
the simulator, and both backends agree round by round."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from shaky.comm.base import Done, block_sizes


HEARTBEAT_S = 0.25
"""How often each rank's heartbeat thread writes to the rendezvous store."""


class _Reduced:
    """An all-reduce in flight; ``wait`` gives the mean."""

    def __init__(self, work: dist.Work, total: torch.Tensor, denominator: torch.Tensor | float) -> None:
        self._work, self._total, self._denominator = work, total, denominator

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._total / self._denominator


class DistComm:
    """Comm for one worker per torch.distributed process (gloo on CPU, NCCL on GPU)."""

    def __init__(self, *, heartbeat: bool = False) -> None:
        """``heartbeat``: a thread beats in the rendezvous store, so that :meth:`diagnose_failure` can tell
        a rank that died from one that hangs (``shaky train`` turns it on; a user's own loop need not)."""
        if not dist.is_initialized():
            raise RuntimeError("DistComm needs torch.distributed to be initialised (start with torchrun)")
        self.rank = dist.get_rank()
        self.num_workers = dist.get_world_size()
        self.rows = torch.tensor([self.rank])
        self._store = dist.distributed_c10d._get_default_store()
        self._buffers: dict[str, torch.Tensor] = {}
        # A heartbeat in the rendezvous store, from a thread: after a collective fails, the ranks whose
        # heartbeat stopped are the ones that died (a kill -9, a crash, a SIGSTOP), whatever step they reached.
        self._beating = threading.Event()
        self._heartbeat = heartbeat
        if heartbeat:
            threading.Thread(target=self._beat, name="shaky-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        key = f"shaky/beat/{self.rank}"
        while not self._beating.wait(HEARTBEAT_S):
            try:
                self._store.add(key, 1)
            except RuntimeError:  # the store is gone (its host died, or the job ended)
                return

    def close(self) -> None:
        """Stops the heartbeat (before the process group is destroyed)."""
        self._beating.set()

    def _buffer(self, name: str, size: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < size or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = like.new_empty(size)
        return buf[:size]

    def on_step(self, step: int) -> None:
        """Marks this rank's progress in the rendezvous store, where survivors of a failure read it."""
        self._store.set(f"shaky/step/{self.rank}", str(step))

    def diagnose_failure(self, timeout_s: float) -> tuple[int, int] | None:
        """After a collective failed: which rank stopped, and after which step.

        A rank whose heartbeat stopped (it died, or its process was frozen) is the one; if every heartbeat
        goes on, the rank that reported the lowest step (it hangs while its process lives). Reads both from
        the rendezvous store. Rank 0 may host that store (plain ``init_method=env://``), so it waits until
        every other survivor has read it before returning; None if the store is gone.
        """
        try:
            dead: list[int] = []
            if self._heartbeat:
                others = [r for r in range(self.num_workers) if r != self.rank]
                before = {r: self._store.add(f"shaky/beat/{r}", 0) for r in others}
                time.sleep(4 * HEARTBEAT_S)
                dead = [r for r in others if self._store.add(f"shaky/beat/{r}", 0) == before[r]]
            steps = [int(self._store.get(f"shaky/step/{r}")) if self._store.check([f"shaky/step/{r}"]) else -1
                     for r in range(self.num_workers)]
            failed = min(dead or range(self.num_workers), key=lambda r: (steps[r], r))
            self._store.set(f"shaky/diagnosed/{self.rank}", "1")
            if self.rank == 0:
                waiting = [f"shaky/diagnosed/{r}" for r in range(1, self.num_workers) if r != failed and r not in dead]
                # Polled, not store.wait: a wait holds the store client, which would stall this rank's heartbeat.
                deadline = time.monotonic() + timeout_s
                while waiting and not self._store.check(waiting) and time.monotonic() < deadline:
                    time.sleep(0.05)
        except RuntimeError:  # the store went away with its host
            return None
        return failed, steps[failed]

    def mean(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        if weights is None:
            total = x.clone()
            dist.all_reduce(total)
            return total / self.num_workers
        w = weights.to(x.dtype)
        total = x * w[self.rank]
        dist.all_reduce(total)
        return total / w.sum()

    def start_mean(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> _Reduced:
        """:meth:`mean` as gloo's asynchronous all-reduce: it runs while the caller goes on."""
        if weights is None:
            total, denominator = x.clone(), float(self.num_workers)
        else:
            w = weights.to(x.dtype)
            total, denominator = x * w[self.rank], w.sum()
        return _Reduced(dist.all_reduce(total, async_op=True), total, denominator)

    def start_block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                            weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                            overwrite: bool = False) -> Done:
        """:meth:`block_average`; on gloo it completes before returning (its two phases depend on each other)."""
        return Done(self.block_average(x, up, down, weights=weights, servers=servers, overwrite=overwrite))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All workers' rows, [W, ...], on every rank (for checkpoints)."""
        parts = [torch.empty_like(x) for _ in range(self.num_workers)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    def block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                      weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                      overwrite: bool = False) -> torch.Tensor:
        # ``overwrite`` is allowed, not required: the result here is always a fresh tensor (phase 2
        # receives into it while ``x`` still supplies the blocks whose average was lost).
        w, me = self.num_workers, self.rank
        row = x[0]
        sizes = block_sizes(row.numel(), w)
        srv = servers.tolist() if servers is not None else list(range(w))
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
        received = self._buffer("received", w * mine, row)
        dist.all_to_all_single(received, row.contiguous(), output_split_sizes=[mine] * w,
                               input_split_sizes=per_rank)
        arrived = up[:, me].to(x.dtype)
        if weights is not None:
            arrived = arrived * weights.to(x.dtype)
        share = (arrived / arrived.sum())[None]        # [1, senders]: each arrival's weight, as in SimComm

        # Phase 2: I send my average to every rank and get every server's back, in ``order`` layout: the
        # average is computed straight into my piece of the result and sent from there, and every server's
        # arrives straight into its piece, with no staging copies. (An all_to_all_single would need the
        # average copied w times into a send buffer; gloo's all-gather allocates and page-faults a
        # full-size buffer on every call: both took longer on the benchmark.)
        out = row.new_empty(row.numel())
        piece = [sum(per_rank[:r]) for r in range(w)]
        avg = out[piece[me]:piece[me] + mine]
        torch.mm(share, received.view(w, mine), out=avg.view(1, mine))
        requests = []
        for r in range(w):
            if r != me:
                if mine:
                    requests.append(dist.isend(avg, r))
                if per_rank[r]:
                    requests.append(dist.irecv(out[piece[r]:piece[r] + per_rank[r]], r))
        for request in requests:
            request.wait()
        # Where a server's average was lost, keep my own block (few blocks: a copy each, no full-size mask).
        pos = 0
        for j in order:
            if not down[srv[j], me]:
                out[pos:pos + sizes[j]] = row[pos:pos + sizes[j]]
            pos += sizes[j]
        if order != list(range(w)):
            unpermuted = torch.empty_like(out)
            pos = 0
            for j in order:
                unpermuted[starts[j]:starts[j] + sizes[j]] = out[pos:pos + sizes[j]]
                pos += sizes[j]
            out = unpermuted
        return out[None]


def init_from_env(timeout_s: float) -> None:
    """Joins the process group that torchrun describes in the environment.

    Training runs on the CPU, so the group is gloo; collectives that wait longer
    than ``timeout_s`` fail instead of hanging.
    """
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"backend dist must be started by torchrun (the environment lacks {', '.join(missing)}); "
                         "e.g. torchrun --nproc-per-node 4 -m shaky train --backend dist ...")
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


def broadcast_object(value: object) -> object:
    """Rank 0's ``value`` on every rank (a run directory, a measured compute time)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
