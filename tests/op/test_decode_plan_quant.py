"""The quantized decode's own plan (ORT_KVLAYOUT_DECODE_QUANT_PLAN=bytes, csrc/cuda/plan_rules.h
DecodeQuantBytesPlan) against the plan of a cache of T (=fp16): on the CPU through
_C.plan_gqa_cuda (the rules on a modelled H200 and A100), the knob's parse in a child process;
on the GPU, the two plans' outputs and present caches bit for bit equal (the plan moves when the
static scales are read, never what is computed)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_C = pytest.importorskip("ort_kvlayout._C")
if not hasattr(_C, "plan_gqa_cuda"):
    pytest.skip("_C without plan_gqa_cuda", allow_module_level=True)

TESTS = Path(__file__).resolve().parent
HELPERS = TESTS.parent / "helpers"
H200 = {"sm_count": 132, "cc_major": 9, "max_smem_optin": 227 * 1024, "smem_per_sm": 228 * 1024}
A100 = {"sm_count": 108, "cc_major": 8, "max_smem_optin": 163 * 1024, "smem_per_sm": 164 * 1024}
LAUNCH = ("splits", "split_target", "cluster", "decode_ctas_per_sm", "decode_threads",
          "decode_packed", "workspace_bytes", "counter_bytes")  # fmt: skip


def plan(heads: str, batch: int, length: int, device: dict, knobs: dict | None = None,
         **quant) -> dict:  # fmt: skip
    n, nkv, h = (int(x) for x in heads.split("/"))
    shape = {"batch": batch, "seq_len": 1, "num_heads": n, "kv_num_heads": nkv, "head_size": h,
             "kv_layout": 1, "past_capacity": length, "present_capacity": length,
             "dtype": "float16", **quant}  # fmt: skip
    return _C.plan_gqa_cuda(shape, device, knobs or {})


@pytest.mark.parametrize("device", [H200, A100], ids=["h200", "a100"])
def test_bytes_plan_reads_static_scales_early_and_keeps_the_launch(device):
    """Static scales (per tensor, per channel; 8- and 4-bit codes): the bytes plan asks for them
    early; PER_TOKEN scales come with the codes, and a cache of T has none. Either way the launch
    (splits, target, clusters, CTAs per SM, warps, workspace) is the fp16 plan's."""
    for heads in ("32/8/128", "9/3/64", "28/4/128"):
        for batch in (1, 2, 8, 32, 64):
            for length in (1024, 16384, 65536):
                for bits, kv_quant in ((8, "PER_CHANNEL"), (8, "PER_TENSOR"), (4, "PER_CHANNEL"),
                                       (8, "PER_TOKEN"), (4, "PER_TOKEN")):  # fmt: skip
                    q = {"kv_bits": bits, "kv_quant": kv_quant}
                    ours = plan(heads, batch, length, device, **q)
                    theirs = plan(heads, batch, length, device, {"decode_quant_bytes": False}, **q)
                    where = (heads, batch, length, bits, kv_quant)
                    assert ours["kernel"] == theirs["kernel"] == "decode_tc", where
                    assert {k: ours[k] for k in LAUNCH} == {k: theirs[k] for k in LAUNCH}, where
                    assert ours["decode_scales_early"] == (kv_quant != "PER_TOKEN"), where
                    assert not theirs["decode_scales_early"], where
                fp16 = plan(heads, batch, 16384, device)
                assert not fp16["decode_scales_early"], (heads, batch)


def _knob_child(value: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORT_KVLAYOUT_")}
    env["ORT_KVLAYOUT_DECODE_QUANT_PLAN"] = value
    code = ("from ort_kvlayout import _C; v = _C.knob_values(); "
            "print(v['ORT_KVLAYOUT_DECODE_QUANT_PLAN']); print(v['error'])")  # fmt: skip
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


def test_quant_plan_knob_parses_its_two_names_and_names_a_bad_one():
    for value, want in (("bytes", "bytes"), ("fp16", "fp16"), ("", "bytes")):
        p = _knob_child(value)
        assert p.returncode == 0, p.stderr
        assert p.stdout.splitlines() == [want, ""], (value, p.stdout)
    p = _knob_child("FP16")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        "bytes",
        "environment variable ORT_KVLAYOUT_DECODE_QUANT_PLAN must be bytes or fp16, got 'FP16'",
    ]


# Decode calls the quantized instances serve (head sizes 128 and 64), each with an appended row
# (its quantization reads the static scales) in a split of a many-split grid (4,096 keys), in
# both layouts, fp16 and bf16.
GPU_CASES = [
    {"base": {"num_heads": 32, "kv_num_heads": 8, "head_size": 128, "past_len": 4096, "batch": 1,
              "pad": 0, "dtype": "fp16", "kv_layout": 0}, "bits": 8, "quant": "PER_CHANNEL"},
    {"base": {"num_heads": 32, "kv_num_heads": 8, "head_size": 128, "past_len": 4096, "batch": 2,
              "pad": 900, "dtype": "bf16", "kv_layout": 1}, "bits": 8, "quant": "PER_TENSOR"},
    {"base": {"num_heads": 9, "kv_num_heads": 3, "head_size": 64, "past_len": 4096, "batch": 2,
              "pad": 37, "dtype": "fp16", "kv_layout": 1}, "bits": 8, "quant": "PER_CHANNEL"},
    {"base": {"num_heads": 16, "kv_num_heads": 2, "head_size": 128, "past_len": 4096, "batch": 3,
              "pad": 11, "dtype": "fp16", "kv_layout": 0}, "bits": 4, "quant": "PER_CHANNEL"},
    {"base": {"num_heads": 8, "kv_num_heads": 2, "head_size": 64, "past_len": 4096, "batch": 2,
              "pad": 5, "dtype": "bf16", "kv_layout": 0}, "bits": 4, "quant": "PER_TENSOR"},
]  # fmt: skip

_GPU_CHILD = """
import hashlib, json, sys
import numpy as np
from gpu_util import SKIP_REASON
if SKIP_REASON is not None:
    print("SKIP " + SKIP_REASON)
    sys.exit(0)
from gqa_case import GqaCase
from test_gqa_cuda_quant import run_cuda_quant
from test_gqa_quant import QuantCase
for i, spec in enumerate(json.loads(sys.argv[1])):
    base = GqaCase(kind="decode", shared=True, seed=1009 + i, **spec["base"])
    out = run_cuda_quant(QuantCase(base, spec["bits"], spec["quant"]))
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(x).tobytes() for x in out))
    print("RESULT " + json.dumps(digest.hexdigest()))
"""


def _gpu_child(value: str) -> tuple[int, list[str], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORT_KVLAYOUT_DECODE_")}
    env["ORT_KVLAYOUT_DECODE_QUANT_PLAN"] = value
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(HELPERS), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(_GPU_CHILD), json.dumps(GPU_CASES)],
                       env=env, capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    recs = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    return p.returncode, recs, p.stdout + p.stderr


@pytest.mark.gpu
def test_bytes_plan_computes_what_the_fp16_plan_computes():
    """Each case's output and present caches: the same bytes under both plans (in two fresh
    processes: the knob is read once per process)."""
    rc0, fp16, out0 = _gpu_child("fp16")
    skip = [line[5:] for line in out0.splitlines() if line.startswith("SKIP ")]
    if skip:
        pytest.skip(f"GPU tests: {skip[0]}")
    rc1, ours, out1 = _gpu_child("bytes")
    assert rc0 == 0 and len(fp16) == len(GPU_CASES), out0[-3000:]
    assert rc1 == 0 and len(ours) == len(GPU_CASES), out1[-3000:]
    for spec, a, b in zip(GPU_CASES, fp16, ours, strict=True):
        assert a == b, f"bytes plan differs from the fp16 plan at {spec}"
    # Different cases give different bytes (the digests see the data).
    assert len(set(ours)) == len(GPU_CASES)
    assert hashlib.sha256(b"").hexdigest() not in ours
