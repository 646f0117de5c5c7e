"""dptui's modules import one another without circles, and none reaches into another's private
names: a shared helper lives in a module of its own, under a public name.

Every import counts, at the top or inside a function (a deferred import closes a circle as
surely, only later), and so does one under TYPE_CHECKING (a circle for whoever reads the code).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from import_scan import imports, module_name

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tui", "dpengine")
# Where the rules hold; the rest of dpengine joins the graph, so a circle through it still shows.
CHECKED = ("tui", "dpengine.script")


def project_modules(root: Path) -> dict[str, Path]:
    return {module_name(path, root): path for package in PACKAGES for path in sorted((root / package).rglob("*.py"))}


def within(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports; `from pkg import sub` imports pkg.sub."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for _, source, taken in imports(name, path):
            submodules = {f"{source}.{t}" for t in taken} & modules.keys()
            targets = submodules if submodules and len(submodules) == len(taken) else {source} | submodules
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (first module repeated at the end) per strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [circle_through(group, graph) for group in groups]


def circle_through(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest path from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no circle in {group}")


def circles_found(root: Path) -> list[str]:
    return [" -> ".join(c) for c in cycles(import_graph(project_modules(root))) if any(within(m, CHECKED) for m in c)]


def private_imports(root: Path) -> list[str]:
    modules = project_modules(root)
    found = []
    for name, path in modules.items():
        if not within(name, CHECKED):
            continue
        for line, source, taken in imports(name, path):
            if source == name or not within(source, PACKAGES):
                continue
            private = [t for t in taken if t.startswith("_") and not (t.startswith("__") and t.endswith("__"))]
            found += [f"{path.relative_to(root)}:{line}: from {source} import {t}" for t in private]
    return found


def test_no_import_circles():
    assert circles_found(ROOT) == []


def test_no_module_imports_another_modules_private_names():
    assert private_imports(ROOT) == []


def test_the_checks_see_a_deferred_circle_and_a_private_import(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "tui" / "a.py").write_text("from . import b\n")
    (tmp_path / "tui" / "b.py").write_text("import tui.c\n")
    (tmp_path / "tui" / "c.py").write_text("def f():\n    from .a import _helper, __doc__\n")
    assert circles_found(tmp_path) == ["tui.a -> tui.b -> tui.c -> tui.a"]
    assert private_imports(tmp_path) == ["tui/c.py:2: from tui.a import _helper"]


def test_a_circle_through_the_engine_core_counts(tmp_path):
    # dpengine/script may import the core; only a way back to the script module is a circle.
    (tmp_path / "tui").mkdir()
    (tmp_path / "dpengine" / "script").mkdir(parents=True)
    (tmp_path / "dpengine" / "core.py").write_text("from .script import hooks\n")
    (tmp_path / "dpengine" / "other.py").write_text("from . import core\n")
    (tmp_path / "dpengine" / "script" / "hooks.py").write_text("def f():\n    from ..core import g\n")
    assert circles_found(tmp_path) == ["dpengine.core -> dpengine.script.hooks -> dpengine.core"]
