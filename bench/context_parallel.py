"""--policy.context-parallel N on CPU: the trainer's peak memory per rank and its step time for one long completion of
SmolLM2-135M (fp32, FSDP2 over the ranks, gloo), split over N ranks ("cp"), next to the data-parallel run on the same
ranks ("dp": each rank a whole row of its own).

    python bench/context_parallel.py                 # N = 1, 2, 4; a 64-token prompt + 2048-token completion
    python bench/context_parallel.py --tokens 4096

One forward + backward of TokenLogprobs (the fused head, log-probs and entropies in the loss) per run, after a short
warm-up pass; each configuration in fresh processes. Memory: the kernel's peak RSS of each rank during the measured
pass (VmHWM, reset before it) and that peak less the RSS just before it (the step's own: activations, gathered
layers, gradients, workspaces).
Every run gets the machine's cores: torch threads = cores // N per rank.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def rss_gb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 2**20  # kB -> GiB


def worker(args):
    """One rank: build, warm up, one timed forward + backward; print one JSON line."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import context_parallel
    import models
    from token_logprobs import TokenLogprobs, collate
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, args.cores // world))
    cp = context_parallel.groups(world, world)[0] if args.worker == "cp" and world > 1 else None
    policy, _ = models.load_policy(args.model)
    module = models.shard(TokenLogprobs(policy, cp), MixedPrecisionPolicy())
    g = torch.Generator().manual_seed(0 if cp is not None else rank)  # cp: the group's one row; dp: a row per rank
    row = lambda n: [{"prompt_ids": torch.randint(10, 40000, (64,), generator=g).tolist(),  # noqa: E731
                      "completion_ids": torch.randint(10, 40000, (n,), generator=g).tolist()}]
    timings = []
    for n in (256, args.tokens):  # warm-up, then the measured pass
        inputs = collate(row(n), 0, torch.device("cpu"), n)
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS: the peak is this pass's
            f.write("5")
        base = rss_gb("VmRSS")
        dist.barrier()
        t0 = time.perf_counter()
        lp, ent = module(inputs, 1.0, with_entropy=True)  # [1, n] each
        (-(lp + 0.01 * ent).mean()).backward()
        dist.barrier()
        timings.append(time.perf_counter() - t0)
        module.zero_grad(set_to_none=True)
    print("RESULT " + json.dumps({"rank": rank, "time_s": timings[-1], "peak_gb": rss_gb("VmHWM"),
                                  "step_gb": rss_gb("VmHWM") - base}), flush=True)
    dist.destroy_process_group()


def measure(model, mode, n, tokens, cores):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port",
           str(29600 + n + 10 * (mode == "cp")), os.path.abspath(__file__), "--worker", mode, "--model", model,
           "--tokens", str(tokens), "--cores", str(cores)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    rows = [json.loads(x) for x in re.findall(r"RESULT (\{[^}]*\})", out.stdout)]  # (ranks' lines may interleave)
    if len(rows) != n:
        raise RuntimeError(f"{mode} N={n} failed:\n{(out.stdout + out.stderr)[-4000:]}")
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--cores", type=int, default=os.cpu_count())
    p.add_argument("--worker", default=None)
    p.add_argument("--model", default=None)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    import models
    model = args.model or models.convert_gguf_once(models.packaged_smollm2(), os.path.join(ROOT, "outputs", "bench"))
    print(f"SmolLM2-135M fp32, rows of 64 + {args.tokens} tokens (one per context-parallel group, one per rank in "
          f"data parallel), {args.cores} cores\n")
    print("| N | layout | rows per step | peak RSS per rank (GiB) | the step's own (GiB) | step time (s) | s per row |")
    print("|---|---|---|---|---|---|---|")
    for n in args.ranks:
        for mode in (("cp", "dp") if n > 1 else ("cp",)):
            rows = measure(model, mode, n, args.tokens, args.cores)
            t, k = max(r["time_s"] for r in rows), (n if mode == "dp" else 1)
            name = "one rank" if n == 1 else ("context parallel" if mode == "cp" else "data parallel")
            print(f"| {n} | {name} | {k} | {max(r['peak_gb'] for r in rows):.2f} | "
                  f"{max(r['step_gb'] for r in rows):.2f} | {t:.1f} | {t / k:.1f} |", flush=True)


if __name__ == "__main__":
    main()
