"""End-to-end figure: a 32-layer stack of GroupQueryAttention nodes (32/8/128 or --heads, fp16,
one shared KV cache per layer, each layer's output the next layer's query) as one ONNX graph,
one decode step (S = 1) replayed under ONNX Runtime's CUDA graph capture, com.microsoft vs
ai.kvlayout in both layouts. Reported: the median time of one replayed step (host launch of the
graph included), from CUDA events, over steps that keep the cache length fixed (the same replay
every time).

With --mlp F, two MatMuls (D x F, then F x D with D = N x H, one pair of fp16 weights shared by
every layer) stand between each layer's attention and the next layer's query, as an MLP does in
the model: at F = 14336 (Llama-3-8B) they stream 235 MB of weights per layer, more than the L2, so
each attention layer starts with cold caches instead of finding the previous layer's code and
data there.

    python bench/bench_stack.py                      # B {1, 8} x L {4096, 16384}
    python bench/bench_stack.py --cases 1x4096 --layers 8
    python bench/bench_stack.py --mlp 14336          # weight MatMuls between the layers
    python bench/bench_stack.py --heads 28/4/128 --layers 28 --mlp 18944 --cases 1x4096 # Qwen2.5-7B
    python bench/bench_stack.py --rounds 5 ...       # the three variants' steps interleaved

With --rounds R the three sessions live through a case and take turns, R rounds of steps / R
replays each, the order reversed every other round: a drift of the clocks or the machine over the
case then weighs on all three alike, and each turn starts with one untimed step. Three stacks'
caches are then allocated at once (51 GB at 32/8/128 B=8 L=16k, 32 layers). R = 1 (the default):
each variant's session is made, timed and freed in turn (ORT, kv_layout=0, kv_layout=1), so only
one stack's caches are allocated at a time. With R = 1, kv_layout=1 once came
out 0.7 to 3.4 us per layer faster than kv_layout=0 in all eight comparisons of a run, though both
read the same bytes: an order effect that R > 1 tells apart.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
from pathlib import Path

import bench_cuda  # a sibling: the --rounds turns
import numpy as np
import onnxruntime as ort
import ort_kvlayout
from onnx import TensorProto, helper


def build_stack(
    domain: str, layers: int, n: int, nkv: int, layout: int | None, mlp: int = 0
) -> bytes:
    f16 = TensorProto.FLOAT16
    ins = [helper.make_tensor_value_info(x, f16, None) for x in ("x", "k", "v")]
    ins += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
            helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]  # fmt: skip
    if mlp:
        ins += [helper.make_tensor_value_info("w_up", f16, [None, mlp]),
                helper.make_tensor_value_info("w_down", f16, [mlp, None])]  # fmt: skip
    outs, nodes = [], []
    attrs = {"num_heads": n, "kv_num_heads": nkv}
    if layout is not None:
        attrs["kv_layout"] = layout
    q = "x"
    for i in range(layers):
        ins += [
            helper.make_tensor_value_info(f"past_{kv}_{i}", f16, None) for kv in ("key", "value")
        ]
        node_outs = [f"out_{i}", f"present_key_{i}", f"present_value_{i}"]
        nodes.append(helper.make_node(
            "GroupQueryAttention",
            [q, "k", "v", f"past_key_{i}", f"past_value_{i}", "seqlens_k", "total_sequence_length"],
            node_outs, domain=domain, name=f"gqa_{i}", **attrs))  # fmt: skip
        outs += [helper.make_tensor_value_info(x, f16, None) for x in node_outs[1:]]
        q = f"out_{i}"
        if mlp and i < layers - 1:  # the next layer's query through the two weight MatMuls
            nodes.append(helper.make_node("MatMul", [q, "w_up"], [f"up_{i}"], name=f"up_{i}"))
            nodes.append(helper.make_node("MatMul", [f"up_{i}", "w_down"], [f"mlp_{i}"],
                                          name=f"down_{i}"))  # fmt: skip
            q = f"mlp_{i}"
    outs.append(helper.make_tensor_value_info(f"out_{layers - 1}", f16, None))
    graph = helper.make_graph(nodes, "stack", ins, outs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)]
    )
    model.ir_version = 10
    return model.SerializeToString()


VARIANTS = bench_cuda.VARIANTS


def make_stack(
    label: str,
    b: int,
    length: int,
    layers: int,
    gen,
    mlp: int = 0,
    heads: tuple[int, int, int] = (32, 8, 128),
) -> tuple:
    """A session of the stack for one variant, its binding (the graph captured) and the tensors
    the binding points to."""
    import torch

    n, nkv, h = heads
    domain, layout = (
        ("com.microsoft", None) if label == "ort" else (ort_kvlayout.DOMAIN, int(label[-1]))
    )
    so = ort.SessionOptions()
    ort_kvlayout.register(so)
    so.log_severity_level = 3
    sess = ort.InferenceSession(
        build_stack(domain, layers, n, nkv, layout, mlp), so,
        providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})],
    )  # fmt: skip
    dev, f16 = "cuda", torch.float16
    keep = {
        "x": torch.randn(b, 1, n * h, generator=gen, device=dev).to(f16),
        "k": torch.randn(b, 1, nkv * h, generator=gen, device=dev).to(f16),
        "v": torch.randn(b, 1, nkv * h, generator=gen, device=dev).to(f16),
        "seqlens_k": torch.full((b,), length - 2, dtype=torch.int32, device=dev),
    }
    if mlp:  # small weights: the activations stay finite through the layers
        keep["w_up"] = (0.01 * torch.randn(n * h, mlp, generator=gen, device=dev)).to(f16)
        keep["w_down"] = (0.01 * torch.randn(mlp, n * h, generator=gen, device=dev)).to(f16)
    io = sess.io_binding()
    for name, t in keep.items():
        io.bind_input(name, "cuda", 0, np.int32 if t.dtype == torch.int32 else np.float16,
                      list(t.shape), t.data_ptr())  # fmt: skip
    # Everything the binding points to lives in `keep`, which outlives the session's replays.
    keep["total"] = ort.OrtValue.ortvalue_from_numpy(np.array(length, np.int32), "cpu", 0)
    io.bind_ortvalue_input("total_sequence_length", keep["total"])
    for i in range(layers):
        for kv in ("key", "value"):
            t = torch.randn(b * nkv * length * h, generator=gen, device=dev).to(f16)
            keep[f"{kv}_{i}"] = t  # bytes of the layout; the values only need to be finite
            shape = [b, nkv, length, h]
            io.bind_input(f"past_{kv}_{i}", "cuda", 0, np.float16, shape, t.data_ptr())
            io.bind_output(f"present_{kv}_{i}", "cuda", 0, np.float16, shape, t.data_ptr())
    out = keep["out"] = torch.empty(b, 1, n * h, dtype=f16, device=dev)
    io.bind_output(f"out_{layers - 1}", "cuda", 0, np.float16, list(out.shape), out.data_ptr())
    for _ in range(3):  # the first run captures the graph
        sess.run_with_iobinding(io)
    return sess, io, keep


def replay_ms(sess, io, n: int) -> list[float]:
    """Milliseconds of n replayed steps, each from CUDA events around the Run (the host's
    launch of the graph included)."""
    import torch

    times = []
    for _ in range(n):  # seqlens_k stays: every replay appends at row L-1 and reads L keys
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        sess.run_with_iobinding(io)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_case(b: int, length: int, layers: int, steps: int, gen, mlp: int, heads, rounds: int):
    """Median step time (ms) of each variant."""
    import torch

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    if rounds <= 1:  # one session at a time
        for v in VARIANTS:
            sess, io, keep = make_stack(v, b, length, layers, gen, mlp, heads)
            times[v] = replay_ms(sess, io, steps)
            del sess, io, keep
            torch.cuda.empty_cache()
    else:
        live = {v: make_stack(v, b, length, layers, gen, mlp, heads) for v in VARIANTS}
        for v, n in bench_cuda.turns(VARIANTS, steps, rounds):
            sess, io = live[v][:2]
            sess.run_with_iobinding(io)  # untimed: the turn starts as back-to-back steps do
            times[v] += replay_ms(sess, io, n)
        del live
        torch.cuda.empty_cache()
    return {v: statistics.median(t) for v, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="1x4096,1x16384,8x4096,8x16384")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--heads", default="32/8/128", help="N/Nkv/H of every layer")
    p.add_argument("--mlp", type=int, default=0,
                   help="hidden size F of two weight MatMuls between the layers (0: none)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1,
                   help="interleave the three variants' steps in this many rounds")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="also write the record here")
    args = p.parse_args(argv)
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    heads = tuple(int(x) for x in args.heads.split("/"))
    d = heads[0] * heads[2]
    mlp = f", MatMuls {d} x {args.mlp} x {d} between the layers" if args.mlp else ""
    print(f"# {args.layers}-layer GQA stack ({args.heads}, fp16{mlp}), one decode step under CUDA "
          f"graph replay, median of {args.steps} in {max(1, args.rounds)} round(s); "
          f"onnxruntime {ort.__version__}, "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    print(f"command: python {' '.join(sys.argv)}")
    print(
        "| B | L | ORT com.microsoft ms | ours kv_layout=0 ms | ours kv_layout=1 ms | ORT/kv0 | ORT/kv1 "
        "| ORT - kv0 per layer us | ORT - kv1 per layer us |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for spec in filter(None, args.cases.split(",")):
        b, length = (int(x) for x in spec.split("x"))
        t = time_case(b, length, args.layers, args.steps, gen, args.mlp, heads, args.rounds)
        rows.append({"batch": b, "length": length, **{f"{v}_ms": t[v] for v in VARIANTS}})
        print(f"| {b} | {length} | {t['ort']:.3f} | {t['kv0']:.3f} | {t['kv1']:.3f} "
              f"| {t['ort'] / t['kv0']:.2f} | {t['ort'] / t['kv1']:.2f} "
              f"| {(t['ort'] - t['kv0']) * 1e3 / args.layers:.1f} "
              f"| {(t['ort'] - t['kv1']) * 1e3 / args.layers:.1f} |", flush=True)  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "onnxruntime": ort.__version__, "device": torch.cuda.get_device_name(),
                "command": "python " + " ".join(sys.argv), "git": bench_cuda.git_revision(),
                "layers": args.layers, "heads": args.heads, "mlp": args.mlp,
                "steps": args.steps, "rounds": max(1, args.rounds)}  # fmt: skip
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
