"""ds_uniep's modules import one another without a cycle.

The graph is built from the sources (``ast``), not by importing: every ``import`` and ``from ...
import`` of a ds_uniep module, at module level and inside functions alike (a function-level import
is a cycle deferred, not avoided), relative and absolute. ``from . import x`` and ``from .pkg
import name`` count as an import of ``x`` and of ``pkg.name`` where those are modules, else of the
package. A package's ``__init__`` is its own node: importing ``ds_uniep.a.b`` runs ``ds_uniep``'s and
``ds_uniep.a``'s ``__init__`` first, but a module that imports a sibling is not made to depend on
the package that holds them both, so only what a file names is an edge.
"""
import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "ds_uniep"


SOURCES = {PACKAGE: PACKAGE, f"{PACKAGE}.ops": "ops"}
"""Package -> its source folder, as setup.cfg's ``package_dir`` maps them (``ds_uniep.ops`` is ``ops/``)."""


def _modules(root: Path) -> Dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file of the packages in :data:`SOURCES`."""
    out = {}
    for package, folder in SOURCES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = package.split(".") + list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out.setdefault(".".join(parts), path)
    return out


def _resolve(module: str, is_package: bool, level: int, name: Optional[str]) -> str:
    """The absolute name ``from <level dots><name>`` means inside ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(module: str, path: Path, known: Set[str]) -> Set[str]:
    """The package's modules that ``module`` imports anywhere in its source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = set()

    def add(name: str) -> None:
        # the module itself, else the closest enclosing module that exists (an attribute's module)
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node.level, node.module)
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                add(sub if sub in known else target)
    return found


def import_graph(root: Path = ROOT) -> Dict[str, Set[str]]:
    mods = _modules(root)
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def find_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle per strongly connected set of modules (more than one module, or a self-import), from
    its smallest name back to it (Tarjan, then a shortest path back), with the set's other modules."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(set(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:
        if len(comp) == 1 and next(iter(comp)) not in graph.get(next(iter(comp)), ()):
            continue
        start = min(comp)
        # shortest path from start back to start inside the component (breadth first)
        prev, frontier, seen = {}, [start], {start}
        end = None
        while frontier and end is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & comp):
                    if w == start:
                        end = v
                        break
                    if w not in seen:
                        seen.add(w)
                        prev[w] = v
                        nxt.append(w)
                if end is not None:
                    break
            frontier = nxt
        path = [end]
        while path[-1] != start:
            path.append(prev[path[-1]])
        cycle = list(reversed(path)) + [start]
        rest = sorted(comp - set(cycle))
        cycles.append(cycle + ([f"(also in this circle: {', '.join(rest)})"] if rest else []))
    return sorted(cycles)


def test_the_graph_sees_the_package():
    """The walk finds the package's modules and their imports (a guard against an empty graph)."""
    graph = import_graph()
    assert "ds_uniep.layer" in graph and "ds_uniep.config" in graph["ds_uniep.layer"]
    assert "ds_uniep.layer" in graph["ds_uniep"]


def test_cycles_are_found_and_named():
    """The finder itself: module-level, function-level and relative imports all make edges."""
    import textwrap

    import tempfile
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        pkg = root / PACKAGE
        (pkg / "sub").mkdir(parents=True)
        files = {"__init__.py": "", "a.py": "from . import b\n",
                 "b.py": "def f():\n    from .sub.c import g\n",
                 "sub/__init__.py": "", "sub/c.py": "import ds_uniep.a\n\ndef g():\n    pass\n",
                 "d.py": "from .sub import c\n"}
        for name, text in files.items():
            (pkg / name).write_text(textwrap.dedent(text))
        graph = import_graph(root)
        assert graph["ds_uniep.d"] == {"ds_uniep.sub.c"}
        assert find_cycles(graph) == [["ds_uniep.a", "ds_uniep.b", "ds_uniep.sub.c", "ds_uniep.a"]]


def test_no_import_cycle_in_the_package():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles in ds_uniep:\n" + "\n".join(" -> ".join(c) for c in cycles)
