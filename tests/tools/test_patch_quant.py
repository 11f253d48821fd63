"""patch_kv_layout on quantized-KV-cache models (int8 / packed int4, per tensor / per channel).

The synthetic models carry quantized GQA nodes the way onnxruntime-genai's builder emits them
(kv_cache_quant_scheme): scales as initializers, separate past/present. Original (ORT's
com.microsoft op) and patched (ai.kvlayout, layout 1) run side by side under onnxruntime.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from ort_kvlayout.model.config import load_metadata
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


_MODEL_ATTRS: dict = {}  # session -> kv_num_heads / cache_dim of its GQA nodes


def _session(model_dir: Path, library: str | None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    if library:
        so.register_custom_ops_library(library)
    path = str(model_dir / "model.onnx")
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    config = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
    node = _gqa_nodes(model_dir)[0]
    bits = {a.name: a.i for a in node.attribute}.get("kv_cache_bit_width", 0)
    head = config["head_size"]
    _MODEL_ATTRS[sess] = {
        "kv_num_heads": config["num_key_value_heads"],
        "cache_dim": (head + 1) // 2 if bits == 4 else head,
    }
    return sess


def _gqa_nodes(model_dir: Path) -> list[onnx.NodeProto]:
    model = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    return [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]


def _greedy(sess: ort.InferenceSession, prompt: list[int], steps: int):
    """Greedy tokens, and the present caches {name: array} of the first (prompt) step."""
    kv_inputs = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    past = {}
    for i in kv_inputs:  # (1, Nkv, 0, Hc): Nkv and Hc from the graph, else from the model's node
        dims = [d if isinstance(d, int) else None for d in i.shape]
        nkv = dims[1] or _MODEL_ATTRS[sess]["kv_num_heads"]
        hc = dims[3] or _MODEL_ATTRS[sess]["cache_dim"]
        past[i.name] = np.zeros((1, nkv, 0, hc), _NP[i.type])
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


def test_cuda_targeted_int8_model_patches(tmp_path):
    """The CUDA op runs quantized caches: a CUDA-targeted model keeps them."""
    src = make_model_dir(tmp_path / "model", Variant(kv_bits=8, provider="cuda"))
    out = tmp_path / "out"
    patch_model_dir(src, out, library=None)
    model = onnx.load(out / "model.onnx")
    for node in (n for n in model.graph.node if n.op_type == "GroupQueryAttention"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["kv_layout"] == 1 and attrs["kv_cache_bit_width"] == 8


def test_cuda_targeted_fp8_model_patches(tmp_path):
    src = make_model_dir(tmp_path / "model", Variant(kv_bits=8, fp8_cache=True, provider="cuda"))
    patch_model_dir(src, tmp_path / "out", library=None)
    assert (tmp_path / "out" / "model.onnx").exists()


def test_cuda_targeted_unquantized_model_still_patches(tmp_path):
    src = make_model_dir(tmp_path / "model", Variant(provider="cuda"))
    assert patch_model_dir(src, tmp_path / "out", library=None).rewritten == 2


def test_fp8_static_scale_cache_patches(tmp_path):
    """An fp8 (float8e4m3fn) cache with static scales: ORT's CPU has no kernel for it, ours
    runs it (PER_TENSOR / PER_CHANNEL, CONTRACT); the patcher keeps it and the runtime reads
    it."""
    from ort_kvlayout.runtime.generation import Runtime

    lib = _library()
    src = make_model_dir(tmp_path / "model", Variant(kv_bits=8, fp8_cache=True))
    out = patch_model_dir(src, tmp_path / "out", library=lib).out_dir
    io = load_metadata(out / "inference_metadata.yaml")["model"]["io"]
    assert (io["kv_dtype"], io["kv_quant_scheme"]) == ("float8e4m3fn", "per_tensor")
    with Runtime(out, capacity=32) as rt:
        assert rt.spec.kv.element_type == onnx.TensorProto.FLOAT8E4M3FN
        tokens = rt.generate([1, 5, 7, 9], 6, eos_token_ids=[]).tokens[0]
    from ort_kvlayout.tools.reference_loop import Generator

    assert tokens == Generator(out).generate([1, 5, 7, 9], 6).tokens


def test_fp8_cache_without_quant_type_refused_by_name(tmp_path):
    src = make_model_dir(tmp_path / "model", Variant(kv_bits=8, fp8_cache=True, extra_attrs={
        "k_quant_type": "NONE", "v_quant_type": "NONE", "kv_cache_bit_width": 0,
    }))  # fmt: skip
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


# ---------------------------------------------------------------------------------------------
# A builder-made quantized model: onnxruntime-genai 0.18's builder, offline, from a random tiny
# Llama (transformers) with a word-level tokenizer and a hand-written kv_cache_scale_file.

BUILDER_SCHEMES = ["int8_per_channel", "int4_per_tensor"]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    pytest.importorskip("onnxruntime_genai.models.builder")
    return make_tiny_hf(tmp_path_factory.mktemp("builder"))


def make_tiny_hf(root: Path) -> Path:
    """root/hf: a random tiny Llama with a word-level tokenizer (t0 .. t255), and the scale
    files root/per_tensor.json, root/per_channel.json."""
    torch = pytest.importorskip("torch")
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    hf = root / "hf"
    vocab = 256
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        initializer_range=0.3,  # larger than the default: varied greedy tokens
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="t1", eos_token="t2", pad_token="t0", unk_token="t0"
    ).save_pretrained(hf)
    # The calibration file format (kv_cache_calibration.py): per layer a scalar (per tensor) or
    # Nkv*H values (per channel); qmax 128 says int8-calibrated, the builder rescales for int4.
    for scheme, entry in (("per_tensor", 0.06), ("per_channel", [0.06] * 32)):
        scales = {"k_scales": [entry, entry], "v_scales": [entry, entry]}
        (root / f"{scheme}.json").write_text(json.dumps({"scales": scales, "qmax": 128}))
    return hf


def _build(hf: Path, scheme: str, out: Path) -> Path:
    scale_file = hf.parent / f"{scheme.split('_', 1)[1]}.json"
    cmd = [
        sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
        "-p", "fp32", "-e", "cpu", "-c", str(hf.parent / "cache"), "--extra_options",
        f"kv_cache_quant_scheme={scheme}", f"kv_cache_scale_file={scale_file}",
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


@pytest.mark.parametrize("scheme", BUILDER_SCHEMES)
def test_builder_quantized_model_patched_runs_the_same(tmp_path, tiny_hf, scheme):
    """A builder-made quantized model patched to layout 1: same tokens under onnxruntime-genai
    and the plain ORT loop, same present bytes (transposed), metadata reporting the format."""
    from genai_util import genai_greedy

    lib = _library()
    src = _build(tiny_hf, scheme, tmp_path / "model")
    out = patch_model_dir(src, tmp_path / "out", layout="seq-major", library=lib).out_dir
    bits, kind = scheme.split("_", 1)
    io = load_metadata(out / "inference_metadata.yaml")["model"]["io"]
    assert (io["kv_dtype"], io["kv_quant_scheme"]) == (
        "int8" if bits == "int8" else "uint8_packed_int4",
        kind,
    )
    prompt = [1, 5, 7, 9, 11, 13, 17, 19, 23]
    tokens = genai_greedy(src, prompt, 12)
    assert len(set(tokens)) > 1
    assert genai_greedy(out, prompt, 12) == tokens
    tokens_a, first_a = _greedy(_session(src, None), prompt, len(tokens))
    tokens_b, first_b = _greedy(_session(out, lib), prompt, len(tokens))
    assert tokens_a == tokens_b == tokens
    for key, a in first_a.items():
        b = first_b[key].reshape(a.shape[0], a.shape[2], a.shape[1], a.shape[3])
        np.testing.assert_array_equal(b.transpose(0, 2, 1, 3), a, err_msg=key)
    # Our runtime (growable cache of the graph's narrow type, shared in place) on both.
    from ort_kvlayout.runtime.generation import Runtime

    for model_dir in (src, out):
        with Runtime(model_dir, capacity=64) as rt:
            assert rt.spec.kv.quant == kind and rt.spec.kv.bits == int(bits[3:])
            got = rt.generate(prompt, len(tokens), eos_token_ids=[]).tokens[0]
        assert got == tokens, model_dir.name


def test_builder_quantized_model_targeting_cuda_patches(tmp_path, tiny_hf):
    src = _build(tiny_hf, "int8_per_tensor", tmp_path / "model")
    config = json.loads((src / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["provider_options"] = [{"cuda": {}}]
    (src / "genai_config.json").write_text(json.dumps(config))
    patch_model_dir(src, tmp_path / "out", library=None)
    assert (tmp_path / "out" / "genai_config.json").exists()


@pytest.mark.parametrize("name", ["int8_per_channel", "int4_per_tensor"])
def test_cli_verify_runs_quantized_models(tmp_path, capsys, name):
    """--verify's reference loop allocates the graph's int8 / packed uint8 caches: the original
    (ORT's GQA) and the patched model (ours, seq-major) give the same greedy tokens."""
    from ort_kvlayout.tools.cli import patch_main

    _library()
    src = make_model_dir(tmp_path / "model", QUANT[name])
    assert patch_main([str(src), "-o", str(tmp_path / "out"), "--verify", "--tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "tokens agree" in out and "max |logit diff|" in out
