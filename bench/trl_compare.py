"""Step time and memory against the reference trainer (TRL's GRPOTrainer), same setting, one process, 2 threads.

    python bench/trl_compare.py --model smollm2 --steps 5     # SmolLM2-135M-Instruct, 2 prompts x 8, <= 64 tokens
    python bench/trl_compare.py --model tiny --steps 30       # builtin tiny model, default max_digit task (64 x 8)
    python bench/trl_compare.py --model smollm2 --skip-trl    # reuse the cached TRL result (<work>/trl_<model>.json)
    python bench/trl_compare.py --render results.json         # print the table of an earlier --out results.json

Runs, each in its own process with OMP_NUM_THREADS=2: (a) TRL's GRPOTrainer (transformers generate) through
bench/trl_driver.py in TRL's own virtualenv (--trl-python; never a dependency of the product), (b) grpo.py with the
vLLM engine, (c) grpo.py with the HF engine (--rollout.engine hf); then (d) a probe that runs grpo.main in this
process with RSS recorded around each setup phase and stage, for the memory breakdown of ours.
Settings: loss dapo, beta 0, num_iterations 1, temperature 1, fp32, lr 1e-6 (smollm2) / 1e-3 (tiny).
s/step = wall time between the end of step `--warmup` and the end of the last step, over the steps in between (the
first steps are warm-up: allocator growth, lazy inits; they are left out and said so). Peak RSS = the process tree's
RSS sampled from /proc at 20 Hz (and ru_maxrss of the child, which wait4 reports). RSS after each step = the tree's
RSS when that step's line appeared (ours: metrics.jsonl; TRL: the driver's steps file).
The lower bound: training FLOPs (6 x matmul params x tokens + attention, bench/roofline.update_flops; each prompt's
tokens once per group) over the all-threads fp32 matmul peak (measured now, or --peak-gflops from an idle machine: a
loaded machine's peak is no bound), plus generation (2 x params x tokens) at the same peak: no trainer on this machine
can step faster than that.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

SETTINGS = {  # the two measured settings (completions per step, G, max tokens, lr, TRL reward, step-time target x TRL)
    "smollm2": dict(dataset="arith", batch=16, G=8, max_tokens=64, lr=1e-6, reward="accuracy", target=0.5),
    "tiny": dict(dataset="max_digit", batch=64, G=8, max_tokens=8, lr=1e-3, reward="max_digit", target=1.0),
}


# ----------------------------------------------------------------------------------------------------------
# Process-tree RSS from /proc
# ----------------------------------------------------------------------------------------------------------

def tree_pids(root):
    """root and all its descendants (from /proc/<pid>/stat ppid fields)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    pids, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in pids]
        pids.update(kids)
        frontier += kids
    return pids


def rss_gb(pid):
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        return 0.0


def tree_rss_gb(root):
    return sum(rss_gb(p) for p in tree_pids(root))


def run_monitored(cmd, steps_file, env, log_path, cwd=ROOT, timeout=None):
    """Run cmd; sample its tree's RSS at 20 Hz; note time and RSS whenever steps_file gains a line.
    -> {peak_gb, maxrss_gb, step_ends: [[t, rss_gb]], rc, start, exit} (start, exit: the process's wall times)."""
    if os.path.exists(steps_file):
        os.remove(steps_file)
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    peak, ends, seen, status, usage = 0.0, [], 0, None, None
    while status is None:
        now_rss = tree_rss_gb(proc.pid)
        peak = max(peak, now_rss)
        lines = sum(1 for _ in open(steps_file)) if os.path.exists(steps_file) else 0
        for _ in range(seen, lines):
            ends.append([time.time(), now_rss])
        seen = lines
        pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            status, usage = st, ru
        elif timeout and time.time() - start > timeout:
            proc.kill()
            proc.wait()
            raise subprocess.TimeoutExpired(cmd, timeout)
        else:
            time.sleep(0.05)
    return {"peak_gb": peak, "maxrss_gb": usage.ru_maxrss / 2**20, "step_ends": ends,
            "rc": os.waitstatus_to_exitcode(status), "start": start, "exit": time.time()}


def summarise(mon, warmup, tokens):
    """s/step over the steps after `warmup`, RSS after each step, completion tokens per step (mean of timed steps);
    from the process's start to the end of step 1 (start-up + the first step), from the last step's end to its exit
    (ours: the final checkpoint; TRL's driver saves none)."""
    t = [e[0] for e in mon["step_ends"]]
    timed = len(t) - warmup
    s_step = (t[-1] - t[warmup - 1]) / timed if timed > 0 and warmup > 0 else float("nan")
    return {"s_per_step": s_step, "to_step1_s": t[0] - mon["start"], "after_last_s": mon["exit"] - t[-1],
            "peak_gb": mon["peak_gb"], "maxrss_gb": mon["maxrss_gb"],
            "rss_after_step_gb": [round(e[1], 2) for e in mon["step_ends"]],
            "tokens_per_step": sum(tokens[warmup:]) / max(1, len(tokens[warmup:])), "steps": len(t)}


# ----------------------------------------------------------------------------------------------------------
# The three runs
# ----------------------------------------------------------------------------------------------------------

def prepare(model, work):
    """-> (HF model folder, rows jsonl): the same checkpoint and prompts for every trainer."""
    import models
    import tasks
    s = SETTINGS[model]
    if model == "smollm2":
        path = models.convert_gguf_once(models.packaged_smollm2(), os.path.join(work, "converted"))
    else:
        path = os.path.join(work, "tiny")
        if not os.path.exists(os.path.join(path, "config.json")):
            models.build_tiny_model(path, seed=0)  # what --model builtin:tiny builds (seed 0)
    data = os.path.join(work, f"{s['dataset']}.jsonl")
    with open(data, "w") as f:
        for row in tasks.load_dataset_rows(s["dataset"], size=2000, seed=0):
            f.write(json.dumps(row) + "\n")
    return path, data


def env_2_threads():
    env = dict(os.environ, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false")
    env.pop("RANK", None)
    return env


def ours_flags(model, path, steps, out_dir, engine, micro_batch=None):
    s = SETTINGS[model]
    return ["--model", path, "--dataset", s["dataset"], "--output-dir", out_dir, "--overwrite",
            "--num-generations", str(s["G"]), "--batch-size", str(s["batch"]),
            "--micro-batch-size", str(micro_batch or s["batch"]),
            "--rollout.max-completion-length", str(s["max_tokens"]), "--loss.loss-type", "dapo", "--loss.beta", "0",
            "--max-steps", str(steps), "--optim.lr", str(s["lr"]), "--rollout.engine", engine,
            "--log.completions-every", "0", "--log.no-progress", "--eval.every", "0"]


def run_ours(model, path, steps, work, engine, warmup, repo=ROOT, micro_batch=None):
    out = os.path.join(work, f"ours_{engine}_{model}")
    metrics = os.path.join(out, "metrics.jsonl")
    cmd = [sys.executable, os.path.join(repo, "grpo.py"), *ours_flags(model, path, steps, out, engine, micro_batch)]
    mon = run_monitored(cmd, metrics, env_2_threads(), os.path.join(work, f"ours_{engine}_{model}.log"), repo)
    if mon["rc"] != 0:
        raise RuntimeError(f"ours ({engine}) failed: see {work}/ours_{engine}_{model}.log")
    rows = [json.loads(line) for line in open(metrics)]
    res = summarise(mon, warmup, [r["completion_len/mean"] * SETTINGS[model]["batch"] for r in rows])
    res["stage_s"] = {k[5:]: sum(r[k] for r in rows[warmup:]) / len(rows[warmup:])
                      for k in rows[0] if k.startswith("time/")}
    return res


def driver_command(python, path, data, reward, steps, G, batch, max_tokens, lr, threads, output_dir, steps_file,
                   cuda=False):
    """bench/trl_driver.py's command line (TRL's GRPOTrainer on one setting; a line per step into steps_file)."""
    return [python, "bench/trl_driver.py", "--model", path, "--data", data, "--reward", reward, "--steps", str(steps),
            "--num-generations", str(G), "--batch-size", str(batch), "--max-completion-length", str(max_tokens),
            "--lr", str(lr), "--threads", str(threads), "--output-dir", output_dir, "--steps-file", steps_file,
            *(["--cuda"] if cuda else [])]


def run_trl(model, path, data, steps, work, trl_python, warmup):
    s = SETTINGS[model]
    steps_file = os.path.join(work, f"trl_{model}_steps.jsonl")
    cmd = driver_command(trl_python, path, data, s["reward"], steps, s["G"], s["batch"], s["max_tokens"], s["lr"], 2,
                         os.path.join(work, f"trl_{model}"), steps_file)
    mon = run_monitored(cmd, steps_file, env_2_threads(), os.path.join(work, f"trl_{model}.log"))
    if mon["rc"] != 0:
        raise RuntimeError(f"TRL failed: see {work}/trl_{model}.log")
    last = json.loads(open(steps_file).read().splitlines()[-1])
    mon["step_ends"] = mon["step_ends"][:steps]  # the driver's final summary line is not a step
    return summarise(mon, warmup, [x * last["batch_size"] for x in last["completion_len"]])


# ----------------------------------------------------------------------------------------------------------
# Memory breakdown of ours: grpo.main in this process, RSS recorded around each setup phase and stage
# ----------------------------------------------------------------------------------------------------------

class PeakSampler(threading.Thread):
    """This process's RSS at 100 Hz; .peak is the highest since the last .reset()."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = 0.0

    def reset(self):
        self.peak = rss_gb(os.getpid())

    def run(self):
        while True:
            self.peak = max(self.peak, rss_gb(os.getpid()))
            time.sleep(0.01)


def tensor_gb(tensors):
    """GB of distinct storage (tied weights, e.g. an lm head that is the embedding, count once)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # FSDP2's DTensors: this rank's shard
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}
    return sum(seen.values()) / 2**30


def probe(model, path, engine, steps, out_json):
    """Run grpo.main with RSS wrappers around build_policy, build_engine and each stage; write the records."""
    import torch
    import tyro

    import grpo
    import launch
    import optim
    if engine == "vllm":
        import vllm  # noqa: F401 (its import cost belongs to "libraries")
    sampler, rec = PeakSampler(), {"libraries_gb": rss_gb(os.getpid()), "stages": [], "computed": {}}
    sampler.start()

    def wrap(mod, name, label):
        fn = getattr(mod, name)

        def recorded(*a, **k):
            before = rss_gb(os.getpid())
            sampler.reset()
            out = fn(*a, **k)
            rec["stages"].append([label, before, sampler.peak, rss_gb(os.getpid())])
            if name == "setup":
                rec["computed"].update(computed_sizes(out, engine))
            if name == "optimizer_step" and "adamw_states_gb" not in rec["computed"]:
                rec["computed"]["adamw_states_gb"] = tensor_gb(
                    [v for s in a[1].state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0])
            return out
        setattr(mod, name, recorded)

    for mod, name, label in [(grpo, "setup", "setup"), (launch, "build_policy", "policy"),
                             (launch, "build_engine", "engine"), (grpo, "sync_weights", "sync"),
                             (grpo, "generate", "generate"), (grpo, "accumulate_gradients", "forward+backward"),
                             (optim, "optimizer_step", "optimizer step"), (grpo, "log_step", "step end")]:
        wrap(mod, name, label)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    cfg = tyro.cli(grpo.Config, args=ours_flags(model, path, steps, tempfile.mkdtemp(), engine))
    grpo.main(cfg)
    with open(out_json, "w") as f:
        json.dump(rec, f)


def computed_sizes(run, engine):
    """Bytes from tensor sizes (labelled 'computed' in the table): params, grads (= trainable params), engine weights."""
    import torch
    params = [p for p in run.module.parameters()]
    out = {"params_gb": tensor_gb(params), "grads_gb": tensor_gb([p for p in params if p.requires_grad])}
    if engine == "vllm":  # the CPU backend repacks linear weights into oneDNN handles that no state_dict shows:
        # count one copy of the policy in the engine dtype
        out["engine_weights_gb"] = out["params_gb"] * torch.finfo(run.precision["compute"]).bits / 32
        out["kv_cache_gb"] = float(run.cfg.vllm.kv_cache_gb)
    else:
        out["engine_weights_gb"] = tensor_gb(run.engine.model.state_dict().values())
    return out


def breakdown_rows(rec):
    """-> [(component, computed GB or None, measured GB)] from the probe's records. Measured = RSS deltas around a
    setup phase or stage (so a phase's number includes what its own code allocated around the tensors)."""
    by = {}
    for label, before, peak, after in rec["stages"]:
        by.setdefault(label, []).append((before, peak, after))
    c = rec["computed"]
    pol, eng, sync1, fb = by["policy"][0], by["engine"][0], by["sync"][0], by["forward+backward"]
    ends = [after for _, _, after in by["step end"]]
    engine_computed = c["engine_weights_gb"] + c.get("kv_cache_gb", 0)
    engine_measured = eng[2] - eng[0] + sync1[2] - sync1[0]  # the HF engine's weights are memory-mapped from the
    # checkpoint until the first sync writes them, so its RSS arrives there
    return [("python + torch/transformers(/vllm) imports", None, rec["libraries_gb"]),
            ("policy params (load + FSDP2 wrap)", c["params_gb"], pol[2] - pol[0]),
            ("engine total (weights + KV cache + runtime; build + first sync)", engine_computed, engine_measured),
            ("  engine weights (one copy in the engine dtype)", c["engine_weights_gb"], None),
            ("  KV cache (--vllm.kv-cache-gb)", c.get("kv_cache_gb"), None),
            ("  engine runtime/other (measured - computed)", None, engine_measured - engine_computed),
            ("AdamW states (+ what step 1 keeps: RSS after step 1 - after its sync)", c.get("adamw_states_gb"),
             ends[0] - sync1[2]),
            ("generation transient (peak - before, max over steps)", None,
             max(p - b for b, p, _ in by["generate"])),
            ("activations + grads (fwd+bwd peak - before, max over steps)", c["grads_gb"],
             max(p - b for b, p, _ in fb)),
            ("freed but still mapped after backward (malloc_trim returns it)", None,
             max(a - b for b, _, a in fb) - c["grads_gb"]),
            ("RSS after each step", None, [round(x, 2) for x in ends]),
            ("peak RSS of the probe", None, max(p for v in by.values() for _, p, _ in v))]


# ----------------------------------------------------------------------------------------------------------
# Lower bound, table, main
# ----------------------------------------------------------------------------------------------------------

def lower_bound_s(model, path, data, gen_tokens, peak_gflops=None):
    """FLOPs of one step / the measured all-threads fp32 matmul peak -> (seconds, peak GFLOP/s, GFLOP)."""
    import torch

    import models
    import tasks
    from bench.roofline import matmul_peak, update_flops
    s = SETTINGS[model]
    policy, tok = models.load_policy(path)
    rows = [json.loads(line) for line in open(data)][:64]
    prompt = sum(len(tasks.encode_prompt(r, tok, 128)["prompt_ids"]) for r in rows) / len(rows)  # mean prompt tokens
    completion = gen_tokens / s["batch"]
    groups = s["batch"] // s["G"]
    tokens = groups * prompt + gen_tokens  # each prompt once per group: the least any trainer runs (--policy.share-prompts)
    cfg = models.text_config(policy.config)
    train = update_flops(policy, tokens, (prompt + completion) / 2) - 6 * cfg.vocab_size * cfg.hidden_size * (
        groups * prompt)  # the fused head runs on completion positions only
    matmul_params = sum(p.numel() for p in policy.parameters() if p.dim() == 2)
    generate = 2 * matmul_params * (s["batch"] // s["G"] * prompt + gen_tokens)  # each prompt prefilled once
    peak = (peak_gflops or matmul_peak(torch.get_num_threads())) * 1e9
    return (train + generate) / peak, peak / 1e9, (train + generate) / 1e9


def print_rounds(rounds):
    """s/step of every round and each of ours against the same round's TRL; the median ratio last."""
    if len(rounds) < 2 or "trl" not in rounds[0]:
        return
    names = list(rounds[0])
    print(f"\n{len(rounds)} rounds, s/step (x the same round's TRL):")
    for i, runs in enumerate(rounds):
        print(f"  round {i + 1}: " + ", ".join(f"{n} {runs[n]['s_per_step']:.3f}" + (
            f" ({runs[n]['s_per_step'] / runs['trl']['s_per_step']:.2f}x)" if n != "trl" else "") for n in names))
    print("  median x TRL: " + ", ".join(
        f"{n} {statistics.median(r[n]['s_per_step'] / r['trl']['s_per_step'] for r in rounds):.2f}"
        for n in names if n != "trl"))


def print_table(res):
    trl = res["runs"].get("trl")
    print(f"\nmachine: {res['machine']}   load average (1 min) at start/end: {res['load_start']:.1f} / {res['load_end']:.1f}")
    print(f"setting: --model {res['model']}, {res['setting']}; {res['steps']} steps, the first {res['warmup']} "
          "left out as warm-up")
    head = f"{'trainer':>14} | {'s/step':>7} | {'x TRL':>6} | {'to step 1 s':>11} | {'exit s':>6} | " \
           f"{'peak RSS GB':>11} | {'ru_maxrss':>9} | {'gen tok/step':>12} | RSS after each step (GB)"
    print(head + "\n" + "-" * len(head))
    for name, r in res["runs"].items():
        ratio = f"{r['s_per_step'] / trl['s_per_step']:6.2f}" if trl else f"{'-':>6}"
        print(f"{name:>14} | {r['s_per_step']:7.3f} | {ratio} | {r.get('to_step1_s', float('nan')):11.1f} | "
              f"{r.get('after_last_s', float('nan')):6.1f} | {r['peak_gb']:11.2f} | {r['maxrss_gb']:9.2f} | "
              f"{r['tokens_per_step']:12.0f} | {r['rss_after_step_gb']}")
    print("to step 1: from the process's start to the end of the first step (start-up + step 1); exit: from the last "
          "step's end to the process's exit (ours: the final checkpoint; TRL's driver saves none)")
    for name, r in res["runs"].items():
        if "stage_s" in r:
            print(f"{name} stage seconds (mean of timed steps): " +
                  ", ".join(f"{k} {v:.3f}" for k, v in r["stage_s"].items()))
    print_rounds(res.get("rounds", []))
    lb, target = res["lower_bound"], SETTINGS[res["model"]]["target"]
    print(f"lower bound: {lb['gflop']:.0f} GFLOP per step (train fwd+bwd + generation) / {lb['peak_gflops']:.0f} GFLOP/s "
          f"measured fp32 matmul peak = {lb['s']:.3f} s/step" + (
              f"; target {target} x TRL = {target * trl['s_per_step']:.3f} s/step is "
              f"{'BELOW' if target * trl['s_per_step'] < lb['s'] else 'above'} it" if trl else ""))
    for engine, rows in res.get("breakdown", {}).items():
        print(f"\nmemory breakdown, ours ({engine}): GB; 'computed' = from tensor sizes, 'measured' = RSS deltas")
        print(f"{'component':<66} | {'computed':>8} | measured")
        for name, comp, meas in rows:
            comp = f"{comp:8.3f}" if comp is not None else f"{'':>8}"
            meas = f"{meas:.3f}" if isinstance(meas, float) else ("" if meas is None else str(meas))
            print(f"{name:<66} | {comp} | {meas}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=sorted(SETTINGS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="steps left out of s/step (>= 1)")
    ap.add_argument("--skip-trl", action="store_true", help="reuse <work>/trl_<model>.json from an earlier run")
    ap.add_argument("--engines", nargs="+", default=["vllm", "hf"])
    ap.add_argument("--rounds", type=int, default=1, help="run the whole sequence (TRL, then ours) this many times; "
                    "the table adds each round's ratios and their median (this VM's speed drifts between runs; with --skip-trl "
                    "every round compares with the one cached TRL run)")
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--micro-batch-size", type=int, default=None, help="ours: completions per forward/backward "
                    "(default: the whole batch, as TRL's driver; the gradient does not depend on it)")
    ap.add_argument("--peak-gflops", type=float, default=None, help="the machine's fp32 matmul peak on 2 threads for "
                    "the lower bound (default: measured now; on a loaded machine pass the unloaded bench/roofline.py value)")
    ap.add_argument("--trl-python", default="/work/trl-venv/bin/python")
    ap.add_argument("--work", default="/tmp/trl_compare")
    ap.add_argument("--out", default=None, help="write the results as json here")
    ap.add_argument("--repo", default=ROOT, help="run grpo.py from this checkout (e.g. an older commit, for before/after)")
    ap.add_argument("--render", default=None, help="print the table of an earlier --out json (no runs)")
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # internal: ENGINE,PATH,OUT_JSON
    args = ap.parse_args()
    if args.probe:
        sys.path.insert(0, args.repo)
        engine, path, out = args.probe.split(",")
        return probe(args.model, path, engine, min(args.steps, 3), out)
    if args.render:
        return print_table(json.load(open(args.render)))
    os.makedirs(args.work, exist_ok=True)
    path, data = prepare(args.model, args.work)
    s = SETTINGS[args.model]
    res = {"model": args.model, "steps": args.steps, "warmup": args.warmup, "runs": {},
           "machine": f"{os.cpu_count()}-core CPU, OMP_NUM_THREADS=2, 1 process",
           "setting": f"{s['batch'] // s['G']} prompts x {s['G']} completions, <= {s['max_tokens']} tokens, "
                      f"{s['dataset']}, dapo, beta 0, fp32", "load_start": os.getloadavg()[0]}
    cached = os.path.join(args.work, f"trl_{args.model}.json")
    res["rounds"] = []
    for _ in range(args.rounds):  # TRL then ours, again: each ratio compares runs minutes apart, not a whole bench
        runs = {}
        if args.skip_trl and os.path.exists(cached):
            runs["trl"] = json.load(open(cached))
        elif not args.skip_trl:
            runs["trl"] = run_trl(args.model, path, data, args.steps, args.work, args.trl_python, args.warmup)
            json.dump(runs["trl"], open(cached, "w"))
        for engine in args.engines:
            runs[f"ours ({engine})"] = run_ours(args.model, path, args.steps, args.work, engine, args.warmup,
                                                args.repo, args.micro_batch_size)
        res["rounds"].append(runs)
    res["runs"] = res["rounds"][0]
    gen = next(r["tokens_per_step"] for k, r in res["runs"].items() if k.startswith("ours"))
    lb_s, peak, gflop = lower_bound_s(args.model, path, data, gen, args.peak_gflops)
    res["lower_bound"] = {"s": lb_s, "peak_gflops": peak, "gflop": gflop}
    if not args.no_breakdown:
        res["breakdown"] = {}
        for engine in args.engines:
            out = os.path.join(args.work, f"probe_{engine}.json")
            log = os.path.join(args.work, f"probe_{engine}.log")
            with open(log, "w") as f:
                done = subprocess.run([sys.executable, __file__, "--model", args.model, "--steps", "3", "--repo",
                                       args.repo, "--probe", f"{engine},{path},{out}"], env=env_2_threads(),
                                      cwd=args.repo, stdout=f, stderr=subprocess.STDOUT)
            if done.returncode:
                raise RuntimeError(f"memory probe ({engine}) failed: see {log}")
            res["breakdown"][engine] = breakdown_rows(json.load(open(out)))
    res["load_end"] = os.getloadavg()[0]
    print_table(res)
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
