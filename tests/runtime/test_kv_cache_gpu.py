"""The KV cache's CUDA virtual memory (_C.VmmReservation) and the runtime under CUDA graphs.

Needs a GPU, onnxruntime-gpu and ort_kvlayout built with CUDA (skipped otherwise, and under
GQA_GPU_EMULATE_CPU, which has no device memory to map).

* The allocator: granules mapped on demand at a fixed address, data kept across growth, a
  simulated failed cuMemCreate -> an error naming CUDA_ERROR_OUT_OF_MEMORY with the reservation
  still usable, the process totals back to zero after close.
* The runtime on a synthetic model with 4 KiB of KV per token and buffer (fp32, 8 KV heads of
  128), so a 2 MiB granule holds 512 tokens: a 500-token prompt and 40 new tokens cross a granule
  boundary mid-generation. Growable + CUDA graph: the same tokens and logits as a preallocated
  cache without graphs, one capture, replays across the growth, no re-capture, 0 bytes moved,
  the live prefix (read back from the device) and the pointers unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_util import EMULATE, SKIP_REASON

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(SKIP_REASON is not None, reason=f"GPU tests: {SKIP_REASON}"),
    pytest.mark.skipif(EMULATE, reason="CUDA virtual memory cannot be emulated on the CPU"),
]

PROMPT_LEN, NEW_TOKENS = 500, 40


@pytest.fixture(autouse=True)
def no_leaks():
    from ort_kvlayout.runtime.kv_memory import allocator_stats, simulate_commit_failure

    def device_totals():  # CUDA virtual memory (_C) and onnxruntime allocations
        return {k: v for k, v in allocator_stats().items() if k.startswith("cuda")}

    before = device_totals()
    yield
    simulate_commit_failure("cuda", -1)
    assert device_totals() == before


def test_reservation_maps_granules_on_demand():
    from ort_kvlayout.runtime.kv_memory import DeviceReservation, allocator_stats

    res = DeviceReservation(5 << 20)
    g = res.granule
    assert g >= 4096 and res.size % g == 0 and res.size >= 5 << 20
    assert res.committed_bytes == 0
    assert res.commit(0, 10) == g and res.commit(5, 100) == 0
    data = bytes(range(256)) * 16
    res.write(0, data)
    ptr = res.ptr
    assert res.commit(0, 2 * g + 1) == 2 * g  # two more granules, after the first
    assert res.ptr == ptr and res.read(0, len(data)) == data
    assert allocator_stats()["cuda"]["committed_bytes"] >= 3 * g
    res.close()
    res.close()


def test_driver_times_count_each_granule_mapped_and_unmapped():
    """kv_memory.driver_times(): one cuMemCreate and cuMemMap a granule mapped and one
    cuMemSetAccess a run of them, one cuMemUnmap and cuMemRelease a granule unmapped, each
    with its time."""
    from ort_kvlayout.runtime.kv_memory import DeviceReservation, driver_times

    def delta(before, after):
        return {n: after[n]["calls"] - before[n]["calls"] for n in after}

    res = DeviceReservation(8 << 20)
    g = res.granule
    before = driver_times()
    res.commit(0, 3 * g)
    mapped = driver_times()
    calls = delta(before, mapped)
    assert calls["cuMemCreate"] == calls["cuMemMap"] == 3 and calls["cuMemSetAccess"] == 1
    assert calls["cuMemUnmap"] == calls["cuMemRelease"] == 0
    assert all(mapped[n]["ns"] > before[n]["ns"] for n in ("cuMemCreate", "cuMemMap"))
    res.decommit(0, 2 * g)
    calls = delta(mapped, driver_times())
    assert calls["cuMemUnmap"] == calls["cuMemRelease"] == 2 and calls["cuMemCreate"] == 0
    assert calls["cuCtxSynchronize"] == 1
    unmapped = driver_times()
    res.commit(0, 3 * g)  # granules 0 and 1 again: one run
    calls = delta(unmapped, driver_times())
    assert calls["cuMemCreate"] == 2 and calls["cuMemSetAccess"] == 1
    res.write(0, b"mapped")
    assert res.read(0, 6) == b"mapped"
    res.close()


def test_failed_physical_allocation_names_the_cuda_error():
    from ort_kvlayout.runtime.kv_memory import (
        DeviceReservation,
        KvMemoryError,
        simulate_commit_failure,
    )

    res = DeviceReservation(8 << 20)
    g = res.granule
    simulate_commit_failure("cuda", after=1)
    with pytest.raises(KvMemoryError, match=r"cuMemCreate\(.*CUDA_ERROR_OUT_OF_MEMORY"):
        res.commit(0, 3 * g)
    assert res.committed_bytes == g  # the granule before the failure stays mapped
    res.write(0, b"still usable")
    assert res.commit(0, 3 * g) == 2 * g and res.read(0, 12) == b"still usable"
    res.close()


def test_misuse_is_refused_by_name():
    from ort_kvlayout import _C
    from ort_kvlayout.runtime.kv_memory import DeviceReservation

    res = DeviceReservation(4 << 20)
    with pytest.raises(_C.CudaError, match="not granule-aligned"):
        res._vmm.map(1, res.granule)
    with pytest.raises(_C.CudaError, match="unmapped granule"):
        res.read(0, 16)
    res.close()
    with pytest.raises(_C.CudaError, match="closed"):
        res._vmm.map(0, res.granule)


def test_cache_growth_on_the_device_keeps_pointer_and_content():
    from ort_kvlayout.runtime.kv_cache import KvCache
    from ort_kvlayout.runtime.model_spec import KvSpec

    spec = KvSpec.synthetic(2, 8, 128, np.float16, "seq-major", 8192)  # 2 KiB a token
    with KvCache.create(spec, "growable", device="cuda", batch=2) as cache:
        g = cache.granule
        cache.ensure([100, 1])
        assert cache.stats.committed_bytes == spec.buffers * 2 * g  # one granule per entry
        head = cache.read_bytes(0, 0, 100 * spec.token_bytes)
        ptrs = [b.ptr for b in cache.buffers]
        tokens = g // spec.token_bytes * 3 + 5  # into a fourth granule
        cache.ensure([tokens, 1])
        assert cache.stats.committed_bytes == spec.buffers * 5 * g
        assert [b.ptr for b in cache.buffers] == ptrs and cache.stats.bytes_moved == 0
        assert cache.read_bytes(0, 0, len(head)) == head


# ---------------------------------------------------------------------------------------------
# The runtime under CUDA graphs


def _wide_model(tmp_path_factory, context: int):
    import synthetic_models
    from ort_kvlayout.tools.patch import patch_model_dir

    saved = synthetic_models.MAX_POS
    synthetic_models.MAX_POS = context  # the context (rotary tables and genai_config)
    try:
        root = tmp_path_factory.mktemp(f"wide{context}")
        variant = synthetic_models.Variant(layers=2, num_heads=8, kv_heads=8, head_size=128)
        src = synthetic_models.make_model_dir(root / "original", variant)
    finally:
        synthetic_models.MAX_POS = saved
    return patch_model_dir(src, root / "seq", layout="seq-major").out_dir


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    return _wide_model(tmp_path_factory, 1024)


@pytest.fixture(scope="module")
def wider_model(tmp_path_factory):
    """Context 1100 tokens: not a multiple of the 512 tokens a 2 MiB granule holds."""
    return _wide_model(tmp_path_factory, 1100)


def prompt_ids(n: int) -> list[int]:
    return [(7 * i + 3) % 64 for i in range(n)]


def run(model_dir, mode, cuda_graph, on_step=None, session_options=None):
    from ort_kvlayout.runtime.generation import Runtime

    with Runtime(model_dir, "cuda", cache=mode, cuda_graph=cuda_graph, fixed_mask=True,
                 session_options=session_options) as rt:  # fmt: skip
        out = rt.generate(
            prompt_ids(PROMPT_LEN), NEW_TOKENS, eos_token_ids=[], keep_logits=True,
            on_step=(lambda t: on_step(rt, t)) if on_step else None,
        )  # fmt: skip
    return out


def test_growable_graph_replays_across_growth(wide_model):
    from ort_kvlayout.runtime.generation import CUDA_GRAPH_WARMUP_RUNS

    baseline = run(wide_model, "preallocated", cuda_graph=False)
    snapshots = []

    def snapshot(rt, _tokens):
        cache = rt.cache
        rows = cache.tokens[0] * cache.spec.token_bytes
        snapshots.append(([b.ptr for b in cache.buffers], cache.read_bytes(1, 0, rows)))

    out = run(wide_model, "growable", cuda_graph=True, on_step=snapshot)
    assert out.tokens == baseline.tokens
    np.testing.assert_allclose(np.stack(out.logits), np.stack(baseline.logits), atol=1e-4)
    s = out.stats
    granule_tokens = (2 << 20) // (8 * 128 * 4)
    assert PROMPT_LEN < granule_tokens < PROMPT_LEN + NEW_TOKENS  # the test's premise
    assert s.growth_events >= 2 and s.bytes_moved == 0 and s.recaptures == 0
    decode_steps = out.steps - 1
    assert s.graph_captures == 1
    assert s.replays == decode_steps - CUDA_GRAPH_WARMUP_RUNS - 1
    final_ptrs, final_rows = snapshots[-1]
    for ptrs, rows in snapshots:
        assert ptrs == final_ptrs and final_rows[: len(rows)] == rows


def test_bucket_graph_recaptures_on_growth(wide_model):
    baseline = run(wide_model, "preallocated", cuda_graph=False)
    out = run(wide_model, "bucket", cuda_graph=True)
    assert out.tokens == baseline.tokens
    s = out.stats
    assert s.recaptures >= 1 and s.bytes_moved > 0  # 512 -> 1024 tokens at row 512


def test_ort_log_confirms_the_capture_counters(wide_model, capfd):
    """ORT's CUDA EP logs "Capturing the cuda graph for this model" (INFO) each time it begins a
    capture: once for a growable cache across its growth, once more per bucket re-stride."""
    import onnxruntime as ort

    def verbose():
        so = ort.SessionOptions()
        so.log_severity_level = 1  # INFO: the capture message
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return so

    capfd.readouterr()
    growable = run(wide_model, "growable", cuda_graph=True, session_options=verbose())
    logged = capfd.readouterr().err.count("Capturing the cuda graph for this model")
    assert logged == growable.stats.graph_captures == 1
    bucket = run(wide_model, "bucket", cuda_graph=True, session_options=verbose())
    logged = capfd.readouterr().err.count("Capturing the cuda graph for this model")
    assert logged == bucket.stats.graph_captures == 1 + bucket.stats.recaptures


def test_batch_of_two_grows_across_several_granules_at_an_unaligned_capacity(wider_model):
    """Batch 2, prompts of 300 and 20 tokens, 600 new tokens, capacity 1100 rows (not a granule
    multiple: entry 1's prefix starts inside a granule). With 4 KiB per token a 2 MiB granule
    holds 512 rows: granule 0 holds entry 0's rows 0-511, granule 1 its rows 512-1023, granule 2
    its rows 1024-1099 and entry 1's rows 0-435. The prefill (300 padded rows for both entries)
    maps granules 0 and 2; decode then maps granule 1 when entry 0 reaches row 512 (step ~212)
    and granule 3 when entry 1 reaches row 436 (step ~416), long after the graph was captured.
    Tokens and logits equal a preallocated cache without graphs; one capture, no re-capture,
    0 bytes moved, pointers and the real rows unchanged."""
    from ort_kvlayout.runtime.generation import Runtime

    lengths = (300, 20)
    prompts = [prompt_ids(n) for n in lengths]
    new_tokens, capacity = 600, 1100

    def generate(mode, cuda_graph, on_step=None):
        with Runtime(wider_model, "cuda", cache=mode, cuda_graph=cuda_graph, fixed_mask=True,
                     capacity=capacity) as rt:  # fmt: skip
            return rt.generate(
                prompts, new_tokens, eos_token_ids=[], keep_logits=True,
                on_step=(lambda t: on_step(rt, t)) if on_step else None,
            )  # fmt: skip

    baseline = generate("preallocated", cuda_graph=False)
    seen = []  # (decode step, ptrs, committed bytes, real rows per entry): step 0 and growths
    steps = [0]

    def watch(rt, _tokens):
        step = steps[0]
        steps[0] += 1
        cache = rt.cache
        committed = cache.stats.committed_bytes
        if seen and seen[-1][2] == committed:
            return
        tb = cache.spec.token_bytes
        rows = [  # the rows written from real tokens so far (not the prefill's padding)
            cache.read_bytes(1, b * capacity * tb, (n + step) * tb) for b, n in enumerate(lengths)
        ]
        seen.append((step, [b.ptr for b in cache.buffers], committed, rows))

    out = generate("growable", cuda_graph=True, on_step=watch)
    assert out.tokens == baseline.tokens
    np.testing.assert_allclose(np.stack(out.logits), np.stack(baseline.logits), atol=1e-4)
    growth_steps = [step for step, *_ in seen[1:]]
    assert len(growth_steps) >= 2, f"premise: growth after the prefill at steps {growth_steps}"
    assert min(growth_steps) > 3  # after the capture (decode step 3)
    s = out.stats
    assert s.bytes_moved == 0 and s.recaptures == 0 and s.graph_captures == 1
    _, final_ptrs, _, final = seen[-1]
    for _, ptrs, _, rows in seen:
        assert ptrs == final_ptrs
        for b in range(2):
            assert final[b][: len(rows[b])] == rows[b]


def test_fp16_prefill_near_a_granule_end_does_not_fault(tmp_path):
    """fp16 prefill of 940 rows per entry (cuDNN's flash attention on sm_90) into a growable
    seq-major cache of capacity 1100 rows (2 KiB per token: 1024 rows per 2 MiB granule): entry
    1's prompt ends at absolute row 2039, 9 rows before an unmapped granule, and the last
    128-row key tile reaches row 2123. The runtime maps one tile past the prompt, so the
    prefill neither faults nor differs from a preallocated cache. In a child process: a device
    fault would poison this process's CUDA context."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    helpers = Path(__file__).resolve().parents[1] / "helpers"
    code = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(helpers)!r})
        import synthetic_models
        from ort_kvlayout.runtime.generation import Runtime
        from ort_kvlayout.tools.patch import patch_model_dir
        synthetic_models.MAX_POS = 1100
        root = Path({str(tmp_path)!r})
        v = synthetic_models.Variant(layers=1, num_heads=8, kv_heads=8, head_size=128,
                                     float16=True)
        src = synthetic_models.make_model_dir(root / "original", v)
        seq = patch_model_dir(src, root / "seq", layout="seq-major").out_dir
        prompts = [[(7 * i + 3) % 64 for i in range(940)], [(5 * i + 1) % 64 for i in range(940)]]
        out = {{}}
        for mode in ("preallocated", "growable"):
            with Runtime(seq, "cuda", cache=mode, cuda_graph=False, capacity=1100) as rt:
                out[mode] = rt.generate(prompts, 4, eos_token_ids=[]).tokens
        assert out["growable"] == out["preallocated"], out
        print("OK", out["growable"])
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, check=False)  # fmt: skip
    assert p.returncode == 0 and "OK" in p.stdout, (p.stdout + p.stderr)[-3000:]
