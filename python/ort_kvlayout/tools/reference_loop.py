"""The reference loop: a plain ONNX Runtime greedy generation loop over an onnxruntime-genai model
directory, the independent oracle of patch_kv_layout --verify (verify.py), the main job and the
tests.

    gen = Generator("smollm2-seq-major")            # registers the directory's custom-op library
    result = gen.generate(prompt_ids, max_new_tokens=32)
    result.tokens, result.tokens_per_second

The KV cache is shared in place, as onnxruntime-genai does it: one (B, Nkv, C, H) buffer per
past/present pair, bound through IO binding as both the past input and the present output, so the
GQA op appends the new rows into it (a pointer-equal past and present). The attention mask grows
by one column a step; seqlens_k and total_sequence_length are derived from it inside the graph.
Batch size 1, no sampling, numpy buffers: kept deliberately simple and independent of the runtime
it checks (ort_kvlayout.runtime: KV cache modes, batches, sampling, CUDA graphs), so it imports
nothing of this package.

Quantized caches: int8, packed int4 (uint8, (H + 1) // 2 bytes a row) and float8e4m3fn caches
are allocated in the graph's type. A PER_TOKEN model's float32 scale caches (1, Nkv, C), named
by genai_config's past_key_scale_names / ... (default past_key_scale.%d, ...), are shared in
place beside them. `emulate_kv_quant` runs a plain (float-cache) model as the PER_TOKEN oracle:
after each step, every row written that step is quantized and dequantized in numpy
(`fake_quant_rows`: the op's code, docs/CONTRACT.md) and stored back in the cache's type. It is
not bit-exact to the op: the attention of the step that writes a row reads it unquantized here
(the op reads it dequantized), and a float16 cache rounds the dequantized value to float16.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort

from ..op.library import register_library

GENAI_CONFIG = "genai_config.json"
# genai_config.json's scale-cache templates (PER_TOKEN) and their defaults.
SCALE_KEYS = {
    "past_key_scale_names": "past_key_scale.%d",
    "past_value_scale_names": "past_value_scale.%d",
    "present_key_scale_names": "present_key_scale.%d",
    "present_value_scale_names": "present_value_scale.%d",
}
# PER_TOKEN schemes: (largest code, smallest code, code type); fp8 rounds to float8e4m3fn.
KV_QUANT = {
    "int8-per-token": (127, -128, np.int8),
    "int4-per-token": (7, -8, np.int8),
    "fp8-per-token": (448, -448, ml_dtypes.float8_e4m3fn),
}
_NP_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,  # quantized KV caches (int8; packed int4 as uint8, two per byte)
    "tensor(uint8)": np.uint8,
    "tensor(float8e4m3fn)": ml_dtypes.float8_e4m3fn,
}
_ONNX_TYPES = {  # numpy types OrtValue cannot take by dtype
    np.dtype(ml_dtypes.float8_e4m3fn): onnx.TensorProto.FLOAT8E4M3FN,
}


def fake_quant_rows(x: np.ndarray, scheme: str) -> np.ndarray:
    """PER_TOKEN quantize then dequantize each row (last axis) of float32 `x`: scale =
    max|x| / qmax, codes rint(x * float32(1 / scale)) clamped (fp8: cast, saturating), read
    back float32(code) * scale; a row with a NaN/Inf reads NaN, an all-zero row 0."""
    hi, lo, code = KV_QUANT[scheme]
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        amax = np.max(np.abs(x), axis=-1, keepdims=True)
        scale = (amax / np.float32(hi)).astype(np.float32)
        finite = np.isfinite(scale)
        inv = np.where(finite & (scale > 0), np.float32(1) / np.where(scale > 0, scale, 1), 0)
        y = np.where(finite, x, 0).astype(np.float32) * inv.astype(np.float32)
        if code is np.int8:
            q = np.clip(np.rint(y), lo, hi).astype(np.float32)
        else:
            q = np.clip(y, lo, hi).astype(code).astype(np.float32)
        out = q * np.where(finite, scale, np.float32(np.nan))
    return out.astype(np.float32)


def _graph_kv_layout(path: Path) -> int:
    """The kv_layout of the graph's GroupQueryAttention nodes (0 without the attribute)."""
    model = onnx.load(str(path), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            for attr in node.attribute:
                if attr.name == "kv_layout":
                    return int(attr.i)
    return 0


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids, prompt excluded
    logits: list[np.ndarray] = field(repr=False)  # float32 (vocab,) per generated token
    prompt_seconds: float = 0.0  # the first run (whole prompt) -> first token
    decode_seconds: float = 0.0  # every later run

    @property
    def seconds(self) -> float:
        return self.prompt_seconds + self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens over the whole generation time (prompt included)."""
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first over the decode time (the steady-state rate)."""
        n = len(self.tokens) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


def _config_library(model_dir: Path, config: dict[str, Any]) -> Path | None:
    options = config.get("model", {}).get("decoder", {}).get("session_options", {})
    name = options.get("custom_ops_library")
    if not name:
        return None
    path = Path(name) if Path(name).is_absolute() else model_dir / name
    if not path.is_file():
        raise FileNotFoundError(f"{GENAI_CONFIG} names custom_ops_library {name}, not found")
    return path


class Generator:
    """One ORT session over the decoder of an onnxruntime-genai model directory."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        provider: str = "cpu",
        custom_ops_library: str | os.PathLike | None = "auto",
        session_options: ort.SessionOptions | None = None,
        emulate_kv_quant: str | None = None,
    ):
        """custom_ops_library: "auto" registers the library genai_config.json names (if any);
        a path registers that file; None registers none. provider: "cpu" or "cuda".
        emulate_kv_quant: a KV_QUANT scheme to emulate on a float-cache model (CPU only)."""
        self.model_dir = Path(model_dir)
        self.config: dict[str, Any] = json.loads((self.model_dir / GENAI_CONFIG).read_text())
        model = self.config["model"]
        decoder = model["decoder"]
        self.layers: int = decoder["num_hidden_layers"]
        self.kv_heads: int = decoder["num_key_value_heads"]
        self.head_size: int = decoder["head_size"]
        self.context_length: int = model["context_length"]
        inputs, outputs = decoder["inputs"], decoder["outputs"]
        self.input_ids_name: str = inputs["input_ids"]
        self.attention_mask_name: str = inputs["attention_mask"]
        self.position_ids_name: str | None = inputs.get("position_ids")
        self.logits_name: str = outputs["logits"]
        self.kv_pairs: list[tuple[str, str]] = []  # (past, present) names, k0, v0, k1, v1, ...
        for layer in range(self.layers):
            for past, present in (
                (inputs["past_key_names"], outputs["present_key_names"]),
                (inputs["past_value_names"], outputs["present_value_names"]),
            ):
                self.kv_pairs.append((past % layer, present % layer))

        so = session_options or ort.SessionOptions()
        library = (
            _config_library(self.model_dir, self.config)
            if custom_ops_library == "auto"
            else custom_ops_library
        )
        self.library: str | None = str(library) if library else None
        if self.library:
            register_library(so, self.library)
        self.provider = provider
        self.device = "cuda" if provider == "cuda" else "cpu"
        providers = ["CUDAExecutionProvider"] if provider == "cuda" else []
        providers.append("CPUExecutionProvider")
        path = self.model_dir / decoder.get("filename", "model.onnx")
        self.session = ort.InferenceSession(str(path), so, providers=providers)
        types = {i.name: i.type for i in self.session.get_inputs()}
        self.kv_pairs = [(p, q) for p, q in self.kv_pairs if p in types]  # hybrid models
        self.kv_dtype = _NP_TYPES[types[self.kv_pairs[0][0]]]
        self.mask_dtype = _NP_TYPES[types[self.attention_mask_name]]
        self.has_position_ids = bool(self.position_ids_name) and self.position_ids_name in types
        # PER_TOKEN scale caches: (past, present) per KV pair, when the graph has them.
        templates = {k: {**inputs, **outputs}.get(k, v) for k, v in SCALE_KEYS.items()}
        self.scale_pairs: list[tuple[str, str]] = []
        for past, _ in self.kv_pairs:
            layer, kind = self._layer_of(past, inputs)
            name = templates[f"past_{kind}_scale_names"] % layer
            if name in types:
                present = templates[f"present_{kind}_scale_names"] % layer
                self.scale_pairs.append((name, present))
        self.emulate_kv_quant = emulate_kv_quant
        if emulate_kv_quant is not None:
            if emulate_kv_quant not in KV_QUANT:
                raise ValueError(f"emulate_kv_quant {emulate_kv_quant!r}: one of {list(KV_QUANT)}")
            if self.kv_dtype not in (np.float32, np.float16) or self.scale_pairs:
                raise ValueError("emulate_kv_quant needs a float32 / float16 KV cache")
            if self.device != "cpu":
                raise ValueError("emulate_kv_quant runs on the CPU (the cache is numpy memory)")
        self.kv_layout = _graph_kv_layout(path)
        self._arrays: list[np.ndarray] = []  # the numpy memory of the KV buffers (CPU)

    def _layer_of(self, past: str, inputs: dict[str, Any]) -> tuple[int, str]:
        for kind in ("key", "value"):
            for layer in range(self.layers):
                if inputs[f"past_{kind}_names"] % layer == past:
                    return layer, kind
        raise ValueError(f"{past} matches no past key/value template")

    def new_cache(self, capacity: int) -> list[ort.OrtValue]:
        """Zeroed (1, Nkv, capacity, H) buffers, one per past/present pair, on the device."""
        # A packed int4 cache (uint8) holds two elements per byte: (H + 1) // 2 of them per row.
        row = (self.head_size + 1) // 2 if self.kv_dtype == np.uint8 else self.head_size
        shape = (1, self.kv_heads, capacity, row)
        # One array per buffer: on CPU the OrtValue wraps the numpy memory (and keeps it alive).
        self._arrays = [np.zeros(shape, self.kv_dtype) for _ in self.kv_pairs]
        scales = [np.zeros(shape[:3], np.float32) for _ in self.scale_pairs]
        return [self._value(a) for a in self._arrays + scales]

    def _value(self, array: np.ndarray) -> ort.OrtValue:
        onnx_type = _ONNX_TYPES.get(array.dtype)
        if onnx_type is None:
            return ort.OrtValue.ortvalue_from_numpy(array, self.device, 0)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, onnx_type)

    def _emulate(self, first: int, end: int) -> None:
        """Rows [first, end) of every cache quantized and dequantized in place (numpy)."""
        for array in self._arrays:
            capacity = array.shape[2]
            rows = array.reshape(-1)
            if self.kv_layout == 1:  # the (1, Nkv, C, H) buffer holds (1, C, Nkv, H) bytes
                view = rows.reshape(capacity, self.kv_heads, self.head_size)[first:end]
            else:
                view = rows.reshape(self.kv_heads, capacity, self.head_size)[:, first:end]
            view[...] = fake_quant_rows(view.astype(np.float32), self.emulate_kv_quant)

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        eos_token_ids: list[int] | None = None,
        capacity: int | None = None,
    ) -> GenerationResult:
        """Greedy decoding; stops after max_new_tokens or at an eos id (when given)."""
        capacity = capacity or min(self.context_length, len(prompt_ids) + max_new_tokens)
        if len(prompt_ids) + max_new_tokens > capacity:
            raise ValueError(f"prompt + new tokens exceed the cache capacity {capacity}")
        cache = self.new_cache(capacity)
        binding = self.session.io_binding()
        for (past, present), value in zip(self.kv_pairs + self.scale_pairs, cache):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)

        tokens: list[int] = []
        logits_seen: list[np.ndarray] = []
        step_ids = np.asarray([prompt_ids], dtype=np.int64)
        total = 0
        times = []
        while len(tokens) < max_new_tokens:
            start = time.perf_counter()
            past = total
            total += step_ids.shape[1]
            binding.bind_cpu_input(self.input_ids_name, step_ids)
            binding.bind_cpu_input(self.attention_mask_name, np.ones((1, total), self.mask_dtype))
            if self.has_position_ids:
                positions = np.arange(past, total, dtype=np.int64)[None, :]
                binding.bind_cpu_input(self.position_ids_name, positions)
            binding.bind_output(self.logits_name, "cpu")
            self.session.run_with_iobinding(binding)
            if self.emulate_kv_quant is not None:
                self._emulate(past, total)
            logits = binding.get_outputs()[-1].numpy()  # logits bound last
            last = np.asarray(logits[0, -1], dtype=np.float32)
            token = int(np.argmax(last))
            times.append(time.perf_counter() - start)
            tokens.append(token)
            logits_seen.append(last)
            if eos_token_ids and token in eos_token_ids:
                break
            step_ids = np.asarray([[token]], dtype=np.int64)
        return GenerationResult(tokens, logits_seen, times[0], sum(times[1:]))
