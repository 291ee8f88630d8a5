"""optim.py: the optimizer side of an update, shared by grpo.py and flow_grpo.py: AdamW's flags and their checks, the
clipped step that skips a NaN/Inf update, the learning-rate schedule, and the EMA of the weights.
"""
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from distributed import full_tensor, release_memory


@dataclass
class OptimConfig:
    lr: float | None = None
    """Peak learning rate (AdamW). Default: 1e-6 (TRL's), 1e-3 for the built-in tiny models (flags.fill_defaults)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    warmup_steps: int = 5
    """Linear warmup, in optimizer updates."""
    schedule: str = "constant"
    """constant | cosine (after warmup, to 10% of lr at the last update)."""
    max_grad_norm: float = 1.0
    """Gradient clipping (global norm)."""


def check_optim(optim):
    """--optim.*: refused by flag before torch's own message ('Invalid learning rate'), or before a silent wrong run
    (clip_grad_norm_ with max_norm 0 zeroes every gradient; below 0 it flips their sign)."""
    problems = {f"--optim.lr {optim.lr} must be > 0 (e.g. 1e-6 for a full model, 1e-5 for LoRA)": not optim.lr > 0,
                f"--optim.betas {optim.betas} must both be in [0, 1)": not all(0 <= b < 1 for b in optim.betas),
                f"--optim.weight-decay {optim.weight_decay} must be >= 0": not optim.weight_decay >= 0,
                f"--optim.warmup-steps {optim.warmup_steps} must be >= 0": optim.warmup_steps < 0,
                f"--optim.max-grad-norm {optim.max_grad_norm} must be > 0 (inf = no clipping)": not optim.max_grad_norm > 0}
    for message, bad in problems.items():
        if bad:
            raise ValueError(message)


@dataclass
class EMAConfig:
    decay: float = 0.0
    """EMA of the trainable parameters, updated after each optimizer step: e <- decay e + (1 - decay) p (0 = off;
    LightRFT uses 0.992). Sharded like the policy; saved as checkpoint-N/ema/ (HF format) and resumed exactly."""


def optimizer_step(params, optimizer, scheduler, max_grad_norm, loss_value):
    """Clip and step; a NaN/Inf loss or gradient norm skips the step (grads dropped). -> (grad_norm, skipped).
    loss_value must be the same on every rank (a global reduction) so that all ranks skip together."""
    grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    skipped = not (math.isfinite(loss_value) and torch.isfinite(grad_norm).item())
    if not skipped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    release_memory()  # the freed gradients and activations: back to the OS (CPU RSS would creep up otherwise)
    return grad_norm.item(), skipped


def ema_init(named_params, decay):
    """{name: float32 copy of the (sharded) parameter}, or None when decay is 0. Float32 because with bf16 weights
    the (1 - decay) x step increments (0.008 x lr-sized) would round away."""
    return {n: p.detach().float().clone() for n, p in named_params} if decay else None


@torch.no_grad()
def ema_update(ema, named_params, decay):
    """Polyak averaging of the iterates (Polyak & Juditsky 1992): e <- decay e + (1 - decay) p, shard by shard."""
    for n, p in named_params:
        ema[n].lerp_(p.detach().float(), 1 - decay)


@contextmanager
def ema_weights(ema, named_params):
    """The EMA weights in the live parameters for the block (evaluation, saving), then the live ones back, bit for
    bit. A no-op when ema is None."""
    named = list(named_params) if ema is not None else []
    live = {n: p.detach().clone() for n, p in named}
    for n, p in named:  # (copies into detached views: nothing for autograd to record)
        p.detach().copy_(ema[n])
    try:
        yield
    finally:
        for n, p in named:
            p.detach().copy_(live[n])


def adamw(params, c, betas, total_updates, fused=None):
    """AdamW over `params` at c.lr / c.weight_decay, with lr_lambda's schedule (c.warmup_steps, c.schedule) ->
    (optimizer, scheduler). fused=True: one kernel over all shards (FSDP2's per-tensor DTensor path cost 31 vs 4 ms)."""
    optimizer = torch.optim.AdamW(params, lr=c.lr, betas=betas, weight_decay=c.weight_decay, fused=fused)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(c.warmup_steps, c.schedule, total_updates))


def lr_lambda(warmup_steps, schedule, total_updates):
    """Linear warmup, then constant or cosine decay to 10% of the peak lr at the last update."""
    def f(u):
        if u < warmup_steps:
            return (u + 1) / (warmup_steps + 1)
        if schedule == "cosine":
            progress = (u - warmup_steps) / max(1, total_updates - warmup_steps)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0
    return f


def trainable(module):
    """[(name, parameter)] that the optimizer updates (and the EMA averages)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]
