"""A patched model runs quietly: at ORT's default log level a plain InferenceSession prints no
warning about our GroupQueryAttention nodes or their outputs (issue 10: the op's inferred
present shape held a fixed -1, so ORT's VerifyOutputSizes warned twice per node per Run).

ORT logs to the process's stderr, so each run happens in a child process whose stderr is read
back. The child first runs a control model whose declared output shape is wrong on purpose: its
VerifyOutputSizes warning must show up, which proves the capture sees ORT's warnings at the
default level (so a quiet patched run means something).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from gqa_case import op_available

HELPERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")

_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import onnxruntime as ort
import ort_kvlayout
from onnx import TensorProto, helper
from ort_kvlayout.tools.patch import rewrite_model
from synthetic_models import Variant, build_model

provider = sys.argv[2]
variants = json.loads(sys.argv[3])
providers = [provider] if provider == "CPUExecutionProvider" else [provider, "CPUExecutionProvider"]

# Control: Identity declared (2,) but run on 3 elements -> one VerifyOutputSizes warning.
g = helper.make_graph(
    [helper.make_node("Identity", ["x"], ["y"])], "control",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
)
control = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
ort.InferenceSession(control.SerializeToString(), providers=["CPUExecutionProvider"]).run(
    None, {"x": np.zeros(3, np.float32)})
print("CONTROL_DONE", file=sys.stderr, flush=True)

for spec in variants:
    layout = spec.pop("kv_layout")
    v = Variant(**spec)
    model = build_model(v)
    rewrite_model(model, layout)
    so = ort.SessionOptions()  # default log level: warnings are printed
    ort_kvlayout.register(so)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=providers)
    print("SESSION", spec, layout, file=sys.stderr, flush=True)
    batch, prompt = 2, 5
    cap = v.local_window_size if v.sliding_window_cache else 0
    past = {}
    for layer in range(v.layers):
        for kv in ("key", "value"):
            past[f"past_key_values.{layer}.{kv}"] = np.zeros(
                (batch, v.kv_heads, cap, v.head_size), np.float32)
    ids = np.arange(batch * prompt, dtype=np.int64).reshape(batch, prompt) % 60 + 3
    total = prompt
    for step in range(4):  # a prompt, then 3 decode steps feeding present back as past
        feeds = {"input_ids": ids, "attention_mask": np.ones((batch, total), np.int64), **past}
        outs = sess.run(None, feeds)
        names = [o.name for o in sess.get_outputs()]
        past = {n.replace("present.", "past_key_values."): o for n, o in zip(names, outs)
                if n.startswith("present.")}
        ids = np.argmax(outs[0][:, -1:, :], axis=-1).astype(np.int64)
        total += 1
    print("RAN", spec, layout, file=sys.stderr, flush=True)
"""

# Warnings that concern our nodes: the node names, their outputs, the op or its domain.
_OURS = re.compile(r"GroupQueryAttention|ai\.kvlayout|present\.\d+\.|attn_out|VerifyOutputSizes")
_WARN = re.compile(r"\[(W|E):onnxruntime")


def run_child(provider: str, variants: list[dict]) -> str:
    env = dict(os.environ)
    env.pop("ORT_LOGGING_LEVEL", None)
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, HELPERS, provider, json.dumps(variants)],
        capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip
    assert p.returncode == 0, f"child failed (rc {p.returncode}):\n{p.stderr[-3000:]}"
    return p.stderr


def check_quiet(stderr: str, variants: list[dict]) -> None:
    control, _, rest = stderr.partition("CONTROL_DONE")
    assert re.search(r"VerifyOutputSizes.*\{2\}.*\{3\}", control), (
        "the control's VerifyOutputSizes warning did not reach stderr: the capture is blind\n"
        + control[-2000:]
    )
    assert rest.count("RAN") == len(variants), rest[-3000:]
    ours = [line for line in rest.splitlines() if _WARN.search(line) and _OURS.search(line)]
    assert not ours, f"{len(ours)} ORT warning(s) about our nodes, e.g.:\n" + "\n".join(ours[:6])


_CPU_VARIANTS = [
    {"packed": True, "kv_layout": 1},
    {"packed": False, "kv_layout": 1},
    {"packed": True, "kv_layout": 0},
    {"packed": True, "local_window_size": 4, "sliding_window_cache": 1, "kv_layout": 1},
]


def test_patched_model_quiet_on_cpu():
    ok, why = op_available()
    if not ok:
        pytest.skip(f"ort_kvlayout is not usable: {why}")
    check_quiet(run_child("CPUExecutionProvider", _CPU_VARIANTS), _CPU_VARIANTS)


@pytest.mark.gpu
def test_patched_model_quiet_on_cuda():
    from gpu_util import EMULATE, SKIP_REASON

    if SKIP_REASON is not None or EMULATE:
        pytest.skip(f"GPU tests: {SKIP_REASON or 'emulated on CPU'}")
    check_quiet(run_child("CUDAExecutionProvider", _CPU_VARIANTS), _CPU_VARIANTS)
