#!/usr/bin/env python3
"""Fetch ONNX Runtime's C/C++ API headers from Debian's libonnxruntime-dev package.

The onnxruntime wheels ship no headers, so the build takes them from Debian's package (a
registry every build machine of this project reaches). Headers are architecture independent;
the amd64 package is used everywhere. Prints the include directory on success.

The package source is the one apt is already configured with: the Debian archives named in
/etc/apt/sources.list(.d) (one-line or deb822 form), asked for the suite that carries the package.
Order: apt-get download with a throwaway sources list naming those archives (no root, no
install), else a direct download of the pool file from each of them. Either way the .deb's sha256
is checked and only its usr/include/onnxruntime tree is extracted into the cache. With no Debian
archive configured, one message says how to provide the headers instead.
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
from typing import NamedTuple

PACKAGE = "libonnxruntime-dev"
VERSION = "1.21.0+dfsg-1"
SUITE = "trixie"
DEB_NAME = f"{PACKAGE}_{VERSION}_amd64.deb"
SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
POOL_PATH = f"pool/main/o/onnxruntime/{DEB_NAME}"
APT_SOURCES = Path("/etc/apt")
# Suites of the Debian archive itself (not -security / -updates / third-party repositories).
DEBIAN_SUITES = {"oldstable", "stable", "testing", "unstable", "sid", "bullseye", "bookworm",
                 "trixie", "forky", "duke"}  # fmt: skip
HOW_TO = (
    "set ORT_INCLUDE_DIR to a directory holding onnxruntime_cxx_api.h, or install Debian's "
    f"{PACKAGE} ({VERSION}, suite {SUITE})"
)


class Archive(NamedTuple):
    uri: str
    signed_by: str | None  # a keyring path, when the source names one


def _list_entries(text: str) -> list[Archive]:
    """One-line sources: `deb [opt=value ...] URI SUITE COMPONENT...`."""
    out = []
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        words, opts = words[1:], {}
        if words and words[0].startswith("["):
            while words:
                raw = words.pop(0)
                w = raw.strip("[]")
                if "=" in w:
                    k, v = w.split("=", 1)
                    opts[k] = v
                if raw.endswith("]"):
                    break
        if len(words) >= 3 and words[1] in DEBIAN_SUITES and "main" in words[2:]:
            out.append(Archive(words[0].rstrip("/"), opts.get("signed-by")))
    return out


def _deb822_entries(text: str) -> list[Archive]:
    """deb822 sources: stanzas of `Types:`, `URIs:`, `Suites:`, `Components:`, `Signed-By:`."""
    out = []
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = None
        for line in stanza.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line[0].isspace() and key:  # continuation (an inline key)
                fields[key] += "\n" + line.strip()
                continue
            key, _, value = line.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()
        if fields.get("enabled", "yes").lower() == "no" or "deb" not in fields.get("types", ""):
            continue
        suites = fields.get("suites", "").split()
        if not any(x in DEBIAN_SUITES for x in suites) or "main" not in fields.get(
            "components", ""
        ):
            continue
        signed = fields.get("signed-by")
        signed = signed if signed and "\n" not in signed and signed.startswith("/") else None
        out += [Archive(uri.rstrip("/"), signed) for uri in fields.get("uris", "").split()]
    return out


def configured_archives(root: Path | None = None) -> list[Archive]:
    """The Debian archives apt is configured with, in the order apt reads them, no duplicates."""
    root = APT_SOURCES if root is None else root
    found: list[Archive] = []
    files = [root / "sources.list"] + sorted((root / "sources.list.d").glob("*"))
    for f in files:
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        if f.name == "sources.list" or f.suffix == ".list":
            found += _list_entries(text)
        elif f.suffix == ".sources":
            found += _deb822_entries(text)
    return list(dict.fromkeys(found))


def _apt_download(workdir: Path, archives: list[Archive]) -> Path | None:
    if shutil.which("apt-get") is None:
        return None
    sources = workdir / "sources.list"
    sources.write_text("".join(
        f"deb {'[signed-by=' + a.signed_by + '] ' if a.signed_by else ''}{a.uri} {SUITE} main\n"
        for a in archives))  # fmt: skip
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
        print(
            f"fetch_ort_headers: apt-get route failed ({err}); trying a direct download",
            file=sys.stderr,
        )
        return None
    deb = workdir / DEB_NAME.replace("+", "%2b")
    if not deb.exists():
        deb = workdir / DEB_NAME
    return deb if deb.exists() else None


def _direct_download(workdir: Path, archives: list[Archive]) -> Path:
    deb = workdir / DEB_NAME
    errors = []
    for a in archives:
        try:
            with (
                urllib.request.urlopen(f"{a.uri}/{POOL_PATH}", timeout=300) as resp,
                open(deb, "wb") as out,
            ):
                shutil.copyfileobj(resp, out)
            return deb
        except OSError as err:
            errors.append(f"{a.uri}: {err}")
    raise RuntimeError(f"could not download {DEB_NAME} ({'; '.join(errors)}); {HOW_TO}")


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
        archives = configured_archives()
        if not archives:
            raise RuntimeError(f"apt names no Debian archive in {APT_SOURCES}; {HOW_TO}")
        deb = _apt_download(workdir, archives) or _direct_download(workdir, archives)
        data = deb.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != SHA256:
            raise RuntimeError(f"{DEB_NAME}: sha256 {digest} != expected {SHA256}")
        staging = cache / f".staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        with _data_tar(data) as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.name.lstrip("./").startswith("usr/include/onnxruntime/")
            ]
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
    default_cache = Path(
        os.environ.get("ORT_KVLAYOUT_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ort_kvlayout"
    )
    parser.add_argument("--cache", type=Path, default=default_cache)
    args = parser.parse_args()
    try:
        print(fetch(args.cache))
    except (RuntimeError, OSError) as err:
        print(f"fetch_ort_headers: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
