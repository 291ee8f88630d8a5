"""torchrun --nproc_per_node 2: gradients of a loss built on fused_linear_logprobs through an FSDP2-sharded tiny
model equal those of the unsharded model on the same data (each rank holds half of the batch)."""
import sys

import torch
import torch.distributed as dist

import grpo
import models

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
ref = grpo.TokenLogprobs(ref_model)
full = sum(loss_of(ref, list(range(r * 4, r * 4 + 4))) for r in range(world)) / world  # FSDP averages over ranks
full.backward()

policy, _ = models.load_policy(path)
sharded = grpo.shard(grpo.TokenLogprobs(policy), torch.distributed.fsdp.MixedPrecisionPolicy())
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
dist.destroy_process_group()
