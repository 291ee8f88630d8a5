"""launch.py: everything grpo.py does before its first step: validate the flags (every rank, before any collective),
load the data, build the policy, reference, critic, EMA, optimizer and engine, resume, and hand the stages one Run
record. grpo.py's Config is the only thing it reads; nothing here runs during a step.
"""
import os
import random
import signal
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

import checkpoints
import console
import distributed
import episodes
import inference_ranks
import losses
import models
import optim
import ppo
import rollout
import tasks
import token_logprobs
import user_code
from models import shard
from optim import trainable
from token_logprobs import TokenLogprobs

# ----------------------------------------------------------------------------------------------------------
# Validation: every rank runs this before any collective, so bad input fails everywhere at once, never hangs
# ----------------------------------------------------------------------------------------------------------

def engine_kind(cfg):
    if cfg.rollout.engine != "auto":
        return cfg.rollout.engine
    import importlib.util
    return "vllm" if importlib.util.find_spec("vllm") else "hf"  # without importing it (slow): validate runs first


# Flags whose default is None: a real model's value (TRL's), or the built-in tiny models' demo value
DEFAULTS = {"optim.lr": 1e-6, "rollout.max_completion_length": 256}
DEMO_DEFAULTS = {"optim.lr": 3e-3, "rollout.max_completion_length": 2}  # builtin:tiny learns find_digit in 100 steps


def fill_defaults(cfg):
    """Give each of DEFAULTS' flags the user left unset its value: the demo's with --model builtin:*, else the real
    model's; --rollout.max-total-length: --vllm.max-model-len. Never touches a flag the user set.
    -> {flag: demo value applied} (setup prints them)."""
    demo, applied = cfg.model.startswith("builtin:"), {}
    for name, value in DEFAULTS.items():
        group, attr = name.split(".")
        if getattr(getattr(cfg, group), attr) is None:
            setattr(getattr(cfg, group), attr, DEMO_DEFAULTS[name] if demo else value)
            applied.update({name: DEMO_DEFAULTS[name]} if demo else {})
    if cfg.rollout.max_total_length is None:  # multi-turn episodes fill at most the engine's context
        cfg.rollout.max_total_length = cfg.vllm.max_model_len
    return applied


def validate(cfg, rows):
    """Raise one clear error naming the flag and the fix."""
    from transformers import AutoConfig
    fill_defaults(cfg)
    losses.validate_loss_config(cfg.loss)
    choices = {"--scale-rewards": (cfg.scale_rewards, ("group", "batch", "none")),
               "--advantage-estimator": (cfg.advantage_estimator, ("grpo", "rloo") + ppo.TOKEN_ESTIMATORS),
               "--critic.schedule": (cfg.critic.schedule, ("constant", "cosine")),
               "--reward-aggregation": (cfg.reward_aggregation, ("sum_then_normalize", "normalize_then_sum")),
               "--rollout.engine": (cfg.rollout.engine, ("auto", "vllm", "hf")),
               "--policy.dtype": (cfg.policy.dtype, ("auto", "float32", "bfloat16")),
               "--optim.schedule": (cfg.optim.schedule, ("constant", "cosine"))}
    for flag, (value, allowed) in choices.items():
        if value not in allowed:
            raise ValueError(f"{flag} {value!r} is not known: use one of {', '.join(allowed)}")
    if cfg.dynamic_sampling and cfg.num_generations < 2:
        raise ValueError(f"--dynamic-sampling keeps the groups whose rewards differ; with --num-generations "
                         f"{cfg.num_generations} no group ever does. Use --num-generations 2 or more, or drop "
                         "--dynamic-sampling.")
    validate_ignored_flags(cfg)
    validate_numbers(cfg)
    group_relative = cfg.advantage_estimator in ("grpo", "rloo")
    if cfg.num_generations < 2 and group_relative and (cfg.scale_rewards != "none" or cfg.advantage_estimator == "rloo"):
        raise ValueError(f"--num-generations {cfg.num_generations}: group-relative advantages need at least 2 "
                         "completions per prompt. Use --num-generations 2 or more.")
    if cfg.loss.kl_in_reward and cfg.advantage_estimator not in ppo.TOKEN_ESTIMATORS:
        raise ValueError("--loss.kl-in-reward puts the KL into per-token rewards: use it with --advantage-estimator "
                         "gae or reinforce_pp (with grpo/rloo the KL is a loss term: --loss.beta).")
    if not 0 <= cfg.ema.decay < 1 or cfg.critic.value_clip <= 0:
        raise ValueError("--ema.decay must be in [0, 1) (0 = off) and --critic.value-clip > 0.")
    if cfg.critic.model and cfg.advantage_estimator == "gae":
        models.check_model_path(cfg.critic.model, "--critic.model")
    if cfg.ptx.dataset.endswith((".jsonl", ".json", ".parquet")):
        if not os.path.isfile(cfg.ptx.dataset):
            raise FileNotFoundError(f"--ptx.dataset {cfg.ptx.dataset!r}: no such file. Pass a .jsonl/.parquet file "
                                    f"with a {cfg.ptx.column!r} column, a hub dataset or a built-in task.")
        tasks.load_dataset_rows(cfg.ptx.dataset, prompt_column=cfg.ptx.column, flags=("--ptx.dataset", "--ptx.column"))
    if cfg.critic.freeze_actor_steps and cfg.advantage_estimator != "gae":
        raise ValueError("--critic.freeze-actor-steps trains the critic alone first: it needs --advantage-estimator "
                         "gae (with no critic the policy would simply not train).")
    if cfg.eval.use_ema and not cfg.ema.decay:
        raise ValueError("--eval.use-ema evaluates the EMA weights: turn the EMA on with --ema.decay (e.g. 0.992).")
    if not (0 < cfg.gamma <= 1 and 0 <= cfg.lam <= 1):
        raise ValueError(f"--gamma {cfg.gamma} must be in (0, 1] and --lam {cfg.lam} in [0, 1].")
    G, B = cfg.num_generations, cfg.batch_size
    if B % G or (B * cfg.steps_per_generation) % G or B % min(cfg.micro_batch_size, B):
        raise ValueError(f"--batch-size {B} must hold whole groups of --num-generations {G} (and split evenly into "
                         f"--micro-batch-size {cfg.micro_batch_size}). Use e.g. --batch-size {max(G, B // G * G)}.")
    if not (0 < cfg.rollout.top_p <= 1) or cfg.rollout.top_k < 0 or cfg.rollout.max_mismatch < 0:
        raise ValueError("--rollout.top-p must be in (0, 1], --rollout.top-k >= 0 (0 = off) and "
                         "--rollout.max-mismatch >= 0 (0 = off).")
    total = cfg.rollout.max_prompt_length + cfg.rollout.max_completion_length
    if engine_kind(cfg) == "vllm" and total > cfg.vllm.max_model_len:
        raise ValueError(f"--rollout.max-prompt-length + --rollout.max-completion-length = {total} exceeds "
                         f"--vllm.max-model-len {cfg.vllm.max_model_len}. Raise --vllm.max-model-len or shorten them.")
    validate_multi_turn(cfg)
    validate_inference_ranks(cfg)
    if cfg.data.reward_weights and len(cfg.data.reward_weights) != len(reward_names(cfg)):
        raise ValueError(f"--data.reward-weights has {len(cfg.data.reward_weights)} values for "
                         f"{len(reward_names(cfg))} reward functions: give one weight per function.")
    tasks.check_rewards(reward_names(cfg), cfg.data, rows)  # rm:PATH reads only the config here: no model loads
    if cfg.model.startswith("builtin:") and cfg.model not in ("builtin:tiny", "builtin:tiny-tools"):
        raise ValueError(f"--model {cfg.model!r}: the built-in models are builtin:tiny and builtin:tiny-tools (multi-turn)")
    gguf = models.gguf_source(cfg.model, cfg.policy.gguf_file)
    if gguf and not os.path.isfile(gguf):
        raise FileNotFoundError(f"GGUF file {gguf!r} not found: pass --model path/to/file.gguf, or --model FOLDER "
                                "--policy.gguf-file NAME.gguf")
    if not cfg.model.startswith("builtin:") and not gguf:
        models.check_model_path(cfg.model)
    image_text = not cfg.model.startswith("builtin:") and not gguf and models.is_image_text(  # GGUF: text models only
        AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.policy.trust_remote_code))
    if any(r.get("image") is not None for r in rows) and not image_text:
        raise ValueError(f"--dataset {cfg.dataset!r} has images but --model {cfg.model!r} is a text-only model. "
                         "Use an image-text checkpoint (e.g. Qwen2.5-VL) or a text dataset.")
    if eval_every(cfg) and not rows:
        raise ValueError(f"--eval.num-prompts {cfg.eval.num_prompts} holds out every prompt of --dataset {cfg.dataset!r} "
                         "for evaluation: none is left to train on. Lower --eval.num-prompts (below the dataset's row "
                         "count) or pass an evaluation split with --data.eval-split.")
    return checkpoints.resolve_resume(cfg.output_dir, cfg.resume, cfg.overwrite)


def validate_numbers(cfg):
    """Counts and sizes that must be positive, and the signs of the loss's constants: refused by flag, before a
    ZeroDivisionError (--batch-size 0), torch's message (--optim.lr -1) or a run that trains wrongly without a word
    (--loss.beta -0.1 rewards drifting from the reference; --max-bad-steps 0 stops after the first step)."""
    optim.check_optim(cfg.optim)
    r, ls = cfg.rollout, cfg.loss
    counts = {"--max-steps": cfg.max_steps, "--batch-size": cfg.batch_size, "--micro-batch-size": cfg.micro_batch_size,
              "--num-generations": cfg.num_generations, "--steps-per-generation": cfg.steps_per_generation,
              "--num-iterations": cfg.num_iterations, "--dynamic-sampling-max-rounds": cfg.dynamic_sampling_max_rounds,
              "--max-bad-steps": cfg.max_bad_steps, "--kl-horizon": cfg.kl_horizon, "--eval.n-samples": cfg.eval.n_samples,
              "--rollout.max-prompt-length": r.max_prompt_length,
              "--rollout.max-completion-length": r.max_completion_length}
    if bad := [f"{flag} {value}" for flag, value in counts.items() if value < 1]:
        raise ValueError(f"{', '.join(bad)}: must be >= 1.")
    signs = {f"--rollout.temperature {r.temperature} must be > 0 (the log-probs divide by it)": not r.temperature > 0,
             f"--loss.beta {ls.beta} must be >= 0 (0 = no KL term)": not ls.beta >= 0,
             f"--loss.epsilon {ls.epsilon} and --loss.epsilon-high {ls.epsilon_high} must be >= 0":
                 not ls.epsilon >= 0 or (ls.epsilon_high is not None and not ls.epsilon_high >= 0),
             f"--kl-target {cfg.kl_target} must be > 0 (unset = a fixed KL coefficient)":
                 cfg.kl_target is not None and not cfg.kl_target > 0,
             f"--eval.every {cfg.eval.every} and --checkpoint.every {cfg.checkpoint.every} must be >= 0 (0 = never)":
                 min(cfg.eval.every or 0, cfg.checkpoint.every) < 0}
    for message, bad in signs.items():
        if bad:
            raise ValueError(message)


def validate_ignored_flags(cfg):
    """Flags that the chosen advantage estimator or rollout mode would not use: refused, never silently ignored."""
    if cfg.policy.fp32_lm_head and engine_kind(cfg) != "hf":
        raise ValueError("--policy.fp32-lm-head runs the engine's lm-head in fp32, which only the HF engine does: add "
                         "--rollout.engine hf, or drop --policy.fp32-lm-head")
    if engine_kind(cfg) == "hf" and cfg.vllm.tp > 1:
        raise ValueError(f"--vllm.tp {cfg.vllm.tp} sizes the vLLM engine; the HF engine (--rollout.engine hf) runs one "
                         "copy per rank. Drop --vllm.tp, or use --rollout.engine vllm.")
    est, scale = cfg.advantage_estimator, cfg.scale_rewards
    if cfg.reward_aggregation == "normalize_then_sum" and est != "grpo":
        raise ValueError(f"--reward-aggregation normalize_then_sum (GDPO: each reward function normalised within its "
                         f"group) applies to --advantage-estimator grpo only; {est} uses the weighted sum of the "
                         "rewards. Drop --reward-aggregation or use --advantage-estimator grpo.")
    if (est in ppo.TOKEN_ESTIMATORS and scale != "group") or (est == "rloo" and scale == "batch"):
        how = "are not scaled" if est == "rloo" else "are whitened over the global batch's tokens"
        raise ValueError(f"--scale-rewards {scale} does nothing with --advantage-estimator {est}: its advantages {how}. "
                         "Drop --scale-rewards (it applies to grpo).")
    lc, in_reward = cfg.loss, ppo.kl_in_reward(cfg)
    unused = ([f"--loss.kl-estimator {lc.kl_estimator}"] * (lc.kl_estimator != "k3") + ["--loss.use-bias-correction-kl"]
              * lc.use_bias_correction_kl if in_reward else
              [f"--loss.reward-kl-estimator {lc.reward_kl_estimator}"] * (lc.reward_kl_estimator != "k1"))
    if unused:
        where = ("the KL is in the reward (reinforce_pp or --loss.kl-in-reward, with --loss.beta > 0): its estimator is "
                 "--loss.reward-kl-estimator" if in_reward else "the KL is not in the reward (it needs --loss.beta > 0 "
                 "with reinforce_pp, or gae --loss.kl-in-reward)")
        raise ValueError(f"{' and '.join(unused)} would be ignored: {where}. Drop {'/'.join(u.split()[0] for u in unused)}.")
    r = cfg.rollout
    if r.inference_ranks and r.max_staleness > 0 and cfg.loss.sampler_correction == "none":
        raise ValueError(f"--loss.sampler-correction none with --rollout.inference-ranks and --rollout.max-staleness "
                         f"{r.max_staleness} would train samples from older weights with no correction for the policy "
                         "that generated them. Use a correction (the default sequence_mask, or token_truncate) or "
                         "--rollout.max-staleness 0.")


def reward_names(cfg):
    return list(cfg.data.rewards) or (["env"] if cfg.env else tasks.DEFAULT_REWARDS.get(cfg.dataset, ["accuracy"]))


def tool_names(cfg):
    return list(cfg.data.tools) or tasks.DEFAULT_TOOLS.get(cfg.dataset, [])


def validate_multi_turn(cfg):
    """--data.tools / --env: importable, a chat template to render turns with, and the limits that apply."""
    r = cfg.rollout
    if r.max_turns < 1 or r.tool_timeout_s <= 0 or r.env_timeout_s <= 0:
        raise ValueError("--rollout.max-turns must be >= 1, --rollout.tool-timeout-s > 0 and "
                         "--rollout.env-timeout-s > 0.")
    if r.max_total_length is not None and r.max_total_length <= r.max_prompt_length:
        raise ValueError(f"--rollout.max-total-length {r.max_total_length} must exceed --rollout.max-prompt-length "
                         f"{r.max_prompt_length} (it caps prompt + every turn).")
    if engine_kind(cfg) == "vllm" and (r.max_total_length or 0) > cfg.vllm.max_model_len:
        raise ValueError(f"--rollout.max-total-length {r.max_total_length} exceeds --vllm.max-model-len "
                         f"{cfg.vllm.max_model_len}. Raise --vllm.max-model-len or lower it.")
    if not (tool_names(cfg) or cfg.env):
        return
    episodes.load_tools(tool_names(cfg), cfg.data.import_timeout_s)  # (later loads find the modules imported)
    if cfg.env:
        user_code.resolve(cfg.env, "--env", cfg.data.import_timeout_s)
    flags = "--data.tools / --env"
    if cfg.model == "builtin:tiny":
        raise ValueError(f"{flags} need a checkpoint with a chat template (tool results and observations are chat "
                         "messages); builtin:tiny has none. Pass --model builtin:tiny-tools or a chat model.")


def check_chat_template(cfg, model_path):
    """Multi-turn episodes render tool results and observations with the checkpoint's chat template (a GGUF file's
    is read once converted: still on every rank, before any collective)."""
    if not (tool_names(cfg) or cfg.env) or cfg.model == "builtin:tiny":  # refused in validate
        return
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.policy.trust_remote_code)
    if not tok.chat_template:
        raise ValueError(f"--data.tools / --env: --model {cfg.model!r} has no chat template; multi-turn episodes "
                         "render tool results and observations with it. Use a chat model.")
    warn_if_template_ignores_tools(cfg, tok)


def warn_if_template_ignores_tools(cfg, tok):
    """Rank 0: a chat template that renders the same prompt with and without tools= (SmolLM2's) never shows the
    model the tool schemas of --data.tools."""
    tools = list(episodes.load_tools(tool_names(cfg)).values())
    probe = [{"role": "user", "content": "hi"}]
    render = lambda **kw: tok.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, **kw)  # noqa: E731
    if tools and os.environ.get("RANK", "0") == "0" and render(tools=tools) == render():
        print(f"warning: the chat template of --model {cfg.model!r} ignores tools=: the schemas of --data.tools never "
              "reach the prompt, so the model is not told which tools exist or how to call them. Describe them in "
              "--data.system-prompt or the prompts, or use a model whose chat template renders tools.", flush=True)


def check_critic_tokenizer(cfg, model_path):
    """--critic.model reads the policy's token ids: every policy token with the same id in the critic's vocabulary
    (a superset is fine) and the same bos/eos/unk ids (pad positions are masked), or a clear refusal."""
    if cfg.advantage_estimator != "gae" or not cfg.critic.model:
        return
    from transformers import AutoTokenizer
    load = lambda p: AutoTokenizer.from_pretrained(p, trust_remote_code=cfg.policy.trust_remote_code)  # noqa: E731
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
    if os.path.isdir(cfg.critic.model) and not any(os.path.exists(os.path.join(cfg.critic.model, f)) for f in files):
        raise ValueError(f"--critic.model {cfg.critic.model!r} has no tokenizer files (tokenizer.json, "
                         "tokenizer_config.json, ...): the check that it reads the policy's token ids needs them. Save "
                         "the policy's tokenizer into that directory (AutoTokenizer.from_pretrained(MODEL)"
                         ".save_pretrained(CRITIC_DIR)) if the critic was trained with it, or leave --critic.model empty.")
    policy, critic = load(model_path), load(cfg.critic.model)
    want, got = ({k: getattr(t, k) for k in ("bos_token_id", "eos_token_id", "unk_token_id")} for t in (policy, critic))
    differs = [f"{k} {got[k]} vs {want[k]}" for k in want if got[k] != want[k]]
    cv = critic.get_vocab()
    missing = [t for t, i in policy.get_vocab().items() if cv.get(t) != i]
    if missing:
        differs.insert(0, f"{len(missing)} policy tokens missing or with other ids, e.g. {missing[0]!r}")
    if differs:
        raise ValueError(f"--critic.model {cfg.critic.model!r} has another tokenizer than --model {cfg.model!r} "
                         f"({'; '.join(differs)}): the critic reads the policy's token ids, which must mean the same "
                         "tokens. Use a critic of the policy's family (its vocabulary holding the policy's with the same "
                         "ids, same bos/eos/unk), or leave --critic.model empty to start from the policy's checkpoint.")


def validate_inference_ranks(cfg):
    """--rollout.inference-ranks: a world with trainers left, whole engines, and only what the split supports."""
    r, world = cfg.rollout, int(os.environ.get("WORLD_SIZE", 1))
    if r.max_staleness < 0 or r.timeout_s <= 0 or r.inference_ranks < 0:
        raise ValueError("--rollout.inference-ranks and --rollout.max-staleness must be >= 0, --rollout.timeout-s > 0.")
    if not r.inference_ranks:
        return
    if r.inference_ranks >= world:
        raise ValueError(f"--rollout.inference-ranks {r.inference_ranks} leaves no trainer in a world of {world} "
                         f"ranks: launch more (torchrun --nproc-per-node {r.inference_ranks + 1} or more) or use fewer.")
    tp = cfg.vllm.tp if engine_kind(cfg) == "vllm" else 1
    if r.inference_ranks % tp:
        raise ValueError(f"--rollout.inference-ranks {r.inference_ranks} is not a multiple of --vllm.tp {tp}: every "
                         "engine needs all of its TP ranks.")
    why = {"--dynamic-sampling": (cfg.dynamic_sampling, "the rewards that find uninformative groups run on the trainers, "
                                  "after the generators sent the batch (and generated the next ones); every refill "
                                  "round would stall both sides for a round trip. Async frameworks filter where rewards "
                                  "are computed (AReaL's should_accept_fn, in the rollout workflow). Watch frac_zero_std "
                                  "and raise --num-generations instead")}
    for flag, (value, reason) in why.items():
        if value:
            raise ValueError(f"{flag} is not supported with --rollout.inference-ranks: {reason}; or use the colocated "
                             "loop (--rollout.inference-ranks 0).")


# ----------------------------------------------------------------------------------------------------------
# Setup: data, policy, reference, optimizer, engine, resume -> one Run record the stages share
# ----------------------------------------------------------------------------------------------------------

@dataclass
class Run:
    """State that crosses stages: built once by setup(); the stages read it and update the last few fields."""
    cfg: object  # grpo.Config
    rank: int
    world: int
    device: torch.device
    dp_rank: int  # data-parallel rank: the ranks of one vLLM TP group share it (and one prompt batch)
    tp: int
    policy: nn.Module
    processor: object
    module: nn.Module  # FSDP2 root (TokenLogprobs) around the policy
    ref_kind: str  # none | copy | disabled_adapter | adapter (models.build_reference)
    ref_module: nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: object
    engine: object
    engine_dtype: torch.dtype
    rows: list
    eval_rows: list
    order: np.ndarray  # data order, the same on every rank: position = step
    reward_fns: list  # [(name, fn)]
    weights: list
    kl_ctl: object
    metrics_path: str
    tools: dict = field(default_factory=dict)  # {name: function}: --data.tools (episodes.load_tools)
    make_env: object = None  # --env factory: make_env() -> an environment per episode
    critic: dict | None = None  # ppo.build_critic: --advantage-estimator gae
    ptx: list | None = None  # token-id rows of --ptx.dataset
    ema: dict | None = None  # {name: sharded EMA of a trainable parameter} (--ema.decay)
    packing: dict = field(default_factory=dict)  # collate's pair_cost / max_len (--policy.share-prompts; {} = off)
    link: object = None  # inference_ranks.Link: --rollout.inference-ranks (trainer or generator side)
    start_step: int = 0
    bad_steps: int = 0
    ds_extra_rounds: int = 0  # dynamic sampling's extra rounds so far: the data blocks they read (checkpointed)
    no_signal_steps: int = 0  # consecutive steps with frac_zero_std 1.0 (dynamic_sampling.hint_if_no_signal)
    policy_changed: bool = True  # the engine needs a weight sync
    sigterm: bool = False
    printed_errors: set = field(default_factory=set)
    config_record: dict = field(default_factory=dict)  # checkpoints.config_record: saved, compared on resume


def eval_every(cfg):
    """--eval.every; its default evaluates before and after training where the dataset has an evaluation split."""
    if cfg.eval.every is None:
        return cfg.max_steps if cfg.data.eval_split or cfg.dataset in tasks.BUILTIN_TASKS else 0
    return cfg.eval.every


def load_rows(cfg):
    """-> (train rows, eval rows). An eval split (built-in tasks: "test") is drawn with seed 0, not --seed, so runs
    with any seed are scored on the same prompts, and its prompts leave train even without --eval.every (built-in
    tasks draw both splits from one small space). No eval split: the last eval.num_prompts rows of train, when
    evaluating."""
    load = lambda split, size, seed: tasks.load_dataset_rows(  # noqa: E731
        cfg.dataset, split=split, prompt_column=cfg.data.prompt_column, answer_column=cfg.data.answer_column,
        size=size, seed=seed)
    rows = load(cfg.data.split, cfg.data.size, cfg.seed)
    eval_split = cfg.data.eval_split or ("test" if cfg.dataset in tasks.BUILTIN_TASKS else None)
    if eval_split:
        held = load(eval_split, cfg.eval.num_prompts, 0)[:cfg.eval.num_prompts]
        seen = {repr(h["prompt"]) for h in held}
        return [r for r in rows if repr(r["prompt"]) not in seen], held if eval_every(cfg) else []
    if not eval_every(cfg):
        return rows, []
    return rows[:-cfg.eval.num_prompts], rows[-cfg.eval.num_prompts:]


def model_path_for(cfg):
    """The checkpoint directory, before init and without collectives. A GGUF file is converted once (file lock);
    builtin:tiny is written per rank (transformers saves only on rank 0 once a process group exists). Multi-turn
    flags need the directory's chat template (a GGUF file's is read from its conversion)."""
    gguf = models.gguf_source(cfg.model, cfg.policy.gguf_file)
    if gguf:
        path = models.convert_gguf_once(gguf, os.path.join(cfg.output_dir, "converted"),
                                        verbose=os.environ.get("RANK", "0") == "0")
    elif cfg.model == "builtin:tiny-tools":
        path = tiny_tools_path(verbose=os.environ.get("RANK", "0") == "0")
    elif cfg.model != "builtin:tiny":
        path = cfg.model
    else:
        path = os.path.join(cfg.output_dir, "builtin-tiny", f"rank{os.environ.get('RANK', '0')}")
        if not os.path.exists(os.path.join(path, "config.json")):
            models.build_tiny_model(path, seed=cfg.seed)
    check_chat_template(cfg, path)
    check_critic_tokenizer(cfg, path)
    return path


def tiny_tools_path(verbose=True):
    """builtin:tiny-tools, warmed up on calculator episodes once per machine (about 20 s on 2 CPU cores) into
    ~/.cache/grpo-builtin (or $XDG_CACHE_HOME), in a folder named by a hash of the code that builds it."""
    import hashlib
    import inspect
    code = inspect.getsource(models.build_tiny_tool_model) + inspect.getsource(tasks.calculator_transcripts)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    out = os.path.join(cache, "grpo-builtin", "tiny-tools-" + hashlib.sha256(code.encode()).hexdigest()[:12])
    build = lambda path: models.build_tiny_tool_model(path, tasks.calculator_transcripts(3200, 1), [tasks.multiply])  # noqa: E731
    return models.build_once(out, build, verbose)


def build_policy(cfg, model_path, device):
    """Policy + reference (+ critic, EMA), FSDP2-sharded, with AdamW and the lr schedule."""
    dtype = torch.float32  # master weights (and optimizer state) in fp32 whatever the compute dtype
    load_opts = dict(dtype=dtype, attn_implementation=cfg.policy.attn_implementation,
                     trust_remote_code=cfg.policy.trust_remote_code, freeze_vision=cfg.policy.freeze_vision)
    policy, processor = models.load_policy(model_path, gradient_checkpointing=cfg.policy.gradient_checkpointing,
                                           lora=cfg.lora, **load_opts)
    token_logprobs.check_head_transform(policy)
    limit = token_logprobs.check_shared_prompts(policy, token_logprobs.share_limit(policy.config)
                                                if cfg.policy.share_prompts else 0)
    packing = dict(pair_cost=token_logprobs.pair_cost(policy.config), max_len=limit) if limit != 0 else {}
    mp, root_mp = mixed_precision(cfg, device)
    ref_kind, ref = models.build_reference(policy, model_path, beta=cfg.loss.beta, lora=cfg.lora, **load_opts)
    for m in ([policy] + ([ref] if ref_kind == "copy" else [])) if root_mp else []:
        models.fp32_final_norm(m)  # --policy.fp32-lm-head: the root (norm, head) computes in fp32 on the layers' output
    module = shard(TokenLogprobs(policy).to(device), mp, root_mp)
    ref_module = shard(TokenLogprobs(ref).to(device), mp, root_mp) if ref_kind == "copy" else None
    params = [p for p in module.parameters() if p.requires_grad]
    # fused: one kernel over all shards (CPU and CUDA); the per-tensor DTensor path cost 31 ms vs 4 ms per step (tiny)
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay,
                                  fused=True)
    total_updates = cfg.max_steps * cfg.steps_per_generation * cfg.num_iterations
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, optim.lr_lambda(cfg.optim.warmup_steps, cfg.optim.schedule, total_updates))
    critic = ppo.build_critic(cfg, model_path, device, mp, dtype, policy.config)
    ema = optim.ema_init(trainable(module), cfg.ema.decay)
    return dict(policy=policy, processor=processor, module=module, ref_kind=ref_kind, ref_module=ref_module,
                packing=packing, optimizer=optimizer, scheduler=scheduler, engine_dtype=sync_dtype(cfg, device), critic=critic, ema=ema)


def engine_dtype(cfg, device):
    """The compute dtype of the trainer's forward and of the engine: bf16 for --policy.dtype bfloat16 (and auto on
    CUDA), else fp32. A flag, not a device: CPU runs the same bf16 path as CUDA."""
    bf16 = cfg.policy.dtype == "bfloat16" or (cfg.policy.dtype == "auto" and device.type == "cuda")
    return torch.bfloat16 if bf16 else torch.float32


def head_in_fp32(cfg, device):
    """--policy.fp32-lm-head takes effect: only with a bf16 compute dtype."""
    return cfg.policy.fp32_lm_head and engine_dtype(cfg, device) == torch.bfloat16


def sync_dtype(cfg, device):
    """The dtype weights travel to the engine in: the engine's, or fp32 when its head is fp32 (it casts the rest)."""
    return torch.float32 if head_in_fp32(cfg, device) else engine_dtype(cfg, device)


def mixed_precision(cfg, device):
    """FSDP2's policies (decoder layers, root): bf16 compute with fp32 master weights and fp32 gradient reduction when
    engine_dtype is bf16 (the sharded parameters, their gradients and AdamW's state stay fp32), the root (embeddings,
    final norm, head) in fp32 with --policy.fp32-lm-head; plain fp32 otherwise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if engine_dtype(cfg, device) != torch.bfloat16:
        return MixedPrecisionPolicy(), None
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), fp32 if head_in_fp32(cfg, device) else None


def build_engine(cfg, model_path, config, processor, engine_dtype, dp_rank, device):
    banned = token_logprobs.placeholder_token_ids(config)
    if engine_kind(cfg) == "vllm":
        engine = rollout.VLLMEngine(model_path, seed=cfg.seed + dp_rank, cfg=cfg.vllm,
                                    dtype=str(engine_dtype).replace("torch.", ""),
                                    image_text=getattr(processor, "image_token_id", None) is not None,
                                    banned_token_ids=banned, show_progress=cfg.log.verbose)
    else:
        engine = rollout.HFEngine(model_path, seed=cfg.seed + dp_rank, dtype=engine_dtype, device=device,
                                  banned_token_ids=banned, fp32_lm_head=head_in_fp32(cfg, device))
    return engine


def setup(cfg):
    """Validate (every rank, no collective), then build everything and resume. -> Run."""
    console.quiet_libraries(cfg.log.verbose, int(os.environ.get("RANK", 0)))  # before any model is built or loaded
    demo = fill_defaults(cfg)
    if demo and os.environ.get("RANK", "0") == "0":
        print(f"{cfg.model}: the demo's " + " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in demo.items())
              + " (a real model's defaults: " + " ".join(f"--{k.replace('_', '-')} {DEFAULTS[k]:g}" for k in demo)
              + ")", flush=True)
    with console.user_input():
        rows, eval_rows = load_rows(cfg)
        resume_path = validate(cfg, rows)
        record = checkpoints.config_record(cfg, train_rows=len(rows), world_size=int(os.environ.get("WORLD_SIZE", 1)))
        if resume_path:  # (its manifest was checked first) refuse a checkpoint of a run with other settings
            checkpoints.check_config(resume_path, record, cfg.checkpoint.allow_changes)
        model_path = model_path_for(cfg)
    link = (inference_ranks.connect(cfg.rollout.inference_ranks, cfg.vllm.tp if engine_kind(cfg) == "vllm" else 1,
                                    cfg.rollout.timeout_s) if cfg.rollout.inference_ranks else None)
    rank, world, device = distributed.setup_distributed()  # with inference ranks: this side's ranks only
    if link and link.role == "generator":
        return setup_generator(cfg, link, rows, eval_rows, model_path, rank, world, device)
    tp = cfg.vllm.tp if engine_kind(cfg) == "vllm" and not link else 1
    with console.user_input():  # one run per directory, before anything is written there
        checkpoints.take_output_dir(cfg.output_dir, cfg.resume, cfg.overwrite, resume_path, rank, device)
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed)  # identical init on every rank; sampling has its own per-completion streams
    built = build_policy(cfg, model_path, device)
    engine = None  # --rollout.inference-ranks: the generators hold the engines
    if not link:
        engine = build_engine(cfg, model_path, built["policy"].config, built["processor"], engine_dtype(cfg, device),
                              rank // tp, device)
        rollout.check_sync_names(engine, built["policy"])  # raises on every rank alike, before the sync's collectives
    kl_ctl = (losses.AdaptiveKLController(cfg.loss.beta, cfg.kl_target, cfg.kl_horizon) if cfg.kl_target and cfg.loss.beta
              else losses.FixedKLController(cfg.loss.beta))
    # a sharded reward model's forward is a collective: with --vllm.tp > 1 only one rank per TP group scores (copies)
    data = cfg.data if tp == 1 else replace(cfg.data, rm_shard_gb=float("inf"))
    reward_fns = [(n, tasks.resolve_reward(n, data, max_completion_length=cfg.rollout.max_completion_length,
                                           device=device, processor=built["processor"])) for n in reward_names(cfg)]
    run = Run(cfg=cfg, rank=rank, world=world, device=device, dp_rank=rank // tp, tp=tp, engine=engine, rows=rows,
              eval_rows=eval_rows, order=np.random.default_rng(cfg.seed).permutation(len(rows)), reward_fns=reward_fns,
              weights=list(cfg.data.reward_weights) or [1.0] * len(reward_fns), kl_ctl=kl_ctl,
              metrics_path=os.path.join(cfg.output_dir, "metrics.jsonl"), link=link, **built)
    run.tools = episodes.load_tools(tool_names(cfg))
    run.config_record = record
    run.make_env = user_code.resolve(cfg.env, "--env") if cfg.env else None
    if cfg.ptx.dataset:
        run.ptx = tasks.ptx_token_rows(cfg.ptx, getattr(run.processor, "tokenizer", run.processor), cfg.seed)
    if resume_path:
        state = checkpoints.load_checkpoint(resume_path, run.module, run.optimizer, rank,
                                         extra={"ema": run.ema} if run.ema else None)
        run.scheduler.load_state_dict(state["scheduler"])
        checkpoints.apply_lr(run.scheduler, cfg.optim.lr)  # a new --optim.lr (--checkpoint.allow-changes) applies
        if run.critic:
            ppo.load_critic_state(run.critic, resume_path, state["critic_scheduler"])
        run.start_step, run.bad_steps, kl_ctl.value = state["step"], state["bad_steps"], state["kl_coef"]
        run.ds_extra_rounds = state.get("ds_extra_rounds", 0)
        if rank == 0:
            print(f"resumed from {resume_path} at step {run.start_step}", flush=True)
    if rank == 0:
        console.trim_metrics(run.metrics_path, run.start_step)
    signal.signal(signal.SIGTERM, lambda *_: setattr(run, "sigterm", True))  # preemption: save at the next safe point
    return run


def setup_generator(cfg, link, rows, eval_rows, model_path, rank, world, device):
    """An inference rank's Run: the data order, the processor and the engine; no policy, optimizer or rewards."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.policy.trust_remote_code)
    processor = models.load_processor(model_path, models.is_image_text(config), cfg.policy.trust_remote_code)
    tp = cfg.vllm.tp if engine_kind(cfg) == "vllm" else 1
    dtype = engine_dtype(cfg, device)
    no_sleep = replace(cfg, vllm=replace(cfg.vllm, enable_sleep_mode=False))  # a generator owns its device
    engine = build_engine(no_sleep, model_path, config, processor, dtype, rank // tp, device)
    run = Run(cfg=cfg, rank=rank, world=world, device=device, dp_rank=rank // tp, tp=tp, policy=None,
              processor=processor, module=None, ref_kind="none", ref_module=None, optimizer=None, scheduler=None,
              engine=engine, engine_dtype=dtype, rows=rows, eval_rows=eval_rows,
              order=np.random.default_rng(cfg.seed).permutation(len(rows)), reward_fns=[], weights=[], kl_ctl=None,
              metrics_path="", link=link)
    run.tools = episodes.load_tools(tool_names(cfg))  # episodes run where they are generated: tools and env here
    run.make_env = user_code.resolve(cfg.env, "--env") if cfg.env else None
    return run
