"""Plots of a bench_cuda.py JSON: decode TB/s against L (one panel per head shape, one colour per
batch size) and prefill TFLOP/s against S (one panel per head shape, one colour per batch size);
ORT's built-in op dashed, ours kv_layout=0 and kv_layout=1 solid and dotted.

    python bench/plot_cuda.py bench/results/cuda-h200.json --out docs/img
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STYLES = {"ort": ("--", "ORT com.microsoft"), "kv0": ("-", "ours kv_layout=0"),
          "kv1": (":", "ours kv_layout=1")}  # fmt: skip


def plot(rows: list[dict], kind: str, unit: str, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["kind"] == kind]
    heads = sorted({r["heads"] for r in rows}, key=lambda h: [-int(x) for x in h.split("/")])
    if not heads:
        return
    fig, axes = plt.subplots(1, len(heads), figsize=(4.2 * len(heads), 3.8), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, head in zip(axes[0], heads):
        sub = [r for r in rows if r["heads"] == head]
        for i, batch in enumerate(sorted({r["batch"] for r in sub})):
            pts = sorted((r for r in sub if r["batch"] == batch), key=lambda r: r["length"])
            xs = [r["length"] for r in pts]
            for variant, (style, label) in STYLES.items():
                ys = [r[variant][unit] for r in pts]
                ax.plot(xs, ys, style, color=colours[i % len(colours)], marker="o", markersize=3,
                        label=f"B={batch} {label}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_title(f"{head} (N/Nkv/H)")
        ax.set_xlabel("L (cached tokens)" if kind == "decode" else "S (prompt tokens)")
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=6, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", type=Path)
    p.add_argument("--out", type=Path, default=Path("docs/img"))
    args = p.parse_args(argv)
    data = json.loads(args.json.read_text())
    where = f"{data.get('device', 'GPU')}, {data.get('date', '')}"
    plot(data["rows"], "decode", "TB/s", f"Decode, KV read bandwidth ({where})",
         args.out / "cuda-decode-h200.png")  # fmt: skip
    plot(data["rows"], "prefill", "TFLOP/s", f"Prefill, causal ({where})",
         args.out / "cuda-prefill-h200.png")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
