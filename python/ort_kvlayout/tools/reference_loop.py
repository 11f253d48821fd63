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
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

GENAI_CONFIG = "genai_config.json"
_NP_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,  # quantized KV caches (int8; packed int4 as uint8, two per byte)
    "tensor(uint8)": np.uint8,
}


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
    ):
        """custom_ops_library: "auto" registers the library genai_config.json names (if any);
        a path registers that file; None registers none. provider: "cpu" or "cuda"."""
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
            so.register_custom_ops_library(self.library)
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

    def new_cache(self, capacity: int) -> list[ort.OrtValue]:
        """Zeroed (1, Nkv, capacity, H) buffers, one per past/present pair, on the device."""
        # A packed int4 cache (uint8) holds two elements per byte: (H + 1) // 2 of them per row.
        row = (self.head_size + 1) // 2 if self.kv_dtype == np.uint8 else self.head_size
        shape = (1, self.kv_heads, capacity, row)
        # One array per buffer: on CPU the OrtValue wraps the numpy memory (and keeps it alive).
        return [
            ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, self.kv_dtype), self.device, 0)
            for _ in self.kv_pairs
        ]

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
        for (past, present), value in zip(self.kv_pairs, cache):
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
