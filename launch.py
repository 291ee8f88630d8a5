"""launch.py: everything grpo.py does before its first step, once the flags are checked (flags.py): load the data,
build the policy, reference, critic, EMA, optimizer and engine, resume, and hand the stages one Run record. grpo.py's
Config is the only thing it reads; nothing here runs during a step.
"""
import os
import random
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

import checkpoints
import console
import context_parallel
import distributed
import episodes
import hubs
import inference_ranks
import losses
import models
import optim
import ppo
import rollout
import scoring
import tasks
import token_logprobs
import weight_sync
from flags import (DEFAULTS, check_chat_template, check_critic_tokenizer, check_teacher, engine_kind, eval_every,
                   fill_defaults, lora_settings, reward_names, tool_names, validate, validate_lora_sync)
from models import shard
from optim import trainable
from token_logprobs import TokenLogprobs

# ---- Setup: data, policy, reference, optimizer, engine, resume -> one Run record the stages share ----

@dataclass
class DistillConfig:
    teacher: str = ""
    """On-policy distillation (GKD, arXiv 2306.13649): a teacher (checkpoint folder, hub id or .gguf file) with the
    student's tokenizer scores the sampled tokens, and each token's advantage gains -coef (log p_student - log
    p_teacher). Frozen and FSDP2-sharded like the reference; on the trainer ranks. Empty = off."""
    coef: float = 1.0
    """Weight of the distillation advantage, added to the reward's advantage (distillation alone: --data.reward-weights
    0, one per reward function)."""


@dataclass(kw_only=True)
class Run(checkpoints.RunState):
    """State that crosses stages: built once by setup(); the stages read it and update the last few fields."""
    dp_rank: int  # this rank's prompt batch: the ranks of one vLLM TP group or context-parallel group share it
    tp: int
    batch_ranks: int  # the data-parallel ranks whose rows one prompt batch holds (a TP group's: tp / N, at least 1)
    processor: object
    engine: object
    precision: dict  # precision(): compute, fp32_head, sync (the dtype weights travel to the engine in), mp, root_mp
    # the trainer's (an inference rank's Run keeps these and RunState's defaults: no policy, optimizer or rewards)
    policy: nn.Module = None
    ref_kind: str = "none"  # none | copy | disabled_adapter | adapter (models.build_reference)
    kl_ctl: object = None
    tools: dict = field(default_factory=dict)  # {name: function}: --data.tools (episodes.load_tools)
    make_env: object = None  # --env factory: make_env() -> an environment per episode
    critic: dict | None = None  # ppo.build_critic: --advantage-estimator gae
    teacher_module: nn.Module | None = None  # --distill.teacher: frozen, FSDP2 root (TokenLogprobs) like the reference
    ptx: list | None = None  # token-id rows of --ptx.dataset
    packing: dict = field(default_factory=dict)  # collate's pair_cost / max_len (--policy.share-prompts; {} = off)
    cp_group: object = None  # --policy.context-parallel: the ranks this rank's rows are split over (None: off)
    link: object = None  # inference_ranks.Link: --rollout.inference-ranks (trainer or generator side)
    ds_extra_rounds: int = 0  # dynamic sampling's extra rounds so far: the data blocks they read (checkpointed)
    no_signal_steps: int = 0  # consecutive steps with frac_zero_std 1.0 (dynamic_sampling.hint_if_no_signal)


def load_rows(cfg):
    """-> (train rows, eval rows). An eval split (built-in tasks: "test") is drawn with seed 0, so every --seed scores
    the same prompts, which leave train even without --eval.every (built-in tasks draw both from one small space).
    Else, when evaluating, the last eval.num_prompts rows of train. A hub environment's taskset is the dataset."""
    hub, target = hubs.hub_of(cfg.env)
    if "rows" in (hub or {}):
        return hub["rows"](target, cfg.env_args, cfg.data.import_timeout_s), []
    load = lambda split, size, seed: tasks.load_dataset_rows(  # noqa: E731
        cfg.dataset, split=split, prompt_column=cfg.data.prompt_column, answer_column=cfg.data.answer_column,
        size=size, seed=seed, timeout_s=cfg.data.import_timeout_s, need_prompt=not cfg.env)
    rows = load(cfg.data.split, cfg.data.size, cfg.seed)
    eval_split = cfg.data.eval_split or ("test" if cfg.dataset in tasks.BUILTIN_TASKS else None)
    if eval_split:
        held = load(eval_split, cfg.eval.num_prompts, 0)[:cfg.eval.num_prompts]
        seen = {row_key(h) for h in held}
        return [r for r in rows if row_key(r) not in seen], held if eval_every(cfg) else []
    if not eval_every(cfg):
        return rows, []
    train, held = rows[:-cfg.eval.num_prompts], rows[-cfg.eval.num_prompts:]
    prompts = {row_key(h)[0] for h in held}
    seen = {row_key(r) for r in train if row_key(r)[0] in prompts}  # in both, it would score memory
    kept = [h for h in held if row_key(h) not in seen]
    if len(kept) < len(held) and os.environ.get("RANK", "0") == "0":
        print(f"held-out prompts: {len(held) - len(kept)} of the last {len(held)} rows of --dataset {cfg.dataset!r} "
              "also appear among its training rows and were left out of the evaluation", flush=True)
    return train, kept


def row_key(row):
    """What makes two rows the same question: the prompt (a row without one, whose environment writes it: its other
    columns), and the image when there is one (its pixels)."""
    image = row.get("image")
    question = row.get("prompt", {k: v for k, v in sorted(row.items()) if k != "image"})
    return repr(question), None if image is None else (image.size, image.tobytes())


def model_path_for(cfg):
    """The checkpoint directory, before init and without collectives: a GGUF file converted once (file lock);
    builtin:tiny written per rank (transformers saves only on rank 0 once a process group exists). Then the checks
    that read its files (chat template, critic tokenizer)."""
    gguf, verbose = models.gguf_source(cfg.model, cfg.policy.gguf_file), os.environ.get("RANK", "0") == "0"
    if gguf:
        path = models.convert_gguf_once(gguf, os.path.join(cfg.output_dir, "converted"), verbose=verbose)
    elif cfg.model == "builtin:tiny-tools":
        path = tiny_tools_path(verbose=verbose)
    elif cfg.model != "builtin:tiny":
        path = cfg.model
    else:
        path = os.path.join(cfg.output_dir, "builtin-tiny", f"rank{os.environ.get('RANK', '0')}")
        if not os.path.exists(os.path.join(path, "config.json")):
            models.build_tiny_model(path, seed=cfg.seed)
    check_chat_template(cfg, path)
    check_critic_tokenizer(cfg, path)
    return path


def teacher_path_for(cfg, model_path):
    """--distill.teacher as a checkpoint directory (GGUF converted once), checked against the student
    (flags.check_teacher), before init and without collectives. None without a teacher."""
    gguf = models.gguf_source(cfg.distill.teacher)
    path = models.convert_gguf_once(gguf, os.path.join(cfg.output_dir, "converted", "teacher"),
                                    verbose=os.environ.get("RANK", "0") == "0") if gguf else cfg.distill.teacher
    if path:
        check_teacher(cfg, model_path, path)
    return path or None


def tiny_tools_path(verbose=True):
    """builtin:tiny-tools, warmed up on calculator episodes once per machine (about 20 s on 2 CPU cores) into
    ~/.cache/grpo-builtin (or $XDG_CACHE_HOME), in a folder named by a hash of the code that builds it."""
    import hashlib
    import inspect
    code = inspect.getsource(models.build_tiny_tool_model) + inspect.getsource(tasks.calculator_transcripts)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    out = os.path.join(cache, "grpo-builtin", "tiny-tools-" + hashlib.sha256(code.encode()).hexdigest()[:12])
    build = lambda path: models.build_tiny_tool_model(path, tasks.calculator_transcripts(3200, 1), [tasks.multiply])  # noqa: E731
    models.build_once(out, build, say=f"building {out} (once: later runs reuse it)" if verbose else None)
    return out


def build_policy(cfg, model_path, device, teacher_path=None, cp_group=None):
    """Policy + reference (+ teacher, critic, EMA), FSDP2-sharded, with AdamW and the lr schedule; with cp_group each
    row's sequence split over its ranks (context_parallel.py)."""
    dtype = torch.float32  # master weights (and optimizer state) in fp32 whatever the compute dtype
    load_opts = dict(dtype=dtype, attn_implementation=cfg.policy.attn_implementation,
                     trust_remote_code=cfg.policy.trust_remote_code, freeze_vision=cfg.policy.freeze_vision)
    policy, processor = models.load_policy(model_path, gradient_checkpointing=cfg.policy.gradient_checkpointing,
                                           lora=cfg.lora, **load_opts)
    token_logprobs.check_head_transform(policy)
    limit = token_logprobs.check_shared_prompts(policy, token_logprobs.share_limit(policy.config)
                                                if cfg.policy.share_prompts else 0)
    packing = dict(pair_cost=token_logprobs.pair_cost(policy.config), max_len=limit) if limit != 0 else {}
    prec = precision(cfg, device)
    mp, root_mp = prec["mp"], prec["root_mp"]  # FSDP2's policies: decoder layers, root
    ref_kind, ref = models.build_reference(policy, model_path, beta=cfg.loss.beta, lora=cfg.lora, processor=processor,
                                           **load_opts)
    teacher = (models.load_policy(teacher_path, processor=processor, **load_opts)[0].eval().requires_grad_(False)
               if teacher_path else None)  # (its tokenizer is not kept; flags.check_teacher compared it with ours)
    if teacher is not None:  # like the reference copy: frozen, sharded, no optimizer state
        token_logprobs.check_head_transform(teacher)
        if packing:  # the teacher reads the same shared-prompt rows: they must give its own log-probs too
            t_limit = token_logprobs.check_shared_prompts(teacher, token_logprobs.share_limit(teacher.config))
            packing = {} if t_limit == 0 else {**packing, "max_len": min((x for x in (limit, t_limit) if x), default=None)}
    for m in ([policy] + ([ref] if ref_kind == "copy" else []) + [teacher] * (teacher is not None)) if root_mp else []:
        models.fp32_final_norm(m)  # --policy.fp32-lm-head: the root (norm, head) computes in fp32 on the layers' output
    module = shard(TokenLogprobs(policy, cp_group).to(device), mp, root_mp)
    ref_module = shard(TokenLogprobs(ref, cp_group).to(device), mp, root_mp) if ref_kind == "copy" else None
    teacher_module = shard(TokenLogprobs(teacher, cp_group).to(device), mp, root_mp) if teacher is not None else None
    params = [p for p in module.parameters() if p.requires_grad]
    total_updates = cfg.max_steps * cfg.steps_per_generation * cfg.num_iterations
    optimizer, scheduler = optim.adamw(params, cfg.optim, cfg.optim.betas, total_updates, fused=True)
    critic = ppo.build_critic(cfg, model_path, device, mp, dtype, policy.config, cp_group)
    ema = optim.ema_init(trainable(module), cfg.ema.decay)
    return dict(policy=policy, processor=processor, module=module, ref_kind=ref_kind, ref_module=ref_module,
                teacher_module=teacher_module, packing=packing, optimizer=optimizer, scheduler=scheduler,
                precision=prec, critic=critic, ema=ema)


def precision(cfg, device):
    """The run's dtypes, decided once. compute: the trainer's forward's and the engine's, bf16 for --policy.dtype
    bfloat16 (and auto on CUDA), else fp32 (a flag, not a device: CPU runs the same bf16 path as CUDA). fp32_head:
    --policy.fp32-lm-head takes effect (only with bf16 compute). sync: the dtype weights travel to the engine in, the
    engine's, or fp32 when its head is fp32 (it casts the rest). mp, root_mp: FSDP2's policies (decoder layers, root):
    with bf16 compute, bf16 on fp32 master weights (and gradients, AdamW state) with fp32 gradient reduction, the root
    (embeddings, final norm, head) in fp32 with fp32_head; plain fp32 otherwise (root_mp None: the layers' policy)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    bf16 = cfg.policy.dtype == "bfloat16" or (cfg.policy.dtype == "auto" and device.type == "cuda")
    fp32_head = cfg.policy.fp32_lm_head and bf16
    layers = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    return dict(compute=torch.bfloat16 if bf16 else torch.float32, fp32_head=fp32_head, mp=layers,
                sync=torch.bfloat16 if bf16 and not fp32_head else torch.float32,
                root_mp=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32) if fp32_head else None)


def build_engine(cfg, model_path, config, processor, prec, dp_rank, device):
    banned = token_logprobs.placeholder_token_ids(config)
    lora_rank = lora_settings(cfg.lora)["r"] if cfg.lora.sync == "adapter" else 0  # the engine serves the adapter
    if engine_kind(cfg) == "vllm":
        return rollout.VLLMEngine(model_path, seed=cfg.seed + dp_rank, cfg=cfg.vllm,
                                  dtype=str(prec["compute"]).replace("torch.", ""),
                                  image_text=getattr(processor, "image_token_id", None) is not None,
                                  banned_token_ids=banned, show_progress=cfg.log.verbose, lora_rank=lora_rank)
    return rollout.HFEngine(model_path, seed=cfg.seed + dp_rank, dtype=prec["compute"], device=device,
                            banned_token_ids=banned, fp32_lm_head=prec["fp32_head"], lora_rank=lora_rank,
                            processor=processor, compile_decode=cfg.rollout.compile_decode)


def setup(cfg):
    """Validate (every rank, no collective), then build everything and resume. -> Run."""
    console.quiet_libraries(cfg.log.verbose, int(os.environ.get("RANK", 0)))  # before any model is built or loaded
    demo = fill_defaults(cfg)
    if demo and os.environ.get("RANK", "0") == "0":
        text = lambda values: " ".join(f"--{k.replace('_', '-')} {values[k]:g}" for k in demo)  # noqa: E731
        print(f"{cfg.model}: the demo's {text(demo)} (a real model's defaults: {text(DEFAULTS)})", flush=True)
    with console.user_input():
        rows, eval_rows = load_rows(cfg)
        resume_path = validate(cfg, rows)
        model_path = model_path_for(cfg)
        validate_lora_sync(cfg, model_path)  # what the engine serves decides: before the config is recorded
        record = checkpoints.config_record(cfg, train_rows=len(rows), world_size=int(os.environ.get("WORLD_SIZE", 1)))
        if resume_path:  # (its manifest was checked first) refuse a checkpoint of a run with other settings
            checkpoints.check_config(resume_path, record, cfg.checkpoint.allow_changes,
                                     checkpoints.config_record(type(cfg)()))
        teacher_path = teacher_path_for(cfg, model_path)
        if cfg.policy.context_parallel > 1:  # every model whose rows are split (GGUF, built-in), before any collective
            from transformers import AutoConfig
            split = {"--model": model_path, "--distill.teacher": teacher_path,
                     "--critic.model": (cfg.critic.model or model_path) if cfg.advantage_estimator == "gae" else None}
            context_parallel.check(cfg, int(os.environ.get("WORLD_SIZE", 1)), {k: AutoConfig.from_pretrained(
                p, trust_remote_code=cfg.policy.trust_remote_code) for k, p in split.items() if p})
    link = (inference_ranks.connect(cfg.rollout.inference_ranks, cfg.vllm.tp if engine_kind(cfg) == "vllm" else 1,
                                    cfg.rollout.timeout_s, cfg.policy.context_parallel)
            if cfg.rollout.inference_ranks else None)
    rank, world, device = distributed.setup_distributed()  # with inference ranks: this side's ranks only
    generator = link and link.role == "generator"
    tp = cfg.vllm.tp if engine_kind(cfg) == "vllm" and (generator or not link) else 1  # ranks per engine
    cp, cp_group = 1 if generator else cfg.policy.context_parallel, None  # ranks per row, sharing one batch
    if cp > 1:
        cp_group, distributed.DATA_GROUP = context_parallel.groups(world, cp)
    shared = dict(cfg=cfg, rank=rank, world=world // cp, device=device, dp_rank=rank // max(tp, cp), tp=tp,
                  batch_ranks=max(tp // cp, 1), rows=rows,
                  eval_rows=eval_rows, order=np.random.default_rng(cfg.seed).permutation(len(rows)), link=link,
                  tools=episodes.load_tools(tool_names(cfg)),  # episodes run where they are generated
                  make_env=hubs.load_env(cfg) if cfg.env else None)
    if generator:
        return setup_generator(cfg, model_path, device, shared)
    with console.user_input():  # one run per directory, before anything is written there
        checkpoints.take_output_dir(cfg.output_dir, cfg.resume, cfg.overwrite, resume_path, rank, device)
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed)  # identical init on every rank; sampling has its own per-completion streams
    built = build_policy(cfg, model_path, device, teacher_path, cp_group)
    engine = None  # --rollout.inference-ranks: the generators hold the engines
    if not link:
        engine = build_engine(cfg, model_path, built["policy"].config, built["processor"], built["precision"],
                              rank // tp, device)
        weight_sync.check_sync_names(engine, built["policy"])  # every rank raises alike, before the sync's collectives
    kl_ctl = (losses.AdaptiveKLController(cfg.loss.beta, cfg.kl_target, cfg.kl_horizon) if cfg.kl_target and cfg.loss.beta
              else losses.FixedKLController(cfg.loss.beta))
    run = Run(**shared, engine=engine, cp_group=cp_group, **reward_functions(cfg, device, built["processor"], tp),
              kl_ctl=kl_ctl, config_record=record, metrics_path=os.path.join(cfg.output_dir, "metrics.jsonl"), **built)
    if cfg.ptx.dataset:
        run.ptx = tasks.ptx_token_rows(cfg.ptx, getattr(run.processor, "tokenizer", run.processor), cfg.seed)
    load_critic = lambda state: ppo.load_critic_state(run.critic, resume_path, state["critic_scheduler"])  # noqa: E731
    state = checkpoints.start_run(run, resume_path, load_critic if run.critic else None)
    if resume_path:
        kl_ctl.value, run.ds_extra_rounds = state["kl_coef"], state.get("ds_extra_rounds", 0)
    return run


def reward_functions(cfg, device, processor, tp, shard=True):
    """-> {reward_fns: [(name, fn)], weights} (the Run's fields). A sharded reward model's forward is a collective:
    not with --vllm.tp > 1 (one rank per TP group scores), nor on a generator (shard=False: its NCCL receives)."""
    data = cfg.data if tp == 1 and shard else replace(cfg.data, rm_shard_gb=float("inf"))
    fns = [(n, scoring.resolve_reward(n, data, max_completion_length=cfg.rollout.max_completion_length, device=device,
                                      processor=processor)) for n in reward_names(cfg)]
    return {"reward_fns": fns, "weights": list(cfg.data.reward_weights) or [1.0] * len(fns)}


def setup_generator(cfg, model_path, device, shared):
    """An inference rank's Run (`shared`: the fields every rank's has): the processor and the engine (and with
    --dynamic-sampling the reward functions: it scores its batch); no policy or optimizer."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.policy.trust_remote_code)
    processor = models.load_processor(model_path, models.is_image_text(config), cfg.policy.trust_remote_code)
    prec = precision(cfg, device)
    no_sleep = replace(cfg, vllm=replace(cfg.vllm, enable_sleep_mode=False))  # a generator owns its device
    engine = build_engine(no_sleep, model_path, config, processor, prec, shared["dp_rank"], device)
    rewards = reward_functions(cfg, device, processor, shared["tp"], shard=False) if cfg.dynamic_sampling else {}
    return Run(**shared, processor=processor, engine=engine, precision=prec, **rewards)
