"""What a generation runtime needs to know about a model directory, read once.

    spec = ModelSpec.from_dir("smollm2-seq-major")
    spec.kv  # KvSpec: buffer names, kv heads, head dim, dtype, layout, context length

Sources: genai_config.json (names, sizes, token ids), inference_metadata.yaml when present (the
KV layout the patcher recorded), and the decoder graph read without its external data (the KV
element type, which KV ports exist, and the GQA nodes' kv_layout when there is no metadata).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ..model.config import (
    METADATA_FILE,
    MetadataError,
    decoder_files,
    expand_kv,
    load_genai_config,
    load_metadata,
    model_kv_layout,
)
from ..model.graph import iter_gqa_nodes, node_attrs, node_label
from ..op.layout import layout_id
from ..op.library import DOMAIN

_ELEM_TYPES = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32,
}


@dataclass(frozen=True)
class KvSpec:
    """The KV buffers of a model: one (B, kv_heads, C, head_dim) buffer per (past, present)."""

    names: tuple[tuple[str, str], ...]  # (past input, present output): k0, v0, k1, v1, ...
    kv_heads: int
    head_dim: int
    dtype: np.dtype
    layout: int  # 0 head-major BNSH, 1 seq-major BSNH
    context_length: int  # the longest sequence the model supports (rotary tables, config)

    @property
    def buffers(self) -> int:
        return len(self.names)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one batch entry in one buffer (all kv heads)."""
        return self.kv_heads * self.head_dim * np.dtype(self.dtype).itemsize

    @classmethod
    def synthetic(
        cls,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: type | np.dtype = np.float16,
        layout: int | str = 1,
        context_length: int = 4096,
    ) -> KvSpec:
        """A spec without a model (benchmarks, unit tests): k/v names per layer."""
        names = tuple(
            (f"past.{i}.{kv}", f"present.{i}.{kv}")
            for i in range(layers)
            for kv in ("key", "value")
        )
        return cls(names, kv_heads, head_dim, np.dtype(dtype), layout_id(layout), context_length)


@dataclass(frozen=True)
class ModelSpec:
    model_dir: Path
    onnx_path: Path
    kv: KvSpec
    input_ids: str
    attention_mask: str
    position_ids: str | None  # None when the graph has no such input
    logits: str
    mask_dtype: np.dtype
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    custom_ops_library: str | None  # genai_config's decoder session option, as written
    gqa_nodes: tuple[tuple[str, str], ...] = ()  # (node label, domain) of every GQA node

    def foreign_gqa_nodes(self) -> list[str]:
        """Labels of the GQA nodes that are not ai.kvlayout (ORT's own com.microsoft op)."""
        return [name for name, domain in self.gqa_nodes if domain != DOMAIN]

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> ModelSpec:
        """Raises MetadataError naming the file and the key or rule on any unreadable input."""
        model_dir = Path(model_dir)
        config = load_genai_config(model_dir)
        try:
            return cls._from_config(model_dir, config)
        except (KeyError, TypeError, ValueError) as exc:  # a missing key, or a wrong type
            raise MetadataError(
                f"{model_dir / 'genai_config.json'}: incomplete or malformed "
                f"({type(exc).__name__}: {exc}); expected onnxruntime-genai's model.decoder "
                "inputs/outputs names, num_hidden_layers, num_key_value_heads, head_size, "
                "model.context_length and model.vocab_size"
            ) from exc

    @classmethod
    def _from_config(cls, model_dir: Path, config: dict) -> ModelSpec:
        model = config["model"]
        decoder = model["decoder"]
        files = decoder_files(config)
        if len(files) != 1:
            raise MetadataError(
                f"{model_dir}: a decoder pipeline of {len(files)} files is not supported by the "
                "generation runtime (one decoder graph expected)"
            )
        onnx_path = model_dir / files[0]
        try:
            graph_model = onnx.load(str(onnx_path), load_external_data=False)
        except Exception as exc:  # DecodeError, OSError...: one clear message
            raise MetadataError(
                f"{onnx_path}: not a readable ONNX model ({type(exc).__name__}: {exc})"
            ) from exc
        input_types = {i.name: i.type.tensor_type.elem_type for i in graph_model.graph.input}
        output_names = {o.name for o in graph_model.graph.output}
        nodes = list(iter_gqa_nodes(graph_model))
        for node in nodes:
            if int(node_attrs(node).get("sliding_window_cache", 0)):  # type: ignore[arg-type]
                raise MetadataError(
                    f"{onnx_path.name}: node {node.name} keeps a window-sized KV cache "
                    "(sliding_window_cache=1); the generation runtime supports full-context "
                    "caches only"
                )

        inputs, outputs = decoder["inputs"], decoder["outputs"]
        layers = int(decoder["num_hidden_layers"])
        _check_sizes(model_dir, model, decoder, layers, len(input_types))
        pasts = expand_kv(inputs["past_key_names"], inputs["past_value_names"], layers)
        presents = expand_kv(outputs["present_key_names"], outputs["present_value_names"], layers)
        names = tuple((p, q) for p, q in zip(pasts, presents) if p in input_types)
        if not names:
            raise MetadataError(f"{onnx_path.name}: none of the past key/value inputs exists")
        missing = [q for _, q in names if q not in output_names]
        if missing:
            raise MetadataError(f"{onnx_path.name}: present outputs {missing[:3]} missing")
        kv_type = input_types[names[0][0]]
        if kv_type not in _ELEM_TYPES:
            raise MetadataError(
                f"{onnx_path.name}: KV element type {onnx.TensorProto.DataType.Name(kv_type)} "
                "is not supported (float32 / float16)"
            )

        metadata_path = model_dir / METADATA_FILE
        if metadata_path.is_file():
            layout = layout_id(load_metadata(metadata_path)["model"]["io"]["kv_layout"])
            graph_layout = model_kv_layout({files[0]: nodes})
            if layout != graph_layout:
                raise MetadataError(
                    f"{metadata_path} says kv_layout {layout}, the graph's nodes use "
                    f"{graph_layout}: regenerate it (gen_inference_metadata --force)"
                )
        else:
            layout = model_kv_layout({files[0]: nodes})

        kv = KvSpec(
            names=names,
            kv_heads=int(decoder["num_key_value_heads"]),
            head_dim=int(decoder["head_size"]),
            dtype=np.dtype(_ELEM_TYPES[kv_type]),
            layout=layout,
            context_length=int(model["context_length"]),
        )
        eos = model.get("eos_token_id", [])
        position_ids = inputs.get("position_ids")
        mask_name = inputs["attention_mask"]
        return cls(
            model_dir=model_dir,
            onnx_path=onnx_path,
            kv=kv,
            input_ids=inputs["input_ids"],
            attention_mask=mask_name,
            position_ids=position_ids if position_ids in input_types else None,
            logits=outputs["logits"],
            mask_dtype=np.dtype(_ELEM_TYPES[input_types[mask_name]]),
            vocab_size=int(model["vocab_size"]),
            eos_token_ids=tuple(int(t) for t in (eos if isinstance(eos, list) else [eos])),
            pad_token_id=int(model.get("pad_token_id") or 0),
            custom_ops_library=decoder.get("session_options", {}).get("custom_ops_library"),
            gqa_nodes=tuple((node_label(n, i), n.domain) for i, n in enumerate(nodes)),
        )


MAX_CONTEXT = 1 << 24  # tokens: far above any model's context; a larger value is a broken file


def _check_sizes(model_dir: Path, model: dict, decoder: dict, layers: int, graph_inputs: int):
    """The sizes and token ids of genai_config.json in range, before anything is allocated or
    derived from them (a layer count of 10**9 would otherwise expand 2 * 10**9 KV names, and a
    context of 10**12 reserve terabytes): MetadataError naming the key, the value and the bound."""
    where = model_dir / "genai_config.json"

    def check(key: str, value: int, low: int, high: int, why: str = "") -> None:
        if not low <= value <= high:
            raise MetadataError(f"{where}: {key} = {value} is out of range [{low}, {high}]{why}")

    # Every layer has a past key and a past value input.
    check("model.decoder.num_hidden_layers", layers, 1, graph_inputs // 2,
          f" (the graph has {graph_inputs} inputs)")  # fmt: skip
    check("model.context_length", int(model["context_length"]), 1, MAX_CONTEXT)
    check("model.decoder.num_key_value_heads", int(decoder["num_key_value_heads"]), 1, 1 << 12)
    check("model.decoder.head_size", int(decoder["head_size"]), 1, 1 << 12)
    vocab = int(model["vocab_size"])
    check("model.vocab_size", vocab, 1, 1 << 24)
    eos = model.get("eos_token_id", [])
    for token in eos if isinstance(eos, list) else [eos]:
        check("model.eos_token_id", int(token), 0, vocab - 1, " (the vocabulary)")
    check("model.pad_token_id", int(model.get("pad_token_id") or 0), 0, vocab - 1,
          " (the vocabulary)")  # fmt: skip
