"""Length values on CUDA (docs/CONTRACT.md, "Length values on CUDA"): seqlens_k, query_seqlens
and position_ids live on the device, so the CUDA op checks them in its prepare/decode kernel and
records the first violation. Default mode: the node's next Run fails with the CPU op's message
for the same value, or ort_kvlayout.take_length_error() returns it (what a CUDA graph replay
needs); strict mode (ORT_KVLAYOUT_STRICT_LENGTHS=1): the same Run fails with that message.

The oracle of every message is the CPU op fed the same values. The first tests run anywhere
(the value cases fail on the CPU, the Python call and the exported symbol); the rest need a GPU.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import ort_kvlayout
import pytest
from gqa_case import KV_DOMAIN, GqaCase, build_model, make_session, run_session

I32_MAX, I32_MIN = 2**31 - 1, -(2**31)
STRICT_ENV = "ORT_KVLAYOUT_STRICT_LENGTHS"


def _decode(**kw):
    return GqaCase(batch=2, kind="decode", past_len=11, pad=3, head_size=64, dtype="fp16",
                   do_rotary=True, **kw)  # fmt: skip


def _chunk(**kw):
    kw.setdefault("batch", 1)
    return GqaCase(seq=4, kind="chunk", past_len=11, pad=3 if kw["batch"] > 1 else 0,
                   head_size=64, dtype="fp16", do_rotary=True, **kw)  # fmt: skip


_PROMPT = GqaCase(batch=2, seq=7, kind="prompt", pad=3, head_size=64, dtype="fp16", do_rotary=True)

# name -> (case, {input: {batch entry (or (b, i)): bad value}}, the rule's words). Total length
# of the decode cases: 12 (seqlens_k in [0, 11]); chunk: 15; prompt: 7.
VALUE_CASES = {
    "seqlens_negative": (_decode(), {"seqlens_k": {0: -5}}, r"'seqlens_k'\[0\] = -5 is out of range"),
    "seqlens_huge": (_decode(), {"seqlens_k": {0: 10**6}}, r"'seqlens_k'\[0\] = 1000000 is out"),
    "seqlens_i32_max": (_decode(), {"seqlens_k": {1: I32_MAX}}, r"'seqlens_k'\[1\] = 2147483647"),
    "seqlens_one_past_total": (_decode(), {"seqlens_k": {0: 12}}, r"= 12 is out of range.*\[0, 11\]"),
    "seqlens_shared_past_capacity": (_decode(shared=True, extra_capacity=5), {"seqlens_k": {0: 16}},
                                     r"'seqlens_k'\[0\] = 16 is out of range"),
    "seqlens_both_bad": (_decode(), {"seqlens_k": {0: I32_MIN, 1: I32_MAX}}, r"'seqlens_k'\[[01]\]"),
    "chunk_seqlens_below_seq": (_chunk(), {"seqlens_k": {0: 1}}, r"'seqlens_k'\[0\] = 1 is too small"),
    "chunk_seqlens_negative": (_chunk(), {"seqlens_k": {0: -100}}, r"'seqlens_k'\[0\] = -100 is out"),
    "prompt_seqlens_huge": (_PROMPT, {"seqlens_k": {0: 10**6}}, r"'seqlens_k'\[0\] = 1000000 is out"),
    "prompt_seqlens_negative": (_PROMPT, {"seqlens_k": {1: -7}}, r"'seqlens_k'\[1\] = -7 is out"),
    "position_ids_huge": (_decode(position_ids=True), {"position_ids": {(0, 0): 10**6}},
                          r"'position_ids' gives position 1000000 for batch 0 token 0"),
    "position_ids_negative": (_decode(position_ids=True), {"position_ids": {(1, 0): -3}},
                              r"'position_ids' gives position -3 for batch 1 token 0"),
    "query_seqlens_above_seq": (_chunk(batch=2, query_seqlens=True), {"query_seqlens": {0: 9}},
                                r"'query_seqlens'\[0\] = 9 is out of range"),
    "query_seqlens_negative": (_chunk(batch=2, query_seqlens=True), {"query_seqlens": {1: -1}},
                               r"'query_seqlens'\[1\] = -1 is out of range"),
    "past_beyond_capacity": (_chunk(batch=2, query_seqlens=True),
                             {"query_seqlens": {0: 0}, "seqlens_k": {0: 14}},
                             (r"'seqlens_k'\[0\] = 14 implies a past of 15 tokens, beyond the "
                              r"capacity of 'past_key' \(11\)")),
}  # fmt: skip


def _bad_feeds(case: GqaCase, edits: dict) -> dict:
    f = dict(case.feeds())
    for name, values in edits.items():
        arr = np.array(f[name], copy=True)
        for where, v in values.items():
            arr[where] = v
        f[name] = arr
    return f


def _single_edits(edits: dict) -> list[dict]:
    """Each bad value alone (with the case's other edits): the messages the CPU op may give when
    several batch entries are bad (the device records whichever it finds first)."""
    multi = [n for n, v in edits.items() if len(v) > 1]
    if not multi:
        return [edits]
    name = multi[0]
    return [dict(edits, **{name: {w: v}}) for w, v in edits[name].items()]


def _op_message(exc: BaseException) -> str:
    m = re.search(r"ai\.kvlayout::GroupQueryAttention: .*", str(exc))
    assert m, f"no op message in: {exc}"
    return m.group(0).strip()


def _cpu_messages(case: GqaCase, edits: dict) -> list[str]:
    """The CPU op's message for these values (the oracle), one per bad value."""
    out = []
    for single in _single_edits(edits):
        feeds = _bad_feeds(case, single)
        sess = make_session(build_model(feeds, case.attrs(), KV_DOMAIN, case.kv_layout), KV_DOMAIN)
        with pytest.raises(Exception) as ei:
            run_session(sess, feeds, case.shared)
        out.append(_op_message(ei.value))
    return out


# --------------------------------------------------------------------------------------------
# Anywhere
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(VALUE_CASES))
def test_value_case_fails_on_cpu_with_the_rule(name):
    """Each value case is invalid on the CPU op (so the CUDA checks below test real cases),
    with a message naming the input, the batch entry, the value and the bound."""
    case, edits, words = VALUE_CASES[name]
    for layout in (0, 1):
        for msg in _cpu_messages(case.replace(kv_layout=layout), edits):
            assert re.search(words, msg), msg


def test_take_length_error_none_without_cuda_records():
    """No CUDA op instance has recorded anything (a CPU session ran, or none did): None. On a
    build without CUDA it is always None."""
    case, edits, _ = VALUE_CASES["seqlens_negative"]
    _cpu_messages(case, edits)  # the library is loaded, a CPU node ran with bad values
    assert ort_kvlayout.take_length_error() is None
    ort_kvlayout.check_length_error("step 0")  # raises nothing


def test_library_exports_the_take_function():
    lib = ctypes.CDLL(ort_kvlayout.library_path())
    fn = lib.OrtKvlayoutTakeLengthError
    fn.argtypes, fn.restype = [ctypes.c_char_p, ctypes.c_size_t], ctypes.c_size_t
    buf = ctypes.create_string_buffer(64)
    assert fn(buf, 64) == 0 and buf.value == b""
    out = subprocess.run(["nm", "-D", "--defined-only", ort_kvlayout.library_path()],
                         capture_output=True, text=True, check=False)  # fmt: skip
    if out.returncode == 0:
        exported = {ln.split()[-1] for ln in out.stdout.splitlines() if " T " in ln}
        expected = {"RegisterCustomOps", "OrtKvlayoutTakeLengthError"}
        if ort_kvlayout.build_info().get("cuda"):  # CUDA builds: what cuDNN served
            expected.add("OrtKvlayoutCudnnStatus")
        assert exported == expected, exported


def test_take_finds_the_library_only_when_loaded():
    """In a fresh process that never loaded the library, the call loads nothing (RTLD_NOLOAD)."""
    code = textwrap.dedent(
        """
        import ort_kvlayout
        assert ort_kvlayout.take_length_error() is None
        with open("/proc/self/maps") as f:
            print("LOADED" if "libort_kvlayout" in f.read() else "NOT LOADED")
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "NOT LOADED", p.stdout + p.stderr[-1000:]


# --------------------------------------------------------------------------------------------
# On the GPU
# --------------------------------------------------------------------------------------------
from gpu_util import (
    SKIP_REASON,
    bind_and_run,
    from_device,
    new_cuda_session,
    to_device,
    update,
)

gpu = pytest.mark.skipif(SKIP_REASON is not None, reason=f"GPU tests: {SKIP_REASON}")


def _cuda_session(case: GqaCase, strict: bool, monkeypatch):
    if strict:
        monkeypatch.setenv(STRICT_ENV, "1")
    else:
        monkeypatch.delenv(STRICT_ENV, raising=False)
    model = build_model(case.feeds(), case.attrs(), KV_DOMAIN, case.kv_layout)
    return new_cuda_session(model, KV_DOMAIN)  # the variable is read at kernel creation


def _run(sess, case: GqaCase, feeds: dict):
    """One Run, waited for (its outputs copied to the host)."""
    outs, _ = bind_and_run(sess, feeds, case.attrs(), case.shared)
    return [from_device(o) for o in outs]


def _each_value_case(test):
    """Marks a GPU test to run for every value case, in both layouts."""
    test = pytest.mark.parametrize("name", list(VALUE_CASES))(test)
    test = pytest.mark.parametrize("layout", [0, 1])(test)
    return pytest.mark.gpu(gpu(test))


def _value_case(name: str, layout: int, strict: bool, monkeypatch):
    """(case, edits, the CPU op's messages, a CUDA session in the mode) for the value case
    ``name`` in ``layout``, with nothing left recorded from other tests."""
    case, edits, _ = VALUE_CASES[name]
    case = case.replace(kv_layout=layout)
    want = _cpu_messages(case, edits)
    sess = _cuda_session(case, strict, monkeypatch)
    ort_kvlayout.take_length_error()  # nothing left over from other tests
    return case, edits, want, sess


def _assert_reported(got: str, want: list[str]):
    assert any(w in got for w in want), f"CUDA reported:\n  {got}\nthe CPU op says:\n  " + (
        "\n  ".join(want)
    )


@_each_value_case
def test_default_mode_next_run_fails(name, layout, monkeypatch):
    """The bad Run completes (lengths clamped on the device); the node's next Run, with valid
    values, fails with the CPU op's message; the record is then clear: the Run after works."""
    case, edits, want, sess = _value_case(name, layout, False, monkeypatch)
    try:
        _run(sess, case, _bad_feeds(case, edits))
    except Exception as e:
        raise AssertionError(f"default mode: the bad Run itself failed: {e}") from e
    with pytest.raises(Exception) as ei:
        _run(sess, case, case.feeds())
    _assert_reported(str(ei.value), want)
    assert "earlier Run of this node" in str(ei.value)
    assert ort_kvlayout.take_length_error() is None
    _run(sess, case, case.feeds())


@_each_value_case
def test_default_mode_python_call_returns_record(name, layout, monkeypatch):
    """After the bad Run, take_length_error() returns the CPU op's message (and the node's
    name) and clears the record: the node's next Run works."""
    case, edits, want, sess = _value_case(name, layout, False, monkeypatch)
    _run(sess, case, _bad_feeds(case, edits))
    got = ort_kvlayout.take_length_error()
    assert got is not None, "no violation recorded"
    _assert_reported(got, want)
    assert "(recorded on the GPU by node '" in got, got
    assert ort_kvlayout.take_length_error() is None
    _run(sess, case, case.feeds())
    assert ort_kvlayout.take_length_error() is None
    with pytest.raises(ort_kvlayout.LengthError, match=re.escape(want[0][:40])):
        _run(sess, case, _bad_feeds(case, _single_edits(edits)[0]))
        ort_kvlayout.check_length_error("step 7")


@_each_value_case
def test_strict_mode_same_run_fails(name, layout, monkeypatch):
    case, edits, want, sess = _value_case(name, layout, True, monkeypatch)
    with pytest.raises(Exception) as ei:
        _run(sess, case, _bad_feeds(case, edits))
    got = _op_message(ei.value)
    assert got in want, f"strict CUDA: {got}\nCPU: {want}"  # the same words, the same Run
    _run(sess, case, case.feeds())  # nothing recorded behind: the next Run works
    assert ort_kvlayout.take_length_error() is None


@pytest.mark.gpu
@gpu
def test_strict_variable_other_values_refused(monkeypatch):
    case = _decode()
    monkeypatch.setenv(STRICT_ENV, "yes")
    with pytest.raises(Exception, match=r"ORT_KVLAYOUT_STRICT_LENGTHS must be 0 or 1, got 'yes'"):
        new_cuda_session(build_model(case.feeds(), case.attrs(), KV_DOMAIN, 1), KV_DOMAIN)


# ---- CUDA graphs: a replay runs no host code of the op -----------------------------------------
def _graph_rig(case: GqaCase):
    """A decode session under ORT's CUDA graph capture with every input a fixed device value
    (past/present shared), as onnxruntime-genai binds them."""
    f = case.feeds()
    sess = new_cuda_session(build_model(f, case.attrs(), KV_DOMAIN, case.kv_layout), KV_DOMAIN,
                            graph=True)  # fmt: skip
    io = sess.io_binding()
    dev = {}
    for k, v in f.items():
        if v is None:
            continue
        if k == "total_sequence_length":
            io.bind_cpu_input(k, np.asarray(v))
            continue
        dev[k] = to_device(np.asarray(v))
        io.bind_ortvalue_input(k, dev[k])
    io.bind_ortvalue_output("present_key", dev["past_key"])
    io.bind_ortvalue_output("present_value", dev["past_value"])
    q = np.asarray(f["query"])
    out = to_device(np.zeros((q.shape[0], 1, case.num_heads * case.head_size), q.dtype))
    io.bind_ortvalue_output("output", out)
    return sess, io, dev, out


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("name", ["seqlens_huge", "seqlens_negative", "position_ids_huge"])
def test_graph_replay_reported_by_python_call(name, layout, monkeypatch):
    """Warm-up runs, capture, replays: a replay with a bad value in the bound device input
    completes (no host code runs), and take_length_error() returns the CPU op's message; after
    the value is fixed, replays record nothing."""
    monkeypatch.delenv(STRICT_ENV, raising=False)
    case, edits, _ = VALUE_CASES[name]
    case = case.replace(kv_layout=layout, shared=True, extra_capacity=5)
    want = _cpu_messages(case, edits)
    sess, io, dev, out = _graph_rig(case)
    ort_kvlayout.take_length_error()
    for _ in range(4):  # ORT: 2 regular runs, then capture, then replay
        sess.run_with_iobinding(io)
        from_device(out)
        assert ort_kvlayout.take_length_error() is None
    bad = _bad_feeds(case, edits)
    for k in edits:
        update(dev[k], np.asarray(bad[k]))
    sess.run_with_iobinding(io)  # a replay: succeeds
    from_device(out)
    got = ort_kvlayout.take_length_error()
    assert got is not None, "a replay's violation was not recorded"
    _assert_reported(got, want)
    for k in edits:
        update(dev[k], np.asarray(case.feeds()[k]))
    sess.run_with_iobinding(io)
    from_device(out)
    assert ort_kvlayout.take_length_error() is None


@pytest.mark.gpu
@gpu
def test_strict_mode_refuses_graph_capture():
    """Strict mode copies and synchronizes, which a capture cannot contain: the capturing Run
    fails and the reason (strict length checks) reaches the user, in the error or, where ORT
    replaces the node's error by its own end-of-capture failure (onnxruntime-gpu 1.31), on
    stderr; no Run ever returns a wrong output (never a replay of a graph that lacks the op).
    In a child process: a failed capture may leave the process's CUDA state unusable."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        sys.path.insert(0, {here!r})
        import test_cuda_length_errors as t
        case = t._decode(shared=True, extra_capacity=5)
        want = case.reference()[0]
        sess, io, dev, out = t._graph_rig(case)
        for i in range(5):
            try:
                sess.run_with_iobinding(io)
                got = t.from_device(out).astype(np.float64)
                ok = np.allclose(got, want, atol=3e-3, rtol=3e-3)
                print("RUN", i, "ok" if ok else "WRONG", flush=True)
            except Exception as e:
                print("RUN", i, "raised", str(e).replace("\\n", " "), flush=True)
        """
    )
    env = dict(os.environ, ORT_KVLAYOUT_STRICT_LENGTHS="1", PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       check=False, env=env)  # fmt: skip
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RUN")]
    assert len(lines) == 5, p.stdout + p.stderr[-2000:]
    assert any("raised" in ln for ln in lines), "\n".join(lines)
    assert not any("WRONG" in ln for ln in lines), "\n".join(lines)
    reported = "\n".join(ln for ln in lines if "raised" in ln) + p.stderr
    assert "strict length checks" in reported and "CUDA graph capture" in reported, reported[-3000:]
