"""flow_grpo.py: the SDE step against float64 references written from the paper's equations and diffusers' own Euler
step; log-probs, ratios, KL and gradients of the training path against the sampler; the real script under torchrun."""
import json
import math
import os
import shutil
import signal
import socket

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import torchrun


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
    import flow_grpo
    from diffusers import FlowMatchEulerDiscreteScheduler
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
    import flow_grpo
    from diffusers import FlowMatchEulerDiscreteScheduler
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
def run(tmp_path_factory):
    """flow_grpo.setup in this process: LoRA, beta > 0 (reference = adapters disabled), CFG on, 5 steps."""
    import torch.distributed as dist

    import flow_grpo
    env, handler, threads = dict(os.environ), signal.getsignal(signal.SIGTERM), torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is faster, and spinning threads stall on a shared machine
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cfg = flow_grpo.Config(output_dir=str(tmp_path_factory.mktemp("flow")), num_steps=5, guidance_scale=2.0,
                           batch_size=8, micro_batch_size=8, log=flow_grpo.FlowLogConfig(verbose=True))
    cfg.loss.beta = 0.1
    try:
        yield flow_grpo.setup(cfg)
    finally:
        dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
        signal.signal(signal.SIGTERM, handler)
        torch.set_num_threads(threads)


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
    batch["advantages"] = flow_grpo.compute_advantages(run, flow_grpo.score(run, batch))
    batch["train"] = flow_grpo.train_steps(run, N, 0)
    run.module.train()
    loss_cfg = flow_grpo.losses.LossConfig(loss_type="dapo", epsilon=1e-4)
    stats = flow_grpo.accumulate_gradients(run, batch, loss_cfg, first_pass=True)
    run.optimizer.zero_grad(set_to_none=True)
    assert stats["ratio/mean"] == 1.0 and stats["clip_ratio/region"] == 0.0
    assert stats["logprob_mismatch/mean_abs"] == 0.0
    assert stats["kl"] == 0.0  # LoRA B starts at 0: the policy is the base model


def test_gradient_does_not_depend_on_micro_batching_or_step_subsets_order(run):
    """One update's gradient with micro-batches of 8 equals micro-batches of 3 (float32, <= 1e-5 relative), with a
    random timestep_fraction subset per image; after the update the ratio moves and the KL grows."""
    import flow_grpo
    run.cfg.timestep_fraction = 0.6
    batch = flow_grpo.generate(run, flow_grpo.sample_prompts(run, 1), 1)
    batch["advantages"] = torch.linspace(-1, 1, len(batch["rows"]))
    batch["train"] = flow_grpo.train_steps(run, len(batch["rows"]), 1)
    assert (batch["train"].sum(-1) == 3).all() and batch["train"].any(0).sum() > 3  # 3 of 5 steps, differing per image
    loss_cfg = flow_grpo.losses.LossConfig(loss_type="dapo", epsilon=0.2)
    grads = []
    for mbs in (8, 3):
        run.cfg.micro_batch_size = mbs
        flow_grpo.accumulate_gradients(run, batch, loss_cfg, first_pass=True)
        grads.append([p.grad.clone() for p in run.optimizer.param_groups[0]["params"]])
        run.optimizer.zero_grad(set_to_none=True)
    worst = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() for a, b in zip(*grads))
    assert worst <= 1e-5, worst
    assert any(g.abs().max() > 0 for g in grads[0])
    flow_grpo.accumulate_gradients(run, batch, loss_cfg, first_pass=True)
    for group in run.optimizer.param_groups:
        group["lr"] = 0.05
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    after = flow_grpo.accumulate_gradients(run, batch, loss_cfg, first_pass=True)
    run.optimizer.zero_grad(set_to_none=True)
    assert after["ratio/mean"] != 1.0 and after["kl"] > 0
    # the KL, independently: the reference is a fresh base pipeline (LoRA's starting point), the closed form written
    # here in float64 from Flow-GRPO eq. 9 (the two means differ only through v), averaged over the latent, the
    # images and their trained steps
    import images
    pipe = images.build_tiny_flow_pipeline(run.cfg.seed)
    base = images.Velocity(pipe.transformer, pipe.scheduler.config.num_train_timesteps)
    sig, a, kls = batch["sigmas"].double(), run.cfg.noise_level, []
    with torch.no_grad():
        for i in range(run.cfg.num_steps):
            for b in batch["train"][:, i].nonzero().squeeze(-1).tolist():
                x, s = batch["latents"][b:b + 1, i], batch["sigmas"][i].expand(1)
                cond = flow_grpo.pick(batch["cond"], torch.tensor([b]))
                dv = (run.module(x, s, cond, run.cfg.guidance_scale) - base(x, s, cond, run.cfg.guidance_scale)).double()
                t, dt = sig[i], sig[i] - sig[i + 1]
                std2 = a ** 2 * t / (1 - (sig[1] if t == 1 else t))
                dmu = dv * (1 + std2 / (2 * t) * (1 - t)) * dt
                kls.append((dmu ** 2 / (2 * std2 * dt)).mean().item())
    want = sum(kls) / len(kls)
    assert abs(after["kl"] - want) <= 1e-3 * want, (after["kl"], want)


# ----------------------------------------------------------------------------------------------------------
# The real script: 2 ranks under torchrun (gloo)
# ----------------------------------------------------------------------------------------------------------

def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_default_run_learns_and_resumes_exactly(tmp_path):
    """The README's no-flag run (plus --output-dir, checkpoints and evaluations every 3 steps): the mean reward of the last 10
    steps beats the first 10 by >= 0.05. Then 3 steps + resume 3 == 6 straight: checkpoint-3 of that run, resumed to
    step 6 in another directory (image grids on, which must not change training), gives the same adapter weights and
    the same per-step metrics as its checkpoint-6. Both evaluate on the same held-out prompts."""
    straight = str(tmp_path / "straight")
    evals = ["--eval.every", "3", "--eval.num-prompts", "2"]  # its prompts are held out of training: same in both runs
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
    # the adapter loads back onto the pipeline's transformer with PEFT (the documented way to use a checkpoint)
    import images
    from peft import PeftModel
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
        velocity = flow_grpo.Velocity(pipe.transformer, pipe.scheduler.config.num_train_timesteps)
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
        velocity = flow_grpo.Velocity(pipe.transformer, pipe.scheduler.config.num_train_timesteps, family="flux")
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
        velocity = flow_grpo.Velocity(pipe.transformer, pipe.scheduler.config.num_train_timesteps, family="qwen")
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
    import images
    from peft import PeftModel
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
    lines = [f"a prompt number {i}" for i in range(20)]
    (tmp_path / "p.txt").write_text("\n".join(lines) + "\n")
    for dataset in ("colors", str(tmp_path / "p.txt")):
        cfg = tyro.cli(flow_grpo.Config, args=["--dataset", dataset, "--eval.every", "5", "--eval.num-prompts", "4"])
        train, held = flow_grpo.load_prompts(cfg)
        assert len(held) == 4 and not {r["prompt"] for r in held} & {r["prompt"] for r in train}
        if dataset != "colors":
            assert sorted(r["prompt"] for r in train + held) == sorted(lines)
    cfg = tyro.cli(flow_grpo.Config, args=["--dataset", str(tmp_path / "p.txt"), "--eval.every", "5",
                                           "--eval.num-prompts", "20"])
    with pytest.raises(ValueError, match="holds out every prompt"):
        flow_grpo.load_prompts(cfg)


def test_resolution_must_fit_the_latent_grid(tmp_path):
    """flow_grpo.validate (every rank, before any collective): a real pipeline's --resolution must be a multiple of
    16 (VAE factor 8 x 2x2 patches), checked before the model loads."""
    import tyro
    import flow_grpo
    model = tmp_path / "some-pipeline"
    model.mkdir()
    cfg = tyro.cli(flow_grpo.Config, args=["--model", str(model), "--resolution", "520"])
    with pytest.raises(ValueError, match="--resolution 520 must be a multiple of 16"):
        flow_grpo.validate(cfg)
