"""Dynamic sampling's top-up groups (samples flagged `masked` after the last round) are not part of the batch: with
them, grpo.compute_advantages and grpo.accumulate_gradients give the advantages and the gradient of the batch without
them (--scale-rewards batch, GDPO; every loss type in losses.LOSSES).

    python tests/topup_rows_check.py MODEL_DIR        # a world of one, float64 model; prints TOP-UP OK

Used by tests/test_ppo.py."""
import dataclasses
import sys
from types import SimpleNamespace

import torch

import batching
import distributed
import grpo
import losses
import models
import token_logprobs

G, N, KEPT, T = 4, 12, 8, 6
distributed.setup_distributed()
torch.manual_seed(0)
policy, _ = models.load_policy(sys.argv[1], dtype=torch.float64)
module = token_logprobs.TokenLogprobs(policy)
rollout_cfg = SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0, max_completion_length=T)
cfg = SimpleNamespace(micro_batch_size=3, micro_batch_tokens=0, num_generations=G, advantage_estimator="grpo",
                      rollout=rollout_cfg)
run = SimpleNamespace(cfg=cfg, device=torch.device("cpu"), world=1, rank=0, module=module, packing={},
                      processor=SimpleNamespace(pad_token_id=0), weights=[1.0, 0.5])

g = torch.Generator().manual_seed(1)
samples = [{"prompt_ids": torch.randint(2, 50, (int(torch.randint(2, 6, (), generator=g)),), generator=g).tolist(),
            "completion_ids": torch.randint(2, 50, (int(torch.randint(1, T + 1, (), generator=g)),), generator=g).tolist()}
           for _ in range(N)]
for s in samples[KEPT:]:  # the third group: a top-up, flagged and masked as dynamic_sampling / old_and_ref_logps do
    s["top_up"] = True
rewards = torch.rand(N, 2, generator=g, dtype=torch.float64)
rewards[KEPT:] = torch.tensor([4.0, 2.0], dtype=torch.float64)  # its rewards agree (uninformative), far from the rest
lens = torch.tensor([len(s["completion_ids"]) for s in samples])
cm = (torch.arange(T)[None] < lens[:, None]).double()  # [N, T]
mask = cm.clone()
mask[KEPT:] = 0
current = grpo.logps_of(run, module, SimpleNamespace(samples=samples, T=T), torch.arange(N))["logps"]  # [N, T]
old = current + 0.1 * torch.randn(N, T, generator=g, dtype=torch.float64) * cm


def batch_of(n):
    return batching.Batch(samples[:n], completion_mask=cm[:n], mask=mask[:n].clone(), engine_logps=old[:n],
                          truncated=torch.zeros(n, dtype=torch.bool), fresh=torch.ones_like(cm[:n]), old_logps=old[:n])


def grads():
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


full, kept = batch_of(N), batch_of(KEPT)
for scale, agg in [("batch", "sum_then_normalize"), ("group", "normalize_then_sum"), ("batch", "normalize_then_sum")]:
    cfg.scale_rewards, cfg.reward_aggregation = scale, agg
    full.advantages = grpo.compute_advantages(run, rewards, full)["fields"]["advantages"]
    kept.advantages = grpo.compute_advantages(run, rewards[:KEPT], kept)["fields"]["advantages"]
    torch.testing.assert_close(full.advantages[:KEPT], kept.advantages, msg=f"{scale} {agg}")
    assert not full.advantages[KEPT:].any(), (scale, agg)

base = losses.LossConfig(epsilon=0.1, max_completion_length=T)
worst = {}
for lt in losses.LOSSES:  # every entry
    loss_cfg = dataclasses.replace(base, loss_type=lt)
    results = []
    for batch, n in ((full, N), (kept, KEPT)):
        module.zero_grad(set_to_none=True)
        stats = grpo.accumulate_gradients(run, batch, torch.arange(n), loss_cfg)["stats"]
        results.append((grads(), stats["loss"]))
    (gf, lf), (gk, lk) = results
    scale = max(v.abs().max().item() for v in gk.values())
    worst[lt] = max((gf[k] - gk[k]).abs().max().item() for k in gk) / scale
    assert abs(lf - lk) <= 1e-9 * max(1.0, abs(lk)), (lt, lf, lk)
print("relative gradient difference with vs without the top-up rows:", {k: f"{v:.1e}" for k, v in worst.items()})
assert all(v < 1e-9 for v in worst.values()), worst
print("TOP-UP OK", flush=True)
