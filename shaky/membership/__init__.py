"""The one owner of "who is in this step".

The training loop asks its :class:`Members` once a step (:meth:`Members.step`) and gets one value, a
:class:`Turn`: the step's :class:`~shaky.network.faults.Membership` (the live workers, who serves which
block, who comes back, the averaging weights) and the ranks taken back at the step's start. Two owners:

- :class:`Scheduled` (the simulator, gloo, udp without live membership): the failure schedule of the config
  is the membership; nobody is taken back (on gloo a dead rank stops every rank).
- :class:`Agreed` (udp with ``dist.heartbeat_timeout_s``): the survivors agree on changes at run time
  (heartbeats and the quorum's control rounds); a process started again for a dead rank is taken back at a
  step's start. The changes go into the same failure schedule, so the simulator replays the run.
"""

from shaky.membership.owner import Agreed, Agreement, Members, Scheduled, Turn

__all__ = ["Agreed", "Agreement", "Members", "Scheduled", "Turn"]
