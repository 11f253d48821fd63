"""Tiny onnxruntime-genai-style model directories built with onnx.helper, for the patcher tests.

Each is a real (random-weight) decoder: embedding -> per layer GroupQueryAttention (packed or
separate q/k/v, rotary inside, the builder's seqlens_k / total_sequence_length subgraph) ->
o_proj + residual -> lm_head, with past/present KV and a genai_config.json like the builder's.
It runs under ORT's own com.microsoft GQA, so original and patched models can be compared.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VOCAB = 64
MAX_POS = 256


@dataclass
class Variant:
    """Knobs for the GQA nodes the builder can emit (defaults: SmolLM2-like packed QKV)."""

    layers: int = 2
    num_heads: int = 4
    kv_heads: int = 2
    head_size: int = 32  # rotary in GQA needs head_size % 16 == 0
    packed: bool = True
    local_window_size: int = -1
    sliding_window_cache: int = 0
    qk_norm: bool = False
    quantized: str = ""  # "", "scales", "quant_type", "bit_width"
    output_qk: str = ""  # "", "output", "attr"
    extra_attrs: dict = field(default_factory=dict)
    domain: str = "com.microsoft"
    kv_layout: int | None = None  # for ai.kvlayout nodes
    per_layer_layout: list[int] | None = None  # ai.kvlayout nodes with these layouts
    no_gqa: bool = False
    external_data: bool = False
    data_bytes: int = 0  # an extra external initializer of this size (0: none)
    drop_config_keys: list[str] = field(default_factory=list)  # dotted genai_config keys
    float16: bool = False  # weights, KV cache and logits in float16 (ORT's CUDA GQA has no fp32)
    # A quantized KV cache as the builder emits it (kv_cache_quant_scheme): 8 (int8 cache) or 4
    # (uint8, two codes a byte); scales as float initializers, [1] or [1, Nkv, 1, H]; past and
    # present separate (the builder does not share them for a quantized cache on CPU).
    kv_bits: int = 0
    kv_scheme: str = "PER_TENSOR"  # or "PER_CHANNEL"
    fp8_cache: bool = False  # with kv_bits=8: a float8e4m3fn cache instead of int8
    provider: str = ""  # e.g. "cuda": genai_config's decoder provider_options name it
    seed: int = 0


def _rope_caches(head_size: int) -> tuple[np.ndarray, np.ndarray]:
    half = head_size // 2
    inv = 1.0 / (10000 ** (np.arange(half, dtype=np.float64) / half))
    ang = np.arange(MAX_POS, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def genai_config(v: Variant) -> dict:
    config = {
        "model": {
            "bos_token_id": 1,
            "context_length": MAX_POS,
            "decoder": {
                "session_options": {
                    "log_id": "onnxruntime-genai",
                    "provider_options": [{v.provider: {}}] if v.provider else [],
                },
                "filename": "model.onnx",
                "head_size": v.head_size,
                "hidden_size": v.num_heads * v.head_size,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": v.num_heads,
                "num_hidden_layers": v.layers,
                "num_key_value_heads": v.kv_heads,
            },
            "eos_token_id": [2, 3],
            "pad_token_id": 0,
            "type": "llama",
            "vocab_size": VOCAB,
        },
        "search": {"max_length": MAX_POS, "past_present_share_buffer": not v.kv_bits},
    }
    if v.local_window_size > 0 and v.sliding_window_cache:
        config["model"]["decoder"]["sliding_window"] = {
            "window_size": v.local_window_size,
            "slide_key_value_cache": False,
            "slide_inputs": False,
            "layers": list(range(v.layers)),
        }
    for dotted in v.drop_config_keys:
        *parents, last = dotted.split(".")
        node = config
        for p in parents:
            node = node[p]
        del node[last]
    return config


def build_model(v: Variant) -> onnx.ModelProto:
    rng = np.random.default_rng(v.seed)
    fdt = np.float16 if v.float16 else np.float32
    ftype = TensorProto.FLOAT16 if v.float16 else TensorProto.FLOAT
    hidden = v.num_heads * v.head_size
    kv_hidden = v.kv_heads * v.head_size
    inits: list[TensorProto] = []

    def weight(name: str, *shape: int, scale: float = 0.2) -> str:
        inits.append(numpy_helper.from_array(rng.normal(0, scale, shape).astype(fdt), name))
        return name

    cos, sin = _rope_caches(v.head_size)
    inits += [
        numpy_helper.from_array(cos.astype(fdt), "cos_cache"),
        numpy_helper.from_array(sin.astype(fdt), "sin_cache"),
    ]
    nodes = [
        helper.make_node(
            "Gather", [weight("embed", VOCAB, hidden, scale=1.0), "input_ids"], ["h0"]
        ),
        # The builder's attention-mask subgraph: seqlens_k = sum(mask) - 1, total = shape(mask)[1].
        helper.make_node("ReduceSum", ["attention_mask", "one_axis"], ["mask_sum"], keepdims=0),
        helper.make_node("Sub", ["mask_sum", "one_i64"], ["seqlens_i64"]),
        helper.make_node("Cast", ["seqlens_i64"], ["seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["mask_shape"]),
        helper.make_node("Gather", ["mask_shape", "one_i64"], ["total_i64"], axis=0),
        helper.make_node("Cast", ["total_i64"], ["total_len"], to=TensorProto.INT32),
    ]
    inits += [
        numpy_helper.from_array(np.array([1], np.int64), "one_axis"),
        numpy_helper.from_array(np.array(1, np.int64), "one_i64"),
    ]
    if v.data_bytes:
        weight("padding_weight", v.data_bytes // 4)
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", ftype, ["batch", "seq", VOCAB])]
    x = "h0"
    for layer in range(v.layers):
        p = f"/model/layers.{layer}/attn"
        past_k, past_v = f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"
        pres_k, pres_v = f"present.{layer}.key", f"present.{layer}.value"
        ctype, cdim = ftype, v.head_size
        if v.kv_bits:
            ctype = TensorProto.INT8 if v.kv_bits == 8 else TensorProto.UINT8
            ctype = TensorProto.FLOAT8E4M3FN if v.fp8_cache else ctype
            cdim = v.head_size if v.kv_bits == 8 else (v.head_size + 1) // 2
        kv_shape = ["batch", v.kv_heads, "past", cdim]
        inputs += [helper.make_tensor_value_info(n, ctype, kv_shape) for n in (past_k, past_v)]
        out_shape = ["batch", v.kv_heads, "total", cdim]
        outputs += [helper.make_tensor_value_info(n, ctype, out_shape) for n in (pres_k, pres_v)]
        if v.packed:
            w = weight(f"{p}/qkv.weight", hidden, hidden + 2 * kv_hidden)
            nodes.append(helper.make_node("MatMul", [x, w], [f"{p}/qkv"]))
            q, k, val = f"{p}/qkv", "", ""
        else:
            q, k, val = f"{p}/q", f"{p}/k", f"{p}/v"
            for name, width in ((q, hidden), (k, kv_hidden), (val, kv_hidden)):
                nodes.append(
                    helper.make_node("MatMul", [x, weight(f"{name}.weight", hidden, width)], [name])
                )
        gqa_inputs = [
            q,
            k,
            val,
            past_k,
            past_v,
            "seqlens_k",
            "total_len",
            "cos_cache",
            "sin_cache",
            "",
            "",
            "",
        ]
        if v.quantized == "scales":
            gqa_inputs += [weight(f"{p}/k_scale", 1), weight(f"{p}/v_scale", 1)]
        if v.kv_bits:
            shape = (1,) if v.kv_scheme == "PER_TENSOR" else (1, v.kv_heads, 1, v.head_size)
            lo = 0.05 if v.kv_bits == 8 else 1.0  # about max|k| / 127, or / 7
            for name in ("k_scale", "v_scale"):
                scale = rng.uniform(lo, 2 * lo, shape).astype(np.float32)
                inits.append(numpy_helper.from_array(scale, f"{p}/{name}"))
                gqa_inputs.append(f"{p}/{name}")
        if v.qk_norm:
            while len(gqa_inputs) < 14:
                gqa_inputs.append("")
            for name in ("q_norm", "k_norm"):
                inits.append(numpy_helper.from_array(
                    (1 + 0.1 * rng.normal(size=v.head_size)).astype(fdt), f"{p}/{name}"
                ))  # fmt: skip
                gqa_inputs.append(f"{p}/{name}")
        attrs = {
            "num_heads": v.num_heads,
            "kv_num_heads": v.kv_heads,
            "scale": float(v.head_size**-0.5),
            "local_window_size": v.local_window_size,
            "softcap": 0.0,
            "do_rotary": 1,
            "rotary_interleaved": 0,
        }
        if v.qk_norm:
            attrs["qk_norm_epsilon"] = 1e-6
        if v.sliding_window_cache:
            attrs["sliding_window_cache"] = 1
        if v.quantized == "quant_type":
            attrs["k_quant_type"] = attrs["v_quant_type"] = "PER_TENSOR"
        if v.quantized == "bit_width":
            attrs["kv_cache_bit_width"] = 8
        if v.kv_bits:
            attrs["k_quant_type"] = attrs["v_quant_type"] = v.kv_scheme
            attrs["kv_cache_bit_width"] = v.kv_bits
        if v.output_qk == "attr":
            attrs["qk_output"] = 1
        attrs.update(v.extra_attrs)
        domain = v.domain
        if v.per_layer_layout is not None:
            domain, attrs["kv_layout"] = "ai.kvlayout", v.per_layer_layout[layer]
        elif v.kv_layout is not None:
            attrs["kv_layout"] = v.kv_layout
        gqa_outputs = [f"{p}/attn_out", pres_k, pres_v]
        if v.output_qk == "output":
            gqa_outputs.append(f"{p}/qk")
        if v.no_gqa:  # a plain stand-in keeping the graph valid: no attention op at all
            nodes.append(helper.make_node("Identity", [x], [f"{p}/attn_out"]))
            nodes += [
                helper.make_node("Identity", [a], [b])
                for a, b in ((past_k, pres_k), (past_v, pres_v))
            ]
        else:
            nodes.append(helper.make_node(
                "GroupQueryAttention", gqa_inputs, gqa_outputs, name=f"{p}/GroupQueryAttention",
                domain=domain, **attrs,
            ))  # fmt: skip
        o = weight(f"{p}/o.weight", hidden, hidden)
        nodes += [
            helper.make_node("MatMul", [f"{p}/attn_out", o], [f"{p}/o"]),
            helper.make_node("Add", [x, f"{p}/o"], [f"/model/layers.{layer}/out"]),
        ]
        x = f"/model/layers.{layer}/out"
    nodes.append(helper.make_node("MatMul", [x, weight("lm_head", hidden, VOCAB)], ["logits"]))
    graph = helper.make_graph(nodes, "synthetic_decoder", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    if v.per_layer_layout is not None or v.domain == "ai.kvlayout":
        opsets.append(helper.make_opsetid("ai.kvlayout", 1))
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def make_model_dir(path: Path, v: Variant | None = None) -> Path:
    """Writes model.onnx (+ model.onnx.data), genai_config.json and tokenizer-like files."""
    v = v or Variant()
    path.mkdir(parents=True, exist_ok=True)
    model = build_model(v)
    if v.external_data:
        onnx.save_model(
            model, str(path / "model.onnx"), save_as_external_data=True,
            all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=0,
        )  # fmt: skip
    else:
        onnx.save_model(model, str(path / "model.onnx"))
    (path / "genai_config.json").write_text(json.dumps(genai_config(v), indent=4))
    (path / "tokenizer_config.json").write_text('{"model_max_length": 256}\n')
    (path / "chat_template.jinja").write_text("{{ messages }}\n")
    (path / "sub").mkdir(exist_ok=True)
    (path / "sub" / "notes.txt").write_text("nested files are copied too\n")
    return path


def snapshot(path: Path) -> dict[str, tuple[int, bytes]]:
    """{relative path: (mode, content)} of every file under `path` (for byte-identity checks)."""
    return {
        p.relative_to(path).as_posix(): (p.stat().st_mode, p.read_bytes())
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def with_variant(**kwargs) -> Variant:
    return copy.deepcopy(Variant(**kwargs))
