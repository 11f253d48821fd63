"""The CLIs under faults (issue 11 item 5), run as a user runs them (subprocesses): malformed
input gives one line naming the file and the problem and exit 2 (never a traceback, a hang or
unbounded memory); values from genai_config.json are checked (type, range, agreement with the
graph) before use; SIGTERM like SIGINT leaves no partial output and no directory the tool made;
a tool never writes over its own input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import ort_kvlayout
import pytest
from synthetic_models import Variant, make_model_dir, snapshot

PYTHONPATH = str(Path(ort_kvlayout.__file__).resolve().parents[1])
NODE = "/model/layers.0/attn/GroupQueryAttention"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=PYTHONPATH + os.pathsep + os.environ.get("PYTHONPATH", ""))


def cli(tool: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """python -m ort_kvlayout.tools.cli patch|metadata ARGS, with a time limit (a hang fails)."""
    cmd = [sys.executable, "-m", "ort_kvlayout.tools.cli", tool, *args]
    return subprocess.run(
        cmd, check=False, capture_output=True, text=True, timeout=timeout, env=_env()
    )


def assert_one_line_error(run: subprocess.CompletedProcess, *needles: str, code: int = 2) -> str:
    err = run.stderr
    assert run.returncode == code, (run.returncode, err, run.stdout)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def _patch(src: Path, out: Path, fake_library: Path, *extra: str) -> subprocess.CompletedProcess:
    return cli("patch", str(src), "-o", str(out), "--library", str(fake_library), "-q", *extra)


def _edit_config(src: Path, edit) -> None:
    path = src / "genai_config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _set(dotted: str, value):
    def edit(config):
        node = config
        *parents, last = dotted.split(".")
        for part in parents:
            node = node[part]
        node[last] = value

    return edit


# ---------------------------------------------------------------------------------------------
# Malformed files: both tools, one line naming the file, exit 2, nothing written


def _corrupt_model(src: Path) -> None:
    (src / "model.onnx").write_bytes(b"\x08\x07not a protobuf at all\xff\xff\xff" * 10)


def _truncated_model(src: Path) -> None:
    data = (src / "model.onnx").read_bytes()
    (src / "model.onnx").write_bytes(data[: len(data) // 2])


def _raw_config(text: bytes):
    def edit(src: Path) -> None:
        (src / "genai_config.json").write_bytes(text)

    return edit


MALFORMED = {
    "corrupt_model": (_corrupt_model, "model.onnx: not a valid ONNX model"),
    "truncated_model": (_truncated_model, "model.onnx: not a valid ONNX model"),
    "config_not_json": (_raw_config(b'{"model": {'), "genai_config.json: not valid JSON"),
    "config_not_utf8": (_raw_config(b'{"model": "\xff\xfe"}'), "genai_config.json: not UTF-8"),
    "config_list": (_raw_config(b"[1, 2]"), "top level must be an object, got an array"),
    "config_nan": (_raw_config(b'{"model": NaN}'), "genai_config.json: not valid JSON"),
    "config_deep": (_raw_config(b"[" * 100000 + b"]" * 100000), "genai_config.json"),
    "config_huge": (_raw_config(b" " * (17 << 20) + b"{}"), "not a genai_config.json"),
    "model_null": (lambda s: _edit_config(s, _set("model", None)), "'model' must be an object"),
    "decoder_list": (
        lambda s: _edit_config(s, _set("model.decoder", [])),
        "'model.decoder' must be an object, got an array",
    ),
    "inputs_null": (
        lambda s: _edit_config(s, _set("model.decoder.inputs", None)),
        "'model.decoder.inputs' must be an object, got null",
    ),
}


@pytest.mark.parametrize("name", MALFORMED)
@pytest.mark.parametrize("tool", ["patch", "metadata"])
def test_malformed_input_one_line_exit_2(tmp_path, fake_library, tool, name):
    breaker, needle = MALFORMED[name]
    src = make_model_dir(tmp_path / "model")
    breaker(src)
    before = snapshot(src)
    out = tmp_path / "new" / "out"
    if tool == "patch":
        run = _patch(src, out, fake_library)
    else:
        run = cli("metadata", str(src), "--output", str(out))
    assert_one_line_error(run, needle)
    assert not (tmp_path / "new").exists()
    assert snapshot(src) == before


def test_missing_and_truncated_external_data(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model", Variant(external_data=True, data_bytes=1 << 16))
    data = src / "model.onnx.data"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    for tool_args in (("patch",), ("metadata", "--stdout")):
        run = (
            _patch(src, tmp_path / "out", fake_library)
            if tool_args[0] == "patch"
            else cli("metadata", str(src), "--stdout")
        )
        assert_one_line_error(run, "model.onnx", "model.onnx.data has", "truncated")
    data.unlink()
    run = _patch(src, tmp_path / "out", fake_library)
    assert_one_line_error(run, "model.onnx", "external data file model.onnx.data not found")
    assert not (tmp_path / "out").exists()


def test_a_negative_external_data_offset_is_refused_before_writing(tmp_path, fake_library):
    import onnx

    src = make_model_dir(tmp_path / "model", Variant(external_data=True, data_bytes=1 << 16))
    model = onnx.load(src / "model.onnx", load_external_data=False)
    tensor = next(
        t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
    )
    for entry in tensor.external_data:
        if entry.key == "offset":
            entry.value = "-5"
            break
    else:
        tensor.external_data.add(key="offset", value="-5")
    onnx.save(model, src / "model.onnx")
    run = _patch(src, tmp_path / "out", fake_library)
    assert_one_line_error(run, "model.onnx", "offset -5", "must be >= 0")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Values from genai_config.json: types, ranges (values no model can have), agreement with graph

BAD_VALUES = {
    "layers_negative": ("model.decoder.num_hidden_layers", -1, "num_hidden_layers"),
    "layers_zero": ("model.decoder.num_hidden_layers", 0, "num_hidden_layers"),
    "layers_absurd": ("model.decoder.num_hidden_layers", 10**12, "num_hidden_layers"),
    "layers_string": ("model.decoder.num_hidden_layers", "2", "the string '2'"),
    "layers_bool": ("model.decoder.num_hidden_layers", True, "num_hidden_layers"),
    "layers_float": ("model.decoder.num_hidden_layers", 2.0, "num_hidden_layers"),
    "heads_zero": ("model.decoder.num_attention_heads", 0, "num_attention_heads"),
    "kv_heads_over": ("model.decoder.num_key_value_heads", 8, "num_key_value_heads"),
    "kv_heads_not_divisor": ("model.decoder.num_key_value_heads", 3, "multiple"),
    "head_size_absurd": ("model.decoder.head_size", 1 << 40, "head_size"),
    "context_negative": ("model.context_length", -5, "context_length"),
    "context_absurd": ("model.context_length", 1 << 40, "context_length"),
    "vocab_zero": ("model.vocab_size", 0, "vocab_size"),
    "bos_beyond_vocab": ("model.bos_token_id", 10**6, "bos_token_id"),
    "pad_negative": ("model.pad_token_id", -1, "pad_token_id"),
    "eos_empty": ("model.eos_token_id", [], "eos_token_id"),
    "eos_beyond_vocab": ("model.eos_token_id", [2, 10**9], "eos_token_id"),
    "eos_null": ("model.eos_token_id", None, "eos_token_id"),
    "window_beyond_context": ("model.decoder.sliding_window", {"window_size": 10**6}, "window"),
    "window_string": ("model.decoder.sliding_window", {"window_size": "8"}, "window_size"),
    "share_buffer_string": ("search.past_present_share_buffer", "yes", "past_present_share"),
    "input_ids_number": ("model.decoder.inputs.input_ids", 5, "input_ids"),
    "template_null": ("model.decoder.inputs.past_key_names", None, "past_key_names"),
    "decoder_file_escapes": ("model.decoder.filename", "../model.onnx", "relative path"),
    # agreement with the graph
    "heads_disagree": ("model.decoder.num_attention_heads", 8, "disagree with node"),
    "layers_fewer_than_graph": ("model.decoder.num_hidden_layers", 1, "but the graph has"),
}


@pytest.mark.parametrize("name", BAD_VALUES)
def test_config_values_checked_before_use(tmp_path, fake_library, name):
    dotted, value, needle = BAD_VALUES[name]
    src = make_model_dir(tmp_path / "model")
    _edit_config(src, _set(dotted, value))
    run = cli("metadata", str(src), "--stdout", timeout=30)
    assert_one_line_error(run, "genai_config.json", needle)
    assert run.stdout == ""
    # The patcher checks the same before writing anything (its metadata step).
    run = _patch(src, tmp_path / "out", fake_library)
    assert run.returncode == 2 and "Traceback" not in run.stderr and needle in run.stderr
    assert not (tmp_path / "out").exists()


def test_session_options_of_wrong_type(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model")
    _edit_config(src, _set("model.decoder.session_options", [1]))
    run = _patch(src, tmp_path / "out", fake_library, "--no-metadata")
    assert_one_line_error(run, "session_options' must be an object")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Arguments, exit codes, own inputs


@pytest.mark.parametrize("tool", ["patch", "metadata"])
def test_empty_model_dir_argument_is_an_error(tmp_path, tool):
    run = subprocess.run(
        [sys.executable, "-m", "ort_kvlayout.tools.cli", tool, ""],
        check=False, capture_output=True, text=True, timeout=60, env=_env(),
        cwd=make_model_dir(tmp_path / "m"),
    )  # fmt: skip
    assert run.returncode == 2 and "empty path" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "m" / "inference_metadata.yaml").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_patch_empty_output_argument(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model")
    run = cli("patch", str(src), "-o", "", "--library", str(fake_library))
    assert run.returncode == 2 and "empty path" in run.stderr


@pytest.mark.parametrize("tool", ["patch", "metadata"])
def test_model_dir_that_is_a_file(tmp_path, fake_library, tool):
    """A file given as MODEL_DIR is named as a file, not as a directory "not found"."""
    file = tmp_path / "model.onnx"
    file.write_text("x")
    if tool == "patch":
        run = _patch(file, tmp_path / "out", fake_library)
    else:
        run = cli("metadata", str(file))
    err = assert_one_line_error(run, f"{file} is a file, not a model directory")
    assert "not found" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lib", "model.onnx"]


def test_metadata_output_folder_missing(tmp_path):
    """--output in a folder that does not exist: the error names that folder, not the tool's
    hidden temporary file, and nothing is created."""
    src = make_model_dir(tmp_path / "model")
    before = snapshot(src)
    out = tmp_path / "nodir" / "x.yaml"
    err = assert_one_line_error(
        cli("metadata", str(src), "--output", str(out)), f"{tmp_path / 'nodir'} does not exist"
    )
    assert ".tmp" not in err
    assert not (tmp_path / "nodir").exists() and snapshot(src) == before
    blocker = tmp_path / "file"
    blocker.write_text("x")
    run = cli("metadata", str(src), "--output", str(blocker / "x.yaml"))
    assert ".tmp" not in assert_one_line_error(run, f"{blocker} is not a directory")
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("target", ["genai_config.json", "model.onnx", "model.onnx.data"])
def test_metadata_never_writes_over_its_inputs(tmp_path, target):
    src = make_model_dir(tmp_path / "model", Variant(external_data=True))
    before = snapshot(src)
    run = cli("metadata", str(src), "--output", str(src / target), "--force")
    assert_one_line_error(run, "is one of the tool's inputs")
    assert snapshot(src) == before


def test_metadata_never_writes_through_a_hard_link_to_an_input(tmp_path):
    src = make_model_dir(tmp_path / "model")
    before = snapshot(src)
    link = tmp_path / "meta.yaml"
    os.link(src / "genai_config.json", link)
    run = cli("metadata", str(src), "--output", str(link), "--force")
    assert_one_line_error(run, "is one of the tool's inputs")
    assert snapshot(src) == before


def test_tokens_out_of_range_is_a_usage_error(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model")
    run = _patch(src, tmp_path / "out", fake_library, "--verify", "--tokens", "1000000000")
    assert run.returncode == 2 and "--tokens" in run.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_unwritable_output_parent(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model")
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        run = _patch(src, parent / "out", fake_library)
        assert_one_line_error(run, str(parent))
    finally:
        parent.chmod(0o700)


def test_unwritable_output_as_a_file(tmp_path, fake_library):
    """An output path below a regular file cannot be made: one line, exit 2 (also as root)."""
    src = make_model_dir(tmp_path / "model")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    run = _patch(src, blocker / "sub" / "out", fake_library)
    assert_one_line_error(run)
    assert blocker.read_text() == "x"


# ---------------------------------------------------------------------------------------------
# Signals: SIGTERM like SIGINT, in the middle of copying a large-ish external-data file

# The child takes SIGINT as from a terminal: a runner started in the background (`cmd &` in a
# script) passes SIGINT on ignored, and a Python started so never turns it into KeyboardInterrupt
# (the tool then rightly keeps ignoring it: nothing to test).
_SLOW_COPY = """
import os, signal, sys, time
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)
marker = Path(sys.argv.pop(1))
real = os.copy_file_range
def slow(src, dst, count, *args):  # 1 MiB at a time, slowly: the copy is caught mid-way
    marker.touch()
    time.sleep(0.05)
    return real(src, dst, min(count, 1 << 20), *args)
os.copy_file_range = slow
from ort_kvlayout.tools.cli import patch_main
sys.exit(patch_main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_mid_copy_leaves_nothing(tmp_path, fake_library, sig):
    if not hasattr(os, "copy_file_range"):
        pytest.skip("no copy_file_range on this platform")
    src = make_model_dir(tmp_path / "model", Variant(external_data=True, data_bytes=48 << 20))
    before = snapshot(src)
    script = tmp_path / "slow_patch.py"
    script.write_text(_SLOW_COPY)
    marker = tmp_path / "copying"
    out = tmp_path / "new" / "deeper" / "out"
    cmd = [sys.executable, str(script), str(marker), str(src), "-o", str(out),
           "--library", str(fake_library), "-q"]  # fmt: skip
    child = subprocess.Popen(cmd, env=_env(), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert child.poll() is None, child.stderr.read() if child.stderr else ""
        assert time.monotonic() < deadline, "the copy never started"
        time.sleep(0.01)
    time.sleep(0.2)  # well inside the copy of the 48 MiB file (about 2.4 s)
    assert child.poll() is None
    child.send_signal(sig)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 128 + sig, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "new").exists()  # no partial output, no parent it made
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "copying",
        "lib",
        "model",
        "slow_patch.py",
    ]
    assert snapshot(src) == before


def test_failure_removes_the_directories_it_made(tmp_path, fake_library, monkeypatch, capsys):
    """A failure while writing (here: the copy) removes the partial output and every parent
    directory the run created; a parent that existed before stays."""
    from ort_kvlayout.tools import patch as patch_mod
    from ort_kvlayout.tools.cli import patch_main

    src = make_model_dir(tmp_path / "model")

    def fail(*_args, **_kw):
        raise OSError(28, "No space left on device", "injected")

    monkeypatch.setattr(patch_mod, "_copy_file", fail)
    (tmp_path / "kept").mkdir()
    out = tmp_path / "kept" / "made" / "also" / "out"
    assert patch_main([str(src), "-o", str(out), "--library", str(fake_library), "-q"]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and len(err.strip().splitlines()) == 1
    assert list((tmp_path / "kept").iterdir()) == []


def test_verify_that_cannot_run_has_its_own_exit_code(tmp_path, fake_library):
    """--verify with a library that cannot load: the output is written, exit 3 (not 1, which
    means the tokens disagree, and not 2, which means nothing was written)."""
    src = make_model_dir(tmp_path / "model")
    run = _patch(src, tmp_path / "out", fake_library, "--verify", "--tokens", "2")
    assert_one_line_error(run, "--verify could not run", code=3)
    assert (tmp_path / "out" / "model.onnx").is_file()
