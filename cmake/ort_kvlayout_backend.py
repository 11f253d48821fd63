"""The package's PEP 517 backend: scikit-build-core, keeping its build directory across pip runs.

pip builds in a new temporary environment each time (build isolation), so scikit-build-core
finds its own path changed and wipes CMakeCache.txt and CMakeFiles/ of `build/{wheel_tag}`,
object files included: every `pip install .` then recompiled all of the library (minutes with
nvcc). Before each build this points the build directory's record at the scikit-build-core of
this environment when only that path moved (same source, same scikit-build-core version), so
CMake reconfigures on its cache and ninja rebuilds only what changed. The cached paths into the
old environment are safe to keep: pip deletes that environment, so find_package(pybind11) looks
again (a package directory without its config file is searched anew), and scikit-build-core sets
CMAKE_PREFIX_PATH and CMAKE_MAKE_PROGRAM on every configure. `cmake.fresh=true` (a config
setting) or deleting build/ still forces a clean build.
"""

from __future__ import annotations

import json
from pathlib import Path

import scikit_build_core
from scikit_build_core.build import *
from scikit_build_core.build import __all__ as _hooks
from scikit_build_core.build import build_editable as _build_editable
from scikit_build_core.build import build_wheel as _build_wheel

__all__ = list(_hooks)


def keep_build_dirs(source: Path = Path()) -> list[Path]:
    """Rewrites build/*/.skbuild-info.json of `source` whose only change is the isolated
    environment's scikit-build-core path; returns the directories kept."""
    here = Path(scikit_build_core.__file__).parent
    kept = []
    for info_path in sorted(source.resolve().glob("build/*/.skbuild-info.json")):
        try:
            info = json.loads(info_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # scikit-build-core clears an unreadable record itself
        if not isinstance(info, dict):
            continue
        same_source = info.get("source_dir") == str(source.resolve())
        same_version = info.get("skbuild_version") == scikit_build_core.__version__
        if same_source and same_version and info.get("skbuild_path") != str(here):
            info["skbuild_path"] = str(here)
            info_path.write_text(json.dumps(info, indent=2), encoding="utf-8")
            kept.append(info_path.parent)
    return kept


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    keep_build_dirs()
    return _build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    keep_build_dirs()
    return _build_editable(wheel_directory, config_settings, metadata_directory)
