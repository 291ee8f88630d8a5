"""bench/async.py: the colocated loop vs dedicated inference ranks (--rollout.inference-ranks) on this machine.

Every run: torchrun with 2 ranks, the default task, the same global batch (64 completions per step) and seed.
  colocated        both ranks generate (vLLM) and train, taking turns (--batch-size 32 per rank)
  1+1, S=0         rank 0 trains, rank 1 generates; the trainer waits for each batch (synchronous, disaggregated)
  1+1, S=1         as above, but generation of batch s+1 overlaps training on batch s (one-step off-policy)
  1+1, S=1, in-flight  as above, and the generator loads new weights between chunks of --chunk tokens
                   (--rollout.inflight-updates): completions in progress continue under them
--extra adds flags to every run (e.g. "--rollout.max-completion-length 64" for long completions).
Prints s/step (steps 2.. of the trainer's loop), steps per minute, the reward reached within a fixed wall-clock
budget of training (time from the end of step 1: startup and the first step's engine warm-up left out), the final
reward, and the async metrics.

    python bench/async.py --steps 100 --budget-s 5
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import matmul_peak  # noqa: E402  (printed beside the timings: machines of one kind differ)
RUNS = {
    "colocated": ["--batch-size", "32", "--micro-batch-size", "32"],
    "1+1, S=0": ["--rollout.inference-ranks", "1", "--rollout.max-staleness", "0"],
    "1+1, S=1": ["--rollout.inference-ranks", "1", "--rollout.max-staleness", "1"],
    "1+1, S=1, in-flight": ["--rollout.inference-ranks", "1", "--rollout.max-staleness", "1",
                            "--rollout.inflight-updates"],  # + --chunk
}


def run(name, flags, steps, work, evaluate=False):
    out = os.path.join(work, name.replace(" ", "").replace(",", "_").replace("+", "p").replace("=", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "grpo.py", "--output-dir", out,
           "--overwrite", "--max-steps", str(steps), "--log.completions-every", "0",
           *([] if evaluate else ["--eval.every", "0"]), *flags]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{name} failed:\n{(p.stdout + p.stderr)[-4000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return rows, time.time() - t0


def summarise(rows, wall, budget):
    clock, reached = 0.0, []
    for r in rows[1:]:
        clock += r["time/step"]
        if clock <= budget:
            reached.append(r)
    window = lambda rs: sum(r["reward/mean"] for r in rs[-10:]) / max(len(rs[-10:]), 1)  # noqa: E731
    step_s = sum(r["time/step"] for r in rows[1:]) / (len(rows) - 1)
    get = lambda k: sum(r.get(k, 0.0) for r in rows[1:]) / (len(rows) - 1)  # noqa: E731
    return {"s/step": step_s, "steps/min": 60 / step_s, "steps in budget": len(reached) + 1,
            "reward at budget": window(rows[:1] + reached), "final reward": window(rows), "wall s": wall,
            "staleness": get("async/staleness_mean"), "trainer wait s": get("async/trainer_wait_s"),
            "generator wait s": get("async/generator_wait_s"), "transfer s": get("time/weight_transfer"),
            "accuracy": next((r["eval/accuracy"] for r in reversed(rows) if "eval/accuracy" in r), float("nan")),
            "partial frac": get("async/partial_frac"), "spread max": max(r.get("async/version_spread_max", 0)
                                                                         for r in rows)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--budget-s", type=float, default=5.0, help="wall-clock training budget for 'reward at budget'")
    ap.add_argument("--work", default="/tmp/bench_async")
    ap.add_argument("--only", nargs="*", default=list(RUNS))
    ap.add_argument("--chunk", default="1", help="--rollout.inflight-updates of the in-flight run (tokens per chunk)")
    ap.add_argument("--extra", default="", help="flags added to every run")
    ap.add_argument("--eval", action="store_true", help="keep the default evaluation (held-out greedy accuracy)")
    args = ap.parse_args()
    RUNS["1+1, S=1, in-flight"].append(args.chunk)
    load0, peak = os.getloadavg()[0], matmul_peak(1)
    results = {name: summarise(*run(name, RUNS[name] + args.extra.split(), args.steps, args.work, args.eval),
                               args.budget_s)
               for name in args.only}
    print(f"\nmachine: {os.cpu_count()} CPU cores, matmul peak fp32 {peak:.0f} GFLOP/s per core; 2 ranks; "
          f"load average (1 min) at start/end {load0:.1f} / "
          f"{os.getloadavg()[0]:.1f}; {args.steps} steps; 64 completions per step; budget {args.budget_s:.0f} s; "
          f"chunk {args.chunk}; extra flags {args.extra or 'none'}")
    cols = list(next(iter(results.values())))
    print(f"| run | {' | '.join(cols)} |\n|---|{'---|' * len(cols)}")
    for name, r in results.items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
