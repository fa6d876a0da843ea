"""Claims: a paper's statement turned into numbers measured by a sweep, and a verdict.

A sweep file states each claim it tests as a ``[[claim]]`` table::

    [[claim]]
    id = "rps-drop"
    title = "RPS stays robust as the drop rate grows; gradient averaging does not"
    paper = "comparable convergence up to a drop rate of ~0.3 (qualitative)"
    [claim.values]                      # in order; each is a run aggregate or an expression
    rps_0 = {metric = "final_test_accuracy", where = {"strategy.name" = "rps", "network.drop_rate" = 0.0}}
    rps_3 = {where = {"strategy.name" = "rps", "network.drop_rate" = 0.3}}   # metric defaults to final accuracy
    rps_loss = "rps_0 - rps_3"                       # expressions see every run aggregate
    ours = "rps loses {rps_loss:.2%} at drop 0.3"     # a format string over the values
    holds = ["rps_loss <= 0.01"]                     # every condition must be true

A run aggregate is the mean of ``metric`` (a summary key, or an arithmetic
expression over summary keys such as ``sim_time_s / steps``) over the runs whose
settings match ``where`` (typically the seeds); ``NAME_sd``, ``NAME_min``,
``NAME_max`` and ``NAME_n`` are defined beside it. With ``baseline = {"network.drop_rate" = 0.0}``
each run's metric is taken minus that of its partner with the baseline's grid
values (same seed, same everything else), so the spread is that of paired differences. Expressions allow numbers,
names, + - * /, comparisons, and/or/not, and abs/min/max: nothing else is
evaluated. A claim that does not hold is reported with the conditions that
failed and the values in them.
"""

from __future__ import annotations

import ast
import math
import operator
import string
from dataclasses import dataclass
from typing import Any, Callable, Sequence

DEFAULT_METRIC = "final_test_accuracy"
_CLAIM_KEYS = ("id", "title", "paper", "values", "ours", "holds", "note")
_VALUE_KEYS = ("metric", "where", "baseline")
_STATS = ("sd", "min", "max", "n")
_FUNCS: dict[str, Callable[..., float]] = {"abs": abs, "min": min, "max": max}
_BINOPS: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: lambda a, b: a / b if b else (math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a))}
_CMPOPS: dict[type, Callable[[float, float], bool]] = {
    ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Eq: operator.eq,
    ast.NotEq: operator.ne}


def _parse(expr: str, what: str) -> ast.Expression:
    if not isinstance(expr, str) or not expr.strip():
        raise ValueError(f"{what} must be a non-empty expression string, got {expr!r}")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{what} is not a valid expression: {expr!r}") from None
    for node in ast.walk(tree):
        ok = isinstance(node, (ast.Expression, ast.Name, ast.Load, ast.BinOp, ast.UnaryOp, ast.Compare,
                               ast.BoolOp, ast.And, ast.Or, ast.Not, ast.USub, ast.UAdd, *_BINOPS, *_CMPOPS))
        ok = ok or (isinstance(node, ast.Constant) and isinstance(node.value, (int, float))
                    and not isinstance(node.value, bool))
        ok = ok or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
                    and not node.keywords)
        if not ok:
            raise ValueError(f"{what}: {expr!r} uses {type(node).__name__}; only numbers, names, + - * /, "
                             "comparisons, and/or/not and abs/min/max are allowed")
    return tree


def names_in(expr: str, what: str) -> set[str]:
    """The names an expression reads (function names excluded); ValueError if it is not allowed."""
    tree = _parse(expr, what)
    funcs = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in funcs}


def evaluate(expr: str, names: dict[str, Any], what: str = "expression") -> Any:
    """Evaluates an allowed expression over ``names`` (numbers); a missing name is a ValueError."""
    tree = _parse(expr, what)

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in names:
                raise ValueError(f"{what}: {node.id!r} is not defined (known: {', '.join(sorted(names))})")
            return names[node.id]
        if isinstance(node, ast.BinOp):
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else (not value if isinstance(node.op, ast.Not) else value)
        if isinstance(node, ast.BoolOp):
            values = [ev(v) for v in node.values]
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.Compare):
            left = ev(node.left)
            for op, comp in zip(node.ops, node.comparators):
                right = ev(comp)
                if not _CMPOPS[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.Call):
            return _FUNCS[node.func.id](*(ev(a) for a in node.args))  # type: ignore[attr-defined]
        raise AssertionError(node)  # _parse admitted only the node types above

    return ev(tree)


def _format_fields(text: str) -> set[str]:
    fields = set()
    for _, field, _, _ in string.Formatter().parse(text):
        if field is not None:
            fields.add(field.split(".")[0].split("[")[0])
    return fields


def check_claim(claim: dict[str, Any], k: int, match: Callable[[dict[str, Any]], int],
                known_key: Callable[[str], bool], check_baseline: Callable[[Any, str], None]) -> None:
    """Checks one ``[[claim]]`` table; ``match(where)`` counts the runs a selection matches and
    ``check_baseline(table, what)`` refuses a baseline that does not name grid values."""
    what = f"claim[{k}]"
    unknown = sorted(set(claim) - set(_CLAIM_KEYS))
    if unknown:
        raise ValueError(f"{what}.{unknown[0]} is not a claim setting (known: {', '.join(_CLAIM_KEYS)})")
    for key in ("id", "title", "paper", "ours"):
        if not isinstance(claim.get(key), str) or not claim[key].strip():
            raise ValueError(f"{what}.{key} must be a non-empty string, got {claim.get(key)!r}")
    what = f"claim {claim['id']!r}"
    if "note" in claim and not isinstance(claim["note"], str):
        raise ValueError(f"{what}: note must be a string, got {claim['note']!r}")
    values = claim.get("values")
    if not isinstance(values, dict) or not values:
        raise ValueError(f"{what}: values must be a non-empty table of name -> run aggregate or expression")
    # Run aggregates first, then the expressions in their order (each may use the ones before it).
    defined: set[str] = {f"{n}{s}" for n, spec in values.items() if not isinstance(spec, str)
                         for s in ("", *(f"_{t}" for t in _STATS))}
    for name, spec in values.items():
        if not name.isidentifier() or name in _FUNCS:
            raise ValueError(f"{what}: value name {name!r} must be an identifier other than abs, min, max")
        where = f"{what}: values.{name}"
        if isinstance(spec, str):
            missing = names_in(spec, where) - defined
            if missing:
                raise ValueError(f"{where}: {sorted(missing)[0]!r} is not a run aggregate or an expression "
                                 "before it")
            defined.add(name)
            continue
        if not isinstance(spec, dict):
            raise ValueError(f"{where} must be an expression string or a table with metric and where, got {spec!r}")
        bad = sorted(set(spec) - set(_VALUE_KEYS))
        if bad:
            raise ValueError(f"{where}.{bad[0]} is not a value setting (known: {', '.join(_VALUE_KEYS)})")
        if "baseline" in spec:
            check_baseline(spec["baseline"], f"{where}.baseline")
        names_in(spec.get("metric", DEFAULT_METRIC), f"{where}.metric")
        selection = spec.get("where", {})
        if not isinstance(selection, dict):
            raise ValueError(f"{where}.where must be a table of setting -> value, got {selection!r}")
        for key in selection:
            if not known_key(key):
                raise ValueError(f"{where}.where: {key!r} is not a setting")
        if match(selection) == 0:
            raise ValueError(f"{where}.where = {selection!r} matches no run of the grid")
    missing = _format_fields(claim["ours"]) - defined
    if missing:
        raise ValueError(f"{what}: ours uses {sorted(missing)[0]!r}, which is not a value")
    holds = claim.get("holds")
    if not isinstance(holds, list) or not holds or not all(isinstance(h, str) for h in holds):
        raise ValueError(f"{what}: holds must be a non-empty list of condition strings, got {holds!r}")
    for cond in holds:
        missing = names_in(cond, f"{what}: holds") - defined
        if missing:
            raise ValueError(f"{what}: holds condition {cond!r} uses {sorted(missing)[0]!r}, which is not a value")


@dataclass(frozen=True, slots=True)
class Verdict:
    """A claim measured."""

    id: str
    title: str
    paper: str
    ours: str
    holds: bool | None
    """True, False, or None when runs are missing."""
    why: str
    """Empty when it holds; otherwise the failed conditions with their values, or what is missing."""
    note: str
    values: dict[str, float]


def _metric(summary: dict[str, Any], metric: str, what: str) -> float:
    names = {k: (math.nan if v is None else float(v)) for k, v in summary.items()
             if isinstance(v, (int, float)) or v is None}
    return float(evaluate(metric, names, what))


def _stats(xs: Sequence[float]) -> dict[str, float]:
    n = len(xs)
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return {"": mean, "_sd": sd, "_min": min(xs), "_max": max(xs), "_n": float(n)}


Pairs = Callable[[dict[str, Any], "dict[str, Any] | None"], list[tuple["dict[str, Any] | None", "dict[str, Any] | None"]]]


def measure(claim: dict[str, Any], pairs: Pairs) -> Verdict:
    """Evaluates a checked claim.

    ``pairs(where, baseline)`` returns, for each run matching ``where``, its summary and that of its
    baseline run (the same grid values but for the baseline's), each None where it is not finished.
    """
    what = f"claim {claim['id']!r}"
    names: dict[str, float] = {}
    missing = 0
    aggregates = [(n, spec) for n, spec in claim["values"].items() if not isinstance(spec, str)]
    expressions = [(n, spec) for n, spec in claim["values"].items() if isinstance(spec, str)]
    for name, spec in aggregates:
        baseline = spec.get("baseline")
        found = pairs(spec.get("where", {}), baseline)
        if not found:
            missing += 1  # a grid narrowed by --set has no run for this value
        complete = [(s, b) for s, b in found if s is not None and (baseline is None or b is not None)]
        missing += len(found) - len(complete)
        metric = spec.get("metric", DEFAULT_METRIC)
        label = f"{what}: values.{name}.metric"
        xs = [_metric(s, metric, label) - (_metric(b, metric, label) if b is not None else 0.0)
              for s, b in complete] or [math.nan]
        names.update({name + suffix: v for suffix, v in _stats(xs).items()})
    for name, expr in expressions:
        names[name] = float(evaluate(expr, names, f"{what}: values.{name}"))
    base = {"id": claim["id"], "title": claim["title"], "paper": claim["paper"], "note": claim.get("note", ""),
            "values": names}
    try:
        ours = claim["ours"].format(**names)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{what}: ours {claim['ours']!r} cannot be formatted: {exc}") from None
    if missing:
        return Verdict(**base, ours=ours, holds=None, why=f"not measured: {missing} of its runs are missing")
    failed = []
    for cond in claim["holds"]:
        if not evaluate(cond, names, f"{what}: holds"):
            used = sorted(names_in(cond, "holds"))
            failed.append(f"`{cond}` is false ({', '.join(f'{n} = {names[n]:.4g}' for n in used)})")
    return Verdict(**base, ours=ours, holds=not failed, why="; ".join(failed))
