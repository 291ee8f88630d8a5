"""Run by tests/test_rollout.py in its own process: a tiny Qwen2.5-VL in the real vLLM engine.

Checks: the engine accepts a sync of the trainer's image-text names; it generates from a prompt with an image;
its log-probs match the trainer's (float32), before and after a sync of perturbed weights."""
import sys

import torch
from PIL import Image

import grpo
import models
import rollout
import token_logprobs
import weight_sync

path = sys.argv[1]
model, processor = models.load_policy(path)
engine = rollout.VLLMEngine(path, seed=0, cfg=rollout.VLLMConfig(max_model_len=512), dtype="float32", image_text=True,
                             banned_token_ids=token_logprobs.placeholder_token_ids(model.config))
weight_sync.check_sync_names(engine, model)
img = Image.new("RGB", (56, 56), (200, 30, 30))
row = {"prompt": [{"role": "user", "content": "What colour is the square?"}], "image": img}


def mismatch():
    enc = grpo.encode_prompt(row, processor, 512)
    outs = engine.generate([enc["engine"]], n=2, temperature=1.0, max_tokens=6, seeds=[[5, 6]])[0]
    samples = [{"prompt_ids": enc["prompt_ids"], "completion_ids": c.token_ids, "mm": enc["mm"]} for c in outs[:1]]
    batch = grpo.collate(samples, processor.tokenizer.pad_token_id, torch.device("cpu"), len(outs[0].token_ids),
                         processor.image_token_id)
    with torch.no_grad():
        lp, _ = token_logprobs.TokenLogprobs(model)(batch, 1.0)
    return (lp[0] - torch.tensor(outs[0].logprobs)).abs().max().item(), outs[0].token_ids


before, toks = mismatch()
with torch.no_grad():
    for n, p in model.named_parameters():
        p.add_(0.05 * torch.randn_like(p))
engine.load_weights(weight_sync.iter_engine_weights(model, torch.float32))
after, toks2 = mismatch()
print(f"vlm mismatch before {before:.2e} after sync {after:.2e}; tokens {toks} -> {toks2}")
assert before < 1e-4 and after < 1e-4, (before, after)
print("VLM OK")
