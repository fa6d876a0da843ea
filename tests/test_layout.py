"""The package's layout: its modules import one another without a cycle, and the network model stays below comm.

The import graph is read from the source with ``ast``, not by importing anything. Every ``import`` and
``from ... import`` statement counts, wherever it is: at module level, inside a function or a method, or
inside ``try``. A function-level import does not fail at import time, but a cycle through one is still a
cycle of dependencies (the two modules cannot be understood, tested or moved apart), and DESIGN.md wants
dependencies to point one way. Imports under ``if TYPE_CHECKING:`` are skipped, since they never run (their
``else:`` branch does run, and counts). Imports made by name through ``importlib`` (``shaky/__init__.py``'s
lazy exports) are not statements and are not seen.

What an edge is, so that a cycle here is a real one:

- ``import a.b.c`` and ``from a.b.c import x`` import ``a.b.c``; ``from a.b import c`` imports ``a.b.c`` when
  that is a module, else (``c`` is a name defined in ``a/b/__init__.py``) ``a.b``; relative imports are
  resolved against the importing module's package.
- Importing ``a.b.c`` first runs the ``__init__`` of every package above it, so it is also an edge to ``a``
  and ``a.b``, except to a package that holds the importing module itself: Python has already started
  that package's ``__init__`` before the module runs, so the implicit import finds it and runs nothing.
- A package's ``__init__`` importing its children is an edge like any other, and so is a child naming its
  own package explicitly (``from shaky.comm import Comm`` inside ``shaky/comm/``). Together these are a
  real cycle: importing the package runs ``__init__``, which imports the child, which asks for a name the
  half-run ``__init__`` may not have defined yet. So they are counted; only the implicit parent import of
  the point above is not.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "shaky"


def _module_names() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__.py``)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth, except those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """For each module of the package, the package's modules it imports, each with the line of the first
    statement that does (see the module docstring for what counts)."""
    modules = _module_names()
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        edges: dict[str, int] = {}

        def add(target: str, line: int, *, name: str = name, package: str = package,
                edges: dict[str, int] = edges) -> None:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                candidate = ".".join(parts[:i])
                if candidate not in modules or candidate == name:
                    continue
                implicit = i < len(parts)
                if implicit and (package == candidate or package.startswith(candidate + ".")):
                    continue   # an enclosing package of the importer: already started, nothing runs
                edges.setdefault(candidate, line)

        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node.lineno)
                continue
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else base, node.lineno)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[tuple[list[str], list[str]]]:
    """Each strongly connected component of more than one module (or a module importing itself), as (its
    modules, one cycle through them: the shortest through its first module, as [m0, m1, ..., m0])."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:   # Tarjan's algorithm (the graph is a few dozen modules: recursion is fine)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, {}):
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)

    cycles = []
    for component in sorted(components):
        members, start = set(component), component[0]
        # Breadth-first from start's successors back to start, inside the component.
        previous: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in previous:
            following = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in members and w not in previous:
                        previous[w] = v
                        following.append(w)
            frontier = following
        path, v = [start], previous[start]
        while v != start:
            path.append(v)
            v = previous[v]
        path.append(start)
        cycles.append((component, path[::-1]))
    return cycles


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    modules = _module_names()
    steps = []
    for a, b in zip(cycle, cycle[1:], strict=False):
        where = modules[a].relative_to(PACKAGE.parent)
        steps.append(f"  {a} -> {b}   ({where}:{graph[a][b]})")
    return "\n".join(steps)


def test_the_import_graph_is_read() -> None:
    """The rules above, on imports the package has today (a check of the reader, not of the layout)."""
    graph = import_graph()
    assert "shaky.geometry" in graph["shaky.network.model"]        # a module-level import
    assert "shaky.network.presets" in graph["shaky.config"]        # inside a method (NetworkConfig.__post_init__)
    assert "shaky.network" in graph["shaky.config"]                # ... which runs shaky/network/__init__.py first
    assert "shaky.config" not in graph["shaky.network.model"]      # only under TYPE_CHECKING
    assert "shaky.comm" not in graph["shaky.comm.sim"]             # its own package: already started
    assert "shaky.comm.sim" in graph["shaky.comm"]                 # a package's __init__ importing a child


def test_no_import_cycle() -> None:
    graph = import_graph()
    cycles = _cycles(graph)
    message = "\n\n".join(f"{', '.join(component)} import one another; for example {' -> '.join(cycle)}:\n"
                          f"{_describe(cycle, graph)}" for component, cycle in cycles)
    assert not cycles, f"{len(cycles)} group(s) of shaky's modules import one another in a circle:\n\n{message}"


def test_network_does_not_import_comm() -> None:
    """The network model is data below comm/ (DESIGN.md): what both need is in shaky.geometry."""
    graph = import_graph()
    bad = [f"{m} imports {t} (line {line})" for m, edges in sorted(graph.items())
           if m.split(".")[:2] == ["shaky", "network"]
           for t, line in sorted(edges.items()) if t.split(".")[:2] == ["shaky", "comm"]]
    assert not bad, "shaky.network must not import shaky.comm:\n" + "\n".join(bad)


def _members(cls: ast.ClassDef) -> list[str]:
    """A Protocol class's members: its annotated attributes and its methods."""
    names = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    return names + [n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_the_comm_protocol_is_data_only() -> None:
    """What a strategy moves between workers, and nothing about membership, progress or observed losses (those
    are shaky.membership's and comm.base.Observed's): at most 8 members."""
    tree = ast.parse((PACKAGE / "comm" / "base.py").read_text())
    comm = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Comm")
    members = _members(comm)
    assert len(members) <= 8, f"the Comm protocol has {len(members)} members: {members}"
    assert not {"on_step", "take_membership", "take_admitted", "welcome", "take_observed"} & set(members), members


def test_nothing_below_the_job_reads_the_environment() -> None:
    """The process environment is read once, by the command line (shaky.job.env.JobEnv), and passed down: nothing
    under comm/ or membership/ reads os.environ or os.getenv."""
    found = []
    for folder in ("comm", "membership"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb") and \
                        isinstance(node.value, ast.Name) and node.value.id == "os":
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, "reads the process environment: " + ", ".join(found)


def test_the_command_line_parses_and_dispatches() -> None:
    """cli.py stays small and imports nothing of comm's internals: a rank's life is shaky.job's."""
    text = (PACKAGE / "cli.py").read_text()
    assert len(text.splitlines()) < 600, f"cli.py has {len(text.splitlines())} lines"
    graph = import_graph()
    assert not [t for t in graph["shaky.cli"] if t.startswith("shaky.comm")], graph["shaky.cli"]


def test_no_comm_chooses_its_control_plane() -> None:
    """The udp comm is given its control plane (comm.udp.control): no comm asks which one it has (the branches
    ``self._quorum is None`` chose between two control planes in 15 places)."""
    found = []
    for path in sorted((PACKAGE / "comm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                sides = [node.left, *node.comparators]
                names = {s.attr for s in sides if isinstance(s, ast.Attribute)}
                if names & {"_quorum", "quorum", "control", "_control", "agreement"}:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, "a comm chooses between control planes at " + ", ".join(found)


def test_every_backend_averages_by_the_one_rule() -> None:
    """RPS's rule is written once (comm/rps.py): the simulator, gloo and udp all call it."""
    graph = import_graph()
    for backend in ("shaky.comm.sim", "shaky.comm.gloo", "shaky.comm.udp.exchange"):
        assert "shaky.comm.rps" in graph[backend], f"{backend} does not use shaky.comm.rps"
