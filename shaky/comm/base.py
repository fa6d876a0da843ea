"""The Comm protocol: the only way strategies move tensors between workers.

Every tensor has a leading worker axis: [W, ...] in the simulator (all workers
in one process), [1, ...] in a torch.distributed process. ``rows`` says which
global workers the local rows are, so a strategy indexes the global delivery
masks with it and the same line of code runs on both backends.

The delivery masks of a block exchange are bool [W, W] (one message per block)
or, when the unit of loss is a datagram's segment, [W, W, S]: ``shaky.geometry``'s
``block_sizes`` cuts a row into W blocks and ``segment_length``/``segment_counts``
cut each block into segments (see :meth:`Comm.block_average`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from shaky.geometry import LinkSample


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: itself where it is there already; from the host to a GPU through pinned memory,
    without waiting for the GPU (the copy is queued on the current stream, before the work that reads it).
    The round's masks, membership and batch indices are drawn on the host, the same on every device, and
    cross this way (a few hundred bytes a step)."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class Handle(Protocol):
    """An exchange that was started and completes later: ``wait()`` blocks until its result is here.

    The simulator's exchanges complete when they start (:class:`Done`); a real transport's may run
    in the background while the next steps compute, and ``wait`` is where a worker blocks for it.
    """

    def wait(self) -> torch.Tensor: ...


class MeanHandle(Handle, Protocol):
    """A mean that was started (:meth:`Comm.start_mean`)."""

    @property
    def settled(self) -> bool:
        """Whether the result is here alike on every rank: ``wait()`` then waits for nothing, and every rank
        that asks at the same step gets True (an all-reduce in flight, which each rank sees complete at its own
        time, is False until it is waited for)."""
        ...

    @property
    def carried(self) -> bool:
        """Whether a control round already on its way carries it, one the training loop takes in at a step of
        its schedule anyway (a delayed exchange's): waiting for it sooner would only wait for that round early.
        The same on every rank at the same step."""
        ...


class Done(NamedTuple):
    """A handle whose result is already here (every exchange of the simulator)."""

    value: torch.Tensor
    """The exchange's result, [w, ...] like its input."""

    WORKER_AXIS = ("value",)
    settled = True
    carried = True

    def wait(self) -> torch.Tensor:
        return self.value


class Observed(Protocol):
    """A transport whose losses are observed, not drawn (udp): what really arrived, and what it counted. The
    simulator and gloo are not one: their drawn masks are the ones that applied (:data:`DRAWN` stands in)."""

    def control_round_seconds(self, latency_ms: Any) -> float:
        """Seconds of the control round that every exchange waits for after its messages, under the network's
        one-way latencies (ms, a number or [W, W]): on the udp transport with live membership a round of records
        by mail (``shaky.network.clock.mail_round_seconds``), 0 without one. The simulated clock adds it."""
        ...

    def on_step(self, step: int) -> None:
        """A step starts: the exchanges launched from now on are this step's."""
        ...

    def take_observed(self) -> list[tuple[int, LinkSample]]:
        """The masks observed for the exchanges that completed since the last call, each with the step that
        launched it (a background exchange completes steps later)."""
        ...

    def transport_stats(self, before: dict[str, int | float] | None = None) -> dict[str, int | float]:
        """What the transport counted over the run, summed over the ranks (a collective), added to ``before``
        (the table at the checkpoint a run was resumed from)."""
        ...


class _Drawn:
    """:class:`Observed` for a backend whose masks are drawn (the simulator, gloo): nothing observed, nothing
    counted, no control round."""

    def control_round_seconds(self, latency_ms: Any) -> float:
        return 0.0

    def on_step(self, step: int) -> None:
        pass

    def take_observed(self) -> list[tuple[int, LinkSample]]:
        return []

    def transport_stats(self, before: dict[str, int | float] | None = None) -> dict[str, int | float]:
        return {}


DRAWN: Observed = _Drawn()


def observer(comm: object) -> Observed:
    """``comm`` itself where its losses are observed (it has ``take_observed``), else :data:`DRAWN`."""
    return comm if hasattr(comm, "take_observed") else DRAWN  # type: ignore[return-value]


class Comm(Protocol):
    """What a strategy moves between workers, and nothing else: exact means, RPS's block average (started, then
    completed), gathers and broadcasts. Who is in a step is :mod:`shaky.membership`'s; what a lossy transport
    observed is :class:`Observed`'s."""

    num_workers: int
    """W, the number of workers in the whole run."""
    rows: torch.Tensor
    """int64 [w]: the global worker index of each local row."""
    wait_s: float
    """Seconds spent blocked waiting for exchanges (0 where they complete at once, as in the simulator)."""

    def mean(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Exact average over all W workers (a reliable all-reduce), returned on every local row.

        ``weights`` (float [W], global) weighs each worker's row: 0 leaves a dead worker
        out, a batch size weighs by samples. None is the plain mean.
        """
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every worker's rows [W, ...] (for checkpoints); a collective on the dist backend."""
        ...

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (what rank 0 read of the run directory when a run resumes: the other
        ranks' machines may have no copy of it); a collective on the dist backend, ``value`` itself in the
        simulator."""
        ...

    def start_block_average(self, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                            weights: torch.Tensor | None = None, servers: torch.Tensor | None = None,
                            overwrite: bool = False, segment_bytes: int = 0) -> Handle:
        """The two-phase exchange of RPS (Yu et al. 2019) over a lossy network.

        x [w, D] is cut into W blocks; block j is served by worker ``servers[j]``
        (worker j if None). Phase 1: the server averages block j over the senders i
        whose message arrived (``up[i, server]``; its own always does), weighted by
        ``weights`` if given. Phase 2: worker i takes that average where
        ``down[server, i]``, and keeps its own block j otherwise.

        With ``segment_bytes`` > 0 the unit of loss is a segment: block j is cut into
        segments of ``segment_length(segment_bytes, x.element_size())`` values
        (``segment_counts``), and ``up``/``down`` are bool [W, W, S]. The rule above
        holds per segment: the server averages segment k over the senders with
        ``up[i, server, k]``, and worker i takes it where ``down[server, i, k]``.
        With ``segment_bytes`` 0 the masks are [W, W] (one message per block).

        ``overwrite``: the caller gives ``x`` up, so the result may be written into
        its storage (and ``x`` returned) instead of a new tensor.

        The handle's ``wait()`` gives the result (each comm also has ``block_average``: started and waited for).
        """
        ...

    def start_mean(self, x: torch.Tensor, weights: torch.Tensor | None = None, *,
                   deferred: bool = False) -> MeanHandle:
        """:meth:`mean`, started: the handle's ``wait()`` gives its result. ``deferred``: nobody needs it before
        the comm's next collective (a step's loss), so a comm whose collectives are rounds of records may carry
        it in that round's instead of one of its own."""
        ...
