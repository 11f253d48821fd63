"""The serving engine on CUDA (fp16 synthetic model, growable VMM cache): the same tokens as
`Runtime.generate` alone, slot ranges bound at an offset in device memory, pages unmapped when
requests end. Skips without a GPU (tests/gpu_util.py says why); GQA_GPU_EMULATE_CPU=1 runs it
on the CPU (a check of the test, not of CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_util import DEVICE, SKIP_REASON
from synthetic_models import Variant, make_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(SKIP_REASON is not None, reason=f"GPU tests: {SKIP_REASON}"),
]

PROMPTS = [[1, 5, 7, 9, 11, 13, 17, 19, 23], [4, 8, 15, 16], [30 + i % 30 for i in range(70)], [6]]
LENGTHS = [40, 25, 33, 12]
TIE = 2e-2  # a top-2 logit gap below this (fp16) may flip with the batch's composition


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from ort_kvlayout.tools.patch import patch_model_dir

    root = tmp_path_factory.mktemp("engine_gpu")
    src = make_model_dir(root / "original", Variant(layers=2, float16=True, head_size=64, seed=3))
    return patch_model_dir(src, root / "seq", layout="seq-major").out_dir


def _alone(model):
    from ort_kvlayout.runtime.generation import Runtime

    out = []
    with Runtime(model, provider=DEVICE, cuda_graph=False) as rt:
        for p, n in zip(PROMPTS, LENGTHS):
            g = rt.generate(p, n, eos_token_ids=[], keep_logits=True)
            out.append((g.tokens[0], [step[0] for step in g.logits]))
    return out


def _same_or_tie(got: list[int], tokens: list[int], logits: list[np.ndarray]) -> None:
    for k, (a, b) in enumerate(zip(got, tokens)):
        if a != b:
            top = np.sort(logits[k].astype(np.float32))[-2:]
            assert top[1] - top[0] < TIE, f"token {k}: {a} != {b}, top-2 gap {top[1] - top[0]}"
            return
    assert len(got) == len(tokens)


@pytest.mark.parametrize("chunk", [8, 256])
def test_engine_on_cuda_equals_runtime_alone(model, chunk):
    from ort_kvlayout.runtime.kv_memory import allocator_stats
    from ort_kvlayout.serve.engine import Engine, EngineConfig, RequestParams

    alone = _alone(model)
    before = allocator_stats()[DEVICE]["committed_bytes"]
    # Emulated on the CPU, the host cache commits CUDA's granule (2 MiB) instead of a page.
    granule = 2 << 20 if DEVICE == "cpu" else None
    config = EngineConfig(max_batch=3, prefill_chunk=chunk, provider=DEVICE, granule=granule)
    # Every request is queued before the loop's first step, so the first step admits three
    # (however fast the device) and none can finish in it: peak_running is 3 by construction
    # unless the budget refuses them. The three slots (64 KiB per buffer each) share one 2 MiB
    # VMM granule per buffer, the whole reservation (the default budget): counted once per slot,
    # the requests ran one at a time.
    with Engine(model, config, start=False) as engine:
        handles = [
            engine.submit(p, RequestParams(max_tokens=n, ignore_eos=True))
            for p, n in zip(PROMPTS, LENGTHS)
        ]
        engine.start()
        got = [h.result() for h in handles]
        stats = engine.stats()
    for g, (tokens, logits) in zip(got, alone):
        _same_or_tie(g, tokens, logits)
    assert stats["kv_bytes_moved"] == 0
    assert stats["kv_committed_bytes"] == 0  # every slot's granules unmapped
    assert stats["peak_running"] == 3
    assert stats["preemptions"] == 0
    assert stats["kv_peak_committed_bytes"] <= stats["kv_budget_bytes"]
    assert allocator_stats()[DEVICE]["committed_bytes"] == before
