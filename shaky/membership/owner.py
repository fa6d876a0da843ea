"""The membership owners: the loop asks one of them once a step (:meth:`Members.step`) and gets a :class:`Turn`.

An owner never moves data: the comm does (``shaky.comm``). The udp transport's survivors agree on changes in
the control rounds its exchanges make (``shaky.comm.udp.control.QuorumControl``, over
:class:`shaky.membership.quorum.Quorum`); :class:`Agreed` takes what they agreed on through that
:class:`Agreement`, and writes it into the failure schedule, which is what the strategies, the checkpoint and the
simulator's replay read. Whoever starts the rank (``shaky.job.rank``) builds its owner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from shaky.network.faults import FailureSchedule, Membership

Handover = Callable[[tuple[int, ...]], dict[str, Any]]
"""``handover(joiners)``: the training loop's state for ranks taken back at this step's start (what a checkpoint
holds, less the model), made once every exchange in flight has completed."""


class Turn(NamedTuple):
    """Who is in one step, the same value on every live rank."""

    members: Membership
    """The step's membership: live workers, the server of each block, who comes back, the averaging weights."""
    joiners: tuple[int, ...]
    """Ranks started again for dead ones, taken back at this step's start (handed the run's state)."""


class Members(Protocol):
    """The one owner of "who is in this step"."""

    schedule: FailureSchedule
    """The run's membership as failures (configured, and with :class:`Agreed` those observed at run time): the
    checkpoint records it and the simulator replays it."""

    def step(self, step: int, handover: Handover | None) -> Turn:
        """Called at each step's start, before anything of the step is exchanged."""
        ...


class Scheduled:
    """The failure schedule is the membership (the simulator; gloo, where a dead rank stops every rank; udp
    without live membership). ``progress(step)``, if given, marks this rank's progress where the survivors of a
    failure read it (``Heartbeat.mark``: the failure report names the rank that stopped, and its step)."""

    def __init__(self, schedule: FailureSchedule, progress: Callable[[int], None] | None = None) -> None:
        self.schedule = schedule
        self._progress = progress

    def step(self, step: int, handover: Handover | None = None) -> Turn:
        if self._progress is not None:
            self._progress(step)
        return Turn(self.schedule.membership(step), ())


class Agreement(Protocol):
    """What a transport with live membership (udp with ``dist.heartbeat_timeout_s``) agreed on among the
    survivors: changes of the live ranks, and ranks started again to take back."""

    def on_step(self, step: int, *, admit: bool = True) -> None:
        """A step starts: its first control round may take ranks back (unless ``admit`` is False)."""
        ...

    def take_admitted(self) -> tuple[int, ...]:
        """Ranks started again that the survivors agreed (in the last step) to take back now."""
        ...

    def welcome(self, joiners: Sequence[int], snapshot: dict[str, Any]) -> None:
        """Takes ``joiners`` back from this step, handing them ``snapshot`` (every live rank calls it)."""
        ...

    def take_membership(self) -> list[tuple[int, torch.Tensor]]:
        """The changes agreed since the last call: (the step from which it holds, bool [W] live)."""
        ...


class Agreed:
    """The membership the survivors agree on at run time, written into ``schedule`` as it is agreed.

    A loop that can hand its state to a process started again (``shaky train``) passes a ``handover`` each step
    and takes such ranks back; one that cannot (a user's own loop with ``RPSAverager(transport="udp")``, whose
    state is the user's) passes None, and its rounds take nobody back: its survivors train on without the dead.
    """

    def __init__(self, agreement: Agreement, schedule: FailureSchedule) -> None:
        self.schedule = schedule
        self._agreement = agreement

    def step(self, step: int, handover: Handover | None) -> Turn:
        agreement = self._agreement
        agreement.on_step(step, admit=handover is not None)
        joiners = agreement.take_admitted() if handover is not None else ()
        if handover is not None and joiners:
            agreement.welcome(joiners, handover(joiners))
        for at, live in agreement.take_membership():  # a dead rank left out, or ranks taken back
            self.schedule.observe(at, live)
        return Turn(self.schedule.membership(step), joiners)
