"""The package's import layers: op at the bottom, model on it, tools and runtime side by side,
serve on the runtime; and no import cycle between its modules.

Every import statement counts, those inside a function body too: an import moved into a
function still runs, only later, so it hides a cycle rather than removing it."""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import ort_kvlayout

PACKAGE = Path(ort_kvlayout.__file__).resolve().parent
# subpackage -> the subpackages it may import (the compiled _C sits beside them all)
ALLOWED = {
    "op": set(),
    "model": {"op"},
    "tools": {"op", "model"},
    "runtime": {"op", "model"},
    "serve": {"op", "model", "runtime"},
}


@dataclass(frozen=True)
class Edge:
    """One import statement of module `src` that loads module `dst`."""

    src: str
    dst: str
    line: int
    scope: str  # "module level" or "in f()"

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst} (line {self.line}, {self.scope})"


def _modules(root: Path, name: str) -> dict[str, Path | None]:
    """Dotted name -> source file of every module under package `root`, folders without an
    __init__.py included (a package by its __init__.py; a compiled extension such as _C by None:
    it has no source to read)."""
    found: dict[str, Path | None] = {}
    for path in sorted(root.rglob("*")):
        parts = path.relative_to(root).parts
        if path.suffix == ".py":
            stem = parts[:-1] if path.name == "__init__.py" else (*parts[:-1], path.stem)
            found[".".join((name, *stem))] = path
        elif any(path.name.endswith(s) for s in EXTENSION_SUFFIXES):
            found[".".join((name, *parts[:-1], path.name.split(".")[0]))] = None
    return found


def _imported(
    module: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules: Collection[str]
) -> Iterator[str]:
    """The dotted names an import statement loads: `from pkg import name` loads pkg.name when
    that is a module, else pkg."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield sub if sub in modules else base


class _ImportVisitor(ast.NodeVisitor):
    """The Edges of one module, each with the function it stands in."""

    def __init__(self, module: str, is_package: bool, modules: Collection[str]):
        self.module, self.is_package, self.modules = module, is_package, modules
        self.scopes: list[str] = []
        self.edges: list[Edge] = []

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scopes.append(node.name)
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        scope = f"in {self.scopes[-1]}()" if self.scopes else "module level"
        names = _imported(self.module, self.is_package, node, self.modules)
        for name in dict.fromkeys(names):
            if name in self.modules and name != self.module:
                self.edges.append(Edge(self.module, name, node.lineno, scope))

    visit_Import = visit_ImportFrom = _import


def import_edges(root: Path, name: str) -> list[Edge]:
    """Every import between the modules of package `root` (named `name`), wherever it stands.

    A module's own parent packages are not edges: Python imports them first whichever way, and a
    package whose __init__ imports its children is no cycle."""
    modules = _modules(root, name)
    edges = []
    for module, path in modules.items():
        if path is None:
            continue
        visitor = _ImportVisitor(module, path.name == "__init__.py", modules)
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        edges += visitor.edges
    return edges


def import_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One cycle (its edges in order) through each group of modules that import each other."""
    out: dict[str, list[Edge]] = {}
    for edge in edges:
        out.setdefault(edge.src, []).append(edge)
    cycles: list[list[Edge]] = []
    seen: set[str] = set()
    for start in sorted(out):
        if start in seen:
            continue
        # Depth-first from `start`, keeping the path, until an edge leads back onto it.
        stack: list[tuple[str, Iterator[Edge]]] = [(start, iter(out.get(start, [])))]
        path: list[Edge] = []
        on_path = {start}
        while stack:
            module, pending = stack[-1]
            edge = next(pending, None)
            if edge is None:
                stack.pop()
                on_path.discard(module)
                seen.add(module)
                if path:
                    path.pop()
                continue
            if edge.dst in on_path:
                first = next((i for i, e in enumerate(path) if e.src == edge.dst), len(path))
                cycle = path[first:] + [edge]
                if not any({e.src for e in c} == {e.src for e in cycle} for c in cycles):
                    cycles.append(cycle)
            elif edge.dst not in seen:
                path.append(edge)
                on_path.add(edge.dst)
                stack.append((edge.dst, iter(out.get(edge.dst, []))))
    return cycles


def layer_problems(edges: list[Edge]) -> list[str]:
    """The edges from one subpackage into another that ALLOWED does not list."""
    bad = []
    for edge in edges:
        src, dst = edge.src.split("."), edge.dst.split(".")
        if len(src) < 3 or len(dst) < 3 or src[1] == dst[1]:
            continue  # the package's top level (__init__, _C) is no layer
        allowed = ALLOWED.get(src[1], set())  # a subpackage ALLOWED lacks: its own test fails
        if dst[1] not in allowed:
            bad.append(f"{edge}: {src[1]} may import only {sorted(allowed)}")
    return bad


def test_every_subpackage_has_a_layer():
    subpackages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and any(p.rglob("*.py"))}
    assert subpackages == set(ALLOWED), "give each subpackage its place in ALLOWED"


def test_subpackages_import_only_the_layers_below():
    problems = layer_problems(import_edges(PACKAGE, "ort_kvlayout"))
    assert not problems, "\n".join(problems)


def test_no_import_cycle_even_through_function_bodies():
    cycles = import_cycles(import_edges(PACKAGE, "ort_kvlayout"))
    assert not cycles, "import cycles:\n" + "\n".join(
        "  " + "; ".join(str(e) for e in cycle) for cycle in cycles
    )


def _write_package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_a_cycle_hidden_in_a_function_is_found(tmp_path):
    """The checker itself: a module-level import one way and a function-level one back (how
    tools/kvquant.py and tools/patch.py once imported each other) is a cycle; so is a cycle
    through `from . import name` and an absolute import; a package's __init__ importing its
    children is not."""
    pkg = _write_package(
        tmp_path,
        {
            "a/__init__.py": "from . import schema\n",
            "b/__init__.py": "",
            "a/schema.py": "X = 1\n",
            "a/quant.py": "from .patch import X\n",
            "a/patch.py": "from .schema import X\n\ndef convert():\n    from .quant import X\n",
            "b/one.py": "from ..a import schema\nfrom . import two\n",
            "b/two.py": "def f():\n    import pkg.b.one\n",
        },
    )
    cycles = import_cycles(import_edges(pkg, "pkg"))
    found = sorted(sorted(e.src for e in cycle) for cycle in cycles)
    assert found == [["pkg.a.patch", "pkg.a.quant"], ["pkg.b.one", "pkg.b.two"]]
    hidden = next(e for c in cycles for e in c if e.src == "pkg.a.patch")
    assert (hidden.dst, hidden.scope, hidden.line) == ("pkg.a.quant", "in convert()", 4)


def test_the_layer_rule_sees_imports_inside_functions(tmp_path):
    pkg = _write_package(
        tmp_path,
        {
            "op/__init__.py": "",
            "op/low.py": "import os\n\ndef f():\n    from ..tools import high\n",
            "tools/__init__.py": "",
            "tools/high.py": "from ..op.low import f\n",
        },
    )
    assert layer_problems(import_edges(pkg, "pkg")) == [
        "pkg.op.low -> pkg.tools.high (line 4, in f()): op may import only []"
    ]
