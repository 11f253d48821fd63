#!/usr/bin/env python3
"""KV cache memory and growth by mode, and decode speed against onnxruntime-genai.

    python bench/bench_kv_cache.py memory [--device cpu|cuda] [--granule BYTES] [--shape NAME]
    python bench/bench_kv_cache.py decode --model PATCHED_DIR [--provider cuda] [--tokens N]

memory (no model: the caches are driven directly with the shapes of a model's KV):
  committed bytes against live tokens (1 .. the whole context, batch 1) for
    seq-growable   seq-major, growable (the whole context reserved, granules committed as needed)
    head-growable  head-major at the same fixed stride, growable (one prefix per head)
    head-bucket    head-major packed buffer, doubled and re-strided when full
    preallocated   the whole context committed up front (onnxruntime-genai)
  and, growing token by token from 1 to the context, each mode's growth events, bytes moved and
  time per growth. Shapes: smollm2 (30 layers, 3 KV heads x 64, context 8192; fp32 on the CPU,
  fp16 on CUDA) and llama8b (32 layers, 8 KV heads x 128, fp16, context 8192). On the CPU the
  granule is a page by default; --granule 2097152 commits the CUDA granule size on the host (the
  same arithmetic, measured by the kernel). Goals checked and printed: seq-growable <= 1/kv_heads
  of head-growable, and within one granule per buffer of the live bytes.
decode (a model directory; the patched one for our runtime, the same directory for genai):
  time to first token and decode tokens/s of ort_kvlayout.runtime.generation (growable, preallocated,
  bucket; CUDA graphs on CUDA) and of onnxruntime-genai on the same model and prompt. Each runtime
  is loaded once and warmed by one untimed generation of the same length; both are timed over the
  same scope: time to first token from the call to the first token chosen, decode from the first
  to the last token chosen (model runs, logits copies, sampling and the loop). Best of --repeat.

Writes JSON (--json, default bench/results/kv_cache_<part>_<device>.json) and, for memory, a PNG
plot (--plot; needs matplotlib: pip install .[bench]).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from revision import git_revision  # a sibling: bench/revision.py

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # layers, kv heads, head dim, context
    "smollm2": (30, 3, 64, 8192),
    "llama8b": (32, 8, 128, 8192),
}
MODES = {  # label: (layout, cache mode)
    "seq-growable": (1, "growable"),
    "head-growable": (0, "growable"),
    "head-bucket": (0, "bucket"),
    "preallocated": (1, "preallocated"),
}
MIB = 1 << 20


def token_points(context: int) -> list[int]:
    points, t = [], 1
    while t < context:
        points.append(t)
        t *= 2
    return points + [context]


def shape_spec(name: str, device: str):
    from ort_kvlayout.runtime.model_spec import KvSpec

    layers, kv_heads, head_dim, context = SHAPES[name]
    dtype = np.float32 if name == "smollm2" and device == "cpu" else np.float16
    return lambda layout: KvSpec.synthetic(layers, kv_heads, head_dim, dtype, layout, context)


def memory_curve(make_spec, device: str, granule: int | None) -> dict:
    """Committed bytes at each token point, per mode (one cache per mode, grown in order)."""
    from ort_kvlayout.runtime.kv_cache import KvCache

    spec = make_spec(1)
    points = token_points(spec.context_length)
    curves: dict[str, list[dict]] = {}
    for label, (layout, mode) in MODES.items():
        rows = []
        with KvCache.create(make_spec(layout), mode, device=device, granule=granule) as cache:
            for t in points:
                cache.ensure([t])
                s = cache.stats
                measured = cache.measured_committed_bytes() if device == "cpu" else None
                rows.append({
                    "tokens": t, "committed_bytes": s.committed_bytes,
                    "measured_bytes": measured, "live_bytes": s.live_bytes,
                })  # fmt: skip
            if mode == "growable":
                granule_bytes = cache.granule  # the other modes are plain allocations
        curves[label] = rows
    return {"points": points, "curves": curves, "granule": granule_bytes}


def growth_run(make_spec, device: str, granule: int | None) -> dict:
    """Grow one token at a time from 1 to the context: events, bytes moved, time per growth."""
    from ort_kvlayout.runtime.kv_cache import KvCache

    out = {}
    for label, (layout, mode) in MODES.items():
        spec = make_spec(layout)
        times = []
        with KvCache.create(spec, mode, device=device, granule=granule) as cache:
            for t in range(1, spec.context_length + 1):
                start = time.perf_counter()
                grew = cache.ensure([t])
                if grew:
                    times.append(time.perf_counter() - start)
            s = cache.stats
        out[label] = {
            "growth_events": s.growth_events,
            "bytes_moved": s.bytes_moved,
            "growth_seconds": s.growth_seconds,
            "mean_growth_ms": 1e3 * statistics.fmean(times) if times else 0.0,
            "max_growth_ms": 1e3 * max(times) if times else 0.0,
            "final_committed_bytes": s.committed_bytes,
        }
    return out


def check_goals(name: str, curve: dict, kv_heads: int, buffers: int) -> dict:
    g = curve["granule"]
    seq = curve["curves"]["seq-growable"]
    head = curve["curves"]["head-growable"]
    ratio_ok = [r["tokens"] for r, h in zip(seq, head)
                if r["committed_bytes"] * kv_heads <= h["committed_bytes"]]  # fmt: skip
    within = all(r["committed_bytes"] - r["live_bytes"] <= buffers * g for r in seq)
    below = 0
    for t in curve["points"]:  # the longest prefix of points where the ratio goal holds
        if t not in ratio_ok:
            break
        below = t
    return {
        "shape": name,
        "seq_le_head_over_kv_heads_up_to_tokens": below,
        "seq_within_one_granule_per_buffer": within,
    }


def print_memory(name: str, curve: dict) -> None:
    labels = list(curve["curves"])
    print(f"\n{name}: committed KV MiB (granule {curve['granule']} B)")
    print(f"{'tokens':>7} {'live':>9} " + " ".join(f"{lb:>14}" for lb in labels))
    for i, t in enumerate(curve["points"]):
        live = curve["curves"][labels[0]][i]["live_bytes"] / MIB
        cells = " ".join(
            f"{curve['curves'][lb][i]['committed_bytes'] / MIB:14.2f}" for lb in labels
        )
        print(f"{t:7d} {live:9.2f} {cells}")


def plot_memory(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(results["shapes"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, name in zip(axes[0], shapes):
        curve = results["shapes"][name]["memory"]
        styles = {"head-growable": {"ls": "--", "lw": 2.5}, "preallocated": {"lw": 1}}
        for label, rows in curve["curves"].items():
            ax.plot([r["tokens"] for r in rows], [r["committed_bytes"] / MIB for r in rows],
                    marker="o", ms=3, label=label, **styles.get(label, {}))  # fmt: skip
        rows = next(iter(curve["curves"].values()))
        ax.plot([r["tokens"] for r in rows], [r["live_bytes"] / MIB for r in rows], "k--",
                lw=1, label="live rows")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("live tokens (batch 1)")
        ax.set_ylabel("committed KV MiB")
        ax.set_title(f"{name}, {results['device']}, granule {curve['granule'] // 1024} KiB")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_memory(args) -> dict:
    results = {"part": "memory", "device": args.device, "shapes": {}}
    for name in args.shape:
        make_spec = shape_spec(name, args.device)
        spec = make_spec(1)
        curve = memory_curve(make_spec, args.device, args.granule)
        growth = growth_run(make_spec, args.device, args.granule)
        goals = check_goals(name, curve, spec.kv_heads, spec.buffers)
        results["shapes"][name] = {
            "layers": SHAPES[name][0], "kv_heads": spec.kv_heads, "head_dim": spec.head_dim,
            "dtype": str(np.dtype(spec.dtype)), "context": spec.context_length,
            "buffers": spec.buffers, "memory": curve, "growth": growth, "goals": goals,
        }  # fmt: skip
        print_memory(name, curve)
        print(f"\n{name}: growing 1 -> {spec.context_length} tokens one at a time")
        print(f"{'mode':>14} {'events':>7} {'moved MiB':>10} {'mean ms':>8} {'max ms':>8}"
              f" {'total ms':>9}")  # fmt: skip
        for label, g in growth.items():
            print(f"{label:>14} {g['growth_events']:7d} {g['bytes_moved'] / MIB:10.1f} "
                  f"{g['mean_growth_ms']:8.3f} {g['max_growth_ms']:8.3f} "
                  f"{g['growth_seconds'] * 1e3:9.1f}")  # fmt: skip
        print(f"goals: {goals}")
    return results


# ---------------------------------------------------------------------------------------------
# decode: our runtime vs onnxruntime-genai


class _StepClock:
    """Wall-clock marks of the token choices of one generation: the first mark ends the time to
    first token, the marks after it are decode steps (model run, logits copy, sampling, loop)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.marks: list[float] = []

    def mark(self, *_args: object) -> None:
        self.marks.append(time.perf_counter())

    def result(self) -> dict:
        ttft = self.marks[0] - self.start
        steps, decode = len(self.marks) - 1, self.marks[-1] - self.marks[0]
        return {"ttft_ms": ttft * 1e3, "decode_steps": steps, "decode_seconds": decode,
                "decode_tokens_per_s": steps / decode if decode > 0 else 0.0}  # fmt: skip


def genai_runs(model_dir: Path, ids: list[int], tokens: int, provider: str, repeat: int):
    """onnxruntime-genai: one og.Model, one untimed warm-up generation, then `repeat` timed ones,
    each timed like ours (_StepClock around generate_next_token)."""
    import onnxruntime_genai as og

    config = og.Config(str(model_dir))
    if provider == "cuda":
        config.clear_providers()
        config.append_provider("cuda")
        config.set_provider_option("cuda", "enable_cuda_graph", "1")
    model = og.Model(config)

    def one() -> dict:
        params = og.GeneratorParams(model)
        # min_length: genai stops at EOS; ours is told to ignore it (eos_token_ids=[]). Both
        # then generate `tokens` tokens (genai masks EOS until then, so its tokens after the
        # first EOS differ from ours; the comparison below stops there).
        n = len(ids) + tokens
        params.set_search_options(max_length=n, min_length=n, do_sample=False)
        generator = og.Generator(model, params)
        clock = _StepClock()
        generator.append_tokens(ids)  # the prefill (before 0.6: in the first next_token)
        generator.generate_next_token()  # chooses the first token
        clock.mark()
        while not generator.is_done():
            generator.generate_next_token()  # a decode run, then the choice
            clock.mark()
        out = [int(t) for t in generator.get_sequence(0)][len(ids) :]
        del generator
        return {**clock.result(), "tokens": out}

    one()  # warm-up: session allocations, CUDA graph capture
    return [one() for _ in range(repeat)]


def runtime_runs(model_dir: Path, ids, tokens, provider, mode, repeat) -> list[dict]:
    """ort_kvlayout.runtime.generation: one Runtime, one untimed warm-up generation of the same length,
    then `repeat` timed ones; cache counters per generation (differences, not totals)."""
    from ort_kvlayout.runtime.generation import Runtime

    counters = ("growth_events", "bytes_moved", "graph_captures", "replays", "recaptures")
    runs = []
    with Runtime(model_dir, provider, cache=mode) as rt:
        rt.generate(ids, tokens, eos_token_ids=[])  # warm-up: allocations, graph capture
        for _ in range(repeat):
            before = dataclasses.replace(rt.cache.stats)
            clock = _StepClock()
            out = rt.generate(ids, tokens, eos_token_ids=[], on_step=clock.mark)
            s = out.stats
            runs.append({
                **clock.result(), "tokens": out.tokens[0], "library": rt.library,
                "committed_bytes": s.committed_bytes, "reserved_bytes": s.reserved_bytes,
                **{c: getattr(s, c) - getattr(before, c) for c in counters},
            })  # fmt: skip
    return runs


def run_decode(args) -> dict:
    from ort_kvlayout.model.tokenizer import load_tokenizer
    from ort_kvlayout.runtime.model_spec import ModelSpec

    ids = load_tokenizer(args.model).encode(args.prompt)
    results = {"part": "decode", "device": args.provider, "model": str(args.model),
               "prompt_tokens": len(ids), "new_tokens": args.tokens, "runs": {},
               "method": "each runtime loaded once, one untimed warm-up generation of the same "
               "length, then --repeat timed generations; time to first token: call to the first "
               "token chosen; decode: first to last token chosen (runs, copies, sampling)"}  # fmt: skip
    runs = results["runs"]
    for mode in ("growable", "preallocated", "bucket"):
        runs[mode] = runtime_runs(args.model, ids, args.tokens, args.provider, mode, args.repeat)
    try:
        runs["onnxruntime-genai"] = genai_runs(
            args.model, ids, args.tokens, args.provider, args.repeat
        )
    except ImportError as exc:
        results["genai_error"] = f"onnxruntime-genai not installed: {exc}"
    print(f"\ndecode: {args.model} ({args.provider}), prompt {len(ids)} tokens, "
          f"{args.tokens} new, best of {args.repeat}")  # fmt: skip
    # The custom-op library both runtimes ran: the copy in the model directory that
    # patch_kv_layout made (genai_config.json names it), whatever ort_kvlayout is installed. To
    # compare two builds' kernels, patch the model with each build.
    results["library"] = runs["preallocated"][0]["library"]
    print(f"custom-op library (ours and genai): {results['library']}")
    print(f"{'runtime':>18} {'TTFT ms':>9} {'tokens/s':>9} {'KV committed MiB':>17} tokens")
    reference = runs["preallocated"][0]["tokens"]
    eos = set(ModelSpec.from_dir(args.model).eos_token_ids)
    # genai masks EOS until min_length, so at the reference's first EOS it chooses another token:
    # it is compared on the steps before that one.
    stop = next((i for i, t in enumerate(reference) if t in eos), len(reference))
    for name, reps in runs.items():
        best = max(reps, key=lambda r: r["decode_tokens_per_s"])
        kv = best.get("committed_bytes")
        kv_text = f"{kv / MIB:17.2f}" if kv is not None else f"{'(max_length)':>17}"
        # genai masks EOS (min_length): its tokens are compared up to the reference's first EOS.
        upto = stop if name == "onnxruntime-genai" else len(reference)
        first = next((i for i, (a, b) in enumerate(zip(best["tokens"][:upto], reference[:upto]))
                      if a != b), None)  # fmt: skip
        same = "same" if first is None else f"differs from step {first}"
        if upto == 0:  # the reference chose EOS first: genai (EOS masked) has nothing to match
            same = "not compared (the reference's first token is EOS)"
        if name == "onnxruntime-genai" and first is None and upto < len(reference):
            same += f" (to the first EOS, step {upto})"
        best["tokens_vs_preallocated"] = same
        print(f"{name:>18} {min(r['ttft_ms'] for r in reps):9.1f} "
              f"{best['decode_tokens_per_s']:9.1f} {kv_text} {same}")  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="part", required=True)
    m = sub.add_parser("memory")
    m.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    m.add_argument("--granule", type=int, default=None, help="host commit granule (bytes)")
    m.add_argument("--shape", action="append", choices=list(SHAPES), default=None)
    m.add_argument("--plot", type=Path, default=None)
    d = sub.add_parser("decode")
    d.add_argument("--model", type=Path, required=True, help="a patched model directory")
    d.add_argument("--provider", choices=["cpu", "cuda"], default="cuda")
    d.add_argument("--tokens", type=int, default=256)
    d.add_argument("--repeat", type=int, default=3)
    d.add_argument("--prompt", default="The capital of France is")
    for sp in (m, d):
        sp.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    if args.part == "memory":
        args.shape = args.shape or list(SHAPES)
        results = run_memory(args)
        suffix = f"{args.device}" + (f"_g{args.granule}" if args.granule else "")
    else:
        results = run_decode(args)
        suffix = args.provider
    results.update({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_revision(mark_dirty=False), "host": platform.node(), "argv": sys.argv[1:],
    })  # fmt: skip
    path = args.json or ROOT / "bench" / "results" / f"kv_cache_{args.part}_{suffix}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {path}")
    if args.part == "memory":
        plot = args.plot or path.with_suffix(".png")
        try:
            plot_memory(results, plot)
            print(f"wrote {plot}")
        except ImportError:
            print("matplotlib not installed (pip install .[bench]): no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
