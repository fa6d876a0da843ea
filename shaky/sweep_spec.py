"""What a sweep file's claims, plots and table may say, checked against its grid before anything runs.

Shared by ``shaky.sweep`` (which checks a file when it loads it) and ``shaky.report``
(which draws what it describes); it imports neither.
"""

from __future__ import annotations

from typing import Any, Callable

from shaky.claims import check_claim, names_in

_DEFAULT_METRIC = {"train": "final_test_accuracy", "scale": "scalability"}
_PLOT_KEYS = {"curves": ("kind", "name", "title", "where", "exclude", "lines"),
              "final": ("kind", "name", "title", "where", "exclude", "lines", "x", "metric", "baseline", "xlabel",
                        "ylabel", "xscale", "yscale")}
_SCALES = ("linear", "log", "log2")


def _matches(point: Any, where: dict[str, Any]) -> bool:
    """Whether a run has these settings: a grid key compares with the grid value as written, any other
    dotted key with the resolved setting (so ``strategy.name`` finds a grid axis ``strategy = [{...}]``)."""
    for key, value in where.items():
        try:
            if (point.params[key] if key in point.params else point.get(key)) != value:
                return False
        except KeyError:
            return False
    return True


def _selected(point: Any, spec: dict[str, Any]) -> bool:
    """Whether a plot shows a run: it matches ``where`` and not ``exclude``."""
    exclude = spec.get("exclude", {})
    return _matches(point, spec.get("where", {})) and not (exclude and _matches(point, exclude))


def _check_baseline(sweep: Any, table: Any, what: str) -> None:
    """A baseline names grid keys and values of their axes: every run then has a partner in the grid."""
    grid = dict(sweep.grid)
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{what} must be a table of grid key -> value, got {table!r}")
    for key, value in table.items():
        if key not in grid:
            raise ValueError(f"{what}: {key!r} is not a grid key (grid: {', '.join(grid)})")
        if value not in grid[key] and len(grid[key]) > 1:
            raise ValueError(f"{what}: {key} = {value!r} is not a value of the grid ({list(grid[key])})")


def check_sweep_spec(sweep: Any, known_key: Callable[[str], bool], require_runs: bool = True) -> None:
    """Checks a sweep's claims, plots and table against its grid (ValueError naming the entry).

    ``known_key(key)``: whether a dotted setting exists for the sweep's kind of run. With
    ``require_runs``, every selection (a claim's value, a plot's where) must match a run of the grid.
    """
    grid_keys = [k for k, _ in sweep.grid]

    def count(where: dict[str, Any]) -> int:
        return sum(_matches(p, where) for p in sweep.points) if require_runs else 1

    ids = []
    for k, claim in enumerate(sweep.claims):
        check_claim(claim, k, count, known_key,
                    lambda table, what: _check_baseline(sweep, table, what))
        ids.append(claim["id"])
    if len(set(ids)) != len(ids):
        raise ValueError(f"claim id {next(i for i in ids if ids.count(i) > 1)!r} is used twice")
    names = []
    for k, plot in enumerate(sweep.plots):
        what = f"plot[{k}]"
        kind = plot.get("kind")
        if kind not in _PLOT_KEYS:
            raise ValueError(f"{what}.kind must be one of {', '.join(_PLOT_KEYS)}; got {kind!r}")
        if kind == "curves" and sweep.kind != "train":
            raise ValueError(f"{what}: curves need training runs (kind = \"train\"), not {sweep.kind!r}")
        bad = sorted(set(plot) - set(_PLOT_KEYS[kind]))
        if bad:
            raise ValueError(f"{what}.{bad[0]} is not a {kind} plot setting (known: {', '.join(_PLOT_KEYS[kind])})")
        lines = plot.get("lines", [])
        for key in [lines] if isinstance(lines, str) else lines:
            if key not in grid_keys:
                raise ValueError(f"{what}.lines: {key!r} is not a grid key (grid: {', '.join(grid_keys)})")
        if kind == "final":
            if "baseline" in plot:
                _check_baseline(sweep, plot["baseline"], f"{what}.baseline")
            if plot.get("x") not in grid_keys:
                raise ValueError(f"{what}.x must be a grid key (grid: {', '.join(grid_keys)}), got {plot.get('x')!r}")
            names_in(plot.get("metric", _DEFAULT_METRIC[sweep.kind]), f"{what}.metric")
            for axis in ("xscale", "yscale"):
                if plot.get(axis, "linear") not in _SCALES:
                    raise ValueError(f"{what}.{axis} must be one of {', '.join(_SCALES)}, got {plot[axis]!r}")
        where = plot.get("where", {})
        if not isinstance(where, dict) or count(where) == 0:
            raise ValueError(f"{what}.where = {where!r} matches no run of the grid")
        exclude = plot.get("exclude", {})
        if not isinstance(exclude, dict) or (exclude and count(exclude) == 0):
            raise ValueError(f"{what}.exclude = {exclude!r} matches no run of the grid")
        if require_runs and not any(_selected(p, plot) for p in sweep.points):
            raise ValueError(f"{what}: where and exclude leave no run to plot")
        names.append(plot.get("name", f"{kind}{k}"))
    if len(set(names)) != len(names):
        raise ValueError(f"two plots are named {next(n for n in names if names.count(n) > 1)!r}; give them names")
    for metric in sweep.table:
        names_in(metric, "table")
