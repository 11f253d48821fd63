"""model/gqa_schema.py's inputs and outputs are ONNX Runtime's com.microsoft::GroupQueryAttention
schema, as the installed onnxruntime registers it, by name and index, followed by the PER_TOKEN
scale caches that only ai.kvlayout has (docs/CONTRACT.md)."""

from __future__ import annotations

import onnxruntime
import pytest
from ort_kvlayout.model import gqa_schema

KVLAYOUT_ONLY_INPUTS = ("past_key_scale", "past_value_scale")
KVLAYOUT_ONLY_OUTPUTS = ("present_key_scale", "present_value_scale")


def _ort_gqa_schema():
    """The newest com.microsoft::GroupQueryAttention schema of the installed onnxruntime."""
    try:
        from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema
    except ImportError:
        pytest.skip(
            f"onnxruntime {onnxruntime.__version__} does not expose its operator schemas "
            "(no get_all_operator_schema in onnxruntime.capi.onnxruntime_pybind11_state)"
        )
    found = [
        s
        for s in get_all_operator_schema()
        if s.name == "GroupQueryAttention" and s.domain == "com.microsoft"
    ]
    assert found, f"onnxruntime {onnxruntime.__version__} has no com.microsoft::GroupQueryAttention"
    return max(found, key=lambda s: s.since_version)


def test_inputs_are_orts_then_the_scale_caches():
    schema = _ort_gqa_schema()
    ort = tuple(p.name for p in schema.inputs)
    assert len(ort) == schema.max_input
    assert gqa_schema.GQA_INPUTS == ort + KVLAYOUT_ONLY_INPUTS


def test_outputs_are_orts_then_the_scale_caches():
    schema = _ort_gqa_schema()
    ort = tuple(p.name for p in schema.outputs)
    assert len(ort) == schema.max_output
    assert gqa_schema.GQA_OUTPUTS == ort + KVLAYOUT_ONLY_OUTPUTS


@pytest.mark.parametrize(
    ("constant", "name"),
    [("PAST_KEY", "past_key"), ("PAST_VALUE", "past_value"), ("K_SCALE", "k_scale"),
     ("V_SCALE", "v_scale"), ("Q_NORM", "q_norm_weight"), ("K_NORM", "k_norm_weight")],
)  # fmt: skip
def test_input_constants_are_orts_indices(constant, name):
    ort = [p.name for p in _ort_gqa_schema().inputs]
    assert getattr(gqa_schema, constant) == ort.index(name)


@pytest.mark.parametrize(
    ("constant", "name"),
    [("PRESENT_KEY", "present_key"), ("PRESENT_VALUE", "present_value"),
     ("OUTPUT_QK", "output_qk")],
)  # fmt: skip
def test_output_constants_are_orts_indices(constant, name):
    ort = [p.name for p in _ort_gqa_schema().outputs]
    assert getattr(gqa_schema, constant) == ort.index(name)


def test_the_scale_cache_constants_follow_orts_ports():
    schema = _ort_gqa_schema()
    n_in, n_out = len(schema.inputs), len(schema.outputs)
    assert (gqa_schema.PAST_K_SCALE, gqa_schema.PAST_V_SCALE) == (n_in, n_in + 1)
    assert (gqa_schema.PRESENT_K_SCALE, gqa_schema.PRESENT_V_SCALE) == (n_out, n_out + 1)
