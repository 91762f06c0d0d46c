"""The house rules the import graph keeps: no module imports itself back through others, no
package reaches up to one built on it, and no source file grows past 400 lines.

The graph is read from the source with `ast`: every import counts, at module level, inside
a function, or under `if TYPE_CHECKING:` (a type named in an annotation ties two modules as
an import does: a cycle of them is one too).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 400

# The layers, bottom first: a unit (a top-level module, or a package under lucedesk/) may
# import its own modules and units of lower layers, never a unit of its own layer or above.
LAYERS: list[set[str]] = [
    {"lucedesk", "errors", "owner", "isa"},
    {"config", "kernels"},
    {"catalog"},
    {"profile", "engine"},
    {"chat"},
    {"store", "server", "bench"},
    {"agent", "export"},
    {"tui"},
    {"commands"},
    {"agent_cli"},
    {"cli"},
    {"__main__"},
]


def modules(src: Path = SRC) -> dict[str, Path]:
    found = {}
    for path in sorted((src / "lucedesk").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    mods = modules(src)
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # `from pkg import submodule` imports the submodule; a name, the package
                submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = submodules if len(submodules) == len(node.names) else [base, *submodules]
            else:
                continue
            graph[name] |= {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer(name: str) -> int:
    for i, units in enumerate(LAYERS):
        if name in units:
            return i
    raise AssertionError(f"{name!r} is in no layer of tests/test_import_graph.py: place it")


def test_no_module_imports_itself_back():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_runs_back_up_a_layer():
    upward = [
        f"{a} -> {b}"
        for a, targets in sorted(import_graph().items())
        for b in sorted(targets)
        if unit(a) != unit(b) and layer(unit(b)) >= layer(unit(a))
    ]
    assert not upward, "imports of a unit in the same layer or above:\n" + "\n".join(upward)


# Packages whose clients import them by their front door (the package itself) only.
FRONT_DOORS = ("engine", "chat")


def test_clients_import_the_engine_and_chat_layer_by_their_front_doors():
    behind = [
        f"{a} -> {b}"
        for a, targets in sorted(import_graph().items())
        for b in sorted(targets)
        if unit(b) in FRONT_DOORS and unit(a) != unit(b) and b != f"lucedesk.{unit(b)}"
    ]
    assert not behind, "imports of the modules behind a front door:\n" + "\n".join(behind)


def test_no_source_file_over_400_lines():
    long = {
        str(path.relative_to(SRC)): n
        for path in modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_the_checker_sees_a_cycle_through_a_type_checking_import(tmp_path):
    package = tmp_path / "lucedesk"
    (package / "engine").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "engine" / "__init__.py").write_text("from lucedesk.engine.a import A\n")
    (package / "engine" / "a.py").write_text("A = 1\n")
    (package / "engine" / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from lucedesk.engine.c import C\n"
        "def f():\n    from lucedesk.engine import A\n"
    )
    (package / "engine" / "c.py").write_text("from lucedesk.engine.b import f\n")
    graph = import_graph(tmp_path)
    assert graph["lucedesk.engine.b"] == {"lucedesk.engine", "lucedesk.engine.c"}
    assert cycles(graph) == [["lucedesk.engine.b", "lucedesk.engine.c"]]
