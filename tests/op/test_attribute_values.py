"""Item 4 of issue 11: every attribute value ORT's com.microsoft op runs means the same in ours,
or the patcher refuses the node up front. A table of every attribute of the op's table and every
value class (0, 1, another positive value, negative, non-finite for floats, the wrong type):
for each, ORT's CPU op and ours run on the same small inputs, and one of these holds:
- the patcher refuses the node (by name; nothing written), or
- ORT refuses the node too (at load or at run), or
- ORT and the patched node both run and agree (float tolerance; NaN where ORT gives NaN).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import reference as ref
from gqa_case import (
    KV_DOMAIN,
    GqaCase,
    build_model,
    make_session,
    op_available,
    run_session,
    with_attribute,
)
from ort_kvlayout.model.gqa_schema import gqa_attribute_types
from ort_kvlayout.tools.patch import UnsupportedNodeError, rewrite_model

pytestmark = pytest.mark.skipif(not op_available()[0], reason=f"op: {op_available()[1]}")

# A chunk with past (causal masking and windows matter) and rotary. No q/k norm weights: ORT's
# CPU op refuses them, so the epsilons are checked only for being accepted with the same result.
_CASE = GqaCase(
    batch=1, kind="chunk", seq=3, past_len=6, num_heads=4, kv_num_heads=2,
    head_size=16, do_rotary=True,
)  # fmt: skip
_BASE_ATTRS = _CASE.attrs()

_WRONG = {"INT": 1.0, "FLOAT": 1, "STRING": 1}
_CLASSES = {
    "INT": {"zero": 0, "one": 1, "positive": 2, "large": 5, "negative": -1, "negative2": -3},
    "FLOAT": {
        "zero": 0.0, "one": 1.0, "positive": 2.5, "large": 1e4, "tiny": 1e-30,
        "negative": -1.0, "nan": math.nan, "inf": math.inf, "-inf": -math.inf,
    },
    "STRING": {"NONE": "NONE", "empty": "", "lower": "none", "INT8": "INT8", "other": "x"},
}  # fmt: skip


def _table() -> list[tuple[str, str, object]]:
    rows = []
    for name, kind in gqa_attribute_types().items():
        if name == "kv_layout":  # not an ORT attribute: the tools' strictness covers it
            continue
        for cls, value in _CLASSES[kind].items():
            rows.append((name, cls, value))
        rows.append((name, "wrong_type", _WRONG[kind]))
    return rows


def _ms_model(name: str, value) -> onnx.ModelProto:
    return onnx.load_from_string(
        with_attribute(build_model(_CASE.feeds(), _BASE_ATTRS), name, value)
    )


def _run(model: onnx.ModelProto, domain: str, layout: int = 0):
    """(output, present_key, present_value), presents as logical BNSH; `layout` is the byte
    order of ours (its past inputs are fed in it)."""
    feeds = dict(_CASE.feeds())
    for name in ("past_key", "past_value"):
        feeds[name] = ref.to_layout(ref.from_layout(feeds[name], 0), layout)
    sess = make_session(model.SerializeToString(), domain)
    out, pk, pv = run_session(sess, feeds)
    return out, ref.from_layout(pk, layout), ref.from_layout(pv, layout)


@pytest.mark.parametrize("layout", [0, 1], ids=["head_major", "seq_major"])
@pytest.mark.parametrize("name,cls,value", _table(), ids=lambda x: str(x))
def test_value_means_what_it_means_in_ort(name, cls, value, layout):
    ms = _ms_model(name, value)
    try:
        want = _run(ms, "com.microsoft")
    except Exception as exc:  # noqa: BLE001 - ORT refuses: any behaviour of ours is fine
        ort_error = str(exc)
    else:
        ort_error = None

    ours = onnx.ModelProto()
    ours.CopyFrom(ms)
    try:
        rewrite_model(ours, layout)  # the patcher's own check and rewrite
    except UnsupportedNodeError as exc:
        assert "gqa" in str(exc)  # refused by node name
        return
    if ort_error is not None:
        return  # ORT refuses the node itself: not a model ORT runs
    got = _run(ours, KV_DOMAIN, layout)
    for what, g, w in zip(("output", "present_key", "present_value"), got, want, strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, what
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=what)
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-4, equal_nan=True, err_msg=what)


def test_base_case_runs_in_both():
    """The table's base node runs in ORT and ours (else every row would pass by refusal)."""
    want = _run(_ms_model("scale", 0.0), "com.microsoft")
    ours = _ms_model("scale", 0.0)
    rewrite_model(ours, 0)
    got = _run(ours, KV_DOMAIN)
    np.testing.assert_allclose(got[0], want[0], rtol=2e-4, atol=2e-4)


# Whole directories through the CLI, seq-major: values ORT runs as "off" patch (exit 0) and the
# patched model generates ORT's tokens (before: exit 0, then refused at session creation);
# values v1 cannot run are refused by node name with exit 2 and no output directory.
@pytest.mark.parametrize(
    "extra",
    [{"smooth_softmax": 2}, {"softcap": -1.0}, {"do_rotary": 1, "rotary_interleaved": 2}],
    ids=str,
)
def test_ort_off_values_patch_and_run_the_same(tmp_path, extra):
    from ort_kvlayout.tools.cli import patch_main
    from ort_kvlayout.tools.reference_loop import Generator
    from synthetic_models import Variant, make_model_dir

    src = make_model_dir(tmp_path / "model", Variant(extra_attrs=extra))
    out = tmp_path / "out"
    assert patch_main([str(src), "-o", str(out), "-q"]) == 0
    prompt = [1, 5, 7, 9, 11, 13]
    a = Generator(src, custom_ops_library=None).generate(prompt, 8)
    b = Generator(out).generate(prompt, 8)
    assert a.tokens == b.tokens
    la, lb = np.stack(a.logits), np.stack(b.logits)
    np.testing.assert_allclose(la, lb, rtol=0, atol=1e-5 * float(np.abs(la).max()))


@pytest.mark.parametrize(
    "extra,reason",
    [
        ({"scale": math.nan}, "non-finite scale"),
        ({"scale": math.inf}, "non-finite scale"),
        ({"softcap": math.inf}, "softcap=inf"),
    ],
    ids=str,
)
def test_unsupported_values_refused_by_cli(tmp_path, extra, reason, capsys):
    from ort_kvlayout.tools.cli import patch_main
    from synthetic_models import Variant, make_model_dir

    src = make_model_dir(tmp_path / "model", Variant(extra_attrs=extra))
    out = tmp_path / "out"
    assert patch_main([str(src), "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert "/model/layers.0/attn/GroupQueryAttention" in err and reason in err, err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
