"""--lora.sync adapter vs merged on SmolLM2-135M-Instruct (the packaged GGUF): what one sync sends and costs.

    python bench/lora_sync.py [--ranks 8 64 --steps 4]

Runs `python grpo.py` (one process, the vLLM CPU engine, fp32) for each rank and mode with the same seed and flags, and
prints per run the medians over steps 2.. (step 1 follows the first, full sync): sync/bytes, time/sync, time/step,
mem/peak_gb, and the largest logprob_mismatch/mean_abs of any step. Prints the machine's fp32 matmul peak first
(bench/roofline.py); time nothing else on the machine meanwhile.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

FLAGS = ["--dataset", "small_arith", "--data.rewards", "final_number", "--num-generations", "4", "--batch-size", "8",
         "--micro-batch-size", "8", "--rollout.max-completion-length", "16", "--rollout.max-prompt-length", "96",
         "--vllm.max-model-len", "128", "--optim.lr", "1e-4", "--eval.every", "0", "--log.completions-every", "0",
         "--rollout.engine", "vllm", "--overwrite"]


def run(model, rank, mode, steps, out, reuse=False):
    """One grpo.py run (or, with reuse, the one already in `out`) -> its metrics rows (every step)."""
    if reuse and os.path.exists(os.path.join(out, "metrics.jsonl")):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if r["step"] >= 1]
    cmd = [sys.executable, os.path.join(ROOT, "grpo.py"), "--model", model, "--output-dir", out, "--max-steps",
           str(steps), "--lora.r", str(rank), "--lora.alpha", str(2 * rank), "--lora.sync", mode, *FLAGS]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if proc.returncode:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["step"] >= 1]


def main():
    import models
    from roofline import matmul_peak
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="/tmp/bench_lora_sync")
    ap.add_argument("--reuse", action="store_true", help="print the table of the runs already in --out")
    args = ap.parse_args()
    model = models.convert_gguf_once(models.packaged_smollm2(), os.path.join(args.out, "converted"), verbose=False)
    print(f"machine: {os.cpu_count()} CPUs, fp32 matmul peak {matmul_peak(1):.0f} GFLOP/s (1 thread), "
          f"{matmul_peak(2):.0f} GFLOP/s (2 threads); load average {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d')}")
    print(f"{'r':>3} | {'sync':>7} | {'MB per sync':>11} | {'s per sync':>10} | {'s generate':>10} | {'s per step':>10} | "
          f"{'peak GB':>7} | {'max mismatch':>12}")
    for rank in args.ranks:
        for mode in ("adapter", "merged"):
            rows = run(model, rank, mode, args.steps, os.path.join(args.out, f"r{rank}-{mode}"), args.reuse)
            med = lambda k: statistics.median(r[k] for r in rows[1:])  # noqa: E731
            print(f"{rank:>3} | {mode:>7} | {med('sync/bytes') / 1e6:11.2f} | {med('time/sync'):10.3f} | "
                  f"{med('time/generate'):10.2f} | {med('time/step'):10.2f} | {med('mem/peak_gb'):7.2f} | "
                  f"{max(r['logprob_mismatch/mean_abs'] for r in rows):12.2e}", flush=True)


if __name__ == "__main__":
    main()
