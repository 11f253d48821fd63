"""The patcher and the metadata tool read GroupQueryAttention attributes with the op's strictness,
from the op's own table (csrc/core/gqa_attributes.h through ort_kvlayout._C): a name outside it,
a wrong type, or kv_layout other than INT 0 or 1 is refused by node name, exit 2, nothing written."""

from __future__ import annotations

import pytest
from ort_kvlayout.model.config import MetadataError
from ort_kvlayout.model.gqa_schema import gqa_attribute_types
from ort_kvlayout.tools.cli import metadata_main, patch_main
from ort_kvlayout.tools.metadata import build_metadata
from synthetic_models import Variant, make_model_dir, snapshot

NODE = "/model/layers.0/attn/GroupQueryAttention"


def _ort_schema_types() -> dict[str, str]:
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    for s in C.get_all_operator_schema():
        if s.name == "GroupQueryAttention" and s.domain == "com.microsoft":
            return {n: a.type.name for n, a in s.attributes.items()}
    raise AssertionError("onnxruntime has no com.microsoft::GroupQueryAttention schema")


def test_table_is_the_ops_and_matches_ort_schema():
    """The tools' table comes from the compiled op and is ORT's schema plus kv_layout."""
    from ort_kvlayout import _C

    assert gqa_attribute_types() == _C.gqa_attribute_types()
    assert gqa_attribute_types() == dict(_ort_schema_types(), kv_layout="INT")


# (variant, text the refusal must hold)
REFUSED = {
    "kv_layout_float": (
        Variant(domain="ai.kvlayout", extra_attrs={"kv_layout": 1.0}),
        "attribute 'kv_layout' must be of type INT, got FLOAT",
    ),
    "kv_layout_2": (Variant(domain="ai.kvlayout", kv_layout=2), "'kv_layout' must be 0 or 1"),
    "kv_layout_string": (
        Variant(domain="ai.kvlayout", extra_attrs={"kv_layout": "1"}),
        "attribute 'kv_layout' must be of type INT, got STRING",
    ),
    "scale_int": (Variant(extra_attrs={"scale": 1}), "'scale' must be of type FLOAT, got INT"),
    "do_rotary_ints": (
        Variant(domain="ai.kvlayout", kv_layout=1, extra_attrs={"do_rotary": [1]}),
        "'do_rotary' must be of type INT, got INTS",
    ),
    "misspelled": (
        Variant(extra_attrs={"softcapp": 2.0}),
        "attribute 'softcapp' is not in the ai.kvlayout contract",
    ),
    "quant_type_int": (
        Variant(extra_attrs={"k_quant_type": 0}),
        "'k_quant_type' must be of type STRING, got INT",
    ),
}


@pytest.mark.parametrize("name", REFUSED)
def test_patcher_refuses_by_node_name(tmp_path, name, capsys):
    variant, reason = REFUSED[name]
    src = make_model_dir(tmp_path / "model", variant)
    before = snapshot(src)
    lib = tmp_path / "libfake.so"
    lib.write_bytes(b"\x7fELF")
    out = tmp_path / "out"
    assert patch_main([str(src), "-o", str(out), "--library", str(lib)]) == 2
    err = capsys.readouterr().err
    assert NODE in err and reason in err, err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["libfake.so", "model"]
    assert snapshot(src) == before


@pytest.mark.parametrize("name", ["kv_layout_float", "kv_layout_2", "scale_int", "misspelled"])
def test_metadata_refuses_by_node_name(tmp_path, name, capsys):
    """Before: kv_layout=1.0 gave seq_major_bsnh while the op refuses (or ran head-major)."""
    variant, reason = REFUSED[name]
    src = make_model_dir(tmp_path / "model", variant)
    with pytest.raises(MetadataError) as err:
        build_metadata(src)
    assert NODE in str(err.value) and reason in str(err.value)
    assert metadata_main([str(src), "--stdout"]) == 2
    err_text = capsys.readouterr().err
    assert NODE in err_text and reason in err_text
    assert not (src / "inference_metadata.yaml").exists()


def test_int_kv_layout_read():
    """INT 0 / 1 are read as the layouts (the strict reader does not refuse the valid ones)."""
    import onnx
    from ort_kvlayout.model.graph import GraphError, node_kv_layout

    for value, want in ((0, 0), (1, 1)):
        node = onnx.helper.make_node(
            "GroupQueryAttention", [], [], domain="ai.kvlayout", kv_layout=value
        )
        assert node_kv_layout(node) == want
    node = onnx.helper.make_node("GroupQueryAttention", [], [], domain="ai.kvlayout", kv_layout=1.0)
    with pytest.raises(GraphError, match="kv_layout' must be INT 0 or 1, got FLOAT"):
        node_kv_layout(node)


def test_without_compiled_module_the_tools_fail_clearly(tmp_path, monkeypatch, capsys):
    """The table lives in ort_kvlayout._C: without it the tools stop with one line, exit 2."""
    import sys

    src = make_model_dir(tmp_path / "model")
    gqa_attribute_types.cache_clear()
    import ort_kvlayout

    monkeypatch.setitem(sys.modules, "ort_kvlayout._C", None)  # import raises ImportError
    monkeypatch.delattr(ort_kvlayout, "_C", raising=False)
    try:
        assert metadata_main([str(src), "--stdout"]) == 2
        err = capsys.readouterr().err
        assert "ort_kvlayout._C" in err and "reinstall" in err and len(err.splitlines()) == 1
        assert patch_main([str(src), "-o", str(tmp_path / "out"), "--library", str(src)]) == 2
        assert not (tmp_path / "out").exists()
    finally:
        gqa_attribute_types.cache_clear()
