#!/usr/bin/env python3
"""The main job: a real model, patched to seq-major, generating the same tokens as the original.

    pip install -e .[model]
    python scripts/main_job.py [--prompt TEXT] [--tokens N] [--provider auto|cpu|cuda]

1. builds SmolLM2-135M-Instruct with the onnxruntime-genai builder, or reuses the cached build
   (scripts/build_test_model.py; fp32/CPU, or fp16/CUDA when the CUDA op and EP are there);
2. patches it to seq-major (patch_kv_layout) next to the cached model;
3. generates greedily from the prompt with the original (ORT's com.microsoft GQA) and the patched
   model (ai.kvlayout, kv_layout=1), each through a plain ORT loop with the KV shared in place;
4. prints both texts, whether the tokens agree, and tokens/s for each. Exit 1 when they differ;
5. generates the same tokens again through ort_kvlayout.runtime.generation: the original with a
   preallocated KV cache (the whole context up front, as onnxruntime-genai does) and the patched
   model with a growable one, and prints each cache's committed bytes side by side.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import build_test_model


def pick_provider(choice: str) -> str:
    if choice != "auto":
        return choice
    import ort_kvlayout

    try:
        return "cuda" if ort_kvlayout.cuda_available() else "cpu"
    except Exception:  # noqa: BLE001 -- no _C module / no CUDA build: CPU
        return "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--provider", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--cache-root", type=Path, default=None)
    parser.add_argument(
        "--library",
        type=Path,
        default=None,
        help="custom-op library to patch in (default: the installed one)",
    )
    args = parser.parse_args(argv)

    from ort_kvlayout.model.tokenizer import load_tokenizer
    from ort_kvlayout.tools.patch import patch_model_dir
    from ort_kvlayout.tools.reference_loop import Generator

    provider = pick_provider(args.provider)
    precision, ep = ("fp16", "cuda") if provider == "cuda" else ("fp32", "cpu")
    start = time.perf_counter()
    model_dir = build_test_model.build(precision, ep, args.cache_root)
    print(f"model: {model_dir} ({time.perf_counter() - start:.1f} s)")

    start = time.perf_counter()
    patched_dir = model_dir.parent / f"{model_dir.name}-seq-major"
    library = args.library if args.library is not None else "auto"
    result = patch_model_dir(model_dir, patched_dir, "seq-major", force=True, library=library)
    print(
        f"patched: {patched_dir} ({result.rewritten} GroupQueryAttention nodes -> ai.kvlayout "
        f"kv_layout=1, {time.perf_counter() - start:.1f} s)"
    )

    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer.encode(args.prompt)
    runs = {}
    for name, path, library in (
        ("original (com.microsoft GQA, head-major)", model_dir, None),
        ("patched  (ai.kvlayout GQA, seq-major)  ", patched_dir, "auto"),
    ):
        generator = Generator(path, provider, custom_ops_library=library)
        generator.generate(ids, 2)  # warm-up: first-run allocations out of the timing
        runs[name] = generator.generate(ids, args.tokens)

    print(f"\nprompt ({provider}, {len(ids)} tokens, greedy {args.tokens}): {args.prompt!r}")
    for name, run in runs.items():
        print(
            f"{name}: {run.tokens_per_second:6.1f} tokens/s "
            f"(decode {run.decode_tokens_per_second:.1f} tokens/s, "
            f"prompt {run.prompt_seconds * 1e3:.0f} ms) {tokenizer.decode(run.tokens)!r}"
        )
    first, second = runs.values()
    agree = first.tokens == second.tokens
    print(f"tokens agree: {'yes' if agree else 'NO'} ({len(first.tokens)} tokens)")
    agree = compare_kv_memory(model_dir, patched_dir, provider, ids, args.tokens, second.tokens)
    return 0 if agree else 1


def compare_kv_memory(model_dir, patched_dir, provider, ids, tokens, reference) -> bool:
    """The original on a preallocated cache vs the patched model on a growable one."""
    from ort_kvlayout.runtime.generation import Runtime

    mib = 1 << 20
    print("\nKV cache (ort_kvlayout.runtime.generation, whole context reserved):")
    same = True
    for name, path, mode, library in (
        ("original, preallocated", model_dir, "preallocated", None),
        ("patched,  growable    ", patched_dir, "growable", "auto"),
    ):
        with Runtime(path, provider, cache=mode, custom_ops_library=library) as rt:
            out = rt.generate(ids, tokens, eos_token_ids=[])
        s = out.stats
        graphs = f", graph replays {s.replays}" if rt.cuda_graph else ""
        print(
            f"{name}: committed {s.committed_bytes / mib:8.2f} MiB of {s.reserved_bytes / mib:.2f}"
            f" MiB reserved (live rows {s.live_bytes / mib:.2f} MiB), growth events "
            f"{s.growth_events}, bytes moved {s.bytes_moved}{graphs}, decode "
            f"{out.decode_tokens_per_second:.1f} tokens/s"
        )
        same = same and out.tokens[0] == reference
    print(f"runtime tokens agree with the loop above: {'yes' if same else 'NO'}")
    return same


if __name__ == "__main__":
    sys.exit(main())
