"""The measured default flow_grpo.py run (docs/benchmarks.md): 2 ranks, no flags but an output directory and an
ODE evaluation before the first step and after the last (evaluation does not touch training: its noise streams are
its own). Prints a table and OVERWRITES the tracked docs/flow_before_after.png (docs/benchmarks.md's before/after picture)
with the two evaluation grids side by side; `git checkout docs/flow_before_after.png` restores it.

    python bench/flow_default.py [--out outputs/flow-bench] [--nproc 2]
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "flow-bench"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--eval-prompts", type=int, default=6)
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    t0 = time.time()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "flow_grpo.py",
           "--output-dir", args.out, "--overwrite", "--eval.every", "30", "--eval.num-prompts", str(args.eval_prompts),
           "--log.no-progress"]
    subprocess.run(cmd, cwd=ROOT, check=True)
    wall = time.time() - t0
    with open(os.path.join(args.out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    base, steps = rows[0], [r for r in rows if "reward/mean" in r]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    table = {"steps": len(steps), "wall_s (torchrun start to exit)": round(wall, 1),
             "reward first 10 steps": round(mean(steps[:10], "reward/mean"), 3),
             "reward last 10 steps": round(mean(steps[-10:], "reward/mean"), 3),
             "eval/reward before (ODE, 40 steps)": round(base["eval/reward"], 3),
             "eval/reward after": round(steps[-1]["eval/reward"], 3),
             "s/step (median)": round(sorted(r["time/step"] for r in steps)[len(steps) // 2], 2),
             "images/s (median)": round(sorted(r["images_per_s"] for r in steps)[len(steps) // 2], 1),
             "max logprob mismatch": max(r["logprob_mismatch/mean_abs"] for r in steps),
             "peak mem GB (rank 0)": round(max(r["mem/peak_gb"] for r in steps), 2),
             "load average at start / end": f"{load0:.1f} / {os.getloadavg()[0]:.1f}"}
    print("\n| measure | value |\n|---|---|")
    for k, v in table.items():
        print(f"| {k} | {v} |")
    before_after(os.path.join(args.out, "images"), len(steps), os.path.join(ROOT, "docs", "flow_before_after.png"))


def before_after(images_dir, last, out):
    """Eval grids of step 0 and the last step side by side (same prompts, same noise)."""
    from PIL import Image, ImageDraw
    a, b = (Image.open(os.path.join(images_dir, f"eval-step-{s}.png")) for s in (0, last))
    grid = Image.new("RGB", (a.width + b.width + 16, max(a.height, b.height) + 20), "white")
    grid.paste(a, (0, 20))
    grid.paste(b, (a.width + 16, 20))
    draw = ImageDraw.Draw(grid)
    draw.text((4, 4), "before (step 0)", fill="black")
    draw.text((a.width + 20, 4), f"after (step {last})", fill="black")
    grid.save(out)
    print(f"overwrote {out} (tracked in git: docs/benchmarks.md's before/after picture)")


if __name__ == "__main__":
    main()
