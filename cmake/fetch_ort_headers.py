#!/usr/bin/env python3
"""Fetch ONNX Runtime's C/C++ API headers from Debian's libonnxruntime-dev package.

The onnxruntime wheels ship no headers, so the build takes them from Debian's package (a
registry every build machine of this project reaches). Headers are architecture independent;
the amd64 package is used everywhere. Prints the include directory on success.

Order: apt-get download with a throwaway sources list (no root, no install), else a direct
download of the pool file. Either way the .deb's sha256 is checked and only its
usr/include/onnxruntime tree is extracted into the cache.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

PACKAGE = "libonnxruntime-dev"
VERSION = "1.21.0+dfsg-1"
SUITE = "trixie"
DEB_NAME = f"{PACKAGE}_{VERSION}_amd64.deb"
SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
MIRROR = "http://deb.debian.org/debian"
POOL_URL = f"{MIRROR}/pool/main/o/onnxruntime/{DEB_NAME}"


def _apt_download(workdir: Path) -> Path | None:
    if shutil.which("apt-get") is None:
        return None
    sources = workdir / "sources.list"
    sources.write_text(f"deb {MIRROR} {SUITE} main\n")
    (workdir / "lists" / "partial").mkdir(parents=True)
    (workdir / "cache" / "archives" / "partial").mkdir(parents=True)
    opts = [
        f"-oDir::Etc::SourceList={sources}",
        "-oDir::Etc::SourceParts=/dev/null",
        f"-oDir::State::Lists={workdir / 'lists'}",
        f"-oDir::Cache={workdir / 'cache'}",
        "-oAPT::Get::List-Cleanup=0",
        "-oDebug::NoLocking=1",
        "-oAPT::Sandbox::User=root",
        "-qq",
    ]
    try:
        subprocess.run(["apt-get", *opts, "update"], check=True, cwd=workdir, timeout=300)
        subprocess.run(
            ["apt-get", *opts, "download", f"{PACKAGE}={VERSION}"],
            check=True,
            cwd=workdir,
            timeout=300,
        )
    except (subprocess.SubprocessError, OSError) as err:
        print(f"fetch_ort_headers: apt-get route failed ({err}); trying a direct download",
              file=sys.stderr)
        return None
    deb = workdir / DEB_NAME.replace("+", "%2b")
    if not deb.exists():
        deb = workdir / DEB_NAME
    return deb if deb.exists() else None


def _direct_download(workdir: Path) -> Path:
    deb = workdir / DEB_NAME
    with urllib.request.urlopen(POOL_URL, timeout=300) as resp, open(deb, "wb") as out:
        shutil.copyfileobj(resp, out)
    return deb


def _data_tar(deb_bytes: bytes) -> tarfile.TarFile:
    """Open data.tar.* inside a .deb (an `ar` archive) without needing dpkg."""
    if not deb_bytes.startswith(b"!<arch>\n"):
        raise RuntimeError("not a Debian package (missing ar magic)")
    pos = 8
    while pos + 60 <= len(deb_bytes):
        header = deb_bytes[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        body = deb_bytes[pos + 60 : pos + 60 + size]
        if name.startswith("data.tar"):
            if name.endswith(".xz"):
                body = lzma.decompress(body)
                return tarfile.open(fileobj=io.BytesIO(body), mode="r:")
            return tarfile.open(fileobj=io.BytesIO(body), mode="r:*")
        pos += 60 + size + (size & 1)
    raise RuntimeError("no data.tar member in the package")


def fetch(cache: Path) -> Path:
    include = cache / f"onnxruntime-headers-{VERSION}" / "include"
    marker = include / "onnxruntime" / "onnxruntime_cxx_api.h"
    if marker.exists():
        return include / "onnxruntime"
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        deb = _apt_download(workdir) or _direct_download(workdir)
        data = deb.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != SHA256:
            raise RuntimeError(f"{DEB_NAME}: sha256 {digest} != expected {SHA256}")
        staging = cache / f".staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        with _data_tar(data) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.lstrip("./").startswith("usr/include/onnxruntime/")]
            for m in members:
                m.name = m.name.lstrip("./")[len("usr/") :]
            tar.extractall(staging, members=members, filter="data")
        include.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(include, ignore_errors=True)
        os.replace(staging / "include", include)
        shutil.rmtree(staging, ignore_errors=True)
    if not marker.exists():
        raise RuntimeError(f"headers missing after extraction: {marker}")
    return include / "onnxruntime"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    default_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ort_kvlayout"
    parser.add_argument("--cache", type=Path, default=default_cache)
    args = parser.parse_args()
    print(fetch(args.cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
