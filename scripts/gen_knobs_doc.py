"""Writes docs/KNOBS.md: every environment knob of the library (the registry csrc/core/knobs.h,
read through ort_kvlayout._C.knobs()), every build knob (CMakeLists.txt's cache options and
compile definitions, listed here) and the environment of the build and the scripts.

    python scripts/gen_knobs_doc.py           # rewrites docs/KNOBS.md
    python scripts/gen_knobs_doc.py --check   # exits 1 when docs/KNOBS.md differs

tests/op/test_knobs.py runs the check and keeps these tables complete (every name the sources use
is in one of them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "KNOBS.md"

# CMake cache options, set through CMAKE_ARGS="-DNAME=VALUE" for pip (or -D for cmake).
# (name, values, default, class, doc)
BUILD_KNOBS = [
    (
        "ORT_KVLAYOUT_CUDA",
        "AUTO | ON | OFF",
        "AUTO",
        "product",
        (
            "build the CUDA kernels; AUTO when nvcc is found and nvidia-smi lists a GPU, ON also "
            "without a GPU (cmake/visible_gpus.cmake)"
        ),
    ),
    (
        "ORT_KVLAYOUT_CUDNN",
        "ON | OFF | AUTO",
        "AUTO",
        "product",
        (
            "CUDA builds: prefill through cuDNN; AUTO when cudnn.h, nvrtc.h and the cuDNN frontend are "
            "found"
        ),
    ),
    (
        "CMAKE_CUDA_ARCHITECTURES",
        "a CMake list",
        "the visible GPUs' (e.g. 90-real), else 80-real;90-real",
        "product",
        "GPU code built; PTX only where named (e.g. 90-virtual)",
    ),
    (
        "ORT_INCLUDE_DIR",
        "a path",
        "$ORT_INCLUDE_DIR, else the system, else fetched",
        "product",
        "directory holding onnxruntime_cxx_api.h (fetched: Debian's 1.21 headers, into the cache)",
    ),
    (
        "CUDNN_INCLUDE_DIR",
        "a path",
        "$CUDNN_INCLUDE_DIR, else nvidia-cudnn-cu13, else CUDA's",
        "product",
        "directory holding cudnn.h (headers only; libcudnn is opened at run time)",
    ),
    (
        "CUDNN_FRONTEND_INCLUDE_DIR",
        "a path",
        "$CUDNN_FRONTEND_INCLUDE_DIR, else fetched",
        "product",
        "directory holding the header-only cuDNN frontend's cudnn_frontend.h",
    ),
    (
        "ORT_KVLAYOUT_PYTHON",
        "ON | OFF",
        "OFF",
        "product",
        "build the pybind11 module _C in a plain CMake build (pip builds it always)",
    ),
    (
        "CMAKE_BUILD_TYPE",
        "Release | RelWithDebInfo | Debug",
        "Release",
        "product",
        "CMake's build type",
    ),
]

# Compile definitions that change generated code, for benchmarking and debugging only: passed
# as "-DCMAKE_CUDA_FLAGS=-DNAME=VALUE"; product builds take the defaults. tests/op/test_knobs.py
# checks this list against the `#ifndef KVL_...` defaults in csrc/.
# (name, values, default, class, doc)
COMPILE_KNOBS = [
    (
        "KVL_DECODE_TRACE",
        "0 | 1 | 2",
        "0",
        "diagnostic",
        (
            "1: the decode kernel prints a KVL_TRACE line of phase cycles per launch; 2: one line per "
            "CTA of row 0 (tools/perf/trace_summary.py reads them)"
        ),
    ),
    (
        "KVL_DECODE_STOP",
        "0 .. 5",
        "0",
        "diagnostic",
        (
            "n > 0 ends the decode kernel after its n-th phase (wrong results; splits a launch's time "
            "by phase)"
        ),
    ),
    (
        "KVL_DECODE_MAX_CLUSTER",
        "8 | 16",
        "8",
        "tuning-unstable",
        "largest thread-block cluster of decode CTAs (16: sm_90's non-portable size)",
    ),
    (
        "KVL_DECODE_FLAT_MERGE_FLOATS",
        "a positive integer",
        "32768",
        "tuning-unstable",
        "bound (floats) under which a row's split partials merge flat rather than as a tree",
    ),
    (
        "KVL_CP_ASYNC_L2_PREFETCH",
        "0 | 128 | 256",
        "128",
        "tuning-unstable",
        "L2 prefetch size in bytes of the CUDA kernels' cp.async loads",
    ),
]

# Environment variables of the build and of the scripts (not of the library).
# (name, read by, doc)
BUILD_ENV = [
    (
        "CMAKE_ARGS",
        "pip install (scikit-build-core)",
        'CMake options for pip builds, e.g. "-DORT_KVLAYOUT_CUDA=OFF"',
    ),
    (
        "CMAKE_BUILD_PARALLEL_LEVEL",
        "pip install (cmake --build)",
        "parallel compile jobs (default: ninja's, every core + 2)",
    ),
    ("ORT_INCLUDE_DIR", "CMakeLists.txt", "the default of the CMake option of that name"),
    ("CUDNN_INCLUDE_DIR", "CMakeLists.txt", "the default of the CMake option of that name"),
    (
        "CUDNN_FRONTEND_INCLUDE_DIR",
        "CMakeLists.txt",
        "the default of the CMake option of that name",
    ),
    (
        "NVRTC_INCLUDE_DIR",
        "CMakeLists.txt",
        "where nvrtc.h is (the cuDNN frontend's headers include it; types only)",
    ),
    (
        "ORT_KVLAYOUT_CACHE",
        "cmake/fetch_*.py, scripts/build_test_model.py",
        (
            "cache of fetched headers and of the test model (default ~/.cache/ort_kvlayout, "
            "or $XDG_CACHE_HOME/ort_kvlayout)"
        ),
    ),
    (
        "ORT_KVLAYOUT_GGUF",
        "scripts/build_test_model.py",
        "the test model's GGUF file, on a machine without PyPI",
    ),
    (
        "ORT_KVLAYOUT_API_KEY",
        "ort-kvlayout serve (serve/auth.py)",
        "the API key every /v1/* route requires (as --api-key, kept out of ps); unset: no key",
    ),
]


def _row(cells) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def _code(name: str) -> str:
    return f"`{name}`"


def render(knobs: list[dict] | None = None) -> str:
    """docs/KNOBS.md's text; `knobs` defaults to the installed library's registry."""
    if knobs is None:
        from ort_kvlayout import _C

        knobs = _C.knobs()
    out = [
        "# Knobs",
        "",
        "<!-- Generated by scripts/gen_knobs_doc.py from csrc/core/knobs.h and the script's build",
        "     tables; edit those, then run the script. tests/op/test_knobs.py checks this",
        "     file. -->",
        "",
        "Every setting of the library and its build. Classes: **product** (stable; README names",
        "them), **diagnostic** (forces a path or reports a choice, for bug reports and tests) and",
        "**tuning-unstable** (benchmarking; may change or go without notice).",
        "",
        "## Environment variables of the library",
        "",
        "Parsed in one place (csrc/core/knobs.cc); unset or empty means the default. A value",
        "outside the listed ones is an error, never a silent default: the op that reads the knob",
        "fails when its session is created, with",
        "`environment variable NAME must be RULE, got 'VALUE'` (`ORT_KVLAYOUT_CPU_ISA`: each CPU",
        "call fails, naming the levels built). `ort_kvlayout._C.knob_values()` shows the parsed",
        "values.",
        "",
        _row(["Name", "Values", "Default", "Class", "Read by", "What it does"]),
        _row(["---"] * 6),
    ]
    for k in knobs:
        values = k["values"]
        default = _code(k["default"]) if k["default"] else "unset"
        out.append(_row([_code(k["name"]), values, default, k["class"], k["read"], k["doc"]]))
    out += [
        "",
        "## Build options",
        "",
        'CMake cache options: `CMAKE_ARGS="-DNAME=VALUE" pip install .`, or `-DNAME=VALUE` to',
        "cmake.",
        "",
        _row(["Name", "Values", "Default", "Class", "What it does"]),
        _row(["---"] * 5),
    ]
    for name, values, default, cls, doc in BUILD_KNOBS:
        out.append(
            _row([_code(name), values, _code(default) if " " not in default else default, cls, doc])
        )
    out += [
        "",
        "Compile definitions of the CUDA kernels, for benchmarking and debugging (product builds",
        'take the defaults), e.g. `CMAKE_ARGS="-DCMAKE_CUDA_FLAGS=-DKVL_DECODE_TRACE=1"`:',
        "",
        _row(["Name", "Values", "Default", "Class", "What it does"]),
        _row(["---"] * 5),
    ]
    for name, values, default, cls, doc in COMPILE_KNOBS:
        out.append(_row([_code(name), values, _code(default), cls, doc]))
    out += [
        "",
        "## Environment of the build, the scripts and the server",
        "",
        _row(["Name", "Read by", "What it does"]),
        _row(["---"] * 3),
    ]
    for name, reader, doc in BUILD_ENV:
        out.append(_row([_code(name), reader, doc]))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/KNOBS.md differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.is_file() or DOC.read_text(encoding="utf-8") != text:
            print(f"{DOC} is out of date: run python scripts/gen_knobs_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
