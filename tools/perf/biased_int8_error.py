"""The score error of the CUDA decode's biased int8 operands, emulated on a model's own queries
and cache codes (no GPU needed).

    python scripts/build_test_model.py --kv-quant-scheme int8_per_channel
    python tools/perf/biased_int8_error.py [--tokens 2048] [--positions 64]

Under fp16 the quantized decode step feeds its MMAs 1152 + code and starts each score at -1152 x
the query's sum (docs/DECISIONS.md, "biased int8 operands"). Every product is exact in fp32 (an
fp16 query element times 1152 + code holds at most 22 significant bits); what changes is the
fp32 accumulation, whose terms are now about 1152 x |q| instead of |q| x |code|. This runs the
builder's int8 per-channel SmolLM2-135M through ORT's own op on CPU as one first prompt of
`--tokens` tokens of the perplexity text (bench/perplexity.py), takes each layer's queries
(rotated, scaled and multiplied by the K scales, rounded to fp16, as the kernel's query tile)
and the cache's codes, and for `--positions` query positions spread over the prompt computes
every head's scores against the keys it attends to three ways:
* in float64 (the exact score of the fp16 query tile and the codes);
* plain: the 64 products accumulated in fp32, one after another, from 0;
* biased: the products with 1152 + code accumulated from fp32(-1152 x the fp32 sum of the
  query), as the kernel does.
It prints, per layer and over all, the largest and the 99.9th-percentile |error| of each
(in logits: the query tile already holds the softmax scale), beside the error the kernel's
fp16 rounding of the query tile itself brings (float64 query against the tile). Sequential fp32
round-to-nearest is a model of the tensor cores' accumulation, not the hardware's exact order.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

BIAS = 1152.0


def fp32_sum(start: np.ndarray, terms: np.ndarray) -> np.ndarray:
    """start + terms[..., 0] + terms[..., 1] + ..., each addition rounded to fp32 (cumsum is
    sequential)."""
    seq = np.concatenate([start[..., None], terms], axis=-1).astype(np.float32)
    return np.cumsum(seq, axis=-1, dtype=np.float32)[..., -1]


def scores(q_tile: np.ndarray, codes: np.ndarray) -> dict[str, np.ndarray]:
    """q_tile (heads, H) fp16 values as float32; codes (heads, keys, H) int8. Scores (heads, keys)
    exact (float64), plain and biased (fp32 accumulation)."""
    q = q_tile.astype(np.float64)
    c = codes.astype(np.float64)
    exact = np.einsum("hd,hkd->hk", q, c)
    prod = (q[:, None, :] * c).astype(np.float32)  # exact: 11 x 8 significant bits
    plain = fp32_sum(np.zeros(prod.shape[:-1], np.float32), prod)
    qsum = fp32_sum(np.zeros(q.shape[0], np.float32), (q * BIAS).astype(np.float32))
    bprod = (q[:, None, :] * (c + BIAS)).astype(np.float32)  # exact: 11 x 11 bits
    start = np.broadcast_to(-qsum[:, None], bprod.shape[:-1]).astype(np.float32)
    biased = fp32_sum(start, bprod)
    return {"exact": exact, "plain": plain, "biased": biased}


def layer_errors(qkv, key_codes, k_scale, cos, sin, attrs, positions) -> dict[str, np.ndarray]:
    import reference as ref

    n, nkv = attrs["num_heads"], attrs["kv_num_heads"]
    h = key_codes.shape[-1]
    group = n // nkv
    out: dict[str, list] = {"plain": [], "biased": [], "tile": []}
    for t in positions:
        q = qkv[0, t, : n * h].astype(np.float64).reshape(1, 1, n, h)
        q = ref.apply_rotary(q, np.array([[t]]), cos, sin, bool(attrs["rotary_interleaved"]))[0, 0]
        ks = k_scale.reshape(nkv, h)[np.arange(n) // group].astype(np.float64)
        q_true = q * attrs["scale"] * ks
        tile = q_true.astype(np.float16).astype(np.float32)
        codes = key_codes[0][np.arange(n) // group, : t + 1]  # (n, t + 1, H)
        s = scores(tile, codes)
        out["plain"].append(np.abs(s["plain"] - s["exact"]).ravel())
        out["biased"].append(np.abs(s["biased"] - s["exact"]).ravel())
        true = np.einsum("hd,hkd->hk", q_true, codes.astype(np.float64))
        out["tile"].append(np.abs(s["exact"] - true).ravel())
    return {k: np.concatenate(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--positions", type=int, default=64)
    p.add_argument("--model", type=Path, default=None, help="default: the cached builder model")
    args = p.parse_args(argv)

    import build_test_model
    import onnx
    import onnxruntime as ort
    import perplexity
    from onnx import numpy_helper
    from transformers import AutoTokenizer

    models = build_test_model.default_cache_root() / "models"
    model = args.model or models / "smollm2-135m-fp32-cpu-kv-int8_per_channel"
    if not (model / "model.onnx").exists():
        print(f"{model} is not built: python scripts/build_test_model.py "
              "--kv-quant-scheme int8_per_channel", file=sys.stderr)  # fmt: skip
        return 2
    # The weights stay in model.onnx.data (hard-linked in the cache, which onnx.load refuses):
    # ORT reads them through a hard link beside the edited graph (it refuses a symbolic one),
    # and the few arrays used here are read by offset.
    proto = onnx.load(str(model / "model.onnx"), load_external_data=False)
    inits = {i.name: i for i in proto.graph.initializer}

    def array(name: str) -> np.ndarray:
        t = inits[name]
        if not t.external_data:
            return numpy_helper.to_array(t)
        info = {e.key: e.value for e in t.external_data}
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        raw = np.fromfile(model / info["location"], np.uint8, int(info["length"]),
                          offset=int(info.get("offset", 0)))  # fmt: skip
        return raw.view(dtype).reshape(tuple(t.dims))

    gqa = [nd for nd in proto.graph.node if nd.op_type == "GroupQueryAttention"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in nd.attribute} for nd in gqa]
    if any(a.get("k_quant_type") != b"PER_CHANNEL" or a.get("kv_cache_bit_width") != 8
           for a in attrs):  # fmt: skip
        print(f"{model}: not an int8 per-channel model", file=sys.stderr)
        return 2
    for nd in gqa:  # each layer's packed q, k, v as an extra output
        proto.graph.output.append(onnx.helper.make_empty_tensor_value_info(nd.input[0]))
    cos = array(gqa[0].input[7]).astype(np.float64)
    sin = array(gqa[0].input[8]).astype(np.float64)

    tok = AutoTokenizer.from_pretrained(str(model))
    text = perplexity.fetch_text()
    ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"][: args.tokens]
    with tempfile.TemporaryDirectory(dir=model.parent) as tmp:  # hard links: same file system
        data = {e.value for t in inits.values() for e in t.external_data if e.key == "location"}
        for name in data:
            os.link(model / name, Path(tmp) / name)
        path = str(Path(tmp) / "model.onnx")
        onnx.save(proto, path)
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.asarray([ids], np.int64),
             "attention_mask": np.ones((1, len(ids)), np.int64)}  # fmt: skip
    nkv, head = attrs[0]["kv_num_heads"], cos.shape[1] * 2  # full rotary: H = 2 x cos's width
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values"):  # a first prompt: empty int8 pasts
            feeds[i.name] = np.zeros((1, nkv, 0, head), np.int8)
    names = [o.name for o in sess.get_outputs()]
    got = dict(zip(names, sess.run(None, feeds)))

    positions = np.unique(np.linspace(16, len(ids) - 1, args.positions).astype(int))
    print(f"{model.name}: {len(ids)} tokens, {len(positions)} query positions, {len(gqa)} layers; "
          "|score error| in logits (max / 99.9th percentile)")  # fmt: skip
    print("| layer | plain fp32 | biased fp32 | the fp16 query tile's own |")
    print("|---|---|---|---|")
    total: dict[str, list] = {"plain": [], "biased": [], "tile": []}
    for layer, (nd, a) in enumerate(zip(gqa, attrs)):
        key_codes = got[nd.output[1]]  # (1, Nkv, S, H) int8, BNSH
        k_scale = array(nd.input[12])
        e = layer_errors(got[nd.input[0]], key_codes, k_scale, cos, sin, a, positions)
        cells = [f"{e[k].max():.2e} / {np.quantile(e[k], 0.999):.2e}" for k in total]
        print(f"| {layer} | " + " | ".join(cells) + " |")
        for k, errors in total.items():
            errors.append(e[k])
    cells = []
    for errors in total.values():
        v = np.concatenate(errors)
        cells.append(f"{v.max():.2e} / {np.quantile(v, 0.999):.2e}")
    print("| all | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
