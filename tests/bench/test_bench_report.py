"""bench/report.py: the tables of docs/PERFORMANCE.md, docs/SERVING.md, docs/QUANTIZATION.md and
README.md are what the script writes from the committed JSON in bench/results/, and each names its date, device, commit
and command."""

from __future__ import annotations

import fnmatch
import json
import subprocess
from pathlib import Path

import pytest
from bench_util import load_bench

report = load_bench("report")


def test_the_documents_equal_what_the_script_writes():
    for key, new in report.blocks().items():
        path = report.DOCUMENTS[key]
        text = path.read_text()
        assert report.splice(text, new) == text, f"{path}: run python bench/report.py"


def test_check_mode_passes_on_the_committed_document():
    assert report.main(["--check"]) == 0


def test_every_committed_result_has_a_table():
    # The files git tracks (.gitignore decides which results are committed), not local runs.
    ls = subprocess.run(["git", "-C", str(report.ROOT), "ls-files", "bench/results"],
                        check=False, capture_output=True, text=True)  # fmt: skip
    if ls.returncode != 0:
        pytest.skip("not a git checkout")
    committed = {Path(f).name for f in ls.stdout.split() if f.endswith(".json")}
    fixed = {report.CUDA, report.KV_MEMORY, *report.CUDA_QUANT, *report.CPU_QUANT}
    fixed |= {n for *_, names in report.CPU_GROUPS for n in names}
    assert fixed <= committed
    rest = (
        committed - fixed - {report.CUDA_COLD, report.CUDA_QUANT_COLD, report.CUDA_QUANT_COLD_PLANS}
    )
    assert all(fnmatch.fnmatch(n, report.STACKS) or fnmatch.fnmatch(n, report.SERVING)
               or fnmatch.fnmatch(n, report.PERPLEXITY) or fnmatch.fnmatch(n, report.STEP_PROFILES)
               or fnmatch.fnmatch(n, report.CUDA_QUANT_SPLITS)
               for n in rest), rest  # fmt: skip


@pytest.mark.parametrize("name", ["cuda-meta", "cpu-epyc", "cpu-xeon", "kv-memory"])
def test_each_table_names_its_date_commit_and_command(name):
    block = report.blocks()["doc"][name]
    assert "commit `" in block and "unknown" not in block
    assert "python bench/" in block and "UTC" in block


def test_each_serving_table_names_its_date_device_commit_command_and_peer():
    served = report.blocks()["serving"]
    profiles = {p.stem for p in report.RESULTS.glob(report.STEP_PROFILES)}
    assert set(served) == {p.stem for p in report.RESULTS.glob(report.SERVING)} | profiles
    for name, block in served.items():
        data = json.loads((report.RESULTS / f"{name}.json").read_text())
        assert f"Measured {data['date']} on {data['device']}, commit `{data['commit']}`" in block
        assert f"\n{data['command']}\n" in block and "Not recorded in the JSON: " not in block
        results = data.get("results", {}) if name not in profiles else {}
        assert ("og.Engine" in block) == bool({"genai", "genai-paged"} & set(results)), name


def test_the_step_profile_table_shows_each_graph_and_the_gpu_share():
    for path in report.RESULTS.glob(report.STEP_PROFILES):
        data = json.loads(path.read_text())
        block = "\n".join(report.step_profile(data, path.name))
        both_ways = len({r.get("overlap") for r in data["results"]}) > 1
        aheads = len({bool(r.get("commit_ahead")) for r in data["results"]}) > 1
        pipes = {bool(r.get("pipeline")) for r in data["results"]}
        for r in data["results"]:  # a row per mode, named as step_profile.py's --modes
            label = report._STEP_GRAPHS[r["mode"]]
            if r.get("label"):  # an A/B of commits in one file names the run
                label += f" ({r['label']})"
            if both_ways:  # a run of --overlap on,off says which
                label += ", overlap " + ("on" if r["overlap"] else "off")
            if aheads:  # and one of --commit-ahead on,off
                label += ", commit ahead " + ("on" if r["commit_ahead"] else "off")
            if len(pipes) > 1 or pipes == {True}:  # and one of --pipeline (on: always said)
                label += ", pipeline " + ("on" if r["pipeline"] else "off")
            assert f"| {label} |" in block
        emulated = any(r.get("device_ms") for r in data["results"])
        assert ("Run busy ms/step" if emulated else "GPU ms/step") in block
        assert "host share" in block


def test_a_serving_json_without_a_field_says_so():
    data = {"date": "2026-12-06 00:40 UTC", "device": "cpu (x86_64, 2 cores)",
            "command": "python bench/bench_serving.py --json x.json", "model": "m",
            "genai_model": "g", "workload": {},
            "results": {"genai": {"request_throughput": 1.0, "output_throughput": 2.0,
                                  "ttft_ms": {"p50": 1, "p99": 2}, "tpot_ms": {"p50": 1, "p99": 2},
                                  "itl_ms": {"p50": 1, "p99": 2}, "max_concurrent_decoding": 4,
                                  "peak_committed_kv_bytes": None, "preemptions": None}}}  # fmt: skip
    head = report.serving(data, "serving-x.json")[0]
    assert "commit `not recorded`" in head and "Not recorded in the JSON: commit." in head
    assert "runs per system not recorded in the JSON" in head
    assert "og.Engine (its version not recorded in the JSON), on `g`" in head
    mixed = {**data, "mixed_cost": {"mixed_padded": 9.0, "separate": 4.0,
                                    "runs_ms": {"mixed_padded": [9.0], "separate": [4.0]}}}  # fmt: skip
    lines = report.serving(mixed, "serving-y.json")
    assert "B = bench_serving.py's default --max-batch decode rows" in lines[0]
    assert lines[-2:] == ["| one right-padded (B, S) call | 9.0 | 9.0 |",
                          "| a (B, 1) decode call + a (1, S) prefill call | 4.0 | 4.0 |"]  # fmt: skip
    mixed["mixed_cost"] |= {"mixed_packed": 3.0}
    mixed["mixed_cost"]["runs_ms"] |= {"mixed_packed": [3.0, 3.5]}
    lines = report.serving(mixed, "serving-y.json")
    assert lines[-1] == "| one packed call of B + S tokens | 3.0 | 3.0, 3.5 |"


def test_a_serving_table_shows_a_stalled_run():
    def row(**extra):
        return {"request_throughput": 1.0, "output_throughput": 2.0, "ttft_ms": {"p50": 1, "p99": 2},
                "tpot_ms": {"p50": 1, "p99": 2}, "itl_ms": {"p50": 1, "p99": 2},
                "max_concurrent_decoding": 4, "peak_committed_kv_bytes": None,
                "preemptions": None, **extra}  # fmt: skip

    data = {"date": "2026-12-06 00:40 UTC", "device": "cuda (H100)", "commit": "abc1234",
            "command": "python bench/bench_serving.py", "model": "m", "genai_model": "g",
            "workload": {"repeat": 1},
            "results": {"engine": row(stalled=False, requests=64, unfinished_requests=0),
                        "genai-paged": row(stalled=True, stopped_by="stall", requests=64,
                                           unfinished_requests=7, last_event_s=40.06)}}  # fmt: skip
    table = report.serving(data, "serving-x.json")[-1].splitlines()
    assert table[0].endswith("| preemptions | stalled |")
    assert table[2].endswith("| - |") and table[2].startswith("| engine |")
    assert table[3].endswith("| 7 of 64 unfinished at 40.1 s (stall) |")
    assert "over the time to its last event" in table[-1]
    # Without a stall (every committed JSON, and ones from before the field): no column, no note.
    del data["results"]["genai-paged"]
    table = report.serving(data, "serving-x.json")[-1].splitlines()
    assert table[0].endswith("| preemptions |") and len(table) == 3


def test_ratios_are_ort_time_over_ours():
    rows = [
        {"kind": "decode", "heads": "9/3/64", "batch": 1, "length": 1024, "ratio0": 1.25,
         "ratio1": 0.98, "ort": {"kernel_ms": 0.01, "TB/s": 1.0}, "kv0": {"TB/s": 1.25},
         "kv1": {"TB/s": 0.98}},
    ]  # fmt: skip
    assert report.cuda_table({"rows": rows}, "decode")[-1] == "| 9/3/64 | 1 | 1.25 / 0.98 (10.0) |"
    summary = report.cuda_summary({"rows": rows})[0]
    assert "at 0 of 1 points" in summary and "9/3/64 B=1 L=1024 kv_layout=1" in summary


STACK = {"layers": 30, "heads": "9/3/64", "mlp": 1536, "date": "2026-12-06 01:00 UTC",
         "device": "NVIDIA H200", "onnxruntime": "1.31.1", "git": "abc1234", "steps": 50,
         "rounds": 1, "command": "python bench/bench_stack.py --json x.json",
         "rows": [{"batch": 1, "length": 4096, "ort_ms": 0.33, "kv0_ms": 0.30, "kv1_ms": 0.333}]}  # fmt: skip

# The blocks whose JSON may be missing, each with the heading and sentences it carries.
OPTIONAL = {
    ("doc", "cuda-cold"): report.CUDA_COLD_INTRO,
    ("doc", "stacks"): report.STACKS_INTRO,
    ("quant", Path(report.CUDA_QUANT_COLD).stem): report.CUDA_QUANT_COLD_INTRO,
    ("quant", Path(report.CUDA_QUANT_COLD_PLANS).stem): report.CUDA_QUANT_COLD_PLANS_INTRO,
}


def _results_without_optional(tmp_path: Path) -> Path:
    optional = {report.CUDA_COLD, report.CUDA_QUANT_COLD, report.CUDA_QUANT_COLD_PLANS}
    for f in report.RESULTS.glob("*.json"):
        if f.name not in optional and not fnmatch.fnmatch(f.name, report.STACKS):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path


def test_a_table_without_its_json_leaves_its_markers_empty_and_no_prose_about_it(tmp_path):
    blocks = report.blocks(_results_without_optional(tmp_path))
    for (key, name), intro in OPTIONAL.items():
        assert blocks[key][name] == "", name
        # The document keeps the markers, with nothing between them, and no heading or sentence
        # outside them that introduces the missing table.
        text = report.splice(report.DOCUMENTS[key].read_text(), blocks[key])
        assert f"<!-- report:{name} -->\n<!-- /report:{name} -->" in text
        for paragraph in intro:
            assert paragraph not in text, paragraph
        before = text[: text.index(f"<!-- report:{name} -->")].rstrip().splitlines()[-1]
        assert not before.startswith("#") and not before.endswith(":"), (name, before)


def test_a_table_with_its_json_follows_its_heading_and_introduction(tmp_path):
    results = _results_without_optional(tmp_path)
    for n in (report.CUDA, report.CUDA_QUANT[1]):  # their cold runs, as the same JSON flushed
        data = json.loads((report.RESULTS / n).read_text())
        colds = (
            [report.CUDA_COLD]
            if n == report.CUDA
            else [report.CUDA_QUANT_COLD, report.CUDA_QUANT_COLD_PLANS]
        )
        for cold in colds:
            (results / cold).write_text(json.dumps({**data, "flush_l2": True}))
    (results / "stack-9-3-64.json").write_text(json.dumps(STACK))
    blocks = report.blocks(results)
    for (key, name), intro in OPTIONAL.items():
        body = blocks[key][name]
        head = "".join(f"{p}\n\n" for p in intro)
        assert body.startswith(head), name
        assert body[len(head) :].startswith(("Measured ", "Decode, ", "30 layers of ")), name
        text = report.splice(report.DOCUMENTS[key].read_text(), blocks[key])
        assert f"<!-- report:{name} -->\n{head}" in text
        assert all(text.count(p) == 1 for p in intro), name


def test_a_stack_table_gives_ratios_and_the_time_saved_per_layer():
    lines = report.stacks([("stack-9-3-64.json", STACK)])
    assert "30 layers of 9/3/64, MatMuls 1536 wide" in lines[0] and "`abc1234`" in lines[0]
    assert lines[-1] == "| 1 | 4096 | 0.330 | 0.300 | 0.333 | 1.10x | 0.99x | 1.0 / -0.1 |"


def test_readme_table_keeps_a_loss_visible():
    assert report._span([0.9991, 1.2]) == "0.999x to 1.20x"
    assert report._span([1.004, 1.004]) == "1.00x"


def test_a_marker_without_a_block_and_a_block_without_a_marker_are_refused():
    doc = "a\n<!-- report:x -->\nold\n<!-- /report:x -->\nb\n"
    assert report.splice(doc, {"x": "new"}) == "a\n<!-- report:x -->\nnew\n<!-- /report:x -->\nb\n"
    with pytest.raises(KeyError, match="report:x"):
        report.splice(doc, {})
    with pytest.raises(KeyError, match="y"):
        report.splice(doc, {"x": "new", "y": "more"})
    # An empty block (its JSON not committed) empties the markers; a document without them is
    # still refused.
    empty = "a\n<!-- report:x -->\n<!-- /report:x -->\nb\n"
    assert report.splice(doc, {"x": ""}) == empty
    assert report.splice(empty, {"x": ""}) == empty
    assert report.splice(empty, {"x": "new"}) == report.splice(doc, {"x": "new"})
    with pytest.raises(KeyError, match="x"):
        report.splice("a\nb\n", {"x": ""})


def test_each_perplexity_table_names_its_text_method_commit_and_command():
    blocks = report.blocks()["quant"]
    ppl = {p.stem for p in report.RESULTS.glob(report.PERPLEXITY)}
    speed = {
        Path(n).stem
        for n in (
            *report.CUDA_QUANT,
            report.CUDA_QUANT_COLD,
            report.CUDA_QUANT_COLD_PLANS,
            *report.CPU_QUANT,
        )
    }
    assert set(blocks) == ppl | speed | {"cuda-quant-h100-cold-splits"}
    splits = blocks["cuda-quant-h100-cold-splits"]
    assert "ORT_KVLAYOUT_DECODE_SPLITS=64 python bench/bench_cuda.py" in splits
    assert "| B=1 L=16k | 32/8/128 | int8-per-channel | plan |" in splits
    for name in ppl:
        block = blocks[name]
        data = json.loads((report.RESULTS / f"{name}.json").read_text())
        text = data["text"]
        assert f"{text['package']}=={text['version']}" in block and text["sha256"][:16] in block
        assert (
            f"\n{data['command']}\n" in block and f"windows of {data['method']['window']}" in block
        )
        for row in data["rows"]:
            assert f"| {row['name']} |" in block and f"`{row['commit']}`" in block
            assert "unknown" not in row["commit"]


def test_a_perplexity_table_gives_deltas_targets_and_what_is_not_measured():
    perplexity = report.perplexity
    rows = [
        {"name": "fp32", "kv_dtype": "float32", "scales": "none", "ppl": 20.0, "mean_nll": 3.0,
         "commit": "abc1234"},
        {"name": "int8-per-token", "kv_dtype": "int8", "scales": "dynamic", "ppl": 20.2,
         "mean_nll": 3.01, "commit": "abc1234", "target_pct": 0.5, "delta_nll": 0.01,
         "delta_nll_stderr": 0.002, "top1_agreement": 0.97},
        {"name": "fp8-per-token", "kv_dtype": "float8e4m3fn", "scales": "dynamic", "ppl": 20.1,
         "mean_nll": 3.005, "commit": "abc1234", "target_pct": 1.0, "ppl_ort_op": 20.1},
    ]  # fmt: skip
    data = perplexity.finish({"rows": rows, "not_run": {"int4-per-token": "SystemExit: 2"}})
    lines = perplexity.table(data).splitlines()
    assert lines[2].startswith("| fp32 | float32 | none | 20.0000 | (reference) |")
    assert "| +1.00% | +0.01000 ± 0.00200 | 97.00% | <= +0.5%: missed |" in lines[3]
    assert "| +0.50% |" in lines[4] and "<= +1%: met | 20.1000 | `abc1234` |" in lines[4]
    assert "Not measured yet:" in lines
    missing = [line for line in lines if line.startswith("- ")]
    assert len(missing) == len(perplexity.VARIANTS) - 3
    assert (
        "- int4-per-token: `python bench/perplexity.py --variants int4-per-token --json "
        "bench/results/perplexity-cpu-smollm2.json` (last try: SystemExit: 2)" in missing
    )


@pytest.mark.parametrize("name", ["cuda-quant-h200", "cuda-quant-h100", "cpu-quant-int8-xeon"])
def test_each_quantized_speed_table_names_its_date_commit_and_command(name):
    block = report.blocks()["quant"][name]
    assert "commit `" in block and "unknown" not in block
    assert "python bench/" in block and "UTC" in block
    assert f"bench/results/{name}.json`" in block
    if name.startswith("cpu"):
        assert "other load" in block


def _quant_cell(us: float) -> dict:
    return {"kernel_ms": us * 1e-3}


def test_a_cuda_quant_table_says_which_goals_each_row_meets():
    rows = [
        {"kind": "decode", "batch": 8, "length": 16384, "capacity": 16384, "heads": "32/8/128",
         "kv_quant": "int8-per-channel", "ort": _quant_cell(130), "kv0": _quant_cell(125),
         "kv1": _quant_cell(126), "ort_q": _quant_cell(120), "q0": _quant_cell(70),
         "q1": _quant_cell(80), "q_vs_fp16": {"q0": 0.56, "q1": 0.54},
         "q_speedup_vs_ort_q": {"q0": 1.71, "q1": 1.5}, "max_abs_diff_q_vs_ort_q": 0.0005},
        {"kind": "decode", "batch": 1, "length": 16384, "capacity": 16384, "heads": "9/3/64",
         "kv_quant": "int4-per-channel", "ort": _quant_cell(12), "kv0": _quant_cell(11),
         "kv1": _quant_cell(11), "ort_q": {"error": "refused"}, "q0": _quant_cell(14),
         "q1": _quant_cell(14), "q_vs_fp16": {"q0": 1.3, "q1": 1.3}, "q_speedup_vs_ort_q": {}},
        {"kind": "decode", "batch": 1, "length": 4096, "capacity": 4096, "heads": "9/3/64",
         "kv_quant": "int8-per-channel", "ort": _quant_cell(5), "kv0": _quant_cell(5),
         "kv1": _quant_cell(5), "ort_q": _quant_cell(6), "q0": _quant_cell(4), "q1": _quant_cell(4),
         "q_vs_fp16": {"q0": 0.8, "q1": 0.8}, "q_speedup_vs_ort_q": {"q0": 1.5, "q1": 1.5}},
    ]  # fmt: skip
    data = {"date": "2026-12-06 04:21 UTC", "device": "NVIDIA H200", "onnxruntime": "1.31.1",
            "git": "abc1234", "git_reported_on_device": "def5678+dirty", "runs": 20,
            "command": "python bench/bench_cuda.py --kv-quant x --json y.json", "rows": rows}  # fmt: skip
    lines = report.cuda_quant(data, "cuda-quant-x.json")
    assert "commit `abc1234` (the copy on the device reported `def5678+dirty`)" in lines[0]
    assert "<= 1.0 fp16: met in both layouts by 2 of 3 rows" in lines[2]
    assert ">= 1.0x ORT: met in both layouts by 2 of 2 rows" in lines[2]  # int4: ORT refused
    assert "<= 0.55 fp16: met in both layouts by 0 of 1 rows, in one layout by 1 more." in lines[2]
    assert lines[-3] == (
        "| B=8 L=16k | 32/8/128 | int8-per-channel | 130.0 | 120.0 | 126.0 | 70.0 | 80.0 "
        "| 0.56 / 0.54 | 1.71x / 1.50x | 5.0e-04 "
        "| <= 1.0 fp16: met; >= 1.0x ORT: met; <= 0.55 fp16: L0 missed, L1 met |"
    )
    assert lines[-2] == (
        "| B=1 L=16k | 9/3/64 | int4-per-channel | 12.0 | refused | 11.0 | 14.0 | 14.0 "
        "| 1.30 / 1.30 | - / - | - | <= 1.0 fp16: missed |"
    )
    assert lines[-1].endswith("| <= 1.0 fp16: met; >= 1.0x ORT: met |")  # B=1: no 0.55 goal


def test_a_cpu_quant_table_says_when_the_machine_was_shared():
    def level(other: float) -> dict:
        stats = {k: {"throughput": g} for k, g in
                 (("ort", 1.0), ("kv0", 1.2), ("kv1", 0.9), ("kv1plain", 2.0))}  # fmt: skip
        meta = {"date": "2026-12-06T04:23:02+00:00", "kv_quant": "int8-per-channel",
                "onnxruntime": "1.32.0", "ort_kvlayout": {"git": "abc1234"},
                "machine": {"model_name": "Xeon", "logical_cpus": 2},
                "command": "python bench/bench_cpu.py --kv-quant int8-per-channel --isa current "
                           "--json /tmp/a.json"}  # fmt: skip
        result = {"case": {"name": "decode B=1 L=4096", "heads": "9/3/64"}, "stats": stats,
                  "ratio": {"kv0": 1.2, "kv1": 0.9, "kv1plain": 2.0},
                  "other_processes_cpus": other}  # fmt: skip
        return {"meta": meta, "results": [result]}

    lines = report.cpu_quant({"levels": {"avx2": level(1.34)}}, "cpu-quant-x.json")
    assert "--isa avx2 --json bench/results/cpu-quant-x.json" in lines[0]
    assert "The machine was shared: other processes used 1.34 to 1.34 CPUs' worth" in lines[2]
    assert (
        "| decode B=1 L=4096 | 9/3/64 | avx2 | 1.00 | 1.20 | 0.90 | 2.00 | 1.20x | 0.90x | 1.34 |"
        in lines
    )
    assert lines[-1].startswith("At or above ORT (>= 1.0x): kv_layout=0 at 1 of 1 points")
    idle = report.cpu_quant({"levels": {"avx2": level(0.02)}}, "cpu-quant-x.json")
    assert "Other processes used at most 0.02 of its 2 CPUs" in idle[2]
