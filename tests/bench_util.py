"""Loads a bench/ script as a module for its tests (bench/ is scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str, *, register: bool = False) -> ModuleType:
    """bench/<name>.py, loaded with bench/ on sys.path while it runs (several scripts import
    bench_cuda as a sibling). `register` puts it in sys.modules under `name` first (a dataclass
    of the module looks its module up there)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module
