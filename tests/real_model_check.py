"""Run by tests/test_real_model.py in its own process (one vLLM engine per process): SmolLM2-135M-Instruct in the real
vLLM engine against the trainer's fused log-probs, float32, before and after one real AdamW update synced to the engine.

Prints the measured gaps and "REAL MODEL OK"; any failed check raises."""
import sys

import torch

import grpo
import models
import rollout
import token_logprobs
import weight_sync

path = sys.argv[1]
policy, tok = models.load_policy(path)
engine = rollout.VLLMEngine(path, seed=0, cfg=rollout.VLLMConfig(max_model_len=512), dtype="float32")
weight_sync.check_sync_names(engine, policy)
questions = ["What is 12 + 7?", "What is 3 * 4? Answer with a number.", "Name a colour."]
prompts = [grpo.encode_prompt({"prompt": q}, tok, 256)["prompt_ids"] for q in questions]
T = 24
MAX_GAP = 1e-3  # on every token, not just on average


def sample(seed):
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], n=2, temperature=1.0, max_tokens=T,
                           seeds=[[seed + 10 * i, seed + 10 * i + 1] for i in range(len(prompts))])
    comps = [c for o in outs for c in o]
    samples = [{"prompt_ids": p, "completion_ids": c.token_ids} for p, o in zip(prompts, outs) for c in o]
    engine_lp = [torch.tensor(c.logprobs, dtype=torch.float64) for c in comps]
    return grpo.collate(samples, tok.pad_token_id, torch.device("cpu"), T), engine_lp


def gap(trainer, engine_lp):
    """Mean and max |trainer - engine| over every sampled token."""
    d = torch.cat([(trainer[i, :len(e)].double() - e).abs() for i, e in enumerate(engine_lp)])
    return d.mean().item(), d.max().item()


def trainer_logps(batch):
    with torch.no_grad():
        return token_logprobs.TokenLogprobs(policy)(batch, 1.0)[0]


batch, engine_lp = sample(0)
before, before_max = gap(trainer_logps(batch), engine_lp)
assert before <= 1e-3 and before_max <= MAX_GAP, f"engine vs trainer before the update: {before:.2e} ({before_max:.2e})"

# one real update: AdamW on a policy-gradient loss of these samples (advantage +1 for the first of each pair)
opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
adv = torch.tensor([1.0, -1.0] * len(prompts))
lp, _ = token_logprobs.TokenLogprobs(policy)(batch, 1.0)
mask = batch["logprob_mask"].float()
(-(lp * mask).sum(-1) @ adv / mask.sum()).backward()
opt.step()
stale = gap(trainer_logps(batch), engine_lp)[0]  # the engine still has the old weights
assert stale > 2e-2, f"the update barely moved the policy ({stale:.2e}): the after-sync check would prove nothing"

engine.load_weights(weight_sync.iter_engine_weights(policy, torch.float32))
batch, engine_lp = sample(100)
after, after_max = gap(trainer_logps(batch), engine_lp)
assert after <= 1e-3 and after_max <= MAX_GAP, f"engine vs trainer after sync: {after:.2e} ({after_max:.2e})"
print(f"mean |dlogp| engine vs trainer: before {before:.2e}, stale engine {stale:.2e}, after sync {after:.2e}; "
      f"max: before {before_max:.2e}, after {after_max:.2e}")
print("REAL MODEL OK")
