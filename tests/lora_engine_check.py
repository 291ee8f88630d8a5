"""Run by tests/test_lora.py in its own process (one vLLM engine per process): --lora.sync adapter on the real vLLM CPU
engine, built with LoRA as launch.build_engine builds it, on the tiny checkpoint given as argv[1].

1. Three versions of a moving adapter (rsLoRA, alpha != r): after each adapter sync the engine's log-probs of its own
   samples equal PEFT's merge_and_unload model's (fp32), its samples change with the version, and the prefix cache (a
   prompt longer than one 32-token block, sampled 4 times) never serves an older version's KV.
2. A continued adapter (--lora.adapter, loaded as launch.py loads it) with per-module ranks and alphas (PEFT's
   rank_pattern / alpha_pattern) and rsLoRA: the engine's log-probs equal the trainer's (the PEFT model's forward) and
   the merged model's, so each module's own scaling reached the engine (q/k/v of ranks 8/4/4 packed into one qkv_proj).
3. An adapter the engine cannot take (rank 16 > its 8) stops with a UserError naming --lora.sync, and the engine keeps
   the last good version; a module the engine has no LoRA for is an unknown name, refused with --lora.sync merged named.
Prints "LORA ENGINE OK"; any failed check raises."""
import sys
import tempfile

import torch
from peft import LoraConfig as PeftLoraConfig, get_peft_model

import flags
import models
import rollout
import weight_sync
from console import UserError
from test_lora import merged_logps, model_logps, randomize_adapters

path = sys.argv[1]
engine = rollout.VLLMEngine(path, seed=0, cfg=rollout.VLLMConfig(max_model_len=256), dtype="float32", lora_rank=8)
PROMPT = [24, 12, 35, 38, 5, 38, 9, 43] * 5  # 40 tokens: one full KV block the prefix cache could share


def sample():
    return engine.generate([{"prompt_token_ids": PROMPT}], n=4, temperature=1.0, max_tokens=8,
                           seeds=rollout.completion_seeds(7, 0, 0, 1, 4))[0]


policy, _ = models.load_policy(path, lora=models.LoraConfig(r=8, alpha=24, use_rslora=True))
weight_sync.check_sync_names(engine, policy)
seen = []
for version in range(3):
    randomize_adapters(policy, seed=version)
    tally = {}
    engine.load_weights(weight_sync.engine_weights(policy, torch.float32, adapter=True, tally=tally))
    assert tally["bytes"] == sum(p.numel() * 4 for n, p in policy.named_parameters() if "lora_" in n), tally
    outs = sample()
    gap = max((merged_logps(policy, PROMPT, c.token_ids) - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max()
              for c in outs)
    print(f"version {version}: engine vs merged model |dlogp| max {gap:.2e}")
    assert gap < 1e-4, (version, gap)
    seen.append([c.token_ids for c in outs])
assert seen[0] != seen[1] != seen[2], seen

base = models.load_policy(path)[0]
saved = get_peft_model(base, PeftLoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=models.lora_targets(base),
                                            rank_pattern={"q_proj": 8, "down_proj": 2},
                                            alpha_pattern={"v_proj": 32, "down_proj": 3}))
randomize_adapters(saved, seed=5)
folder = tempfile.mkdtemp()
saved.save_pretrained(folder)
lora = models.LoraConfig(adapter=folder)
assert flags.lora_settings(lora)["r"] == 8  # the engine's max LoRA rank: the largest of the pattern
continued, _ = models.load_policy(path, lora=lora)
assert len({m.scaling["default"] for m in continued.modules() if "default" in getattr(m, "lora_A", {})}) == 4
engine.load_weights(weight_sync.engine_weights(continued, torch.float32, adapter=True))
for c in sample():
    engine_lp = torch.tensor(c.logprobs, dtype=torch.float64)
    gaps = [(ref(continued, PROMPT, c.token_ids) - engine_lp).abs().max() for ref in (model_logps, merged_logps)]
    print(f"continued adapter with rank/alpha patterns: engine vs trainer, merged |dlogp| max {gaps[0]:.2e} {gaps[1]:.2e}")
    assert max(gaps) < 1e-4, gaps

before = [c.token_ids for c in sample()]
wide, _ = models.load_policy(path, lora=models.LoraConfig(r=16, alpha=16))
randomize_adapters(wide)
try:
    engine.load_weights(weight_sync.engine_weights(wide, torch.float32, adapter=True))
    raise AssertionError("a rank-16 adapter was taken by a rank-8 engine")
except UserError as e:
    assert str(e).startswith("--lora.sync adapter: the engine refused the adapter"), e
    print(f"refused: {e}")
assert [c.token_ids for c in sample()] == before
bogus = weight_sync.sync_names(policy, adapter=True)[0].replace("q_proj", "nope_proj")
assert engine.unknown_names([bogus]) == [bogus]
try:
    weight_sync.raise_unknown_names(engine.unknown_names([bogus]))
    raise AssertionError("an unknown adapter name passed")
except ValueError as e:
    assert str(e).startswith("--lora.sync adapter: the engine has no LoRA layer") and "--lora.sync merged" in str(e), e
print("LORA ENGINE OK")
