"""Naive (logits -> log_softmax -> gather) vs fused_linear_logprobs: peak extra memory and time, fwd + bwd.

    python bench/logprobs.py                 # CPU sizes, float32
    python bench/logprobs.py --device cuda   # the GPU rows of issue 41: N=8192 and 32768, H=896, V=151936, bf16
    python bench/logprobs.py --precision     # the errors behind the head's precision choices (bf16 inputs)

Peak extra memory = peak allocation during forward + backward minus what the inputs already hold.
On CPU each measurement runs in a fresh subprocess and reads the kernel's peak RSS (VmHWM);
on CUDA it is torch.cuda.max_memory_allocated.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

from losses import fused_linear_logprobs  # noqa: E402


def naive(h, w, t):
    logits = (h @ w.T).float()  # [N, V]
    return logits.log_softmax(-1).gather(-1, t[:, None]).squeeze(-1)


def fused(h, w, t, chunk):
    return fused_linear_logprobs(h, w, t, chunk_size=chunk, keep_probs=None)[0]  # as the trainer: chunk, mode by memory


VARIANTS = {  # fused options: the loss reads the log-probs, and the entropy too where it says so
    "logp": lambda h, w, t, c: fused(h, w, t, c),
    "entropy computed, unused": lambda h, w, t, c: fused_linear_logprobs(h, w, t, chunk_size=c, with_entropy=True,
                                                                          keep_probs=None)[0],
    "entropy in the loss": lambda h, w, t, c: sum(fused_linear_logprobs(h, w, t, chunk_size=c, with_entropy=True,
                                                                       keep_probs=None)),
    "top_k=50, top_p=0.9": lambda h, w, t, c: fused_linear_logprobs(h, w, t, chunk_size=c, top_k=50, top_p=0.9,
                                                                     keep_probs=None)[0],
    "logits recomputed (4 mm)": lambda h, w, t, c: fused_linear_logprobs(h, w, t, chunk_size=c, keep_probs=False)[0],
    "p kept (3 mm)": lambda h, w, t, c: fused_linear_logprobs(h, w, t, chunk_size=c, keep_probs=True)[0],
}


GPU_SIZES = [(8192, 896, 151936, "bfloat16"), (32768, 896, 151936, "bfloat16")]  # issue 41: Qwen2.5-0.5B's head


def precision_report(device, n=256, hdim=896, v=151936, logit_std=3.0):
    """The errors that decide the head's precisions, on bf16 inputs at Qwen2.5-0.5B's head with logits of std
    `logit_std` (a trained model's range), against float64 from the same bf16 values:
    (a) logits rounded to bf16 (a bf16-output matmul) vs written in fp32 (fp32 accumulation, fp32 output):
        max |error| of log p at the target;
    (b) the gradient dL/dz = gl (p - onehot) rounded to bf16 once before the two gradient matmuls (they run in bf16;
        what the fused backward does on CUDA), vs rounding p - onehot and gl * h separately: relative error of the
        weight gradient against float64."""
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(n, hdim, generator=g, device=device).bfloat16()
    w = (torch.randn(v, hdim, generator=g, device=device) * logit_std / hdim ** 0.5).bfloat16()
    t = torch.randint(0, v, (n,), generator=g, device=device)
    z64 = h.double() @ w.double().T  # [n, V]: the exact logits of these bf16 values
    ref = z64.log_softmax(-1).gather(-1, t[:, None]).squeeze(-1)
    lp = lambda z: z.double().log_softmax(-1).gather(-1, t[:, None]).squeeze(-1)  # noqa: E731
    z32 = (h.float() @ w.float().T)  # fp32 accumulation, fp32 output (what cuBLAS's fp32-output bf16 gemm computes)
    err_fp32, err_bf16 = (lp(z32) - ref).abs().max().item(), (lp(z32.bfloat16()) - ref).abs().max().item()
    d = z64.softmax(-1)
    d[torch.arange(n, device=device), t] -= 1  # dL/dz for L = -sum log p_y
    gl = torch.randn(n, generator=g, device=device, dtype=torch.float64)
    gw_ref = (d * gl[:, None]).T @ h.double()  # [V, H]
    rel = lambda a: ((a - gw_ref).norm() / gw_ref.norm()).item()  # noqa: E731
    apart = d.bfloat16().double().T @ (h.double() * gl[:, None]).bfloat16().double()  # d and gl*h each rounded
    err_d, err_g = rel(apart), rel((d * gl[:, None]).bfloat16().double().T @ h.double())  # ours: gl*d rounded once
    kept = z64.softmax(-1).bfloat16()  # p kept from the forward in bf16, its target entry p_y - 1 from expm1(log p_y)
    kept[torch.arange(n, device=device), t] = torch.expm1(ref).bfloat16()
    err_k = rel((kept * gl[:, None].bfloat16()).double().T @ h.double())  # then scaled in place in bf16
    print(f"bf16 inputs, N={n} H={hdim} V={v}, logit std {z64.std().item():.2f} (max {z64.max().item():.1f}), "
          f"errors against float64 on {device}:")
    print(f"  log p at the target, logits written in fp32        max |err| {err_fp32:.2e} nats")
    print(f"  log p at the target, logits rounded to bf16        max |err| {err_bf16:.2e} nats")
    print(f"  weight gradient, gl*(p - onehot) rounded to bf16 once (ours) relative {err_g:.2e}")
    print(f"  weight gradient, p - onehot and gl*h rounded apart          relative {err_d:.2e}")
    print(f"  weight gradient, p - onehot kept in bf16, gl applied in bf16 (kept p) relative {err_k:.2e}")
    return {"logp_fp32": err_fp32, "logp_bf16": err_bf16, "grad_w_once": err_g, "grad_w_apart": err_d,
            "grad_w_kept": err_k}


def _rss_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def measure(kind, n, hdim, v, dtype, device, chunk, repeats):
    g = torch.Generator(device=device).manual_seed(0)
    h = (torch.randn(n, hdim, generator=g, device=device) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(v, hdim, generator=g, device=device) * 0.02).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g, device=device)
    up = torch.randn(n, generator=g, device=device)
    if kind in VARIANTS:
        fn = lambda: VARIANTS[kind](h, w, t, chunk)  # noqa: E731
    else:
        fn = (lambda: naive(h, w, t)) if kind == "naive" else (lambda: fused(h, w, t, chunk))

    def step():
        h.grad = w.grad = None
        (fn() * up).sum().backward()

    step()  # warm-up; also allocates .grad so the grads are part of the baseline
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = _rss_kb("VmRSS:") * 1024
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else _rss_kb("VmHWM:") * 1024
    return {"extra_gb": max(peak - base, 0) / 2**30, "time_s": sorted(times)[len(times) // 2]}


def one(args, chunk, kind, n, hdim, v, dt):
    """One measurement; on CPU in a fresh process so the peak RSS belongs to this variant alone. None on OOM."""
    if args.device == "cuda":
        try:
            return measure(kind, n, hdim, v, getattr(torch, dt), "cuda", chunk, args.repeats)
        except torch.OutOfMemoryError:
            return None
        finally:
            torch.cuda.empty_cache()
    out = subprocess.run([sys.executable, __file__, "--device", "cpu", *(["--chunk", str(chunk)] if chunk else []),
                          "--repeats", str(args.repeats), "--one", f"{kind}|{n}|{hdim}|{v}|{dt}"], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--chunk", type=int, default=None, help="fused chunk size (default: fused_logprobs.default_chunk_size)")
    ap.add_argument("--precision", action="store_true", help="measure the precision choices' errors instead")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one measurement as JSON
    args = ap.parse_args()
    chunk = args.chunk
    if args.precision:
        return precision_report(args.device)
    if args.one:
        kind, n, hdim, v, dt = args.one.split("|")
        r = measure(kind, int(n), int(hdim), int(v), getattr(torch, dt), args.device, chunk, args.repeats)
        print(json.dumps(r))
        return
    if args.device == "cuda":
        sizes = GPU_SIZES
    else:
        sizes = [(2048, 256, 8192, "float32"), (4096, 512, 32768, "float32"), (8192, 512, 32768, "float32")]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from roofline import matmul_peak  # machines of one kind differ: the peak goes beside the timings
    name = torch.cuda.get_device_name() if args.device == "cuda" else \
        f"CPU x{os.cpu_count()}, matmul peak fp32 {matmul_peak(1):.0f} GFLOP/s per core"
    print(f"device: {name}   fused chunk_size={chunk or 'auto'}   forward+backward, median of {args.repeats}; "
          "variants run one after another: compare ratios from one run only")
    print(f"{'N':>6} {'H':>5} {'V':>7} {'dtype':>9} | {'naive GB':>9} {'naive s':>8} | {'fused GB':>9} {'fused s':>8} | {'mem x':>6} {'time x':>6}")
    for n, hdim, v, dt in sizes:
        res = {kind: one(args, chunk, kind, n, hdim, v, dt) for kind in ("naive", "fused")}
        nv, fv = res["naive"], res["fused"]
        cell = lambda r, k, f: (f % r[k]) if r else "OOM"  # noqa: E731
        ratio = lambda k: f"{fv[k] / nv[k]:.2f}" if nv and fv and nv[k] > 0 else "-"  # noqa: E731
        print(f"{n:>6} {hdim:>5} {v:>7} {dt:>9} | {cell(nv, 'extra_gb', '%9.3f')} {cell(nv, 'time_s', '%8.3f')} | "
              f"{cell(fv, 'extra_gb', '%9.3f')} {cell(fv, 'time_s', '%8.3f')} | {ratio('extra_gb'):>6} {ratio('time_s'):>6}")
    n, hdim, v, dt = sizes[1 if args.device == "cpu" else 0]
    print(f"\nfused options at N={n} H={hdim} V={v} {dt} (time fwd+bwd; entropy backward runs only when the loss uses it)")
    for kind in VARIANTS:
        r = one(args, chunk, kind, n, hdim, v, dt)
        print(f"  {kind:<26} {r['time_s']:8.3f} s  {r['extra_gb']:7.3f} GB")


if __name__ == "__main__":
    main()
