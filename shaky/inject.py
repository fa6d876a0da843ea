"""Deterministic fault injection with counters a test can assert on (in the style of torchft's EventInjector).

A :class:`FaultInjector` is handed to the training loop, which calls
``check(step, rank)`` before every step on every rank (both backends run the
same loop). A fault fires at most once, exactly at its step, and is counted;
nothing sleeps and nothing is random. The ``SHAKY_INJECT_FAULT`` environment
variable is the command line's way to make one (``shaky.job.env.JobEnv.inject_fault``, given to
:meth:`FaultInjector.parse`).
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

KINDS = ("exit", "kill", "freeze", "term", "hang", "stop")
ENV_VAR = "SHAKY_INJECT_FAULT"


class InterruptedRun(RuntimeError):
    """Raised by an injected ``stop``: the run ends there, as a killed process would (no final checkpoint)."""


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    """exit: the process exits at once (status 17), as a crash would; kill: it sends itself SIGKILL, as the
    kernel's OOM killer or ``kill -9`` would; freeze: it sends itself SIGSTOP (``kill -CONT`` wakes it up),
    as a machine that stalls would; term: it sends itself SIGTERM (the run then stops after the step, with a
    checkpoint, on every rank), as a scheduler's preemption would; hang: it stops answering, as a stuck
    process would; stop: the run raises InterruptedRun (in-process tests of resume)."""
    step: int
    """The step before which it fires (so ``step`` steps have completed)."""
    rank: int | None = None
    """The rank it hits; None: every rank (the simulator is one rank, 0)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"fault step must be an integer >= 0, got {self.step!r}")
        if self.rank is not None and (isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0):
            raise ValueError(f"fault rank must be an integer >= 0 or None, got {self.rank!r}")


@dataclass
class FaultInjector:
    """Faults at chosen steps, and counters of what was checked and what fired."""

    faults: tuple[Fault, ...] = ()
    fired: Counter[Fault] = field(default_factory=Counter)
    """How many times each fault fired (at most once each)."""
    fired_at: list[tuple[str, int, int]] = field(default_factory=list)
    """(kind, step, rank) of every firing, in order."""
    checks: int = 0
    """How many times the loop asked (one per step and rank)."""

    def check(self, step: int, rank: int = 0) -> None:
        """Called before each step; fires the faults due at ``step`` on ``rank``."""
        self.checks += 1
        for fault in self.faults:
            if fault.step != step or (fault.rank is not None and fault.rank != rank) or self.fired[fault]:
                continue
            self.fired[fault] += 1
            self.fired_at.append((fault.kind, step, rank))
            if fault.kind == "stop":
                raise InterruptedRun(f"stopped after step {step} (injected fault)")
            if fault.kind == "exit":
                os._exit(17)
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind in ("freeze", "term"):
                os.kill(os.getpid(), signal.SIGSTOP if fault.kind == "freeze" else signal.SIGTERM)
                return
            while True:  # hang: this rank stops answering, as a stuck process would
                time.sleep(3600)

    @staticmethod
    def parse(spec: str) -> FaultInjector:
        """``KIND:RANK:STEP`` (e.g. ``exit:2:40``), several separated by commas."""
        faults = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            try:
                kind, rank, step = part.split(":")
                faults.append(Fault(kind, int(step), int(rank)))
            except ValueError:
                raise ValueError(f"{ENV_VAR} must be KIND:RANK:STEP with KIND one of {', '.join(KINDS)} "
                                 f"(e.g. exit:2:40), got {spec!r}") from None
        return FaultInjector(tuple(faults))
