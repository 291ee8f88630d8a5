"""flow_launch.py: what flow_grpo.py runs before its first step (as launch.py is for grpo.py): the diffusers pipeline
with the trained transformer behind its FSDP2 root (images.Velocity), flag validation on every rank before any
collective, the prompts, the optimizer and resume -> one Run record; and flow_grpo.Config's flag groups."""
import copy
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import tyro
from torch import nn

import checkpoints
import console
import distributed
import images
import models
import optim
from images import Velocity
from optim import trainable

# ---- flow_grpo.py's flag groups (tyro): the shared ones narrowed to what flow_grpo.py does, and its own ----

@dataclass
class EvalConfig:
    every: int = 0
    """Evaluate on held-out prompts with the ODE (noise 0) every this many steps, and before the first (0 = never)."""
    num_prompts: int = 8
    """Held-out prompts per evaluation, one image each (split across ranks; a multiple of the number of ranks)."""
    num_steps: int = 40
    """Denoising steps for evaluation (the paper trains with 10 and evaluates with 40)."""


@dataclass
class FlowLogConfig(console.LogConfig):
    completions_every: tyro.conf.Suppress[int] = 0  # text completions: grpo.py's; images: images_every
    verbose: bool = False
    """Show library INFO logs and progress bars (diffusers, transformers); warnings and errors show either way."""
    images_every: int = 0
    """Write a grid PNG of prompts x generations (rank 0's) to <output-dir>/images/ every N steps, and to wandb (0 =
    never). Evaluations always write their grid there."""


@dataclass
class FlowLossConfig:
    loss_type: str = "dapo"
    """dapo | bnpo | cispo: the clipped objective averaged over every trained (image, denoising step) pair, each step a
    token of losses.policy_loss (train_sd3.py's mean over images and steps)."""
    epsilon: float = 1e-4
    """Clip: the ratio is clipped to [1 - epsilon, 1 + epsilon_high] (train_sd3.py's clip_range 1e-4: the log-probs are
    per-dimension means, so ratios stay near 1)."""
    epsilon_high: float | None = None
    """Upper clip (None -> epsilon); for cispo the cap on the ratio."""
    delta: float | None = None
    """Upper cap on the unclipped ratio (two-sided clipping, INTELLECT-2 arXiv 2505.07291). None = off."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative advantages (arXiv 1912.09729). None = off."""
    beta: float = 0.0
    """KL coefficient, the reference's train.beta (its SD3 configs: 0.01 PickScore, 0.04 OCR and GenEval) with
    --loss.kl-form reference. 0: no reference pass."""
    kl_form: str = "reference"
    """reference: per step |mu - mu_ref|^2 / (2 s_t^2), averaged over the latent (train_sd3.py's kl_loss) | exact: the
    KL of the two Gaussian steps, |mu - mu_ref|^2 / (2 s_t^2 |dt|) = reference / |dt|: with 10 steps and shift 3 that
    is 3.7x-112x per step (23x averaged over all 10, 13x over the first 9), so a published beta does not transfer."""


@dataclass
class FlowLoraConfig(models.LoraConfig):
    target_modules: tuple[str, ...] | None = None
    """Module names to adapt. Default: every block's attention projections (SD3: train_sd3.py's attn.* list, so not
    SD3.5's second attention attn2; Qwen-Image also the image and text MLPs)."""
    init: str = "gaussian"
    """LoRA initialisation (PEFT's init_lora_weights), B = 0 either way: gaussian, A ~ normal with std 1/r
    (train_sd3.py's) | default, PEFT's Kaiming-uniform A."""
    adapter: tyro.conf.Suppress[str | None] = None  # continuing an adapter: grpo.py only
    sync: tyro.conf.Suppress[str | None] = None  # what an inference engine gets: grpo.py only


@dataclass
class FlowCheckpointConfig(checkpoints.CheckpointConfig):
    save_merged: tyro.conf.Suppress[bool] = False  # checkpoints hold the adapter or the full transformer
    allow_changes: tuple[str, ...] = ()
    """--resume: settings that may differ from the checkpoint's (max_steps, optim.lr, optim.max_grad_norm, eval.every,
    micro_batch_size); any other difference is refused."""


@dataclass
class FlowEMAConfig:
    decay: float = 0.0
    """EMA of the trained weights for evaluation and checkpoint-N/ema/ (sampling for training uses the live ones), with
    the decay warmed up as min((1 + k) / (10 + k), decay) at optimizer step k (Flow-GRPO's EMAModuleWrapper; its SD3
    configs: 0.9). 0 = off."""
    every: int = 8
    """Update the EMA after every this-many-th optimizer step (the reference's update_step_interval 8)."""
    repeat: int = 1
    """Apply each due update this many times (decay^repeat): train_sd3.py steps its EMA once per sample batch, so each
    due update lands gradient_accumulation_steps times (its pickscore_sd3 config: 2; the _4gpu/_1gpu ones: 4)."""


# ---- The model: a diffusers pipeline; the trained transformer behind one FSDP2 root that applies CFG ----

def load_pipeline(cfg, device):
    """The pipeline with frozen text encoders and VAE on `device`; the transformer with LoRA adapters (or all of it)
    trainable. The builtin: pipelines are built in memory from cfg.seed, the same on every rank."""
    if cfg.model in images.BUILTIN_PIPELINES:
        pipe = images.BUILTIN_PIPELINES[cfg.model](cfg.seed)
    else:
        from diffusers import DiffusionPipeline
        pipe = DiffusionPipeline.from_pretrained(cfg.model, torch_dtype=torch.float32 if device.type == "cpu" or
                                                 cfg.dtype == "float32" else torch.bfloat16)
    from diffusers import FlowMatchEulerDiscreteScheduler
    family = images.pipeline_family(pipe)
    if family is None or not isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
        raise ValueError(f"--model {cfg.model!r} is a {type(pipe).__name__} with a {type(pipe.scheduler).__name__}: "
                         "this version wires StableDiffusion3Pipeline (SD3 / SD3.5), FluxPipeline (FLUX.1) and "
                         "QwenImagePipeline (Qwen-Image) with a FlowMatchEulerDiscreteScheduler.")
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae"):
        if getattr(pipe, name, None) is not None:
            getattr(pipe, name).to(device).eval().requires_grad_(False)
    transformer = pipe.transformer.to({"bfloat16": torch.bfloat16, "float64": torch.float64}.get(cfg.dtype, torch.float32))
    if cfg.lora.r:
        from peft import LoraConfig, get_peft_model
        transformer.requires_grad_(False)
        transformer = get_peft_model(transformer, LoraConfig(
            r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout, use_dora=cfg.lora.use_dora,
            use_rslora=cfg.lora.use_rslora, init_lora_weights=cfg.lora.init == "default" or cfg.lora.init,
            target_modules=list(cfg.lora.target_modules or images.LORA_TARGETS[family])))
    return pipe, transformer


def shard_velocity(transformer, pipe, cfg, device):
    """FSDP2: fully_shard every transformer block, then the Velocity root; bf16 compute on CUDA with --dtype auto."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # diffusers' FLUX single blocks return slices of one tensor, and the root's output is a view: every later use is
    # out of place (torch.cat, arithmetic), so FSDP2's in-place warning does not apply
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP(FluxSingleTransformerBlock|Velocity)\) "
                                              "returned a view tensor")
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if device.type == "cuda" and cfg.dtype == "auto" else MixedPrecisionPolicy())
    if cfg.dtype == "float64":  # tests: the root casts the float32 latents and text embeddings to float64
        mp = MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float64)
    module = Velocity(transformer, pipe.scheduler.config.num_train_timesteps, images.pipeline_family(pipe)).to(device)
    base = transformer.get_base_model() if models.is_peft(transformer) else transformer
    for block in [*base.transformer_blocks, *getattr(base, "single_transformer_blocks", [])]:
        fully_shard(block, mp_policy=mp)
    return fully_shard(module, mp_policy=mp)


# ---- Setup: validate (no collective), then pipeline, policy, reference, optimizer, data, resume -> one Run record ----

@dataclass(kw_only=True)
class Run(checkpoints.RunState):
    """State that crosses stages: built once by setup(); the stages read it and update the last few fields."""
    pipe: object  # the diffusers pipeline (text encoders, VAE, scheduler)
    transformer: nn.Module  # the policy (a PeftModel with --lora.r > 0)
    neg: dict  # the negative prompt's encoding, neg_* [1, ...] (CFG's unconditional branch)
    updates: int = 0  # optimizer steps taken (the EMA's schedule counts them)


def validate(cfg):
    """Raise one clear error naming the flag and the fix, on every rank, before any collective."""
    G, B, world, S = cfg.num_generations, cfg.batch_size, int(os.environ.get("WORLD_SIZE", 1)), cfg.num_steps
    choices = {"--scale-rewards": (cfg.scale_rewards, ("global", "group", "batch", "none")),
               "--loss.loss-type": (cfg.loss.loss_type, ("dapo", "bnpo", "cispo")),
               "--loss.kl-form": (cfg.loss.kl_form, ("reference", "exact")),
               "--guidance-grad": (cfg.guidance_grad, ("cond", "both")),
               "--timestep-selection": (cfg.timestep_selection, ("first", "random")),
               "--dtype": (cfg.dtype, ("auto", "float32", "bfloat16", "float64")),
               "--lora.init": (cfg.lora.init, ("gaussian", "default"))}
    problems = {
        **{f"{flag} {value!r} is not known: use one of {', '.join(allowed)}": value not in allowed
           for flag, (value, allowed) in choices.items()},
        f"--batch-size {B} must be a multiple of --num-generations {G} (G >= 2, or G = 1 with --scale-rewards global, "
        "which then normalises by the batch's statistics)": B % G or (G < 2 and cfg.scale_rewards != "global"),
        f"--batch-size {B} must be a multiple of --steps-per-generation {cfg.steps_per_generation} (>= 1)":
            cfg.steps_per_generation < 1 or B % cfg.steps_per_generation,
        "--micro-batch-size, --num-steps, --max-steps and --num-iterations must be >= 1":
            min(cfg.micro_batch_size, S, cfg.max_steps, cfg.num_iterations) < 1,
        "--noise-level must be > 0 to train (noise 0 is the ODE, used by evaluation)": cfg.noise_level <= 0,
        f"--timestep-fraction must be in (0, 1] and train at least one of the {S} steps (first: int(S x fraction))":
            not 0 < cfg.timestep_fraction <= 1 or (cfg.timestep_selection == "first" and S * cfg.timestep_fraction < 1),
        "--ema.decay must be in [0, 1) (0 = off), --ema.every and --ema.repeat >= 1":
            not 0 <= cfg.ema.decay < 1 or min(cfg.ema.every, cfg.ema.repeat) < 1,
        f"--eval.num-prompts {cfg.eval.num_prompts} must be a multiple of the {world} ranks":
            cfg.eval.every and cfg.eval.num_prompts % world,
        "--reward-weights needs one weight per reward function": cfg.reward_weights and len(cfg.reward_weights) != len(cfg.rewards),
        "--optim.schedule must be constant or cosine": cfg.optim.schedule not in ("constant", "cosine"),
        f"--resolution {cfg.resolution} must be a multiple of 16 (the VAE's factor 8 x the transformer's 2x2 patches "
        "in SD3, FLUX and Qwen-Image)": cfg.resolution and cfg.resolution % 16 and not cfg.model.startswith("builtin:"),
    }
    for message, bad in problems.items():
        if bad:
            raise ValueError(message)
    optim.check_optim(cfg.optim)
    for name in cfg.rewards:
        images.resolve_image_reward(name)
    if cfg.model.startswith("builtin:") and cfg.model not in images.BUILTIN_PIPELINES:
        raise ValueError(f"--model {cfg.model!r}: the built-in models are {', '.join(images.BUILTIN_PIPELINES)}")
    if not cfg.model.startswith("builtin:"):
        models.check_model_path(cfg.model)
    return checkpoints.resolve_resume(cfg.output_dir, cfg.resume, cfg.overwrite)


def load_prompts(cfg):
    """-> (train rows, eval rows): evaluation prompts are held out of training (a file's test split is its train);
    they are drawn with seed 0, so runs with any --seed are evaluated on the same prompts."""
    rows = images.load_prompt_rows(cfg.dataset, prompt_column=cfg.prompt_column, seed=cfg.seed)
    eval_rows = (images.load_prompt_rows(cfg.dataset, split="test", prompt_column=cfg.prompt_column,
                                        size=cfg.eval.num_prompts, seed=0)[:cfg.eval.num_prompts]  # not --seed
                 if cfg.eval.every else [])
    held_out = {repr(r["prompt"]) for r in eval_rows}
    rows = [r for r in rows if repr(r["prompt"]) not in held_out]
    if not rows:
        raise ValueError(f"--eval.num-prompts {cfg.eval.num_prompts} holds out every prompt of --dataset "
                         f"{cfg.dataset!r}: lower it or use a larger dataset.")
    return rows, eval_rows


def setup(cfg):
    """Validate (every rank, no collective), then build everything and resume. -> Run."""
    console.quiet_libraries(cfg.log.verbose, int(os.environ.get("RANK", 0)))
    with console.user_input():
        rows, eval_rows = load_prompts(cfg)
        resume_path = validate(cfg)
        record = checkpoints.config_record(cfg, train_rows=len(rows), world_size=int(os.environ.get("WORLD_SIZE", 1)))
        if resume_path:  # (its manifest was checked first) refuse a checkpoint of a run with other settings
            checkpoints.check_config(resume_path, record, cfg.checkpoint.allow_changes,
                                     checkpoints.config_record(type(cfg)()))
    rank, world, device = distributed.setup_distributed()
    with console.user_input():  # one run per directory, before anything is written there
        checkpoints.take_output_dir(cfg.output_dir, cfg.resume, cfg.overwrite, resume_path, rank, device)
    if rank == 0:
        os.makedirs(os.path.join(cfg.output_dir, "images"), exist_ok=True)
    torch.manual_seed(cfg.seed)  # identical LoRA init on every rank; sampling has its own per-image streams
    pipe, transformer = load_pipeline(cfg, device)
    ref = None
    if cfg.loss.beta and not models.is_peft(transformer):  # LoRA's reference is the base model: adapters disabled
        ref = shard_velocity(copy.deepcopy(transformer).requires_grad_(False), pipe, cfg, device)
    module = shard_velocity(transformer, pipe, cfg, device)
    optimizer, scheduler = optim.adamw([p for _, p in trainable(module)], cfg.optim, cfg.optim.betas,
                                       cfg.max_steps * cfg.num_iterations * cfg.steps_per_generation)
    neg = images.encode_prompts(pipe, [cfg.negative_prompt], device, cfg.max_sequence_length)
    run = Run(cfg=cfg, rank=rank, world=world, device=device, pipe=pipe, transformer=transformer, module=module,
              ref_module=ref, ema=optim.ema_init(trainable(module), cfg.ema.decay), optimizer=optimizer,
              scheduler=scheduler, neg={f"neg_{k}": v for k, v in neg.items()},
              rows=rows, eval_rows=eval_rows, order=np.random.default_rng(cfg.seed).permutation(len(rows)),
              reward_fns=[(n, images.resolve_image_reward(n)) for n in cfg.rewards],
              weights=list(cfg.reward_weights) or [1.0] * len(cfg.rewards),
              metrics_path=os.path.join(cfg.output_dir, "metrics.jsonl"), config_record=record)
    run.updates = checkpoints.start_run(run, resume_path).get("updates", 0)
    return run
