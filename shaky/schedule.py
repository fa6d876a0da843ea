"""When exchanges happen: the one place a period, a delay and a warm-up are written.

Every strategy, the model averager, the simulated clock and the scalability
model read their timing from a :class:`Schedule`, so the four can never disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Schedule:
    """Exchanges launched every ``period`` steps, each applied ``delay - 1`` steps after its launch."""

    period: int = 1
    """Launch an exchange at the end of every period-th step (local SGD's tau, DTS's d); 1 = every step."""
    delay: int = 1
    """The exchange launched at the end of step n is applied at the end of step n + delay - 1 (DTS's t);
    1 = synchronous."""
    warmup_steps: int = 0
    """Steps from the first during which an exchange is launched every step, whatever the period
    (PeriodicModelAverager's warm-up)."""

    def __post_init__(self) -> None:
        for name in ("period", "delay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")

    def in_warmup(self, step: int) -> bool:
        return step < self.warmup_steps

    def launches(self, step: int) -> bool:
        """Whether an exchange is launched at the end of ``step`` (steps count from 0)."""
        return step >= 0 and (step < self.warmup_steps or (step + 1) % self.period == 0)

    def launch_index(self, step: int) -> int | None:
        """Which periodic launch (0, 1, ...) happens at the end of ``step``, or None (no warm-up)."""
        return (step + 1) // self.period - 1 if step >= 0 and (step + 1) % self.period == 0 else None

    def due_index(self, step: int) -> int | None:
        """Which launch is applied at the end of ``step`` (launched ``delay - 1`` steps before), or None."""
        return self.launch_index(step - (self.delay - 1))

    @property
    def slots(self) -> int:
        """Launches in flight at once: those of the last t - 1 steps, one every d steps."""
        return math.ceil((self.delay - 1) / self.period)
