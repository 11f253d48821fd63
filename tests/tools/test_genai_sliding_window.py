"""A sliding-window model (GQA nodes with local_window_size and sliding_window_cache=1, as the
onnxruntime-genai builder emits for Gemma 2/3 layers) through onnxruntime-genai itself: the
original directory (ORT's com.microsoft GQA) and its patched copies (tools/patch_kv_layout.py,
both layouts) give the same greedy tokens, on the CPU and on CUDA.

The model is tests/helpers/synthetic_models.py's random decoder with a genai_config.json
`sliding_window` section (window_size, slide_key_value_cache false, every layer). onnxruntime-genai
allocates the shared past/present buffers with max_length rows on the CPU and CUDA (window-sized
buffers only on TensorRT-RTX), so the window moves over a 12-token prompt and 20 new tokens while
the cache does not shift; the shifting cache is covered op by op (test_gqa_cpu.py, test_gqa_cuda.py,
test_cuda_graph.py).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from genai_util import genai_greedy
from synthetic_models import Variant, make_model_dir

if importlib.util.find_spec("onnxruntime_genai") is None:
    pytest.skip("onnxruntime_genai not installed", allow_module_level=True)

PROMPT = [1, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37]  # longer than the window
NEW_TOKENS = 20
WINDOW = 8
# Weights seed 2: along both precisions' greedy paths the top-2 logit gap stays >= 1.6 (logits
# ~110; one fp16 ulp there is 0.06), so an fp16 rounding difference cannot flip a token.


def _library_or_skip() -> None:
    import ort_kvlayout

    try:
        ort_kvlayout.library_path()
    except (FileNotFoundError, OSError) as exc:
        pytest.skip(f"custom-op library not built: {exc}")


def _cuda_or_skip() -> None:
    import onnxruntime_genai as og
    from gpu_util import SKIP_REASON

    if SKIP_REASON is not None:
        pytest.skip(f"GPU tests: {SKIP_REASON}")
    if not og.is_cuda_available():
        pytest.skip("onnxruntime_genai has no CUDA (install onnxruntime-genai-cuda)")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """{"fp32"|"fp16": {"original", "seq-major", "head-major": dir}}."""
    from ort_kvlayout.tools.patch import patch_model_dir

    _library_or_skip()
    root = tmp_path_factory.mktemp("genai_swc")
    dirs: dict[str, dict[str, Path]] = {}
    for precision in ("fp32", "fp16"):
        v = Variant(local_window_size=WINDOW, sliding_window_cache=1,
                    float16=precision == "fp16", seed=2)  # fmt: skip
        src = make_model_dir(root / precision / "original", v)
        config = json.loads((src / "genai_config.json").read_text())
        assert config["model"]["decoder"]["sliding_window"]["window_size"] == WINDOW
        dirs[precision] = {"original": src}
        for layout in ("seq-major", "head-major"):
            dirs[precision][layout] = patch_model_dir(src, root / precision / layout,
                                                      layout=layout).out_dir  # fmt: skip
    return dirs


def _check_same_tokens(dirs: dict[str, Path], ep: str, layout: str) -> None:
    want = genai_greedy(dirs["original"], PROMPT, NEW_TOKENS, ep)
    got = genai_greedy(dirs[layout], PROMPT, NEW_TOKENS, ep)
    assert len(want) == NEW_TOKENS, f"the original stopped early: {want}"
    assert got == want, f"{ep} {layout}: patched {got} != original {want}"


@pytest.mark.parametrize("layout", ["seq-major", "head-major"])
def test_genai_cpu_sliding_window_patched_tokens_equal_original(model_dirs, layout):
    _check_same_tokens(model_dirs["fp32"], "cpu", layout)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["seq-major", "head-major"])
def test_genai_cuda_sliding_window_patched_tokens_equal_original(model_dirs, layout):
    """fp16 (ORT's CUDA GQA has no fp32 kernel); both models on the CUDA EP."""
    _cuda_or_skip()
    _check_same_tokens(model_dirs["fp16"], "cuda", layout)
