"""One command for the first GPU: the recipe's parts, run for real, in a table with pass/fail against targets.

    python bench/gpu_check.py            # CUDA: a random Qwen2 at Qwen2.5-0.5B's sizes (V = 151,936), built offline
    python bench/gpu_check.py --small    # the reduced form (tiny sizes, ~1 min on 2 CPU cores): what CI runs;
                                         # the default on a machine without CUDA

Rows: grpo.py for 3 steps with FSDP2 + bf16 compute (fp32 master weights) + the colocated vLLM engine (sleep mode on
CUDA), then the same with the HF engine: steps done, engine/trainer log-prob mismatch per step, peak memory per phase
(sync, generate, old/ref log-probs, update), the update's model FLOP utilisation (bench/roofline.update_flops over
the measured bf16 matmul peak of this device) and its top operations from torch.profiler (step 2, left out of the
MFU); the update on completions of 8..256 tokens with --micro-batch-size alone vs --micro-batch-tokens (tokens
run per completion token, seconds); fused vs naive log-probs at the model's vocabulary (bench/logprobs.py: N=8192
and 32768 on CUDA) and the fused head against float64; a LoRA step; 2 steps of flow_grpo.py on its tiny pipeline; a
side by side with TRL's GRPOTrainer when `trl` is importable (bench/trl_driver.py; both HF generate, max_digit
prompts, 64 completions (8 x 8) of 128 tokens, dapo, beta 0, one micro-batch of 64; 4 steps, s/step over steps 2-4);
the HF engine's decode against transformers' generate as TRL calls it, and with a static KV cache (compiled on CUDA).
Each run is its own process, so its peaks are its own. Exit status 1 when a row fails.
"""
import argparse
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import torch  # noqa: E402

# (CUDA target, reduced-form target); None = reported, not judged. Why each: the mismatch bound is a tenth of
# --rollout.max-mismatch (bf16 on both sides measured ~1e-3 nats mean on CPU, on a random model whose logits are
# near uniform: a real checkpoint measures more, ~4e-2 on SmolLM2, so this row judges the plumbing, not bf16 drift);
# memory must leave 10% of the device free; an update under 10% MFU on a 0.5B model is launch-bound; the fused head
# must hold at most a quarter of the naive [N, V] logits' extra memory, at most its time. On 2 shared CPU cores at
# tiny sizes, peak RSS and milliseconds are noise (bench/logprobs.py measures the CPU sizes that mean something).
# The fused head's error bounds: bench/logprobs.py --precision measured 1.4e-6 nats with fp32-written logits (1.7e-2
# when they are rounded to bf16) and 1.6e-3 relative weight-gradient error from the one bf16 rounding of dL/dz.
TARGETS = {"mismatch": (1e-2, 1e-2), "mem_frac": (0.9, None), "mfu": (0.10, None), "fused_mem": (0.25, None),
           "fused_time": (1.0, None), "fused_logp_err": (1e-3, 1e-3), "fused_grad_err": (1e-2, 1e-2),
           "generate": (1.0, None)}
SIZES = {  # Qwen2.5-0.5B's shape (494M parameters, tied head) vs a tiny one
    "full": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936),
    "small": dict(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, vocab=4096)}
PHASES = ("sync_weights", "generate", "old_and_ref_logps", "update")


def varied_reward(prompts, completions, **_):
    """A reward that differs within every group (a hash of the text in [0, 1)): a random model scores 0 on any real
    task, every advantage is then 0 and the update runs forward only (idle rows), so its MFU would count work never
    done. The 2026-11-27 H100 run measured exactly that (update 9.7% "MFU" with every row idle)."""
    import zlib
    return [zlib.crc32(str(c).encode()) / 2**32 for c in completions]


def build_qwen2(path, *, hidden, layers, heads, kv_heads, intermediate, vocab, seed=0):
    """A random Qwen2 saved offline at this shape (models.build_tiny_model's tokenizer padded up to `vocab`)."""
    import models
    return models.build_tiny_model(path, seed=seed, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                                   intermediate=intermediate, vocab=vocab, max_positions=4096)


def seconds(fn, cuda):
    """Wall time of fn(), the device's queue drained before and after (CUDA runs asynchronously)."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def matmul_peak(device, dtype, n):
    """Best TFLOP/s of an n x n x n matmul in `dtype` on `device` (all threads), best of 5."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    best = min(seconds(lambda: a @ b, device == "cuda") for _ in range(6))
    return 2 * n ** 3 / best / 1e12


def _peak_reset(cuda):
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the kernel's peak RSS restarts from the current RSS


def _peak_gb(cuda):
    if cuda:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()  # vLLM's pool is outside torch's allocator: count the device's use
        return max(torch.cuda.max_memory_allocated() / 2**30, (total - free) / 2**30)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20


def child(out_json, flags):
    """Run grpo.main in this process with each phase timed and its peak memory taken; write them as JSON."""
    import tyro
    from roofline import update_flops

    import console
    import grpo
    cuda, rec = torch.cuda.is_available(), {p: [] for p in PHASES}
    rec["update_gflop"] = []

    def timed(name, fn):
        def wrapped(*a, **k):
            _peak_reset(cuda)
            profiled = name == "update" and len(rec[name]) == 1  # step 2: warm, and left out of the MFU
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if cuda else [])) if profiled else None
            t0 = time.perf_counter()
            if prof:
                with prof:
                    out = fn(*a, **k)
                wall = time.perf_counter() - t0
                rec["profile" if name == "update" else "generate_profile"] = top_ops(prof, cuda)
                rec[name + "_device_busy"] = device_busy(prof, wall) if cuda else None
                with open(f"{out_json}.{name}.txt", "w") as f:  # the whole table, for a reader of the work dir
                    f.write(prof.key_averages().table(sort_by="self_device_time_total" if cuda else
                                                      "self_cpu_time_total", row_limit=40, max_name_column_width=60))
            else:
                out = fn(*a, **k)
            gb = _peak_gb(cuda)  # (synchronises CUDA first: the time includes the queued kernels)
            rec[name].append({"s": time.perf_counter() - t0, "gb": gb, "profiled": profiled})
            if name == "update":  # model FLOPs: each prompt once per group (shared), every completion token
                run, batch = a[0], a[1]
                s, G = batch.samples, run.cfg.num_generations
                tokens = sum(len(x["prompt_ids"]) for x in s[::G]) + sum(len(x["completion_ids"]) for x in s)
                ctx = sum(len(x["prompt_ids"]) + len(x["completion_ids"]) for x in s) / len(s) / 2
                rec["update_gflop"].append(run.cfg.num_iterations * update_flops(run.policy, tokens, ctx) / 1e9)
            return out
        return wrapped

    for p in PHASES:
        setattr(grpo, p, timed(p, getattr(grpo, p)))
    console.run_script(grpo.main, tyro.cli(grpo.Config, args=flags))
    with open(out_json, "w") as f:
        json.dump(rec, f)


def device_busy(prof, wall):
    """Share of the wall time the GPU spent in kernels (all kernels' self device time / wall): well under 1 means the
    host (Python, launches, syncs) bounds the phase, not the device."""
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e6 / wall


def top_ops(prof, cuda, k=6):
    """[[op, ms, share]]: the k operations with the most self time (device time on CUDA), share of all self time."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    ops = [(e.key, getattr(e, key)) for e in prof.key_averages()]
    total = sum(t for _, t in ops) or 1
    return [[name, t / 1e3, t / total] for name, t in sorted(ops, key=lambda x: -x[1])[:k]]


def run_grpo(work, name, model, flags, timeout):
    """grpo.py in a child process -> (metrics rows, phase records, seconds); raises with the output's tail on failure."""
    out, rec = os.path.join(work, name), os.path.join(work, name + ".json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", rec, "--", "--model", model, "--output-dir", out,
           "--log.completions-every", "0", "--log.no-progress", "--eval.every", "0", *flags]
    return _metrics(out, cmd, timeout), json.load(open(rec))


def _metrics(out, cmd, timeout):
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def bound(target, sign="<="):
    return f"{sign} {target:g}" if target is not None else "-"


def judge(value, target, better="below"):
    if target is None:
        return "-"
    return "pass" if (value <= target if better == "below" else value >= target) else "FAIL"


def grpo_rows(engine, metrics, rec, peak_tflops, total_gb, k, steps):
    """Table rows of one grpo.py run: steps, mismatch per step, peak memory per phase, the update's MFU."""
    losses_ok = len(metrics) == steps and all(abs(r["loss"]) < float("inf") for r in metrics)
    rows = [(f"grpo.py {engine}: steps done, finite loss", f"{len(metrics)}/{steps}", f"{steps}/{steps}",
             "pass" if losses_ok else "FAIL")]
    mism = [r["logprob_mismatch/mean_abs"] for r in metrics]
    rows.append((f"{engine}: engine/trainer mismatch per step (nats)", " ".join(f"{m:.1e}" for m in mism),
                 bound(TARGETS["mismatch"][k]), judge(max(mism, default=float("inf")), TARGETS["mismatch"][k])))
    gb = {p: max(x["gb"] for x in rec[p]) for p in PHASES if rec[p]}
    limit = TARGETS["mem_frac"][k] * total_gb if TARGETS["mem_frac"][k] and total_gb else None
    rows.append((f"{engine}: peak memory GB sync/gen/logps/update", " / ".join(f"{gb.get(p, 0):.2f}" for p in PHASES),
                 f"<= {limit:.1f}" if limit else "-", judge(max(gb.values()), limit)))
    timed = [i for i, x in enumerate(rec["update"]) if i > 0 and not x.get("profiled")]  # step 1 warms up
    timed = timed or list(range(len(rec["update"])))
    secs, gflop = sum(rec["update"][i]["s"] for i in timed), sum(rec["update_gflop"][i] for i in timed)
    mfu = gflop / 1e3 / secs / peak_tflops
    idle = max(metrics[i].get("frac_zero_std/in_loss", 0.0) for i in timed) if len(metrics) == steps else 1.0
    rows.append((f"{engine}: update MFU (model FLOPs / bf16 peak)", f"{mfu:.1%} ({gflop / secs / 1e3:.0f} TFLOP/s)"
                 + (f"; {idle:.0%} of groups idle (forward only): not a trained-token MFU" if idle else ""),
                 f">= {TARGETS['mfu'][k]:.0%}" if TARGETS["mfu"][k] else "-",
                 judge(mfu, TARGETS["mfu"][k], "above") if not idle else "FAIL"))
    gen = [x["s"] for i, x in enumerate(rec["generate"]) if i > 0 and not x.get("profiled")]
    if gen:
        rows.append((f"{engine}: generate s (steps 2+, unprofiled)", " ".join(f"{g:.2f}" for g in gen), "-", "-"))
    for phase, key in (("update", "profile"), ("generate", "generate_profile")):
        if rec.get(key):
            ops = ", ".join(f"{n} {s:.0%}" for n, _, s in rec[key])
            busy = rec.get(phase + "_device_busy")
            busy = f"; device busy {busy:.0%} of wall" if busy is not None else ""
            rows.append((f"{engine}: {phase} top ops (profiler, step 2, share of self time)", ops + busy, "-", "-"))
    return rows


def ceiling_rows(model_path, peak_tflops, cuda, n=32, prompt=30, completion=256, repeats=3):
    """What bounds the update: forward + backward of the bare bf16 model (no FSDP, no loss, no optimizer) on the update's
    token shape, through TokenLogprobs (the fused head), one sample per row and prompt-sharing rows, and through the
    model's own logits + log_softmax (naive). -> rows of MFU."""
    from roofline import update_flops

    import models
    from token_logprobs import TokenLogprobs, collate, pair_cost
    dev = "cuda" if cuda else "cpu"
    model, _ = models.load_policy(model_path, dtype=torch.bfloat16)
    model.to(dev).train()
    module, g = TokenLogprobs(model), torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    samples = [{"prompt_ids": torch.randint(0, V, (prompt,), generator=g).tolist(),
                "completion_ids": torch.randint(0, V, (completion,), generator=g).tolist()} for _ in range(n // 8)]
    samples = [dict(prompt_ids=s["prompt_ids"], completion_ids=torch.randint(0, V, (completion,), generator=g).tolist())
               for s in samples for _ in range(8)]
    gflop = update_flops(model, n // 8 * prompt + n * completion, (prompt + completion) / 2) / 1e9

    def naive(b):
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
        return out.logits[:, :-1].float().log_softmax(-1).gather(-1, b["input_ids"][:, 1:, None]).sum()

    rows = []
    for name, fn, pc in (("fused head, a row per sample", lambda b: module(b, 1.0)[0].sum(), 0.0),
                         ("fused head, prompt-sharing rows", lambda b: module(b, 1.0)[0].sum(), pair_cost(model.config)),
                         ("naive logits", naive, 0.0)):
        b = collate(samples, 0, dev, completion, pair_cost=pc)
        times = []
        for _ in range(repeats + 1):
            times.append(seconds(lambda: fn(b).backward(), cuda))
            model.zero_grad(set_to_none=True)
        s = min(times[1:])
        rows.append((f"bare bf16 model fwd+bwd, {n} x {completion} tokens, {name}",
                     f"{gflop / 1e3 / s / peak_tflops:.1%} MFU ({s * 1e3:.0f} ms)", "-", "-"))
    del model, module
    if cuda:
        torch.cuda.empty_cache()
    return rows


def packing_rows(model_path, cuda, n, prompt, longest, mbs, repeats):
    """The update (grpo.accumulate_gradients, one process) on n completions of 8..longest tokens (uniform; groups of 8
    share a prompt), cut as --micro-batch-size mbs (each pass padded to its longest row) vs --micro-batch-size n
    --micro-batch-tokens mbs x (prompt + longest) (the same largest pass; rows sorted by length, as many as fit), with
    one row per sample and with shared prompts: tokens run (prompts and padding included) per completion token, and
    seconds per update (the settings take turns; the fastest of `repeats` after one warm-up)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    import batching
    import grpo
    import losses
    import models
    from token_logprobs import TokenLogprobs, layout, pair_cost
    dev = torch.device("cuda" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    model, _ = models.load_policy(model_path, dtype=torch.bfloat16 if cuda else torch.float32)
    model.to(dev).train()
    g, V = torch.Generator().manual_seed(0), model.config.vocab_size
    samples = [{"prompt_ids": p, "completion_ids": torch.randint(0, V, (int(torch.randint(8, longest + 1, (),
                generator=g)),), generator=g).tolist()} for _ in range(n // 8)
               for p in [torch.randint(0, V, (prompt,), generator=g).tolist()] for _ in range(8)]
    for s in samples:
        s.update(engine_logps=[-1.0] * len(s["completion_ids"]), truncated=False)
    batch = batching.build_batch(samples, False, dev)
    batch.advantages = torch.randn(n, generator=g).to(dev)
    rollout = SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0, max_completion_length=longest)
    settings = itertools.product(({}, {"pair_cost": pair_cost(model.config)}), (0, mbs * (prompt + longest)))
    runs = [SimpleNamespace(cfg=SimpleNamespace(micro_batch_size=n if budget else mbs, micro_batch_tokens=budget,
                                                rollout=rollout), device=dev, world=1, packing=packing,
                            module=TokenLogprobs(model), processor=SimpleNamespace(pad_token_id=0))
            for packing, budget in settings]
    times = [[] for _ in runs]
    for _ in range(repeats + 1):
        for run, t in zip(runs, times):
            t.append(seconds(lambda: grpo.accumulate_gradients(run, batch, torch.arange(n),
                                                               losses.LossConfig(loss_type="dapo")), cuda))
            model.zero_grad(set_to_none=True)
    rows, trained = [], batch.mask.sum().item()
    for run, t in zip(runs, times):
        c, pk = run.cfg, run.packing
        plan = batching.micro_batch_plan(torch.arange(n), None, c.micro_batch_size, dev, c.micro_batch_tokens,
                                         samples, pk)
        padded = sum(len(r) * L for r, L in (layout([samples[i] for i in mb.tolist()], **pk) for mb, _ in plan))
        name = (f"--micro-batch-size {c.micro_batch_size}" + (f" --micro-batch-tokens {c.micro_batch_tokens}"
                if c.micro_batch_tokens else "") + (", shared prompts" if pk else ", a row per sample"))
        rows.append((f"update, {n} completions of 8..{longest} tokens, {name}",
                     f"{padded / trained:.2f} tokens run per completion token, {len(plan)} passes, "
                     f"{min(t[1:]):.2f} s", "-", "-"))
    dist.destroy_process_group()
    del model, runs
    if cuda:
        torch.cuda.empty_cache()
    return rows


def logprob_rows(cuda, k, size):
    """Fused vs naive log-probs, forward + backward, at the model's vocabulary (bench/logprobs.py's measurement)."""
    from types import SimpleNamespace

    import logprobs
    sizes = [(n, dt) for n, _, _, dt in logprobs.GPU_SIZES] if cuda else [(1024, "float32")]
    args, rows = SimpleNamespace(device="cuda" if cuda else "cpu", repeats=3), []
    kinds = ("naive", "fused", "logits recomputed (4 mm)") if cuda else ("naive", "fused")  # fused: p kept if it fits
    for n, dt in sizes:
        res = {kind: logprobs.one(args, None, kind, n, size["hidden"], size["vocab"], dt) for kind in kinds}
        nv, fv, rv = res["naive"], res["fused"], res.get("logits recomputed (4 mm)")
        where = f"N={n} H={size['hidden']} V={size['vocab']} {dt}"
        if not nv or not fv:
            rows.append((f"fused vs naive log-probs {where}", f"naive {nv} fused {fv}", "both run",
                         "FAIL" if not fv else "pass"))
            continue
        mem, tim = fv["extra_gb"] / max(nv["extra_gb"], 1e-9), fv["time_s"] / nv["time_s"]
        rows += [(f"fused/naive extra memory, {where}", f"{mem:.2f} ({fv['extra_gb']:.2f} / {nv['extra_gb']:.2f} GB)",
                  bound(TARGETS["fused_mem"][k]), judge(mem, TARGETS["fused_mem"][k])),
                 (f"fused/naive time, {where}", f"{tim:.2f} ({fv['time_s'] * 1e3:.0f} / {nv['time_s'] * 1e3:.0f} ms)",
                  bound(TARGETS["fused_time"][k]), judge(tim, TARGETS["fused_time"][k]))]
        if rv:  # the other mode, for the record: the backward recomputes the logits (what runs when p does not fit)
            rows.append((f"fused, logits recomputed / naive, {where}", f"time {rv['time_s'] / nv['time_s']:.2f}, "
                         f"memory {rv['extra_gb'] / max(nv['extra_gb'], 1e-9):.2f}", "-", "-"))
    return rows + fused_exactness_rows("cuda" if cuda else "cpu", k, size)


def fused_exactness_rows(device, k, size, n=512):
    """The fused head on bf16 inputs against float64 from the same values (log p and the weight gradient)."""
    from losses import fused_linear_logprobs
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(n, size["hidden"], generator=g, device=device).bfloat16().requires_grad_()
    w = (torch.randn(size["vocab"], size["hidden"], generator=g, device=device) * 3 / size["hidden"] ** 0.5).bfloat16()
    w.requires_grad_()
    t = torch.randint(0, size["vocab"], (n,), generator=g, device=device)
    up = torch.randn(n, generator=g, device=device)
    lp, _ = fused_linear_logprobs(h, w, t, keep_probs=None)  # the trainer's head
    (lp * up).sum().backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = (h64 @ w64.T).log_softmax(-1).gather(-1, t[:, None]).squeeze(-1)
    (ref * up.double()).sum().backward()
    err = (lp.double() - ref).abs().max().item()
    gerr = ((w.grad.double() - w64.grad).norm() / w64.grad.norm()).item()
    where = f"N={n} V={size['vocab']} bf16 vs float64"
    return [(f"fused log p max |error|, {where}", f"{err:.1e} nats", bound(TARGETS["fused_logp_err"][k]),
             judge(err, TARGETS["fused_logp_err"][k])),
            (f"fused weight-gradient relative error, {where}", f"{gerr:.1e}", bound(TARGETS["fused_grad_err"][k]),
             judge(gerr, TARGETS["fused_grad_err"][k]))]


def trl_rows(cuda, work, model, left, extra=()):
    """Ours vs TRL's GRPOTrainer on one setting, both with HF generate; "TRL not installed: skipped" without trl.
    Wall times of each step's end (bench/trl_compare.run_monitored): s/step over steps 2-4, start-up + step 1, and
    apart what follows the last step (ours: the final checkpoint; TRL's driver saves none).
    bf16 on CUDA, fp32 on CPU (as TRL's driver runs there); `extra`: more flags for ours (--ours-flags)."""
    if importlib.util.find_spec("trl") is None:
        return [("TRL side by side (s/step, steps 2-4)", "TRL not installed: skipped", "-", "-")]
    import tasks
    from trl_compare import driver_command, run_monitored, summarise
    batch, G, tokens, steps = (64, 8, 128, 4) if cuda else (8, 4, 8, 3)
    data = os.path.join(work, "max_digit.jsonl")
    with open(data, "w") as f:
        for row in tasks.load_dataset_rows("max_digit", size=2000, seed=0):
            f.write(json.dumps(row) + "\n")
    ours, steps_file = os.path.join(work, "ours_vs_trl"), os.path.join(work, "trl_steps.jsonl")
    runs = {"ours": ([sys.executable, "grpo.py", "--model", model, "--output-dir", ours, "--dataset", "max_digit",
                      "--rollout.engine", "hf", "--batch-size", str(batch), "--num-generations", str(G),
                      "--micro-batch-size", str(batch), "--rollout.max-completion-length", str(tokens),
                      "--loss.loss-type", "dapo", "--loss.beta", "0", "--max-steps", str(steps), "--optim.lr", "1e-6",
                      "--policy.dtype", "bfloat16" if cuda else "float32", "--log.completions-every", "0",
                      "--log.no-progress", "--eval.every", "0", *extra], os.path.join(ours, "metrics.jsonl")),
            "TRL": (driver_command(sys.executable, model, data, "max_digit", steps, G, batch, tokens, "1e-6",
                                   os.cpu_count(), os.path.join(work, "trl"), steps_file, cuda), steps_file)}
    res = {}
    for name, (cmd, lines) in runs.items():
        log = os.path.join(work, f"{name}_vs.log")
        mon = run_monitored(cmd, lines, dict(os.environ), log, timeout=left())
        mon["step_ends"] = mon["step_ends"][:steps]  # (the driver's last line is its summary, not a step)
        if mon["rc"] != 0 or len(mon["step_ends"]) < steps:
            raise RuntimeError(f"{name}: exit {mon['rc']}, {len(mon['step_ends'])}/{steps} steps:\n"
                               f"{open(log, errors='replace').read()[-3000:]}")
        res[name] = summarise(mon, 1, [])
    o, t = res["ours"], res["TRL"]
    pair = lambda k, f: f"{o[k]:{f}} vs {t[k]:{f}} ({o[k] / t[k]:.2f}x)"  # noqa: E731
    return [(f"ours vs TRL: s/step, steps 2-{steps} (HF generate both)", pair("s_per_step", ".2f"), "-", "-"),
            ("ours vs TRL: start-up + step 1 (s)", pair("to_step1_s", ".1f"), "-", "-"),
            ("ours: after the last step (the final checkpoint, exit) (s)", f"{o['after_last_s']:.1f}", "-", "-")]


def decode_error(model, ids, outs):
    """Mean abs nats between the log-probs a decode returned and one forward of the model over the same tokens
    (temperature 1, no truncation; every completion of the same length)."""
    seqs = torch.tensor([p + c.token_ids for p, group in zip(ids.tolist(), outs) for c in group])  # [R, W + T]
    got = torch.tensor([c.logprobs for group in outs for c in group])  # [R, T]
    err, w, dev = 0.0, ids.shape[1], model.device
    with torch.no_grad():
        for rows, lp in zip(seqs.split(8), got.split(8)):  # [8, W + T]: the [8, T, V] logits of a slice at a time
            z = model(input_ids=rows.to(dev)).logits[:, w - 1:-1].float().log_softmax(-1)
            err += (z.gather(-1, rows[:, w:, None].to(dev))[..., 0].cpu().double() - lp).abs().sum().item()
    return err / got.numel()


def generate_rows(model_path, cuda, k, prompts, G, tokens, out_of_time, stock_static=False):
    """The HF engine's decode loop against transformers' generate called as TRL does (each prompt repeated G times, a
    dynamic KV cache, multinomial sampling; here on the engine's bf16 copy, where TRL runs fp32 weights under
    autocast and never compiles); then the HF engine with --rollout.compile-decode (one static KV cache, the step
    compiled: CUDA graphs on CUDA), with both decodes' log-probs against one forward over their tokens. stock_static:
    instead, stock generate with one static KV cache reused by every call, which transformers compiles on CUDA. Every
    row runs to `tokens` (stop tokens off on both sides, so both decode the same tokens); a warm-up call, then one
    timed."""
    from transformers import StaticCache

    from rollout import HFEngine
    dev = "cuda" if cuda else "cpu"
    eng = HFEngine(model_path, seed=0, dtype=torch.bfloat16, device=dev)
    eng.stop_ids = []
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, eng.model.config.vocab_size, (prompts, 30), generator=g)  # [B, 30]
    reqs, rep = [{"prompt_token_ids": r.tolist()} for r in ids], ids.repeat_interleave(G, 0).to(dev)

    def timed(fn):  # a warm-up call, then a timed one -> (the timed call's output, its time, the warm-up's time)
        t0, out = time.perf_counter(), []
        fn()
        warm = time.perf_counter() - t0
        return out, seconds(lambda: out.append(fn()), cuda), warm

    stock = dict(input_ids=rep, attention_mask=torch.ones_like(rep), do_sample=True, top_k=0, top_p=1.0,
                 temperature=1.0, max_new_tokens=tokens, pad_token_id=eng.tok.pad_token_id)
    shape, per = f"{prompts * G} x {tokens} tokens", lambda s: f"{s:.2f} s ({s / tokens * 1e3:.1f} ms per step)"
    if stock_static:
        what = f"generate {shape}: one static KV cache{', compiled' if cuda else ' (compiled on CUDA only)'}"
        if out_of_time(what, need_s=150):
            return []
        cache = StaticCache(config=eng.model.config, max_cache_len=rep.shape[1] + tokens)
        try:  # one cache for every call: its tensors keep their addresses, so CUDA graphs are recorded once
            _, static, warm = timed(lambda: cache.reset() or eng.model.generate(**stock, past_key_values=cache))
        except Exception as e:  # a compile failure is a finding, not the end of the table
            return [(what, f"failed: {type(e).__name__}: {str(e)[:80]}", "-", "-")]
        return [(what, f"{per(static)}; first call (compiles) {warm:.0f} s", "-", "-")]
    eager, ours, _ = timed(lambda: eng.generate(reqs, n=G, temperature=1.0, max_tokens=tokens))
    theirs = timed(lambda: eng.model.generate(**stock))[1]
    rows = [(f"generate {shape}: HF engine (ours)", per(ours), "-", "-"),
            (f"generate {shape}: transformers generate, TRL's way", per(theirs), "-", "-"),
            ("generate: ours / transformers", f"{ours / theirs:.2f}", bound(TARGETS["generate"][k]),
             judge(ours / theirs, TARGETS["generate"][k]))]
    what = f"generate {shape}: HF engine, --rollout.compile-decode"
    if out_of_time(what, need_s=150):  # compiling 24 layers takes minutes on a slow host
        return rows
    eager_err = decode_error(eng.model, ids, eager[0])
    try:
        comp = HFEngine(model_path, seed=0, dtype=torch.bfloat16, device=dev, compile_decode=True,
                        processor=eng.processor)
        comp.stop_ids = []  # the timed call's output: the second at this shape, so from the reused cache
        compiled, fast, warm = timed(lambda: comp.generate(reqs, n=G, temperature=1.0, max_tokens=tokens))
        err, target = decode_error(eng.model, ids, compiled[0]), TARGETS["generate"][k]
        rows += [(what, f"{per(fast)}; first call (compiles) {warm:.0f} s", "-", "-"),
                 ("generate: ours compiled / transformers", f"{fast / theirs:.2f}", bound(target),
                  judge(fast / theirs, target)),
                 ("decode log-probs vs one forward, eager / compiled (nats)", f"{eager_err:.1e} / {err:.1e}",
                  bound(TARGETS["mismatch"][k]), judge(max(eager_err, err), TARGETS["mismatch"][k]))]
    except Exception as e:  # a compile failure is a finding, not the end of the table
        rows.append((what, f"failed: {type(e).__name__}: {str(e)[:80]}", "-", "-"))
    return rows


def grpo_group(work, name, model, flags, steps, left, peak, total_gb, k):
    """grpo.py with `flags` in its own process -> its rows (a LoRA run: steps and mismatch only)."""
    if name == "vllm" and importlib.util.find_spec("vllm") is None:
        return [("grpo.py vllm", "vLLM not installed: skipped", "-", "-")]
    metrics, rec = run_grpo(work, name, model, flags, left())
    return grpo_rows(name, metrics, rec, peak, total_gb, k, steps)[:None if name != "lora" else 2]


def flow_rows(work, timeout):
    """2 steps of flow_grpo.py on builtin:tiny-flow (its default run's model), one process."""
    t0, out = time.time(), os.path.join(work, "flow")
    try:
        flow = _metrics(out, [sys.executable, "flow_grpo.py", "--output-dir", out, "--max-steps", "2",
                              "--log.no-progress"], timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(e, file=sys.stderr)
        return [("flow_grpo.py builtin:tiny-flow", "did not finish (log above)", "2 steps", "FAIL")]
    return [("flow_grpo.py builtin:tiny-flow: steps done", f"{len(flow)}/2 in {time.time() - t0:.0f} s", "2/2",
             "pass" if len(flow) == 2 else "FAIL")]


class Rows(list):
    """The table's rows, each also printed as it arrives (a run cut short still shows what it measured)."""

    def append(self, row):
        print(" | ".join(row), flush=True)
        super().append(row)

    def __iadd__(self, rows):
        for r in rows:
            self.append(r)
        return self


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="the reduced form (tiny sizes), also on CUDA")
    ap.add_argument("--work", default=None, help="folder for the model and the runs (default: a new temporary one)")
    ap.add_argument("--only", default="ceiling,logprobs,vllm,hf,generate,trl,packing,lora,flow,static",
                    help="comma-separated row groups to run (default: all, in this order)")
    ap.add_argument("--budget-s", type=float, default=0, help="start no run after this many seconds and give a "
                    "running one only what is left, so the table prints inside a lent machine's call limit (0 = none)")
    ap.add_argument("--packing", default=None, help="N,PROMPT,LONGEST,MBS,REPEATS of the token-budget rows "
                    "(default 64,30,256,16,3 on CUDA, 16,8,128,4,1 in the reduced form)")
    ap.add_argument("--ours-flags", default="", help="more grpo.py flags for ours in the TRL side by side, e.g. "
                    "--ours-flags=--rollout.compile-decode")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one instrumented grpo.main
    args, rest = ap.parse_known_args()
    if args.child:
        return child(args.child, rest[1:] if rest[:1] == ["--"] else rest)
    cuda = torch.cuda.is_available() and not args.small
    k, size, timeout = (0, SIZES["full"], 1800) if cuda else (1, SIZES["small"], 600)
    work = args.work or tempfile.mkdtemp(prefix="gpu_check-")
    deadline = time.time() + (args.budget_s or float("inf"))
    left = lambda: max(1.0, min(timeout, deadline - time.time()))  # noqa: E731 (a child's timeout: what is left)
    model = build_qwen2(os.path.join(work, "model"), **size)
    peak = matmul_peak("cuda" if cuda else "cpu", torch.bfloat16, 8192 if cuda else 1024)
    total_gb = torch.cuda.mem_get_info()[1] / 2**30 if cuda else None
    shape = (["--batch-size", "32", "--num-generations", "8", "--rollout.max-completion-length", "256"] if cuda else
             ["--batch-size", "8", "--num-generations", "4", "--rollout.max-completion-length", "16"])
    common = ["--policy.dtype", "bfloat16", "--rollout.max-mismatch", "0", *shape,  # mismatch: measured, not a stop
              "--data.rewards", "gpu_check:varied_reward"]  # every row trains (see varied_reward)
    rows, only = Rows(), set(args.only.split(","))

    def out_of_time(what, need_s=0):  # --budget-s spent (or under need_s left): `what` gets a row saying it was skipped
        if time.time() + need_s < deadline:
            return False
        rows.append((what, "skipped: --budget-s spent" if need_s == 0 else f"skipped: under {need_s} s left", "-", "-"))
        return True
    def grpo(name, flags, steps):
        flags = [*flags, "--max-steps", str(steps), *common]
        return grpo_group(work, name, model, flags, steps, left, peak, total_gb, k)
    hf, decode_shape = ["--rollout.engine", "hf"], (8, 8, 128) if cuda else (2, 4, 16)
    groups = {  # name: (row label, rows), in the order they run: what a lent machine's budget must reach comes first
        "ceiling": ("bare model MFU",
                    lambda: ceiling_rows(model, peak, cuda, *((32, 30, 256) if cuda else (8, 8, 16)))),
        "logprobs": ("fused vs naive log-probs", lambda: logprob_rows(cuda, k, size)),
        "vllm": ("grpo.py vllm", lambda: grpo("vllm", ["--rollout.engine", "vllm",  # (the HF engine has no context cap)
                                                       *(["--vllm.max-model-len", "512"] if cuda else [])], 3)),
        "hf": ("grpo.py hf", lambda: grpo("hf", hf, 3)),
        "generate": ("generate: ours vs transformers",  # the side by side's shape: 8 prompts x 8 completions of 128
                     lambda: generate_rows(model, cuda, k, *decode_shape, out_of_time)),
        "trl": ("ours vs TRL", lambda: trl_rows(cuda, work, model, left, args.ours_flags.split())),
        "packing": ("token-budget micro-batches", lambda: packing_rows(model, cuda, *(int(x) for x in (
            args.packing or ("64,30,256,16,3" if cuda else "16,8,128,4,1")).split(",")))),
        "lora": ("grpo.py lora", lambda: grpo("lora", [*hf, "--lora.r", "8", "--optim.lr", "1e-4"], 1)),
        "flow": ("flow_grpo.py builtin:tiny-flow", lambda: flow_rows(work, left())),
        "static": ("generate: one static KV cache", lambda: generate_rows(model, cuda, k, *decode_shape, out_of_time,
                                                                            stock_static=True))}
    for name, (label, group_rows) in groups.items():
        if name not in only or out_of_time(label):
            continue
        try:
            rows += group_rows()
        except Exception as e:  # one group's failure is a row, not the end of the table
            print(e, file=sys.stderr)
            rows.append((label, f"did not finish: {type(e).__name__} (log above)", "-", "FAIL"))
    machine = (f"{torch.cuda.get_device_name()}, {total_gb:.0f} GB" if cuda else f"CPU x{os.cpu_count()} (reduced form)")
    n_params = size["vocab"] * size["hidden"] + size["layers"] * (
        2 * size["hidden"] ** 2 + 2 * size["hidden"] * size["hidden"] // size["heads"] * size["kv_heads"]
        + 3 * size["hidden"] * size["intermediate"])
    print(f"\nmachine: {machine}; bf16 matmul peak {peak:.1f} TFLOP/s; model: random Qwen2, ~{n_params / 1e6:.0f}M "
          f"matmul parameters, vocabulary {size['vocab']}; work dir {work}")
    w = max(len(r[0]) for r in rows)
    print(f"{'check':<{w}} | {'value':<40} | {'target':<12} | result")
    for r in rows:
        print(f"{r[0]:<{w}} | {r[1]:<40} | {r[2]:<12} | {r[3]}")
    return 1 if any(r[3] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
