"""bench/bench_cuda.py's models, run on the CPU: the --rotary model (do_rotary=1, cos/sin caches)
is one that ORT's com.microsoft op and ours both accept and agree on, in both layouts, and
rotary changes the output (the bench measures the op with its rotation, as LLMs run it)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import ort_kvlayout
import pytest
from bench_util import load_bench

bench_cuda = load_bench("bench_cuda")

N, NKV, H, B, L = 4, 2, 16, 2, 9  # decode: one new token after L - 1 cached ones


def _caches(positions: int, h: int) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / 10000.0 ** (np.arange(0, h, 2, dtype=np.float64) / h)
    ang = np.outer(np.arange(positions, dtype=np.float64), inv)
    return np.cos(ang).astype(np.float16), np.sin(ang).astype(np.float16)


def _run(domain: str, layout: int | None, rotary: bool, feeds: dict) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if domain != "com.microsoft":
        ort_kvlayout.register(so)
    sess = ort.InferenceSession(
        bench_cuda.build_model(domain, N, NKV, layout, rotary=rotary), so,
        providers=["CPUExecutionProvider"],
    )  # fmt: skip
    feeds = dict(feeds)
    if layout == 1:  # the same logical past, as seq-major bytes in the declared shape
        for name in ("past_key", "past_value"):
            feeds[name] = np.ascontiguousarray(feeds[name].transpose(0, 2, 1, 3)).reshape(
                feeds[name].shape
            )
    if not rotary:
        feeds = {k: v for k, v in feeds.items() if k not in bench_cuda.ROTARY_INPUTS}
    return sess.run(["output"], feeds)[0].astype(np.float32)


@pytest.fixture(scope="module")
def feeds() -> dict:
    rng = np.random.default_rng(7)
    cos, sin = _caches(L + 1, H)
    return {
        "query": rng.standard_normal((B, 1, N * H)).astype(np.float16),
        "key": rng.standard_normal((B, 1, NKV * H)).astype(np.float16),
        "value": rng.standard_normal((B, 1, NKV * H)).astype(np.float16),
        "past_key": rng.standard_normal((B, NKV, L, H)).astype(np.float16),
        "past_value": rng.standard_normal((B, NKV, L, H)).astype(np.float16),
        "seqlens_k": np.array([L - 1, L - 3], np.int32),  # a ragged batch
        "total_sequence_length": np.array(L, np.int32),
        "cos_cache": cos,
        "sin_cache": sin,
    }


@pytest.mark.parametrize("layout", [0, 1])
def test_rotary_model_agrees_with_orts_op(feeds, layout):
    want = _run("com.microsoft", None, True, feeds)
    got = _run(ort_kvlayout.DOMAIN, layout, True, feeds)
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=2e-3)


def test_rotary_changes_the_output(feeds):
    plain = _run(ort_kvlayout.DOMAIN, 0, False, feeds)
    rotated = _run(ort_kvlayout.DOMAIN, 0, True, feeds)
    assert np.abs(plain - rotated).max() > 1e-2


def test_rotary_caches_are_the_usual_frequencies():
    torch = pytest.importorskip("torch")
    got = bench_cuda.rotary_caches(L + 1, H, "cpu")
    cos, sin = _caches(L + 1, H)
    assert got["cos_cache"].dtype == torch.float16 and tuple(got["cos_cache"].shape) == (
        L + 1,
        H // 2,
    )
    np.testing.assert_array_equal(got["cos_cache"].numpy(), cos)
    np.testing.assert_array_equal(got["sin_cache"].numpy(), sin)


def test_order_is_a_permutation_of_the_three_variants():
    assert bench_cuda.parse_order("kv1, ort,kv0") == ("kv1", "ort", "kv0")
    for bad in ("kv0,kv0,ort", "ort,kv0", "ort,kv0,kv1,kv1", "ort,kv0,kv2"):
        with pytest.raises(ValueError, match="--order"):
            bench_cuda.parse_order(bad)


def test_a_bad_order_is_refused_before_any_run(capsys):
    with pytest.raises(SystemExit):
        bench_cuda.main(["--order", "kv0,kv1", "--decode", "1x16", "--prefill="])
    assert "--order" in capsys.readouterr().err
