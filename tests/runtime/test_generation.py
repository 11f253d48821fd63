"""The generation runtime (ort_kvlayout.runtime.generation) on synthetic models, CPU.

Reference: the plain loop of ort_kvlayout.tools.reference_loop.Generator on the original model
(ORT's own com.microsoft GQA, batch 1, a growing mask, numpy-owned buffers), an implementation
independent of the runtime and its cache.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from ort_kvlayout.runtime.kv_cache import CACHE_MODES, KvCapacityError
from ort_kvlayout.runtime.kv_memory import KvMemoryError, allocator_stats, simulate_commit_failure
from ort_kvlayout.runtime.sampling import Sampler, SamplingParams
from synthetic_models import VOCAB, Variant, make_model_dir

PROMPT = [1, 5, 7, 9, 11, 13, 17, 19, 23]
SHORT = [4, 8, 15, 16]
TOKENS = 60  # 256 B per token and buffer: rows cross a 4 KiB page every 16 tokens


def library_or_skip() -> None:
    import ort_kvlayout

    try:
        ort_kvlayout.library_path()
    except (FileNotFoundError, OSError) as exc:
        pytest.skip(f"custom-op library not built: {exc}")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    from ort_kvlayout.tools.patch import patch_model_dir

    library_or_skip()
    root = tmp_path_factory.mktemp("gen")
    src = make_model_dir(root / "original", Variant(layers=2))
    return {
        "original": src,
        "seq": patch_model_dir(src, root / "seq", layout="seq-major").out_dir,
        "head": patch_model_dir(src, root / "head", layout="head-major").out_dir,
    }


def reference(model_dir, prompt, n) -> list[int]:
    from ort_kvlayout.tools.reference_loop import Generator

    return Generator(model_dir, custom_ops_library=None).generate(prompt, n).tokens


@pytest.fixture(scope="module")
def ref(dirs) -> dict:
    return {
        "long": reference(dirs["original"], PROMPT, TOKENS),
        "short": reference(dirs["original"], SHORT, TOKENS),
    }


@pytest.fixture(autouse=True)
def no_leaks():
    before = allocator_stats()["cpu"]
    yield
    simulate_commit_failure("cpu", -1)
    assert allocator_stats()["cpu"] == before  # every cache closed: accounting back


def runtime(model_dir, cache="growable", **kwargs):
    from ort_kvlayout.runtime.generation import Runtime

    return Runtime(model_dir, cache=cache, **kwargs)


@pytest.mark.parametrize("fixed_mask", [False, True])
@pytest.mark.parametrize("mode", CACHE_MODES)
@pytest.mark.parametrize("model", ["original", "seq", "head"])
def test_greedy_tokens_identical_across_modes_and_layouts(dirs, ref, model, mode, fixed_mask):
    with runtime(dirs[model], mode, fixed_mask=fixed_mask, bucket_tokens=16) as rt:
        out = rt.generate(PROMPT, TOKENS, eos_token_ids=[])
        stats = out.stats
    assert out.tokens == [ref["long"]]
    assert out.finish_reasons == ["length"] and out.steps == TOKENS
    if mode == "growable":
        assert stats.bytes_moved == 0 and stats.growth_events >= 3  # several page boundaries
        assert stats.committed_bytes < stats.reserved_bytes
    elif mode == "bucket":  # 16 -> 32 -> 64 -> 128 tokens: three re-strides
        assert stats.growth_events == 3 and stats.bytes_moved > 0
    else:
        assert stats.committed_bytes == stats.reserved_bytes and stats.growth_events == 0


@pytest.mark.parametrize("mode", CACHE_MODES)
@pytest.mark.parametrize("model", ["seq", "head"])
def test_batch_of_two_prompt_lengths_matches_each_alone(dirs, ref, model, mode):
    with runtime(dirs[model], mode, fixed_mask=True, bucket_tokens=16) as rt:
        out = rt.generate([SHORT, PROMPT], TOKENS, eos_token_ids=[])
    assert out.tokens == [ref["short"], ref["long"]]


@pytest.mark.parametrize("mode", CACHE_MODES)
def test_float16_model_chooses_on_float16_logits(tmp_path, mode):
    """A float16 model (what a CUDA export holds: float16 logits) through the runtime: the
    greedy choice on the logits' bits gives the reference loop's tokens (ORT's own GQA on the
    original), in both mask modes, and the kept logits are float32 copies, one per step, whose
    argmax is the token chosen there."""
    from ort_kvlayout.tools.patch import patch_model_dir

    src = make_model_dir(tmp_path / "original", Variant(layers=2, float16=True))
    seq = patch_model_dir(src, tmp_path / "seq", layout="seq-major").out_dir
    want = reference(src, PROMPT, 24)
    for fixed_mask in (False, True):
        with runtime(seq, mode, fixed_mask=fixed_mask, bucket_tokens=16) as rt:
            assert rt.logits_dtype == np.float16
            out = rt.generate(PROMPT, 24, eos_token_ids=[], keep_logits=True)
        assert out.tokens == [want], (mode, fixed_mask)
        assert len(out.logits) == 24 and all(k.dtype == np.float32 for k in out.logits)
        assert [int(np.argmax(k[0])) for k in out.logits] == want
        assert len({k.tobytes() for k in out.logits}) > 1  # copies, not views of one buffer


def test_seq_major_growth_keeps_pointer_and_prefix(dirs, ref):
    """Growth maps more memory after the live prefix: the bound pointers and the rows already
    written stay where they are (checked through the cache's memory, step by step)."""
    with runtime(dirs["seq"], "growable") as rt:
        snapshots = []

        def check(_tokens):
            cache = rt.cache
            rows = cache.tokens[0] * cache.spec.token_bytes
            snapshots.append(([b.ptr for b in cache.buffers], cache.read_bytes(0, 0, rows)))

        out = rt.generate(PROMPT, TOKENS, eos_token_ids=[], on_step=check)
        assert out.tokens == [ref["long"]]
        final_ptrs = [b.ptr for b in rt.cache.buffers]
        final = rt.cache.read_bytes(0, 0, rt.cache.tokens[0] * rt.cache.spec.token_bytes)
    for ptrs, rows in snapshots:
        assert ptrs == final_ptrs
        assert final[: len(rows)] == rows
    assert out.stats.growth_events >= 3 and out.stats.bytes_moved == 0


def test_committed_bytes_follow_live_tokens(dirs):
    with runtime(dirs["seq"], "growable") as rt:
        seen = []
        rt.generate(PROMPT, TOKENS, eos_token_ids=[], on_step=lambda _: seen.append(
            (rt.cache.tokens[0], rt.cache.stats.committed_bytes,
             rt.cache.measured_committed_bytes())
        ))  # fmt: skip
        spec = rt.cache.spec
    for tokens, committed, measured in seen:
        per_buffer = -(-tokens * spec.token_bytes // 4096) * 4096
        assert committed == spec.buffers * per_buffer
        assert measured == committed


def test_stops_at_eos(dirs, ref):
    eos = ref["long"][5]
    first = ref["long"].index(eos)
    with runtime(dirs["seq"]) as rt:
        out = rt.generate([PROMPT, SHORT], TOKENS, eos_token_ids=[eos])
    assert out.tokens[0] == ref["long"][: first + 1] and out.finish_reasons[0] == "eos"
    if eos in ref["short"]:
        assert out.tokens[1] == ref["short"][: ref["short"].index(eos) + 1]
    else:
        assert out.tokens[1] == ref["short"] and out.finish_reasons[1] == "length"


def test_model_eos_ids_come_from_genai_config(dirs):
    config = json.loads((dirs["seq"] / "genai_config.json").read_text())
    with runtime(dirs["seq"]) as rt:
        assert list(rt.spec.eos_token_ids) == config["model"]["eos_token_id"]


@pytest.mark.parametrize("mode", CACHE_MODES)
def test_generating_past_the_reserved_context_is_a_clear_error(dirs, mode):
    with runtime(dirs["seq"], mode, capacity=64) as rt:
        with pytest.raises(KvCapacityError, match=r"needs 68 cache rows; the KV cache reserves 64"):
            rt.generate(PROMPT, 60)
        with pytest.raises(KvCapacityError, match=r"^prompt 1 of 9 tokens \+ 60 new tokens"):
            rt.generate([PROMPT[:2], PROMPT], 60)  # a batch: the entry is named
        assert rt.generate(PROMPT, 56, eos_token_ids=[]).steps == 56  # exactly fits: row 63
    with runtime(dirs["seq"], mode) as rt, pytest.raises(KvCapacityError, match="context 256"):
        rt.generate(PROMPT, 300)


def test_failed_physical_allocation_mid_generation(dirs, ref):
    """The hook is armed after the prefill (whose commits succeed): a decode step's growth fails
    part-way (2 of the 4 buffers' next pages commit, the third does not); the error is clear and
    the same runtime and cache then generate the right tokens."""
    with runtime(dirs["seq"], "growable") as rt:
        seen = []

        def arm_after_prefill(step_tokens):
            if not seen:
                simulate_commit_failure("cpu", after=2)
            seen.append(step_tokens)

        with pytest.raises(KvMemoryError, match="ENOMEM"):
            rt.generate(PROMPT, TOKENS, eos_token_ids=[], on_step=arm_after_prefill)
        # Prompt 9 tokens, 16 per page: the first growth is at the 17th row, decode step 8.
        assert len(seen) == 16 - len(PROMPT) + 1
        assert [t for (t,) in seen] == ref["long"][: len(seen)]
        cache = rt.cache
        assert cache.measured_committed_bytes() == cache.stats.committed_bytes  # exact accounting
        out = rt.generate(PROMPT, TOKENS, eos_token_ids=[])  # the same runtime and cache
        assert out.tokens == [ref["long"]] and rt.cache is cache


def test_sampling_is_seeded_and_top_k_1_is_greedy(dirs, ref):
    with runtime(dirs["seq"]) as rt:
        a = rt.generate(PROMPT, 20, SamplingParams(1.0, 0, 0.9, seed=3), eos_token_ids=[])
        b = rt.generate(PROMPT, 20, SamplingParams(1.0, 0, 0.9, seed=3), eos_token_ids=[])
        c = rt.generate(PROMPT, 20, SamplingParams(5.0, 1, 1.0, seed=9), eos_token_ids=[])
    assert a.tokens == b.tokens
    assert c.tokens == [ref["long"][:20]]


def test_sampler_top_p_keeps_the_smallest_set():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=0))
    drawn = {int(sampler(logits)[0]) for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 + 0.3 reaches 0.7; 2 and 3 are cut
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=3, seed=0))
    assert {int(sampler(logits)[0]) for _ in range(300)} == {0, 1, 2}
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(temperature=1.0, top_p=0.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seed": "abc"}, "seed must be an integer, got 'abc'"),
        ({"seed": 1.5}, "seed must be an integer, got 1.5"),
        ({"top_k": 2.5}, "top_k must be an integer, got 2.5"),
        ({"top_k": True}, "top_k must be an integer, got True"),
        ({"temperature": "1"}, "temperature must be a number, got '1'"),
        ({"temperature": None}, "temperature must be a number, got None"),
        ({"top_p": [0.5]}, r"top_p must be a number, got \[0.5\]"),
    ],
)
def test_sampling_params_of_the_wrong_type_are_named(kwargs, message):
    with pytest.raises(TypeError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_are_named(dirs):
    with runtime(dirs["seq"]) as rt:
        with pytest.raises(ValueError, match="at least one token"):
            rt.generate([PROMPT, []], 4)
        with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {VOCAB}\)"):
            rt.generate([1, VOCAB + 3], 4)
        with pytest.raises(ValueError, match=r"prompt 0: token ids must be integers, got 5.0"):
            rt.generate([5.0, 6.5], 4)
        with pytest.raises(TypeError, match="max_new_tokens must be an integer, got 2.5"):
            rt.generate(PROMPT, 2.5)
    with pytest.raises(RuntimeError, match="the Runtime is closed"):
        rt.generate(PROMPT, 4)


def test_window_sized_caches_are_refused(tmp_path):
    from ort_kvlayout.model.config import MetadataError
    from ort_kvlayout.runtime.generation import Runtime

    src = make_model_dir(tmp_path / "m", Variant(local_window_size=8, sliding_window_cache=1))
    with pytest.raises(MetadataError, match="sliding_window_cache=1"):
        Runtime(src, custom_ops_library=None)


def test_options_given_register_once(dirs, ref):
    """ort_kvlayout.register(so) and then a Runtime given `so` (README and RUNTIME.md both show
    it) make one session that runs; the library is not registered twice."""
    import onnxruntime as ort
    import ort_kvlayout

    so = ort.SessionOptions()
    ort_kvlayout.register(so)
    with runtime(dirs["seq"], session_options=so) as rt:
        out = rt.generate(PROMPT, 4, eos_token_ids=[])
    assert list(out.tokens[0]) == ref["long"][:4]


def test_options_registered_by_hand_too_are_named_as_a_clash(dirs):
    """register_custom_ops_library() by hand, and then the Runtime's own registration: ORT's
    "Domain already set in registry" is explained, naming the two calls."""
    import onnxruntime as ort
    import ort_kvlayout

    so = ort.SessionOptions()
    so.register_custom_ops_library(ort_kvlayout.library_path())
    with pytest.raises(ValueError, match="register the ai.kvlayout op library twice"):
        runtime(dirs["seq"], session_options=so)


# ---------------------------------------------------------------------------------------------
# The command line, with a word-level tokenizer.json written for the synthetic vocabulary


@pytest.fixture(scope="module")
def tokenized_dir(dirs):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(dirs["seq"] / "tokenizer.json"))
    return dirs["seq"]


def test_cli_streams_the_greedy_text(tokenized_dir, ref, capsys):
    from ort_kvlayout.runtime.cli import main

    prompt = " ".join(f"w{i}" for i in PROMPT)
    argv = [str(tokenized_dir), "--prompt", prompt, "--max-new-tokens", "12", "--cache", "bucket"]
    assert main(argv + ["--tokenizer", "tokenizers"]) == 0
    captured = capsys.readouterr()
    words = captured.out.split()
    expected = ref["long"][:12]
    stop = next((i for i, t in enumerate(expected) if t in (2, 3)), None)  # genai_config eos
    expected = expected[: stop + 1] if stop is not None else expected
    assert words == [f"w{t}" for t in expected]
    assert "KV (bucket, tokenizers tokenizer): committed" in captured.err
    assert "\033[K" not in captured.err  # stderr is no terminal here: no status redraws


def test_cli_stops_quietly_when_its_reader_goes_away(tokenized_dir):
    """`... | head -c 0`: the closed pipe ends the run with 141 and no traceback. The reader
    leaves before the first token is written (had it read some first, the run's whole output
    could fit the pipe's buffer, and the run end with 0 before it meets the closed pipe)."""
    import subprocess
    import sys

    prompt = " ".join(f"w{i}" for i in PROMPT)
    cmd = [sys.executable, "-m", "ort_kvlayout.runtime", str(tokenized_dir), "--prompt", prompt,
           "--max-new-tokens", "200", "--tokenizer", "tokenizers"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader leaves
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "Error" not in err


def test_cli_refuses_bad_sampling_flags(tokenized_dir, capsys):
    from ort_kvlayout.runtime.cli import main

    assert main([str(tokenized_dir), "--prompt", "w1", "--top-k", "5"]) == 2
    assert "need --temperature" in capsys.readouterr().err
    assert main([str(tokenized_dir), "--prompt", "w1", "--temperature", "1", "--seed", "-1"]) == 2
    assert capsys.readouterr().err == "error: --seed must be an integer >= 0, got -1\n"


def test_cli_names_a_missing_model_dir(tmp_path, capsys):
    """A missing MODEL_DIR is named as such, not as a missing tokenizer.json."""
    from ort_kvlayout.runtime.cli import main

    missing = tmp_path / "nowhere"
    assert main([str(missing), "--prompt", "w1"]) == 2
    assert capsys.readouterr().err == f"error: MODEL_DIR {missing} does not exist\n"
    (tmp_path / "file").write_text("x")
    assert main([str(tmp_path / "file"), "--prompt", "w1"]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_cli_refuses_a_prompt_that_is_not_unicode(tokenized_dir, capsys):
    """A prompt the shell could not decode (a lone surrogate: Python's surrogateescape of stray
    bytes) is refused by name, not by the tokenizer's TypeError."""
    from ort_kvlayout.runtime.cli import main

    assert main([str(tokenized_dir), "--prompt", "w1 \udcff"]) == 2
    assert "--prompt 1 is not valid Unicode text (at character 3)" in capsys.readouterr().err


def test_growable_cuda_cache_is_refused_for_an_unpatched_model(dirs):
    """ORT's com.microsoft GQA may read unmapped rows of a growable range: refused before any
    CUDA call (so this runs without a GPU), naming the nodes and the way out."""
    from ort_kvlayout.runtime.generation import Runtime
    from ort_kvlayout.runtime.model_spec import ModelSpec

    with pytest.raises(ValueError, match=r"com.microsoft op \(.+\).*--cache preallocated"):
        Runtime(dirs["original"], provider="cuda", cache="growable", custom_ops_library=None)

    assert ModelSpec.from_dir(dirs["seq"]).foreign_gqa_nodes() == []
    assert len(ModelSpec.from_dir(dirs["original"]).foreign_gqa_nodes()) == 2  # two layers


def test_cli_reports_a_corrupt_model_in_one_line(tokenized_dir, tmp_path, capsys):
    import shutil

    from ort_kvlayout.runtime.cli import main

    broken = shutil.copytree(tokenized_dir, tmp_path / "broken")
    (broken / "model.onnx").write_bytes(b"\x08\x07 this is not a protobuf \xff\xfe" * 10)
    assert main([str(broken), "--prompt", "w1 w2", "--tokenizer", "tokenizers"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "model.onnx: not a readable ONNX model" in err and "Traceback" not in err
    assert "genai_config.json" not in err  # the file at fault, not the config that names it

    config = json.loads((broken / "genai_config.json").read_text())
    del config["model"]["decoder"]["num_key_value_heads"]
    (broken / "genai_config.json").write_text(json.dumps(config))
    shutil.copy(tokenized_dir / "model.onnx", broken / "model.onnx")
    assert main([str(broken), "--prompt", "w1 w2", "--tokenizer", "tokenizers"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "genai_config.json: incomplete or malformed (KeyError: 'num_key_value_heads')" in err


def test_cli_reports_any_failure_in_one_line(tokenized_dir, monkeypatch, capsys):
    """An exception the CLI does not expect (here ORT's own Fail, a plain Exception subclass)
    is still one line with exit 2, its type named."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail
    from ort_kvlayout.runtime import generation
    from ort_kvlayout.runtime.cli import main

    def fail(*_args, **_kwargs):
        raise Fail("[ONNXRuntimeError] : 1 : FAIL : simulated\nsecond line")

    monkeypatch.setattr(generation.Runtime, "generate", fail)
    assert main([str(tokenized_dir), "--prompt", "w1", "--tokenizer", "tokenizers"]) == 2
    err = capsys.readouterr().err
    assert err == "error: Fail: [ONNXRuntimeError] : 1 : FAIL : simulated; second line\n"


class _Stream:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(
    ("stream", "quiet", "out_tty", "err_tty", "expected"),
    [
        (True, False, True, True, False),  # text streaming onto the terminal: no redraws
        (True, False, False, True, True),  # text redirected: the status line on the terminal
        (False, False, True, True, True),  # a batch (printed at the end): redraws
        (True, False, False, False, False),  # stderr to a file: no escape codes in it
        (False, True, False, True, False),  # --quiet
    ],
)
def test_cli_progress_never_erases_streamed_text(stream, quiet, out_tty, err_tty, expected):
    from ort_kvlayout.runtime.cli import redraws_progress

    got = redraws_progress(stream, quiet, _Stream(out_tty), _Stream(err_tty))
    assert got is expected


def test_sampler_tiny_temperature_is_greedy_and_bad_logits_are_named():
    logits = np.array([[0.1, 2.0, 1.9, -3.0], [5.0, 4.0, 4.5, 0.0]], np.float32)
    sampler = Sampler(SamplingParams(temperature=1e-30, seed=0))  # inf - inf gave NaN before
    assert sampler(logits).tolist() == [1, 0]
    bad = logits.copy()
    bad[1, 2] = np.nan
    for params in (SamplingParams(), SamplingParams(temperature=0.7, seed=1)):
        with pytest.raises(ValueError, match=r"batch entries \[1\] contain NaN or infinite"):
            Sampler(params)(bad)


def test_greedy_on_float16_logits_matches_argmax_of_their_values():
    """A CUDA model's float16 logits are chosen from on their bits (no float32 copy): the same
    token as np.argmax over the float32 values, ties (first wins) and -0.0 == +0.0 included."""
    every = np.arange(-(2**15), 2**15, dtype=np.int32).astype(np.int16).view(np.float16)
    finite = every[np.isfinite(every)]
    rng = np.random.default_rng(7)
    rows = [finite, finite[::-1], np.array([-0.0, 0.0, -0.0], np.float16)]
    for _ in range(200):
        width = int(rng.integers(1, 70))
        rows.append(rng.choice(finite, width))  # any finite value
        rows.append(rng.integers(-2, 3, width).astype(np.float16))  # many ties
        rows.append(np.array([-0.0, 0.0], np.float16)[rng.integers(0, 2, width)])
    greedy = Sampler()
    for row in rows:
        assert greedy(row[None])[0] == np.argmax(row.astype(np.float32)), row
    batch = rng.choice(finite, (3, 50))
    assert greedy(batch).tolist() == np.argmax(batch.astype(np.float32), axis=-1).tolist()
    for bad in (np.inf, -np.inf, np.nan):
        logits = np.zeros((2, 9), np.float16)
        logits[1, 4] = bad
        with pytest.raises(ValueError, match=r"batch entries \[1\] contain NaN or infinite"):
            greedy(logits)


@pytest.mark.parametrize("capacity", [0, -4])
def test_capacity_below_one_is_refused(dirs, capacity):
    with pytest.raises(ValueError, match=rf"capacity {capacity}: .* must be >= 1"):
        runtime(dirs["seq"], capacity=capacity)


def test_tokenizer_failure_is_one_line(tmp_path):
    from ort_kvlayout.model.tokenizer import load_tokenizer

    (tmp_path / "tokenizer.json").write_text("{ not json\n at all")
    with pytest.raises(RuntimeError, match="no tokenizer backend could load") as info:
        load_tokenizer(tmp_path)
    assert "\n" not in str(info.value)


def test_recapture_counted_only_when_ort_captures_again(dirs, ref):
    """The graph counters follow ORT's rule (CUDA_GRAPH_WARMUP_RUNS regular runs of a graph id,
    then a capture); the GPU test reading ORT's capture log is their oracle. Here, on the CPU
    with the graph ids run uncaptured, the edge: a bucket growth one step before the end starts
    a graph id that ORT never captures, so it is no re-capture."""
    from ort_kvlayout.runtime.generation import CUDA_GRAPH_WARMUP_RUNS

    assert CUDA_GRAPH_WARMUP_RUNS == 2
    with runtime(dirs["seq"], "bucket", fixed_mask=True, bucket_tokens=16) as rt:
        rt.cuda_graph = True  # count as the CUDA path does; the CPU session gets no graph ids
        rt.run_options = lambda _graph_id: None
        # Prompt 9: bucket 16 -> 32 at decode step 8 (row 17), -> 64 at step 24 (row 33).
        out = rt.generate(PROMPT, 25, eos_token_ids=[])  # decode steps 1..24
        assert out.tokens == [ref["long"][:25]]
        s = out.stats
        # graph 0: steps 1-7 (capture at 3, 4 replays); graph 1: steps 8-23 (capture at 10,
        # 13 replays); graph 2: step 24 alone, never captured.
        assert (s.graph_captures, s.replays, s.recaptures) == (2, 17, 1)


def test_streaming_decodes_a_short_tail_and_keeps_spaces(capsys):
    """The CLI's streaming decodes only the last few ids per step (not the whole text again) and
    prints exactly the full decode, leading spaces included (SentencePiece drops the space of a
    decode's first piece: the context ids keep it)."""
    from ort_kvlayout.runtime.cli import Progress

    pieces = ["\u2581The", "\u2581cap", "ital", "\u2581of", "\u2581Fr", "ance", "\u2581is", "."]

    class SentencePieceLike:
        def __init__(self):
            self.lengths: list[int] = []

        def decode(self, ids):
            self.lengths.append(len(ids))
            text = "".join(pieces[i % len(pieces)] for i in ids).replace("\u2581", " ")
            return text.removeprefix(" ")

    tok = SentencePieceLike()
    progress = Progress(tok, runtime=None, stream=True, quiet=True)
    ids = list(range(200))
    for t in ids:
        progress([t])
    out = capsys.readouterr().out
    assert out == progress.text == tok.decode(ids)
    assert max(tok.lengths[:-1]) <= 3  # two windows per step, each one or two pieces long


def test_runtime_reads_the_length_record_of_the_library_it_registered(dirs, ref):
    """A patched directory carries its own libort_kvlayout.so (genai_config's
    custom_ops_library), which the runtime's session loads: the per-step length-record check
    must reach that copy (it used to look only for the package's copy, found nothing, and
    repeated the failed lookup every step). An unpatched model registers no library and checks
    nothing."""
    from pathlib import Path

    from ort_kvlayout.op.library import string_function

    with runtime(dirs["seq"]) as rt:
        assert rt.library is not None and Path(rt.library).parent == Path(dirs["seq"])
        out = rt.generate(PROMPT, TOKENS, eos_token_ids=[])
        assert out.tokens[0] == ref["long"]
        assert string_function("OrtKvlayoutTakeLengthError", rt.library) is not None
    with runtime(dirs["original"]) as rt:
        assert rt.library is None
