#!/usr/bin/env python3
"""The engine's Python at several commits against each other, with one build of the library.

    python tools/perf/ab_python.py --out /tmp/ab [--rounds 2] BASE NEW [...] -- \\
        MODEL_DIR --provider cuda --batch 32 --requests 256 --prompt 64:512 --output 64:512

Each COMMIT is cloned from this checkout into OUT/src-COMMIT, the built libraries of the
importable ort_kvlayout (or --libs DIR) are linked into its package, and the same
tools/perf/step_profile.py command runs from each clone, the commits interleaved in each of
--rounds rounds, so that a shared machine's drift hits them alike. A change to Python alone
(the engine, its bindings) is measured this way on the GPU machine without a build a commit.

Writes OUT/COMMIT_ROUND.json (step_profile.py's) and --json (default OUT/ab.json): one file
whose results are every run's, each labelled "COMMIT, run ROUND", for bench/report.py. A run
that fails or passes --timeout seconds is reported and left out; the others are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def library_dir() -> Path:
    """Where the importable ort_kvlayout's built libraries are."""
    import ort_kvlayout

    return Path(ort_kvlayout.__file__).parent


def clone(commit: str, out: Path, libs: Path) -> Path:
    """OUT/src-COMMIT: this checkout at `commit`, with the built libraries linked in."""
    src = out / f"src-{commit.replace('/', '_')}"
    if src.exists():  # a name such as HEAD may have moved since: cloned anew
        shutil.rmtree(src)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(src)], check=True)
    subprocess.run(["git", "-C", str(src), "checkout", "-q", commit], check=True)
    package = src / "python" / "ort_kvlayout"
    built = sorted(libs.glob("*.so"))
    if not built:
        raise SystemExit(f"ab_python.py: no built library (*.so) in {libs}")
    for lib in built:
        link = package / lib.name
        link.unlink(missing_ok=True)
        link.symlink_to(lib.resolve())
    return src


def run(src: Path, profile_args: list[str], json_out: Path, timeout: float) -> dict | None:
    """step_profile.py from the clone `src`, its package first on the path; its JSON or None."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(src / "python"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    )
    command = [sys.executable, "tools/perf/step_profile.py", *profile_args, "--json", str(json_out)]
    try:
        done = subprocess.run(command, check=False, cwd=src, env=env, timeout=timeout,
                              capture_output=True, text=True)  # fmt: skip
    except subprocess.TimeoutExpired:
        print(f"ab_python.py: {src.name}: past {timeout:g} s, left out", file=sys.stderr)
        return None
    if done.returncode != 0 or not json_out.is_file():
        tail = "\n".join(done.stderr.splitlines()[-5:])
        print(
            f"ab_python.py: {src.name}: exit {done.returncode}, left out\n{tail}", file=sys.stderr
        )
        return None
    return json.loads(json_out.read_text())


def combine(runs: list[tuple[str, int, dict]], commits: list[str], profile_args: list[str],
            rounds: int) -> dict:  # fmt: skip
    """One step_profile-shaped record of every run, each result labelled by commit and round."""
    first = runs[0][2]
    results = []
    for commit, round_, data in runs:
        for r in data["results"]:
            results.append({**r, "label": f"{commit}, run {round_}"})
    return {
        "date": first["date"],
        "device": first["device"],
        "commit": " against ".join(commits),
        "command": "python tools/perf/step_profile.py " + shlex.join(profile_args),
        "commit_note": (
            f"tools/perf/ab_python.py: the command run from a clone of each of "
            f"{', '.join(commits)} with one build of the library, in turn, {rounds} round"
            f"{'s' * (rounds != 1)}"
        ),
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("ab_python.py: the step_profile.py arguments follow '--'", file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("commits", nargs="+", help="commits (or other git revisions) to compare")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--libs", type=Path, help="the built libraries (default: the importable package's)"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv[:cut])
    profile_args = argv[cut + 1 :]
    if "--json" in profile_args:
        p.error("--json after '--': ab_python.py names each run's JSON itself")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: expected 1 or more")
    if len(set(args.commits)) != len(args.commits):
        p.error("a commit given twice")
    args.out.mkdir(parents=True, exist_ok=True)
    libs = args.libs or library_dir()
    sources = {c: clone(c, args.out, libs) for c in args.commits}
    runs = []
    for round_ in range(1, args.rounds + 1):
        for commit, src in sources.items():
            name = commit.replace("/", "_")
            data = run(src, profile_args, (args.out / f"{name}_{round_}.json").resolve(),
                       args.timeout)  # fmt: skip
            if data is not None:
                runs.append((commit, round_, data))
    if not runs:
        print("ab_python.py: no run finished", file=sys.stderr)
        return 1
    path = args.json or args.out / "ab.json"
    path.write_text(
        json.dumps(combine(runs, args.commits, profile_args, args.rounds), indent=1) + "\n"
    )
    for commit, round_, data in runs:
        for r in data["results"]:
            print(f"{commit}, run {round_}: {r['wall_ms_per_step']:.2f} ms a step, "
                  f"{r['output_tok_s']:.0f} output tok/s")  # fmt: skip
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
