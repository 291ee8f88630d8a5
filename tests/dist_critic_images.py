"""The image-text critic's gradient does not depend on how the batch is cut, with images in it.

    python tests/dist_critic_images.py VLM_DIR OUT.pt ref          # 1 process, the minibatch as one micro-batch
    torchrun --nproc_per_node 2 tests/dist_critic_images.py VLM_DIR OUT.pt check
        # 2 ranks, FSDP2, micro-batches of 3 rows: each rank holds 4 of the reference's 8 rows (images of two sizes,
        # completions of different lengths, one masked row); one critic update (SGD, lr 1) must move every weight,
        # the vision tower's included (trained here), as the reference's does, and log the same metrics.

Float64, so the only differences are summation order. Used by tests/test_ppo.py.
"""
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from PIL import Image

import distributed
import grpo
import models
import ppo
import token_logprobs

path, out_file, mode = sys.argv[1:4]
distributed.setup_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
proc = models.load_processor(path, True)
g = torch.Generator().manual_seed(0)
samples = []
for i in range(8):  # red/blue, 56x56 or 84x56 (4 or 6 image tokens), 1-5 completion tokens
    image = Image.new("RGB", (56 + 28 * (i % 3 == 0), 56), [(255, 0, 0), (0, 0, 255)][i % 2])
    enc = grpo.encode_prompt({"prompt": "What colour is the square?", "image": image}, proc, 512)
    samples.append({**enc, "completion_ids": torch.randint(20, 200, (1 + i % 5,), generator=g).tolist()})
T = 5
lens = torch.tensor([len(s["completion_ids"]) for s in samples])
mask = (torch.arange(T)[None] < lens[:, None]).double()  # [8, T]
mask[5] = 0  # a truncated completion, masked out
old_values, returns = (torch.randn(8, T, generator=g, dtype=torch.float64) for _ in range(2))
mine = slice(0, 8) if mode == "ref" else slice(4 * rank, 4 * rank + 4)

torch.manual_seed(0)
model = models.load_critic(path, dtype=torch.float64, freeze_vision=False)
torch.nn.init.normal_(model.score.weight, std=0.05)  # a non-zero head, so the backbone and vision tower get gradients
module = token_logprobs.TokenValues(model)
if mode != "ref":
    module = models.shard(module, torch.distributed.fsdp.MixedPrecisionPolicy())
full = lambda p: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()  # noqa: E731
before = {n: full(p) for n, p in module.named_parameters()}
opt = torch.optim.SGD(module.parameters(), lr=1.0)
critic = {"module": module, "optimizer": opt, "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
          "image_token_id": model.config.image_token_id, "placeholders": []}
batch = SimpleNamespace(samples=samples[mine], T=T, mask=mask[mine], old_values=old_values[mine], returns=returns[mine])
cfg = SimpleNamespace(micro_batch_size=8 if mode == "ref" else 3, micro_batch_tokens=0,
                      critic=SimpleNamespace(value_clip=0.5, max_grad_norm=1e9))
stats = ppo.update_critic(critic, batch, [torch.arange(len(batch.samples))], cfg, proc.tokenizer.pad_token_id,
                          torch.device("cpu"), world)
stats.pop("critic/lr")
step = {n: before[n] - full(p) for n, p in module.named_parameters()}
if mode == "ref":
    torch.save({"step": step, "stats": stats}, out_file)
    print("REF SAVED", flush=True)
else:
    want = torch.load(out_file)
    assert step.keys() == want["step"].keys()
    assert all(want["step"][n].abs().max() > 0 for n in step if ".visual." in n or "score" in n)  # they all train
    scale = max(v.abs().max().item() for v in want["step"].values())
    worst = max((step[n] - want["step"][n]).abs().max().item() for n in step) / scale
    assert worst <= 1e-9, worst
    for k, v in stats.items():
        assert abs(v - want["stats"][k]) <= 1e-9 * max(1.0, abs(v)), (k, v, want["stats"][k])
    print(f"rank {rank} CRITIC IMAGES INVARIANT OK (relative difference {worst:.1e})", flush=True)
dist.destroy_process_group()
