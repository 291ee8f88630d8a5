"""Engine vs trainer log-probs of the same sampled tokens, by precision, on a real model (one process).

    python bench/bf16_mismatch.py [--model smollm2|PATH] [--prompts 16 --generations 4 --max-tokens 64]

For each precision setting (HF engine: fp32, bf16, bf16 with --policy.fp32-lm-head; vLLM's CPU build: bf16) it builds the run as grpo.py does
(launch.setup: FSDP2 mixed precision, the engine in the same dtype), generates one batch, and scores the sampled
tokens with the trainer before any update. Prints the per-token |engine - trainer| mean and max, the per-sequence
|sum| mean and max, and the share of sequences / tokens the sampler correction would act on at its default cap
(losses.policy_loss: sequence_mask and token_mask drop a ratio above 3; token_truncate clips it).
"""
import argparse
import dataclasses
import os
import sys
import tempfile

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")]
import torch  # noqa: E402

import grpo  # noqa: E402
import launch  # noqa: E402
import models  # noqa: E402

SETTINGS = {"fp32": ("hf", dict(dtype="float32")), "bf16": ("hf", dict(dtype="bfloat16")),
            "bf16 + fp32 lm-head": ("hf", dict(dtype="bfloat16", fp32_lm_head=True)),
            "bf16, vLLM": ("vllm", dict(dtype="bfloat16"))}


def measure(path, setting, args):
    """One batch of one setting -> dict of the mismatch statistics."""
    cfg = grpo.Config(model=path, output_dir=tempfile.mkdtemp(), dataset=args.dataset, seed=args.seed,
                      num_generations=args.generations, batch_size=args.prompts * args.generations,
                      micro_batch_size=args.prompts * args.generations,
                      policy=dataclasses.replace(grpo.Config().policy, **SETTINGS[setting][1]),
                      rollout=dataclasses.replace(grpo.Config().rollout, engine=SETTINGS[setting][0], temperature=1.0,
                                                  max_completion_length=args.max_tokens))
    run = launch.setup(cfg)
    grpo.sync_weights(run, stale=True)
    batch = grpo.old_and_ref_logps(run, grpo.generate(run, grpo.sample_prompts(run, 0), 0))[0]
    with torch.no_grad():
        lp = grpo.logps_of(run, run.module, batch, torch.arange(len(batch.samples)))["logps"]  # [N, T]
    cm, eng = batch.completion_mask.float(), batch.engine_logps
    gap = (lp - eng).abs()[cm > 0]  # [tokens]
    seq = ((lp - eng) * cm).sum(-1).abs()  # [N]
    seq_masked = (((lp - eng) * cm).sum(-1).exp() > 3.0).float().mean().item()  # exp(sum of old - sampler) above C
    tok_trunc = ((((lp - eng) * cm).exp() > 3.0) & (cm > 0)).float().sum().item() / cm.sum().item()
    return {"tokens": int(cm.sum().item()), "mean": gap.mean().item(), "max": gap.max().item(),
            "seq_mean": seq.mean().item(), "seq_max": seq.max().item(),
            "seq_masked": seq_masked, "tok_masked": tok_trunc}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dataset", default="arith")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = ap.parse_args()
    path = models.convert_gguf(models.packaged_smollm2(), "/tmp/smollm2-hf") if args.model == "smollm2" else args.model
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from roofline import matmul_peak
    print(f"machine: CPU x{os.cpu_count()}, matmul peak fp32 {matmul_peak(1):.0f} GFLOP/s per core; model {args.model}; "
          f"{args.prompts} prompts x {args.generations} completions of <= {args.max_tokens} tokens, temperature 1")
    print(f"{'setting':<20} | {'tokens':>6} | {'token mean':>10} | {'token max':>9} | {'seq mean':>8} | {'seq max':>8} | "
          f"{'seq masked':>10} | {'tok > cap':>9}")
    for setting in args.settings:
        r = measure(path, setting, args)
        print(f"{setting:<20} | {r['tokens']:>6} | {r['mean']:10.2e} | {r['max']:9.2e} | {r['seq_mean']:8.2e} | "
              f"{r['seq_max']:8.2e} | {r['seq_masked']:10.1%} | {r['tok_masked']:9.1%}", flush=True)


if __name__ == "__main__":
    main()
