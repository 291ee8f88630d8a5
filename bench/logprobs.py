"""Naive (logits -> log_softmax -> gather) vs fused_linear_logprobs: peak extra memory and time, fwd + bwd.

    python bench/logprobs.py                 # CPU sizes, float32
    python bench/logprobs.py --device cuda   # GPU sizes, bf16 (adds N=16384, H=3584, V=151936)

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
    return fused_linear_logprobs(h, w, t, chunk_size=chunk)[0]


VARIANTS = {  # fused options: the loss reads the log-probs, and the entropy too where it says so
    "logp": lambda h, w, t, c: fused_linear_logprobs(h, w, t, chunk_size=c)[0],
    "entropy computed, unused": lambda h, w, t, c: fused_linear_logprobs(h, w, t, chunk_size=c, with_entropy=True)[0],
    "entropy in the loss": lambda h, w, t, c: sum(fused_linear_logprobs(h, w, t, chunk_size=c, with_entropy=True)),
    "top_k=50, top_p=0.9": lambda h, w, t, c: fused_linear_logprobs(h, w, t, chunk_size=c, top_k=50, top_p=0.9)[0],
}


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
    out = subprocess.run([sys.executable, __file__, "--device", "cpu", "--chunk", str(chunk), "--repeats",
                          str(args.repeats), "--one", f"{kind}|{n}|{hdim}|{v}|{dt}"], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--chunk", type=int, default=None, help="fused chunk size (default: 512 on CPU, 1024 on CUDA)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one measurement as JSON
    args = ap.parse_args()
    chunk = args.chunk or (1024 if args.device == "cuda" else 512)
    if args.one:
        kind, n, hdim, v, dt = args.one.split("|")
        r = measure(kind, int(n), int(hdim), int(v), getattr(torch, dt), args.device, chunk, args.repeats)
        print(json.dumps(r))
        return
    if args.device == "cuda":
        sizes = [(4096, 2048, 32768, "bfloat16"), (8192, 3584, 151936, "bfloat16"), (16384, 3584, 151936, "bfloat16")]
    else:
        sizes = [(2048, 256, 8192, "float32"), (4096, 512, 32768, "float32"), (8192, 512, 32768, "float32")]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from roofline import matmul_peak  # machines of one kind differ: the peak goes beside the timings
    name = torch.cuda.get_device_name() if args.device == "cuda" else \
        f"CPU x{os.cpu_count()}, matmul peak fp32 {matmul_peak(1):.0f} GFLOP/s per core"
    print(f"device: {name}   fused chunk_size={chunk}   forward+backward, median of {args.repeats}")
    print(f"{'N':>6} {'H':>5} {'V':>7} {'dtype':>9} | {'naive GB':>9} {'naive s':>8} | {'fused GB':>9} {'fused s':>8} | {'mem x':>6} {'time x':>6}")
    for n, hdim, v, dt in sizes:
        res = {kind: one(args, chunk, kind, n, hdim, v, dt) for kind in ("naive", "fused")}
        nv, fv = res["naive"], res["fused"]
        cell = lambda r, k, f: (f % r[k]) if r else "OOM"  # noqa: E731
        ratio = lambda k: f"{fv[k] / nv[k]:.2f}" if nv and fv and nv[k] > 0 else "-"  # noqa: E731
        print(f"{n:>6} {hdim:>5} {v:>7} {dt:>9} | {cell(nv, 'extra_gb', '%9.3f')} {cell(nv, 'time_s', '%8.3f')} | "
              f"{cell(fv, 'extra_gb', '%9.3f')} {cell(fv, 'time_s', '%8.3f')} | {ratio('extra_gb'):>6} {ratio('time_s'):>6}")
    n, hdim, v, dt = sizes[1]
    print(f"\nfused options at N={n} H={hdim} V={v} {dt} (time fwd+bwd; entropy backward runs only when the loss uses it)")
    for kind in VARIANTS:
        r = one(args, chunk, kind, n, hdim, v, dt)
        print(f"  {kind:<26} {r['time_s']:8.3f} s  {r['extra_gb']:7.3f} GB")


if __name__ == "__main__":
    main()
