"""Loads a bench/ or tools/perf/ script as a module for its tests (scripts, not packages)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
PERF = ROOT / "tools" / "perf"


def load_bench(name: str, *, register: bool = False, folder: Path = BENCH) -> ModuleType:
    """<folder>/<name>.py (bench/ by default), loaded with bench/ on sys.path while it runs
    (several scripts import bench_cuda as a sibling). `register` puts it in sys.modules under
    `name` first (a dataclass of the module looks its module up there)."""
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def load_perf(name: str, *, register: bool = False) -> ModuleType:
    """tools/perf/<name>.py, as load_bench loads bench/ scripts."""
    return load_bench(name, register=register, folder=PERF)
