"""Tables and plots from run directories and sweeps, and the claims check behind REPRODUCTION.md."""

from __future__ import annotations

import json
import math
import os
import textwrap
from pathlib import Path
from typing import Any, Callable, Sequence

from shaky.claims import DEFAULT_METRIC, _metric, measure, names_in
from shaky.rundir import METRICS_FILE, SUMMARY_FILE, read_metrics, read_summary
from shaky.sweep import SWEEP_FILE, _label, load_saved_sweep, point_name
from shaky.sweep_spec import _DEFAULT_METRIC, _matches, _selected

_COLUMNS = (
    ("run", "{}"), ("final acc", "{:.4f}"), ("test loss", "{:.4f}"), ("consensus", "{:.3g}"),
    ("MB sent", "{:.1f}"), ("dropped", "{:d}"), ("sim s", "{:.2f}"), ("wall s", "{:.1f}"),
)


_TABLE_KEYS = ("final_test_accuracy", "final_test_loss", "consensus_distance", "bytes_sent", "messages_dropped",
               "sim_time_s", "wall_time_s")
"""The summary keys of :func:`table`'s columns after the name."""
_CURVE_KEYS = ("step", "test_accuracy", "test_loss", "sim_time_s", "bytes_sent")
"""The metrics.jsonl keys the accuracy and loss curves read."""


def summary_row(name: str, summary: dict[str, Any]) -> list[str]:
    values = [name, summary["final_test_accuracy"], summary["final_test_loss"], summary["consensus_distance"],
              None if summary["bytes_sent"] is None else summary["bytes_sent"] / 1e6, summary["messages_dropped"],
              summary["sim_time_s"], summary["wall_time_s"]]
    # None: not finite (a diverged run's loss) or not measured.
    return [("-" if v is None else fmt.format(int(v) if fmt == "{:d}" else v))
            for (_, fmt), v in zip(_COLUMNS, values)]


def _check_numbers(path: Path, row: dict[str, Any], keys: Sequence[str], where: str = "") -> None:
    """ValueError naming ``path`` unless each of ``keys`` is in ``row`` as a number or null."""
    for key in keys:
        if key not in row:
            raise ValueError(f"{path}: {where}{key} is missing (the file is damaged or not a shaky run's)")
        v = row[key]
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"{path}: {where}{key} must be a number, got {v!r}")


def load_summary(run_dir: Path, keys: Sequence[str] = _TABLE_KEYS) -> dict[str, Any]:
    """A run's summary.json, checked to hold ``keys`` as numbers (ValueError naming the file)."""
    summary = read_summary(run_dir)
    _check_numbers(run_dir / SUMMARY_FILE, summary, keys)
    return summary


def load_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl, checked to hold the numbers the curves plot (ValueError naming the file)."""
    rows = read_metrics(run_dir)
    for row in rows:
        _check_numbers(run_dir / METRICS_FILE, row, _CURVE_KEYS, f"the row of step {row['step']!r}: ")
    return rows


def table(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """A Markdown table of run summaries, aligned for reading in a terminal too; with a test perplexity column
    after the loss where a run predicts next tokens (``final_test_perplexity``)."""
    body = [[c for c, _ in _COLUMNS]] + [summary_row(name, s) for name, s in rows]
    if any(s.get("final_test_perplexity") is not None for _, s in rows):
        for row, (_, summary) in zip(body, [("", {}), *rows]):
            ppl = summary.get("final_test_perplexity")
            row.insert(3, "perplexity" if not summary else "-" if ppl is None else f"{ppl:.4g}")
    widths = [max(len(r[i]) for r in body) for i in range(len(body[0]))]
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
    loaded = [load_metrics(run_dir) for _, run_dir in runs]  # every file checked before anything is drawn
    for k, ((name, _), rows) in enumerate(zip(runs, loaded)):
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


# ---------------------------------------------------------------------------
# Sweeps: plots, tables and claims from the runs of ``shaky sweep``.

_LABELS: dict[str, tuple[str, float, str]] = {
    # summary key -> (axis or column label with its unit, scale factor, number format)
    "final_test_accuracy": ("final test accuracy (%)", 100.0, "{:.2f}"),
    "final_worker_test_accuracy": ("final worker test accuracy (%)", 100.0, "{:.2f}"),
    "final_test_loss": ("final test loss (cross-entropy)", 1.0, "{:.4f}"),
    "final_train_loss": ("final train loss (cross-entropy)", 1.0, "{:.4f}"),
    "final_test_perplexity": ("final test perplexity (exp of the loss per token)", 1.0, "{:.4g}"),
    "consensus_distance": ("consensus distance (mean squared L2 to the average)", 1.0, "{:.3g}"),
    "sim_time_s": ("simulated time (s)", 1.0, "{:.3g}"),
    "bytes_sent": ("sent (MB)", 1e-6, "{:.1f}"),
    "messages_dropped": ("messages dropped", 1.0, "{:.0f}"),
    "comm_rounds": ("communication rounds", 1.0, "{:.0f}"),
    "rounds_to_target": ("communication rounds to the target accuracy", 1.0, "{:.1f}"),
    "coverage": ("coverage (fraction of samples on live workers)", 1.0, "{:.3f}"),
    "scalability": ("scalability (throughput / W x one worker's)", 1.0, "{:.4f}"),
    "exchange_s": ("one exchange (s)", 1.0, "{:.3f}"),
    "period": ("period d", 1.0, "{:.0f}"),
    "delay": ("delay t", 1.0, "{:.0f}"),
    "wall_time_s": ("wall time (s)", 1.0, "{:.1f}"),
}
_DEFAULT_TABLE = {"train": ("final_test_accuracy", "final_test_loss", "consensus_distance", "sim_time_s",
                            "bytes_sent", "messages_dropped"),
                  "scale": ("scalability", "exchange_s", "period", "delay")}
def _label_of(value: Any, labels: dict[str, str] | None = None) -> str:
    """A grid value as legend or table text (``labels`` maps the run-name form of a value to text)."""
    key = _label(value)
    if labels and key in labels:
        return labels[key]
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return "; ".join(", ".join(f"{k} {v}" for k, v in item.items()) for item in value)
    if isinstance(value, dict):
        if len(value) == 1:
            return _label(next(iter(value.values())))
        return ", ".join(f"{k} {_label(v)}" for k, v in value.items())
    return key


def partner(point: Any, baseline: dict[str, Any]) -> str:
    """The run name of ``point``'s partner: its grid values with the baseline's in their place."""
    return point_name({k: baseline.get(k, v) for k, v in point.params.items()})


def _groups(points: Sequence[Any], keys: Sequence[str]) -> list[tuple[tuple[Any, ...], list[Any]]]:
    """Points grouped by their values at ``keys``, in grid order."""
    out: list[tuple[tuple[Any, ...], list[Any]]] = []
    for p in points:
        key = tuple(p.params[k] for k in keys)
        for existing, members in out:
            if existing == key:
                members.append(p)
                break
        else:
            out.append((key, [p]))
    return out


class SweepRuns:
    """A sweep and the summaries of its finished runs."""

    def __init__(self, sweep_dir: Path) -> None:
        """Reads the sweep and every finished run's summary (and, for a training sweep, metrics), checking
        each file holds what the tables, plots and claims read: ValueError naming the file otherwise."""
        self.dir = Path(sweep_dir)
        try:
            self.sweep = load_saved_sweep(self.dir)
        except (ValueError, TypeError) as exc:
            where = str(self.dir / SWEEP_FILE)
            raise ValueError(str(exc) if where in str(exc) else f"{where}: {exc}") from None
        keys = self._summary_keys()
        self.summaries: dict[str, dict[str, Any]] = {}
        self.metrics: dict[str, list[dict[str, Any]]] = {}
        for p in self.sweep.points:
            run_dir = self.dir / p.name
            if (run_dir / SUMMARY_FILE).is_file():
                self.summaries[p.name] = load_summary(run_dir, keys)
                if self.sweep.kind == "train":
                    self.metrics[p.name] = load_metrics(run_dir)

    def _summary_keys(self) -> list[str]:
        """The summary keys this sweep's table, plots and claims read."""
        sweep = self.sweep
        metrics = [*(sweep.table or _DEFAULT_TABLE[sweep.kind]),
                   *(spec.get("metric", _DEFAULT_METRIC[sweep.kind]) for spec in sweep.plots
                     if spec.get("kind") != "curves"),
                   *(spec.get("metric", DEFAULT_METRIC) for claim in sweep.claims
                     for spec in claim["values"].values() if isinstance(spec, dict))]
        return sorted({name for m in metrics for name in names_in(m, f"metric {m!r}")})

    @property
    def missing(self) -> int:
        return len(self.sweep.points) - len(self.summaries)

    def select(self, where: dict[str, Any]) -> list[dict[str, Any] | None]:
        return [self.summaries.get(p.name) for p in self.sweep.points if _matches(p, where)]

    def pairs(self, where: dict[str, Any], baseline: dict[str, Any] | None
              ) -> list[tuple[dict[str, Any] | None, dict[str, Any] | None]]:
        """Each matching run's summary and its baseline partner's (None without a baseline or not finished)."""
        return [(self.summaries.get(p.name), self.summaries.get(partner(p, baseline)) if baseline else None)
                for p in self.sweep.points if _matches(p, where)]

    def varying(self) -> list[str]:
        """The grid keys that tell runs apart in a table or legend (all but the seed)."""
        return [k for k, values in self.sweep.grid if k != "seed" and len(values) > 1] or \
            [k for k, _ in self.sweep.grid if k != "seed"][:1]


def _metric_values(summaries: Sequence[dict[str, Any]], metric: str) -> list[float]:
    return [_metric(s, metric, metric) for s in summaries]


def _fmt_stat(xs: Sequence[float], metric: str) -> str:
    label, factor, fmt = _LABELS.get(metric, (metric, 1.0, "{:.4g}"))
    xs = [x * factor for x in xs]
    if not xs:
        return "-"
    mean = sum(xs) / len(xs)
    text = fmt.format(mean)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    if fmt.format(sd) != fmt.format(0.0):  # no "± 0.0" for what only float rounding tells apart
        text += " ± " + fmt.format(sd)
    return text


_COLUMN_NAMES = {"final_test_accuracy": "final acc (%)", "final_worker_test_accuracy": "worker acc (%)",
                 "final_test_loss": "test loss", "final_train_loss": "train loss", "consensus_distance": "consensus",
                 "final_test_perplexity": "perplexity",
                 "sim_time_s": "sim s", "bytes_sent": "MB sent", "messages_dropped": "dropped",
                 "rounds_to_target": "rounds to target", "wall_time_s": "wall s", "exchange_s": "exchange s",
                 "period": "d", "delay": "t"}


def _column(metric: str) -> str:
    return _COLUMN_NAMES.get(metric, metric)


def sweep_table(runs: SweepRuns) -> str:
    """One row per setting of the varying grid keys: the mean ± sd over the rest (the seeds). The default columns
    have the test perplexity after the loss where the runs predict next tokens (as :func:`summary_table`)."""
    keys = runs.varying()
    metrics = list(runs.sweep.table or _DEFAULT_TABLE[runs.sweep.kind])
    if (not runs.sweep.table and "final_test_loss" in metrics
            and any(s.get("final_test_perplexity") is not None for s in runs.summaries.values())):
        metrics.insert(metrics.index("final_test_loss") + 1, "final_test_perplexity")
    header = keys + ["runs"] + [_column(m) for m in metrics]
    body = []
    for key, members in _groups(runs.sweep.points, keys):
        found = [runs.summaries[p.name] for p in members if p.name in runs.summaries]
        body.append([_label_of(v, runs.sweep.labels.get(k)) for k, v in zip(keys, key)] +
                    [f"{len(found)}/{len(members)}"] +
                    [_fmt_stat(_metric_values(found, m), m) for m in metrics])
    return _markdown([header] + body)


def _markdown(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _pyplot() -> Any:
    import matplotlib  # noqa: PLC0415 (plotting is optional work; keep imports off the training path)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    plt.rcParams.update({"font.size": 8, "axes.titlesize": 9, "legend.fontsize": 7})
    return plt


def _line_label(keys: Sequence[str], values: Sequence[Any], labels: dict[str, dict[str, str]]) -> str:
    if len(keys) == 1:
        return _label_of(values[0], labels.get(keys[0]))
    return ", ".join(f"{k.split('.')[-1]} {_label_of(v, labels.get(k))}" for k, v in zip(keys, values))


def plot_curves(series: Sequence[tuple[str, Sequence[Path]]], out: Path, title: str = "",
                legend_title: str = "", metrics: Callable[[Path], list[dict[str, Any]]] = load_metrics) -> Path:
    """Test accuracy and loss of the averaged model against steps, simulated seconds and bytes sent.

    Each series is a label and the run directories averaged into its line (the seeds);
    x values are averaged too, since simulated time and bytes differ a little per seed.
    ``metrics(run_dir)`` gives a run's metrics rows (by default read and checked here).
    """
    loaded = [[metrics(d) for d in dirs] for _, dirs in series]  # every file checked before anything is drawn
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(10, 5.4), constrained_layout=True, sharey="row")
    xs = (("step", 1.0, "training step"), ("sim_time_s", 1.0, "simulated time (s)"),
          ("bytes_sent", 1e-6, "sent by all workers (MB)"))
    ys = (("test_accuracy", 100.0, "test accuracy (%)"), ("test_loss", 1.0, "test loss (cross-entropy, log scale)"))
    styles = ("-", "--", "-.", ":")
    final_times = []
    for k, ((label, _), rows) in enumerate(zip(series, loaded)):
        n = min(len(r) for r in rows)
        if n == 0:
            continue

        def mean(key: str, factor: float) -> list[float]:
            return [factor * sum(math.nan if r[i][key] is None else float(r[i][key]) for r in rows) / len(rows)
                    for i in range(n)]

        final_times.append(mean("sim_time_s", 1.0)[-1])
        for row, (ykey, yfactor, _) in enumerate(ys):
            yv = mean(ykey, yfactor)
            for col, (xkey, xfactor, _) in enumerate(xs):
                xv = mean(xkey, xfactor)
                pts = [(x, y) for x, y in zip(xv, yv) if math.isfinite(y) and (col == 0 or x > 0)]
                if pts:
                    axes[row][col].plot(*zip(*pts), linestyle=styles[k % len(styles)], marker=".", markersize=3,
                                        linewidth=1.2, color=f"C{k % 10}", label=label if row == col == 0 else None)
    log_time = bool(final_times) and min(final_times) > 0 and max(final_times) / min(final_times) > 20
    for col, (_, _, xlabel) in enumerate(xs):
        axes[1][col].set_xlabel(xlabel + (" (log scale)" if col == 1 and log_time else ""))
        for row in range(2):
            if col == 1 and log_time:
                axes[row][col].set_xscale("log")
            axes[row][col].grid(alpha=0.3)
    for row, (_, _, ylabel) in enumerate(ys):
        axes[row][0].set_ylabel(ylabel)
    axes[1][0].set_yscale("log")
    _plain_log_ticks(axes[1][0].yaxis)
    seeds = {len(d) for _, d in series}
    note = f"mean of {seeds.pop()} seeds, " if len(seeds) == 1 and max(len(d) for _, d in series) > 1 else ""
    note = f" ({note}metrics of the averaged model)"
    fig.legend(loc="outside lower center", ncols=min(4, max(1, len(series))), title=legend_title or None)
    fig.suptitle(textwrap.fill((title + note).strip(), 110))
    return _save(fig, plt, out)


def _plain_log_ticks(axis: Any) -> None:
    """Ticks at 1, 2, 5 x 10^k written as plain numbers (0.2, 0.5, 1) instead of powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: PLC0415

    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _save(fig: Any, plt: Any, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def plot_final(runs: SweepRuns, spec: dict[str, Any], out: Path) -> Path:
    """A final metric against one grid key, one line per value of ``lines``: the mean, and min-max over the rest.

    With ``baseline``, each run shows its metric minus its baseline partner's (paired, seed by seed).
    """
    plt = _pyplot()
    sweep = runs.sweep
    x_key = spec["x"]
    metric = spec.get("metric", _DEFAULT_METRIC[sweep.kind])
    default_label, factor, _ = _LABELS.get(metric, (metric, 1.0, ""))
    line_keys = [spec["lines"]] if isinstance(spec.get("lines"), str) else list(spec.get("lines", []))
    labels = sweep.labels
    baseline = spec.get("baseline")
    points = [p for p in sweep.points if _selected(p, spec)]
    x_values = list(dict.fromkeys(_freeze(p.params[x_key]) for p in points))
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in x_values)
    fig, ax = plt.subplots(figsize=(5.6, 3.6), constrained_layout=True)
    markers = "osd^vP*X"
    spread = False
    for k, (line, members) in enumerate(_groups(points, line_keys)):
        xs, means, lows, highs = [], [], [], []
        for i, xv in enumerate(x_values):
            vals = []
            for p in members:
                ref = partner(p, baseline) if baseline else None
                if _freeze(p.params[x_key]) != xv or p.name not in runs.summaries or \
                        (ref is not None and ref not in runs.summaries):
                    continue
                v = _metric_values([runs.summaries[p.name]], metric)[0]
                if ref is not None:
                    v -= _metric_values([runs.summaries[ref]], metric)[0]
                if math.isfinite(v):
                    vals.append(v * factor)
            if not vals:
                continue
            xs.append(xv if numeric else i)
            means.append(sum(vals) / len(vals))
            lows.append(min(vals))
            highs.append(max(vals))
            spread = spread or len(vals) > 1
        if not xs:
            continue
        label = _line_label(line_keys, line, labels) if line_keys else None
        ax.plot(xs, means, marker=markers[k % len(markers)], linestyle=("-", "--", "-.", ":")[k % 4], linewidth=1.3,
                markersize=4, color=f"C{k % 10}", label=label)
        if any(h > lo for h, lo in zip(highs, lows)):
            ax.errorbar(xs, means, yerr=[[m - lo for m, lo in zip(means, lows)], [h - m for m, h in zip(means, highs)]],
                        fmt="none", ecolor=f"C{k % 10}", elinewidth=1, capsize=3, alpha=0.8)
    if not numeric:
        ax.set_xticks(range(len(x_values)), [_label_of(_thaw(v), labels.get(x_key)) for v in x_values])
    for axis, setter in (("xscale", ax.set_xscale), ("yscale", ax.set_yscale)):
        scale = spec.get(axis, "linear")
        if scale == "log2":
            setter("log", base=2)
        elif scale == "log":
            setter("log")
    if numeric and (spec.get("xscale", "linear") != "linear" or
                    (len(x_values) <= 6 and all(float(v).is_integer() for v in x_values))):
        ax.set_xticks(x_values, [f"{v:g}" for v in x_values])
        ax.minorticks_off()
    if spec.get("yscale", "linear") != "linear":
        _plain_log_ticks(ax.yaxis)
    ax.set_xlabel(spec.get("xlabel", x_key))
    if baseline:
        ax.axhline(0.0, color="0.5", linewidth=0.8)
        default_label = f"change in {default_label}\nfrom {', '.join(f'{k} = {v}' for k, v in baseline.items())}"
    ax.set_ylabel(spec.get("ylabel", default_label))
    ax.grid(alpha=0.3)
    if line_keys:
        ax.legend(title=", ".join(line_keys), loc="best")
    title = textwrap.fill(spec.get("title", sweep.name), 64)
    ax.set_title(title + ("\n(mean over seeds; bars: min to max)" if spread else ""))
    return _save(fig, plt, out)


def _freeze(value: Any) -> Any:
    """A hashable, comparable form of a grid value (tables and lists as JSON text)."""
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value


def _thaw(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def sweep_plots(runs: SweepRuns, out_dir: Path) -> list[tuple[str, Path]]:
    """Every plot the sweep asks for (or, if none, its curves), as (title, PNG path)."""
    sweep = runs.sweep
    specs = list(sweep.plots) or ([{"kind": "curves"}] if sweep.kind == "train" else
                                  [{"kind": "final", "x": next(k for k, _ in sweep.grid)}])
    made = []
    for k, spec in enumerate(specs):
        out = out_dir / f"{sweep.name}-{spec.get('name', spec['kind'] + str(k))}.png"
        title = spec.get("title", sweep.name)
        if not any(_selected(p, spec) and p.name in runs.summaries for p in sweep.points):
            continue  # nothing finished to show (or a grid narrowed by --set)
        if spec["kind"] == "curves":
            keys = ([spec["lines"]] if isinstance(spec.get("lines"), str) else list(spec.get("lines", []))) \
                or [key for key in runs.varying() if key not in spec.get("where", {})]
            points = [p for p in sweep.points if _selected(p, spec) and p.name in runs.summaries]
            series = [(_line_label(keys, key, sweep.labels), [runs.dir / p.name for p in members])
                      for key, members in _groups(points, keys)]
            made.append((title, plot_curves(series, out, title, ", ".join(keys),
                                            metrics=lambda d: runs.metrics[d.name])))
        else:
            made.append((title, plot_final(runs, spec, out)))
    return made


def find_runs(path: Path) -> list[Path]:
    """``path`` if it is a run directory, else the run directories directly inside it."""
    if (path / SUMMARY_FILE).is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_dir() and (p / SUMMARY_FILE).is_file())


def _rel(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()


def _one_line(text: str) -> str:
    return " ".join(text.split())


def write_report(dirs: Sequence[Path], out_dir: Path, reproduction: Path | None = None) -> dict[str, Any]:
    """Plots in ``out_dir`` and a Markdown page: ``out_dir/report.md``, or with ``reproduction`` the claims
    page (REPRODUCTION.md) at that path, which then takes sweep directories only.

    Every input file is read and checked before anything is written: a damaged one is a ValueError naming it,
    and leaves ``out_dir`` as it was.

    Returns what was written: ``report`` (the Markdown file), ``plots``, ``verdicts``, ``missing`` runs.
    """
    sweeps, loose = [], []
    for d in dirs:
        if (d / SWEEP_FILE).is_file():
            sweeps.append(SweepRuns(d))
        else:
            loose.extend(find_runs(d))
    if reproduction is not None and loose:
        raise ValueError(f"--reproduction reads sweep directories only; {str(loose[0])!r} is a plain run "
                         "(report it without --reproduction)")
    loose_runs = {d: (load_summary(d), load_metrics(d)) for d in loose}
    sections, plots, verdicts, missing = [], [], [], 0
    for runs in sweeps:
        made = sweep_plots(runs, out_dir)
        plots.extend(p for _, p in made)
        found = [measure(c, runs.pairs) for c in runs.sweep.claims]
        verdicts.extend((runs, v) for v in found)
        missing += runs.missing
        sections.append((runs, made, sweep_table(runs)))
    if loose:
        names = [d.name for d in loose]
        png = plot_curves([(n, [d]) for n, d in zip(names, loose)], out_dir / "runs-curves.png", "runs",
                          metrics=lambda d: loose_runs[d][1])
        plots.append(png)
        loose_table = table([(n, loose_runs[d][0]) for n, d in zip(names, loose)])
    # With a claims page the tables and plots live there; report.md is for everything else.
    report_md = reproduction or out_dir / "report.md"
    lines = ["# shaky report", ""]
    if verdicts:
        lines += ["## Claims", "", _claims_table(verdicts, out_dir), ""]
    for runs, made, text in sections:
        lines += [f"## {runs.sweep.name}", "", _one_line(runs.sweep.description), "", text, ""]
        lines += [f"![{title}]({_rel(png, out_dir)})" for title, png in made] + [""]
    if loose:
        lines += ["## Runs", "", loose_table, "", f"![runs]({_rel(png, out_dir)})", ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    if reproduction is not None:
        write_reproduction(sections, verdicts, reproduction)
    else:
        report_md.write_text("\n".join(lines))
    return {"report": report_md, "plots": plots, "verdicts": [v for _, v in verdicts], "missing": missing}


def _verdict_text(v: Any) -> str:
    if v.holds is None:
        return f"not measured ({v.why})"
    return "holds" if v.holds else f"**does not hold**: {v.why}"


def _claims_table(verdicts: Sequence[tuple[SweepRuns, Any]], where: Path) -> str:
    rows = [["claim", "paper", "ours (measured here)", "verdict"]]
    for runs, v in verdicts:
        source = Path(runs.sweep.source)
        link = f"[{source.name}]({_rel(source, where)})" if source.exists() else source.name
        rows.append([f"**{v.title}** ({link})", _one_line(v.paper), _one_line(v.ours), _verdict_text(v)])
    body = ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    body.insert(1, "|---|---|---|---|")
    return "\n".join(body)


def _grid_text(sweep: Any) -> str:
    return " × ".join(f"`{k}` ∈ {{{', '.join(_label_of(v, sweep.labels.get(k)) for v in values)}}}"
                      for k, values in sweep.grid)


def write_reproduction(sections: Sequence[tuple[SweepRuns, list[tuple[str, Path]], str]],
                       verdicts: Sequence[tuple[SweepRuns, Any]], path: Path) -> Path:
    """REPRODUCTION.md: one row per claim (paper, ours, verdict), then each experiment with its plots and table."""
    import datetime  # noqa: PLC0415

    where = path.parent
    total = sum(len(r.summaries) for r, _, _ in sections)
    wall = sum(float(s.get("wall_time_s") or 0.0) for r, _, _ in sections for s in r.summaries.values())
    held = sum(1 for _, v in verdicts if v.holds)
    lines = [
        "# Reproducing the papers' claims", "",
        "<!-- Written by `shaky report` (`make reproduce`) from the runs; do not edit by hand. -->", "",
        "Each claim of the three papers (RPS: Yu et al., *Distributed Learning over Unreliable Networks*, ICML "
        "2019; RI-SGD: Haddadpour et al., *Trading Redundancy for Communication*, ICML 2019; DTS: Zhu et al., "
        "*Distributed Training Across the World*) is one experiment file in `experiments/`, run by `shaky sweep` "
        "on a scaled-down setup and checked by `shaky report`; `make reproduce` regenerates this page and its "
        "plots. The paper's column quotes the paper (qualitative where we do not have its exact number); ours is "
        "measured here (mean over seeds, ± the standard deviation where there are several).", "",
        f"Generated {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} from "
        f"{total} runs ({wall / 60:.1f} minutes of run time, summed over processes); "
        f"{held} of {len(verdicts)} claims hold.", "",
        _claims_table(verdicts, where), "",
    ]
    for runs, made, text in sections:
        sweep = runs.sweep
        source = Path(sweep.source)
        lines += [f"## {sweep.name}", "", _one_line(sweep.description), "",
                  f"Source: [{source.as_posix()}]({_rel(source, where)}) ({len(sweep.points)} runs: "
                  f"{_grid_text(sweep)}).", ""]
        for _, v in ((r, v) for r, v in verdicts if r is runs):
            lines.append(f"- **{v.title}**: {_verdict_text(v)}. Ours: {_one_line(v.ours)}."
                         + (f" {_one_line(v.note)}" if v.note else ""))
        lines += ["", text, ""]
        lines += [f"![{title}]({_rel(png, where)})" for title, png in made] + [""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path
