"""Console scripts: patch_kv_layout and gen_inference_metadata (see docs/TOOLS.md).

Also `python -m ort_kvlayout.tools.cli patch|metadata ARGS`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from ..model.gqa_schema import MissingModuleError
from ..op.layout import LAYOUT_NAMES, layout_id

# Exit codes (docs/TOOLS.md): distinct for each kind of outcome.
EXIT_OK = 0
EXIT_MISMATCH = 1  # --verify: patched and original disagree (the output was written)
EXIT_ERROR = 2  # usage or input error (argparse's code too): nothing written
VERIFY_PROMPT, VERIFY_TOKENS = "The capital of France is", 16  # --verify's defaults
EXIT_VERIFY_FAILED = 3  # --verify could not run the models (the output was written)
EXIT_SIGINT = 128 + signal.SIGINT  # 130: interrupted, nothing written
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143: terminated, nothing written


def _err(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like SIGINT's KeyboardInterrupt so the same cleanup runs."""


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    def raise_terminated(_signum, _frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_guarded(body: Callable[[], int]) -> int:
    """Runs a CLI body: an interrupt (SIGINT, SIGTERM) exits 130 / 143 after the tool's own
    cleanup; an unexpected exception is one line and EXIT_ERROR, never a traceback."""
    try:
        with _sigterm_as_interrupt():
            return body()
    except Terminated:
        _err("terminated (SIGTERM); nothing was written")
        return EXIT_SIGTERM
    except KeyboardInterrupt:
        _err("interrupted; nothing was written")
        return EXIT_SIGINT
    except MissingModuleError as exc:  # a broken install: say so, exit as an error
        _err(str(exc))
        return EXIT_ERROR
    except RecursionError:
        _err("input nested too deeply to be read")
        return EXIT_ERROR
    except MemoryError:
        _err("out of memory reading the input")
        return EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 -- a case the tools do not know: one line, no trace
        _err(f"unexpected {type(exc).__name__}: {exc} (please report this)")
        return EXIT_ERROR


def _path(text: str) -> Path:
    """argparse type: a non-empty path (an empty argument is an error, not the current dir)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path names no directory")
    return Path(text)


def _not_a_model_dir(path: Path) -> str | None:
    """Why `path` cannot be a model directory when it exists but is no directory (a file),
    else None (a missing path is the tools' own "not found")."""
    if path.exists() and not path.is_dir():
        kind = "a file" if path.is_file() else "not a directory"
        return f"{path} is {kind}, not a model directory"
    return None


def _tokens(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= value <= 4096:
        raise argparse.ArgumentTypeError(f"must be in [1, 4096], got {value}")
    return value


def patch_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="patch_kv_layout",
        description="Rewrite a model directory's GroupQueryAttention nodes to ai.kvlayout with the "
        "chosen KV-cache layout, into a new directory runnable by ORT and onnxruntime-genai.",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", type=_path, help="onnxruntime-genai model dir")
    p.add_argument(
        "-o",
        "--output",
        type=_path,
        default=None,
        help="output directory (default: MODEL_DIR-seq-major / MODEL_DIR-head-major)",
    )
    p.add_argument(
        "--layout",
        default="seq-major",
        choices=["seq-major", "head-major"],
        help="KV layout of the rewritten nodes (default seq-major, BSNH)",
    )
    p.add_argument(
        "--kv-quant",
        default=None,
        choices=["int8-per-token", "int4-per-token", "fp8-per-token"],
        help="also convert the plain (float) KV caches to PER_TOKEN quantization: int8, packed "
        "int4 or fp8 caches with per-(token, kv head) scale caches",
    )
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument(
        "--verify",
        action="store_true",
        help="generate greedily with the original and the patched model (plain ORT) and "
        "compare logits and tokens; exit 1 when the tokens differ",
    )
    p.add_argument("--prompt", default=None, help=f"prompt for --verify ({VERIFY_PROMPT!r})")
    p.add_argument("--tokens", type=_tokens, default=None, help="tokens generated by --verify (16)")
    p.add_argument(
        "--library",
        type=_path,
        default=None,
        help="custom-op library to copy into the output (default: the installed one)",
    )
    p.add_argument(
        "--no-metadata", action="store_true", help="do not write inference_metadata.yaml"
    )
    p.add_argument(
        "--link",
        action="store_true",
        help="hard-link large files (weights) instead of copying them: instant, no disk space; "
        "ORT and onnxruntime-genai accept that, onnx.load refuses multiply-linked external data",
    )
    p.add_argument("-q", "--quiet", action="store_true")
    return p


def _verify_settings(args: argparse.Namespace) -> str | None:
    """What makes --verify impossible whatever the patch gives, found before anything is written
    (None: nothing): an empty prompt, or more tokens than the model's context holds."""
    from ..model.config import config_int, load_genai_config

    if not args.prompt.strip():
        return "--prompt is empty: --verify needs a prompt to generate from"
    try:
        context = config_int(load_genai_config(args.model_dir), "model.context_length", lo=1)
    except Exception:  # noqa: BLE001 -- the patch itself names a bad genai_config.json
        return None
    if args.tokens >= context:
        return (
            f"--tokens {args.tokens} does not fit the model's context of {context} tokens "
            "with a prompt: --verify could not run"
        )
    return None


def patch_main(argv: list[str] | None = None) -> int:
    args = patch_parser().parse_args(argv)
    return _run_guarded(lambda: _patch(args))


def _patch(args: argparse.Namespace) -> int:
    from .patch import PatchError, patch_model_dir
    from .verify import verify_patch

    log = (lambda _m: None) if args.quiet else print
    problem = _not_a_model_dir(args.model_dir)
    if not args.verify and (args.prompt is not None or args.tokens is not None):
        problem = "--prompt and --tokens are --verify's: add --verify, or drop them"
    args.prompt = VERIFY_PROMPT if args.prompt is None else args.prompt
    args.tokens = VERIFY_TOKENS if args.tokens is None else args.tokens
    if problem is None and args.verify:
        problem = _verify_settings(args)
    if problem is not None:
        _err(problem)
        return EXIT_ERROR
    try:
        result = patch_model_dir(
            args.model_dir,
            args.output,
            layout=layout_id(args.layout),
            force=args.force,
            library=args.library if args.library is not None else "auto",
            metadata=not args.no_metadata,
            link=args.link,
            log=log,
            kv_quant=args.kv_quant,
        )
    except (PatchError, FileExistsError) as exc:
        _err(str(exc))
        return EXIT_ERROR
    except OSError as exc:  # unreadable input, unwritable output, disk full
        _err(f"{exc.filename or ''}{': ' if exc.filename else ''}{exc.strerror or exc}")
        return EXIT_ERROR
    if not args.verify:
        return 0
    try:
        check = verify_patch(
            result.model_dir, result.out_dir, args.prompt, args.tokens, kv_quant=args.kv_quant
        )
    except Exception as exc:  # noqa: BLE001 -- ORT, tokenizer, model: output stays, unverified
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        _err(
            f"--verify could not run ({type(exc).__name__}: {first}); {result.out_dir} was written"
        )
        return EXIT_VERIFY_FAILED
    if check.prompt_note:
        print(f"verify: {check.prompt_note}")
    print(
        f"verify: {len(check.original_tokens)} greedy tokens, max |logit diff| "
        f"{check.max_logit_diff:.3g} over {check.compared_steps} step(s), tokens "
        + ("agree" if check.tokens_agree else "DISAGREE")
        + (f" with the {args.kv_quant} reference (numpy emulation)" if args.kv_quant else "")
    )
    if check.unquantized_tokens is not None:
        same, total = check.agreement(check.unquantized_tokens, check.patched_tokens)
        print(f"verify: the first {same} of {total} tokens agree with the unquantized model")
    if not check.tokens_agree:
        print(f"  original: {check.original_tokens}\n  patched:  {check.patched_tokens}")
        return EXIT_MISMATCH
    return 0


def metadata_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gen_inference_metadata",
        description="Write inference_metadata.yaml for a model directory from its genai_config.json "
        "and the KV layout of its GroupQueryAttention nodes.",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", type=_path)
    out = p.add_mutually_exclusive_group()
    out.add_argument(
        "--output",
        type=_path,
        default=None,
        help="where to write (default: MODEL_DIR/inference_metadata.yaml)",
    )
    out.add_argument("--stdout", action="store_true", help="print the YAML instead of writing it")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    return p


def metadata_main(argv: list[str] | None = None) -> int:
    args = metadata_parser().parse_args(argv)
    return _run_guarded(lambda: _metadata(args))


def _metadata(args: argparse.Namespace) -> int:
    from ..model.config import METADATA_FILE, MetadataError
    from .metadata import build_metadata, dump_metadata, input_files, write_metadata

    try:
        problem = _not_a_model_dir(args.model_dir)
        if problem is not None:
            raise MetadataError(problem)
        if not args.model_dir.is_dir():
            raise MetadataError(f"model directory {args.model_dir} not found")
        data = build_metadata(args.model_dir)
        if args.stdout:
            sys.stdout.write(dump_metadata(data))
            return 0
        out = args.output or args.model_dir / METADATA_FILE
        inputs = input_files(args.model_dir)
        if out.resolve() in inputs or (
            out.exists() and any(f.exists() and os.path.samefile(out, f) for f in inputs)
        ):  # the same path, or a hard link to an input
            raise MetadataError(f"output {out} is one of the tool's inputs; choose another path")
        if out.is_dir():
            raise MetadataError(f"output {out} is a directory")
        folder = out.parent
        if not folder.is_dir():  # else the error would name the hidden temporary file
            why = "is not a directory" if folder.exists() else "does not exist"
            raise MetadataError(f"output {out}: its folder {folder} {why}")
        path = write_metadata(data, out, args.force)
    except (MetadataError, FileExistsError) as exc:
        _err(str(exc))
        return EXIT_ERROR
    except OSError as exc:
        _err(f"{exc.filename or ''}{': ' if exc.filename else ''}{exc.strerror or exc}")
        return EXIT_ERROR
    layout = data["model"]["io"]["kv_layout"]
    assert layout in LAYOUT_NAMES.values()
    print(f"wrote {path} (kv_layout {layout})")
    return 0


if __name__ == "__main__":  # python -m ort_kvlayout.tools.cli patch|metadata ...
    commands = {"patch": patch_main, "metadata": metadata_main}
    usage = f"usage: python -m ort_kvlayout.tools.cli {{{'|'.join(commands)}}} ..."
    if len(sys.argv) == 2 and sys.argv[1] in ("-h", "--help"):
        print(usage)
        sys.exit(0)
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(usage, file=sys.stderr)
        sys.exit(EXIT_ERROR)  # a usage error, as argparse exits
    sys.exit(commands[sys.argv[1]](sys.argv[2:]))
