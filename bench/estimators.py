"""GRPO vs PPO-with-a-critic (GAE) vs REINFORCE++ on the same task, machine and number of steps.

    python bench/estimators.py [--steps 60 --nproc 2 --out /tmp/bench_estimators]

Runs the README's default command (tiny built-in policy, max_digit, 2 ranks under torchrun) once per estimator and
prints one table: median seconds per step (first 3 steps skipped as warm-up), peak RSS per rank (mem/peak_gb), and the
mean reward of the first and last 10 steps. Extra grpo.py flags after `--` go to every run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import matmul_peak  # noqa: E402  (printed beside the timings: machines of one kind differ)

RUNS = {"grpo": [], "gae (PPO + critic)": ["--advantage-estimator", "gae", "--critic.lr", "1e-3"],
        "reinforce_pp": ["--advantage-estimator", "reinforce_pp"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default="/tmp/bench_estimators")
    ap.add_argument("extra", nargs="*", help="grpo.py flags for every run (after --)")
    args = ap.parse_args()
    rows, peak = [], matmul_peak(1)
    for name, flags in RUNS.items():
        out = os.path.join(args.out, name.split()[0])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "grpo.py",
               "--output-dir", out, "--overwrite", "--max-steps", str(args.steps), "--log.completions-every", "0",
               "--log.no-progress", "--eval.every", "0", *flags, *args.extra]
        t0 = time.time()
        os.makedirs(args.out, exist_ok=True)
        log = os.path.join(args.out, f"{name.split()[0]}.log")
        with open(log, "w") as f:
            if subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode:
                sys.exit(f"the {name} run failed: see {log}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            m = [json.loads(line) for line in f]
        reward = lambda rs: sum(r["reward/mean"] for r in rs) / len(rs)  # noqa: E731
        rows.append((name, statistics.median(r["time/step"] for r in m[3:]), max(r["mem/peak_gb"] for r in m),
                     reward(m[:10]), reward(m[-10:]), time.time() - t0))
    load = os.getloadavg()[0]
    print(f"{args.steps} steps, {args.nproc} ranks, {os.cpu_count()} CPUs (matmul peak fp32 {peak:.0f} GFLOP/s per core), "
          f"load average at the end {load:.1f}\n")
    print("| estimator | s/step (median) | peak RSS GB per rank | reward first 10 | reward last 10 | wall s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, t, mem, r0, r1, wall in rows:
        print(f"| {name} | {t:.2f} | {mem:.2f} | {r0:.3f} | {r1:.3f} | {wall:.0f} |")


if __name__ == "__main__":
    main()
