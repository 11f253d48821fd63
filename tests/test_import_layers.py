"""The package's import layers: op at the bottom, model on it, tools and runtime side by side,
serve on the runtime."""

import ast
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


def _imported_subpackages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "ort_kvlayout" and len(parts) > 1:
                found.add(parts[1])
    return found - {"_C"}


def test_subpackages_import_only_the_layers_below():
    for sub, allowed in ALLOWED.items():
        for path in sorted((PACKAGE / sub).glob("*.py")):
            extra = _imported_subpackages(path) - allowed - {sub}
            assert not extra, f"{sub}/{path.name} imports {sorted(extra)}"
