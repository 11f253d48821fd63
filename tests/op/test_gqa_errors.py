"""Invalid inputs to ai.kvlayout::GroupQueryAttention raise an onnxruntime error (at session
creation or at run) whose message names the problem (the input or attribute name)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gqa_case import (
    KV_DOMAIN,
    GqaCase,
    build_model,
    compare,
    make_session,
    run_session,
    with_attribute,
)
from onnx import TensorProto, helper

_BASE = GqaCase(batch=2, kind="decode", past_len=5, num_heads=4, kv_num_heads=2, head_size=16)


def _raise(feeds, attrs, layout=1, match="", shared=False, input_types=None):
    """Builds, creates and runs; the error may come at either point, and must match."""
    with pytest.raises(Exception, match=match) as ei:
        model = build_model(feeds, attrs, KV_DOMAIN, layout, input_types=input_types)
        sess = make_session(model, KV_DOMAIN)
        run_session(sess, feeds, shared)
    return ei


def _f(**kw):
    f = dict(_BASE.feeds())
    f.update(kw)
    return f


A = _BASE.attrs()
F32 = np.float32
COS = np.ones((32, 8), F32)


@pytest.mark.parametrize("layout", [2, -1, 7])
def test_kv_layout_out_of_range(layout):
    _raise(_f(), A, layout=layout, match=r"kv_layout")


@pytest.mark.parametrize("layout", [0, 1])
def test_heads_not_multiple(layout):
    _raise(_f(), dict(A, kv_num_heads=3), layout, match=r"num_heads|kv_num_heads")


@pytest.mark.parametrize("attrs", [dict(A, num_heads=0), dict(A, kv_num_heads=0)])
def test_zero_heads(attrs):
    _raise(_f(), attrs, match=r"num_heads")


@pytest.mark.parametrize(
    "name,feeds,match",
    [
        ("query_rank2", _f(query=np.zeros((2, 64), F32)), r"query"),
        ("query_rank4", _f(query=np.zeros((2, 1, 4, 16), F32)), r"query"),
        ("query_hidden", _f(query=np.zeros((2, 1, 60), F32)), r"query|head_size|hidden"),
        ("key_rank2", _f(key=np.zeros((2, 32), F32), value=np.zeros((2, 32), F32)), r"key"),
        ("key_hidden", _f(key=np.zeros((2, 1, 24), F32), value=np.zeros((2, 1, 24), F32)),
         r"key|kv_num_heads|head_size"),
        ("key_seq", _f(key=np.zeros((2, 2, 32), F32), value=np.zeros((2, 2, 32), F32)),
         r"key|sequence"),
        ("value_shape", _f(value=np.zeros((2, 1, 16), F32)), r"value"),
        ("past_rank3", _f(past_key=np.zeros((2, 2, 80), F32), past_value=np.zeros((2, 2, 80), F32)),
         r"past_key"),
        ("past_kv_heads", _f(past_key=np.zeros((2, 3, 5, 16), F32),
                             past_value=np.zeros((2, 3, 5, 16), F32)), r"past_key"),
        ("past_head_size", _f(past_key=np.zeros((2, 2, 5, 8), F32),
                              past_value=np.zeros((2, 2, 5, 8), F32)), r"past_key"),
        ("past_kv_differ", _f(past_value=np.zeros((2, 2, 7, 16), F32)), r"past_value|past_key"),
        ("past_too_short", _f(past_key=np.zeros((2, 2, 3, 16), F32),
                              past_value=np.zeros((2, 2, 3, 16), F32)),
         r"past_key|total_sequence_length"),
        ("batch_key", _f(key=np.zeros((3, 1, 32), F32), value=np.zeros((3, 1, 32), F32)),
         r"batch|key"),
        ("batch_past", _f(past_key=np.zeros((3, 2, 5, 16), F32),
                          past_value=np.zeros((3, 2, 5, 16), F32)), r"batch|past_key"),
        ("batch_seqlens", _f(seqlens_k=np.array([5, 5, 5], np.int32)), r"seqlens_k"),
        ("seqlens_negative", _f(seqlens_k=np.array([-1, 5], np.int32)), r"seqlens_k"),
        ("seqlens_huge", _f(seqlens_k=np.array([10**6, 5], np.int32)), r"seqlens_k"),
        ("seqlens_beyond_total", _f(seqlens_k=np.array([5, 6], np.int32)), r"seqlens_k"),
        ("total_two_elems", _f(total_sequence_length=np.array([6, 6], np.int32)),
         r"total_sequence_length"),
        ("head_sink_len", _f(head_sink=np.ones(3, F32)), r"head_sink"),
        ("bias_last_dim", _f(attention_bias=np.ones((2, 4, 1, 5), F32)), r"attention_bias"),
        ("bias_batch", _f(attention_bias=np.ones((3, 4, 1, 6), F32)), r"attention_bias"),
        ("bias_rank3", _f(attention_bias=np.ones((4, 1, 6), F32)), r"attention_bias"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)  # fmt: skip
@pytest.mark.parametrize("layout", [0, 1])
def test_bad_shapes(name, feeds, match, layout):
    _raise(feeds, A, layout, match=match)


@pytest.mark.parametrize("missing", ["key", "value"])
def test_only_one_of_key_value(missing):
    _raise(_f(**{missing: None}), A, match=r"key|value")


def test_only_one_of_past():
    _raise(_f(past_value=None), A, match=r"past_key|past_value")


def test_rotary_without_caches():
    _raise(_f(), dict(A, do_rotary=1), match=r"cos_cache|sin_cache")
    _raise(_f(cos_cache=COS), dict(A, do_rotary=1), match=r"cos_cache|sin_cache")


def test_rotary_bad_caches():
    _raise(_f(cos_cache=COS, sin_cache=np.ones((33, 8), F32)), dict(A, do_rotary=1),
           match=r"cos_cache|sin_cache")  # fmt: skip
    _raise(_f(cos_cache=np.ones((32, 12), F32), sin_cache=np.ones((32, 12), F32)),
           dict(A, do_rotary=1), match=r"cos_cache|rotary")  # fmt: skip
    _raise(_f(cos_cache=np.ones((3, 8), F32), sin_cache=np.ones((3, 8), F32)),
           dict(A, do_rotary=1), match=r"cos_cache|position")  # fmt: skip


def test_position_ids_beyond_cos_cache():
    f = _f(cos_cache=COS, sin_cache=COS, position_ids=np.array([[1000], [2]], np.int64))
    _raise(f, dict(A, do_rotary=1), match=r"position_ids|cos_cache")


@pytest.mark.parametrize("layout", [0, 1])
def test_shared_total_beyond_capacity(layout):
    c = _BASE.replace(shared=True, extra_capacity=2, kv_layout=layout)
    f = dict(c.feeds(), total_sequence_length=np.array(100, np.int32))
    _raise(f, A, layout, match=r"total_sequence_length|capacity|present_key", shared=True)


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("seqlen", [10**6, 2**31 - 1, -5])
def test_shared_seqlens_out_of_range_raises(layout, seqlen):
    c = _BASE.replace(shared=True, extra_capacity=2, kv_layout=layout)
    f = dict(c.feeds(), seqlens_k=np.array([seqlen, 3], np.int32))
    _raise(f, A, layout, match=r"seqlens_k", shared=True)


@pytest.mark.parametrize("binding", ["mixed", "crossed", "one_present"])
@pytest.mark.parametrize("layout", [0, 1])
def test_presents_bound_across_caches_are_refused(binding, layout):
    """IO binding may put the presents anywhere: one shared with its past and the other not,
    each over the other's past (crossed: it ran and mixed the caches), or both presents on one
    buffer. Each is refused by name before any row is written."""
    import onnxruntime as ort

    c = GqaCase(batch=2, kind="decode", past_len=5, num_heads=4, kv_num_heads=2, head_size=16,
                shared=True, extra_capacity=3, kv_layout=layout)  # fmt: skip
    feeds = {k: np.array(v, copy=True) for k, v in c.feeds().items() if v is not None}
    sess = make_session(build_model(c.feeds(), c.attrs(), KV_DOMAIN, layout), KV_DOMAIN)
    io = sess.io_binding()
    values = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in feeds.items()}
    for name, value in values.items():
        io.bind_ortvalue_input(name, value)
    io.bind_output("output")
    key, value = {
        "mixed": (values["past_key"], None),
        "crossed": (values["past_value"], values["past_key"]),
        "one_present": (values["past_key"], values["past_key"]),
    }[binding]
    io.bind_ortvalue_output("present_key", key)
    if value is None:
        io.bind_output("present_value")
    else:
        io.bind_ortvalue_output("present_value", value)
    before = {k: v.copy() for k, v in feeds.items()}
    with pytest.raises(Exception, match=r"present_key|past_key/present_key"):
        sess.run_with_iobinding(io)
    for name in ("past_key", "past_value"):  # nothing was written
        assert np.array_equal(values[name].numpy(), before[name])


def test_shared_huge_seqlens_does_not_crash_process():
    """In a child process, so a crash shows as a signal instead of killing the test run."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {sys.path[0]!r})
        import numpy as np
        from gqa_case import GqaCase, KV_DOMAIN, build_model, make_session, run_session
        for layout in (0, 1):
            c = GqaCase(batch=2, kind="decode", past_len=5, head_size=16, shared=True,
                        extra_capacity=2, kv_layout=layout, do_rotary=True)
            f = dict(c.feeds(), seqlens_k=np.array([10**6, 2**31 - 1], np.int32),
                     total_sequence_length=np.array(2**31 - 1, np.int32))
            sess = make_session(build_model(f, c.attrs(), KV_DOMAIN, layout), KV_DOMAIN)
            try:
                run_session(sess, f, shared=True)
            except Exception as e:
                print("RAISED", type(e).__name__)
            else:
                print("NO ERROR")
        """
    )
    import os

    helpers = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")
    code = code.replace(repr(sys.path[0]), repr(helpers))
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert p.returncode == 0, f"child died (rc {p.returncode}): {p.stderr[-2000:]}"
    assert p.stdout.count("RAISED") == 2, p.stdout + p.stderr[-2000:]


def test_dtype_mismatch_query_vs_past():
    c = _BASE.replace(dtype="fp16")
    f = dict(c.feeds())
    f["past_key"] = f["past_key"].astype(F32)
    f["past_value"] = f["past_value"].astype(F32)
    _raise(f, A, match=r"past_key|past_value|type")


def test_dtype_mismatch_query_vs_key():
    f = _f(key=_BASE.feeds()["key"].astype(np.float16))
    _raise(f, A, match=r"key|type")


def test_quantized_attrs_with_float_cache_refused():
    f = _f(k_scale=np.ones(1, F32), v_scale=np.ones(1, F32))
    a = dict(A, k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR", kv_cache_bit_width=8)
    _raise(f, a, match=r"k_scale|quant")
    u8 = np.zeros((2, 2, 5, 16), np.uint8)
    _raise(_f(past_key=u8, past_value=u8, k_scale=np.ones(1, F32), v_scale=np.ones(1, F32)), a,
           match=r"k_scale|quant|past_key|present_key")  # fmt: skip


def test_qk_output_refused():
    with pytest.raises(Exception, match=r"qk_output|output_qk"):
        f = _f()
        model = build_model(f, dict(A, qk_output=1), KV_DOMAIN, 1, n_outputs=4)
        sess = make_session(model, KV_DOMAIN)
        sess.run(None, {k: v for k, v in f.items() if v is not None})


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("shared", [False, True])
def test_chunk_batch_without_query_seqlens(layout, shared):
    """Chunked prefill (S > 1 with past, S < total) with batch 2 and no query_seqlens: ORT
    refuses it ("batch_size must be 1 when sequence_length > 1 and past context is given"); so
    does ours, naming query_seqlens as what makes it valid."""
    c = GqaCase(batch=2, seq=3, kind="chunk", past_len=7, pad=2, kv_layout=layout, shared=shared)
    ei = _raise(c.feeds(), c.attrs(), layout, match=r"query_seqlens", shared=shared)
    msg = str(ei.value)
    assert re.search(r"chunked prefill.*batch 2.*needs input 'query_seqlens'", msg), msg
    assert re.search(r"batch must be 1", msg), msg
    # The same chunk with query_seqlens is valid, and right.
    ok = c.replace(query_seqlens=True)
    compare(ok, ok.run(KV_DOMAIN), ok.reference())


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kind", ["decode", "prompt"])
def test_seqlens_rank2_refused(layout, batch, kind):
    """seqlens_k of shape (B, 1) (B elements, rank 2): the contract says (B); ORT lets it
    through, ours names the input and the rule."""
    c = GqaCase(batch=batch, seq=4 if kind == "prompt" else 1, kind=kind, past_len=5,
                kv_layout=layout)  # fmt: skip
    f = dict(c.feeds(), seqlens_k=c.feeds()["seqlens_k"].reshape(batch, 1))
    ei = _raise(f, c.attrs(), layout, match=r"seqlens_k")
    assert re.search(rf"'seqlens_k' must have rank 1, shape \(batch,\) = \({batch},\), got "
                     rf"shape \({batch}, 1\)", str(ei.value)), str(ei.value)  # fmt: skip


def test_query_seqlens_out_of_range():
    c = GqaCase(batch=2, seq=3, kind="chunk", past_len=7, kv_layout=1, query_seqlens=True)
    _raise(dict(c.feeds(), query_seqlens=np.array([4, 3], np.int32)), c.attrs(), 1,
           match=r"query_seqlens")  # fmt: skip
    _raise(dict(c.feeds(), query_seqlens=np.array([-1, 3], np.int32)), c.attrs(), 1,
           match=r"query_seqlens")  # fmt: skip


def test_sliding_window_cache_needs_window():
    _raise(_f(), dict(A, sliding_window_cache=1), match=r"local_window_size|sliding_window")
    _raise(_f(), dict(A, sliding_window_cache=1, local_window_size=8),
           match=r"local_window_size|capacity|sliding_window_cache")  # fmt: skip


def test_causal_zero_with_window():
    _raise(_f(), dict(A, causal=0, local_window_size=3), match=r"causal|local_window_size")


def test_norm_weight_sizes():
    f = _f(q_norm_weight=np.ones(8, F32), k_norm_weight=np.ones(8, F32))
    _raise(f, A, match=r"q_norm_weight|k_norm_weight")
    _raise(_f(q_norm_weight=np.ones(16, F32)), A, match=r"q_norm_weight|k_norm_weight")


def test_valid_base_case_runs():
    """The base of every error case is itself valid (so the errors above are the edits)."""
    for layout in (0, 1):
        c = _BASE.replace(kv_layout=layout)
        run_session(make_session(build_model(c.feeds(), A, KV_DOMAIN, layout), KV_DOMAIN),
                    c.feeds())  # fmt: skip


# --------------------------------------------------------------------------------------------
# Attribute types: a custom op has no schema ORT checks, so ours checks what ORT's schema check
# does for com.microsoft::GroupQueryAttention: at session creation, naming the attribute, the
# expected and the actual type.
# --------------------------------------------------------------------------------------------
def _ort_gqa_attr_types() -> dict[str, str]:
    """{attribute: type name} from ORT's own com.microsoft::GroupQueryAttention schema."""
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    for s in C.get_all_operator_schema():
        if s.name == "GroupQueryAttention" and s.domain == "com.microsoft":
            return {n: a.type.name for n, a in s.attributes.items()}
    raise AssertionError("onnxruntime has no com.microsoft::GroupQueryAttention schema")


_TYPED_VALUES = {
    "INT": 1,
    "FLOAT": 1.0,
    "STRING": "1",
    "INTS": [1],
    "FLOATS": [1.0],
    "TENSOR": helper.make_tensor("t", TensorProto.FLOAT, [1], [1.0]),
}
_ATTR_TYPES = dict(_ort_gqa_attr_types(), kv_layout="INT")


@pytest.mark.parametrize(
    "name,actual",
    [(n, t) for n, want in sorted(_ATTR_TYPES.items()) for t in _TYPED_VALUES if t != want],
)
def test_attribute_of_wrong_type_refused_at_session_creation(name, actual):
    """Each attribute of ORT's schema (+ kv_layout) given as each other type: ORT's schema
    check refuses it on a com.microsoft node, ours at session creation with the types named
    (before: kv_layout=1.0 ran head-major, scale as INT was ignored)."""
    want = _ATTR_TYPES[name]
    value = _TYPED_VALUES[actual]
    ours = with_attribute(build_model(_f(), A, KV_DOMAIN, 1), name, value)
    with pytest.raises(Exception) as ei:
        make_session(ours, KV_DOMAIN)
    msg = str(ei.value)
    assert f"attribute '{name}' must be of type {want}, got {actual}" in msg, msg
    if name != "kv_layout":  # the oracle: ORT refuses the same node in its own domain
        theirs = with_attribute(build_model(_f(), A), name, value)
        with pytest.raises(Exception, match=rf"Mismatched attribute type.*{name}"):
            make_session(theirs)


def test_attribute_types_match_ort_schema():
    """The right type with the default value is accepted for every attribute ORT's schema
    knows (so the table above and the op agree with ORT on the expected types)."""
    defaults = {"INT": 0, "FLOAT": 0.0, "STRING": "NONE"}
    neutral = {"causal": 1, "local_window_size": -1, "smooth_softmax": -1, "kv_layout": 1}
    for name, want in sorted(_ATTR_TYPES.items()):
        if name in ("num_heads", "kv_num_heads"):
            continue
        value = neutral.get(name, defaults[want])
        model = with_attribute(build_model(_f(), A, KV_DOMAIN, 1), name, value)
        run_session(make_session(model, KV_DOMAIN), _f())


@pytest.mark.parametrize("name", ["num_heads", "kv_num_heads"])
def test_required_attribute_missing(name):
    model = with_attribute(build_model(_f(), A, KV_DOMAIN, 1), name, None)
    with pytest.raises(Exception, match=rf"attribute '{name}' is required"):
        make_session(model, KV_DOMAIN)


def test_direct_call_checks_attribute_types():
    """The pybind entry (tests, benchmarks) reads a dict with the same strictness."""
    from ort_kvlayout import _C

    c = _BASE.replace(kv_layout=1)
    with pytest.raises(ValueError, match=r"attribute 'kv_layout' must be of type INT, got FLOAT"):
        _C.gqa_cpu(c.feeds(), dict(A, kv_layout=1.0))
    with pytest.raises(ValueError, match=r"attribute 'scale' must be of type FLOAT, got INT"):
        _C.gqa_cpu(c.feeds(), dict(A, scale=1, kv_layout=1))
