"""flow_grpo.py: Flow-GRPO (arXiv 2505.05470) for flow-matching image models, on grpo.py's building blocks.

    torchrun --nproc_per_node 2 flow_grpo.py                             # CPU: a tiny random SD3-style pipeline learns
    torchrun --nproc_per_node 8 flow_grpo.py --model stabilityai/stable-diffusion-3.5-medium --dataset prompts.txt \\
        --rewards mypkg.rewards:pickscore --resolution 512 --guidance-scale 4.5 --num-steps 10 --eval.num-steps 40
    python flow_grpo.py --help                                           # every flag, with its docstring

The method in five lines: docs/flow-grpo.md.

One step: prompts -> text embeddings -> SDE rollouts with log-probs -> rewards -> advantages -> num_iterations x
steps_per_generation optimizer steps -> log -> checkpoint; main() at the bottom reads as that list. The SDE and the
stages live here; the setup (pipeline, validation, resume, flag groups) in flow_launch.py; process groups in
distributed.py, checkpoints in checkpoints.py, metrics files in console.py; the Velocity module, the SDE step math,
the tiny pipelines, prompts and image rewards in images.py; the clipped objective in losses.py.
"""
import contextlib
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import tyro

import checkpoints
import console
import distributed
import images
import losses
import models
import optim
import rollout
import scoring
from flow_launch import EvalConfig, FlowCheckpointConfig, FlowEMAConfig, FlowLogConfig, FlowLoraConfig, FlowLossConfig, setup
from images import bcast, gaussian_kl, image_grid, sde_std, sde_step, step_sigmas
from optim import OptimConfig, trainable

# ---- Config: every field is a CLI flag (tyro); the docstring under it is its --help text ----

@dataclass
class Config:
    model: str = "builtin:tiny-flow"
    """A diffusers SD3 / SD3.5, FLUX.1 or Qwen-Image pipeline (hub id or local folder) with a
    FlowMatchEulerDiscreteScheduler; builtin:tiny-flow builds a tiny random SD3 pipeline offline, builtin:tiny-flux a
    FLUX.1 one, builtin:tiny-qwen-image a Qwen-Image one."""
    dataset: str = "colors"
    """Built-in prompts (colors: 'a red cat on a black background', with a `color` column), a .txt file (one prompt a
    line), a .jsonl/.parquet file or a hub dataset."""
    prompt_column: str = "prompt"
    """The dataset column that holds the prompt (the other columns go to the reward functions)."""
    output_dir: str = "outputs/flow"
    """Where metrics.jsonl, images/ and checkpoint-<step>/ go."""
    max_steps: int = 30
    """Number of steps (one step = one batch of rollouts and its optimizer updates)."""
    seed: int = 0
    """Base seed; every image gets its own noise stream from (seed, step, rank, index)."""
    resume: str | None = None
    """latest (newest checkpoint in output_dir; error if none) | auto (latest if any, else start fresh) | a path."""
    overwrite: bool = False
    """Start fresh in an output_dir that holds another run's checkpoints, deleting them and its metrics.jsonl."""
    num_generations: int = 4
    """G: images per prompt (one group; a group never spans ranks)."""
    batch_size: int = 8
    """Images per rank per step (a multiple of num_generations)."""
    micro_batch_size: int = 8
    """Images per transformer forward, when sampling and when training."""
    num_steps: int = 10
    """Denoising steps of the training rollouts (the paper's denoising reduction: 10 instead of 40)."""
    noise_level: float = 0.7
    """a in sigma_t = a sqrt(t / (1 - t)): the SDE's noise (the paper uses 0.7)."""
    guidance_scale: float = 1.5
    """Classifier-free guidance (1 = off), applied the same way when sampling and when recomputing log-probs: SD3's
    CFG, Qwen-Image's true CFG (true_cfg_scale, with its norm rescale), FLUX.1-dev's distilled guidance embedding."""
    negative_prompt: str = ""
    """The unconditional prompt of classifier-free guidance (SD3, Qwen-Image; Qwen-Image's examples use " ")."""
    resolution: int | None = None
    """Image height and width in pixels (default: the pipeline's; builtin:tiny-flow makes 8x8 images)."""
    guidance_grad: str = "cond"
    """cond: with CFG, train through the conditional prediction only, the unconditional one detached (train_sd3.py) |
    both: through both branches."""
    timestep_fraction: float = 1.0
    """The fraction of each image's denoising steps that train (the reference's SD3 configs: 0.99, i.e. 9 of 10)."""
    timestep_selection: str = "first"
    """first: the first int(num_steps x fraction) steps, as train_sd3.py | random: a random max(1, round(num_steps x
    fraction)) of them per image."""
    steps_per_generation: int = 2
    """Optimizer steps per batch of rollouts: each rank's images are shuffled and cut into this many parts, one step
    per part (gradients accumulated over its micro-batches); the reference takes 2, so the ratio leaves 1 and the clip
    acts on the second part."""
    num_iterations: int = 1
    """mu: passes over each batch of rollouts, each reshuffled and cut into steps_per_generation parts (the reference's
    num_inner_epochs, 1)."""
    scale_rewards: str = "global"
    """global: (r - its group's mean) / (std of every reward in the step's gathered batch, ddof 0, + 1e-4), and with
    G = 1 the batch mean as baseline (Flow-GRPO's global_std, in all its SD3 configs) | group: the group's std (Bessel)
    | batch: the batch's std (Bessel) | none."""
    adv_clip: float = 5.0
    """Clip advantages to [-adv_clip, adv_clip] (Flow-GRPO's adv_clip_max)."""
    rewards: tuple[str, ...] = ("brightness",)
    """Reward functions: brightness | target_color | jpeg_compressibility | jpeg_incompressibility |
    package.module:function, each fn(prompts, images, **columns) -> list[float | None]."""
    reward_weights: tuple[float, ...] = ()
    """One weight per reward function (default: all 1); the reward is their weighted sum (NaN ones left out)."""
    max_sequence_length: int = 128
    """Prompt tokens embedded: T5's (SD3, FLUX.1), Qwen2.5-VL's after its template (Qwen-Image, <= 1024)."""
    dtype: str = "auto"
    """The trained transformer's dtype: auto (fp32 master weights + bf16 compute on CUDA, fp32 on CPU) | float32 |
    bfloat16 | float64 (CPU tests against float64 references)."""
    lora: FlowLoraConfig = field(default_factory=lambda: FlowLoraConfig(r=8, alpha=16))
    """LoRA adapters on the transformer (r 0 = full fine-tuning)."""
    loss: FlowLossConfig = field(default_factory=FlowLossConfig)
    """The clipped policy loss over SDE steps and its KL to the reference."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-2, warmup_steps=0))
    """AdamW and its learning-rate schedule, gradient clipping."""
    ema: FlowEMAConfig = field(default_factory=FlowEMAConfig)
    """An exponential moving average of the trained weights, used for evaluation and saved with checkpoints."""
    log: FlowLogConfig = field(default_factory=FlowLogConfig)
    """The console and image grids."""
    wandb: console.WandbConfig = field(default_factory=lambda: console.WandbConfig(project="flow_grpo"))
    """Weights & Biases logging (off by default)."""
    checkpoint: FlowCheckpointConfig = field(default_factory=FlowCheckpointConfig)
    """How often checkpoints are written and how many are kept."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation with the plain ODE (noise 0)."""


# ---- Stages 1-3: prompts, text embeddings, SDE rollouts with per-step log-probs, decoding ----

def sample_prompts(run, step):
    """This rank's batch_size / G prompt rows: a function of (seed, step, rank) only, so resume is exact."""
    per_rank = run.cfg.batch_size // run.cfg.num_generations
    start = (step * run.world + run.rank) * per_rank
    return [run.rows[int(run.order[(start + i) % len(run.rows)])] for i in range(per_rank)]


def image_seeds(seed, step, part, n):
    """One noise seed per image, keyed by (seed, step, the image's place: part * n + index): rollout.py's streams."""
    return [s[0] for s in rollout.completion_seeds(seed, step, part * n, n, 1)]


@torch.no_grad()
def sample_sde(run, cond, seeds, num_steps, noise_level, shape):
    """Sample one image per seed with the SDE (noise_level 0: the ODE), step by step over micro-batches ->
    (latents [N, S + 1, C, h, w], log-probs [N, S], sigmas [S + 1])."""
    cfg, dev = run.cfg, run.device
    sigmas = step_sigmas(run.pipe.scheduler, num_steps, image_seq_len=shape[0])
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    draw = lambda: torch.stack([torch.randn(shape, generator=g) for g in gens]).to(dev)  # noqa: E731  [N, C, h, w]
    x, traj, logps = draw(), [], []
    run.module.eval()
    for i in range(num_steps):
        traj.append(x)
        noise, out = draw(), []
        for mb in torch.arange(len(seeds)).split(cfg.micro_batch_size):
            s = sigmas[i].expand(len(mb)).to(dev)  # [b]
            v = run.module(x[mb], s, pick(cond, mb), cfg.guidance_scale)
            out.append(sde_step(x[mb], v, bcast(s, x), sigmas[i + 1].to(dev), sigmas[1].to(dev), noise_level,
                                noise=noise[mb])[:2])  # (x_next [b, ...], log-prob [b])
        x, lp = (torch.cat(t) for t in zip(*out))
        logps.append(lp)
    traj.append(x)
    return torch.stack(traj, 1), torch.stack(logps, 1), sigmas  # [N, S+1, C, h, w], [N, S], [S+1]


def pick(cond, rows):
    """The rows' prompt encodings (and the shared negative prompt's, neg_*)."""
    return {k: v if k.startswith("neg_") else v[rows] for k, v in cond.items()}


def image_px(run):
    """Image height and width in pixels: --resolution, or the pipeline's default."""
    return run.cfg.resolution or run.pipe.default_sample_size * run.pipe.vae_scale_factor


def decode(run, latents):
    """Final latents [N, ...] -> PIL images through the frozen VAE."""
    pixels = images.decode_latents(run.pipe, latents, image_px(run), run.cfg.micro_batch_size)  # [N, 3, H, W]
    return run.pipe.image_processor.postprocess(pixels, output_type="pil")


def generate(run, prompts, step):
    """G images per prompt, each from its own noise stream -> this rank's batch (groups contiguous)."""
    cfg, G = run.cfg, run.cfg.num_generations
    rows = [r for r in prompts for _ in range(G)]  # [N = prompts * G]
    enc = images.encode_prompts(run.pipe, [r["prompt"] for r in prompts], run.device, cfg.max_sequence_length)
    cond = {**{k: v.repeat_interleave(G, 0) for k, v in enc.items()}, **run.neg}  # [N, ...] each
    latents, logps, sigmas = sample_sde(run, cond, image_seeds(cfg.seed, step, run.rank, len(rows)), cfg.num_steps,
                                     cfg.noise_level, images.latent_shape(run.pipe, image_px(run)))
    return {"rows": rows, "cond": cond, "latents": latents, "logps": logps, "sigmas": sigmas,
            "images": decode(run, latents[:, -1])}


# ---- Stages 4-5: rewards and group advantages over the global batch ----

def score(run, batch):
    """Rewards [N, K] (NaN = does not apply, raised or NaN/inf; scoring.score_rewards, as grpo.py) and the global count
    of failed images in batch["n_failed"]; stops when every function failed on every image (nothing to learn from)."""
    rows = batch["rows"]
    rewards, failed = scoring.score_rewards(run.reward_fns, rows, batch["images"], [None] * len(rows), run.printed_errors)
    n = distributed.global_sums({**{f"failed/{k}": f for k, f in enumerate(failed)}, "images": len(rows)}, run.device)
    if all(n[f"failed/{k}"] == n["images"] for k in range(len(failed))):
        raise console.UserError("every reward function failed (raised, or returned NaN/inf) on every image of this "
                                "step: stopping (see the messages above). Fix the reward functions, "
                                f"{checkpoints.go_on(run.cfg.output_dir)}.")
    batch["n_failed"] = sum(n[f"failed/{k}"] for k in range(len(failed)))
    return rewards  # [N, K]


def global_std_advantages(rewards, G, eps=1e-4):
    """Flow-GRPO's PerPromptStatTracker(global_std=True) (train_sd3.py): (r - its group's mean) / (std of every reward,
    ddof 0, + eps); G = 1: (r - batch mean) / (batch std + eps), its fallback. rewards [M] (NaN: unscorable, advantage
    0, left out of the statistics) -> [M]."""
    ok = ~rewards.isnan()  # [M]
    r = rewards.nan_to_num()
    groups, n = (r * ok).view(-1, G).sum(-1), ok.view(-1, G).sum(-1).clamp(min=1)  # [M / G]
    mean = (groups / n).repeat_interleave(G) if G > 1 else r[ok].mean()  # [M] or a scalar
    return torch.where(ok, (r - mean) / (r[ok].std(correction=0) + eps), 0.0)  # [M]


def compute_advantages(run, rewards):
    """GRPO advantages (arXiv 2402.03300) from every rank's rewards, clipped to +-adv_clip -> this rank's [N]."""
    cfg, N, G = run.cfg, rewards.shape[0], run.cfg.num_generations
    everyone = distributed.all_gather_cat(rewards.to(run.device)).cpu()  # [world * N, K], groups contiguous
    if cfg.scale_rewards == "global":
        total = (everyone * torch.tensor(run.weights, dtype=everyone.dtype)).nansum(-1)  # [world * N]
        adv = global_std_advantages(total.masked_fill(everyone.isnan().all(-1), float("nan")), G)
    else:
        adv = losses.group_advantages(everyone, run.weights, G, scale=cfg.scale_rewards)
    return adv.clamp(-cfg.adv_clip, cfg.adv_clip)[run.rank * N:(run.rank + 1) * N].to(run.device)  # [N]


# ---- Stage 6: policy updates. Denoising steps are the tokens of losses.policy_loss; one backward per (step, micro-batch),
# every rank running the same number of them (FSDP2 collectives), padded with zero-weight micro-batches.

def train_steps(run, advantages, step):
    """The denoising steps each image trains on -> bool [n, S]: the first int(S x timestep_fraction) (train_sd3.py),
    or a random subset per image. An image whose advantage is exactly 0 trains none (train_sd3.py drops those)."""
    S, frac, n = run.cfg.num_steps, run.cfg.timestep_fraction, len(advantages)
    if run.cfg.timestep_selection == "first":
        steps = (torch.arange(S) < int(S * frac)).expand(n, S)  # [n, S]
    else:
        g = torch.Generator().manual_seed(run.cfg.seed * 1_000_003 + step * 1009 + run.rank)  # resume-exact
        ranks = torch.stack([torch.randperm(S, generator=g) for _ in range(n)])  # [n, S]: a random order of the steps
        steps = ranks < max(1, round(S * frac))  # [n, S]: the first K of each order
    return steps & (advantages != 0).cpu()[:, None]  # [n, S]


def update_parts(run, n, step):
    """This rank's images of each optimizer step: num_iterations passes, each a fresh shuffle of the n images
    (train_sd3.py's perm) cut into steps_per_generation equal parts -> [tensor of indices]. Resume-exact."""
    g = torch.Generator().manual_seed((run.cfg.seed * 1_000_003 + step * 1009 + run.rank) * 2 + 1)
    k = run.cfg.steps_per_generation
    return [perm.view(k, -1)[j] for perm in (torch.randperm(n, generator=g) for _ in range(run.cfg.num_iterations))
            for j in range(k)]


def ema_decay(k, decay, every, repeat=1):
    """The EMA decay after optimizer step k (1-based), or None when step k does not update it: Flow-GRPO's
    EMAModuleWrapper.step (decay warm-up min((1 + k) / (10 + k), decay), every `every` steps), applied `repeat` times
    with the same weights (train_sd3.py's one call per sample batch) -> that decay ** repeat."""
    return min((1 + k) / (10 + k), decay) ** repeat if (k + 1) % every == 0 else None


def step_kl(run, x, s, cond, sigmas, i, mean, scale):
    """Per image, the KL term of step i against the reference policy (the frozen copy, or the policy with its LoRA
    adapters disabled) -> [b]: train_sd3.py's kl_loss |mu - mu_ref|^2 / (2 s_t^2) (--loss.kl-form reference), or the
    Gaussian steps' exact KL, the same over |dt| (exact)."""
    lora = run.ref_module is None
    with torch.no_grad(), models.adapters_off(run.transformer) if lora else contextlib.nullcontext():
        v = (run.module if lora else run.ref_module)(x, s, cond, run.cfg.guidance_scale)
        ref = sde_step(x, v, bcast(s, x), sigmas[i + 1], sigmas[1], run.cfg.noise_level, x_next=x)[2]
    if run.cfg.loss.kl_form == "reference":
        scale = sde_std(bcast(s, x).to(mean.dtype), sigmas[1].to(mean.dtype), run.cfg.noise_level)  # s_t, no sqrt(|dt|)
    return gaussian_kl(mean, ref, scale)  # [b]


def accumulate_gradients(run, batch, loss_cfg, rows, first_pass):
    """Forward + backward over every (denoising step, micro-batch) of this rank's images `rows` -> global stats."""
    cfg, dev, sigmas = run.cfg, run.device, batch["sigmas"].to(run.device)
    chosen = torch.zeros_like(batch["train"])  # [N, S] bool: the steps of `rows` that train
    chosen[rows] = batch["train"][rows]
    n_items = distributed.global_sums({"n": chosen.sum().item()}, dev)["n"] / run.world  # this rank's share
    n_chunks = distributed.global_sums({f"step/{i}": math.ceil(c / cfg.micro_batch_size)  # the busiest rank's, per step
                                        for i, c in enumerate(chosen.sum(0).tolist())}, dev, dist.ReduceOp.MAX)
    loss_total, sums = 0.0, {}
    add = lambda k, v, w: sums.update({k: sums.get(k, 0.0) + v * w, k + "/weight": sums.get(k + "/weight", 0.0) + w})  # noqa
    for i in range(cfg.num_steps):
        rows = chosen[:, i].nonzero().squeeze(-1)
        for c in range(int(n_chunks[f"step/{i}"])):
            mb = rows[c * cfg.micro_batch_size:(c + 1) * cfg.micro_batch_size]
            weight = 1.0 if len(mb) else 0.0  # an empty chunk still runs (on row 0) so that every rank calls FSDP alike
            mb = mb if len(mb) else torch.zeros(1, dtype=torch.long)
            x, s = batch["latents"][mb, i], sigmas[i].expand(len(mb))
            v = run.module(x, s, pick(batch["cond"], mb), cfg.guidance_scale,
                           detach_uncond=cfg.guidance_grad == "cond")  # train_sd3.py trains the conditional branch
            _, lp, mean, scale = sde_step(x, v, bcast(s, x), sigmas[i + 1], sigmas[1], cfg.noise_level,
                                          x_next=batch["latents"][mb, i + 1])
            old = batch["logps"][mb, i]
            loss, m = losses.policy_loss(lp[:, None], old[:, None], batch["advantages"][mb], torch.ones_like(lp[:, None]),
                                         loss_cfg, num_items=n_items)  # [b, 1]: this step as one token per image
            if cfg.loss.beta:
                kl = step_kl(run, x, s, pick(batch["cond"], mb), sigmas, i, mean, scale)  # [b]
                loss = loss + cfg.loss.beta * kl.sum() / n_items
                add("kl", kl.mean().item(), weight * len(mb))
            (loss * weight).backward()
            loss_total += loss.item() * weight
            w = weight * len(mb)
            for k in ("clip_ratio/region", "clip_ratio/low_mean", "clip_ratio/high_mean", "ratio/mean"):
                add(k, m[k].item(), w)
            add(f"clip_ratio/step_{i}", m["clip_ratio/region"].item(), w)
            if first_pass:  # sampler vs trainer log-probs of the same steps, before any update
                add("logprob_mismatch/mean_abs", (lp.detach() - old).abs().mean().item(), w)
    totals = distributed.global_sums({"loss": loss_total, **sums}, dev)  # a weighted sum and its weight per metric
    return {"loss": totals["loss"] / run.world, **{k: totals[k] / max(totals[k + "/weight"], 1e-12)
                                                   for k in sums if not k.endswith("/weight")}}


def update(run, batch, step):
    """num_iterations x steps_per_generation optimizer steps, each over one part of the batch, then the EMA's turn ->
    per-update stats. SIGTERM: stop early."""
    cfg = run.cfg
    clip = ("loss_type", "epsilon", "epsilon_high", "delta", "dual_clip")  # beta 0 there: the KL term is added here
    loss_cfg = losses.LossConfig(**{k: getattr(cfg.loss, k) for k in clip})
    params = run.optimizer.param_groups[0]["params"]
    run.module.train()
    stats = []
    for k, rows in enumerate(update_parts(run, len(batch["rows"]), step)):
        s = accumulate_gradients(run, batch, loss_cfg, rows, first_pass=k == 0)
        grad_norm, skipped = optim.optimizer_step(params, run.optimizer, run.scheduler, cfg.optim.max_grad_norm,
                                                     s["loss"])
        run.updates += 1
        decay = ema_decay(run.updates, cfg.ema.decay, cfg.ema.every, cfg.ema.repeat) if run.ema else None
        if decay is not None:
            optim.ema_update(run.ema, trainable(run.module), decay)
        stats.append({**s, "grad_norm": grad_norm, "skipped_updates": float(skipped)})
        if checkpoints.preempted(run):
            break
    return stats


# ---- Stages 7-8: metrics, images, evaluation, checkpoints ----

def step_metrics(run, step, rewards, stats, times, n_failed):
    """One metrics.jsonl row: global over ranks; update stats averaged over the step's updates (mismatch: the first)."""
    dev, G = run.device, run.cfg.num_generations
    total = (rewards * torch.tensor(run.weights)).nansum(-1)  # [N] weighted
    everyone = distributed.all_gather_cat(total.to(dev)).cpu()  # [world * N]
    fns = [name for name, _ in run.reward_fns]
    n = distributed.global_sums({**{f"{f}/sum": rewards[:, k].nansum().item() for k, f in enumerate(fns)},
                                 **{f"{f}/count": (~rewards[:, k].isnan()).sum().item() for k, f in enumerate(fns)}}, dev)
    return {"step": step + 1, "reward/mean": everyone.mean().item(), "reward/std": everyone.std().item(),
            "reward/failed": n_failed,
            **{f"reward/{name}/mean": n[f"{name}/sum"] / max(n[f"{name}/count"], 1) for name, _ in run.reward_fns},
            "frac_zero_std": (everyone.view(-1, G).std(-1) < 1e-6).float().mean().item(),
            **{k: float(np.mean([s[k] for s in stats if k in s])) for k in dict.fromkeys(k for s in stats for k in s)
               if k != "skipped_updates"},  # a part whose images all have advantage 0 trains nothing: no clip stats
            "skipped_updates": sum(s["skipped_updates"] for s in stats), "lr": run.scheduler.get_last_lr()[0],
            **{f"time/{k}": v for k, v in times.items()}, "images_per_s": len(everyone) / times["step"],
            "mem/peak_gb": distributed.peak_mem_gb(dev)}


def save_grid(run, images, n_cols, captions, name, step):
    """Rank 0: <output-dir>/images/<name>.png, and to wandb when enabled."""
    grid = image_grid(images, n_cols, captions)
    grid.save(os.path.join(run.cfg.output_dir, "images", f"{name}.png"))
    if run.cfg.wandb.mode != "disabled":
        import wandb
        wandb.log({name.rsplit("-", 1)[0]: wandb.Image(grid)}, step=step)


def evaluate(run, step):
    """Held-out prompts, one image each with the ODE (noise 0) in eval.num_steps steps -> {eval/reward}; rank 0 writes
    all of them as a grid. The seeds are fixed, so successive grids start from the same noise."""
    cfg = run.cfg
    rows = run.eval_rows[run.rank::run.world]
    enc = images.encode_prompts(run.pipe, [r["prompt"] for r in rows], run.device, cfg.max_sequence_length)
    cond = {**enc, **run.neg}
    with optim.ema_weights(run.ema, trainable(run.module)):  # the EMA's weights when on (as train_sd3.py's eval)
        seeds = [image_seeds(cfg.seed + 1, -1, i, 1)[0] for i in range(run.rank, len(run.eval_rows), run.world)]
        latents, _, _ = sample_sde(run, cond, seeds, cfg.eval.num_steps, 0.0,  # (each row's seed: its place)
                                   images.latent_shape(run.pipe, image_px(run)))
    batch = {"rows": rows, "images": decode(run, latents[:, -1])}
    total = (score(run, batch) * torch.tensor(run.weights)).nansum(-1)
    s = distributed.global_sums({"reward": total.sum().item(), "prompts": len(rows)}, run.device)
    everyone = distributed.all_gather_cat(latents[:, -1].contiguous())  # [num_prompts, C, h, w], rank by rank
    if run.rank == 0:
        captions = [r["prompt"] for k in range(run.world) for r in run.eval_rows[k::run.world]]
        save_grid(run, decode(run, everyone), 1, captions, f"eval-step-{step}", step)
    return {"eval/reward": s["reward"] / max(s["prompts"], 1)}


def log_step(run, row, batch, bar):
    """metrics.jsonl, a stdout line, wandb, and every log.images_every steps a grid of the rollouts (rank 0)."""
    cfg = run.cfg
    if run.rank != 0:
        return
    line = (f"step {row['step']}/{cfg.max_steps} reward {row['reward/mean']:.3f} loss {row['loss']:.4f} "
            f"clip {row.get('clip_ratio/region', 0):.3f} mismatch {row.get('logprob_mismatch/mean_abs', 0):.1e} "
            f"{row['time/step']:.2f}s/step {row['images_per_s']:.1f} img/s"
            + (f" kl {row['kl']:.2e}" if "kl" in row else "") + (f" eval {row['eval/reward']:.3f}" if "eval/reward" in row else ""))
    console.log_row(run.metrics_path, row, line, bar, cfg.wandb.mode)
    if cfg.log.images_every and row["step"] % cfg.log.images_every == 0:
        G = cfg.num_generations
        save_grid(run, batch["images"], G, [r["prompt"] for r in batch["rows"][::G]], f"train-step-{row['step']}",
                  row["step"])


def save(run, steps_done):
    """(collective) checkpoint-<steps_done>: the transformer (the adapter with LoRA) under transformer/ (+ the EMA's
    under ema/transformer), sharded model + optimizer (+ EMA), RNG, trainer state."""
    return checkpoints.save_run(run, steps_done, {"updates": run.updates}, run.transformer, None, subdir=("transformer",))


# ---- Main: the table of contents ----

def main(cfg: Config):
    t_start = time.time()
    run = setup(cfg)
    bar = console.start_logging(cfg, run.rank, run.start_step)  # rank 0: wandb and the progress bar
    if cfg.eval.every and run.start_step == 0:  # the baseline before any update, logged as step 0
        row0 = {"step": 0, **evaluate(run, 0)}
        if run.rank == 0:
            console.append_metrics(run.metrics_path, row0)

    for step in range(run.start_step, cfg.max_steps):
        t0 = time.time()
        # ---- 1. sample prompts: each rank its own; a group of G stays on one rank ----
        prompts = sample_prompts(run, step)
        # ---- 2-3. encode them and sample G images per prompt with the SDE, recording per-step log-probs ----
        batch = generate(run, prompts, step)
        t_sample = time.time() - t0
        # ---- 4. rewards [N, K] ----
        rewards = score(run, batch)
        # ---- 5. group advantages over the global batch; the denoising steps each image trains on ----
        batch["advantages"] = compute_advantages(run, rewards)
        batch["train"] = train_steps(run, batch["advantages"], step)
        # ---- 6. policy updates: num_iterations passes over the batch, steps_per_generation optimizer steps each ----
        t_train = time.time()
        stats = update(run, batch, step)
        t_train = time.time() - t_train
        if len(stats) < cfg.num_iterations * cfg.steps_per_generation:  # SIGTERM between updates: save; resume reruns
            checkpoints.maybe_save(run, step, save)
            break
        run.bad_steps = run.bad_steps + 1 if all(s["skipped_updates"] for s in stats) else 0
        # ---- 7. log (and evaluate) ----
        times = {"sample": t_sample, "train": t_train, "step": time.time() - t0}
        row = step_metrics(run, step, rewards, stats, times, batch["n_failed"])
        if cfg.eval.every and (step + 1) % cfg.eval.every == 0:
            row.update(evaluate(run, step + 1))
        log_step(run, row, batch, bar)
        distributed.release_memory()
        # ---- 8. checkpoint; stop on preemption or repeated bad steps ----
        if checkpoints.maybe_save(run, step + 1, save):
            break

    if bar:
        bar.close()
    if run.rank == 0:
        console.print_done(run.metrics_path, t_start)
    dist.destroy_process_group()


if __name__ == "__main__":
    console.run_script(main, tyro.cli(Config))
