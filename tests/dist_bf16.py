"""torchrun --nproc_per_node 2 tests/dist_bf16.py MODEL_DIR: --policy.dtype bfloat16 builds the mixed-precision policy
on CPU exactly as on CUDA (launch.build_policy): bf16 compute, fp32 master weights, fp32 gradients (reduced in fp32),
fp32 log-probs out of the fused head, fp32 AdamW state. Its first-step gradient on a fixed batch is compared with the
--policy.dtype float32 gradient of the same batch on the same ranks (the reference). Used by tests/test_distributed.py.

Tolerance: bf16 keeps 8 significant bits, so one rounding of an activation or weight is off by at most 2^-9 ~ 0.002
relative. The gradient of this 2-layer model passes through ~25 such roundings (weights cast once; per layer: the
attention and MLP inputs and outputs forward, the same backward); their errors add at worst linearly, ~0.05. The
per-tensor relative error ||g_bf16 - g_fp32|| / ||g_fp32|| must stay below 0.05, and above 1e-4 (an fp32 run of the
same batch differs by ~1e-7, so a smaller error means bf16 compute never happened).
"""
import dataclasses
import sys

import torch
import torch.distributed as dist

import distributed
import grpo
import launch

path = sys.argv[1]
rank, world, device = distributed.setup_distributed()
g = torch.Generator().manual_seed(0)
samples = [{"prompt_ids": torch.randint(2, 50, (int(torch.randint(3, 8, (), generator=g)),), generator=g).tolist(),
            "completion_ids": torch.randint(2, 50, (int(torch.randint(2, 7, (), generator=g)),), generator=g).tolist()}
           for _ in range(8)]
adv = torch.randn(8, generator=g)
mine = list(range(rank * 4, rank * 4 + 4))  # each rank holds half of the batch
T = max(len(s["completion_ids"]) for s in samples)


def first_step(dtype):
    """Build the policy as grpo.py does for --policy.dtype `dtype`; one loss on the fixed batch, backward, AdamW step.
    -> (built, this rank's log-probs [4, T], {name: full fp32 gradient})."""
    cfg = grpo.Config(model=path, policy=dataclasses.replace(grpo.Config().policy, dtype=dtype), optim=grpo.OptimConfig(lr=3e-3))
    torch.manual_seed(0)
    built = launch.build_policy(cfg, path, device)
    module = built["module"]
    lp, ent = module(grpo.collate([samples[i] for i in mine], 0, device, T), 0.7, with_entropy=True)  # [4, T]
    mask = (torch.arange(T)[None] < torch.tensor([len(samples[i]["completion_ids"]) for i in mine])[:, None]).float()
    (-((lp * adv[mine, None] + 0.01 * ent) * mask).sum() / mask.sum()).backward()
    grads = {n: p.grad.full_tensor() for n, p in module.named_parameters()}
    return built, lp.detach(), grads


built32, lp32, g32 = first_step("float32")
built16, lp16, g16 = first_step("bfloat16")
assert built16["precision"]["sync"] == torch.bfloat16 and built32["precision"]["sync"] == torch.float32  # the engine follows
# fp32 master weights and gradients; fp32 log-probs from the fused head (it accumulates bf16 logits in fp32)
for n, p in built16["module"].named_parameters():
    assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, (n, p.dtype, p.grad.dtype)
assert lp16.dtype == torch.float32, lp16.dtype
# the policy FSDP2 applies: bf16 compute, fp32 reduction, on every sharded unit (a bf16 reduce_dtype moves the
# gradient by only ~0.2% here, far inside the tolerance below, so it is checked where it is set)
units = [m for m in built16["module"].modules() if hasattr(m, "_get_fsdp_state")]
assert units and all(u._get_fsdp_state()._mp_policy.reduce_dtype == torch.float32 for u in units)
assert sum(u._get_fsdp_state()._mp_policy.param_dtype == torch.bfloat16 for u in units) >= 2  # the decoder layers
lp_err = (lp16 - lp32).abs().max().item()
assert 1e-4 < lp_err < 0.1, lp_err  # bf16 logits of O(1) values: off by ~1e-2 nats at most
worst, least = 0.0, 1.0
for n in g32:
    rel = ((g16[n] - g32[n]).norm() / g32[n].norm().clamp(min=1e-20)).item()
    worst, least = max(worst, rel), min(least, rel)
    assert rel < 0.05, (n, rel)
assert worst > 1e-4, worst  # the bf16 path really ran
if rank == 0:
    print(f"bf16 vs fp32: log-probs max abs diff {lp_err:.2e}; gradient relative error per tensor "
          f"{least:.2e}..{worst:.2e}", flush=True)
print(f"rank {rank} BF16 GRADS OK", flush=True)

opt = built16["optimizer"]
opt.step()
for group in opt.param_groups:
    for p in group["params"]:
        assert p.dtype == torch.float32
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][k].dtype == torch.float32, (k, opt.state[p][k].dtype)
print(f"rank {rank} FP32 STATE OK", flush=True)

# --policy.fp32-lm-head: the final norm, the head and the log-softmax in fp32 on the bf16 decoder's output, in the
# trainer (FSDP2 root in fp32) and in the HF engine. Reference: a plain bf16 transformers model's last decoder output
# (the final norm's input), then RMSNorm, head and log-softmax in float64 from the fp32 checkpoint's weights.
import models  # noqa: E402
import rollout  # noqa: E402
import weight_sync  # noqa: E402

cfg = grpo.Config(model=path, policy=dataclasses.replace(grpo.Config().policy, dtype="bfloat16", fp32_lm_head=True),
                  optim=grpo.OptimConfig(lr=3e-3))
builth = launch.build_policy(cfg, path, device)
batch = grpo.collate([samples[i] for i in mine], 0, device, T)
with torch.no_grad():
    lp_head = builth["module"](batch, 0.7)[0]  # [4, T]
    plain, _ = models.load_policy(path, dtype=torch.bfloat16)
    fp32, _ = models.load_policy(path)
    seen = []
    plain.model.norm.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    x = seen[0].double()  # [4, L, H]
    eps = plain.config.rms_norm_eps
    h = x * (x.square().mean(-1, keepdim=True) + eps).rsqrt() * fp32.model.norm.weight.double()
    ref_all = (h @ fp32.lm_head.weight.double().T / 0.7).log_softmax(-1)  # [4, L, V]
    engine = rollout.HFEngine(path, seed=0, dtype=torch.bfloat16, fp32_lm_head=True)
    engine.load_weights(weight_sync.iter_engine_weights(fp32, torch.float32))  # the first sync sends fp32 (precision()["sync"])
    logits = engine.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    eng_all = (logits.double() / 0.7).log_softmax(-1)  # [4, L, V]
cm = batch["logprob_mask"]
rows, cols = cm.nonzero().unbind(1)
at = batch["hidden_index"][rows, cols]  # flat [row * L + position] of the state that predicts each token
tg = batch["targets"][rows, cols]
ref = ref_all.flatten(0, 1)[at, tg]
eng = eng_all.flatten(0, 1)[at, tg]
errs = {"trainer": (lp_head[rows, cols].double() - ref).abs().max().item(), "engine": (eng - ref).abs().max().item(),
        "bf16 trainer": (lp16[rows, cols].double() - ref).abs().max().item()}
if rank == 0:
    print("fp32 lm-head vs the float64 reference, max abs:", {k: f"{v:.1e}" for k, v in errs.items()}, flush=True)
assert errs["trainer"] < 1e-5 and errs["engine"] < 1e-5 and errs["bf16 trainer"] > 1e-4, errs
print(f"rank {rank} FP32 HEAD OK", flush=True)
dist.destroy_process_group()
