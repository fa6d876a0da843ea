"""What a run tells its user: a progress bar on a terminal, plain lines otherwise (logs, CI, pipes), and
the one-line messages on stderr (``say``)."""

from __future__ import annotations

import sys
from typing import Any


def say(line: str) -> None:
    """Write one line to stderr in a single write.

    ``print(..., file=sys.stderr)`` writes the text and its newline separately (stderr writes through), so two
    ranks that share a terminal or a pipe (``shaky launch``, torchrun) could run their lines into one. One write of
    at most PIPE_BUF (4096) bytes to a pipe is never interleaved with another's."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


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
