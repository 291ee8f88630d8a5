"""Training-phase roofline: achieved FLOP/s of the policy update against this machine's measured matmul peak.

    python bench/roofline.py [--model smollm2|tiny|PATH] [--seqs 16 --prompt-len 64 --completion-len 64]

1. Peak: fp32 square matmuls (n=2048) on 1 thread and on all threads, best of 5.
2. The update as grpo.py runs it: TokenLogprobs forward (the fused chunked log-softmax, never [tokens, vocab]) +
   backward of a token-level policy-gradient loss, then AdamW, on `--seqs` sequences (2 prompts x 8, the SmolLM2 step-time setting).
   Model FLOPs per token = 6 x (matmul parameters, the tied lm_head counted once as a matmul) + 12 x layers x hidden x
   context (attention scores and values, fwd+bwd); the embedding lookup is not a matmul.
Prints seconds and GFLOP/s per phase and the fraction of the all-threads peak (model FLOP utilisation).
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import models  # noqa: E402
import token_logprobs  # noqa: E402


def matmul_peak(threads, n=2048, reps=5):
    """Best fp32 GFLOP/s of an n x n x n matmul on `threads` threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best = min(_timed(lambda: a @ b) for _ in range(reps))
    torch.set_num_threads(old)
    return 2 * n ** 3 / best / 1e9


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def update_flops(model, n_tokens, context):
    """Model FLOPs of one forward+backward over n_tokens tokens at an average attention context of `context`."""
    cfg = models.text_config(model.config)
    embed = model.get_input_embeddings().weight
    matmul_params = sum(p.numel() for p in model.parameters() if p.dim() == 2 and p is not embed)
    matmul_params += embed.numel()  # the lm_head matmul (tied or not, it is one V x d matmul per token)
    if not getattr(cfg, "tie_word_embeddings", False):
        matmul_params -= model.get_output_embeddings().weight.numel()  # counted above already
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * context
    return n_tokens * (6 * matmul_params + attention)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--completion-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    path = {"smollm2": lambda: models.convert_gguf(models.packaged_smollm2(), "/tmp/smollm2-hf"),
            "tiny": lambda: models.build_tiny_model(tempfile.mkdtemp())}.get(args.model, lambda: args.model)()
    threads = torch.get_num_threads()
    peak1, peak = matmul_peak(1), matmul_peak(threads)
    model, _ = models.load_policy(path)
    module = token_logprobs.TokenLogprobs(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    P, C, N = args.prompt_len, args.completion_len, args.seqs
    V = model.config.vocab_size
    samples = [{"prompt_ids": torch.randint(V, (P,)).tolist(), "completion_ids": torch.randint(V, (C,)).tolist()}
               for _ in range(N)]
    batch = token_logprobs.collate(samples, 0, torch.device("cpu"), C)
    phases = {"forward (no grad)": [], "forward+backward": [], "AdamW step": []}
    for _ in range(args.reps + 1):  # the first is a warm-up
        with torch.no_grad():
            phases["forward (no grad)"].append(_timed(lambda: module(batch, 1.0)))
        def fwd_bwd():
            lp, _ = module(batch, 1.0)
            (-lp.mean()).backward()
        phases["forward+backward"].append(_timed(fwd_bwd))
        phases["AdamW step"].append(_timed(lambda: (opt.step(), opt.zero_grad())))
    tokens = N * (P + C)  # the forward runs over prompts and completions; the head only over completion positions
    full = update_flops(model, tokens, (P + C) / 2)
    head = 6 * V * model.config.hidden_size * (tokens - N * C)  # head FLOPs not spent on prompt positions
    fb_flops = full - head
    print(f"machine: CPU, {threads} threads   matmul peak fp32: {peak1:.0f} GFLOP/s (1 thread), {peak:.0f} GFLOP/s "
          f"({threads} threads)")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.model} ({n_params / 1e6:.1f}M params, vocab {V})   batch: {N} sequences x ({P} prompt + "
          f"{C} completion) tokens")
    print(f"{'phase':>18} | {'seconds':>8} | {'GFLOP':>8} | {'GFLOP/s':>8} | {'of peak':>7}")
    for name, times in phases.items():
        s = sorted(times[1:])[len(times[1:]) // 2]
        flops = {"forward (no grad)": fb_flops / 3, "forward+backward": fb_flops, "AdamW step": 0}[name]
        rate = f"{flops / s / 1e9:8.1f} | {flops / s / 1e9 / peak:7.1%}" if flops else f"{'-':>8} | {'-':>7}"
        print(f"{name:>18} | {s:8.3f} | {flops / 1e9:8.1f} | {rate}")


if __name__ == "__main__":
    main()
