"""flow_grpo.py: the SDE step against float64 references written from the paper's equations and diffusers' own Euler
step; log-probs, ratios, KL and gradients of the training path against the sampler; one training step against a
float64 re-implementation of the authors' train_sd3.py step on the same batch; the real script under torchrun."""
import json
import math
import os
import shutil
import signal
import socket

import numpy as np
import pytest
import torch
from conftest import torchrun
from safetensors.torch import load_file

# ----------------------------------------------------------------------------------------------------------
# The SDE step (pure functions) against independent references
# ----------------------------------------------------------------------------------------------------------

def paper_step(x, v, t, t_next, a, sigma_max, noise):
    """Flow-GRPO (arXiv 2505.05470) eq. 9, element by element in float64 Python floats:
    sigma_t = a sqrt(t / (1 - t)) (t = 1 uses 1 - sigma_max), dt = t_next - t,
    x_next = x + [v + sigma_t^2 / (2t) (x + (1 - t) v)] dt + sigma_t sqrt(-dt) eps,
    log p = sum over dims of log N(x_next; mean, sigma_t^2 (-dt)) / dims."""
    s = a * math.sqrt(t / (1 - (sigma_max if t == 1 else t)))
    dt = t_next - t
    sd = s * math.sqrt(-dt)
    means = [xi + (vi + s * s / (2 * t) * (xi + (1 - t) * vi)) * dt for xi, vi in zip(x, v)]
    nexts = [m + sd * e for m, e in zip(means, noise)]
    logp = sum(-0.5 * ((y - m) / sd) ** 2 - math.log(sd) - 0.5 * math.log(2 * math.pi) for y, m in zip(nexts, means))
    return nexts, logp / len(x), means, sd


def test_sde_step_and_logprob_match_float64_paper_reference():
    from diffusers import FlowMatchEulerDiscreteScheduler

    import flow_grpo
    sigmas = flow_grpo.step_sigmas(FlowMatchEulerDiscreteScheduler(shift=3.0), 10).double()
    assert sigmas[0] == 1 and sigmas[-1] == 0 and len(sigmas) == 11
    g = torch.Generator().manual_seed(0)
    for i in (0, 3, 9):  # the t = 1 step, a middle one, the last one (to t = 0)
        x, v, eps = (torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64) for _ in range(3))
        s = sigmas[i].expand(2).view(-1, 1, 1, 1)
        x_next, logp, mean, scale = flow_grpo.sde_step(x, v, s, sigmas[i + 1], sigmas[1], 0.7, noise=eps)
        assert x_next.dtype == torch.float64
        for b in range(2):
            ref_next, ref_logp, ref_mean, ref_sd = paper_step(x[b].flatten().tolist(), v[b].flatten().tolist(),
                                                              sigmas[i].item(), sigmas[i + 1].item(), 0.7,
                                                              sigmas[1].item(), eps[b].flatten().tolist())
            torch.testing.assert_close(x_next[b].flatten(), torch.tensor(ref_next, dtype=torch.float64), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(mean[b].flatten(), torch.tensor(ref_mean, dtype=torch.float64), rtol=1e-12, atol=1e-12)
            assert logp[b].item() == pytest.approx(ref_logp, rel=1e-12, abs=1e-12)
            assert scale[b].item() == pytest.approx(ref_sd, rel=1e-12)
        # the log-prob of a given x_next (the training path) is the same number; the KL is torch's closed form
        assert torch.equal(flow_grpo.sde_step(x, v, s, sigmas[i + 1], sigmas[1], 0.7, x_next=x_next)[1], logp)
        ref_mean = mean + 0.1 * torch.randn(mean.shape, generator=g, dtype=torch.float64)
        kl = torch.distributions.kl_divergence(torch.distributions.Normal(mean, scale),
                                               torch.distributions.Normal(ref_mean, scale)).flatten(1).mean(-1)
        torch.testing.assert_close(flow_grpo.gaussian_kl(mean, ref_mean, scale), kl, rtol=1e-12, atol=1e-15)


def test_noise_level_zero_is_the_schedulers_euler_step():
    """With --noise-level 0 the sampler is diffusers' own FlowMatchEulerDiscreteScheduler.step, step for step."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    import flow_grpo
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sigmas = flow_grpo.step_sigmas(sched, 8)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 4, generator=g)
    ours = x.clone()
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(2, 3, 4, 4, generator=g)
        x = sched.step(v, t, x, return_dict=False)[0]
        ours, logp, _, _ = flow_grpo.sde_step(ours, v, sigmas[i].expand(2).view(-1, 1, 1, 1), sigmas[i + 1],
                                              sigmas[1], 0.0)
        torch.testing.assert_close(ours, x, rtol=1e-6, atol=1e-6)
        assert not logp.any()


# ----------------------------------------------------------------------------------------------------------
# The training path in one process (a gloo world of one), the tiny built-in pipeline
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def world():
    """A gloo world of one in this process, which every flow_grpo.setup of this module joins."""
    import torch.distributed as dist
    env, handler, threads = dict(os.environ), signal.getsignal(signal.SIGTERM), torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is faster, and spinning threads stall on a shared machine
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
        signal.signal(signal.SIGTERM, handler)
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run(world, tmp_path_factory):
    """flow_grpo.setup in this process: LoRA, beta > 0 (reference = adapters disabled), CFG on, 5 steps."""
    import flow_grpo
    cfg = flow_grpo.Config(output_dir=str(tmp_path_factory.mktemp("flow")), num_steps=5, guidance_scale=2.0,
                           batch_size=8, micro_batch_size=8, log=flow_grpo.FlowLogConfig(verbose=True))
    cfg.loss.beta = 0.1
    return flow_grpo.setup(cfg)


def trainer_logps(run, batch, micro_batch_size):
    """Per-step log-probs of the recorded trajectories recomputed by the training forward, in micro-batches."""
    import flow_grpo
    sig = batch["sigmas"]
    out = torch.zeros_like(batch["logps"])
    with torch.no_grad():
        for i in range(run.cfg.num_steps):
            for mb in torch.arange(len(batch["rows"])).split(micro_batch_size):
                x, s = batch["latents"][mb, i], sig[i].expand(len(mb))
                v = run.module(x, s, flow_grpo.pick(batch["cond"], mb), run.cfg.guidance_scale)
                out[mb, i] = flow_grpo.sde_step(x, v, s.view(-1, 1, 1, 1), sig[i + 1], sig[1], run.cfg.noise_level,
                                                x_next=batch["latents"][mb, i + 1])[1]
    return out


def test_recomputed_logprobs_ratio_and_kl_at_the_sampling_weights(run):
    """Same weights, same CFG: recomputed per-step log-probs equal the sampler's (bitwise in the sampler's own
    micro-batches, <= 1e-5 in others); the first update's ratio is exactly 1 and the KL to the reference is 0."""
    import flow_grpo
    batch = flow_grpo.generate(run, flow_grpo.sample_prompts(run, 0), 0)
    N, S = len(batch["rows"]), run.cfg.num_steps
    assert batch["latents"].shape == (N, S + 1, 3, 8, 8) and batch["logps"].shape == (N, S)
    assert torch.isfinite(batch["logps"]).all()
    assert torch.equal(trainer_logps(run, batch, run.cfg.micro_batch_size), batch["logps"])
    assert (trainer_logps(run, batch, 3) - batch["logps"]).abs().max() <= 1e-5
    # the images are the decoded final latents (identity VAE: pixel = (x / 2 + 0.5) * 255)
    px = torch.tensor(np.asarray(batch["images"][0]), dtype=torch.float32)  # [8, 8, 3]
    ref = ((batch["latents"][0, -1].permute(1, 2, 0) / 2 + 0.5).clamp(0, 1) * 255)
    assert (px - ref).abs().max() <= 1.0
    batch["advantages"] = torch.linspace(-1, 1, N + 1)[torch.arange(N + 1) != N // 2]  # none 0: every image trains
    batch["train"] = flow_grpo.train_steps(run, batch["advantages"], 0)
    run.module.train()
    loss_cfg = flow_grpo.losses.LossConfig(loss_type="dapo", epsilon=1e-4)
    stats = flow_grpo.accumulate_gradients(run, batch, loss_cfg, torch.arange(N), first_pass=True)
    run.optimizer.zero_grad(set_to_none=True)
    assert stats["ratio/mean"] == 1.0 and stats["clip_ratio/region"] == 0.0
    assert stats["logprob_mismatch/mean_abs"] == 0.0
    assert stats["kl"] == 0.0  # LoRA B starts at 0: the policy is the base model


def test_gradient_does_not_depend_on_micro_batching_and_the_kl_is_train_sd3s(run):
    """One update's gradient with micro-batches of 8 equals micro-batches of 3 (float32, <= 1e-5 relative), with a
    random timestep_fraction subset per image; after the update the ratio moves and the KL grows. The logged KL is
    train_sd3.py's kl_loss (--loss.kl-form reference), and --loss.kl-form exact is it over |dt|, step by step."""
    import flow_grpo
    run.cfg.timestep_fraction, run.cfg.timestep_selection = 0.6, "random"
    batch = flow_grpo.generate(run, flow_grpo.sample_prompts(run, 1), 1)
    N = len(batch["rows"])
    batch["advantages"] = torch.linspace(-1, 1, N + 1)[torch.arange(N + 1) != N // 2]  # none exactly 0
    batch["train"] = flow_grpo.train_steps(run, batch["advantages"], 1)
    assert (batch["train"].sum(-1) == 3).all() and batch["train"].any(0).sum() > 3  # 3 of 5 steps, differing per image
    loss_cfg = flow_grpo.losses.LossConfig(loss_type="dapo", epsilon=0.2)
    everyone = torch.arange(N)
    grads = []
    for mbs in (8, 3):
        run.cfg.micro_batch_size = mbs
        flow_grpo.accumulate_gradients(run, batch, loss_cfg, everyone, first_pass=True)
        grads.append([p.grad.clone() for p in run.optimizer.param_groups[0]["params"]])
        run.optimizer.zero_grad(set_to_none=True)
    worst = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() for a, b in zip(*grads))
    assert worst <= 1e-5, worst
    assert any(g.abs().max() > 0 for g in grads[0])
    flow_grpo.accumulate_gradients(run, batch, loss_cfg, everyone, first_pass=True)
    for group in run.optimizer.param_groups:
        group["lr"] = 0.05
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    after = flow_grpo.accumulate_gradients(run, batch, loss_cfg, everyone, first_pass=True)
    run.cfg.loss.kl_form = "exact"
    exact = flow_grpo.accumulate_gradients(run, batch, loss_cfg, everyone, first_pass=True)
    run.cfg.loss.kl_form = "reference"
    run.optimizer.zero_grad(set_to_none=True)
    assert after["ratio/mean"] != 1.0 and after["kl"] > 0
    # the KL, independently: the reference policy is a fresh base pipeline (LoRA's starting point); train_sd3.py's
    # kl_loss = mean over the latent of (mu - mu_ref)^2 / (2 std_dev_t^2), std_dev_t = a sqrt(t / (1 - t)) (no dt),
    # written here in float64 from sd3_sde_with_logprob.py's mean (the two means differ only through v), averaged
    # over the images and their trained steps; the exact Gaussian KL divides each step's by |dt|
    import images
    pipe = images.build_tiny_flow_pipeline(run.cfg.seed)
    base = images.Velocity(pipe.transformer, pipe.scheduler.config.num_train_timesteps)
    sig, a, kls, exacts = batch["sigmas"].double(), run.cfg.noise_level, [], []
    with torch.no_grad():
        for i in range(run.cfg.num_steps):
            for b in batch["train"][:, i].nonzero().squeeze(-1).tolist():
                x, s = batch["latents"][b:b + 1, i], batch["sigmas"][i].expand(1)
                cond = flow_grpo.pick(batch["cond"], torch.tensor([b]))
                dv = (run.module(x, s, cond, run.cfg.guidance_scale) - base(x, s, cond, run.cfg.guidance_scale)).double()
                t, dt = sig[i], sig[i] - sig[i + 1]
                std2 = a ** 2 * t / (1 - (sig[1] if t == 1 else t))
                dmu = dv * (1 + std2 / (2 * t) * (1 - t)) * dt
                kls.append((dmu ** 2 / (2 * std2)).mean().item())
                exacts.append(kls[-1] / dt.item())
    want = sum(kls) / len(kls)
    assert abs(after["kl"] - want) <= 1e-3 * want, (after["kl"], want)
    want = sum(exacts) / len(exacts)
    assert abs(exact["kl"] - want) <= 1e-3 * want, (exact["kl"], want)


# ----------------------------------------------------------------------------------------------------------
# Flow-GRPO's reference training step (yifan123/flow_grpo: scripts/train_sd3.py, flow_grpo/diffusers_patch/
# sd3_sde_with_logprob.py and sd3_pipeline_with_logprob.py, flow_grpo/stat_tracking.py, flow_grpo/ema.py), re-written
# here in float64 from that source, against flow_grpo.py on the same batch
# ----------------------------------------------------------------------------------------------------------

REF_LORA_TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                    "attn.to_out.0", "attn.to_q", "attn.to_v"]  # train_sd3.py's target_modules


def ref_sde_step_with_logprob(sigmas, j, model_output, sample, noise_level, prev_sample=None, noise=None):
    """sde_step_with_logprob, line by line: sigma = sigmas[j], sigma_prev = sigmas[j + 1], sigma_max = sigmas[1]."""
    sigma, sigma_prev, sigma_max = sigmas[j], sigmas[j + 1], sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = (sample * (1 + std_dev_t ** 2 / (2 * sigma) * dt)
                        + model_output * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt)
    if prev_sample is None:
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * noise
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                - torch.log(std_dev_t * torch.sqrt(-1 * dt))
                - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi, dtype=torch.float64))))  # (float32 there)
    return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), prev_sample_mean, std_dev_t


def ref_noise_pred(transformer, latents, timestep, embeds, pooled_embeds, guidance_scale, detach_uncond=True):
    """compute_log_prob with config.train.cfg: one call over [uncond; cond], the unconditional half detached (the
    sampling pipeline makes the same call without gradients)."""
    noise_pred = transformer(hidden_states=torch.cat([latents] * 2), timestep=torch.cat([timestep] * 2),
                             encoder_hidden_states=embeds, pooled_projections=pooled_embeds, return_dict=False)[0]
    noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
    if detach_uncond:
        noise_pred_uncond = noise_pred_uncond.detach()
    return noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)


def ref_stat_tracker(prompts, rewards, global_std=True):
    """PerPromptStatTracker.update(prompts, rewards) (type grpo), numpy float64; train_sd3.py's fallback for G = 1."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    if len(set(prompts.tolist())) == len(prompts):  # num_image_per_prompt == 1: per_prompt_stat_tracking off
        return (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        mean = np.mean(rewards[prompts == prompt], axis=0, keepdims=True)
        std = (np.std(rewards, axis=0, keepdims=True) if global_std else
               np.std(rewards[prompts == prompt], axis=0, keepdims=True)) + 1e-4
        advantages[prompts == prompt] = (rewards[prompts == prompt] - mean) / std
    return advantages


class RefEMA:
    """EMAModuleWrapper(parameters, decay=0.9, update_step_interval=8) as train_sd3.py builds it."""

    def __init__(self, parameters, decay=0.9, update_step_interval=8):
        self.ema_parameters = [p.clone().detach() for p in parameters]
        self.decay, self.update_step_interval = decay, update_step_interval

    @torch.no_grad()
    def step(self, parameters, optimization_step):
        one_minus_decay = 1 - min((1 + optimization_step) / (10 + optimization_step), self.decay)
        if (optimization_step + 1) % self.update_step_interval == 0:
            for ema_parameter, parameter in zip(self.ema_parameters, parameters, strict=True):
                ema_parameter.add_(one_minus_decay * (parameter - ema_parameter))


def ref_policy(init, seed):
    """train_sd3.py's LoRA transformer in float64 with the given starting weights (names as in Velocity's state)."""
    from peft import LoraConfig, get_peft_model

    import images
    pipe = images.build_tiny_flow_pipeline(seed)
    policy = get_peft_model(pipe.transformer, LoraConfig(r=8, lora_alpha=16, target_modules=REF_LORA_TARGETS)).double()
    with torch.no_grad():
        for n, p in policy.named_parameters():
            p.copy_(init["transformer." + n])
    return policy, pipe.scheduler


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.fixture(scope="module")
def ref_run(world, tmp_path_factory):
    """flow_grpo.setup in float64 at the reference's SD3 settings (config/grpo.py's pickscore_sd3 on the tiny pipeline:
    10 steps, CFG 4.5, noise 0.7, timestep_fraction 0.99, beta 0.01, clip 1e-4, global std, AdamW 3e-4 / (0.9, 0.999)
    / 1e-4, two optimizer steps per batch, EMA 0.9 every 8, two sample batches accumulated per optimizer step so the
    EMA's due update lands twice), except the gradient-norm and advantage clips, tightened to 1e-3 and 1 so both act."""
    import flow_grpo
    cfg = flow_grpo.Config(output_dir=str(tmp_path_factory.mktemp("flow64")), dtype="float64", num_steps=10,
                           guidance_scale=4.5, timestep_fraction=0.99, batch_size=8, micro_batch_size=2, adv_clip=1.0,
                           log=flow_grpo.FlowLogConfig(verbose=True), ema=flow_grpo.FlowEMAConfig(decay=0.9, repeat=2),
                           loss=flow_grpo.FlowLossConfig(beta=0.01),
                           optim=flow_grpo.OptimConfig(lr=3e-4, betas=(0.9, 0.999), weight_decay=1e-4,
                                                                warmup_steps=0, max_grad_norm=1e-3))
    return flow_grpo.setup(cfg)


def ref_inputs(run, batch):
    """The batch's text embeddings in float64, [neg; cond] as train_sd3.py concatenates them, and the schedule."""
    c = {k: v.double() for k, v in batch["cond"].items()}
    N = len(batch["rows"])
    return (torch.cat([c["neg_embeds"].expand(N, -1, -1), c["embeds"]]),
            torch.cat([c["neg_pooled"].expand(N, -1), c["pooled"]]))


def ref_train_batch(policy, sigmas, sample, embeds, pooled, adv, old, T, cfg, detach_uncond=True, ga=1):
    """One sample batch of train_sd3.py's inner loop: for j < T the clipped loss plus beta x kl_loss, each backward
    divided by ga x T (accelerate's accumulation over gradient_accumulation_steps x T timesteps) -> summed loss."""
    total = 0.0
    for j in range(T):
        x, nxt = sample[:, j], sample[:, j + 1]
        t = (sigmas[j] * 1000).expand(len(x))  # scheduler.timesteps = sigmas x num_train_timesteps (float64 here)
        v = ref_noise_pred(policy, x, t, embeds, pooled, cfg.guidance_scale, detach_uncond)
        _, log_prob, mean, std_dev_t = ref_sde_step_with_logprob(sigmas, j, v, x, cfg.noise_level, prev_sample=nxt)
        with torch.no_grad(), policy.disable_adapter():
            v_ref = ref_noise_pred(policy, x, t, embeds, pooled, cfg.guidance_scale)
            _, _, mean_ref, _ = ref_sde_step_with_logprob(sigmas, j, v_ref, x, cfg.noise_level, prev_sample=nxt)
        advantages = torch.clamp(adv, -cfg.adv_clip, cfg.adv_clip)
        ratio = torch.exp(log_prob - old[:, j])
        unclipped_loss = -advantages * ratio
        clipped_loss = -advantages * torch.clamp(ratio, 1.0 - cfg.loss.epsilon, 1.0 + cfg.loss.epsilon)
        policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
        kl_loss = torch.mean(((mean - mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t ** 2))
        loss = policy_loss + cfg.loss.beta * kl_loss
        (loss / (ga * T)).backward()
        total += loss.item() / (ga * T)
    return total


def test_same_batch_as_flow_grpos_reference_training_step(ref_run):
    """One whole step of the reference's training at its SD3 settings, float64, on the tiny SD3 pipeline: SDE sampling
    with log-probs (the same noise), global-std advantages of given rewards, the batch shuffled and cut in two, one
    optimizer step per half (the ratio clip and the KL act on the second, the gradient-norm clip on both, the advantage
    clip on some images), each half two accumulated sample batches of 2 (train.batch_size 2, gradient_accumulation_steps
    2: --micro-batch-size 2), the EMA stepped after each sample batch (--ema.repeat 2), due at optimizer step 7. Our
    latents, log-probs, advantages, per-step losses
    and clipped gradients, updated weights and EMA: all within 1e-6."""
    import flow_grpo
    run, cfg = ref_run, ref_run.cfg
    named = flow_grpo.trainable(run.module)
    init = {n: full(p).detach().clone() for n, p in run.module.named_parameters()}
    prompts = flow_grpo.sample_prompts(run, 0)
    assert len({r["prompt"] for r in prompts}) == len(prompts)  # the stat tracker groups by prompt text
    rewards = torch.tensor([0.1, 0.7, 0.4, 0.9, 0.3, 0.35, 0.8, 0.05], dtype=torch.float64)  # none at its group mean
    # ours: the stages of one flow_grpo.py step, the gradients captured as the optimizer takes them
    batch = flow_grpo.generate(run, prompts, 0)
    batch["advantages"] = flow_grpo.compute_advantages(run, rewards[:, None])
    batch["train"] = flow_grpo.train_steps(run, batch["advantages"], 0)
    parts = flow_grpo.update_parts(run, len(rewards), 0)
    run.updates = 6  # optimizer steps 7 and 8 follow: the EMA (every 8) updates after the first
    grads = []
    hook = run.optimizer.register_step_pre_hook(lambda *_: grads.append({n: full(p.grad).clone() for n, p in named}))
    stats = flow_grpo.update(run, batch, 0)
    hook.remove()
    # the reference, from the same starting weights, noise streams, prompt encodings, rewards and shuffle
    policy, sched = ref_policy(init, cfg.seed)
    sched.set_timesteps(cfg.num_steps)
    sigmas = sched.sigmas.double()
    embeds, pooled = ref_inputs(run, batch)
    N, S = len(rewards), cfg.num_steps
    gens = [torch.Generator().manual_seed(s) for s in flow_grpo.image_seeds(cfg.seed, 0, 0, N)]
    draw = lambda: torch.stack([torch.randn(3, 8, 8, generator=g) for g in gens]).double()  # noqa: E731
    latents, all_latents, all_log_probs = draw(), [], []
    with torch.no_grad():  # pipeline_with_logprob
        for i in range(S):
            all_latents.append(latents)
            v = ref_noise_pred(policy, latents, (sigmas[i] * 1000).expand(N), embeds, pooled, cfg.guidance_scale)
            latents, log_prob, _, _ = ref_sde_step_with_logprob(sigmas, i, v, latents, cfg.noise_level, noise=draw())
            all_log_probs.append(log_prob)
    all_latents.append(latents)
    traj, old = torch.stack(all_latents, 1), torch.stack(all_log_probs, 1)  # [N, S + 1, C, h, w], [N, S]
    assert rel(batch["latents"], traj) <= 1e-6 and rel(batch["logps"], old) <= 1e-6
    advantages = torch.tensor(ref_stat_tracker([r["prompt"] for r in batch["rows"]], rewards.numpy()))
    assert (advantages != 0).all()  # train_sd3.py's zero-advantage filter keeps every sample
    assert (advantages.abs() > cfg.adv_clip).any() and (advantages.abs() < cfg.adv_clip).any()  # the clip acts
    assert rel(batch["advantages"], advantages.clamp(-cfg.adv_clip, cfg.adv_clip)) <= 1e-6
    T = int(cfg.num_steps * cfg.timestep_fraction)
    assert T == 9 and batch["train"][:, :T].all() and not batch["train"][:, T:].any()
    params = [p for p in policy.parameters() if p.requires_grad]
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8)
    ema, global_step = RefEMA(params), 6
    assert [len(p) for p in parts] == [N // 2, N // 2] and sorted(torch.cat(parts).tolist()) == list(range(N))
    GA = 2
    for k, rows in enumerate(parts):  # samples_batched after the perm; GA sample batches per optimizer step
        loss = 0.0
        for b, br in enumerate(rows.split(len(rows) // GA)):
            loss += ref_train_batch(policy, sigmas, traj[br], embeds[torch.cat([br, br + N])],
                                    pooled[torch.cat([br, br + N])], advantages[br], old[br], T, cfg, ga=GA)
            if b < GA - 1:  # accelerate: no sync yet, so no optimizer step; the EMA steps at the same global_step
                ema.step(params, global_step)
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.optim.max_grad_norm).item()
        assert norm > cfg.optim.max_grad_norm and stats[k]["grad_norm"] == pytest.approx(norm, rel=1e-6)  # it clips
        for n, p in zip(names, params):
            assert rel(grads[k]["transformer." + n], p.grad) <= 1e-6, (k, n)
        assert abs(stats[k]["loss"] - loss) <= 1e-6 * abs(loss), (k, stats[k]["loss"], loss)
        optimizer.step()
        optimizer.zero_grad()
        global_step += 1
        ema.step(params, global_step)
    assert stats[0]["ratio/mean"] == pytest.approx(1.0, abs=1e-12) and stats[1]["kl"] > 0
    ours = dict(named)
    for n, p, e in zip(names, params, ema.ema_parameters):
        assert rel(full(ours["transformer." + n]).detach(), p.detach()) <= 1e-6, n
        assert rel(full(run.ema["transformer." + n]).double(), e) <= 1e-6, n
    assert any(rel(e, init["transformer." + n]) > 1e-3 for n, e in zip(names, ema.ema_parameters) if "lora_B" in n)


def test_cfg_gradient_is_the_conditional_branchs(ref_run):
    """--guidance-grad cond (default): the log-prob gradient is train_sd3.py's, with the unconditional prediction
    detached; --guidance-grad both is the same loss with the gradient through both branches; the two differ."""
    import flow_grpo
    run, cfg = ref_run, ref_run.cfg
    batch = flow_grpo.generate(run, flow_grpo.sample_prompts(run, 1), 1)
    N, T = len(batch["rows"]), int(cfg.num_steps * cfg.timestep_fraction)
    batch["advantages"] = torch.linspace(-1, 1, N + 1, dtype=torch.float64)[torch.arange(N + 1) != N // 2]
    batch["train"] = flow_grpo.train_steps(run, batch["advantages"], 1)
    named = flow_grpo.trainable(run.module)
    policy, sched = ref_policy({n: full(p).detach() for n, p in run.module.named_parameters()}, cfg.seed)
    sched.set_timesteps(cfg.num_steps)
    embeds, pooled = ref_inputs(run, batch)
    loss_cfg = flow_grpo.losses.LossConfig(loss_type="dapo", epsilon=cfg.loss.epsilon)
    ours = {}
    for mode in ("cond", "both"):
        run.cfg.guidance_grad = mode
        flow_grpo.accumulate_gradients(run, batch, loss_cfg, torch.arange(N), first_pass=True)
        ours[mode] = torch.cat([full(p.grad).flatten() for _, p in named])
        run.optimizer.zero_grad(set_to_none=True)
        ref_train_batch(policy, sched.sigmas.double(), batch["latents"], embeds, pooled, batch["advantages"],
                        batch["logps"], T, cfg, detach_uncond=mode == "cond")
        want = torch.cat([p.grad.flatten() for p in policy.parameters() if p.requires_grad])
        policy.zero_grad(set_to_none=True)
        assert rel(ours[mode], want) <= 1e-6, mode
    run.cfg.guidance_grad = "cond"
    assert torch.nn.functional.cosine_similarity(ours["cond"], ours["both"], dim=0) < 0.99


def test_trained_timesteps_are_the_first_int_s_times_fraction():
    """train_sd3.py trains steps 0 .. int(S x timestep_fraction) - 1 of every sample (9 of 10 at 0.99: never the last),
    and drops a sample whose advantage is exactly 0; --timestep-selection random draws a subset per image."""
    from types import SimpleNamespace

    import flow_grpo
    run = SimpleNamespace(cfg=flow_grpo.Config(num_steps=10, timestep_fraction=0.99), rank=0)
    adv = torch.tensor([0.5, -1.0, 0.0, 2.0])
    steps = flow_grpo.train_steps(run, adv, 3)
    assert steps[[0, 1, 3]].equal(torch.tensor([[True] * 9 + [False]] * 3)) and not steps[2].any()
    run.cfg.timestep_fraction, run.cfg.timestep_selection = 0.6, "random"
    steps = flow_grpo.train_steps(run, torch.ones(16), 3)
    assert (steps.sum(-1) == 6).all() and steps[:, 6:].any()


def test_global_std_advantages_are_the_reference_stat_trackers():
    """--scale-rewards global (default) == PerPromptStatTracker(global_std=True): group means, the gathered batch's
    std with ddof 0; with G = 1, train_sd3.py's batch-statistics fallback. A NaN reward gets advantage 0."""
    import flow_grpo
    g = torch.Generator().manual_seed(0)
    r = torch.rand(12, generator=g, dtype=torch.float64)
    prompts = [f"p{i // 4}" for i in range(12)]
    torch.testing.assert_close(flow_grpo.global_std_advantages(r, 4), torch.tensor(ref_stat_tracker(prompts, r.numpy())),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(flow_grpo.global_std_advantages(r, 1),
                               torch.tensor(ref_stat_tracker([f"p{i}" for i in range(12)], r.numpy())),
                               rtol=1e-12, atol=1e-12)
    with_nan = r.clone()
    with_nan[5] = float("nan")
    keep = torch.arange(12) != 5
    want = torch.tensor(ref_stat_tracker([p for p, k in zip(prompts, keep) if k], r[keep].numpy()))
    got = flow_grpo.global_std_advantages(with_nan, 4)
    assert got[5] == 0 and torch.allclose(got[keep], want, rtol=1e-12, atol=1e-12)


def test_ema_follows_the_references_schedule():
    """The EMA through optim.py's helpers on flow_grpo's schedule == EMAModuleWrapper(decay 0.9, interval 8) stepped
    with train_sd3.py's global_step, over 40 optimizer steps of a moving parameter (float32 EMA vs float64)."""
    import flow_grpo
    g = torch.Generator().manual_seed(0)
    p = torch.randn(5, generator=g, dtype=torch.float64)
    ours, ref = flow_grpo.optim.ema_init([("w", p)], 0.9), RefEMA([p])
    for k in range(1, 41):
        p = p + torch.randn(5, generator=g, dtype=torch.float64)
        decay = flow_grpo.ema_decay(k, 0.9, 8)
        if decay is not None:
            flow_grpo.optim.ema_update(ours, [("w", p)], decay)
        ref.step([p], k)
    assert rel(ours["w"].double(), ref.ema_parameters[0]) <= 1e-6


def test_lora_adapters_are_train_sd3s():
    """The tiny SD3 pipeline's block 0 has SD3.5's second attention (attn2), as SD3.5-Medium's dual-attention blocks:
    our default targets adapt exactly the modules train_sd3.py's prefixed target list adapts (attn2 stays frozen), and
    start from its initialisation (init_lora_weights="gaussian"), drawn from the same random state."""
    from peft import LoraConfig, get_peft_model

    import flow_grpo
    import flow_launch
    import images
    cfg = flow_grpo.Config()
    _, ours = flow_launch.load_pipeline(cfg, torch.device("cpu"))
    pipe = images.build_tiny_flow_pipeline(cfg.seed)
    assert any(".attn2." in n for n, _ in pipe.transformer.named_modules())
    ref = get_peft_model(pipe.transformer, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                                      init_lora_weights="gaussian", target_modules=REF_LORA_TARGETS))
    ref_params = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    assert [n for n, p in ours.named_parameters() if p.requires_grad] == [n for n, _ in ref_params]
    assert ref_params and not any("attn2" in n for n, _ in ref_params)
    state = dict(ours.named_parameters())
    for n, p in ref_params:
        assert torch.equal(state[n], p), n


def test_help_lists_only_what_flow_grpo_does(capsys, monkeypatch):
    """flow_grpo.py --help: none of the shared groups' options that flow_grpo.py refuses or ignores (grpo.py's loss
    types and estimators, engine-log-prob corrections, adapters, merged saves, text completions, grpo.py's resumable
    settings and its inference engine)."""
    import tyro

    import flow_grpo
    monkeypatch.setenv("COLUMNS", "250")
    with pytest.raises(SystemExit):
        tyro.cli(flow_grpo.Config, args=["--help"])
    out = capsys.readouterr().out
    for gone in ("--lora.adapter", "--checkpoint.save-merged", "--loss.kl-in-reward", "--loss.off-policy-mask",
                 "--loss.sampler-correction", "--log.completions-every", "--loss.kl-estimator", "--loss.sapo",
                 "--loss.vespo", "--loss.importance-sampling-level", "--loss.top-entropy-quantile",
                 "--loss.max-completion-length", "--loss.use-bias-correction-kl", "luspo", "dr_grpo",
                 "language model", "vLLM", "max_bad_steps", "n_samples"):
        assert gone not in out, gone
    for flag in ("--loss.beta", "--loss.kl-form", "--guidance-grad", "--timestep-selection", "--steps-per-generation",
                 "--scale-rewards", "--ema.decay", "--lora.target-modules", "--log.images-every", "--dtype", "--lora.init",
                 "--reward-weights"):
        assert flag in out, flag


# ----------------------------------------------------------------------------------------------------------
# The real script: 2 ranks under torchrun (gloo)
# ----------------------------------------------------------------------------------------------------------

def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_default_run_learns_and_resumes_exactly(tmp_path):
    """The README's no-flag run (plus --output-dir, checkpoints and evaluations every 3 steps, and an EMA, which only
    evaluation and checkpoints read): the mean reward of the last 10 steps beats the first 10 by >= 0.05. Then 3 steps
    + resume 3 == 6 straight: checkpoint-3 of that run, resumed to step 6 in another directory (image grids on, which
    must not change training), gives the same adapter and EMA weights and the same per-step metrics as its
    checkpoint-6. Both evaluate on the same held-out prompts."""
    straight = str(tmp_path / "straight")
    evals = ["--eval.every", "3", "--eval.num-prompts", "2",  # its prompts are held out of training: same in both runs
             "--ema.decay", "0.9", "--ema.every", "2"]
    _, log, secs = torchrun("flow_grpo.py", "--output-dir", straight, "--checkpoint.every", "3", "--checkpoint.keep", "0",
                            *evals, timeout=600)
    logged = metrics(straight)
    rows = [r for r in logged if "reward/mean" in r]  # the training steps (the step-0 row is the baseline evaluation)
    assert logged[0]["step"] == 0 and "eval/reward" in logged[0]
    first, last = (sum(r["reward/mean"] for r in rs) / 10 for rs in (rows[:10], rows[-10:]))
    print(f"default run: first-10 mean reward {first:.3f}, last-10 {last:.3f}, wall {secs:.0f}s")
    assert last - first >= 0.05, (first, last)
    for k in ("step", "reward/mean", "reward/std", "reward/brightness/mean", "loss", "clip_ratio/region",
              "clip_ratio/step_0", "clip_ratio/step_9", "logprob_mismatch/mean_abs", "time/sample", "time/train",
              "images_per_s", "mem/peak_gb", "grad_norm"):
        assert k in rows[0], k
    assert max(r["logprob_mismatch/mean_abs"] for r in rows) <= 1e-5
    assert "step 1/" in log and "done in" in log

    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(os.path.join(straight, "checkpoint-3"), os.path.join(resumed, "checkpoint-3"))
    with open(os.path.join(resumed, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in logged if r["step"] <= 3)
    _, log, _ = torchrun("flow_grpo.py", "--output-dir", resumed, "--resume", "latest", "--max-steps", "6",
                         "--checkpoint.allow-changes", "max_steps", *evals, "--log.images-every", "3", timeout=300)
    assert "resumed from" in log
    a = load_file(os.path.join(straight, "checkpoint-6", "transformer", "adapter_model.safetensors"))
    b = load_file(os.path.join(resumed, "checkpoint-6", "transformer", "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.equal(a[k], b[k]) for k in a)
    ema_a, ema_b = (load_file(os.path.join(d, "checkpoint-6", "ema", "transformer", "adapter_model.safetensors"))
                    for d in (straight, resumed))
    assert ema_a.keys() == a.keys() and all(torch.equal(ema_a[k], ema_b[k]) for k in a)
    assert not all(torch.equal(ema_a[k], a[k]) for k in a)  # the EMA lags the live weights
    # the adapter loads back onto the pipeline's transformer with PEFT (the documented way to use a checkpoint)
    from peft import PeftModel

    import images
    loaded = PeftModel.from_pretrained(images.build_tiny_flow_pipeline(0).transformer,
                                       os.path.join(straight, "checkpoint-6", "transformer"))
    lora = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert len(lora) == len(a) and all(torch.equal(lora[k.replace(".weight", ".default.weight")], a[k]) for k in a)
    again = [r for r in metrics(resumed) if "reward/mean" in r]
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5, 6]
    for r, s in zip(again[3:], rows[3:6]):
        for k in ("reward/mean", "loss", "grad_norm", "clip_ratio/region"):
            assert r[k] == s[k], (k, r[k], s[k])
    assert "eval/reward" in again[-1]
    for name in ("train-step-6.png", "eval-step-6.png"):
        assert os.path.getsize(os.path.join(resumed, "images", name)) > 0


def test_ode_sampler_with_cfg_equals_the_diffusers_pipeline():
    """With noise 0 our sampler (Velocity's CFG over [uncond; cond], the timestep scaling, encode_prompts, the sigma
    schedule) produces the same final latents as StableDiffusion3Pipeline.__call__ itself, from the same start."""
    import flow_grpo
    import images
    torch.manual_seed(0)
    pipe = images.build_tiny_flow_pipeline(0)
    pipe.set_progress_bar_config(disable=True)
    cfg = flow_grpo.Config()
    prompts, steps, scale = ["a red cat on a black background", "a blue car"], 6, 3.0
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = pipe(prompt=prompts, num_inference_steps=steps, guidance_scale=scale, latents=x.clone(), height=8,
                   width=8, output_type="latent", max_sequence_length=1).images
        cond = {**images.encode_prompts(pipe, prompts, "cpu", cfg.max_sequence_length),
                **{f"neg_{k}": v for k, v in images.encode_prompts(pipe, [""], "cpu", cfg.max_sequence_length).items()}}
        velocity = images.Velocity(pipe.transformer, pipe.scheduler.config.num_train_timesteps)
        sig = flow_grpo.step_sigmas(pipe.scheduler, steps)
        for i in range(steps):
            v = velocity(x, sig[i].expand(2), cond, scale)
            x = flow_grpo.sde_step(x, v, sig[i].expand(2).view(-1, 1, 1, 1), sig[i + 1], sig[1], 0.0)[0]
    torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)


def test_flux_ode_sampler_equals_the_diffusers_pipeline():
    """FLUX.1 layout (builtin:tiny-flux): packed latents, guidance embedding, dynamic shift: with noise 0 our sampler
    gives FluxPipeline.__call__'s final latents from the same start."""
    import flow_grpo
    import images
    torch.manual_seed(0)
    pipe = images.build_tiny_flux_pipeline(0)
    pipe.set_progress_bar_config(disable=True)
    cfg = flow_grpo.Config(max_sequence_length=16)
    prompts, steps, scale = ["a red cat on a black background", "a blue car"], 6, 3.5
    x = torch.randn(2, 16, 12, generator=torch.Generator().manual_seed(5))  # [B, L = (8/2)^2, 4 x 3 channels]
    with torch.no_grad():
        ref = pipe(prompt=prompts, num_inference_steps=steps, guidance_scale=scale, latents=x.clone(), height=8,
                   width=8, output_type="latent", max_sequence_length=16).images
        cond = images.encode_prompts(pipe, prompts, "cpu", cfg.max_sequence_length)
        velocity = images.Velocity(pipe.transformer, pipe.scheduler.config.num_train_timesteps, family="flux")
        sig = flow_grpo.step_sigmas(pipe.scheduler, steps, image_seq_len=16)
        for i in range(steps):
            v = velocity(x, sig[i].expand(2), cond, scale)
            x = flow_grpo.sde_step(x, v, sig[i].expand(2).view(-1, 1, 1), sig[i + 1], sig[1], 0.0)[0]
    torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)


def test_qwen_image_ode_sampler_and_decode_equal_the_diffusers_pipeline():
    """Qwen-Image layout (builtin:tiny-qwen-image): chat-template prompt encoding with a padding mask, packed latents,
    true CFG with a negative prompt and its norm rescale, the dynamic exponential shift with shift_terminal, the 5-D
    VAE decode with latents_mean / latents_std: with noise 0 our sampler gives QwenImagePipeline.__call__'s latents
    after every step, and our decode its images, from the same start."""
    import flow_grpo
    import images
    pipe = images.build_tiny_qwen_image_pipeline(0)
    pipe.set_progress_bar_config(disable=True)
    # the tiny tokenizer's template prefix is the 34 tokens the pipeline drops, as with Qwen's own tokenizer
    ids = pipe.tokenizer(pipe.prompt_template_encode.format("a blue car")).input_ids
    assert pipe.tokenizer.convert_ids_to_tokens(ids[pipe.prompt_template_encode_start_idx - 2:][:5]) == [
        "user", "\n", "a", "blue", "car"]
    prompts, neg, steps, scale, msl = ["a red cat on a black background", "a blue car"], " ", 6, 4.0, 64
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(5))  # [B, L = (16/2/2)^2, 4 x 4 channels]
    ref_traj = []
    with torch.no_grad():
        ref = pipe(prompt=prompts, negative_prompt=neg, true_cfg_scale=scale, num_inference_steps=steps,
                   latents=x.clone(), height=16, width=16, output_type="pt", max_sequence_length=msl,
                   callback_on_step_end=lambda p, i, t, kw: ref_traj.append(kw["latents"]) or {}).images
        cond = {**images.encode_prompts(pipe, prompts, "cpu", msl),
                **{f"neg_{k}": v for k, v in images.encode_prompts(pipe, [neg], "cpu", msl).items()}}
        assert cond["embeds"].shape[1] > cond["neg_embeds"].shape[1] and not cond["mask"].all()  # padding is masked
        velocity = images.Velocity(pipe.transformer, pipe.scheduler.config.num_train_timesteps, family="qwen")
        sig = flow_grpo.step_sigmas(pipe.scheduler, steps, image_seq_len=16)
        for i in range(steps):
            v = velocity(x, sig[i].expand(2), cond, scale)
            x = flow_grpo.sde_step(x, v, sig[i].expand(2).view(-1, 1, 1), sig[i + 1], sig[1], 0.0)[0]
            torch.testing.assert_close(x, ref_traj[i], rtol=1e-5, atol=1e-5)
        px = pipe.image_processor.postprocess(images.decode_latents(pipe, x, 16, 1), output_type="pt")
    assert px.shape == ref.shape == (2, 3, 16, 16)
    torch.testing.assert_close(px, ref, rtol=1e-5, atol=1e-5)


def test_qwen_image_run_completes(tmp_path):
    """builtin:tiny-qwen-image under torchrun (2 ranks): 2 steps with true CFG and a negative prompt, the KL term and
    an evaluation. Finite metrics, sampler and trainer log-probs agree before the update, and the saved adapter (the
    attention and MLP targets) loads back onto the pipeline's transformer with PEFT."""
    out = str(tmp_path / "qwen")
    _, log, secs = torchrun("flow_grpo.py", "--model", "builtin:tiny-qwen-image", "--output-dir", out,
                            "--max-steps", "2", "--num-steps", "3", "--batch-size", "4", "--num-generations", "2",
                            "--micro-batch-size", "4", "--guidance-scale", "3", "--negative-prompt", " ",
                            "--loss.beta", "0.1", "--eval.every", "2", "--eval.num-prompts", "2",
                            "--eval.num-steps", "3", timeout=300)
    print(f"tiny-qwen-image run: wall {secs:.0f}s")
    logged = metrics(out)
    rows = [r for r in logged if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2] and "eval/reward" in logged[0] and "eval/reward" in rows[-1]
    assert all(math.isfinite(v) for r in logged for v in r.values())
    assert max(r["logprob_mismatch/mean_abs"] for r in rows) <= 1e-5
    assert rows[0]["grad_norm"] > 0 and rows[-1]["kl"] > 0  # the first update moved the policy off the reference
    assert os.path.getsize(os.path.join(out, "images", "eval-step-2.png")) > 0
    from peft import PeftModel

    import images
    saved = load_file(os.path.join(out, "checkpoint-2", "transformer", "adapter_model.safetensors"))
    assert any(".img_mlp.net.2." in k for k in saved) and any(".attn.to_add_out." in k for k in saved)
    loaded = PeftModel.from_pretrained(images.build_tiny_qwen_image_pipeline(0).transformer,
                                       os.path.join(out, "checkpoint-2", "transformer"))
    lora = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert len(lora) == len(saved) and all(torch.equal(lora[k.replace(".weight", ".default.weight")], saved[k])
                                           for k in saved)


def test_evaluation_prompts_are_held_out_of_training(tmp_path):
    """The built-in colors task draws train and test from one small space, and a prompt file's test split is its
    train split: either way no evaluation prompt is trained on, and the rest still is."""
    import tyro

    import flow_grpo
    import flow_launch
    lines = [f"a prompt number {i}" for i in range(20)]
    (tmp_path / "p.txt").write_text("\n".join(lines) + "\n")
    for dataset in ("colors", str(tmp_path / "p.txt")):
        cfg = tyro.cli(flow_grpo.Config, args=["--dataset", dataset, "--eval.every", "5", "--eval.num-prompts", "4"])
        train, held = flow_launch.load_prompts(cfg)
        assert len(held) == 4 and not {r["prompt"] for r in held} & {r["prompt"] for r in train}
        if dataset != "colors":
            assert sorted(r["prompt"] for r in train + held) == sorted(lines)
    cfg = tyro.cli(flow_grpo.Config, args=["--dataset", str(tmp_path / "p.txt"), "--eval.every", "5",
                                           "--eval.num-prompts", "20"])
    with pytest.raises(ValueError, match="holds out every prompt"):
        flow_launch.load_prompts(cfg)


def test_flow_flags_are_validated():
    """flow_launch.validate names the flag and the fix for the new options (every rank, before any collective)."""
    import tyro

    import flow_grpo
    import flow_launch
    for args, message in [(["--scale-rewards", "std"], "--scale-rewards 'std' is not known"),
                          (["--loss.kl-form", "k3"], "--loss.kl-form 'k3' is not known"),
                          (["--guidance-grad", "uncond"], "--guidance-grad 'uncond' is not known"),
                          (["--steps-per-generation", "3"], "multiple of --steps-per-generation 3"),
                          (["--num-generations", "1", "--scale-rewards", "group"], "G = 1 with --scale-rewards global"),
                          (["--num-steps", "4", "--timestep-fraction", "0.2"], "train at least one of the 4 steps"),
                          (["--ema.decay", "1"], "--ema.decay must be in"), (["--dtype", "fp16"], "--dtype 'fp16'"),
                          (["--ema.repeat", "0"], "--ema.repeat >= 1"),
                          (["--lora.init", "pissa"], "--lora.init 'pissa'")]:
        with pytest.raises(ValueError, match=message):
            flow_launch.validate(tyro.cli(flow_grpo.Config, args=args))
    flow_launch.validate(tyro.cli(flow_grpo.Config, args=["--num-generations", "1", "--batch-size", "3",
                                                        "--steps-per-generation", "3"]))


def test_resolution_must_fit_the_latent_grid(tmp_path):
    """flow_launch.validate (every rank, before any collective): a real pipeline's --resolution must be a multiple of
    16 (VAE factor 8 x 2x2 patches), checked before the model loads."""
    import tyro

    import flow_grpo
    import flow_launch
    model = tmp_path / "some-pipeline"
    model.mkdir()
    cfg = tyro.cli(flow_grpo.Config, args=["--model", str(model), "--resolution", "520"])
    with pytest.raises(ValueError, match="--resolution 520 must be a multiple of 16"):
        flow_launch.validate(cfg)


def test_nonfinite_image_rewards_are_failures_and_all_failed_stops(run):
    """A reward that returns NaN/inf is None for those images, counted in reward/failed (was: a silent 0 and exit 0);
    when every function fails on every image, the step stops with a message (grpo.py's rule)."""
    import dataclasses

    import rewards_for_tests
    from PIL import Image

    import flow_grpo
    rows = [{"prompt": f"p{i}"} for i in range(4)]
    batch = {"rows": rows, "images": [Image.new("RGB", (8, 8))] * 4}
    half = dataclasses.replace(run, reward_fns=[("nan", rewards_for_tests.always_nan),
                                                ("one", rewards_for_tests.always_one)], printed_errors=set())
    rewards = flow_grpo.score(half, batch)  # [4, 2]
    assert rewards[:, 0].isnan().all() and (rewards[:, 1] == 1).all() and batch["n_failed"] == 4
    broken = dataclasses.replace(half, reward_fns=half.reward_fns[:1])
    with pytest.raises(flow_grpo.console.UserError, match="every reward function failed"):
        flow_grpo.score(broken, batch)
