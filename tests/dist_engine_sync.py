"""torchrun --nproc_per_node 2: an FSDP2-sharded policy syncs into both ranks' vLLM engines (external_launcher),
both generate with the new weights; then a name mismatch raises the same clear error on both ranks (no hang)."""
import sys

import torch
import torch.distributed as dist

import grpo
import models
import rollout
import token_logprobs
import weight_sync

dist.init_process_group("gloo")
rank = dist.get_rank()
path = sys.argv[1]
policy, _ = models.load_policy(path)
module = models.shard(token_logprobs.TokenLogprobs(policy), torch.distributed.fsdp.MixedPrecisionPolicy())
engine = rollout.VLLMEngine(path, seed=rank, cfg=rollout.VLLMConfig(max_model_len=256), dtype="float32")
prompt = [24, 12, 35, 38, 5, 38, 9, 43]
before = engine.generate([{"prompt_token_ids": prompt}], n=1, temperature=0.0, max_tokens=8)[0][0].token_ids
with torch.no_grad():  # a real change to every shard
    for p in module.parameters():
        p.add_(0.5 * torch.randn_like(p))
weight_sync.check_sync_names(engine, policy)
engine.load_weights(weight_sync.iter_engine_weights(policy, torch.float32))
after = engine.generate([{"prompt_token_ids": prompt}], n=1, temperature=0.0, max_tokens=8)[0][0].token_ids
# reference: the unsharded model with the gathered new weights, greedy
full = {k: v.full_tensor() for k, v in policy.state_dict().items()}
ref, _ = models.load_policy(path)
ref.load_state_dict(full)
with torch.no_grad():
    expected = ref.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
assert after != before and after == expected, (before, after, expected)
print(f"rank {rank} SYNC OK {after}", flush=True)


class Renamed(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.config = inner.config
        self.inner = inner


try:
    weight_sync.check_sync_names(engine, Renamed(ref))
except ValueError as e:
    print(f"rank {rank} MISMATCH RAISED: {str(e).splitlines()[0]}", flush=True)
    sys.exit(3)
