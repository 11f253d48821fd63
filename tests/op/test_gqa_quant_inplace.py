"""An int8 cache read in place by the CPU token-generation kernel (csrc/cpu/gqa_cpu.cc, Int8Rows):
codes widened in registers, the static K scales folded into the queries, the V scales applied to
the output (per channel / tensor) or to the weights (PER_TOKEN), the PER_TOKEN K scales to the
scores. The kernel takes that path where a head's rows form one micro-block (decode, short
chunks) and the head size fills the vector step (H = 32, 64, 128 here; 16 and 24 elsewhere
take the dequantizing path at AVX-512). Checked with the quantized suites' own checks (cache
bytes equal ORT 1.32 / the oracle, output within tolerance), at every CPU level this machine
supports: the quantized suites run once per level in a child process."""

from __future__ import annotations

import numpy as np
import pytest
import test_gqa_pertoken as pt
import test_gqa_quant as qt
from gqa_case import GqaCase, op_available
from test_cpu_isa import LEVELS, _child, _info, _require

pytestmark = pytest.mark.skipif(not op_available()[0], reason=op_available()[1])

# (N, Nkv, H, step): SmolLM2's heads at B=4 with a past of several tiles (key splits), one KV
# head of many queries, head size 128, and chunks whose rows share a micro-block (partial blocks).
SHAPES = {
    "decode_9_3_64_b4": {
        "num_heads": 9,
        "kv_num_heads": 3,
        "head_size": 64,
        "kind": "decode",
        "past_len": 300,
        "batch": 4,
        "pad": 5,
    },
    "decode_8_1_32": {
        "num_heads": 8,
        "kv_num_heads": 1,
        "head_size": 32,
        "kind": "decode",
        "past_len": 70,
        "batch": 2,
        "pad": 3,
    },
    "decode_4_2_128": {
        "num_heads": 4,
        "kv_num_heads": 2,
        "head_size": 128,
        "kind": "decode",
        "past_len": 129,
        "batch": 1,
    },
    "chunk_6_3_64": {
        "num_heads": 6,
        "kv_num_heads": 3,
        "head_size": 64,
        "kind": "chunk",
        "seq": 2,
        "past_len": 65,
        "batch": 2,
        "pad": 3,
        "query_seqlens": True,
    },
    "chunk_4_2_64_window_softcap": {
        "num_heads": 4,
        "kv_num_heads": 2,
        "head_size": 64,
        "kind": "chunk",
        "seq": 3,
        "past_len": 40,
        "local_window_size": 20,
        "softcap": 4.0,
    },
    "decode_sliding_window_cache": {
        "num_heads": 9,
        "kv_num_heads": 3,
        "head_size": 64,
        "kind": "decode",
        "past_len": 30,
        "sliding_window_cache": True,
        "local_window_size": 16,
        "extra_capacity": 2,
    },
}


@pytest.mark.parametrize("shared", [False, True], ids=["separate", "shared"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("quant", ["PER_CHANNEL", "PER_TENSOR", "PER_TOKEN"])
@pytest.mark.parametrize("layout", [0, 1])
def test_int8_in_place(layout, quant, shape, shared):
    kw = dict(SHAPES[shape], dtype="fp16", kv_layout=layout, shared=shared, seed=11)
    if kw.get("sliding_window_cache"):
        kw["pad"] = 0
    base = GqaCase(**kw)
    if quant == "PER_TOKEN":
        pt.check(pt.PtCase(base, "int8", quant))
    else:
        qt.check(qt.QuantCase(base, 8, quant))


@pytest.mark.parametrize("layout", [0, 1])
def test_per_token_nonfinite_value_row_in_a_chunk(layout):
    """A new value row holding NaN (scale NaN, codes 0) in a chunk whose queries share a
    micro-block: the queries that attend to it output NaN, the one before it does not."""
    base = GqaCase(
        num_heads=2,
        kv_num_heads=1,
        head_size=64,
        kind="chunk",
        seq=3,
        past_len=5,
        dtype="fp16",
        kv_layout=layout,
        seed=8,
    )
    pc = pt.PtCase(base, "int8")
    pc.feeds()["value"][0, 1, 5] = np.nan
    out, _, _, _, vs = pt.run(pc)
    assert np.isnan(vs[0, 0, 5 + 1])  # the NaN row's scale (one KV head: either layout)
    out = out.astype(np.float32)
    assert not np.isnan(out[0, 0]).any()
    assert np.isnan(out[0, 1:]).all()


@pytest.mark.parametrize("level", LEVELS)
def test_quant_suites_at_every_level(level):
    """The quantized suites (this file, test_gqa_quant.py, test_gqa_pertoken.py) at every
    level other than this process's, in a child process with the level forced."""
    _require(level)
    if level == _info()["cpu_isa"]:
        pytest.skip(f"{level} is this process's level: the suites run here directly")
    tests = qt.__file__.rsplit("/", 1)[0]
    code = f"""
        import sys, pytest, ort_kvlayout
        assert ort_kvlayout.build_info()["cpu_isa"] == {level!r}
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-k", "not every_level",
                              {tests + "/test_gqa_quant.py"!r}, {tests + "/test_gqa_pertoken.py"!r},
                              {__file__!r}]))
    """
    r = _child(code, level, timeout=600)
    assert r.returncode == 0, f"level {level}:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
