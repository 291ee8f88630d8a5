"""grpo.py: GRPO-family RL post-training in one file: FSDP2 policy + colocated vLLM engine + pure losses.

    torchrun --nproc_per_node 2 grpo.py                                  # CPU: tiny built-in policy learns offline
    torchrun --nproc_per_node 8 grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset openai/gsm8k:main \\
        --data.answer-column answer --data.rewards accuracy format --max-completion-length 512 ...
    python grpo.py --help                                                # every flag, with its docstring

One step: sample prompts -> sync weights -> generate -> rewards -> advantages -> old/ref log-probs ->
steps_per_generation x num_iterations optimizer updates -> log. See README.md for the recipes and metrics.
"""
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import tyro
from torch import nn

import losses
import models
import rollout
import tasks


# ----------------------------------------------------------------------------------------------------------
# Config: every field is a CLI flag (tyro); the docstring under it is its --help text
# ----------------------------------------------------------------------------------------------------------

@dataclass
class PolicyConfig:
    dtype: str = "auto"
    """Parameter dtype for training: auto (fp32 master weights + bf16 compute on CUDA, fp32 on CPU) | float32 | bfloat16."""
    attn_implementation: str | None = None
    """Attention kernel (default: flash_attention_2 when installed on CUDA, else sdpa)."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the checkpoint."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (activation checkpointing)."""
    freeze_vision: bool = True
    """Image-text models: keep the vision tower and projector frozen."""


@dataclass
class RolloutConfig:
    engine: str = "auto"
    """vllm | hf | auto (vllm when installed, else transformers generate)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer's log-probs use the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    max_prompt_length: int = 128
    """Prompts longer than this are truncated from the left."""
    max_completion_length: int = 8
    """Maximum generated tokens per completion (also Dr. GRPO's constant denominator)."""
    mask_truncated_completions: bool = False
    """Exclude completions that hit max_completion_length without EOS from the loss (DAPO)."""


@dataclass
class DataConfig:
    prompt_column: str = "prompt"
    """Dataset column holding the prompt (plain text or chat messages)."""
    answer_column: str = "answer"
    """Dataset column passed to reward functions as `answer` (optional)."""
    split: str = "train"
    """Hub dataset split for training."""
    eval_split: str | None = None
    """Hub dataset split for evaluation (default: the last eval.num_prompts rows of train, held out)."""
    size: int = 4000
    """Number of prompts generated for built-in tasks."""
    chat_template: bool = True
    """Wrap plain-text prompts as a user message and apply the tokenizer's chat template (when it has one)."""
    system_prompt: str | None = None
    """Optional system message prepended to chat prompts."""
    rewards: tuple[str, ...] = ()
    """Reward functions: accuracy | format | countdown | max_digit | overlong | package.module:function (default: the task's)."""
    reward_weights: tuple[float, ...] = ()
    """One weight per reward function (default: all 1)."""
    overlong_cache: int = 4
    """DAPO soft overlong penalty: the last this-many tokens before max_completion_length are penalised linearly."""


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
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


@dataclass
class LogConfig:
    completions_every: int = 20
    """Print a table of prompt / completion / reward / advantage every this many steps (0 = never)."""
    progress: bool = True
    """Show a progress bar over steps (rank 0)."""


@dataclass
class WandbConfig:
    mode: str = "disabled"
    """online | offline | disabled."""
    project: str = "grpo"
    """wandb project."""
    name: str | None = None
    """wandb run name (default: the output_dir's name)."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save every this many steps (0 = only at the end). Saves are atomic: written to a temp dir, then renamed."""
    keep: int = 2
    """Keep only the newest N checkpoints (0 = keep all)."""
    save_merged: bool = False
    """LoRA: also save a merged full model under checkpoint-N/merged."""


@dataclass
class EvalConfig:
    every: int = 0
    """Evaluate on held-out prompts every this many steps (0 = never)."""
    num_prompts: int = 64
    """Held-out prompts per evaluation (split across ranks)."""
    n_samples: int = 1
    """1 = greedy (temperature 0); >1 = sample this many at the rollout temperature and report pass@1."""


@dataclass
class Config:
    model: str = "builtin:tiny"
    """Hub id or local checkpoint; builtin:tiny builds a tiny random Qwen2 with a character tokenizer (offline)."""
    dataset: str = "max_digit"
    """Built-in task (max_digit | arith | countdown), a local .jsonl/.parquet file, or a hub dataset (name[:config])."""
    output_dir: str = "outputs/run"
    """Where metrics.jsonl and checkpoint-<step>/ go."""
    max_steps: int = 100
    """Number of steps (one step = one generation batch and its optimizer updates)."""
    seed: int = 0
    """Base seed; each rank derives its own."""
    resume: str | None = None
    """'latest' (newest checkpoint in output_dir) or a checkpoint path."""
    num_generations: int = 8
    """G: completions per prompt (one group; a group never spans ranks)."""
    batch_size: int = 64
    """Completions per rank per optimizer update (a multiple of num_generations)."""
    micro_batch_size: int = 64
    """Completions per forward/backward (gradient accumulation inside one update)."""
    steps_per_generation: int = 1
    """Optimizer updates per generation batch (the batch is split into this many minibatches)."""
    num_iterations: int = 1
    """mu: passes over each generation batch (PPO epochs)."""
    scale_rewards: str = "group"
    """group | batch | none: divide advantages by the group std, the batch std, or nothing (Dr. GRPO)."""
    advantage_estimator: str = "grpo"
    """grpo (group mean baseline, scaled by scale_rewards) | rloo (leave-one-out baseline)."""
    reward_aggregation: str = "sum_then_normalize"
    """Several reward functions: sum_then_normalize | normalize_then_sum (GDPO)."""
    max_bad_steps: int = 3
    """Stop (with a checkpoint) after this many consecutive steps with a NaN/Inf loss or gradient norm."""
    kl_target: float | None = None
    """Adaptive KL (Ziegler et al., arXiv 1909.08593): steer the measured KL to this value, starting from --loss.beta."""
    kl_horizon: int = 10000
    """Adaptive KL horizon (in steps)."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    lora: models.LoraConfig = field(default_factory=models.LoraConfig)
    vllm: rollout.VLLMConfig = field(default_factory=rollout.VLLMConfig)  # before `rollout`, which shadows the module
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: losses.LossConfig = field(default_factory=losses.LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# ----------------------------------------------------------------------------------------------------------
# Validation: every rank runs this before any collective, so bad input fails everywhere at once, never hangs
# ----------------------------------------------------------------------------------------------------------

def engine_kind(cfg):
    if cfg.rollout.engine != "auto":
        return cfg.rollout.engine
    try:
        import vllm  # noqa: F401
        return "vllm"
    except ImportError:
        return "hf"


def validate(cfg, rows):
    """Raise one clear error naming the flag and the fix."""
    from transformers import AutoConfig
    losses.validate_loss_config(cfg.loss)
    choices = {"--scale-rewards": (cfg.scale_rewards, ("group", "batch", "none")),
               "--advantage-estimator": (cfg.advantage_estimator, ("grpo", "rloo")),
               "--reward-aggregation": (cfg.reward_aggregation, ("sum_then_normalize", "normalize_then_sum")),
               "--rollout.engine": (cfg.rollout.engine, ("auto", "vllm", "hf")),
               "--optim.schedule": (cfg.optim.schedule, ("constant", "cosine"))}
    for flag, (value, allowed) in choices.items():
        if value not in allowed:
            raise ValueError(f"{flag} {value!r} is not known: use one of {', '.join(allowed)}")
    if cfg.num_generations < 2 and (cfg.scale_rewards != "none" or cfg.advantage_estimator == "rloo"):
        raise ValueError(f"--num-generations {cfg.num_generations}: group-relative advantages need at least 2 "
                         "completions per prompt. Use --num-generations 2 or more.")
    G, B = cfg.num_generations, cfg.batch_size
    if B % G or (B * cfg.steps_per_generation) % G or B % min(cfg.micro_batch_size, B):
        raise ValueError(f"--batch-size {B} must hold whole groups of --num-generations {G} (and split evenly into "
                         f"--micro-batch-size {cfg.micro_batch_size}). Use e.g. --batch-size {max(G, B // G * G)}.")
    total = cfg.rollout.max_prompt_length + cfg.rollout.max_completion_length
    if engine_kind(cfg) == "vllm" and total > cfg.vllm.max_model_len:
        raise ValueError(f"--rollout.max-prompt-length + --rollout.max-completion-length = {total} exceeds "
                         f"--vllm.max-model-len {cfg.vllm.max_model_len}. Raise --vllm.max-model-len or shorten them.")
    if cfg.data.reward_weights and len(cfg.data.reward_weights) != len(reward_names(cfg)):
        raise ValueError(f"--data.reward-weights has {len(cfg.data.reward_weights)} values for "
                         f"{len(reward_names(cfg))} reward functions: give one weight per function.")
    for name in reward_names(cfg):
        tasks.resolve_reward(name)
    if cfg.model.startswith("builtin:") and cfg.model != "builtin:tiny":
        raise ValueError(f"--model {cfg.model!r}: the only built-in model is builtin:tiny")
    if not cfg.model.startswith("builtin:"):
        models.check_model_path(cfg.model)
    image_text = not cfg.model.startswith("builtin:") and models.is_image_text(
        AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.policy.trust_remote_code))
    if rows and rows[0].get("image") is not None and not image_text:
        raise ValueError(f"--dataset {cfg.dataset!r} has images but --model {cfg.model!r} is a text-only model. "
                         "Use an image-text checkpoint (e.g. Qwen2.5-VL) or a text dataset.")


def reward_names(cfg):
    return list(cfg.data.rewards) or tasks.DEFAULT_REWARDS.get(cfg.dataset, ["accuracy"])


# ----------------------------------------------------------------------------------------------------------
# Distributed setup and the log-prob module
# ----------------------------------------------------------------------------------------------------------

def setup_distributed():
    """torchrun or a single process; nccl on CUDA, gloo on CPU. -> (rank, world, device)."""
    if "RANK" not in os.environ:  # plain `python grpo.py`: a world of one, so FSDP2 and vLLM see a process group
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank) if cuda else torch.device("cpu")


class TokenLogprobs(nn.Module):
    """The FSDP2 root: one forward runs the policy and returns per-token log-probs (and entropies) of the completion
    tokens through the fused lm-head, so the head weight is used inside the root's forward, where FSDP2 has it
    unsharded. Layout: each row is prompt + completion, right-padded (positions then match the engine's)."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy
        self.transform = models.head_transform(policy.config)
        self.banned = models.placeholder_token_ids(policy.config)

    def forward(self, batch, temperature, with_entropy=False):
        hidden = models.final_hidden_states(self.policy, batch["input_ids"], batch["attention_mask"], **batch["mm"])
        targets = batch["input_ids"][:, 1:]  # [B, L-1]: position j predicts token j+1
        head = models.lm_head(self.policy)
        bias = getattr(head, "bias", None)
        if self.banned:  # the engine applies the same logit bias (models.placeholder_token_ids)
            bias = (bias if bias is not None else head.weight.new_zeros(head.weight.shape[0])).clone()
            bias[self.banned] += models.PLACEHOLDER_BIAS
        lp, ent = losses.fused_linear_logprobs(hidden[:, :-1], head.weight, targets, bias=bias,
                                               temperature=temperature, mask=batch["target_mask"],
                                               with_entropy=with_entropy, **self.transform)  # [B, L-1]
        idx, cm = batch["completion_index"], batch["completion_mask"]  # [B, T]: where each completion token is predicted
        return lp.gather(1, idx) * cm, (ent.gather(1, idx) * cm if ent is not None else None)  # [B, T], 0 past the end


def shard(module, mp_policy):
    """FSDP2: fully_shard each decoder layer, then the root (TokenLogprobs)."""
    from torch.distributed.fsdp import fully_shard
    for layer in models.decoder_layers(module.policy):
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(module, mp_policy=mp_policy)
    return module


def collate(samples, pad_id, device, T, image_token_id=None):
    """samples: dicts with prompt_ids, completion_ids (and mm tensors) -> right-padded batch.

    Example (pad = _): prompt [5 6 7], completion [8 9]  ->  input_ids [5 6 7 8 9 _], completion_index [2 3]
    (the hidden state at position 2 predicts token 8)."""
    L = max(len(s["prompt_ids"]) + len(s["completion_ids"]) for s in samples)
    ids = torch.full((len(samples), L), pad_id, dtype=torch.long)
    am = torch.zeros(len(samples), L, dtype=torch.long)
    cidx = torch.zeros(len(samples), T, dtype=torch.long)
    tmask = torch.zeros(len(samples), L - 1, dtype=torch.bool)  # positions whose next token is a completion token
    for i, s in enumerate(samples):
        p, c = list(s["prompt_ids"]), list(s["completion_ids"])
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        am[i, :len(p) + len(c)] = 1
        cidx[i] = (torch.arange(T) + len(p) - 1).clamp(max=L - 2)
        tmask[i, len(p) - 1:len(p) - 1 + len(c)] = True
    cmask = torch.arange(T)[None] < torch.tensor([len(s["completion_ids"]) for s in samples])[:, None]  # [B, T]
    mm = {}
    if any("mm" in s for s in samples):
        for k in samples[0]["mm"]:
            mm[k] = torch.cat([s["mm"][k] for s in samples]).to(device)
        mm["mm_token_type_ids"] = (ids == image_token_id).long().to(device)  # Qwen2.5-VL needs it in training
    return {"input_ids": ids.to(device), "attention_mask": am.to(device), "completion_index": cidx.to(device),
            "target_mask": tmask.to(device), "completion_mask": cmask.to(device), "mm": mm}


# ----------------------------------------------------------------------------------------------------------
# Prompts, rewards, update: the pieces the loop calls
# ----------------------------------------------------------------------------------------------------------

def encode_prompt(row, processor, max_prompt_length, chat_template=True, system_prompt=None):
    """Row -> {prompt_ids, engine prompt, text, (mm tensors)}. Chat messages (and, with chat_template, plain-text
    prompts wrapped as a user message) go through the tokenizer's chat template when it has one."""
    tok = getattr(processor, "tokenizer", processor)
    prompt, image = row["prompt"], row.get("image")
    has_template = getattr(processor, "chat_template", None) or getattr(tok, "chat_template", None)
    if isinstance(prompt, str) and chat_template and has_template:
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        if system_prompt and prompt[0]["role"] != "system":
            prompt = [{"role": "system", "content": system_prompt}] + prompt
        if image is not None and not any(isinstance(m.get("content"), list) for m in prompt):
            first_user = next(i for i, m in enumerate(prompt) if m["role"] == "user")
            prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": m["content"]}]}
                      if i == first_user else m for i, m in enumerate(prompt)]
        text = processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    if image is not None:
        enc = processor(text=[text], images=[image], return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        mm = {k: v for k, v in enc.items() if k in ("pixel_values", "image_grid_thw")}
        return {"prompt_ids": ids, "text": text, "mm": mm,
                "engine": {"prompt": text, "multi_modal_data": {"image": image}, "prompt_token_ids": ids,
                           "hf_inputs": mm}}
    ids = tok(text, add_special_tokens=False)["input_ids"][-max_prompt_length:]  # left truncation
    return {"prompt_ids": ids, "text": text, "engine": {"prompt_token_ids": ids}}


def optimizer_step(params, optimizer, scheduler, max_grad_norm, loss_value):
    """Clip and step; a NaN/Inf loss or gradient norm skips the step (grads dropped). -> (grad_norm, skipped)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    skipped = not (math.isfinite(loss_value) and torch.isfinite(grad_norm).item())
    if not skipped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.item(), skipped


def sync_engine(engine, policy, dtype, policy_changed):
    """Wake the engine and push the policy's weights if they changed (all of them after a discarding sleep)."""
    engine.wake_up()
    if policy_changed or engine.needs_full_sync:
        engine.load_weights(rollout.iter_engine_weights(policy, dtype, full=engine.needs_full_sync))


def lr_lambda(cfg, total_updates):
    def f(u):
        if u < cfg.optim.warmup_steps:
            return (u + 1) / (cfg.optim.warmup_steps + 1)
        if cfg.optim.schedule == "cosine":
            progress = (u - cfg.optim.warmup_steps) / max(1, total_updates - cfg.optim.warmup_steps)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0
    return f


def all_mean(values, device):
    """Global mean over all ranks of a list of floats (NaN ignored) -> float."""
    v = np.asarray(values, dtype=np.float64)
    t = torch.tensor([np.nansum(v), np.sum(~np.isnan(v))], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t[0] / t[1]).item() if t[1] > 0 else float("nan")


def all_gather_cat(x):
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return torch.cat(out)


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: HF-format policy + everything needed to resume exactly; atomic via temp dir + rename
# ----------------------------------------------------------------------------------------------------------

def checkpoint_steps(output_dir):
    """Steps of the complete checkpoints (trainer_state.json present) in output_dir, ascending."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    return sorted(int(d[11:]) for d in names if d.startswith("checkpoint-") and d[11:].isdigit()
                  and os.path.exists(os.path.join(output_dir, d, "trainer_state.json")))


def latest_checkpoint(output_dir):
    steps = checkpoint_steps(output_dir)
    return os.path.join(output_dir, f"checkpoint-{steps[-1]}") if steps else None


def save_hf(module, processor, path, rank, save_merged):
    """The policy in Hugging Face format (adapter for LoRA), gathered from the shards (a collective)."""
    policy = module.policy
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in policy.state_dict().items()}
    if rank == 0:
        policy.save_pretrained(path, state_dict=full)
        processor.save_pretrained(path)
    if save_merged and models.is_peft(policy):
        merged = dict(rollout.iter_engine_weights(policy, torch.float32))
        if rank == 0:
            policy.get_base_model().save_pretrained(os.path.join(path, "merged"), state_dict=merged)
            processor.save_pretrained(os.path.join(path, "merged"))


def save_resume_state(module, optimizer, path, rank, trainer_state):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(module, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(path, "dcp"))
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    torch.save(rng, os.path.join(path, f"rng-rank{rank}.pt"))
    dist.barrier()
    if rank == 0:  # written last: its presence marks a complete checkpoint
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump(trainer_state, f)


def save_checkpoint(cfg, module, optimizer, processor, step, trainer_state):
    rank = dist.get_rank()
    final, tmp = os.path.join(cfg.output_dir, f"checkpoint-{step}"), os.path.join(cfg.output_dir, f".tmp-checkpoint-{step}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    save_hf(module, processor, tmp, rank, cfg.checkpoint.save_merged)
    save_resume_state(module, optimizer, tmp, rank, trainer_state)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # atomic: a crash before this line leaves the previous checkpoint as the latest
        for old in checkpoint_steps(cfg.output_dir)[:-cfg.checkpoint.keep] if cfg.checkpoint.keep else []:
            shutil.rmtree(os.path.join(cfg.output_dir, f"checkpoint-{old}"), ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path, module, optimizer, rank):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(module, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = torch.load(os.path.join(path, f"rng-rank{rank}.pt"), weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"])
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------------

def evaluate(cfg, engine, encoded, rows, reward_fns, tok, rank, world, device, step):
    mine = list(range(rank, len(rows), world))
    n = cfg.eval.n_samples
    temperature = 0.0 if n == 1 else cfg.rollout.temperature
    outs = engine.generate([encoded[i]["engine"] for i in mine], n=n, temperature=temperature, top_p=cfg.rollout.top_p,
                           top_k=cfg.rollout.top_k, max_tokens=cfg.rollout.max_completion_length, seed=cfg.seed + step)
    ids = [c.token_ids for o in outs for c in o]
    comps = [tok.decode(i, skip_special_tokens=True) for i in ids]
    rws = [rows[i] for i in mine for _ in range(n)]
    r, _ = tasks.score_rewards(reward_fns, rws, comps, ids, set()) if rws else (torch.zeros(0, 1), None)
    total = r.nan_to_num(0).sum(-1).tolist()
    key = "eval/pass@1" if n > 1 else "eval/accuracy"
    return {"eval/reward": all_mean(total, device), key: all_mean([float(x >= 1.0 - 1e-6) for x in total], device)}


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------

def main(cfg: Config):
    t_start = time.time()
    cfg.loss.max_completion_length = cfg.rollout.max_completion_length
    # ---- validate on every rank, before any collective ----
    rows = tasks.load_dataset_rows(cfg.dataset, split=cfg.data.split, prompt_column=cfg.data.prompt_column,
                                   answer_column=cfg.data.answer_column, size=cfg.data.size, seed=cfg.seed)
    validate(cfg, rows)
    if cfg.resume and cfg.resume != "latest" and not os.path.exists(os.path.join(cfg.resume, "trainer_state.json")):
        raise FileNotFoundError(f"--resume {cfg.resume!r}: not a complete checkpoint (no trainer_state.json). "
                                "Pass a checkpoint-<step> directory or 'latest'.")
    eval_split = cfg.data.eval_split or ("test" if cfg.dataset in tasks.BUILTIN_TASKS else None)
    if cfg.eval.every and eval_split:
        eval_rows = tasks.load_dataset_rows(cfg.dataset, split=eval_split, prompt_column=cfg.data.prompt_column,
                                            answer_column=cfg.data.answer_column, size=cfg.eval.num_prompts,
                                            seed=cfg.seed)[:cfg.eval.num_prompts]
    else:  # hold out the tail of the training set
        eval_rows, rows = (rows[-cfg.eval.num_prompts:], rows[:-cfg.eval.num_prompts]) if cfg.eval.every else ([], rows)

    model_path = cfg.model
    if cfg.model == "builtin:tiny":  # every rank writes its own identical copy (before init: transformers saves
        # only on rank 0 once a process group exists): no race, no collective
        model_path = os.path.join(cfg.output_dir, "builtin-tiny", f"rank{os.environ.get('RANK', '0')}")
        if not os.path.exists(os.path.join(model_path, "config.json")):
            models.build_tiny_model(model_path, seed=cfg.seed)

    # ---- distributed setup ----
    rank, world, device = setup_distributed()
    tp = cfg.vllm.tp if engine_kind(cfg) == "vllm" else 1
    dp_rank, dp_world, tp_rank = rank // tp, world // tp, rank % tp
    os.makedirs(cfg.output_dir, exist_ok=True)
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed)  # identical init on every rank; per-rank sampling is seeded per request

    # ---- policy, reference, optimizer ----
    cuda = device.type == "cuda"
    dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.policy.dtype]
    load_opts = dict(dtype=dtype, attn_implementation=cfg.policy.attn_implementation,
                     trust_remote_code=cfg.policy.trust_remote_code, freeze_vision=cfg.policy.freeze_vision)
    policy, processor = models.load_policy(model_path, gradient_checkpointing=cfg.policy.gradient_checkpointing,
                                           lora=cfg.lora, **load_opts)
    models.check_head_transform(policy)
    tok = getattr(processor, "tokenizer", processor)
    image_token_id = getattr(processor, "image_token_id", None)
    from torch.distributed.fsdp import MixedPrecisionPolicy
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda and cfg.policy.dtype == "auto" else MixedPrecisionPolicy()
    engine_dtype = torch.bfloat16 if cuda and cfg.policy.dtype != "float32" else dtype
    ref_kind, ref = models.build_reference(policy, model_path, beta=cfg.loss.beta, lora=cfg.lora, **load_opts)
    module = shard(TokenLogprobs(policy).to(device), mp)
    ref_module = shard(TokenLogprobs(ref).to(device), mp) if ref_kind == "copy" else None
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay)
    total_updates = cfg.max_steps * cfg.steps_per_generation * cfg.num_iterations
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_updates))

    # ---- engine ----
    if engine_kind(cfg) == "vllm":
        engine = rollout.VLLMEngine(model_path, seed=cfg.seed + dp_rank, cfg=cfg.vllm,
                                    dtype=str(engine_dtype).replace("torch.", ""), image_text=image_token_id is not None,
                                    banned_token_ids=models.placeholder_token_ids(policy.config))
    else:
        engine = rollout.HFEngine(model_path, seed=cfg.seed + dp_rank, dtype=engine_dtype, device=device,
                                  banned_token_ids=models.placeholder_token_ids(policy.config))
    rollout.check_sync_names(engine, policy)  # raises on every rank alike, before the first collective of the sync

    # ---- resume ----
    start_step, bad_steps, state = 0, 0, {}
    resume_path = latest_checkpoint(cfg.output_dir) if cfg.resume == "latest" else cfg.resume
    if resume_path:
        state = load_checkpoint(resume_path, module, optimizer, rank)
        scheduler.load_state_dict(state["scheduler"])
        start_step, bad_steps = state["step"], state["bad_steps"]
        if rank == 0:
            print(f"resumed from {resume_path} at step {start_step}", flush=True)

    reward_fns = [(n, tasks.resolve_reward(n, max_completion_length=cfg.rollout.max_completion_length,
                                           overlong_cache=cfg.data.overlong_cache)) for n in reward_names(cfg)]
    weights = list(cfg.data.reward_weights) or [1.0] * len(reward_fns)
    kl_ctl = (losses.AdaptiveKLController(cfg.loss.beta, cfg.kl_target, cfg.kl_horizon) if cfg.kl_target and cfg.loss.beta
              else losses.FixedKLController(cfg.loss.beta))
    kl_ctl.value = state.get("kl_coef", kl_ctl.value)
    G = cfg.num_generations
    prompts_per_rank = cfg.batch_size * cfg.steps_per_generation // G
    order = np.random.default_rng(cfg.seed).permutation(len(rows))  # same on every rank; position = step
    metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
    if rank == 0 and os.path.exists(metrics_path):  # keep only the steps the checkpoint we start from has seen
        with open(metrics_path) as f:
            kept = [line for line in f if json.loads(line)["step"] <= start_step]
        with open(metrics_path, "w") as f:
            f.writelines(kept)
    if rank == 0 and cfg.wandb.mode != "disabled":
        import wandb
        wandb.init(project=cfg.wandb.project, name=cfg.wandb.name or os.path.basename(cfg.output_dir.rstrip("/")),
                   mode=cfg.wandb.mode, config=asdict(cfg), dir=cfg.output_dir, resume="allow")
    stop = {"sigterm": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(sigterm=True))  # preemption: checkpoint, then exit
    printed_errors, policy_changed = set(), True
    eval_encoded = [encode_prompt(r, processor, cfg.rollout.max_prompt_length, cfg.data.chat_template,
                                  cfg.data.system_prompt) for r in eval_rows]
    bar = None
    if rank == 0 and cfg.log.progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.max_steps, initial=start_step, desc="steps", dynamic_ncols=True)

    for step in range(start_step, cfg.max_steps):
        t0 = time.time()
        # ---- 1. sample prompts: each data-parallel rank its own shard; a group of G stays on one rank ----
        n_global = prompts_per_rank * world  # prompts per step over all ranks
        idx = [int(order[(step * n_global + dp_rank * prompts_per_rank * tp + i) % len(rows)])
               for i in range(prompts_per_rank * tp)]  # a TP group generates for all its ranks
        batch_rows = [rows[i] for i in idx]
        encoded = [encode_prompt(r, processor, cfg.rollout.max_prompt_length, cfg.data.chat_template, cfg.data.system_prompt)
                   for r in batch_rows]

        # ---- 2. sync weights into the engine if the policy changed ----
        t_sync = time.time()
        sync_engine(engine, policy, engine_dtype, policy_changed)
        policy_changed = False
        t_sync = time.time() - t_sync

        # ---- 3. generate G completions per prompt ----
        t_gen = time.time()
        outs = engine.generate([e["engine"] for e in encoded], n=G, temperature=cfg.rollout.temperature,
                               top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                               max_tokens=cfg.rollout.max_completion_length, seed=cfg.seed * 100_003 + step * 1009 + dp_rank)
        engine.sleep()
        t_gen = time.time() - t_gen
        lo, hi = tp_rank * prompts_per_rank, (tp_rank + 1) * prompts_per_rank  # this rank's slice of the TP batch
        encoded, batch_rows, outs = encoded[lo:hi], batch_rows[lo:hi], outs[lo:hi]
        samples = [{"prompt_ids": e["prompt_ids"], "completion_ids": c.token_ids, "engine_logps": c.logprobs,
                    "truncated": c.truncated, **({"mm": e["mm"]} if "mm" in e else {})}
                   for e, o in zip(encoded, outs) for c in o]  # [N = prompts * G], groups contiguous
        completions = [tok.decode(s["completion_ids"], skip_special_tokens=True) for s in samples]

        # ---- 4. rewards ----
        rewards, failed = tasks.score_rewards(reward_fns, [r for r in batch_rows for _ in range(G)], completions,
                                              [s["completion_ids"] for s in samples], printed_errors)  # [N, K]
        n_failed = torch.tensor(failed + [len(samples)], dtype=torch.float64, device=device)
        dist.all_reduce(n_failed)
        if n_failed[:-1].numel() and (n_failed[:-1] == n_failed[-1]).all():
            raise RuntimeError("every reward function raised on every sample of this step: stopping (see the "
                               "tracebacks above). Fix the reward functions and --resume latest.")

        # ---- 5. advantages ----
        if cfg.advantage_estimator == "rloo":  # weighted sum, then leave-one-out; unscorable samples get 0
            total = (rewards * torch.tensor(weights)).nansum(-1).masked_fill(rewards.isnan().all(-1), float("nan"))
            filled = torch.where(total.isnan(), total.view(-1, G).nanmean(-1).repeat_interleave(G), total)
            advantages = losses.rloo_advantages(filled.nan_to_num(0.0), G).masked_fill(total.isnan(), 0.0)
        else:
            advantages = losses.multi_reward_advantages(rewards, weights, G, aggregation=cfg.reward_aggregation,
                                                        scale=cfg.scale_rewards)  # [N]
        total_reward = (rewards * torch.tensor(weights)).nansum(-1)  # [N]

        # ---- 6. old and reference log-probs (only when needed) ----
        N, T = len(samples), max(1, max(len(s["completion_ids"]) for s in samples))
        lens = torch.tensor([len(s["completion_ids"]) for s in samples])
        completion_mask = (torch.arange(T)[None] < lens[:, None]).float().to(device)  # [N, T]
        truncated = torch.tensor([s["truncated"] for s in samples], device=device)
        mask = completion_mask * (~truncated).float()[:, None] if cfg.rollout.mask_truncated_completions else completion_mask
        engine_logps = torch.zeros(N, T, device=device)
        for i, s in enumerate(samples):
            engine_logps[i, :len(s["engine_logps"])] = torch.tensor(s["engine_logps"])
        mbs = min(cfg.micro_batch_size, N)
        micro_batch = lambda ids: collate([samples[i] for i in ids], tok.pad_token_id, device, T, image_token_id)  # noqa: E731
        chunks = [list(range(i, min(i + mbs, N))) for i in range(0, N, mbs)]

        @torch.no_grad()
        def all_logps(m):  # [N, T], in micro batches
            return torch.cat([m(micro_batch(c), cfg.rollout.temperature)[0] for c in chunks])
        reuse = cfg.num_iterations > 1 or cfg.steps_per_generation > 1
        old_logps = all_logps(module) if reuse else None  # [N, T]
        ref_logps = None
        if cfg.loss.beta != 0 and ref_kind == "copy":
            ref_logps = all_logps(ref_module)
        elif cfg.loss.beta != 0 and ref_kind == "disabled_adapter":  # PEFT: the base model is the reference
            with policy.disable_adapter():
                ref_logps = all_logps(module)
        elif cfg.loss.beta != 0:  # a frozen copy of the adapter we continue from
            policy.set_adapter("reference")
            ref_logps = all_logps(module)
            policy.set_adapter("default")  # PEFT marks the active adapter trainable: keep the reference frozen
            for n, p in policy.named_parameters():
                p.requires_grad_(p.requires_grad and ".reference." not in n)

        # ---- 7. policy updates: num_iterations passes x steps_per_generation minibatches ----
        t_train = time.time()
        loss_cfg = dataclasses.replace(cfg.loss, beta=kl_ctl.value)
        module.train()
        stats = []
        trainer_logps = old_logps if reuse else torch.zeros(N, T, device=device)  # before any update, for the mismatch
        mini = N // cfg.steps_per_generation
        shuffle = torch.Generator().manual_seed(cfg.seed + step)
        for it in range(cfg.num_iterations):
            groups = torch.randperm(N // G, generator=shuffle) if it > 0 else torch.arange(N // G)
            order_s = (groups[:, None] * G + torch.arange(G)).flatten()  # shuffle whole groups between passes
            for m in range(cfg.steps_per_generation):
                rows_m = order_s[m * mini:(m + 1) * mini]
                global_tokens = mask[rows_m.to(device)].sum()
                dist.all_reduce(global_tokens)
                loss_sum, mstats = 0.0, {}
                for j in range(0, len(rows_m), mbs):
                    r = rows_m[j:j + mbs]
                    rd = r.to(device)
                    lp, ent = module(micro_batch(r.tolist()), cfg.rollout.temperature, with_entropy=True)  # [b, T]
                    if not reuse:
                        trainer_logps[rd] = lp.detach()
                    lossv, lm = losses.policy_loss(
                        lp, old_logps[rd] if reuse else None, advantages[r].to(device), mask[rd], loss_cfg,
                        ref_logps=ref_logps[rd] if ref_logps is not None else None, sampler_logps=engine_logps[rd],
                        entropies=ent, num_items=global_tokens / world)
                    # dapo/cispo/vespo already divide by the minibatch's token count; the rest are means over rows
                    weight = 1.0 if cfg.loss.loss_type in ("dapo", "cispo", "vespo") else len(r) / len(rows_m)
                    (lossv * weight).backward()
                    loss_sum += lossv.item() * weight
                    m_mask = mask[rd]
                    mstats.setdefault("entropy", []).append(((ent.detach() * m_mask).sum() / m_mask.sum().clamp(min=1)).item())
                    for k, v in lm.items():
                        mstats.setdefault(k, []).append(v.item())
                grad_norm, skipped = optimizer_step(params, optimizer, scheduler, cfg.optim.max_grad_norm,
                                                    all_mean([loss_sum], device))
                policy_changed |= not skipped
                stats.append({"loss": loss_sum, "grad_norm": grad_norm, "skipped_updates": float(skipped),
                              **{k: float(np.mean(v)) for k, v in mstats.items()}})
        t_train = time.time() - t_train
        bad_steps = bad_steps + 1 if all(s["skipped_updates"] for s in stats) else 0

        # ---- 8. metrics ----
        mm_abs = ((trainer_logps - engine_logps).abs() * completion_mask).sum() / completion_mask.sum().clamp(min=1)
        all_r = all_gather_cat(total_reward.to(device))
        grp = all_r.view(-1, G)
        n_tokens = torch.tensor([lens.sum().item() + sum(len(s["prompt_ids"]) for s in samples)], dtype=torch.float64,
                                device=device)
        dist.all_reduce(n_tokens)
        step_time = time.time() - t0
        row = {"step": step + 1, "reward/mean": all_r.nanmean().item(),
               "reward/std": all_r[~all_r.isnan()].std().item() if all_r.numel() > 1 else 0.0,
               **{f"reward/{n}/mean": all_mean(rewards[:, k].tolist(), device) for k, (n, _) in enumerate(reward_fns)},
               "reward/failed": float(n_failed[:-1].sum()),
               "frac_zero_std": (grp.std(-1) < 1e-6).float().mean().item() if G > 1 else 1.0,
               "completion_len/mean": all_mean(lens.float().tolist(), device),
               "completion_len/clipped_frac": all_mean(truncated.float().tolist(), device),
               **{k: all_mean([s[k] for s in stats], device) for k in stats[0]},
               "logprob_mismatch/mean_abs": all_mean([mm_abs.item()], device),
               "lr": scheduler.get_last_lr()[0], "bad_steps": bad_steps,
               "time/generate": t_gen, "time/sync": t_sync, "time/train": t_train, "time/step": step_time,
               "tokens_per_s": n_tokens.item() / step_time,
               "mem/peak_gb": (torch.cuda.max_memory_allocated() if cuda else _peak_rss()) / 2**30}
        if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and eval_rows:
            sync_engine(engine, policy, engine_dtype, policy_changed)
            policy_changed = False
            row.update(evaluate(cfg, engine, eval_encoded, eval_rows, reward_fns, tok, dp_rank, dp_world, device, step))
            engine.sleep()
        if cfg.loss.beta:
            row["kl_coef"] = kl_ctl.value
        kl_ctl.update(row.get("kl", 0.0), 1)
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            summary = (f"step {step + 1}/{cfg.max_steps} reward {row['reward/mean']:.3f} loss {row['loss']:.4f} "
                       f"len {row['completion_len/mean']:.1f} clip {row['clip_ratio/region']:.3f} "
                       f"mismatch {row['logprob_mismatch/mean_abs']:.1e} {step_time:.2f}s/step "
                       f"{row['tokens_per_s']:.0f} tok/s" + (f" eval {row['eval/reward']:.3f}" if "eval/reward" in row else ""))
            (bar.write if bar else print)(summary)
            if bar:
                bar.update(1)
            if cfg.wandb.mode != "disabled":
                import wandb
                wandb.log(row, step=step + 1)
            if cfg.log.completions_every and (step + 1) % cfg.log.completions_every == 0:
                print_completions(batch_rows, completions, total_reward, advantages, G, cfg.wandb.mode, step + 1)

        # ---- 9. checkpoint; stop on preemption or repeated bad steps ----
        flags = torch.tensor([float(stop["sigterm"]), float(bad_steps >= cfg.max_bad_steps)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        last = step + 1 == cfg.max_steps or flags.any()
        if last or (cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0):
            save_checkpoint(cfg, module, optimizer, processor, step + 1,
                            {"step": step + 1, "bad_steps": bad_steps, "data_position": (step + 1) * n_global,
                             "scheduler": scheduler.state_dict(), "kl_coef": kl_ctl.value})
        if flags[1]:
            raise RuntimeError(f"{bad_steps} consecutive steps had a NaN/Inf loss or gradient norm (--max-bad-steps "
                               f"{cfg.max_bad_steps}); a checkpoint was written at step {step + 1}. Lower --optim.lr "
                               "or check the rewards, then --resume latest.")
        if flags[0]:
            if rank == 0:
                print(f"SIGTERM: checkpoint written at step {step + 1}; exiting", flush=True)
            break
    if bar:
        bar.close()
    if rank == 0:
        print(f"done in {time.time() - t_start:.1f}s; metrics in {metrics_path}", flush=True)
    if not isinstance(engine, rollout.VLLMEngine):  # vLLM's exit hook tears down its groups and the world itself
        dist.destroy_process_group()


def _peak_rss():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def print_completions(rows, completions, rewards, advantages, G, wandb_mode, step, n_prompts=2):
    """A small table of prompt / completion / reward / advantage (rich on stdout, wandb.Table when enabled)."""
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"completions at step {step}", show_lines=False)
    for c in ("prompt", "completion", "reward", "advantage"):
        table.add_column(c)
    data = []
    for i in range(min(len(completions), n_prompts * G)):
        p = rows[i // G]["prompt"]
        p = p if isinstance(p, str) else p[-1]["content"] if isinstance(p[-1]["content"], str) else str(p[-1]["content"])
        data.append([p[-60:], repr(completions[i][:80]), f"{float(rewards[i]):.3f}", f"{float(advantages[i]):.3f}"])
        table.add_row(*data[-1])
    Console().print(table)
    if wandb_mode != "disabled":
        import wandb
        wandb.log({"completions": wandb.Table(columns=["prompt", "completion", "reward", "advantage"], data=data)}, step=step)


if __name__ == "__main__":
    main(tyro.cli(Config))
