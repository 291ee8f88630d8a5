"""Learning against TRL on the SmolLM2 recipe, over seeds: the same start, rows, reward and scorer on both sides.

    python bench/learning_compare.py --seeds 0 1 2 3 4        # runs what --work lacks (ours, TRL, per seed), then the table
    python bench/learning_compare.py --render                  # the table from the saved results only
    python bench/learning_compare.py --variant beta2 --ours-set "optim.betas=0.9 0.999" --systems ours

Per seed s, alternating so both columns grow together: (a) bench/recipe_smollm2.py's flags under `torchrun grpo.py`
(2 ranks x 1 thread) with --seed s, (b) TRL's GRPOTrainer through bench/trl_driver.py in TRL's own virtualenv (one
process x 2 threads) at the same settings (32 completions = 4 prompts x 8 a step, 32 tokens, temperature 0.7, lr 1e-5,
2 warm-up steps then constant, dapo, beta 0, 20 steps, fp32, seed s), trained on the rows `launch.load_rows` gives
ours at seed s. Both start from one conversion of the packaged GGUF (<work>/base) and both final models are scored by
bench/check_small_arith.py (vLLM, greedy, 32 tokens): the 64 held-out prompts (the same for every seed, never
trained on) and 128 fresh ones (drawn like training rows: a few were trained on, so a second table keeps the fresh
prompts neither side trained on at that seed). A run whose score.json exists is skipped, so the bench can run in
pieces. Ours keeps grpo.py's default evaluation (greedy, held-out prompts, steps 0 and 20): it draws no random numbers
and does not touch training. Table: per-seed accuracy (last integer == a op b), the mean with its standard error over
seeds, the paired difference ours - TRL per seed with its mean, standard error and 95% t interval.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.append(HERE)  # after ROOT: bench/rollout.py must not shadow rollout.py
SETS = ("held-out 64", "fresh 128")
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}  # two-sided 95% t quantiles; between entries the next lower df's


def t95(df):
    return T95[max(k for k in T95 if k <= df)] if df < 60 else 1.96
STEPS = 20


def mean_se(xs):
    """-> (mean, standard error of the mean; nan below 2 values)."""
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) if len(xs) > 1 else float("nan"))


def accuracy(score_path, name):
    with open(score_path) as f:
        hits = json.load(f)[name]["last_integer"]
    return sum(hits) / len(hits)


def base_model(work):
    """The packaged GGUF dequantised once into <work>/base (both systems start from this folder)."""
    import models
    return models.convert_gguf_once(models.packaged_smollm2(), os.path.join(work, "base"), verbose=False)


def train_rows_file(work, seed):
    """Ours' training rows at this seed (held-out prompts removed) as jsonl, for TRL."""
    path = os.path.join(work, "rows", f"s{seed}.jsonl")
    if not os.path.exists(path):
        sys.path.insert(0, ROOT)  # train_ours' recipe_smollm2 puts bench/ first, whose rollout.py would shadow ours
        import grpo
        import launch
        rows, _ = launch.load_rows(grpo.Config(dataset="small_arith", seed=seed))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows)
        os.replace(path + ".tmp", path)
    return path


def run_logged(cmd, log_path, env):
    t0 = time.time()
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}).returncode
    if rc != 0:
        sys.exit(f"{cmd[0]} exited with {rc}; see {log_path}")
    return time.time() - t0


def train_ours(run_dir, base, seed, sets):
    from recipe_smollm2 import RECIPE, command
    flags = {**RECIPE, "seed": str(seed), "log.completions-every": "0"}
    flags.pop("eval.every")
    for item in sets:
        name, _, value = item.partition("=")
        flags[name.lstrip("-")] = value
    wall = run_logged(command(flags, run_dir, base, 2), os.path.join(run_dir, "train.log"), {"OMP_NUM_THREADS": "1"})
    return os.path.join(run_dir, f"checkpoint-{STEPS}"), wall


def train_trl(run_dir, base, seed, rows, python, extra):
    cmd = [python, os.path.join(HERE, "trl_driver.py"), "--model", base, "--data", rows, "--reward", "final_number",
           "--steps", str(STEPS), "--num-generations", "8", "--batch-size", "32", "--max-completion-length", "32",
           "--lr", "1e-5", "--temperature", "0.7", "--warmup-steps", "2", "--seed", str(seed), "--threads", "2",
           "--output-dir", os.path.join(run_dir, "trainer"), "--steps-file", os.path.join(run_dir, "steps.jsonl"),
           "--log-file", os.path.join(run_dir, "log.jsonl"), "--save-dir", os.path.join(run_dir, "final")] + extra
    wall = run_logged(cmd, os.path.join(run_dir, "train.log"), {"OMP_NUM_THREADS": "2"})
    return os.path.join(run_dir, "final"), wall


def score(checkpoint, out_json, log_path):
    run_logged([sys.executable, os.path.join(HERE, "check_small_arith.py"), checkpoint, "--json", out_json + ".tmp"],
               log_path, {"OMP_NUM_THREADS": "2"})
    os.replace(out_json + ".tmp", out_json)


def run_one(args, system, seed, base):
    run_dir = os.path.join(args.work, system + (f"-{args.variant}" if args.variant else ""), f"s{seed}")
    done = os.path.join(run_dir, "score.json")
    if os.path.exists(done):
        return
    os.makedirs(run_dir, exist_ok=True)
    print(f"{time.strftime('%H:%M:%S')} {system} seed {seed}: training in {run_dir}", flush=True)
    if system == "ours":
        ckpt, wall = train_ours(run_dir, base, seed, args.ours_set)
    else:
        ckpt, wall = train_trl(run_dir, base, seed, train_rows_file(args.work, seed), args.trl_python, args.trl_args.split())
    score(ckpt, done.replace("score.json", "score_pending.json"), os.path.join(run_dir, "score.log"))
    with open(os.path.join(run_dir, "meta.json"), "w") as f:
        json.dump({"train_wall_s": wall, "load_after": os.getloadavg(), "finished": time.strftime("%F %T %Z"),
                   "commit": subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                                            text=True).stdout.strip()}, f)
    os.replace(done.replace("score.json", "score_pending.json"), done)
    print(f"{time.strftime('%H:%M:%S')} {system} seed {seed}: trained in {wall:.0f} s; " +
          ", ".join(f"{n} {accuracy(done, n):.3f}" for n in SETS), flush=True)


TRL_DEFAULTS = """
import json, torch, transformers
from trl import GRPOConfig
c = GRPOConfig(output_dir="/tmp/x", learning_rate=1e-5, warmup_steps=2, lr_scheduler_type="constant_with_warmup",
               max_steps=20, use_cpu=True, report_to="none")
opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=c.learning_rate)
sched = transformers.get_scheduler(c.lr_scheduler_type, opt, num_warmup_steps=c.warmup_steps, num_training_steps=20)
lrs = []
for _ in range(4):
    lrs.append(opt.param_groups[0]["lr"]); opt.step(); sched.step()
print(json.dumps({"betas": [c.adam_beta1, c.adam_beta2], "eps": c.adam_epsilon, "weight_decay": c.weight_decay,
                  "max_grad_norm": c.max_grad_norm, "optim": str(c.optim), "lr at steps 1-4": lrs,
                  "top_k": c.top_k, "top_p": c.top_p, "scale_rewards": c.scale_rewards,
                  "shuffle_dataset": c.shuffle_dataset, "mask_truncated_completions": c.mask_truncated_completions}))
"""


def defaults(trl_python):
    """The optimizer and sampling defaults each side runs the recipe with, read from each code (not from docs)."""
    import torch

    import optim
    import rollout
    o, r = optim.OptimConfig(lr=1e-5, warmup_steps=2), rollout.RolloutConfig()
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=o.lr, betas=o.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, optim.lr_lambda(o.warmup_steps, o.schedule, STEPS))
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    print("ours:", json.dumps({"betas": list(o.betas), "eps": opt.defaults["eps"], "weight_decay": o.weight_decay,
                               "max_grad_norm": o.max_grad_norm, "lr at steps 1-4": lrs, "top_k": r.top_k,
                               "top_p": r.top_p}))
    print("TRL: ", subprocess.run([trl_python, "-c", TRL_DEFAULTS], capture_output=True, text=True).stdout.strip())


TRL_ORDER = """
import json, sys
from trl.trainer.utils import RepeatSampler
n, seed, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
idx = list(RepeatSampler(range(n), mini_repeat_count=8, batch_size=4, repeat_count=1, shuffle=True, seed=seed))
print(json.dumps(idx[::8][:4 * steps]))
"""


def trained_prompts(work, seed, trl_python):
    """-> (ours, TRL): the 4 x STEPS training rows each side draws at this seed (ours: launch's data order, a
    default_rng(seed) permutation; TRL: its RepeatSampler), as indices into the seed's rows file, and the rows."""
    import numpy as np
    rows = [json.loads(line) for line in open(train_rows_file(work, seed))]
    ours = np.random.default_rng(seed).permutation(len(rows))[:4 * STEPS].tolist()
    trl = json.loads(subprocess.run([trl_python, "-c", TRL_ORDER, str(len(rows)), str(seed), str(STEPS)],
                                    capture_output=True, text=True, check=True).stdout)
    return ours, trl, rows


def prompt_order(work, seed, trl_python):
    """Print what the 4 x STEPS prompts each side trains on at this seed look like, and their overlap."""
    ours, trl, rows = trained_prompts(work, seed, trl_python)
    op = lambda i: rows[i]["prompt"][0]["content"].split()[3]  # noqa: E731 ('What is a op b?')
    for name, idx in (("ours", ours), ("TRL", trl)):
        mix = {o: sum(op(i) == o for i in idx) for o in "+-*"}
        print(f"seed {seed} {name}: {len(set(idx))} distinct of {len(idx)} prompts, operators {mix}, "
              f"mean answer {sum(abs(int(rows[i]['answer'])) for i in idx) / len(idx):.1f}")
    print(f"seed {seed}: {len(set(ours) & set(trl))} prompts in both")


def untrained_fresh(work, seeds, trl_python, fresh_seed=777):
    """The fresh 128 are drawn like training rows, so each side trained on a few of them (and 8 are held-out prompts):
    per seed, both sides' accuracy on the distinct fresh prompts that neither side trained on and that are not
    held out, and the means over seeds."""
    import tasks
    text = lambda r: r["prompt"][0]["content"]  # noqa: E731
    fresh = [text(r) for r in tasks.load_dataset_rows("small_arith", size=128, seed=fresh_seed)]
    held = {text(r) for r in tasks.load_dataset_rows("small_arith", split="test", size=64)}
    res = {"ours": [], "trl": []}
    print("| seed | fresh prompts kept | trained on (ours, TRL) | ours | TRL | ours - TRL |\n|---|---|---|---|---|---|")
    for seed in seeds:
        paths = {sy: os.path.join(work, sy, f"s{seed}", "score.json") for sy in res}
        if not all(map(os.path.exists, paths.values())):
            continue
        ours, trl, rows = trained_prompts(work, seed, trl_python)
        seen = {sy: {text(rows[i]) for i in idx} for sy, idx in (("ours", ours), ("trl", trl))}
        keep = [i for i, t in enumerate(fresh) if fresh.index(t) == i and t not in held | seen["ours"] | seen["trl"]]
        acc = {}
        for sy, path in paths.items():
            with open(path) as f:
                hits = json.load(f)["fresh 128"]["last_integer"]
            acc[sy] = sum(hits[i] for i in keep) / len(keep)
            res[sy].append(acc[sy])
        print(f"| {seed} | {len(keep)} | {sum(t in seen['ours'] for t in fresh)}, {sum(t in seen['trl'] for t in fresh)} "
              f"| {acc['ours']:.3f} | {acc['trl']:.3f} | {acc['ours'] - acc['trl']:+.3f} |")
    if len(res["ours"]) > 1:
        diffs = [o - t for o, t in zip(res["ours"], res["trl"])]
        m, se = mean_se(diffs)
        t = t95(len(diffs) - 1)
        print("| mean +- s.e. | | | %.3f +- %.3f | %.3f +- %.3f | %+.3f +- %.3f (95%%: [%+.3f, %+.3f]) |" % (
            *mean_se(res["ours"]), *mean_se(res["trl"]), m, se, m - t * se, m + t * se))


def render(work, variant=""):
    """Print the per-seed table and the means (+- standard error) of every system found in work."""
    tag = f"-{variant}" if variant else ""
    res = {}
    for system in ("ours", "trl"):
        d = os.path.join(work, system + tag)
        d = d if os.path.isdir(d) or system == "ours" else os.path.join(work, system)  # an ours-only variant: TRL's runs
        for s in sorted(os.listdir(d) if os.path.isdir(d) else []):
            if os.path.exists(os.path.join(d, s, "score.json")):
                res.setdefault(int(s[1:]), {})[system] = {n: accuracy(os.path.join(d, s, "score.json"), n) for n in SETS}
    for system, log, reward in (("ours", "metrics.jsonl", "reward/mean"), ("trl", "log.jsonl", "reward")):
        norms, r0, r1 = [], [], []
        for seed in res:
            path = os.path.join(work, system + (tag if system == "ours" or os.path.isdir(os.path.join(
                work, system + tag)) else ""), f"s{seed}", log)
            rows = [r for r in map(json.loads, open(path)) if "grad_norm" in r] if os.path.exists(path) else []
            norms += [r["grad_norm"] for r in rows]
            r0, r1 = r0 + [r[reward] for r in rows[:5]], r1 + [r[reward] for r in rows[-5:]]
        if norms:
            print(f"{system}: pre-clip grad norm mean {sum(norms) / len(norms):.3f} (max {max(norms):.3f}), "
                  f"{sum(n > 1.0 for n in norms)} of {len(norms)} steps clipped at 1.0; train reward, first/last 5 "
                  f"steps: {sum(r0) / len(r0):.3f} -> {sum(r1) / len(r1):.3f}")
    base = os.path.join(work, "base-score.json")
    print(f"| seed | {' | '.join(f'ours {n} | TRL {n} | ours - TRL' for n in SETS)} |\n|---{'|---' * 6}|")
    for seed, r in sorted(res.items()):
        cells = []
        for n in SETS:
            o, t = r.get("ours", {}).get(n), r.get("trl", {}).get(n)
            cells += [f"{o:.3f}" if o is not None else "", f"{t:.3f}" if t is not None else "",
                      f"{o - t:+.3f}" if None not in (o, t) else ""]
        print(f"| {seed} | " + " | ".join(cells) + " |")
    cells = []
    for n in SETS:
        cols = [[r[sy][n] for r in res.values() if sy in r] for sy in ("ours", "trl")]
        diffs = [r["ours"][n] - r["trl"][n] for r in res.values() if len(r) == 2]
        cells += ["%.3f +- %.3f (%d)" % (*mean_se(c), len(c)) if c else "" for c in cols]
        cells.append("%+.3f +- %.3f (%d)" % (*mean_se(diffs), len(diffs)) if diffs else "")
    print("| mean +- s.e. (n) | " + " | ".join(cells) + " |")
    for n in SETS:
        diffs = [r["ours"][n] - r["trl"][n] for r in res.values() if len(r) == 2]
        if len(diffs) > 1:
            m, se = mean_se(diffs)
            t = t95(len(diffs) - 1)
            print(f"{n}: ours - TRL {m:+.3f}, 95% interval [{m - t * se:+.3f}, {m + t * se:+.3f}] (paired over seeds, "
                  f"t {t}, {len(diffs) - 1} degrees of freedom)")
    if os.path.exists(base):
        print("base model: " + ", ".join(f"{n} {accuracy(base, n):.3f}" for n in SETS))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="/work/bench-learning", help="results folder (outside the repository)")
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2, 3, 4])
    p.add_argument("--systems", nargs="*", default=["ours", "trl"], choices=["ours", "trl"])
    p.add_argument("--variant", default="", help="a name for runs with changed settings (their own folders)")
    p.add_argument("--ours-set", nargs="*", default=[], metavar="NAME=VALUE", help="grpo.py flag overrides")
    p.add_argument("--trl-args", default="", help="extra bench/trl_driver.py arguments, e.g. --trl-args='--adam-beta2 0.99'")
    p.add_argument("--trl-python", default="/work/trl-venv/bin/python", help="TRL's virtualenv's python")
    p.add_argument("--render", action="store_true", help="only print the table from saved results")
    p.add_argument("--defaults", action="store_true", help="only print each side's optimizer/sampling defaults")
    p.add_argument("--order", action="store_true", help="only print the prompts each side trains on per seed")
    args = p.parse_args()
    if args.defaults:
        return defaults(args.trl_python)
    if args.order:
        return [prompt_order(args.work, s, args.trl_python) for s in args.seeds]
    if not args.render:
        os.makedirs(args.work, exist_ok=True)
        base = base_model(args.work)
        if not os.path.exists(os.path.join(args.work, "base-score.json")):
            score(base, os.path.join(args.work, "base-score.json"), os.path.join(args.work, "base-score.log"))
        for seed in args.seeds:
            for system in args.systems:
                run_one(args, system, seed, base)
    render(args.work, args.variant)
    if os.path.exists(args.trl_python) and not args.variant:
        untrained_fresh(args.work, args.seeds, args.trl_python)


if __name__ == "__main__":
    main()
