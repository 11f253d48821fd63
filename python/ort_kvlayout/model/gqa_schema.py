"""The GroupQueryAttention schema as the tools read it: inputs and outputs by index, the
attribute table, and how a node's quantized-cache attributes read.

The names follow ORT 1.32's com.microsoft::GroupQueryAttention, which ai.kvlayout extends with
the PER_TOKEN scale caches (docs/CONTRACT.md). The attribute table is owned by the C++ op
(csrc/core/gqa_attributes.h) and read from the compiled module, so the tools check a node with
the op's own strictness.
"""

from __future__ import annotations

import functools

import onnx

# Input/output names of the contract, by index.
GQA_INPUTS = (
    "query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
    "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink", "k_scale", "v_scale",
    "q_norm_weight", "k_norm_weight", "query_seqlens",
    "past_key_scale", "past_value_scale",  # ai.kvlayout only: PER_TOKEN scale caches
)  # fmt: skip
GQA_OUTPUTS = (
    "output", "present_key", "present_value", "output_qk",
    "present_key_scale", "present_value_scale",  # ai.kvlayout only: PER_TOKEN
)  # fmt: skip

PAST_KEY, PAST_VALUE = GQA_INPUTS.index("past_key"), GQA_INPUTS.index("past_value")
K_SCALE, V_SCALE = GQA_INPUTS.index("k_scale"), GQA_INPUTS.index("v_scale")
Q_NORM, K_NORM = GQA_INPUTS.index("q_norm_weight"), GQA_INPUTS.index("k_norm_weight")
PAST_K_SCALE = GQA_INPUTS.index("past_key_scale")
PAST_V_SCALE = GQA_INPUTS.index("past_value_scale")
PRESENT_KEY = GQA_OUTPUTS.index("present_key")
PRESENT_VALUE = GQA_OUTPUTS.index("present_value")
OUTPUT_QK = GQA_OUTPUTS.index("output_qk")
PRESENT_K_SCALE = GQA_OUTPUTS.index("present_key_scale")
PRESENT_V_SCALE = GQA_OUTPUTS.index("present_value_scale")


class MissingModuleError(RuntimeError):
    """The compiled module ort_kvlayout._C cannot be imported (a broken install)."""


@functools.cache
def gqa_attribute_types() -> dict[str, str]:
    """The op's attribute table, {name: "INT" | "FLOAT" | "STRING"}, read from the compiled
    module (csrc/core/gqa_attributes.h owns it)."""
    # Imported here, not at the top: a broken install must still import the package and reach
    # this clear error, not fail on the first `import ort_kvlayout.tools...`.
    try:
        from .. import _C
    except ImportError as exc:
        raise MissingModuleError(
            f"ort_kvlayout._C (the compiled module holding the op's attribute table) cannot be "
            f"imported ({exc}); reinstall ort-kvlayout with pip"
        ) from exc
    return dict(_C.gqa_attribute_types())


QUANT_TYPE_ATTRS = ("k_quant_type", "v_quant_type")
QUANT_TYPES = ("PER_TENSOR", "PER_CHANNEL", "PER_TOKEN")  # besides NONE


def quant_type(attrs: dict[str, object], name: str) -> str:
    """k_quant_type / v_quant_type as the op reads it (case-insensitive), upper case; `attrs` as
    graph.node_attrs gives them."""
    return attrs.get(name, b"NONE").decode(errors="replace").upper()  # type: ignore[union-attr]


def is_quantized(node: onnx.NodeProto) -> bool:
    """A GQA node with a quantized KV cache (k_quant_type or v_quant_type not NONE)."""
    attrs = {
        a.name: onnx.helper.get_attribute_value(a)
        for a in node.attribute
        if a.name in QUANT_TYPE_ATTRS
    }
    return any(quant_type(attrs, n) != "NONE" for n in QUANT_TYPE_ATTRS)
