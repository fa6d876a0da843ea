"""Tables and plots from run directories."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from shaky.train import read_metrics

_COLUMNS = (
    ("run", "{}"), ("final acc", "{:.4f}"), ("test loss", "{:.4f}"), ("consensus", "{:.3g}"),
    ("MB sent", "{:.1f}"), ("dropped", "{:d}"), ("sim s", "{:.2f}"), ("wall s", "{:.1f}"),
)


def summary_row(name: str, summary: dict[str, Any]) -> list[str]:
    values = [name, summary["final_test_accuracy"], summary["final_test_loss"], summary["consensus_distance"],
              summary["bytes_sent"] / 1e6, summary["messages_dropped"], summary["sim_time_s"],
              summary["wall_time_s"]]
    return [fmt.format(v) for (_, fmt), v in zip(_COLUMNS, values)]


def table(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """A Markdown table of run summaries, aligned for reading in a terminal too."""
    body = [[c for c, _ in _COLUMNS]] + [summary_row(name, s) for name, s in rows]
    widths = [max(len(r[i]) for r in body) for i in range(len(_COLUMNS))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(r, widths)) + " |" for r in body]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def plot_accuracy(runs: Sequence[tuple[str, Path]], out: Path, title: str = "") -> Path:
    """Test accuracy of the averaged model against steps and against simulated seconds."""
    import matplotlib  # noqa: PLC0415 (plotting is optional work; keep imports off the training path)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax_steps, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    styles = ("-", "--", "-.", ":")
    for k, (name, run_dir) in enumerate(runs):
        rows = read_metrics(run_dir)
        acc = [100 * r["test_accuracy"] for r in rows]
        style = {"linestyle": styles[k % len(styles)], "marker": ".", "label": name}
        ax_steps.plot([r["step"] for r in rows], acc, **style)
        timed = [(r["sim_time_s"], a) for r, a in zip(rows, acc) if r["sim_time_s"] > 0]
        ax_time.plot(*zip(*timed), **style)
    ax_steps.set_xlabel("training step")
    ax_time.set_xlabel("simulated wall-clock time (s, log scale)")
    ax_time.set_xscale("log")
    for ax in (ax_steps, ax_time):
        ax.set_ylabel("test accuracy of the averaged model (%)")
        ax.grid(alpha=0.3)
    ax_steps.legend(loc="lower right")  # the same lines on both panels: one legend
    if title:
        fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
