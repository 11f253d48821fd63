"""The rows of a step profile (tools/perf/step_profile.py's results), as both that tool and
bench/report.py print them: a mode's row, then its decode-only and prefill steps' rows, each
with its steps, wall ms, phase ms, GPU ms, host share and (the mode's row) output tok/s."""

from __future__ import annotations

__all__ = ["KIND_NOTE", "cells", "rows_by_kind"]

KIND_NOTE = (
    "A step's kind: prefill steps ran a prefill call (eager, every kernel launched by ORT), "
    "decode steps decode rows alone (a CUDA graph's replay where graphs are on). Their wall "
    "times are the engine loop's step alone; the GPU time of decode steps comes from a pass "
    "profiling only the steps where every request decodes, that of prefill steps is the rest "
    "of the profiled kernel time."
)


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
