"""Writes the tables of docs/PERFORMANCE.md, docs/SERVING.md, docs/QUANTIZATION.md and README.md
(and the plots) from bench/results/.

    python bench/report.py            # rewrite the tables between the markers, and the plots
    python bench/report.py --check    # exit 1 where a document differs from what this writes

Each table lies between `<!-- report:NAME -->` and `<!-- /report:NAME -->` in its document; the
text outside the markers is left alone. A table whose JSON bench/results/ may lack (the cold
grids, the stacks) carries its heading and introduction inside its block, and without its JSON
leaves its markers empty, so no text introduces a missing table. A table names its date, device,
commit and command, all read from its JSON, and every ratio against ORT is ORT's built-in
com.microsoft::GroupQueryAttention time over ours (or our GB/s over its), both measured in the
same run (higher is faster for us); docs/QUANTIZATION.md's CUDA table also gives ours quantized
over ours fp16 (lower is faster for the quantized cache). A serving table
(bench_serving.py's) names its peer, onnxruntime-genai's og.Engine, where the run had one.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

import bench_serving  # a sibling: its Markdown table is the one a serving run prints
import perplexity  # a sibling: its Markdown table is the one a perplexity run prints
from step_table import (
    CALL_NOTE,
    KIND_NOTE,
    KIND_NOTE_DECODE_PASS,
    call_lines,
    cells,
    rows_by_kind,
)  # a sibling: step_profile.py's rows too

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "PERFORMANCE.md"
README = ROOT / "README.md"
SERVING_DOC = ROOT / "docs" / "SERVING.md"
QUANT_DOC = ROOT / "docs" / "QUANTIZATION.md"
DOCUMENTS = {"doc": DOC, "readme": README, "serving": SERVING_DOC, "quant": QUANT_DOC}  # blocks()
IMG = ROOT / "docs" / "img"

CUDA = "cuda-h200.json"
CUDA_COLD = "cuda-h100-cold.json"  # the H100: the device lent when it was measured
STACKS = "stack-*.json"
SERVING = "serving-*.json"  # each in the block named by its stem, in docs/SERVING.md
STEP_PROFILES = "step-profile-*.json"  # tools/perf/step_profile.py's, in docs/SERVING.md
PERPLEXITY = "perplexity-*.json"  # each in the block named by its stem, in docs/QUANTIZATION.md
KV_MEMORY = "kv-cache-memory-cpu-2m.json"
KV_POINTS = (1, 256, 1024, 2048, 4096, 8192)
# Quantized decode against ORT's quantized GQA, each in the block named by its stem, in
# docs/QUANTIZATION.md: bench_cuda.py --kv-quant's JSON, and bench_cpu.py --kv-quant's.
CUDA_QUANT = ("cuda-quant-h200.json", "cuda-quant-h100.json")
# The same with every timed Run after an L2 flush: B=1 caches that fit in the L2 (9/3/64 at 16k:
# 12.6 MB fp16) are read from it in the warm tables, unlike a model's layers.
CUDA_QUANT_COLD = "cuda-quant-h100-cold.json"
# The same cases in the same sitting with the quantized decode on fp16's plan (--quant-plan fp16):
# what the quantized decode's own plan changes.
CUDA_QUANT_COLD_PLANS = "cuda-quant-h100-cold-fp16.json"
# The cold quantized decode at forced split counts (ORT_KVLAYOUT_DECODE_SPLITS, in each JSON's
# knobs; 0: the plan's count), one file per count, in one block of docs/QUANTIZATION.md.
CUDA_QUANT_SPLITS = "cuda-quant-h100-cold-splits*.json"
CPU_QUANT = ("cpu-quant-int8-xeon.json",)
# The CUDA goals (issue 54, cold L2): in every row ours quantized at most ours fp16's time and at
# least as fast as ORT's quantized GQA (where ORT has the scheme); at B >= 8 and L >= 16k ours
# quantized / ours fp16 at most 0.55 (int8, fp8) or 0.35 (int4). On CPU, ours / ORT >= 1.0.
QUANT_TARGET_LENGTH = 16384
QUANT_TARGET_BATCH = 8
QUANT_VS_FP16 = 0.55
QUANT4_VS_FP16 = 0.35
QUANT_VS_ORT = 1.0
MIB = 1 << 20
# (block, title of the machine, its short name, JSON files measured on it in one sitting, in
# table order)
CPU_GROUPS = (
    ("cpu-epyc", "2-core AMD EPYC (Zen 3, KVM guest), AVX2 level, idle", "2-core Zen 3",
     ("cpu-avx2-prefill-idle.json", "cpu-avx2-decode-idle.json", "cpu-avx2-shared-idle.json")),
    ("cpu-xeon", "16-core Intel Xeon (Sapphire Rapids class), AVX-512 and AVX2 levels", "16-core Xeon",
     ("cpu-xeon-avx512.json", "cpu-xeon-avx512-shared.json")),
)  # fmt: skip
HEAD_ORDER = ("32/8/128", "28/4/128", "9/3/64", "4/1/256")


def _heads_key(heads: str) -> tuple:
    return (HEAD_ORDER.index(heads) if heads in HEAD_ORDER else len(HEAD_ORDER), heads)


def _low(row: dict) -> float:
    return min(row["ratio0"], row["ratio1"])


def _ratio(v: float) -> str:
    """Two decimals, three where two would round a loss up to 1.00x."""
    return f"{v:.3f}x" if v < 1.0 <= round(v, 2) else f"{v:.2f}x"


def _span(values: list[float]) -> str:
    lo, hi = _ratio(min(values)), _ratio(max(values))
    return lo if lo == hi else f"{lo} to {hi}"


def _point(row: dict) -> str:
    letter = "L" if row["kind"] == "decode" else "S"
    return f"{row['heads']} B={row['batch']} {letter}={row['length']}"


def _length(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _mib(n: int) -> str:
    return f"{n / MIB:.2f}".rstrip("0").rstrip(".")


def _grid(rows: list[dict], kind: str, cell) -> list[str]:
    """One line per (heads, batch), one column per length."""
    rows = [r for r in rows if r["kind"] == kind]
    lengths = sorted({r["length"] for r in rows})
    letter = "L" if kind == "decode" else "S"
    out = [
        f"| N/Nkv/H | B | {' | '.join(f'{letter}={_length(n)}' for n in lengths)} |",
        "|---|---:|" + "---:|" * len(lengths),
    ]
    keys = sorted({(r["heads"], r["batch"]) for r in rows}, key=lambda k: (_heads_key(k[0]), k[1]))
    for heads, batch in keys:
        by_len = {r["length"]: r for r in rows if r["heads"] == heads and r["batch"] == batch}
        cells = [cell(by_len[n]) if n in by_len else "" for n in lengths]
        out.append(f"| {heads} | {batch} | {' | '.join(cells)} |")
    return out


def cuda_meta(data: dict, name: str) -> list[str]:
    flush = "each Run after an L2 flush" if data.get("flush_l2") else "warm (no L2 flush)"
    order = ", ".join(data.get("order", []))
    return [
        (
            f"Measured {data['date']} on {data['device']}, onnxruntime {data['onnxruntime']}, "
            f"commit `{data.get('git', 'unknown')}`"
            + (f" ({data['git_note']})" if data.get("git_note") else "")
            + f"; median of {data['runs']} timed Runs per variant "
            f"in {data.get('rounds', 1)} round(s), {flush}, variants made in the order {order}. "
            f"Command: `{data['command']}` (JSON: `bench/results/{name}`)."
        ),
    ]


def cuda_summary(data: dict) -> list[str]:
    """One line per kind of call: points at or above ORT, the ratios' range, the best rate."""
    lines = []
    for kind, unit, digits, what in (
        ("decode", "TB/s", 2, "of KV read"),
        ("prefill", "TFLOP/s", 0, ""),
    ):
        rows = [r for r in data["rows"] if r["kind"] == kind]
        if not rows:
            continue
        worst = min(rows, key=_low)
        layout = "kv_layout=0" if worst["ratio0"] <= worst["ratio1"] else "kv_layout=1"
        best = max(max(r["kv0"][unit], r["kv1"][unit]) for r in rows)
        ratios = _span([r["ratio0"] for r in rows] + [r["ratio1"] for r in rows])
        lines.append(
            f"- {kind.capitalize()}: ours at or above ORT in both layouts at "
            f"{sum(_low(r) >= 1.0 for r in rows)} of {len(rows)} points; {ratios}, the lowest at "
            f"{_point(worst)} {layout}; up to {best:.{digits}f} {unit}{' ' + what if what else ''}."
        )
    return lines


# kind: (caption, ORT's figure in a cell: its name and its value)
CUDA_TABLES = {
    "decode": ("Decode (one new token, shared in-place cache of capacity L)", "kernel time in us",
               lambda r: f"{r['ort']['kernel_ms'] * 1e3:.1f}"),
    "prefill": ("Prefill (a first prompt of S tokens, causal)", "TFLOP/s",
                lambda r: f"{r['ort']['TFLOP/s']:.0f}"),
}  # fmt: skip


def cuda_table(data: dict, kind: str) -> list[str]:
    """One line per (heads, batch), one column per length: both ratios and ORT's figure."""
    caption, figure, ort = CUDA_TABLES[kind]

    def cell(r: dict) -> str:
        return f"{r['ratio0']:.2f} / {r['ratio1']:.2f} ({ort(r)})"

    head = f"{caption}. Cell: ORT's time / ours in kv_layout=0 / kv_layout=1, then ORT's {figure}."
    return [head, "", *_grid(data["rows"], kind, cell)]


def cpu_command(meta: dict, levels: list[str], name: str) -> str:
    """The parent command of a bench_cpu.py JSON: each level ran as a child with `--isa current`
    and a temporary --json, which the parent's --isa and --json replace."""
    args = shlex.split(meta["command"])
    for flag, value in (("--isa", ",".join(levels)), ("--json", f"bench/results/{name}")):
        if flag in args:
            args[args.index(flag) + 1] = value
    return shlex.join(args)


def cpu_block(title: str, files: list[tuple[str, dict]]) -> list[str]:
    first = next(iter(files[0][1]["levels"].values()))["meta"]
    machine, lib = first["machine"], first["ort_kvlayout"]
    dates = sorted(lv["meta"]["date"][:16] for _, d in files for lv in d["levels"].values())
    lines = [
        (
            f"{title}: {machine['model_name']}, {machine['logical_cpus']} logical CPUs, "
            f"onnxruntime {first['onnxruntime']}, commit `{lib.get('git', 'unknown')}`, "
            f"runs started {dates[0].replace('T', ' ')} to {dates[-1][11:]} UTC. Commands:"
        ),
        "",
    ]
    for name, data in files:
        meta = next(iter(data["levels"].values()))["meta"]
        lines.append(f"- `{cpu_command(meta, list(data['levels']), name)}`")
    lines += [
        "",
        "| case | N/Nkv/H | level | unit | ORT | ours kv_layout=0 | ours kv_layout=1 | kv0/ORT | kv1/ORT |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for _, data in files:
        levels = data["levels"]
        kv_mode = next(iter(levels.values()))["meta"]["kv_mode"]
        n_cases = len(next(iter(levels.values()))["results"])
        for i in range(n_cases):  # each case at every level, in the JSON's case order
            for level, d in levels.items():
                r = d["results"][i]
                case, st = r["case"], r["stats"]
                name = case["name"]
                if kv_mode == "shared" and case["kind"] == "decode":
                    name += " shared"
                lines.append(
                    f"| {name} | {case['heads']} | {level} | {st['ort']['unit']} "
                    f"| {st['ort']['throughput']:.1f} | {st['kv0']['throughput']:.1f} "
                    f"| {st['kv1']['throughput']:.1f} | {r['ratio']['kv0']:.2f}x "
                    f"| {r['ratio']['kv1']:.2f}x |"
                )
    return lines


def _introduced(intro: list[str], table: list[str]) -> list[str]:
    """`intro` (paragraphs, a heading) and a blank line before `table`; nothing where `table` is
    empty (its JSON not committed), so no sentence introduces a missing table."""
    return [line for p in intro for line in (p, "")] + table if table else []


# docs/PERFORMANCE.md's optional sections, each its block's heading and first paragraph.
CUDA_COLD_INTRO = [
    "### Decode, cold caches",
    (
        "Decode with every timed Run after an L2 flush (`--flush-l2`): what a call costs inside "
        "a model, whose other layers evict the cache, the kernel's code and the op's state. The "
        "goals are measured so; the warm tables below keep the L2 between Runs."
    ),
]
STACKS_INTRO = [
    "### Whole stacks",
    "One decode step of a stack of GQA layers under CUDA graph replay (`bench_stack.py`):",
]


def cuda_cold(data: dict, name: str) -> list[str]:
    """The decode grid with every timed Run after an L2 flush."""
    return [*cuda_meta(data, name), "", *cuda_table(data, "decode")]


def stacks(files: list[tuple[str, dict]]) -> list[str]:
    """One table per bench_stack.py JSON: ms per decode step under CUDA graph replay; none
    without a JSON."""
    lines: list[str] = []
    for name, d in files:
        mlp = f", MatMuls {d['mlp']} wide between the layers" if d["mlp"] else ""
        lines += [
            (
                f"{d['layers']} layers of {d['heads']}{mlp}. Measured {d['date']} on {d['device']}, "
                f"onnxruntime {d['onnxruntime']}, commit `{d.get('git', 'unknown')}`; median of "
                f"{d['steps']} replayed steps in {d['rounds']} round(s). Command: `{d['command']}` "
                f"(JSON: `bench/results/{name}`)."
            ),
            "",
            (
                "| B | L | ORT ms | ours kv_layout=0 ms | ours kv_layout=1 ms | ORT/kv0 | ORT/kv1 "
                "| saved per layer, kv0 / kv1 (us) |"
            ),
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in d["rows"]:
            o, k0, k1 = r["ort_ms"], r["kv0_ms"], r["kv1_ms"]
            per = [f"{(o - k) * 1e3 / d['layers']:.1f}" for k in (k0, k1)]
            lines.append(
                f"| {r['batch']} | {r['length']} | {o:.3f} | {k0:.3f} | {k1:.3f} "
                f"| {_ratio(o / k0)} | {_ratio(o / k1)} | {' / '.join(per)} |"
            )
        lines.append("")
    return lines[:-1]


def kv_memory(data: dict, name: str) -> list[str]:
    """Committed KV bytes against live tokens per cache mode, then the growth to the context."""
    shapes = data["shapes"]
    granule = next(iter(shapes.values()))["memory"]["granule"]
    lines = [
        (
            f"Measured {data['date'][:16].replace('T', ' ')} UTC, device `{data['device']}` "
            f"(host `{data['host']}`), commit `{data['commit']}`, granule {granule // 1024} KiB, "
            f"batch 1. Command: `python bench/bench_kv_cache.py {shlex.join(data['argv'])}` "
            f"(JSON: `bench/results/{name}`)."
        ),
        "",
    ]
    modes = list(next(iter(shapes.values()))["memory"]["curves"])
    head = " | ".join(f"{s} {m}" for s in shapes for m in modes)
    lines += [
        f"| live tokens | live MiB ({' / '.join(shapes)}) | {head} |",
        "|---:|---:|" + "---:|" * (len(shapes) * len(modes)),
    ]
    for t in KV_POINTS:
        live, cells = [], []
        for s in shapes.values():
            curves = s["memory"]["curves"]
            at = {m: next((r for r in c if r["tokens"] == t), None) for m, c in curves.items()}
            if any(r is None for r in at.values()):
                break
            live.append(f"{next(iter(at.values()))['live_bytes'] / MIB:.2f}")
            cells += [_mib(at[m]["committed_bytes"]) for m in modes]
        else:
            lines.append(f"| {t} | {' / '.join(live)} | {' | '.join(cells)} |")
    lines += [
        "",
        "| shape | mode | growth events to the context | bytes moved |",
        "|---|---|---:|---:|",
    ]
    for sname, s in shapes.items():
        for mode, g in s["growth"].items():
            moved = f"{g['bytes_moved'] / MIB:.1f} MiB" if g["bytes_moved"] else "0"
            lines.append(f"| {sname} | {mode} | {g['growth_events']} | {moved} |")
    return lines


def _runs(data: dict) -> str:
    """How many runs each system had, and which one its row shows."""
    repeat = data.get("workload", {}).get("repeat")
    if repeat is None:
        return "runs per system not recorded in the JSON"
    if repeat == 1:
        return "one run per system"
    ordered = all("runs_in_order" in r for r in data["results"].values())
    key = "runs_in_order" if ordered else "runs_output_throughput"
    each = "; ".join(
        f"{s} {', '.join(f'{t:.1f}' for t in r[key])}" for s, r in data["results"].items()
    )
    order = "in the order they ran" if ordered else "lowest first"
    return (
        f"{repeat} runs per system in turn, a row shows the run of median output tok/s "
        f"(output tok/s of each run, {order}: {each})"
    )


def serving_meta(data: dict, name: str, what: str) -> list[str]:
    """Date, device, commit, what ran, then the command as run (bench_serving.py's JSON)."""
    missing = [k for k in ("date", "device", "commit", "command") if not data.get(k)]
    lines = [
        (
            f"Measured {data.get('date', 'at a date not recorded')} on "
            f"{data.get('device', 'a device not recorded')}, commit "
            f"`{data.get('commit', 'not recorded')}`"
            + (f" ({data['commit_note']})" if data.get("commit_note") else "")
            + f"; {what}."
            + (f" Not recorded in the JSON: {', '.join(missing)}." if missing else "")
            + f" Command (JSON: `bench/results/{name}`):"
        ),
        "",
    ]
    return lines + ["```", data.get("command", "(not recorded)"), "```", ""]


def serving_results(data: dict, name: str) -> list[str]:
    """A workload through the engine, the server and og.Engine: bench_serving.py's own table."""
    results = data["results"]
    what = f"the engine on `{data['model']}`"
    version = data.get("genai_version") or "its version not recorded in the JSON"
    for peer, model, kind in (("genai", "genai_model", "og.Engine"),
                              ("genai-paged", "genai_paged_model", "og.Engine, paged")):  # fmt: skip
        if peer in results:
            where = data.get(model) or "a model not recorded in the JSON"
            what += f"; the peer, onnxruntime-genai's {kind} ({version}), on `{where}`"
    what += f"; {_runs(data)}"
    for peer, label in (("genai", "og.Engine"), ("genai-paged", "og.Engine paged")):
        ratio = results.get("engine", {}).get(f"output_throughput_vs_{peer.replace('-', '_')}")
        if ratio is not None:
            what += f"; output tok/s, engine / {label}: {ratio:.2f}x"
    return [*serving_meta(data, name, what), bench_serving.table(results)]


_STEP_GRAPHS = {  # step_profile.py's modes
    "device": "served (device sampling)",
    "packed": "served, packed",
    "mixed": "served, packed and mixed",
    "host": "model's own (host)",
}


def step_profile(data: dict, name: str) -> list[str]:
    """tools/perf/step_profile.py's JSON: host ms per phase of a step against the GPU's."""
    what = "the engine's host phases per step (perf_counter) and the GPU's kernel time (CUPTI)"
    results = data["results"]
    emulated = {r["device_ms"] for r in results if r.get("device_ms")}
    device = "GPU ms/step"
    if emulated:
        what = (
            f"the engine's host phases per step (perf_counter), each Run holding an emulated "
            f"device {', '.join(f'{ms:g}' for ms in sorted(emulated))} ms more (a sleep with "
            "the GIL released, as ORT's Run releases it while a GPU works); 'Run busy' is the "
            "Runs' whole time a step, and host share the rest of the step"
        )
        device = "Run busy ms/step"
    lines = [*serving_meta(data, name, what)]
    phases = list(results[0]["phase_ms_per_step"])
    head = ["graph", "steps", "wall ms/step", *phases, device, "host share", "out tok/s"]
    lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    overlaps = {r.get("overlap") for r in results}
    aheads = {bool(r.get("commit_ahead")) for r in results}
    pipes = {bool(r.get("pipeline")) for r in results}
    waits = {r.get("prefill_wait", 0) for r in results}

    def graph_of(r: dict) -> str:
        graph = _STEP_GRAPHS.get(r.get("mode", "device" if r["sample_on_device"] else "host"))
        if r.get("label"):  # an A/B of commits in one file: which run this is
            graph += f" ({r['label']})"
        if len(overlaps) > 1:  # runs both ways: say which
            graph += ", overlap " + ("on" if r.get("overlap") else "off")
        if len(aheads) > 1:
            graph += ", commit ahead " + ("on" if r.get("commit_ahead") else "off")
        if len(pipes) > 1 or pipes == {True}:
            graph += ", pipeline " + ("on" if r.get("pipeline") else "off")
        if len(waits) > 1 or waits != {0}:
            graph += f", prefill wait {r.get('prefill_wait', 0)}"
        return graph

    for r in results:
        for label, row in rows_by_kind(r, graph_of(r)):
            lines.append("| " + " | ".join([label, *cells(r, row, phases)]) + " |")
    for r in results:
        if r.get("driver"):
            graph = graph_of(r)
            calls = "; ".join(
                f"{name} {t['calls']} x {t['us_per_call']:.0f} us ({t['ms_per_step']:.2f} ms/step)"
                for name, t in r["driver"].items()
            )
            lines += ["", f"The KV cache's CUDA driver calls, {graph}: {calls}."]
    for r in results:
        table = call_lines(r, graph_of(r))
        if table:
            lines += ["", *table]
    if any("by_kind" in r for r in results):
        split = all("calls" in r for r in results)  # the tool's per-step split
        lines += ["", KIND_NOTE if split else KIND_NOTE_DECODE_PASS]
    if any(r.get("calls") for r in results):
        lines += ["", CALL_NOTE]
    return lines


def _flag(command: str, flag: str) -> str:
    args = shlex.split(command)
    return args[args.index(flag) + 1] if flag in args else f"bench_serving.py's default {flag}"


def serving_mixed(data: dict, name: str) -> list[str]:
    """--mixed-cost: one right-padded mixed call against separate decode and prefill calls and
    one packed call."""
    runs = data["mixed_cost"]["runs_ms"]
    n = len(next(iter(runs.values())))
    command = data.get("command", "")
    what = (
        f"B = {_flag(command, '--max-batch')} decode rows beside one chunk of "
        f"S = {_flag(command, '--mixed-chunk')} tokens, median of {n} timed runs after one warm-up"
    )
    lines = [
        "| calls | median ms | each run ms |",
        "|---|---:|---|",
    ]
    for key, calls in (
        ("mixed_padded", "one right-padded (B, S) call"),
        ("separate", "a (B, 1) decode call + a (1, S) prefill call"),
        ("mixed_packed", "one packed call of B + S tokens"),
    ):
        if key not in runs:  # a run from before packed calls
            continue
        each = ", ".join(f"{t:.1f}" for t in runs[key])
        lines.append(f"| {calls} | {data['mixed_cost'][key]:.1f} | {each} |")
    return [*serving_meta(data, name, what), *lines]


def serving(data: dict, name: str) -> list[str]:
    return (serving_mixed if "mixed_cost" in data else serving_results)(data, name)


def perplexity_block(data: dict, name: str) -> list[str]:
    """bench/perplexity.py's table, after what ran where, on which text, how, and how to rerun."""
    text, method = data["text"], data["method"]
    scored = method["windows"] * method["scored_tokens_per_window"]
    return [
        (
            f"{data['model']}. Measured on {data['cpu']} ({data['device']}), onnxruntime "
            f"{data['onnxruntime']}, onnxruntime-genai {data['onnxruntime_genai']}; each row's "
            f"commit in the table (its date in the JSON). Text: {text['work']}, the file "
            f"`{text['file']}` of the PyPI wheel {text['package']}=={text['version']} (sha256 "
            f"`{text['sha256'][:16]}...`; {text['licence']}), {text['tokens']} tokens. Method: "
            f"{method['what']}; windows of {method['window']} tokens, stride {method['stride']}, "
            f"{method['windows']} windows, {scored} scored tokens. Static scales: "
            f"{data['calibration']}. Command (JSON: `bench/results/{name}`):"
        ),
        "",
        "```",
        data["command"],
        "```",
        "",
        perplexity.table(data),
    ]


def _us(cell: dict) -> str:
    return f"{cell['kernel_ms'] * 1e3:.1f}" if "kernel_ms" in cell else "refused"


def _met(values: dict[str, float], ok) -> str:
    """met / missed over both layouts (q0, q1), or which layout met it where they differ."""
    hits = {x: ok(v) for x, v in values.items()}
    if not hits:
        return "not measured"
    if all(hits.values()) or not any(hits.values()):
        return "met" if all(hits.values()) else "missed"
    return ", ".join(f"L{x[1]} {'met' if h else 'missed'}" for x, h in sorted(hits.items()))


def _goals(row: dict) -> list[tuple[str, str, float, bool]]:
    """A row's goals: (ratio key, label, bound, at most (True) or at least)."""
    goals = [("q_vs_fp16", "<= 1.0 fp16", 1.0, True)]
    if row.get("q_speedup_vs_ort_q"):  # ORT has the scheme
        goals.append(("q_speedup_vs_ort_q", f">= {QUANT_VS_ORT:.1f}x ORT", QUANT_VS_ORT, False))
    if row["batch"] >= QUANT_TARGET_BATCH and row["length"] >= QUANT_TARGET_LENGTH:
        bound = QUANT4_VS_FP16 if row["kv_quant"].startswith("int4") else QUANT_VS_FP16
        goals.append(("q_vs_fp16", f"<= {bound} fp16", bound, True))
    return goals


def _ok(bound: float, at_most: bool):
    return (lambda v: v <= bound) if at_most else (lambda v: v >= bound)


# docs/QUANTIZATION.md's sentence before the cold quantized table.
CUDA_QUANT_COLD_INTRO = [
    (
        "With the L2 flushed before each timed Run, as in a model, whose layers' caches together "
        "exceed the L2 (the goals of the quantized decode are measured so):"
    ),
]


CUDA_QUANT_COLD_PLANS_INTRO = [
    (
        "The same cases in the same sitting with the quantized decode on fp16's plan "
        "(`--quant-plan fp16`, `ORT_KVLAYOUT_DECODE_QUANT_PLAN=fp16`): what its own plan changes "
        '(docs/DECISIONS.md, "quantized decode plan").'
    ),
]


def cuda_quant_splits(files: list[tuple[str, dict]]) -> list[str]:
    """bench_cuda.py --kv-quant runs at forced split counts: per case, ours fp16 and quantized
    (kv_layout 0) at each count, and their ratio; the commands and commits named."""
    if not files:
        return []

    def splits(data: dict) -> int:
        return int(data.get("knobs", {}).get("ORT_KVLAYOUT_DECODE_SPLITS", "0") or 0)

    def wide(data: dict) -> str:  # the eight-warp quantized instance: "0" off, "" the plan's
        return str(data.get("knobs", {}).get("ORT_KVLAYOUT_DECODE_WIDE", ""))

    files = sorted(files, key=lambda f: (wide(f[1]), splits(f[1])))
    first = files[0][1]
    commits = sorted({f"`{d.get('git', 'unknown')}`" for _, d in files})
    lines = [
        "Key splits per (batch, kv head) forced through ORT_KVLAYOUT_DECODE_SPLITS on fp16 and the "
        "quantized cache alike (0: the plan's "
        "count), and the quantized one-token instance's eight warps turned off through "
        "ORT_KVLAYOUT_DECODE_WIDE=0 where the wide column says 0 (four warps a CTA), cold as above."
        f" Measured {first.get('date', 'unknown')} on "
        f"{first.get('device', 'unknown')}, commit {', '.join(commits)}. Commands (JSON: "
        + ", ".join(f"`bench/results/{n}`" for n, _ in files)
        + "):",
        "",
        "```",
        *(d.get("command", "") for _, d in files),
        "```",
        "",
        "| case | N/Nkv/H | scheme | wide | splits | ours fp16 | ours quant | quant / fp16 |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for _, data in files:
        for r in data["rows"]:
            if "kernel_ms" not in r.get("kv0", {}) or "kernel_ms" not in r.get("q0", {}):
                continue
            fp16, quant = r["kv0"]["kernel_ms"] * 1e3, r["q0"]["kernel_ms"] * 1e3
            count = splits(data) or "plan"
            lines.append(
                f"| B={r['batch']} L={r['length'] // 1024}k | {r['heads']} | {r['kv_quant']} | "
                f"{wide(data) or 'plan'} | {count} | {fp16:.1f} | {quant:.1f} | "
                f"{quant / fp16:.2f} |"
            )
    return lines


def cuda_quant(data: dict, name: str) -> list[str]:
    """bench_cuda.py --kv-quant: kernel times of ORT fp16 and quantized, ours fp16 and quantized,
    the two ratios against their targets, and how far ours is from ORT's quantized output."""
    flush = "each Run after an L2 flush" if data.get("flush_l2") else "warm (no L2 flush)"
    device_copy = data.get("git_reported_on_device")
    commit = f"commit `{data.get('git', 'unknown')}`" + (
        f" (the copy on the device reported `{device_copy}`)" if device_copy else ""
    )
    if data.get("git_note"):
        commit += f" ({data['git_note']})"
    rows = data["rows"]
    caps = sorted({r["capacity"] for r in rows if r["capacity"] != r["length"]})
    capacity = "L" if not caps else f"max(L, {', '.join(map(str, caps))})"
    counts = []
    labels = dict.fromkeys(label for r in rows for _, label, _, _ in _goals(r))
    for label in labels:
        having = [(r, g) for r in rows for g in _goals(r) if g[1] == label]
        hits = [[_ok(g[2], g[3])(v) for v in r[g[0]].values()] for r, g in having]
        both = sum(all(h) and bool(h) for h in hits)
        one = sum(any(h) for h in hits) - both
        counts.append(
            f"{label}: met in both layouts by {both} of {len(having)} rows"
            + (f", in one layout by {one} more" if one else "")
        )
    lines = [
        (
            f"Decode, one new token, shared in-place cache of capacity {capacity}. Measured "
            f"{data['date']} "
            f"on {data['device']}, onnxruntime {data['onnxruntime']}, {commit}; median kernel "
            f"time of {data['runs']} timed Runs per variant in {data.get('rounds', 1)} round(s), "
            f"{flush}, all variants of a row in one run on the same logical inputs. Command: "
            f"`{data['command']}` (JSON: `bench/results/{name}`)."
        ),
        "",
        (
            'Times in us. "quant / fp16" is ours quantized over ours fp16 in the same layout '
            '(lower: the quantized cache is faster); "ORT quant / ours quant" is ORT\'s '
            'quantized time over ours (higher: ours is faster); "max diff" is the largest '
            "|ours quantized - ORT quantized| over the output, either layout. Goals: in every "
            "row quant / fp16 <= 1.0 and, where ORT has the scheme, ORT quant / ours quant "
            f">= {QUANT_VS_ORT:.1f}x; at B >= {QUANT_TARGET_BATCH} and L >= "
            f"{_length(QUANT_TARGET_LENGTH)} quant / fp16 <= {QUANT_VS_FP16} (int8, fp8) or "
            f"<= {QUANT4_VS_FP16} (int4). {'; '.join(counts)}."
        ),
        "",
        (
            "| case | N/Nkv/H | scheme | ORT fp16 | ORT quant | ours fp16 L1 | ours quant L0 "
            "| ours quant L1 | quant / fp16 L0 / L1 | ORT quant / ours quant L0 / L1 | max diff "
            "| goals met |"
        ),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        case = f"B={r['batch']} L={_length(r['length'])}" + (" rotary" if r.get("rotary") else "")
        times = " | ".join(_us(r.get(v, {})) for v in ("ort", "ort_q", "kv1", "q0", "q1"))
        qf, so = r["q_vs_fp16"], r["q_speedup_vs_ort_q"]
        ratios = [
            " / ".join(f"{d[x]:.2f}{unit}" if x in d else "-" for x in ("q0", "q1"))
            for d, unit in ((qf, ""), (so, "x"))
        ]
        diff = r.get("max_abs_diff_q_vs_ort_q")
        met = "; ".join(f"{label}: {_met(r[key], _ok(bound, at_most))}"
                        for key, label, bound, at_most in _goals(r))  # fmt: skip
        lines.append(
            f"| {case} | {r['heads']} | {r['kv_quant']} | {times} | {ratios[0]} "
            f"| {ratios[1]} | {'-' if diff is None else f'{diff:.1e}'} "
            f"| {met} |"
        )
    return lines


def cpu_quant(data: dict, name: str) -> list[str]:
    """bench_cpu.py --kv-quant: decode GB/s of ORT's quantized GQA and ours, per case and level,
    ours with the float32 cache beside them, and how much of the machine other processes used."""
    levels = data["levels"]
    first = next(iter(levels.values()))["meta"]
    machine, lib = first["machine"], first["ort_kvlayout"]
    dates = sorted(lv["meta"]["date"][:19] for lv in levels.values())
    other = [r["other_processes_cpus"] for lv in levels.values() for r in lv["results"]]
    cpus = machine["logical_cpus"]
    if max(other) >= 0.1:
        load = (
            f"The machine was shared: other processes used {min(other):.2f} to {max(other):.2f} "
            f'CPUs\' worth of its {cpus} during the cases (column "other load")'
        )
    else:
        load = f"Other processes used at most {max(other):.2f} of its {cpus} CPUs during the cases"
    lines = [
        (
            f"{machine['model_name']}, {cpus} logical CPUs, {first['kv_quant']} cache, "
            f"onnxruntime {first['onnxruntime']}, commit `{lib.get('git', 'unknown')}`, runs "
            f"started {dates[0].replace('T', ' ')} to {dates[-1][11:]} UTC. Command: "
            f"`{cpu_command(first, list(levels), name)}`."
        ),
        "",
        (
            "Decode GB/s of KV read, counting the cache's bytes as stored: 1 an int8 element, "
            'and 4 for "ours kv1 float32" (ours, kv_layout=1, with the unquantized float32 '
            "cache), whose GB/s is therefore 4 times that of an int8 cache read in the same "
            "time. kv0/ORT and kv1/ORT are ours quantized over ORT's "
            f"quantized GQA (target >= 1.0x, higher: ours is faster). {load}."
        ),
        "",
        (
            "| case | N/Nkv/H | level | ORT quant | ours quant kv_layout=0 | ours quant kv_layout=1 "
            "| ours kv1 float32 | kv0/ORT | kv1/ORT | other load (CPUs) |"
        ),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    n_cases = len(next(iter(levels.values()))["results"])
    for i in range(n_cases):  # each case at every level, in the JSON's case order
        for level, d in levels.items():
            r = d["results"][i]
            st = r["stats"]
            gbs = " | ".join(
                f"{st[k]['throughput']:.2f}" for k in ("ort", "kv0", "kv1", "kv1plain")
            )
            lines.append(
                f"| {r['case']['name']} | {r['case']['heads']} | {level} | {gbs} "
                f"| {_ratio(r['ratio']['kv0'])} | {_ratio(r['ratio']['kv1'])} "
                f"| {r['other_processes_cpus']:.2f} |"
            )
    kv0 = [r["ratio"]["kv0"] for lv in levels.values() for r in lv["results"]]
    kv1 = [r["ratio"]["kv1"] for lv in levels.values() for r in lv["results"]]
    lines += [
        "",
        (
            f"At or above ORT (>= 1.0x): kv_layout=0 at {sum(v >= 1.0 for v in kv0)} of "
            f"{len(kv0)} points ({_span(kv0)}), kv_layout=1 at {sum(v >= 1.0 for v in kv1)} of "
            f"{len(kv1)} ({_span(kv1)})."
        ),
    ]
    return lines


def summary(cuda: dict, cpu: list[tuple[str, list[tuple[str, dict]]]]) -> list[str]:
    """README's table: the range of ORT time / ours per kind of call, each layout."""
    lines = ["| measured (commit) | kv_layout=0 | kv_layout=1 |", "|---|---:|---:|"]
    for kind, what in (
        ("decode", "decode, B 1 to 64, L 1k to 32k"),
        ("prefill", "prefill, B 1/4, S 512 to 8k"),
    ):
        rows = [r for r in cuda["rows"] if r["kind"] == kind]
        if rows:
            heads = len({r["heads"] for r in rows})
            lines.append(
                f"| {cuda['device'].replace('NVIDIA ', '')} fp16 {what}, {heads} head shapes, "
                f"{len(rows)} points (`{cuda.get('git', 'unknown')}`) "
                f"| {_span([r['ratio0'] for r in rows])} | {_span([r['ratio1'] for r in rows])} |"
            )
    for short, files in cpu:
        level, commit, cells = None, None, {}
        for _, data in files:
            level = level or next(iter(data["levels"]))  # the best level measured
            d = data["levels"][level]
            commit = d["meta"]["ort_kvlayout"].get("git", "unknown")
            for r in d["results"]:
                kind = r["case"]["kind"]
                if kind == "decode":
                    kind = (
                        "decode, shared cache" if r["case"]["shared"] else "decode, separate past"
                    )
                cells.setdefault(kind, ([], []))
                cells[kind][0].append(r["ratio"]["kv0"])
                cells[kind][1].append(r["ratio"]["kv1"])
        for kind, (kv0, kv1) in cells.items():
            lines.append(
                f"| {short} CPU fp32, {level} level, {kind} (`{commit}`) | {_span(kv0)} | {_span(kv1)} |"
            )
    return lines


def blocks(results: Path = RESULTS) -> dict[str, dict[str, str]]:
    """Every block of each document ("doc": docs/PERFORMANCE.md, "readme": README.md,
    "serving": docs/SERVING.md, "quant": docs/QUANTIZATION.md), by name, from the JSON in
    `results`."""
    out: dict[str, str] = {}
    cuda = json.loads((results / CUDA).read_text())
    out["cuda-meta"] = cuda_meta(cuda, CUDA)
    out["cuda-summary"] = cuda_summary(cuda)
    out["cuda-decode"] = cuda_table(cuda, "decode")
    out["cuda-prefill"] = cuda_table(cuda, "prefill")
    cold = results / CUDA_COLD
    out["cuda-cold"] = _introduced(
        CUDA_COLD_INTRO, cuda_cold(json.loads(cold.read_text()), CUDA_COLD) if cold.exists() else []
    )
    out["stacks"] = _introduced(
        STACKS_INTRO,
        stacks([(f.name, json.loads(f.read_text())) for f in sorted(results.glob(STACKS))]),
    )
    kv = json.loads((results / KV_MEMORY).read_text())
    out["kv-memory"] = kv_memory(kv, KV_MEMORY)
    cpu = []
    for block, title, short, names in CPU_GROUPS:
        files = [(n, json.loads((results / n).read_text())) for n in names]
        out[block] = cpu_block(title, files)
        cpu.append((short, files))
    served = {f.stem: serving(json.loads(f.read_text()), f.name) for f in results.glob(SERVING)}
    served |= {
        f.stem: step_profile(json.loads(f.read_text()), f.name) for f in results.glob(STEP_PROFILES)
    }
    quant = {
        f.stem: perplexity_block(json.loads(f.read_text()), f.name)
        for f in results.glob(PERPLEXITY)
    }
    for n in CUDA_QUANT:
        quant[Path(n).stem] = cuda_quant(json.loads((results / n).read_text()), n)
    cold_quant = results / CUDA_QUANT_COLD
    quant[Path(CUDA_QUANT_COLD).stem] = _introduced(
        CUDA_QUANT_COLD_INTRO,
        cuda_quant(json.loads(cold_quant.read_text()), CUDA_QUANT_COLD)
        if cold_quant.exists()
        else [],
    )
    plans = results / CUDA_QUANT_COLD_PLANS
    quant[Path(CUDA_QUANT_COLD_PLANS).stem] = _introduced(
        CUDA_QUANT_COLD_PLANS_INTRO,
        cuda_quant(json.loads(plans.read_text()), CUDA_QUANT_COLD_PLANS) if plans.exists() else [],
    )
    quant["cuda-quant-h100-cold-splits"] = cuda_quant_splits(
        [(f.name, json.loads(f.read_text())) for f in results.glob(CUDA_QUANT_SPLITS)]
    )
    for n in CPU_QUANT:
        quant[Path(n).stem] = cpu_quant(json.loads((results / n).read_text()), n)
    return {
        "doc": {k: "\n".join(v) for k, v in out.items()},
        "readme": {"readme-results": "\n".join(summary(cuda, cpu))},
        "serving": {k: "\n".join(v) for k, v in served.items()},
        "quant": {k: "\n".join(v) for k, v in quant.items()},
    }


MARK = re.compile(
    r"(<!-- report:(?P<name>[\w-]+) -->\n)(.*?)(<!-- /report:(?P=name) -->)", re.DOTALL
)


def splice(text: str, new: dict[str, str]) -> str:
    """`text` with each marked block's body replaced by new[name] (an empty body leaves the
    markers on adjacent lines); a block the document lacks, or a marker without a block, is an
    error."""
    seen = set()

    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in new:
            raise KeyError(f"docs marker report:{name} has no block in bench/report.py")
        seen.add(name)
        body = f"{new[name]}\n" if new[name] else ""
        return f"{m.group(1)}{body}{m.group(4)}"

    out = MARK.sub(sub, text)
    missing = sorted(set(new) - seen)
    if missing:
        raise KeyError(f"blocks without a marker in the document: {', '.join(missing)}")
    return out


def plots(results: Path, img: Path) -> None:
    import plot_cuda  # a sibling

    plot_cuda.main([str(results / CUDA), "--out", str(img)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--doc", type=Path, default=DOC)
    p.add_argument("--readme", type=Path, default=README)
    p.add_argument("--serving", type=Path, default=SERVING_DOC)
    p.add_argument("--quant", type=Path, default=QUANT_DOC)
    p.add_argument("--img", type=Path, default=IMG)
    p.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    new_blocks = blocks(args.results)
    paths = {"doc": args.doc, "readme": args.readme, "serving": args.serving, "quant": args.quant}
    stale = []
    for key, new in new_blocks.items():
        path = paths[key]
        text = path.read_text()
        out = splice(text, new)
        if out != text:
            stale.append(path)
            if not args.check:
                path.write_text(out)
    if args.check:
        for path in stale:
            print(f"{path} differs from bench/report.py's tables: run python bench/report.py",
                  file=sys.stderr)  # fmt: skip
        return 1 if stale else 0
    if not args.no_plots:
        plots(args.results, args.img)
    return 0


if __name__ == "__main__":
    sys.exit(main())
