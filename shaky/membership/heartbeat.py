"""Each rank's sign of life, and its progress, in a store: how a dead rank is told from a slow one.

A thread beats (``shaky/beat/R``, a counter) every :data:`HEARTBEAT_S`, independent of the training loop: a rank
whose beat stopped died or was frozen (kill -9, a crash, SIGSTOP), whatever step it reached. With live
membership (udp's quorum, :mod:`shaky.membership.quorum`) the thread also watches the others' beats
(:meth:`Heartbeat.silent_s`), and the quorum leaves a rank out once it has been silent for
``dist.heartbeat_timeout_s``; on gloo, where a dead rank stops every rank, :meth:`Heartbeat.diagnose` names it
after a collective failed. Each step's start is marked too (``shaky/step/R``, :meth:`Heartbeat.mark`), so that a
rank that hangs while its process lives is named by the step it stopped at.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

HEARTBEAT_S = 0.25
"""How often each rank's heartbeat thread writes to its store (the rendezvous store; with live membership, the
control store: ``shaky.membership.quorum.ControlStore``)."""
BLIND_S = 4 * HEARTBEAT_S
"""Looks at the others' beats further apart than this (this process, or the store's host, stood still between
them) say nothing of who beat meanwhile: every rank's silence counts afresh from the late look."""
HEARTBEAT_JOIN_S = 10.0
"""How long closing waits for the heartbeat thread's store call in progress (TCP's retransmissions)."""


class Heartbeat:
    """This rank's heartbeat and progress marks, and what it saw of the others'.

    ``store``: the rendezvous store: the beats and marks go there until :meth:`start` or :attr:`marks` say
    otherwise, and a failure's diagnosis is agreed there.
    """

    def __init__(self, rank: int, num_workers: int, store: dist.Store) -> None:
        self.rank, self.num_workers = rank, num_workers
        self._rendezvous = store
        self.marks = store
        """Where :meth:`mark` notes this rank's progress (with live membership, the quorum's control store: a
        request a step to the rendezvous store, which torchrun's agent may host, would wait out TCP's 200 ms
        after each lost answer)."""
        self._beats = store
        """Where the beats are."""
        self.running = False
        self.watching = False
        """The thread also notes when every other rank's beat last moved (:meth:`silent_s`)."""
        self.seen: dict[int, tuple[int, float]] = {}
        """Each other rank's last beat seen moving, and when (with :attr:`watching`)."""
        self._stop = threading.Event()
        self._looked_at = 0.0
        self._last_beat = time.monotonic()
        self._longest_gap = 0.0
        """The longest time between two of this process's beats since :meth:`paused_s` last reset it."""
        self._thread: threading.Thread | None = None
        self.looks: list[Callable[[dist.Store], None]] = []
        """What else the thread looks at in the store each beat, in its client (the quorum's join requests)."""

    def start(self, store: dist.Store | None = None, *, watching: bool = False) -> Heartbeat:
        """Beats in ``store`` (None: the rendezvous store) from now on, from a thread (in a client of its own
        where a wait may block another: a beat must never wait behind one); ``watching``: and watches the
        others'."""
        self.running, self.watching, self._beats = True, watching, store or self._rendezvous
        self._last_beat = time.monotonic()
        self._thread = threading.Thread(target=self._beat, name="shaky-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        key = f"shaky/beat/{self.rank}"
        others = [r for r in range(self.num_workers) if r != self.rank]
        store = self._beats
        while True:
            now = time.monotonic()
            self._longest_gap, self._last_beat = max(self._longest_gap, now - self._last_beat), now
            try:
                store.add(key, 1)
                if self.watching:     # live membership: when each other rank's heartbeat last moved
                    now = time.monotonic()
                    # A beat seen moving now moved after the last look: its silence counts from then, so a
                    # dead rank is found silent within the timeout of its last beat, not a look later. But after
                    # a look that came far too late (this process or the store's host stood still: a SIGSTOP, a
                    # stall), nobody could beat meanwhile: every rank's silence counts afresh from now.
                    blind = bool(self._looked_at) and now - self._looked_at > BLIND_S
                    before = now if blind else self._looked_at or now
                    for r in others:
                        beat = int(store.add(f"shaky/beat/{r}", 0))
                        if blind or self.seen.get(r, (None,))[0] != beat:
                            self.seen[r] = (beat, before)
                    self._looked_at = now
                for look in self.looks:
                    look(store)
            except RuntimeError:  # the store is gone (its host died, or the job ended)
                return
            if self._stop.wait(HEARTBEAT_S):
                return

    def mark(self, step: int) -> None:
        """This rank reached ``step``: noted where the survivors of a failure read it (a request a step)."""
        self.marks.set(f"shaky/step/{self.rank}", str(step))

    def paused_s(self, reset: bool = False) -> float:
        """The longest this process has lately gone without a beat, a gap still under way included (while the
        heartbeat thread runs: one that ended, its store gone, measured its last gap when it woke): a SIGSTOP or
        a stalled machine stops the heartbeat thread too, and a pause past ``dist.heartbeat_timeout_s`` may have
        got this rank left out. ``reset``: from now on, count only later gaps."""
        running = self._thread is not None and self._thread.is_alive()   # (a thread that ended beats no more)
        paused = max(self._longest_gap, time.monotonic() - self._last_beat if running else 0.0)
        if reset:
            self._longest_gap = 0.0
        return paused

    def silent_s(self, rank: int) -> float:
        """How long ``rank``'s heartbeat has not moved (with :attr:`watching`; 0 before the first look): from
        the look before the one that saw it last move (an upper bound: it moved after that look) to now, but
        never past one beat after this thread's last look, so a pause of this process (SIGSTOP, a stalled
        machine) is not taken for silence of the others."""
        seen = self.seen.get(rank)
        return 0.0 if seen is None else min(time.monotonic(), self._looked_at + HEARTBEAT_S) - seen[1]

    def diagnose(self, timeout_s: float) -> tuple[int, int] | None:
        """After a collective failed: which rank stopped, and after which step.

        A rank whose heartbeat stopped (it died, or its process was frozen) is the one; if every heartbeat
        goes on, the rank that reported the lowest step (it hangs while its process lives). Reads both from
        where they are written. Rank 0 may host the rendezvous store, so it waits until every other survivor has
        read it before returning; None if the store is gone.
        """
        try:
            dead: list[int] = []
            if self.running:
                others = [r for r in range(self.num_workers) if r != self.rank]
                beats = self._beats
                before = {r: beats.add(f"shaky/beat/{r}", 0) for r in others}
                time.sleep(4 * HEARTBEAT_S)
                dead = [r for r in others if beats.add(f"shaky/beat/{r}", 0) == before[r]]
            marks = self.marks
            steps = [int(marks.get(f"shaky/step/{r}")) if marks.check([f"shaky/step/{r}"]) else -1
                     for r in range(self.num_workers)]
            failed = min(dead or range(self.num_workers), key=lambda r: (steps[r], r))
            store = self._rendezvous
            store.set(f"shaky/diagnosed/{self.rank}", "1")
            if self.rank == 0:
                waiting = [f"shaky/diagnosed/{r}" for r in range(1, self.num_workers) if r != failed and r not in dead]
                # Polled, not store.wait: a wait holds the store client, which would stall this rank's heartbeat.
                deadline = time.monotonic() + timeout_s
                while waiting and not store.check(waiting) and time.monotonic() < deadline:
                    time.sleep(0.05)
        except RuntimeError:  # the store went away with its host
            return None
        return failed, steps[failed]

    def close(self) -> None:
        """Stops the heartbeat (before the process group is destroyed)."""
        self._stop.set()
        if self._thread is not None:
            # Waited for: a daemon thread still inside a store call when the interpreter exits aborts the
            # process ("terminate called without an active exception"), which a lossy network made likely.
            self._thread.join(timeout=HEARTBEAT_JOIN_S)
