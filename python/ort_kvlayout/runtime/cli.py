"""`python -m ort_kvlayout.runtime MODEL_DIR --prompt TEXT ...`: streams generated text.

The text goes to stdout as it is produced (batch 1; a batch prints each entry at the end); a
progress line on stderr shows tokens/s and the KV cache's committed bytes, and a summary closes
the run (time to first token, decode rate, cache counters).

Exit status: 0 done; 2 an error, reported as one line `error: ...` on stderr (bad arguments,
an unreadable model directory or tokenizer, a cache or ORT failure); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .kv_cache import CACHE_MODES, KvCapacityError
from .kv_memory import KvMemoryError
from .sampling import SamplingParams

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool its reader left


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ort_kvlayout.runtime",
        description="Generate text with a (patched or original) onnxruntime-genai model "
        "directory through a plain ORT session and ort_kvlayout's KV cache.",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", type=Path)
    p.add_argument(
        "--prompt", action="append", required=True, help="prompt text; repeat for a batch"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--cache", choices=CACHE_MODES, default="growable")
    p.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--capacity", type=int, default=None, help="tokens reserved per entry")
    p.add_argument(
        "--no-cuda-graph", action="store_true", help="CUDA: run decode steps without graphs"
    )
    sampling = p.add_mutually_exclusive_group()
    sampling.add_argument("--greedy", action="store_true", help="argmax decoding (the default)")
    sampling.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0, help="with --temperature (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature (1: off)")
    p.add_argument("--seed", type=int, default=None, help="with --temperature")
    p.add_argument(
        "--tokenizer", choices=["onnxruntime-extensions", "tokenizers"], default=None,
        help="tokenizer backend (default: the first that loads the directory's tokenizer)",
    )  # fmt: skip
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line or summary")
    return p


def sampling_from(args: argparse.Namespace) -> SamplingParams:
    if args.temperature is None:
        if args.top_k or args.top_p != 1.0 or args.seed is not None:
            raise ValueError("--top-k/--top-p/--seed need --temperature (sampling)")
        return SamplingParams()
    if args.temperature <= 0:
        raise ValueError("--temperature must be > 0 (use --greedy for argmax)")
    if args.seed is not None and args.seed < 0:
        raise ValueError(f"--seed must be an integer >= 0, got {args.seed}")
    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)


def redraws_progress(stream: bool, quiet: bool, stdout=None, stderr=None) -> bool:
    """Whether the redrawn status line goes to stderr: only onto a terminal, and not while text
    streams onto the same terminal (its carriage return and erase would wipe the text's line)."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    return not quiet and stderr.isatty() and not (stream and stdout.isatty())


class Progress:
    """Streams batch-1 text and redraws a one-line status on stderr at most 4 times a second
    (when redraws_progress allows it)."""

    def __init__(self, tokenizer, runtime, stream: bool, quiet: bool):
        self.tokenizer, self.runtime = tokenizer, runtime
        self.stream = stream
        self.redraw = redraws_progress(stream, quiet)
        self.ids: list[int] = []
        # Printed text is extended by decoding a short tail only: ids[prefix:read] were printed
        # last (the context that fixes leading spaces), ids[read:] are not printed yet.
        self.prefix = 0
        self.read = 0
        self.text = ""  # everything printed so far
        self.start = time.perf_counter()
        self.tokens = 0
        self.drawn = 0.0

    @property
    def clear(self) -> str:
        """What erases the status line before the summary ("" when none was drawn)."""
        return "\r\033[K" if self.drawn else ""

    def __call__(self, step_tokens: list[int | None]) -> None:
        self.tokens += sum(t is not None for t in step_tokens)
        if self.stream and step_tokens[0] is not None:
            self.ids.append(step_tokens[0])
            done = self.tokenizer.decode(self.ids[self.prefix : self.read])
            text = self.tokenizer.decode(self.ids[self.prefix :])
            # Whole characters only: a byte-level piece may end mid-character ("\ufffd").
            if len(text) > len(done) and text.startswith(done) and not text.endswith("\ufffd"):
                piece = text[len(done) :]
                sys.stdout.write(piece)
                sys.stdout.flush()
                self.text += piece
                self.prefix, self.read = self.read, len(self.ids)
        now = time.perf_counter()
        if self.redraw and now - self.drawn > 0.25:
            self.drawn = now
            stats = self.runtime.cache.stats
            rate = self.tokens / (now - self.start)
            sys.stderr.write(
                f"\r\033[K[{self.tokens} tokens, {rate:.1f} tokens/s, KV committed "
                f"{mib(stats.committed_bytes)} of {mib(stats.reserved_bytes)} reserved]"
            )
            sys.stderr.flush()


def error_line(exc: BaseException) -> str:
    """One line for any failure: the message (its lines joined), with the exception's type when
    the message alone may not say what failed (ORT's Fail, protobuf errors, KeyError...)."""
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    known = (ValueError, OSError, KvCapacityError, KvMemoryError)
    return f"error: {text}" if isinstance(exc, known) and text else (
        f"error: {type(exc).__name__}: {text or '(no message)'}"
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    streamed: list[bool] = [False]
    try:
        return run(args, streamed)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush writes nowhere
        return EXIT_BROKEN_PIPE
    except Exception as exc:  # noqa: BLE001 -- the CLI boundary: one line, never a traceback
        if streamed[0]:
            sys.stdout.write("\n")
            sys.stdout.flush()
        print(error_line(exc), file=sys.stderr)
        return EXIT_ERROR


def run(args: argparse.Namespace, streamed: list[bool]) -> int:
    from ..model.tokenizer import load_tokenizer
    from .generation import Runtime

    sampling = sampling_from(args)
    model_dir = Path(args.model_dir)
    if not model_dir.is_dir():
        what = "does not exist" if not model_dir.exists() else "is not a directory"
        raise ValueError(f"MODEL_DIR {model_dir} {what}")
    tokenizer = load_tokenizer(args.model_dir, args.tokenizer)
    for i, text in enumerate(args.prompt):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # bytes the shell's encoding could not decode
            raise ValueError(
                f"--prompt {i + 1} is not valid Unicode text (at character {exc.start}): "
                "check the terminal's encoding"
            ) from None
    prompts = [tokenizer.encode(text) for text in args.prompt]
    runtime = Runtime(
        args.model_dir,
        provider=args.provider,
        cache=args.cache,
        cuda_graph=False if args.no_cuda_graph else None,
        capacity=args.capacity,
    )
    with runtime:
        progress = Progress(tokenizer, runtime, stream=len(prompts) == 1, quiet=args.quiet)
        try:
            out = runtime.generate(prompts, args.max_new_tokens, sampling, on_step=progress)
        finally:
            streamed[0] = bool(progress.text)
        if len(prompts) == 1:
            rest = tokenizer.decode(out.tokens[0])
            sys.stdout.write(rest[len(progress.text) :] + "\n")
        else:
            for i, tokens in enumerate(out.tokens):
                print(f"[{i}] {args.prompt[i]}{tokenizer.decode(tokens)}")
        if not args.quiet:
            s = out.stats
            graphs = (
                f", graph captures {s.graph_captures}, replays {s.replays}, "
                f"re-captures {s.recaptures}"
                if runtime.cuda_graph
                else ""
            )
            sys.stderr.write(
                f"{progress.clear}{sum(map(len, out.tokens))} tokens "
                f"({', '.join(out.finish_reasons)}); "
                f"time to first token {out.ttft_seconds * 1e3:.1f} ms, decode "
                f"{out.decode_tokens_per_second:.1f} steps/s; KV ({args.cache}, "
                f"{tokenizer.backend} tokenizer): committed {mib(s.committed_bytes)} of "
                f"{mib(s.reserved_bytes)} reserved, growth events {s.growth_events}, bytes moved "
                f"{s.bytes_moved}{graphs}\n"
            )
    return 0
