"""What a generation runtime needs to know about a model directory, read once.

    spec = ModelSpec.from_dir("smollm2-seq-major")
    spec.kv  # KvSpec: buffer names, kv heads, head dim, dtype, layout, context length, quant

Sources: genai_config.json (names, sizes, token ids), inference_metadata.yaml when present (the
KV layout the patcher recorded), and the decoder graph read without its external data (the KV
element type, which KV ports exist, the GQA nodes' kv_layout when there is no metadata, and
their quantized-cache attributes).

Quantized caches (docs/CONTRACT.md section 13, PER_TOKEN in its own section): the cache element
type is the graph's: int8, uint8 (packed int4, two codes a byte: rows of (H + 1) // 2 bytes) or
float8e4m3fn. Static scales (PER_TENSOR / PER_CHANNEL) are initializers of the graph and need
nothing else; PER_TOKEN models also have one float32 scale cache per KV cache, (B, Nkv, C),
named by genai_config's past_key_scale_names / past_value_scale_names /
present_key_scale_names / present_value_scale_names (default past_key_scale.%d, ...).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx

from ..model.config import (
    METADATA_FILE,
    SCALE_KEYS,
    MetadataError,
    decoder_files,
    expand_kv,
    load_genai_config,
    load_metadata,
    model_kv_layout,
)
from ..model.gqa_schema import QUANT_TYPE_ATTRS, quant_type
from ..model.graph import iter_gqa_nodes, node_attrs, node_label
from ..op.layout import layout_id
from ..op.library import DOMAIN

_ELEM_TYPES = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32,
}
# KV cache element types: the float caches, and the quantized ones (kv_cache_bit_width).
_CACHE_TYPES = {
    onnx.TensorProto.FLOAT: np.dtype(np.float32),
    onnx.TensorProto.FLOAT16: np.dtype(np.float16),
    onnx.TensorProto.INT8: np.dtype(np.int8),
    onnx.TensorProto.UINT8: np.dtype(np.uint8),
    onnx.TensorProto.FLOAT8E4M3FN: np.dtype(ml_dtypes.float8_e4m3fn),
}
_QUANT_BITS = {  # quantized cache element type -> the kv_cache_bit_width it holds
    onnx.TensorProto.INT8: 8,
    onnx.TensorProto.UINT8: 4,
    onnx.TensorProto.FLOAT8E4M3FN: 8,
}
QUANT_SCHEMES = ("none", "per_tensor", "per_channel", "per_token")


def onnx_element_type(dtype: np.dtype) -> int:
    """The ONNX element type of a cache dtype (IO binding takes it where numpy has no type:
    onnxruntime cannot bind an ml_dtypes float8 array by its numpy dtype)."""
    for elem, known in _CACHE_TYPES.items():
        if np.dtype(dtype) == known:
            return elem
    raise ValueError(f"no ONNX element type for a KV cache of {np.dtype(dtype)}")


@dataclass(frozen=True)
class KvSpec:
    """The KV buffers of a model: one (B, kv_heads, C, row) buffer per (past, present), row =
    head_dim elements (packed int4: (head_dim + 1) // 2 bytes); with PER_TOKEN also one float32
    (B, kv_heads, C) scale buffer per (past, present) scale pair, laid out like its cache with
    head_dim 1."""

    names: tuple[tuple[str, str], ...]  # (past input, present output): k0, v0, k1, v1, ...
    kv_heads: int
    head_dim: int
    dtype: np.dtype  # the cache's stored element: float32/16, int8, uint8 (packed), float8
    layout: int  # 0 head-major BNSH, 1 seq-major BSNH
    context_length: int  # the longest sequence the model supports (rotary tables, config)
    bits: int = 0  # kv_cache_bit_width: 0 unquantized, 8 or 4
    quant: str = "none"  # QUANT_SCHEMES: none, per_tensor, per_channel, per_token
    scale_names: tuple[tuple[str, str], ...] = ()  # PER_TOKEN: as names, for the scale caches

    @property
    def buffers(self) -> int:
        """KV buffers (the scale buffers are counted by scale_spec)."""
        return len(self.names)

    @property
    def row(self) -> int:
        """Stored elements of one (token, kv head) row: head_dim, or (head_dim + 1) // 2 bytes
        for a packed int4 cache."""
        return (self.head_dim + 1) // 2 if self.bits == 4 else self.head_dim

    @property
    def element_type(self) -> int:
        """The cache's ONNX element type (what IO binding is given)."""
        return onnx_element_type(self.dtype)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one batch entry in one KV buffer (all kv heads)."""
        return self.kv_heads * self.row * np.dtype(self.dtype).itemsize

    def scale_spec(self) -> KvSpec | None:
        """The scale buffers as a spec of their own (float32, head_dim 1, the same layout and
        context), or None without PER_TOKEN."""
        if not self.scale_names:
            return None
        return KvSpec(self.scale_names, self.kv_heads, 1, np.dtype(np.float32), self.layout,
                      self.context_length)  # fmt: skip

    def entry_bytes(self, capacity: int) -> int:
        """Bytes of one batch entry of `capacity` tokens over every buffer: the KV caches and,
        with PER_TOKEN, their scale caches (what a preallocated slot holds)."""
        scales = self.scale_spec()
        per_token = self.token_bytes * self.buffers
        per_token += scales.token_bytes * scales.buffers if scales else 0
        return capacity * per_token

    @classmethod
    def synthetic(
        cls,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: type | np.dtype = np.float16,
        layout: int | str = 1,
        context_length: int = 4096,
        bits: int = 0,
        quant: str = "none",
    ) -> KvSpec:
        """A spec without a model (benchmarks, unit tests): k/v names per layer; with
        quant="per_token" also the scale names (past_key_scale.%d, ...)."""
        names = tuple(
            (f"past.{i}.{kv}", f"present.{i}.{kv}")
            for i in range(layers)
            for kv in ("key", "value")
        )
        scale_names: tuple[tuple[str, str], ...] = ()
        if quant == "per_token":
            scale_names = tuple(
                (f"past_{kv}_scale.{i}", f"present_{kv}_scale.{i}")
                for i in range(layers)
                for kv in ("key", "value")
            )
        return cls(names, kv_heads, head_dim, np.dtype(dtype), layout_id(layout), context_length,
                   bits, quant, scale_names)  # fmt: skip


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
        except MetadataError:  # names its own file and rule (model.onnx, metadata, ids)
            raise
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
        if kv_type not in _CACHE_TYPES:
            raise MetadataError(
                f"{onnx_path.name}: KV element type {onnx.TensorProto.DataType.Name(kv_type)} "
                "is not supported (float32 / float16, or int8 / uint8 / float8e4m3fn quantized)"
            )
        bits, quant = _cache_quant(onnx_path.name, nodes, kv_type)
        scale_names: tuple[tuple[str, str], ...] = ()
        if quant == "per_token":
            scale_names = _scale_names(
                onnx_path.name, decoder, layers, names, input_types, output_names
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
            dtype=_CACHE_TYPES[kv_type],
            layout=layout,
            context_length=int(model["context_length"]),
            bits=bits,
            quant=quant,
            scale_names=scale_names,
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


def _cache_quant(file: str, nodes: list[onnx.NodeProto], kv_type: int) -> tuple[int, str]:
    """(kv_cache_bit_width, scheme) of the GQA nodes, which must agree with each other and with
    the cache element type: a float cache unquantized, int8 / float8 8 bits, uint8 4 bits."""
    formats: dict[tuple[int, str], list[str]] = {}
    for i, node in enumerate(nodes):
        attrs = node_attrs(node)
        kq, vq = (quant_type(attrs, n).lower() for n in QUANT_TYPE_ATTRS)
        scheme = kq if kq == vq else f"k_{kq}_v_{vq}"
        bits = int(attrs.get("kv_cache_bit_width", 0)) if scheme != "none" else 0  # type: ignore[call-overload]
        formats.setdefault((bits, scheme), []).append(node_label(node, i))
    if len(formats) > 1:
        lines = "; ".join(
            f"{scheme} {bits} bits: {', '.join(labels[:3])}"
            for (bits, scheme), labels in formats.items()
        )
        raise MetadataError(f"{file}: the GroupQueryAttention nodes disagree on the KV cache "
                            f"format ({lines})")  # fmt: skip
    bits, scheme = next(iter(formats)) if formats else (0, "none")
    type_name = onnx.TensorProto.DataType.Name(kv_type).lower()
    if scheme not in QUANT_SCHEMES:
        raise MetadataError(f"{file}: KV quantization {scheme!r} is not supported "
                            f"({', '.join(QUANT_SCHEMES)})")  # fmt: skip
    need = _QUANT_BITS.get(kv_type, 0)
    if bits != need:
        what = f"kv_cache_bit_width={bits} ({scheme})" if scheme != "none" else "unquantized"
        raise MetadataError(f"{file}: the GQA nodes are {what}, the KV cache is {type_name} "
                            f"(which needs {need or 'no'} bits)")  # fmt: skip
    return bits, scheme


def _scale_names(
    file: str,
    decoder: dict,
    layers: int,
    names: tuple[tuple[str, str], ...],
    input_types: dict[str, int],
    output_names: set[str],
) -> tuple[tuple[str, str], ...]:
    """(past, present) scale-cache names in the order of `names` (k0, v0, k1, ...): from
    genai_config's *_scale_names templates, else the default ones; each must be a float32 graph
    input / a graph output."""

    def template(section: str, key: str) -> str:
        value = decoder[section].get(key, SCALE_KEYS[key])
        if not isinstance(value, str) or "%d" not in value:
            raise MetadataError(
                f"genai_config.json: model.decoder.{section}.{key} must be a %d template, "
                f"got {value!r}"
            )
        return value

    kv = expand_kv(decoder["inputs"]["past_key_names"], decoder["inputs"]["past_value_names"],
                   layers)  # fmt: skip
    pasts = expand_kv(template("inputs", "past_key_scale_names"),
                      template("inputs", "past_value_scale_names"), layers)  # fmt: skip
    presents = expand_kv(template("outputs", "present_key_scale_names"),
                         template("outputs", "present_value_scale_names"), layers)  # fmt: skip
    scale_of = {k: (p, q) for k, p, q in zip(kv, pasts, presents)}
    pairs = []
    for past_kv, _ in names:  # the layers that have a KV cache (hybrid models: not every one)
        past, present = scale_of[past_kv]
        if input_types.get(past) != onnx.TensorProto.FLOAT:
            got = input_types.get(past)
            what = "missing" if got is None else onnx.TensorProto.DataType.Name(got).lower()
            raise MetadataError(
                f"{file}: PER_TOKEN scale cache input {past!r} is {what}; a float32 graph "
                "input is needed"
            )
        if present not in output_names:
            raise MetadataError(f"{file}: PER_TOKEN scale cache output {present!r} is missing")
        pairs.append((past, present))
    return tuple(pairs)


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
