"""Which GroupQueryAttention nodes the ai.kvlayout op runs as ORT runs them: the patcher's
refusals, each a reason that names what the op would refuse or run differently.

    from ort_kvlayout.tools.node_checks import check_model
    for name, reason in check_model(model): ...

The attributes are read with the op's own table (model/graph.attribute_problems); on top of it:
values v1 cannot run with ORT's meaning, the q/k norm epsilons, the input/output counts,
output_qk, and the quantized-cache setup (attributes, scales, scale caches and the cache's
element type must agree: CONTRACT sections 13 and 14).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import onnx

from ..model.gqa_schema import (
    GQA_INPUTS,
    GQA_OUTPUTS,
    K_NORM,
    K_SCALE,
    OUTPUT_QK,
    PAST_K_SCALE,
    PAST_KEY,
    PAST_V_SCALE,
    PRESENT_K_SCALE,
    PRESENT_KEY,
    PRESENT_V_SCALE,
    Q_NORM,
    QUANT_TYPES,
    V_SCALE,
    quant_type,
)
from ..model.graph import attribute_problems, iter_gqa_nodes, node_attrs, node_label


def _present(names, index: int) -> bool:
    return len(names) > index and names[index] != ""


# Attribute values ORT's com.microsoft op runs but the v1 op cannot run with the same meaning
# (tests/op/test_attribute_values.py checks every value class against ORT's CPU op): refused up
# front, so the patcher never writes a model that fails at load or runs differently. Values the
# op runs as ORT does (e.g. smooth_softmax=2 or softcap=-1: off in both) are not listed.
_VALUE_RULES: tuple[tuple[str, Callable[[object], bool], str], ...] = (
    ("scale", lambda v: not math.isfinite(v), "a non-finite scale is not supported in v1"),  # type: ignore[arg-type]
    ("softcap", lambda v: math.isinf(v) and v > 0, "softcap=inf is not supported in v1"),  # type: ignore[operator,arg-type]
)


def value_problems(attrs: dict[str, object]) -> list[str]:
    """Reasons from _VALUE_RULES for a node's (correctly typed) attribute values."""
    return [
        f"attribute '{name}'={attrs[name]!r}: {reason}"
        for name, bad, reason in _VALUE_RULES
        if name in attrs and bad(attrs[name])
    ]


def norm_epsilon_problems(attrs: dict[str, object]) -> list[str]:
    """With q/k norm weights: the epsilons the op uses (q_/k_norm_epsilon when >= 0, else
    qk_norm_epsilon) must be finite and >= 0 (v1 refuses others when the node runs)."""
    qk = attrs.get("qk_norm_epsilon", 1e-6)
    problems = []
    for name in ("q_norm_epsilon", "k_norm_epsilon"):
        own = attrs.get(name, -1.0)
        eps = own if own >= 0 else qk  # type: ignore[operator]
        if not (math.isfinite(eps) and eps >= 0):  # type: ignore[arg-type,operator]
            problems.append(
                f"norm epsilon {name}={own!r} / qk_norm_epsilon={qk!r}: a finite epsilon >= 0 is "
                "needed with q/k norm weights in v1"
            )
    return problems


# The cache element types each kv_cache_bit_width takes (CONTRACT section 13 and PER_TOKEN).
_BITS_CACHE = {
    8: (onnx.TensorProto.INT8, onnx.TensorProto.FLOAT8E4M3FN),
    4: (onnx.TensorProto.UINT8,),
}


def quant_problems(node: onnx.NodeProto, attrs: dict[str, object], cache_type: int) -> list[str]:
    """Why the op refuses this node's quantized-cache setup (CONTRACT section 13): the attributes,
    scales and cache element type must agree. cache_type: past/present key's ONNX element type
    (0: unknown). A consistent int8 / packed-int4 / fp8 node gives no reason; so does a
    PER_TOKEN one with both scale caches and no k_scale/v_scale."""
    kq, vq = quant_type(attrs, "k_quant_type"), quant_type(attrs, "v_quant_type")
    bits = attrs.get("kv_cache_bit_width", 0)
    scales = [n for i, n in ((K_SCALE, "k_scale"), (V_SCALE, "v_scale")) if _present(node.input, i)]
    scale_caches = [GQA_INPUTS[i] for i in (PAST_K_SCALE, PAST_V_SCALE) if _present(node.input, i)]
    scale_caches += [
        GQA_OUTPUTS[i] for i in (PRESENT_K_SCALE, PRESENT_V_SCALE) if _present(node.output, i)
    ]
    if kq == vq == "NONE":
        reasons = []
        if cache_type == onnx.TensorProto.FLOAT8E4M3FN:
            reasons.append("an fp8 (float8e4m3fn) KV cache without k_quant_type/v_quant_type")
        if scales:
            reasons.append(
                f"{'/'.join(scales)} input(s) without k_quant_type/v_quant_type: the op refuses a "
                "scale for a cache that is not quantized (k_scale/v_scale)"
            )
        if scale_caches:
            reasons.append(
                f"scale cache(s) {'/'.join(scale_caches)} without k_quant_type=PER_TOKEN: the op "
                "refuses them"
            )
        if bits != 0:
            reasons.append(
                f"quantized KV cache (kv_cache_bit_width={bits}) without k_quant_type/"
                "v_quant_type: the op needs 0 when the cache is not quantized"
            )
        return reasons
    reasons = []
    for name, text in (("k_quant_type", kq), ("v_quant_type", vq)):
        if text not in QUANT_TYPES and text != "NONE":
            reasons.append(
                f"quantized KV cache ({name}={text}): not NONE, PER_TENSOR, PER_CHANNEL or "
                "PER_TOKEN"
            )
    if kq != vq:
        reasons.append(
            f"quantized KV cache (k_quant_type={kq}, v_quant_type={vq}): the op (as ORT's CPU "
            "kernel) needs the same quant type for K and V"
        )
    if bits not in _BITS_CACHE:
        reasons.append(
            f"quantized KV cache (k_quant_type={kq}) needs kv_cache_bit_width 8 or 4, got {bits}"
        )
    elif cache_type and cache_type not in _BITS_CACHE[bits]:  # type: ignore[index]
        got = onnx.TensorProto.DataType.Name(cache_type).lower()
        need = " or ".join(
            onnx.TensorProto.DataType.Name(t).lower()
            for t in _BITS_CACHE[bits]  # type: ignore[index]
        )
        reasons.append(
            f"quantized KV cache (kv_cache_bit_width={bits}) needs a {need} cache, the graph's "
            f"is {got}"
        )
    if "PER_TOKEN" in (kq, vq):
        if scales:
            reasons.append(
                f"{'/'.join(scales)} with k_quant_type=PER_TOKEN: the scales are computed per "
                "token (k_scale/v_scale must be absent)"
            )
        missing = [
            GQA_INPUTS[i] for i in (PAST_K_SCALE, PAST_V_SCALE) if not _present(node.input, i)
        ]
        missing += [
            GQA_OUTPUTS[i] for i in (PRESENT_K_SCALE, PRESENT_V_SCALE)
            if not _present(node.output, i)
        ]  # fmt: skip
        if _present(node.input, PAST_KEY) and missing:
            reasons.append(
                f"PER_TOKEN quantized KV cache without its scale cache(s) {'/'.join(missing)}"
            )
    else:
        if len(scales) < 2:
            reasons.append(f"quantized KV cache (k_quant_type={kq}) needs both k_scale and v_scale")
        if scale_caches:
            reasons.append(
                f"scale cache(s) {'/'.join(scale_caches)} need k_quant_type=PER_TOKEN, the "
                f"node's is {kq}"
            )
    return reasons


def unsupported_reason(node: onnx.NodeProto, cache_type: int = 0) -> str | None:
    """Why the ai.kvlayout op cannot run this GQA node as ORT runs it, or None when it can.

    cache_type: the ONNX element type of the node's past/present key (0: unknown), for the
    quantized-cache checks (cache_element_types gives it for a whole model)."""
    reasons = attribute_problems(node)  # names and types, read with the op's table
    if reasons:  # values of the wrong type are not read further
        return "; ".join(reasons)
    attrs = node_attrs(node)
    if len(node.input) > len(GQA_INPUTS):
        reasons.append(f"{len(node.input)} inputs, the contract has {len(GQA_INPUTS)}")
    if len(node.output) > len(GQA_OUTPUTS):
        reasons.append(f"{len(node.output)} outputs, the contract has {len(GQA_OUTPUTS)}")
    reasons += quant_problems(node, attrs, cache_type)
    if _present(node.output, OUTPUT_QK) or attrs.get("qk_output", 0) != 0:
        reasons.append("output_qk / qk_output is not supported")
    reasons += value_problems(attrs)
    if _present(node.input, Q_NORM) or _present(node.input, K_NORM):
        reasons += norm_epsilon_problems(attrs)
    return "; ".join(reasons) or None


def cache_element_types(model: onnx.ModelProto) -> dict[str, int]:
    """ONNX element type of every typed value of the main graph (inputs, outputs, value_info)."""
    g = model.graph
    return {
        v.name: v.type.tensor_type.elem_type
        for v in (*g.input, *g.output, *g.value_info)
        if v.type.HasField("tensor_type")
    }


def node_cache_name(node: onnx.NodeProto) -> str:
    """The name that types a GQA node's KV cache: its past_key input, else its present_key."""
    if _present(node.input, PAST_KEY):
        return node.input[PAST_KEY]
    return node.output[PRESENT_KEY] if _present(node.output, PRESENT_KEY) else ""


def check_model(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """(node name, reason) for every GQA node that cannot be patched."""
    refusals = []
    types = cache_element_types(model)
    for i, node in enumerate(iter_gqa_nodes(model)):
        reason = unsupported_reason(node, types.get(node_cache_name(node), 0))
        if reason:
            refusals.append((node_label(node, i), reason))
    return refusals
