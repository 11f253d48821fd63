"""What a cold decode call pays for: the kernel's code, the op's own state, or the data.

    python tools/perf/cold_parts.py --heads 28/4/128,32/8/128 --decode 1x4096,1x32768

bench_cuda.py --flush-l2 times a decode Run after a read of twice the L2, which evicts
everything: the inputs and the KV cache, the op's workspace and counters, and the kernels' code
(instructions are fetched through the L2 like data). This diagnostic adds two states between
that and back-to-back (warm) Runs, each after the same flush and an untimed warmer Run at a
small cache (B=1, L=--warm-length, its own buffers):

- `code`: the warmer runs in a second session: the same kernels' code comes back into the L2,
  nothing of the timed session's op (its workspace, its counters) or data does;
- `op`: the warmer runs in the timed session, through a second binding: the code and the op's
  workspace and counters come back, the timed call's inputs and cache do not.

So cold - code is what the code's fetches cost, code - op what the op's state costs, and op -
warm what the data costs (the cache rows the L2 kept, the inputs). ORT's built-in op and ours
(kv_layout=0; kv_layout=1 runs the same code) in one process; kernel time from CUPTI, medians.
The warmer's path through the kernel must be the timed call's (the same split count and merge
tree) for `code` to warm the right code: the table prints both calls' kernel times warm.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import ort_kvlayout

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_cuda as bc  # bench/bench_cuda.py: models, sessions, CUPTI timing


def feeds_for(b: int, length: int, heads: tuple[int, int, int], layout: int, gen) -> dict:
    import torch

    n, nkv, h = heads
    f16 = torch.float16

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(f16)

    return {
        "query": randn(b, 1, n * h), "key": randn(b, 1, nkv * h), "value": randn(b, 1, nkv * h),
        "seqlens_k": torch.full((b,), length - 1, dtype=torch.int32, device="cuda"),
        "total_sequence_length": np.array(length, np.int32),
        "past_key": bc.in_layout(randn(b, nkv, length, h), layout),
        "past_value": bc.in_layout(randn(b, nkv, length, h), layout),
    }  # fmt: skip


def round_times(events: list, runs: int, pre: list[str]) -> list[float]:
    """Kernel time (us) of the timed call in each round: `events` (device events by start time,
    with .name and .device_time_total) fall into `runs` rounds of the same count, each starting
    with the events of before() (`pre`, by name), which are dropped (bench_cuda.split_rounds)."""
    if len(events) // runs <= len(pre):
        raise RuntimeError(f"{len(events)} device events over {runs} rounds: not a fixed set each")
    return [sum(e.device_time_total for e in share) for share in bc.split_rounds(events, runs, pre)]


def timed(before, run, runs: int) -> list[float]:
    """Kernel time (us) of `run` in each of `runs` rounds of before(); run(), the events of
    before() (counted once alone) dropped."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    pre = bc.events_of(before) if before else []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            if before:
                before()
            run()
        torch.cuda.synchronize()
    return round_times(bc.device_events(prof), runs, pre)


def variant(
    domain: str, layout: int | None, b: int, length: int, heads, warm_len: int, runs: int, gen
) -> dict[str, float]:
    """Median kernel time (us) of one op's timed call in each state."""
    import torch

    n, nkv, _ = heads
    model = bc.build_model(domain, n, nkv, layout)
    sess, other = bc.session(model), bc.session(model)
    io, _keep = bc.bind(sess, feeds_for(b, length, heads, layout or 0, gen), shared=True)
    small = feeds_for(1, warm_len, heads, layout or 0, gen)
    io_same, _keep_same = bc.bind(sess, small, shared=True)
    io_other, _keep_other = bc.bind(other, small, shared=True)
    for s, i in ((sess, io), (sess, io_same), (other, io_other)):
        for _ in range(3):
            s.run_with_iobinding(i)

    def flush_then(s=None, i=None) -> None:
        bc.flush_l2()
        if s is not None:
            s.run_with_iobinding(i)
            torch.cuda.synchronize()

    def run() -> None:
        sess.run_with_iobinding(io)

    states = {
        "warm": timed(None, run, runs),
        "cold": timed(flush_then, run, runs),
        "code": timed(lambda: flush_then(other, io_other), run, runs),
        "op": timed(lambda: flush_then(sess, io_same), run, runs),
        "warmer": timed(None, lambda: sess.run_with_iobinding(io_same), runs),
    }
    return {k: statistics.median(v) for k, v in states.items()}


def case(b: int, length: int, heads: tuple[int, int, int], warm_len: int, runs: int, gen):
    return {
        label: variant(domain, layout, b, length, heads, warm_len, runs, gen)
        for label, domain, layout in (
            ("ort", "com.microsoft", None),
            ("kv0", ort_kvlayout.DOMAIN, 0),
        )
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="28/4/128,32/8/128,9/3/64")
    p.add_argument("--decode", default="1x4096,1x32768")
    p.add_argument("--warm-length", type=int, default=4096, help="the warmer call's cache")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--library", default=None, help="load this libort_kvlayout.so instead")
    args = p.parse_args(argv)
    bc.LIBRARY = args.library
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print("CUDAExecutionProvider not available", file=sys.stderr)
        return 2
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    print("kernel us, medians; code = cold with the kernels' code warmed by another session's")
    print("call, op = also the op's workspace and counters (tools/perf/cold_parts.py)")
    print("| case | heads | op | warm | cold | code | op state | warmer call (warm) |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for heads_text in filter(None, args.heads.split(",")):
        heads = tuple(int(x) for x in heads_text.split("/"))
        for spec in filter(None, args.decode.split(",")):
            b, length = (int(x) for x in spec.split("x"))
            row = case(b, length, heads, args.warm_length, args.runs, gen)
            for label, t in row.items():
                print(
                    f"| decode B={b} L={length} | {heads_text} | {label} | {t['warm']:.1f} "
                    f"| {t['cold']:.1f} | {t['code']:.1f} | {t['op']:.1f} | {t['warmer']:.1f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
