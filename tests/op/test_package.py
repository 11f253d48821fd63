"""The Python surface: register(), library_path(), build_info(), layout names and arithmetic.

The package's layout helpers are checked against the oracle's independent copy in
tests/helpers/reference.py, so a stride bug in either shows up here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import reference

ort_kvlayout = pytest.importorskip("ort_kvlayout", reason="ort_kvlayout is not installed")


def test_register_returns_domain_and_loads_library():
    so = ort.SessionOptions()
    assert ort_kvlayout.register(so) == ort_kvlayout.DOMAIN == "ai.kvlayout"
    path = Path(ort_kvlayout.library_path())
    assert path.is_absolute() and path.is_file() and path.name == "libort_kvlayout.so"


def test_register_is_idempotent_and_checks_its_argument(tmp_path):
    """register() twice leaves the options as once (ORT refused a second registration only at
    session creation: "Domain already set in registry"); another copy of the library on the
    same options is refused by name; anything but SessionOptions is a TypeError."""
    from ort_kvlayout.op.library import register_library

    so = ort.SessionOptions()
    ort_kvlayout.register(so)
    ort_kvlayout.register(so)
    copy = tmp_path / "libort_kvlayout.so"
    shutil.copy(ort_kvlayout.library_path(), copy)
    with pytest.raises(ValueError, match="already registered the op library"):
        register_library(so, copy)
    for bad in (None, {}, ort.RunOptions()):
        with pytest.raises(TypeError, match="expected onnxruntime.SessionOptions"):
            ort_kvlayout.register(bad)


def test_cudnn_status_says_what_serves_prefill():
    """Once ORT has loaded the library: a CUDA build reports how cuDNN serves prefill (its
    version, or why not: built without the headers, libcudnn not loadable, disabled) with its
    counters; a CPU-only build has nothing to report (None)."""
    import re

    so = ort.SessionOptions()
    ort_kvlayout.register(so)  # loads the library into this process (while `so` lives)
    status = ort_kvlayout.cudnn_status()
    if not ort_kvlayout.build_info().get("cuda"):
        assert status is None
        return
    assert status is not None
    pattern = r"(cuDNN \d+|unavailable \(.+\)|not built \(.+\)): graphs built \d+, refused \d+, launches \d+"
    assert re.fullmatch(pattern, status), status


def test_build_info_and_version():
    info = ort_kvlayout.build_info()
    assert info["version"] == ort_kvlayout.__version__
    assert info["ort_api_version"] >= 21
    assert info["ort_header_version"].count(".") == 2
    assert isinstance(info["cuda"], bool)
    assert isinstance(ort_kvlayout.cuda_available(), bool)
    if not info["cuda"]:
        assert ort_kvlayout.cuda_available() is False


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    for path in (os.environ.get("CUDACXX"), "/usr/local/cuda/bin/nvcc"):
        if not found and path and os.access(path, os.X_OK):
            found = path
    return found


def _visible_gpu_caps() -> list[str] | None:
    """The compute capabilities ("9.0") of the GPUs nvidia-smi lists; None when it lists none
    (the build's rule: cmake/visible_gpus.cmake)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        listing = subprocess.run(
            [smi, "-L"], check=False, capture_output=True, text=True, timeout=60
        )
        if listing.returncode != 0 or not re.search(r"GPU \d+:", listing.stdout):
            return None
        caps = subprocess.run(
            [smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return re.findall(r"\d+\.\d+", caps.stdout) if caps.returncode == 0 else []


def test_cuda_kernels_are_built_where_a_gpu_is_visible_or_asked():
    """The CUDA kernels are built by default (ORT_KVLAYOUT_CUDA=AUTO) where nvcc exists and a
    GPU is visible, for that GPU's architecture, and wherever ORT_KVLAYOUT_CUDA=ON asks (wheels,
    a compile check without a GPU): a build that silently left CUDA out fails here."""
    cmake_args = os.environ.get("CMAKE_ARGS", "")
    if "ORT_KVLAYOUT_CUDA=OFF" in cmake_args:
        pytest.skip("CUDA switched off through CMAKE_ARGS")
    asked = "ORT_KVLAYOUT_CUDA=ON" in cmake_args
    caps = _visible_gpu_caps()
    usable = [c for c in caps or [] if int(c.replace(".", "")) >= 80]
    if not asked and not (_nvcc() and usable):
        pytest.skip(
            "no nvcc or no sm_80+ GPU visible, and ORT_KVLAYOUT_CUDA=ON not asked: CPU-only"
        )
    info = ort_kvlayout.build_info()
    assert info["cuda"] is True, f"CUDA asked or a GPU visible, but no CUDA kernels: {info}"
    if usable and "CMAKE_CUDA_ARCHITECTURES" not in cmake_args and "CUDAARCHS" not in os.environ:
        for cap in usable:  # built for the visible GPUs themselves (or nvcc's "native")
            assert cap.replace(".", "") in info["cuda_archs"] or info["cuda_archs"] == "native"


@pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake on the PATH")
@pytest.mark.parametrize(
    "smi, found, archs",
    [
        (None, "FALSE", ""),  # no nvidia-smi (nvcc alone is no GPU)
        ("echo 'NVIDIA-SMI has failed: no driver' >&2; exit 9", "FALSE", ""),
        ('[ "$1" = -L ] && echo "No devices were found"; exit 6', "FALSE", ""),
        ('[ "$1" = -L ] && echo "GPU 0: NVIDIA H100 (UUID: GPU-1)" || echo 9.0', "TRUE", "90-real"),
        (  # two kinds: both, lowest first; an sm_75 card is left out
            (
                '[ "$1" = -L ] && printf "GPU 0: A\\nGPU 1: B\\nGPU 2: C\\n" || '
                'printf "9.0\\n8.0\\n7.5\\n"'
            ),
            "TRUE",
            "80-real;90-real",
        ),
        ('[ "$1" = -L ] && echo "GPU 0: NVIDIA T4 (UUID: GPU-2)" || echo 7.5', "TRUE", ""),
        ('[ "$1" = -L ] && echo "GPU 0: an old driver" || exit 2', "TRUE", "native"),
    ],
)
def test_visible_gpus_rule(tmp_path, smi, found, archs):
    """cmake/visible_gpus.cmake against a stand-in nvidia-smi: a GPU is visible only when
    `nvidia-smi -L` lists one; its sm_80+ architectures are built, without PTX."""
    root = Path(__file__).resolve().parents[2]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if smi is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    script = tmp_path / "probe.cmake"
    script.write_text(
        f'include("{root / "cmake" / "visible_gpus.cmake"}")\n'
        "kvl_visible_gpus(found archs)\n"
        'message(NOTICE "found=${found} archs=${archs}")\n'
    )
    # The stand-in (or none) in place of any real nvidia-smi on the PATH.
    kept = [d for d in os.environ["PATH"].split(os.pathsep) if not Path(d, "nvidia-smi").exists()]
    env = {**os.environ, "PATH": os.pathsep.join([str(bin_dir), *kept])}
    cmake = shutil.which("cmake")
    result = subprocess.run(
        [cmake, "-P", str(script)], check=False, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"found={found} archs={archs}"


def test_layout_names_and_ids():
    assert (ort_kvlayout.HEAD_MAJOR, ort_kvlayout.SEQ_MAJOR) == (0, 1)
    assert ort_kvlayout.LAYOUT_NAMES == {0: "head_major_bnsh", 1: "seq_major_bsnh"}
    for text, want in [("seq-major", 1), ("head_major", 0), ("seq_major_bsnh", 1), ("BNSH", 0)]:
        assert ort_kvlayout.layout_id(text) == want
    for bad in (2, -1, "row-major"):
        with pytest.raises(ValueError, match="kv_layout|KV layout"):
            ort_kvlayout.layout_id(bad)


@pytest.mark.parametrize("layout", [0, 1])
def test_layout_arithmetic_matches_the_oracle(layout):
    rng = np.random.default_rng()
    b, n, c, h = 2, 3, 7, 8
    strides = ort_kvlayout.kv_strides(layout, n, c, h)
    assert tuple(strides) == reference.kv_strides(layout, b, n, c, h)
    logical = rng.standard_normal((b, n, c, h)).astype(np.float32)
    buf = ort_kvlayout.to_layout(logical, layout)
    assert buf.shape == logical.shape
    np.testing.assert_array_equal(buf, reference.to_layout(logical, layout))
    np.testing.assert_array_equal(ort_kvlayout.from_layout(buf, layout), logical)
    # Element (b, h, s, d) sits where the strides say.
    flat = buf.reshape(-1)
    for idx in [(0, 0, 0, 0), (1, 2, 6, 7), (1, 0, 3, 5), (0, 2, 1, 2)]:
        offset = sum(i * st for i, st in zip(idx, strides))
        assert flat[offset] == logical[idx]


def test_build_backend_keeps_the_build_dir_across_isolated_environments(tmp_path):
    """cmake/ort_kvlayout_backend.py: a build directory whose record differs only in the path
    of scikit-build-core (pip's new isolated environment) is pointed at this one, so
    scikit-build-core keeps its CMake cache and objects; another source or scikit-build-core
    version is left for scikit-build-core to clear."""
    import importlib.util
    import json

    skbuild = pytest.importorskip("scikit_build_core")
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "ort_kvlayout_backend", root / "cmake" / "ort_kvlayout_backend.py"
    )
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    here = str(Path(skbuild.__file__).parent)
    records = {
        "moved": {"source_dir": str(tmp_path.resolve()), "skbuild_version": skbuild.__version__},
        "other_version": {"source_dir": str(tmp_path.resolve()), "skbuild_version": "0.0.1"},
        "other_source": {"source_dir": "/elsewhere", "skbuild_version": skbuild.__version__},
    }
    for name, info in records.items():
        (tmp_path / "build" / name).mkdir(parents=True)
        info["skbuild_path"] = "/tmp/pip-build-env-gone/scikit_build_core"
        (tmp_path / "build" / name / ".skbuild-info.json").write_text(json.dumps(info))
    assert backend.keep_build_dirs(tmp_path) == [tmp_path.resolve() / "build" / "moved"]
    for name in records:
        info = json.loads((tmp_path / "build" / name / ".skbuild-info.json").read_text())
        assert (info["skbuild_path"] == here) == (name == "moved"), name
    assert set(backend.__all__) >= {"build_wheel", "build_editable", "build_sdist"}
