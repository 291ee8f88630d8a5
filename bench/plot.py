"""Training curves of one or more runs, overlaid, in one PNG.

    python bench/plot.py runs/a runs/b              # -> runs/a/curves.png
    python bench/plot.py runs/a --out curves.png

Reads each run's <output_dir>/metrics.jsonl (one JSON object per step, keys in docs/metrics.md) and draws a 2 x 3
grid: reward, eval accuracy, KL, entropy, mean completion length, step time; x = step, one line per run, labelled
with the directory name. Keys a run did not log are skipped; eval keys, logged every --eval.every steps, are drawn
at the steps that have them. The image is always FIG_SIZE_IN x DPI pixels (1200 x 700).
"""
import argparse
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

FIG_SIZE_IN, DPI = (12, 7), 100  # -> 1200 x 700 pixels; no bbox_inches="tight", which would change the size
PANELS = [  # (title, keys: the first one a run logged is drawn)
    ("reward", ["reward/mean"]),
    ("eval accuracy", ["eval/accuracy", "eval/pass@1"]),
    ("KL", ["kl"]),
    ("entropy", ["entropy"]),
    ("completion length (tokens)", ["completion_len/mean"]),
    ("step time (s)", ["time/step"]),
]


def read_metrics(run_dir):
    """<run_dir>/metrics.jsonl -> list of row dicts. Exits with one message when the file is missing or corrupt."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        sys.exit(f"bench/plot.py: no metrics.jsonl in {run_dir!r}. Pass the --output-dir of a run (it writes "
                 f"metrics.jsonl there from its first step on).")
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if n < len(lines):  # only the last line may be half-written (a run still going)
                sys.exit(f"bench/plot.py: {path} line {n} is not JSON.")
    return rows


def series(rows, keys):
    """(key, steps, values) for the first key in `keys` any row has, over the rows that have it; None if none."""
    key = next((k for k in keys if any(k in r for r in rows)), None)
    if key is None:
        return None
    pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None and not math.isnan(r[key])]
    return key, [s for s, _ in pts], [v for _, v in pts]


def plot_runs(runs, out_path):
    """runs: [(label, rows)] -> one PNG of PANELS at out_path."""
    fig, axes = plt.subplots(2, 3, figsize=FIG_SIZE_IN, dpi=DPI)
    for ax, (title, keys) in zip(axes.flat, PANELS):
        drawn = set()
        for i, (label, rows) in enumerate(runs):
            s = series(rows, keys)
            if s is None:
                continue
            key, steps, values = s
            ax.plot(steps, values, f"C{i}", marker="." if len(steps) < 30 else None, label=label)  # a run keeps its colour
            drawn.add(key)
        ax.set_title(f"{title} [{', '.join(sorted(drawn))}]" if drawn else f"{title} (not logged)", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
    fig.tight_layout()  # moves the axes inside the figure; the figure size stays FIG_SIZE_IN
    fig.savefig(out_path, dpi=DPI)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dirs", nargs="+", help="run output directories, each holding metrics.jsonl")
    p.add_argument("--out", help="PNG to write (default: <first run dir>/curves.png)")
    args = p.parse_args()
    runs = [(os.path.basename(os.path.normpath(d)), read_metrics(d)) for d in args.run_dirs]
    out = args.out or os.path.join(args.run_dirs[0], "curves.png")
    plot_runs(runs, out)
    print(out)


if __name__ == "__main__":
    main()
