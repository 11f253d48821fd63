"""The model patcher on synthetic onnxruntime-genai-style directories
(tests/helpers/synthetic_models.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from ort_kvlayout.model.config import load_metadata
from ort_kvlayout.model.graph import iter_gqa_nodes
from ort_kvlayout.tools import patch as patch_mod
from ort_kvlayout.tools.cli import patch_main
from ort_kvlayout.tools.patch import PatchError, UnsupportedNodeError, patch_model_dir
from synthetic_models import Variant, make_model_dir, snapshot

DOMAIN = "ai.kvlayout"


def real_library() -> str:
    import ort_kvlayout

    try:
        return ort_kvlayout.library_path()
    except (FileNotFoundError, OSError) as exc:
        pytest.skip(f"custom-op library not built: {exc}")


def gqa_nodes(model_dir: Path) -> list[onnx.NodeProto]:
    return list(iter_gqa_nodes(onnx.load(str(model_dir / "model.onnx"), load_external_data=False)))


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


VARIANTS = {
    "packed": Variant(),
    "separate_qkv": Variant(packed=False),
    "local_window": Variant(local_window_size=4),
    "sliding_window_cache": Variant(local_window_size=8, sliding_window_cache=1),
    "qk_norm": Variant(qk_norm=True),
    # ORT 1.32's per-tensor epsilons: the op reads them, so the patcher keeps them.
    "qk_norm_per_tensor_eps": Variant(qk_norm=True, extra_attrs={"q_norm_epsilon": 1e-5}),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_rewrites_every_node_and_keeps_the_rest(tmp_path, fake_library, name):
    src = make_model_dir(tmp_path / "model", VARIANTS[name])
    before = snapshot(src)
    out = tmp_path / "out"
    result = patch_model_dir(src, out, layout="seq-major", library=fake_library)

    assert snapshot(src) == before, "MODEL_DIR must not change"
    assert result.gqa_nodes == result.rewritten == 2
    original, patched = gqa_nodes(src), gqa_nodes(out)
    assert [n.domain for n in patched] == [DOMAIN] * 2
    for a, b in zip(original, patched):
        assert attrs(b) == {**attrs(a), "kv_layout": 1}
        assert list(a.input) == list(b.input) and list(a.output) == list(b.output)
        assert a.name == b.name
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert {(o.domain, o.version) for o in model.opset_import} >= {
        (DOMAIN, 1),
        ("com.microsoft", 1),
    }
    onnx.checker.check_model(model)
    # Every file copied; the library and the metadata added.
    copied = snapshot(out)
    assert set(copied) == set(before) | {"libort_kvlayout.so", "inference_metadata.yaml"}
    for rel in set(before) - {"model.onnx", "genai_config.json"}:
        assert copied[rel][1] == before[rel][1], rel
    assert copied["libort_kvlayout.so"][1] == fake_library.read_bytes()
    config = json.loads((out / "genai_config.json").read_text())
    options = config["model"]["decoder"]["session_options"]
    assert options["custom_ops_library"] == "libort_kvlayout.so"
    assert options["provider_options"] == []  # the rest untouched
    original_config = json.loads((src / "genai_config.json").read_text())
    del options["custom_ops_library"]
    assert config == original_config
    assert load_metadata(out / "inference_metadata.yaml")["model"]["io"]["kv_layout"] == (
        "seq_major_bsnh"
    )
    assert leftovers(tmp_path) == []


def test_head_major_and_layout_switch(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model")
    head = patch_model_dir(src, tmp_path / "head", layout="head-major", library=fake_library)
    assert [(n.domain, attrs(n)["kv_layout"]) for n in gqa_nodes(head.out_dir)] == [(DOMAIN, 0)] * 2
    seq = patch_model_dir(head.out_dir, tmp_path / "seq", layout="seq-major", library=fake_library)
    assert seq.rewritten == 2
    assert [(n.domain, attrs(n)["kv_layout"]) for n in gqa_nodes(seq.out_dir)] == [(DOMAIN, 1)] * 2
    meta = load_metadata(tmp_path / "head" / "inference_metadata.yaml")
    assert meta["model"]["io"]["kv_layout"] == "head_major_bnsh"


def test_idempotent(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model")
    once = patch_model_dir(src, tmp_path / "once", library=fake_library)
    twice = patch_model_dir(once.out_dir, tmp_path / "twice", library=fake_library)
    assert twice.rewritten == 0
    a, b = snapshot(once.out_dir), snapshot(twice.out_dir)
    assert {k: v[1] for k, v in a.items()} == {k: v[1] for k, v in b.items()}


def test_default_output_and_existing_output(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model")
    result = patch_model_dir(src, library=fake_library)
    assert result.out_dir == tmp_path / "model-seq-major"
    marker = result.out_dir / "marker"
    marker.write_text("old")
    with pytest.raises(PatchError, match="exists; pass --force"):
        patch_model_dir(src, library=fake_library)
    assert marker.exists()
    patch_model_dir(src, force=True, library=fake_library)
    assert not marker.exists() and (result.out_dir / "model.onnx").exists()
    assert leftovers(tmp_path) == []


def test_force_replaces_only_a_model_folder_and_never_the_working_directory(
    tmp_path, fake_library, monkeypatch
):
    src = make_model_dir(tmp_path / "model")
    data = tmp_path / "data"
    (data / "work").mkdir(parents=True)
    (data / "work" / "important.txt").write_text("precious")
    with pytest.raises(PatchError, match="holds no genai_config.json: --force replaces only"):
        patch_model_dir(src, data, force=True, library=fake_library)
    assert (data / "work" / "important.txt").read_text() == "precious"
    out = patch_model_dir(src, tmp_path / "out", library=fake_library).out_dir
    monkeypatch.chdir(out)
    with pytest.raises(PatchError, match="contains the working directory"):
        patch_model_dir(src, out, force=True, library=fake_library)
    assert (out / "model.onnx").exists() and leftovers(tmp_path) == []


def test_an_output_under_a_file_is_named_as_such(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(PatchError, match="afile is not a directory"):
        patch_model_dir(src, tmp_path / "afile" / "sub" / "out", library=fake_library)


def test_a_dangling_link_as_output_is_refused(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model")
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "elsewhere" / "x")
    with pytest.raises(PatchError, match="dangling symbolic link"):
        patch_model_dir(src, link, library=fake_library)
    assert not (tmp_path / "elsewhere").exists()


def test_an_output_name_as_long_as_a_name_can_be(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model")
    out = patch_model_dir(src, tmp_path / ("b" * 250), library=fake_library).out_dir
    assert (out / "model.onnx").exists() and leftovers(tmp_path) == []


def test_a_library_that_is_not_a_shared_library_is_refused(tmp_path):
    src = make_model_dir(tmp_path / "model")
    junk = tmp_path / "notalib.so"
    junk.write_text("junk\n")
    with pytest.raises(PatchError, match="not a shared library"):
        patch_model_dir(src, tmp_path / "out", library=junk)
    with pytest.raises(PatchError, match="is a directory"):
        patch_model_dir(src, tmp_path / "out", library=tmp_path)
    assert not (tmp_path / "out").exists()


def test_no_metadata_drops_the_sources_metadata_file(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model")
    (src / "inference_metadata.yaml").write_text("kv_layout: head_major_bnsh  # the source's\n")
    out = patch_model_dir(src, tmp_path / "out", library=fake_library, metadata=False).out_dir
    assert not (out / "inference_metadata.yaml").exists()
    assert (src / "inference_metadata.yaml").exists()


def test_refuses_output_inside_model_dir(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model")
    for out in (src, src / "patched", tmp_path):
        with pytest.raises(PatchError, match="must not be"):
            patch_model_dir(src, out, force=True, library=fake_library)


REFUSED = {
    "k_v_scale_inputs": (Variant(quantized="scales"), "k_scale/v_scale"),
    "quant_type": (Variant(quantized="quant_type"), "k_quant_type=PER_TENSOR"),
    "kv_cache_bit_width": (Variant(quantized="bit_width"), "kv_cache_bit_width=8"),
    "output_qk": (Variant(output_qk="output"), "output_qk"),
    "qk_output_attr": (Variant(output_qk="attr"), "qk_output"),
    "unknown_attr": (Variant(extra_attrs={"future_knob": 3}), "future_knob"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_refuses_unsupported_nodes_by_name(tmp_path, fake_library, name):
    variant, reason = REFUSED[name]
    src = make_model_dir(tmp_path / "model", variant)
    before = snapshot(src)
    with pytest.raises(UnsupportedNodeError) as err:
        patch_model_dir(src, tmp_path / "out", library=fake_library)
    message = str(err.value)
    for layer in range(variant.layers):
        assert f"/model/layers.{layer}/attn/GroupQueryAttention" in message
    assert reason in message
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []
    assert snapshot(src) == before


def test_cli_refusal_exit_code(tmp_path, fake_library, capsys):
    src = make_model_dir(tmp_path / "model", Variant(quantized="quant_type"))
    code = patch_main([str(src), "-o", str(tmp_path / "out"), "--library", str(fake_library)])
    assert code == 2
    err = capsys.readouterr().err
    assert "/model/layers.0/attn/GroupQueryAttention" in err and "quantized KV" in err
    assert not (tmp_path / "out").exists()


def test_no_gqa_node(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model", Variant(no_gqa=True))
    with pytest.raises(PatchError, match="no GroupQueryAttention node"):
        patch_model_dir(src, tmp_path / "out", library=fake_library)
    assert not (tmp_path / "out").exists()


def test_missing_genai_config_key_fails_whole_patch(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model", Variant(drop_config_keys=["model.context_length"]))
    with pytest.raises(PatchError, match="model.context_length"):
        patch_model_dir(src, tmp_path / "out", library=fake_library)
    assert not (tmp_path / "out").exists()
    # Without metadata it patches.
    patch_model_dir(src, tmp_path / "out", library=fake_library, metadata=False)
    assert not (tmp_path / "out" / "inference_metadata.yaml").exists()


def test_existing_foreign_custom_ops_library_refused(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model")
    config = json.loads((src / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["custom_ops_library"] = "libother.so"
    (src / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(PatchError, match="libother.so"):
        patch_model_dir(src, tmp_path / "out", library=fake_library)
    assert not (tmp_path / "out").exists()


def test_external_data_kept_byte_identical_and_never_loaded(tmp_path, fake_library, monkeypatch):
    size = 64 << 20
    src = make_model_dir(tmp_path / "model", Variant(external_data=True, data_bytes=size))
    data = src / "model.onnx.data"
    assert data.stat().st_size > size
    before = snapshot(src)

    def refuse(*_args, **_kwargs):
        raise AssertionError("external data must not be loaded")

    # Every onnx entry point that reads external data into memory.
    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_model", refuse)
    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_tensor", refuse)
    monkeypatch.setattr(onnx, "load_external_data_for_model", refuse)
    start = time.perf_counter()
    result = patch_model_dir(src, tmp_path / "out", library=fake_library)
    seconds = time.perf_counter() - start
    monkeypatch.undo()

    assert seconds < 5, f"patching a {size >> 20} MiB model took {seconds:.1f} s"
    out_data = result.out_dir / "model.onnx.data"
    assert out_data.read_bytes() == data.read_bytes()
    assert snapshot(src) == before
    # The graph still points at the data file, and loads whole from the output directory.
    model = onnx.load(str(result.out_dir / "model.onnx"))
    embed = next(t for t in model.graph.initializer if t.name == "embed")
    assert onnx.numpy_helper.to_array(embed).shape == (64, 128)


def test_copy_instead_of_link(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model", Variant(external_data=True, data_bytes=32 << 20))
    linked = patch_model_dir(src, tmp_path / "linked", library=fake_library)
    copied = patch_model_dir(src, tmp_path / "copied", library=fake_library, link=False)
    src_ino = (src / "model.onnx.data").stat().st_ino
    assert (copied.out_dir / "model.onnx.data").stat().st_ino != src_ino
    assert (linked.out_dir / "model.onnx.data").read_bytes() == (
        src / "model.onnx.data"
    ).read_bytes()


@pytest.mark.parametrize("stage", ["copy", "metadata", "commit"])
def test_failure_mid_patch_leaves_nothing(tmp_path, fake_library, monkeypatch, stage):
    src = make_model_dir(tmp_path / "model", Variant(external_data=True, data_bytes=1 << 20))
    before = snapshot(src)

    def boom(*_args, **_kwargs):
        raise OSError(f"injected failure during {stage}")

    if stage == "copy":
        real_copy = patch_mod._copy_file

        def copy_then_fail(src_file, *args, **kwargs):
            if src_file.name == "model.onnx.data":
                boom()
            return real_copy(src_file, *args, **kwargs)

        monkeypatch.setattr(patch_mod, "_copy_file", copy_then_fail)
    elif stage == "metadata":
        monkeypatch.setattr(patch_mod, "write_metadata", boom)
    else:
        monkeypatch.setattr(patch_mod, "_commit", boom)

    with pytest.raises(OSError, match="injected"):
        patch_model_dir(src, tmp_path / "out", library=fake_library)
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []
    assert snapshot(src) == before

    # Under --force an existing output (an earlier patch: a model folder) survives a failed
    # patch untouched.
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("previous result")
    (tmp_path / "out" / "genai_config.json").write_text("{}")
    with pytest.raises(OSError, match="injected"):
        patch_model_dir(src, tmp_path / "out", force=True, library=fake_library)
    assert (tmp_path / "out" / "keep").read_text() == "previous result"
    assert leftovers(tmp_path) == []


def test_a_full_disk_is_named_by_the_outputs_file(tmp_path, fake_library, monkeypatch, capsys):
    """A copy that fails without naming its file (ENOSPC from copy_file_range) is reported by
    the output's path of the file, not the temporary directory's (which is gone)."""
    import errno

    src = make_model_dir(tmp_path / "model", Variant(external_data=True, data_bytes=1 << 16))
    real = patch_mod._kernel_copy

    def full(src_file, dst_file):
        if src_file.name == "model.onnx.data":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(src_file, dst_file)

    monkeypatch.setattr(patch_mod, "_kernel_copy", full)
    out = tmp_path / "out"
    assert patch_main([str(src), "-o", str(out), "--library", str(fake_library)]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'model.onnx.data'}: No space left on device" in err and ".partial" not in err
    assert not out.exists() and leftovers(tmp_path) == []


def test_output_permissions_are_ordinary(tmp_path, fake_library):
    src = make_model_dir(tmp_path / "model")
    out = patch_model_dir(src, tmp_path / "out", library=fake_library).out_dir
    umask = os.umask(0)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777) == (0o777 & ~umask)


# ---------------------------------------------------------------------------------------------
# Running the patched models (needs the custom-op library)

RUNNABLE = ["packed", "separate_qkv", "local_window", "sliding_window_cache"]


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize("layout", ["seq-major", "head-major"])
def test_patched_model_generates_the_same_tokens(tmp_path, name, layout):
    from ort_kvlayout.tools.reference_loop import Generator

    real_library()
    src = make_model_dir(tmp_path / "model", VARIANTS[name])
    out = patch_model_dir(src, tmp_path / "out", layout=layout).out_dir
    prompt = [1, 5, 7, 9, 11, 13, 17, 19, 23]
    a = Generator(src, custom_ops_library=None).generate(prompt, 12)
    b = Generator(out).generate(prompt, 12)
    assert a.tokens == b.tokens
    la, lb = np.stack(a.logits), np.stack(b.logits)
    # fp32 with a different summation order: relative to the logits' scale (~100 here).
    np.testing.assert_allclose(la, lb, rtol=0, atol=1e-5 * float(np.abs(la).max()))


def test_qk_norm_patched_model_runs(tmp_path):
    """ORT's CPU GQA has no q/k norm, so only the two layouts can be compared here."""
    from ort_kvlayout.tools.reference_loop import Generator

    real_library()
    src = make_model_dir(tmp_path / "model", VARIANTS["qk_norm"])
    runs = [
        Generator(patch_model_dir(src, tmp_path / layout, layout=layout).out_dir).generate(
            [1, 2, 3, 4, 5], 8
        )
        for layout in ("seq-major", "head-major")
    ]
    assert runs[0].tokens == runs[1].tokens


def test_cli_verify(tmp_path, capsys):
    real_library()
    src = make_model_dir(tmp_path / "model")
    assert patch_main([str(src), "-o", str(tmp_path / "out"), "--verify", "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "tokens agree" in out and "max |logit diff|" in out
    # the synthetic folder has no tokenizer: the report says the prompt was not used
    assert "has no tokenizer.json: 8 fixed token ids, not the prompt" in out


def test_cli_verify_settings_that_cannot_run_are_refused_before_writing(tmp_path, capsys):
    src = make_model_dir(tmp_path / "model")
    context = json.loads((src / "genai_config.json").read_text())["model"]["context_length"]
    out = tmp_path / "out"
    for args, message in (
        (["--prompt", " "], "--prompt is empty"),
        (["--tokens", str(context)], f"does not fit the model's context of {context} tokens"),
    ):
        assert patch_main([str(src), "-o", str(out), "--verify", *args]) == 2
        assert message in capsys.readouterr().err and not out.exists()


def test_cli_verify_options_without_verify_are_refused(tmp_path, capsys):
    src = make_model_dir(tmp_path / "model")
    for args in (["--prompt", "Hello"], ["--tokens", "4"]):
        assert patch_main([str(src), "-o", str(tmp_path / "out"), *args]) == 2
        assert "are --verify's" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_verify_fails_on_a_tokenizer_that_does_not_load(tmp_path, capsys):
    real_library()
    pytest.importorskip("tokenizers")  # a backend that refuses the file (none: fixed ids)
    src = make_model_dir(tmp_path / "model")
    (src / "tokenizer.json").write_text("{bad")
    code = patch_main([str(src), "-o", str(tmp_path / "out"), "--verify", "--tokens", "4"])
    err = capsys.readouterr().err
    assert code == 3 and "--verify could not run" in err and (tmp_path / "out").is_dir()


def test_cli_verify_reports_disagreement(tmp_path, capsys, monkeypatch):
    real_library()
    from ort_kvlayout.tools import reference_loop as generate

    src = make_model_dir(tmp_path / "model")
    real_generate = generate.Generator.generate

    def skewed(self, *args, **kwargs):
        result = real_generate(self, *args, **kwargs)
        if self.library:  # the patched run
            result.tokens[-1] = (result.tokens[-1] + 1) % 64
        return result

    monkeypatch.setattr(generate.Generator, "generate", skewed)
    assert patch_main([str(src), "-o", str(tmp_path / "out"), "--verify", "--tokens", "4"]) == 1
    assert "DISAGREE" in capsys.readouterr().out
