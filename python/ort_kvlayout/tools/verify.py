"""patch_kv_layout --verify: the original and the patched model directory through the same plain
greedy loop (reference_loop), compared token by token and logit by logit.

    from ort_kvlayout.tools.verify import verify_patch
    check = verify_patch("smollm2", "smollm2-seq-major")
    check.tokens_agree, check.max_logit_diff

After `--kv-quant` (a PER_TOKEN conversion) the original runs as the reference loop's PER_TOKEN
emulation (numpy quantize/dequantize of each written row, reference_loop.fake_quant_rows) and,
for information, unquantized: the report gives the agreement with both.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..model.config import GENAI_CONFIG
from ..model.tokenizer import TokenizerBackendMissing, load_tokenizer
from .reference_loop import Generator


@dataclass
class VerifyResult:
    original_tokens: list[int]
    patched_tokens: list[int]
    max_logit_diff: float  # over the steps both runs reached with the same prefix
    compared_steps: int
    unquantized_tokens: list[int] | None = None  # --kv-quant: the original, not emulated
    prompt_note: str | None = None  # why the prompt was not used (fixed ids instead)

    @property
    def tokens_agree(self) -> bool:
        return self.original_tokens == self.patched_tokens

    @staticmethod
    def agreement(a: list[int], b: list[int]) -> tuple[int, int]:
        """(leading tokens that agree, tokens compared)."""
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n, max(len(a), len(b))


def verify_prompt_ids(model_dir: Path, prompt: str) -> tuple[list[int], str | None]:
    """The prompt through the directory's tokenizer.json, and None; or, where the directory has
    no tokenizer.json or no tokenizer backend is installed, fixed ids and why the prompt was not
    used. A tokenizer.json that the installed backends refuse raises (RuntimeError), as does a
    prompt that encodes to no token (ValueError)."""
    if (model_dir / "tokenizer.json").is_file():
        try:
            ids = load_tokenizer(model_dir).encode(prompt)
        except TokenizerBackendMissing:  # the runtime extra is not installed
            note = "no tokenizer backend is installed (pip install ort-kvlayout[runtime])"
        else:
            if not ids:
                raise ValueError(f"the prompt {prompt!r} encodes to no token")
            return ids, None
    else:
        note = f"{model_dir} has no tokenizer.json"
    config = json.loads((model_dir / GENAI_CONFIG).read_text())
    vocab = int(config["model"]["vocab_size"])
    return [(1000 + 37 * i) % vocab for i in range(8)], f"{note}: 8 fixed token ids, not the prompt"


def verify_patch(
    original_dir: str | os.PathLike,
    patched_dir: str | os.PathLike,
    prompt: str = "The capital of France is",
    max_new_tokens: int = 16,
    provider: str = "cpu",
    kv_quant: str | None = None,
) -> VerifyResult:
    """Greedy generation with both directories (plain ORT, KV shared in place) and a comparison.

    The original runs with no custom-op library (ORT's own GQA for com.microsoft nodes); the
    patched one with the library its genai_config.json names. kv_quant: the patched model was
    converted to this PER_TOKEN scheme; the original runs with it emulated (and plain).
    """
    original_dir, patched_dir = Path(original_dir), Path(patched_dir)
    ids, note = verify_prompt_ids(original_dir, prompt)
    plain = None
    original = Generator(
        original_dir, provider, custom_ops_library="auto", emulate_kv_quant=kv_quant
    )
    a = original.generate(ids, max_new_tokens)
    if kv_quant is not None:
        plain = Generator(original_dir, provider, custom_ops_library="auto")
        plain = plain.generate(ids, max_new_tokens).tokens
    b = Generator(patched_dir, provider, custom_ops_library="auto").generate(ids, max_new_tokens)
    steps = 0
    diff = 0.0
    for ta, tb, la, lb in zip(a.tokens, b.tokens, a.logits, b.logits):
        diff = max(diff, float(np.max(np.abs(la - lb))))
        steps += 1
        if ta != tb:
            break
    return VerifyResult(a.tokens, b.tokens, diff, steps, plain, note)
