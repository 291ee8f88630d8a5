"""torchrun --nproc_per_node 2: gradients of a loss built on fused_linear_logprobs through an FSDP2-sharded tiny
model equal those of the unsharded model on the same data (each rank holds half of the batch); a sharded DoRA policy
syncs PEFT's own merge."""
import copy
import sys

import torch
import torch.distributed as dist

import grpo
import models
import token_logprobs
import weight_sync

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
path = sys.argv[1]
torch.manual_seed(0)
samples = [{"prompt_ids": torch.randint(2, 50, (int(torch.randint(3, 8, ())),)).tolist(),
            "completion_ids": torch.randint(2, 50, (int(torch.randint(1, 6, ())),)).tolist()} for _ in range(8)]
T = max(len(s["completion_ids"]) for s in samples)
adv = torch.randn(8)


def loss_of(module, part):
    batch = grpo.collate([samples[i] for i in part], 0, torch.device("cpu"), T)
    lp, ent = module(batch, 0.7, with_entropy=True)  # [b, T]
    mask = (torch.arange(T)[None] < torch.tensor([len(samples[i]["completion_ids"]) for i in part])[:, None]).float()
    return -((lp * adv[part, None] + 0.01 * ent) * mask).sum() / mask.sum()


ref_model, _ = models.load_policy(path)
ref = token_logprobs.TokenLogprobs(ref_model)
full = sum(loss_of(ref, list(range(r * 4, r * 4 + 4))) for r in range(world)) / world  # FSDP averages over ranks
full.backward()

policy, _ = models.load_policy(path)
sharded = models.shard(token_logprobs.TokenLogprobs(policy), torch.distributed.fsdp.MixedPrecisionPolicy())
loss_of(sharded, list(range(rank * 4, rank * 4 + 4))).backward()
worst = 0.0
for (n, p), (n2, p2) in zip(sharded.named_parameters(), ref.named_parameters()):
    assert n == n2, (n, n2)
    g = p.grad.full_tensor()
    worst = max(worst, ((g - p2.grad).abs().max() / p2.grad.abs().max().clamp(min=1e-12)).item())
if rank == 0:
    print(f"max relative grad difference FSDP2 vs unsharded: {worst:.2e}")
assert worst < 1e-4, worst
print(f"rank {rank} GRADS OK", flush=True)

# DoRA + rsLoRA under FSDP2: the synced weights are PEFT's merge_and_unload of the same adapter, unsharded
lora = models.LoraConfig(r=4, alpha=8, use_dora=True, use_rslora=True)
peft_policy, _ = models.load_policy(path, lora=lora)
with torch.no_grad():
    g = torch.Generator().manual_seed(3)
    for _, p in sorted((n, p) for n, p in peft_policy.named_parameters() if p.requires_grad):
        p.add_(0.3 * torch.randn(p.shape, generator=g))
expected = copy.deepcopy(peft_policy).merge_and_unload().state_dict()
models.shard(token_logprobs.TokenLogprobs(peft_policy), torch.distributed.fsdp.MixedPrecisionPolicy())
sent = dict(weight_sync.iter_engine_weights(peft_policy, torch.float32))
assert sent.keys() == set(expected) - {"lm_head.weight"}
for k, v in sent.items():
    torch.testing.assert_close(v, expected[k], rtol=1e-6, atol=1e-6, msg=k)
print(f"rank {rank} DORA MERGE OK", flush=True)
dist.destroy_process_group()
