"""The code's shape: files and classes of a readable size, no import cycle among kvrag's modules, and
folders that follow the data path, every import pointing down it (ROOMS) and no face importing another.

Function-level imports count as imports: an import moved into a function to dodge a cycle is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# source folder -> the package name it is installed as (pyproject's package-dir)
PACKAGES = {"kvrag": "kvrag", "cache_backends": "kvrag.cache_backends", "integrations": "kvrag.integrations"}
MAX_FILE_LINES = 500
MAX_CLASS_LINES = 300


def source_files() -> dict[str, Path]:
    """Module name -> file, for every .py under the packages (a package's __init__ is the package itself)."""
    out: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if "tests" in parts or "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def test_source_files_are_found():
    files = source_files()
    assert "kvrag" in files and "kvrag.model.cache" in files and "kvrag.cache_backends.disk" in files
    assert "kvrag.integrations.langchain" in files


def oversized() -> list[str]:
    problems = []
    for name, path in source_files().items():
        text = path.read_text(encoding="utf-8")
        n = len(text.splitlines())
        if n > MAX_FILE_LINES:
            problems.append(f"{path.relative_to(ROOT)}: {n} lines (> {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    problems.append(f"{path.relative_to(ROOT)}: class {node.name} {size} lines (> {MAX_CLASS_LINES})")
    return problems



def test_no_file_over_500_lines_and_no_class_over_300():
    problems = oversized()
    print("\n".join(problems) or "sizes: all within limits")
    assert not problems, "\n".join(problems)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against `module`)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Module -> the kvrag modules it imports anywhere in its body (module level or inside functions)."""
    files = source_files()
    known = set(files)
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in known else base)  # `from kvrag.x import y`: y may be a module
            for t in targets:
                # the deepest known module the name points into (`import kvrag.eval.runner` -> kvrag.eval.runner)
                while t and t not in known:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("kvrag"):
                    graph[name].add(t)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module, as a path a -> ... -> a."""
    return [_cycle_in(graph, set(comp)) for comp in tangles(graph)]


def tangles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan): every module of one imports every other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursion depth: the longest import chain
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [sorted(c) for c in components]


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first within the component)."""
    start = min(comp)
    parent: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:  # back at the start: v, parent(v), ..., start reversed, then start again
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])  # type: ignore[arg-type]
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)  # unreachable for a strongly connected component


def test_cycle_finder_reports_a_cycle():
    graph = {"kvrag.a": {"kvrag.b"}, "kvrag.b": {"kvrag.c"}, "kvrag.c": {"kvrag.a"}, "kvrag.d": {"kvrag.a"}}
    assert find_cycles(graph) == [["kvrag.a", "kvrag.b", "kvrag.c", "kvrag.a"]]
    assert find_cycles({"kvrag.a": {"kvrag.b"}, "kvrag.b": set()}) == []


def test_relative_and_submodule_imports_are_resolved():
    node = ast.parse("from ..model.cache import cache_kv").body[0]
    assert _resolve("kvrag.training.passes", False, node) == "kvrag.model.cache"
    assert _resolve("kvrag.training", True, ast.parse("from . import loop").body[0]) == "kvrag.training"
    graph = import_graph()
    assert "kvrag.training.passes" in graph["kvrag.train"]  # `from kvrag.training.passes import ...`
    assert "kvrag.fuse.stitch" in graph["kvrag.training.passes"]



def test_no_import_cycle_among_kvrag_modules():
    graph = import_graph()
    report = [f"{' -> '.join(_cycle_in(graph, set(comp)))}  (tangle of {len(comp)}: {', '.join(comp)})" for comp in tangles(graph)]
    print("\n".join(report) or "imports: no cycle")
    assert not report, "import cycles:\n" + "\n".join(report)


def test_every_package_is_installed():
    """A package folder missing from pyproject's list works in an editable install and breaks in a
    wheel (kvrag.cache_backends.admin once did: `kvrag cache ...` failed with ModuleNotFoundError)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder, package in PACKAGES.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            if "tests" not in parts and "__pycache__" not in parts:
                found.add(".".join([package, *parts]))
    assert found - listed == set(), f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(found - listed)}"


# The rooms, bottom to top: the data path (files -> chunk KV -> stitch -> select -> decode), the request
# assembled from it, then the tools and faces at the edge. A module may import its own room and rooms
# below it, never one above.
ROOMS = [
    ("vocabulary", ["kvrag.errors", "kvrag.types", "kvrag.timing", "kvrag.version", "kvrag.defaults", "kvrag.quiet", "kvrag.chat"]),
    ("storage", ["kvrag.cache_backends"]),
    ("model", ["kvrag.model"]),
    ("ingest", ["kvrag.ingest"]),
    ("kv", ["kvrag.kv"]),
    ("fuse", ["kvrag.fuse", "kvrag.link_adapter"]),
    ("select and decode", ["kvrag.methods", "kvrag.decode"]),
    ("request", ["kvrag.options", "kvrag.pipeline", "kvrag.core"]),
    ("gate", ["kvrag.check"]),
    ("engine", ["kvrag.engine", "kvrag.client"]),
    ("tools", ["kvrag.eval", "kvrag.training"]),
    ("faces", ["kvrag.integrations", "kvrag.server", "kvrag.demo"]),
    ("command line", ["kvrag.cli", "kvrag.train"]),
    ("package", ["kvrag"]),
]
FACES = ["kvrag.integrations", "kvrag.server", "kvrag.demo", "kvrag.cli"]


def room_of(module: str) -> tuple[int, str]:
    """(rank, prefix) of the room a module lives in: the longest prefix that names it."""
    best = None
    for rank, (_, prefixes) in enumerate(ROOMS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (rank, prefix)
    assert best is not None, f"{module} is in no room: add it to ROOMS"
    return best


def test_every_import_points_down_the_data_path():
    """Request order: e.g. kv -> options (for the KIND_* names) once closed a loop kv -> options -> methods -> fuse -> kv."""
    up = []
    for module, targets in import_graph().items():
        rank, _ = room_of(module)
        for t in sorted(targets):
            if room_of(t)[0] > rank:
                up.append(f"{module} ({ROOMS[rank][0]}) -> {t} ({ROOMS[room_of(t)[0]][0]})")
    print("\n".join(up) or "imports: all point down")
    assert not up, "imports running back up:\n" + "\n".join(up)


def test_no_face_imports_another():
    """The server once needed langchain-core because it imported the LangChain integration for two string helpers."""
    crossed = []
    for module, targets in import_graph().items():
        own = next((f for f in FACES if module == f or module.startswith(f + ".")), None)
        for t in targets:
            other = next((f for f in FACES if t == f or t.startswith(f + ".")), None)
            if own and other and other != own and own != "kvrag.cli":  # the command line starts the server and the demo
                crossed.append(f"{module} -> {t}")
    assert not crossed, crossed
