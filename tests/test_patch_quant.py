"""patch_kv_layout on quantized-KV-cache models (int8 / packed int4, per tensor / per channel).

The synthetic models carry quantized GQA nodes the way onnxruntime-genai's builder emits them
(kv_cache_quant_scheme): scales as initializers, separate past/present. Original (ORT's
com.microsoft op) and patched (ai.kvlayout, layout 1) run side by side under onnxruntime.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from ort_kvlayout.tools.patch import UnsupportedNodeError, patch_model_dir
from synthetic_models import Variant, make_model_dir, snapshot

QUANT = {
    "int8_per_tensor": Variant(kv_bits=8, kv_scheme="PER_TENSOR"),
    "int8_per_channel": Variant(kv_bits=8, kv_scheme="PER_CHANNEL"),
    "int4_per_tensor": Variant(kv_bits=4, kv_scheme="PER_TENSOR"),
    "int4_per_channel": Variant(kv_bits=4, kv_scheme="PER_CHANNEL", packed=False),
}
_NP = {"tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(int64)": np.int64}


def _library() -> str:
    import ort_kvlayout

    try:
        return ort_kvlayout.library_path()
    except FileNotFoundError:
        pytest.skip("custom-op library not built")


def _session(model_dir: Path, library: str | None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    if library:
        so.register_custom_ops_library(library)
    return ort.InferenceSession(
        str(model_dir / "model.onnx"), so, providers=["CPUExecutionProvider"]
    )


def _gqa_nodes(model_dir: Path) -> list[onnx.NodeProto]:
    model = onnx.load(str(model_dir / "model.onnx"))
    return [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]


def _greedy(sess: ort.InferenceSession, prompt: list[int], steps: int):
    """Greedy tokens, and the present caches {name: array} of the first (prompt) step."""
    kv_inputs = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), _NP[i.type]) for i in kv_inputs}
    outputs = [o.name for o in sess.get_outputs()]
    ids, tokens, first = list(prompt), [], None
    step_ids = prompt
    for _ in range(steps):
        feeds = {
            "input_ids": np.asarray([step_ids], np.int64),
            "attention_mask": np.ones((1, len(ids)), np.int64),
            **past,
        }
        result = dict(zip(outputs, sess.run(outputs, feeds)))
        if first is None:
            first = {k: v for k, v in result.items() if k.startswith("present.")}
        token = int(np.argmax(result["logits"][0, -1]))
        tokens.append(token)
        ids.append(token)
        step_ids = [token]
        past = {name: result[name.replace("past_key_values.", "present.")] for name in past}
    return tokens, first


@pytest.mark.parametrize("name", QUANT)
def test_quantized_model_patches_and_keeps_its_tokens_and_bytes(tmp_path, name):
    lib = _library()
    src = make_model_dir(tmp_path / "model", QUANT[name])
    before = snapshot(src)
    out = patch_model_dir(src, tmp_path / "out", layout="seq-major").out_dir
    assert snapshot(src) == before
    for old, new in zip(_gqa_nodes(src), _gqa_nodes(out)):
        assert new.domain == "ai.kvlayout" and list(new.input) == list(old.input)
        kept = {a.name: a for a in new.attribute if a.name != "kv_layout"}
        assert kept == {a.name: a for a in old.attribute}  # quant attributes unchanged
        assert {a.name: a.i for a in new.attribute}["kv_layout"] == 1
    src_inits = {t.name: t for t in onnx.load(str(src / "model.onnx")).graph.initializer}
    out_inits = {t.name: t for t in onnx.load(str(out / "model.onnx")).graph.initializer}
    assert [n for n in out_inits if "scale" in n] and all(
        out_inits[n] == src_inits[n] for n in src_inits
    )

    prompt = [1, 5, 7, 9, 11, 13, 17, 19, 23]
    tokens_a, first_a = _greedy(_session(src, None), prompt, 10)
    tokens_b, first_b = _greedy(_session(out, lib), prompt, 10)
    assert tokens_a == tokens_b
    for key, a in first_a.items():  # (B, Nkv, S, Hc) vs layout 1's (B, S, Nkv, Hc) bytes
        b = first_b[key].reshape(a.shape[0], a.shape[2], a.shape[1], a.shape[3])
        np.testing.assert_array_equal(b.transpose(0, 2, 1, 3), a, err_msg=key)


@pytest.mark.parametrize("name", QUANT)
def test_quantized_model_same_tokens_under_onnxruntime_genai(tmp_path, name):
    """The unpatched (ORT's op) and patched (ours, layout 1, library from the folder) models give
    the same greedy tokens under onnxruntime-genai, which also matches the plain ORT loop."""
    pytest.importorskip("onnxruntime_genai")
    from genai_util import genai_greedy

    lib = _library()
    src = make_model_dir(tmp_path / "model", QUANT[name])
    out = patch_model_dir(src, tmp_path / "out", layout="seq-major", library=lib).out_dir
    prompt = [1, 5, 7, 9, 11, 13, 17, 19, 23]
    tokens = genai_greedy(src, prompt, 10)
    assert len(tokens) >= 4  # EOS (2 or 3) may end it early
    assert genai_greedy(out, prompt, 10) == tokens
    assert _greedy(_session(src, None), prompt, len(tokens))[0] == tokens


def test_cuda_targeted_quantized_model_refused_by_name(tmp_path):
    src = make_model_dir(tmp_path / "model", Variant(kv_bits=8, provider="cuda"))
    before = snapshot(src)
    with pytest.raises(UnsupportedNodeError) as err:
        patch_model_dir(src, tmp_path / "out", library=None)
    message = str(err.value)
    for layer in range(2):
        assert f"/model/layers.{layer}/attn/GroupQueryAttention" in message
    assert "CPU op only" in message and "cuda" in message
    assert not (tmp_path / "out").exists() and snapshot(src) == before


def test_cuda_targeted_unquantized_model_still_patches(tmp_path):
    src = make_model_dir(tmp_path / "model", Variant(provider="cuda"))
    assert patch_model_dir(src, tmp_path / "out", library=None).rewritten == 2


def test_fp8_cache_refused_by_name(tmp_path):
    src = make_model_dir(tmp_path / "model", Variant(kv_bits=8, fp8_cache=True))
    with pytest.raises(UnsupportedNodeError, match=r"(?s)layers\.0.*fp8 \(float8e4m3fn\)"):
        patch_model_dir(src, tmp_path / "out", library=None)


INCONSISTENT = {
    "mixed_types": ({"v_quant_type": "PER_CHANNEL"}, "v_quant_type=PER_CHANNEL"),
    "bits_2": ({"kv_cache_bit_width": 2}, "kv_cache_bit_width 8 or 4, got 2"),
    "bits_vs_cache": ({"kv_cache_bit_width": 4}, "needs a uint8 cache, the graph's is int8"),
}


@pytest.mark.parametrize("name", INCONSISTENT)
def test_inconsistent_quantized_node_refused(tmp_path, name):
    attrs, reason = INCONSISTENT[name]
    src = make_model_dir(tmp_path / "model", Variant(kv_bits=8, extra_attrs=attrs))
    with pytest.raises(UnsupportedNodeError) as err:
        patch_model_dir(src, tmp_path / "out", library=None)
    assert reason in str(err.value) and "layers.1/attn/GroupQueryAttention" in str(err.value)


def test_genai_config_untouched_but_library(tmp_path):
    """Only custom_ops_library is added; the quantized model's separate past/present is kept."""
    lib = _library()
    src = make_model_dir(tmp_path / "model", QUANT["int8_per_channel"])
    out = patch_model_dir(src, tmp_path / "out", library=lib).out_dir
    config = json.loads((out / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is False
    options = config["model"]["decoder"]["session_options"]
    assert options["custom_ops_library"]
