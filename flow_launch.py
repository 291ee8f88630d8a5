"""flow_launch.py: what flow_grpo.py runs before its first step (as launch.py is for grpo.py): the diffusers pipeline
with the trained transformer behind its FSDP2 root (images.Velocity), flag validation on every rank before any
collective, the prompts, the optimizer and resume -> one Run record."""
import copy
import os
import signal
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import checkpoints
import images
import losses
import models
import plumbing
from images import Velocity


# ----------------------------------------------------------------------------------------------------------
# The model: a diffusers pipeline; the trained transformer behind one FSDP2 root that applies CFG
# ----------------------------------------------------------------------------------------------------------

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
    transformer = pipe.transformer.to(torch.bfloat16) if cfg.dtype == "bfloat16" else pipe.transformer.float()
    if cfg.lora.r:
        from peft import LoraConfig, get_peft_model
        transformer.requires_grad_(False)
        transformer = get_peft_model(transformer, LoraConfig(
            r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout, use_dora=cfg.lora.use_dora,
            use_rslora=cfg.lora.use_rslora,
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
    module = Velocity(transformer, pipe.scheduler.config.num_train_timesteps, images.pipeline_family(pipe)).to(device)
    base = transformer.get_base_model() if models.is_peft(transformer) else transformer
    for block in [*base.transformer_blocks, *getattr(base, "single_transformer_blocks", [])]:
        fully_shard(block, mp_policy=mp)
    return fully_shard(module, mp_policy=mp)


# ----------------------------------------------------------------------------------------------------------
# Setup: validate (no collective), then pipeline, policy, reference, optimizer, data, resume -> one Run record
# ----------------------------------------------------------------------------------------------------------

@dataclass
class Run:
    """State that crosses stages: built once by setup(); the stages read it and update the last few fields."""
    cfg: object  # flow_grpo.Config
    rank: int
    world: int
    device: torch.device
    pipe: object  # the diffusers pipeline (text encoders, VAE, scheduler)
    transformer: nn.Module  # the policy (a PeftModel with --lora.r > 0)
    module: nn.Module  # FSDP2 root: Velocity(transformer)
    ref_module: nn.Module | None  # full fine-tune with beta > 0: a frozen copy; LoRA: None (adapters disabled)
    optimizer: torch.optim.Optimizer
    scheduler: object
    neg: dict  # the negative prompt's encoding, neg_* [1, ...] (CFG's unconditional branch)
    rows: list
    eval_rows: list
    order: np.ndarray  # data order, the same on every rank: position = step
    reward_fns: list  # [(name, fn)]
    weights: list
    metrics_path: str
    start_step: int = 0
    bad_steps: int = 0
    sigterm: bool = False
    printed_errors: set = field(default_factory=set)


def validate(cfg):
    """Raise one clear error naming the flag and the fix, on every rank, before any collective."""
    losses.validate_loss_config(cfg.loss)
    G, B, world = cfg.num_generations, cfg.batch_size, int(os.environ.get("WORLD_SIZE", 1))
    problems = {
        "--scale-rewards must be group, batch or none": cfg.scale_rewards not in ("group", "batch", "none"),
        f"--batch-size {B} must be a multiple of --num-generations {G} (>= 2)": B % G or G < 2,
        "--micro-batch-size, --num-steps and --max-steps must be >= 1": min(cfg.micro_batch_size, cfg.num_steps, cfg.max_steps) < 1,
        "--noise-level must be > 0 to train (noise 0 is the ODE, used by evaluation)": cfg.noise_level <= 0,
        "--timestep-fraction must be in (0, 1]": not 0 < cfg.timestep_fraction <= 1,
        "--loss.loss-type: steps are tokens of equal count, so use a token-mean loss (dapo, bnpo, cispo) with "
        "--loss.importance-sampling-level token": cfg.loss.loss_type not in ("dapo", "bnpo", "cispo")
        or cfg.loss.importance_sampling_level != "token" or cfg.loss.top_entropy_quantile < 1,
        f"--eval.num-prompts {cfg.eval.num_prompts} must be a multiple of the {world} ranks":
            cfg.eval.every and cfg.eval.num_prompts % world,
        "--reward-weights needs one weight per reward function": cfg.reward_weights and len(cfg.reward_weights) != len(cfg.rewards),
        "--optim.schedule must be constant or cosine": cfg.optim.schedule not in ("constant", "cosine"),
        f"--resolution {cfg.resolution} must be a multiple of 16 (the VAE's factor 8 x the transformer's 2x2 patches "
        "in SD3, FLUX and Qwen-Image)": cfg.resolution and cfg.resolution % 16 and not cfg.model.startswith("builtin:"),
        # shared flag groups whose text-only options flow_grpo.py does not implement: refused, never silently ignored
        "--lora.adapter (continuing a saved adapter) is not supported here: start a new LoRA": cfg.lora.adapter,
        "--checkpoint.save-merged is not supported here (checkpoints hold the adapter or the full transformer)":
            cfg.checkpoint.save_merged,
        "--loss.kl-in-reward, --loss.off-policy-mask-threshold and --loss.sampler-correction need an engine's log-probs "
        "or token rewards: flow_grpo.py samples with the trained transformer itself (ratio exactly 1 before the first "
        "update), so leave them at their defaults": cfg.loss.kl_in_reward or cfg.loss.off_policy_mask_threshold
        is not None or cfg.loss.sampler_correction != losses.LossConfig.sampler_correction,
    }
    for message, bad in problems.items():
        if bad:
            raise ValueError(message)
    for name in cfg.rewards:
        images.resolve_image_reward(name)
    if cfg.model.startswith("builtin:") and cfg.model not in images.BUILTIN_PIPELINES:
        raise ValueError(f"--model {cfg.model!r}: the built-in models are {', '.join(images.BUILTIN_PIPELINES)}")
    if not cfg.model.startswith("builtin:"):
        models.check_model_path(cfg.model)
    return plumbing.resolve_resume(cfg.output_dir, cfg.resume, cfg.overwrite)


def load_prompts(cfg):
    """-> (train rows, eval rows): evaluation prompts are held out of training (a file's test split is its train)."""
    rows = images.load_prompt_rows(cfg.dataset, prompt_column=cfg.prompt_column, seed=cfg.seed)
    eval_rows = (images.load_prompt_rows(cfg.dataset, split="test", prompt_column=cfg.prompt_column,
                                        size=cfg.eval.num_prompts, seed=cfg.seed)[:cfg.eval.num_prompts]
                 if cfg.eval.every else [])
    held_out = {repr(r["prompt"]) for r in eval_rows}
    rows = [r for r in rows if repr(r["prompt"]) not in held_out]
    if not rows:
        raise ValueError(f"--eval.num-prompts {cfg.eval.num_prompts} holds out every prompt of --dataset "
                         f"{cfg.dataset!r}: lower it or use a larger dataset.")
    return rows, eval_rows


def setup(cfg):
    """Validate (every rank, no collective), then build everything and resume. -> Run."""
    plumbing.quiet_libraries(cfg.log.verbose, int(os.environ.get("RANK", 0)))
    rows, eval_rows = load_prompts(cfg)
    resume_path = validate(cfg)
    if resume_path:  # (its manifest was checked first) refuse a checkpoint of a run with other settings
        checkpoints.check_config(resume_path, checkpoints.config_record(
            cfg, train_rows=len(rows), world_size=int(os.environ.get("WORLD_SIZE", 1))), cfg.checkpoint.allow_changes)
    rank, world, device = plumbing.setup_distributed()
    checkpoints.lock_output_dir(cfg.output_dir, rank, device)  # one run per directory, before anything is written there
    if rank == 0:
        if cfg.overwrite and not resume_path:
            plumbing.clear_output_dir(cfg.output_dir)
        os.makedirs(os.path.join(cfg.output_dir, "images"), exist_ok=True)
        plumbing.restore_interrupted_replace(cfg.output_dir)
    dist.barrier()
    torch.manual_seed(cfg.seed)  # identical LoRA init on every rank; sampling has its own per-image streams
    pipe, transformer = load_pipeline(cfg, device)
    ref = None
    if cfg.loss.beta and not models.is_peft(transformer):  # LoRA's reference is the base model: adapters disabled
        ref = shard_velocity(copy.deepcopy(transformer).requires_grad_(False), pipe, cfg, device)
    module = shard_velocity(transformer, pipe, cfg, device)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, plumbing.lr_lambda(
        cfg.optim.warmup_steps, cfg.optim.schedule, cfg.max_steps * cfg.num_iterations))
    neg = images.encode_prompts(pipe, [cfg.negative_prompt], device, cfg.max_sequence_length)
    run = Run(cfg=cfg, rank=rank, world=world, device=device, pipe=pipe, transformer=transformer, module=module,
              ref_module=ref, optimizer=optimizer, scheduler=scheduler, neg={f"neg_{k}": v for k, v in neg.items()},
              rows=rows, eval_rows=eval_rows, order=np.random.default_rng(cfg.seed).permutation(len(rows)),
              reward_fns=[(n, images.resolve_image_reward(n)) for n in cfg.rewards],
              weights=list(cfg.reward_weights) or [1.0] * len(cfg.rewards),
              metrics_path=os.path.join(cfg.output_dir, "metrics.jsonl"))
    if resume_path:
        state = plumbing.load_checkpoint(resume_path, module, optimizer, rank)
        scheduler.load_state_dict(state["scheduler"])
        checkpoints.apply_lr(scheduler, cfg.optim.lr)  # a new --optim.lr (--checkpoint.allow-changes) applies
        run.start_step, run.bad_steps = state["step"], state["bad_steps"]
        if rank == 0:
            print(f"resumed from {resume_path} at step {run.start_step}", flush=True)
    if rank == 0:
        plumbing.trim_metrics(run.metrics_path, run.start_step)
    signal.signal(signal.SIGTERM, lambda *_: setattr(run, "sigterm", True))  # preemption: save at the next safe point
    return run
