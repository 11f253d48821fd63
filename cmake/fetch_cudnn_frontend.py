#!/usr/bin/env python3
"""Fetch the cuDNN frontend's C++ headers (header-only) from PyPI's nvidia-cudnn-frontend wheel.

pip downloads the wheel by name and version from the index pip is configured with (no
dependencies, no install); its sha256 is checked and only its include/ tree is extracted into
the cache. Prints the include directory on success. Used only by CUDA builds that found cudnn.h
(cmake: ORT_KVLAYOUT_CUDNN); CUDNN_FRONTEND_INCLUDE_DIR skips it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "nvidia-cudnn-frontend"
VERSION = "1.32.0"
# The wheel's include/ tree is the same for every platform tag; this one is pinned.
WHEEL = "nvidia_cudnn_frontend-1.32.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
SHA256 = "c6006556017a4d1c914c52a556c71b1267f2d6a0500f742e7b4edef539878df0"


def cache_root() -> Path:
    root = os.environ.get("ORT_KVLAYOUT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ort_kvlayout"
    )
    return Path(root) / f"cudnn-frontend-{VERSION}"


def main() -> int:
    dest = cache_root()
    include = dest / "include"
    if (include / "cudnn_frontend.h").is_file():
        print(include)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64",
               "--dest", tmp, f"{PACKAGE}=={VERSION}"]  # fmt: skip
        done = subprocess.run(
            cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        wheel = Path(tmp) / WHEEL
        if done.returncode != 0 or not wheel.is_file():
            print(f"could not download {PACKAGE}=={VERSION} with pip ({done.stderr.strip()[-300:]});"
                  " set CUDNN_FRONTEND_INCLUDE_DIR to its include/ directory, or build with"
                  " -DORT_KVLAYOUT_CUDNN=OFF", file=sys.stderr)  # fmt: skip
            return 1
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != SHA256:
            print(f"{wheel.name}: sha256 {digest} is not the pinned {SHA256}", file=sys.stderr)
            return 1
        staging = Path(tmp) / "x"
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("include/") and not name.endswith("/"):
                    zf.extract(name, staging)
        dest.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(include, ignore_errors=True)
        shutil.move(str(staging / "include"), include)
    print(include)
    return 0


if __name__ == "__main__":
    sys.exit(main())
