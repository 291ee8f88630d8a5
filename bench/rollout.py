"""Generation throughput (vLLM engine vs HF engine) and weight-sync cost, same tiny model and prompts.

    python bench/rollout.py [--hidden 256 --layers 4 --prompts 32 --n 8 --max-tokens 32]
    python bench/rollout.py --model smollm2 --prompts 2 --n 8 --max-tokens 64   # the real 135M model

Prints completion tokens/s for each engine and the seconds per million parameters of a full weight sync
(weight_sync.iter_engine_weights -> engine.load_weights), median of 3.
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
import torch  # noqa: E402

import models  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402
import weight_sync  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default="tiny", help="tiny (random, --hidden/--layers) | smollm2 (the packaged "
                    "SmolLM2-135M-Instruct GGUF, converted to /tmp/smollm2-hf) | an HF folder")
    args = ap.parse_args()
    if args.model == "tiny":
        path = models.build_tiny_model(tempfile.mkdtemp(), hidden=args.hidden, layers=args.layers)
    elif args.model == "smollm2":
        path = models.convert_gguf(models.packaged_smollm2(), "/tmp/smollm2-hf")
    else:
        path = args.model
    policy, tok = models.load_policy(path)
    n_params = sum(p.numel() for p in policy.parameters())
    # the arithmetic prompts of the built-in task, through the chat template when the model has one
    prompts = [{"prompt_token_ids": tasks.encode_prompt({"prompt": f"What is {i + 3} * {(7 * i) % 13 + 2}?"}, tok,
                                                        256)["prompt_ids"]} for i in range(args.prompts)]
    engines = {"hf": rollout.HFEngine(path, seed=0)}
    try:
        engines["vllm"] = rollout.VLLMEngine(path, seed=0, cfg=rollout.VLLMConfig(max_model_len=512), dtype="float32")
    except ImportError:
        print("vllm not installed: HF engine only")
    device = "cuda" if torch.cuda.is_available() else f"CPU x{os.cpu_count()}"
    print(f"device: {device} ({torch.get_num_threads()} threads)   model: {args.model}, {n_params / 1e6:.2f}M params   "
          f"{args.prompts} prompts x n={args.n}, up to {args.max_tokens} tokens, T=1.0")
    print(f"{'engine':>6} | {'gen tokens/s':>12} | {'sync s':>7} | {'sync s per 1M params':>20}")
    for name, eng in engines.items():
        eng.generate(prompts[:2], n=2, temperature=1.0, max_tokens=4)  # warm-up
        times, toks = [], 0
        for rep in range(3):
            t0 = time.perf_counter()
            outs = eng.generate(prompts, n=args.n, temperature=1.0, max_tokens=args.max_tokens,
                                seeds=rollout.completion_seeds(0, rep, 0, len(prompts), args.n))
            times.append(time.perf_counter() - t0)
            toks = sum(len(c.token_ids) for o in outs for c in o)
        syncs = []
        for _ in range(3):
            t0 = time.perf_counter()
            eng.load_weights(weight_sync.iter_engine_weights(policy, torch.float32))
            syncs.append(time.perf_counter() - t0)
        gen_s, sync_s = sorted(times)[1], sorted(syncs)[1]
        print(f"{name:>6} | {toks / gen_s:>12.0f} | {sync_s:>7.3f} | {sync_s / (n_params / 1e6):>20.4f}")


if __name__ == "__main__":
    main()
