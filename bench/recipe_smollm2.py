"""A real learning run: GRPO on SmolLM2-135M-Instruct (the packaged GGUF) on small_arith, on a CPU machine.

    python bench/recipe_smollm2.py                                   # the tuned recipe (docs/benchmarks.md, "A real model")
    python bench/recipe_smollm2.py --out outputs/try2 --set optim.lr=5e-6 rollout.temperature=1.0

Runs `torchrun --nproc_per_node 2 grpo.py ...` with the flags below (printed first), then prints the greedy accuracy on
the held-out prompts before training (the step-0 eval) and after (the last eval), the wall time, the machine and the
load average, and writes the curves (bench/plot.py) to <out>/curves.png. Every flag is a grpo.py flag; --set
overrides one (`name=value`, the name without the leading dashes; `name=` drops it).
"""
import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

RECIPE = {  # grpo.py flags; why each value: docs/benchmarks.md, "A real model: SmolLM2-135M-Instruct"
    "dataset": "small_arith",  # operands 1..20: the model gets ~40% right greedily, so groups have mixed rewards
    "data.rewards": "final_number",  # the last number must be the answer: `accuracy` (math-verify) also credits an
    # echo of the question ("3 * 4" for 12), which the first try learned (docs/benchmarks.md); no format bonus
    "max-steps": "20",
    "num-generations": "8",
    "batch-size": "16",  # completions per rank per step: 2 prompts x 8; 2 ranks -> 4 prompts, 32 completions a step
    "micro-batch-size": "16",
    "rollout.max-completion-length": "32",  # "a + b = c" is ~10 tokens; longer answers are rambles that get 0
    "rollout.max-prompt-length": "96",
    "vllm.max-model-len": "128",
    "rollout.temperature": "0.7",  # at 1.0 the samples were right far less often than greedy (docs/benchmarks.md, the tries)
    "optim.lr": "1e-5",  # full fine-tune, float32
    "optim.warmup-steps": "2",
    "loss.beta": "0.0",  # no reference model: half the forward passes
    "eval.every": "5",
    "eval.num-prompts": "64",  # held out: launch.load_rows drops them from train
    "eval.n-samples": "1",  # greedy
    "log.completions-every": "10",
    "log.no-progress": None,
}


def machine():
    """'2-core x86_64 CPU (model name)' from /proc/cpuinfo where there is one."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()}-core {platform.machine()} CPU ({name})"


def load_avg():
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def command(flags, out_dir, model, nproc):
    """The torchrun command line for these flags."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc_per_node", str(nproc), "grpo.py", "--model", model, "--output-dir", out_dir,
           "--overwrite"]
    for name, value in flags.items():
        cmd += [f"--{name}"] + ([] if value is None else value.split())
    return cmd


def summary(rows):
    """metrics.jsonl rows -> (accuracy before, accuracy after, [(step, accuracy)], first/last-5 mean reward)."""
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    first, last = (sum(x) / max(len(x), 1) for x in (rewards[:5], rewards[-5:]))
    return evals[0][1], evals[-1][1], evals, first, last


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="outputs/recipe_smollm2", help="the run's --output-dir (overwritten)")
    p.add_argument("--model", default=None, help="checkpoint (default: the packaged SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    p.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE", help="override or drop (NAME=) a flag")
    p.add_argument("--png", default=None, help="where to write the curves (default: <out>/curves.png)")
    args = p.parse_args()
    import models
    flags = dict(RECIPE)
    for item in args.set:
        name, _, value = item.partition("=")
        if value:
            flags[name.lstrip("-")] = value
        else:
            flags.pop(name.lstrip("-"), None)
    cmd = command(flags, args.out, args.model or models.packaged_smollm2(), args.nproc)
    print("machine:", machine(), "|", load_avg(), "(before)", flush=True)
    print("command:", " ".join(cmd), flush=True)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    with open(os.path.join(args.out, "recipe.log"), "w", buffering=1) as log:  # the full log, line by line
        proc = subprocess.Popen(cmd, cwd=os.path.dirname(HERE), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for line in proc.stdout:
            log.write(line)
            if line.startswith(("step ", "done in", "Traceback")) or "Error" in line:
                print(line, end="", flush=True)
    wall_s = time.time() - t0
    if proc.wait() != 0:
        sys.exit(f"grpo.py exited with {proc.returncode}; see {args.out}/recipe.log")
    with open(os.path.join(args.out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    before, after, evals, r_first, r_last = summary(rows)
    n_eval = flags.get("eval.num-prompts", "64")
    print(f"held-out greedy accuracy ({n_eval} prompts): before {before:.3f} -> after {after:.3f}")
    print("eval curve: " + ", ".join(f"step {s}: {a:.3f}" for s, a in evals))
    print(f"train reward (sampled, mean of first/last 5 steps): {r_first:.3f} -> {r_last:.3f}")
    print(f"wall time {wall_s:.0f} s (torchrun start to exit, incl. GGUF conversion and engine start) on {machine()}; "
          f"{load_avg()} (after)")
    from plot import plot_runs
    png = args.png or os.path.join(args.out, "curves.png")
    plot_runs([(os.path.basename(os.path.normpath(args.out)), rows)], png)
    print("curves:", png)
    if shutil.which("uptime"):
        print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
