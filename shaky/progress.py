"""Progress of a run: a bar on a terminal, plain lines otherwise (logs, CI, pipes)."""

from __future__ import annotations

import sys
from typing import Any


class Progress:
    """A progress bar on a terminal, plain lines otherwise (logs, CI, pipes)."""

    def __init__(self, total: int, initial: int, label: str, enabled: bool) -> None:
        self.enabled = enabled
        self.label = label
        self.total = total
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm  # noqa: PLC0415

            self.bar = tqdm(total=total, initial=initial, desc=label, unit="step", leave=False, dynamic_ncols=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def report(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        msg = (f"acc {row['test_accuracy']:.4f} loss {row['test_loss']:.4f} "
               f"consensus {row['consensus_distance']:.3g} sim {row['sim_time_s']:.1f}s")
        if self.bar is not None:
            self.bar.set_postfix_str(msg, refresh=True)
        else:
            print(f"{self.label} step {row['step']}/{self.total} {msg}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
