"""The rows of a step profile (tools/perf/step_profile.py's results), as both that tool and
bench/report.py print them: a mode's row, then its decode-only and prefill steps' rows, each
with its steps, wall ms, phase ms, GPU ms, host share and (the mode's row) output tok/s."""

from __future__ import annotations

__all__ = ["CALL_NOTE", "KIND_NOTE", "KIND_NOTE_DECODE_PASS", "call_lines", "cells", "rows_by_kind"]

KIND_NOTE = (
    "A step's kind: prefill steps ran a prefill call (eager, every kernel launched by ORT), "
    "decode steps decode rows alone (a CUDA graph's replay where graphs are on). Their wall "
    "times are the engine loop's step alone; their GPU time is the kernels each step of the "
    "profiled pass launched (a profiler range a step)."
)

# how results without a per-step split (no `calls`) got their kinds' GPU times
KIND_NOTE_DECODE_PASS = (
    "A step's kind: prefill steps ran a prefill call (eager, every kernel launched by ORT), "
    "decode steps decode rows alone (a CUDA graph's replay where graphs are on). Their wall "
    "times are the engine loop's step alone; the GPU time of decode steps comes from a pass "
    "profiling only the steps where every request decodes, that of prefill steps is the rest "
    "of the profiled kernel time."
)

CALL_NOTE = (
    "A call's host ms is its time in the engine's executor (perf_counter, from its inputs to "
    "its tokens: ORT's Run returns once the call's kernels are done) less the GPU time of the "
    "kernels it launched (CUPTI, a profiler range a call, in a second pass of the same "
    "requests): the time the GPU waits for the host within the call. Kinds: bucket, a padded "
    "decode call (a CUDA graph's replay where graphs are on); graphed, a prefill step's call of "
    "fixed shapes (graph_chunk; a graph's replay too); packed, a packed prefill call; eager, a "
    "call of rows as they are (both uncaptured: ORT launches each kernel)."
)


def call_lines(result: dict, label: str) -> list[str]:
    """A table of the result's calls by kind (tools/perf/step_profile.py's `calls`): calls,
    host ms per call, GPU ms per call and the host's ms beyond the GPU's; empty without it."""
    calls = result.get("calls")
    if not calls:
        return []
    lines = [f"Calls, {label}:", "", "| call | calls | ms/call | GPU ms/call | host ms beyond the GPU |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    for kind, row in calls.items():
        gpu = row.get("gpu_ms_per_call")
        lines.append(
            f"| {kind} | {row['calls']} | {row['wall_ms_per_call']:.2f} | "
            + (f"{gpu:.2f} | {row['host_ms_per_call']:.2f} |" if gpu is not None else "- | - |")
        )
    return lines


def rows_by_kind(result: dict, label: str) -> list[tuple[str, dict]]:
    """A mode's row, then its decode-only and prefill steps' rows (where recorded)."""
    rows = [(label, result)]
    for kind, name in (("decode", "decode steps"), ("prefill", "prefill steps")):
        if kind in result.get("by_kind", {}):
            rows.append((f"{label}: {name}", result["by_kind"][kind]))
    return rows


def cells(result: dict, row: dict, phases: list[str]) -> list[str]:
    """A row's numbers: steps, wall ms/step, each phase's ms/step, GPU ms/step (or, with an
    emulated device, the Runs' busy ms/step), host share, and output tok/s (the mode's own row
    only)."""
    gpu = row.get("gpu_ms_per_step", row.get("run_busy_ms_per_step"))
    return [
        str(row["steps"]),
        f"{row['wall_ms_per_step']:.2f}",
        *(f"{row['phase_ms_per_step'].get(p, 0.0):.2f}" for p in phases),
        f"{gpu:.2f}" if gpu is not None else "-",
        f"{row['host_share']:.0%}" if gpu is not None else "-",
        f"{result['output_tok_s']:.0f}" if row is result else "-",
    ]
