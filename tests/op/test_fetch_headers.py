"""cmake/fetch_ort_headers.py takes the package source apt is configured with (no host name in
the repository), reads both source formats, and says how to provide the headers otherwise.
The sample sources use apt's file: URIs, so no host name enters the repository here either."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "cmake" / "fetch_ort_headers.py"


@pytest.fixture(scope="module")
def fetch():
    spec = importlib.util.spec_from_file_location("fetch_ort_headers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_archive_host_in_the_script():
    text = SCRIPT.read_text()
    assert "http://" not in text and "https://" not in text


def test_reads_one_line_and_deb822_sources(fetch, tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(
        "# a comment\n"
        "deb [arch=amd64 signed-by=/k/a.gpg] file:/srv/a/debian bookworm main contrib\n"
        "deb file:/srv/a/debian-security bookworm-security main\n"
        "deb-src file:/srv/a/debian bookworm main\n"
    )
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: file:/srv/b/debian/\nSuites: trixie trixie-updates\n"
        "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        "Types: deb\nURIs: file:/srv/c/debian\nSuites: bookworm\nComponents: main\n"
        "Enabled: no\n\n"
        "Types: deb\nURIs: file:/srv/vendor/node\nSuites: nodistro\nComponents: main\n"
    )
    (tmp_path / "sources.list.d" / "vendor.list").write_text(
        "deb file:/srv/vendor/apt cloud-sdk main\n"
    )
    assert fetch.configured_archives(tmp_path) == [
        fetch.Archive("file:/srv/a/debian", "/k/a.gpg"),
        fetch.Archive("file:/srv/b/debian", "/usr/share/keyrings/debian-archive-keyring.gpg"),
    ]


def test_no_configured_archive_says_how_to_provide_the_headers(fetch, tmp_path, monkeypatch):
    (tmp_path / "apt").mkdir()
    monkeypatch.setattr(fetch, "APT_SOURCES", tmp_path / "apt")
    with pytest.raises(RuntimeError, match="ORT_INCLUDE_DIR"):
        fetch.fetch(tmp_path / "cache")
