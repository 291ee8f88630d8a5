"""flags.py: the flags, checked before anything is built: the defaults a run fills in (a real model's, or the
built-in tiny models' demo values), and one clear error for bad input, naming the flag and the fix. Every rank runs
these before any collective, so bad input fails everywhere at once and never leaves a peer waiting.
"""
import dataclasses
import json
import math
import os

import checkpoints
import context_parallel
import episodes
import hubs
import losses
import models
import optim
import ppo
import rollout
import scoring
import tasks
import weight_sync


def engine_kind(cfg):
    import importlib.util  # (find_spec: vLLM without importing it, which is slow: validate runs first)
    return cfg.rollout.engine if cfg.rollout.engine != "auto" else "vllm" if importlib.util.find_spec("vllm") else "hf"


# Flags whose default is None: a real model's value (TRL's), or the built-in tiny models' demo value
DEFAULTS = {"optim.lr": 1e-6, "rollout.max_completion_length": 256}
CRITIC_LR = 1e-5  # --critic.lr with --advantage-estimator gae
DEMO_DEFAULTS = {"optim.lr": 1e-3, "rollout.max_completion_length": 2}  # builtin:tiny learns find_digit in 100 steps


def fill_defaults(cfg):
    """Each of DEFAULTS' flags left unset gets the demo's value with --model builtin:*, else the real model's;
    --rollout.max-total-length gets --vllm.max-model-len. -> {flag: demo value applied} (setup prints them)."""
    demo, applied = cfg.model.startswith("builtin:"), {}
    for name, value in DEFAULTS.items():
        group, attr = name.split(".")
        if getattr(getattr(cfg, group), attr) is None:
            setattr(getattr(cfg, group), attr, DEMO_DEFAULTS[name] if demo else value)
            applied.update({name: DEMO_DEFAULTS[name]} if demo else {})
    if cfg.rollout.max_total_length is None:  # multi-turn episodes fill at most the engine's context
        cfg.rollout.max_total_length = cfg.vllm.max_model_len
    if cfg.critic.lr is None and cfg.advantage_estimator == "gae":  # unset elsewhere: a value typed there is refused
        cfg.critic.lr = CRITIC_LR
    return applied


def validate(cfg, rows):
    """Raise one clear error naming the flag and the fix."""
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
    validate_numbers(cfg)  # (a value that is wrong anywhere, before one that is unread here)
    validate_ignored_flags(cfg)
    group_relative = cfg.advantage_estimator in ("grpo", "rloo")
    if cfg.num_generations < 2 and group_relative and (cfg.scale_rewards != "none" or cfg.advantage_estimator == "rloo"):
        raise ValueError(f"--num-generations {cfg.num_generations}: group-relative advantages need at least 2 "
                         "completions per prompt. Use --num-generations 2 or more.")
    if cfg.critic.model and cfg.advantage_estimator == "gae":
        models.check_model_path(cfg.critic.model, "--critic.model")
    if cfg.ptx.dataset.endswith((".jsonl", ".json", ".parquet")):
        if not os.path.isfile(cfg.ptx.dataset):
            raise FileNotFoundError(f"--ptx.dataset {cfg.ptx.dataset!r}: no such file. Pass a .jsonl/.parquet file "
                                    f"with a {cfg.ptx.column!r} column, a hub dataset or a built-in task.")
        tasks.load_dataset_rows(cfg.ptx.dataset, prompt_column=cfg.ptx.column, flags=("--ptx.dataset", "--ptx.column"))
    G, B = cfg.num_generations, cfg.batch_size
    if B % G or (B * cfg.steps_per_generation) % G or B % min(cfg.micro_batch_size, B):
        k = math.lcm(G, min(cfg.micro_batch_size, max(G, B // G * G)))  # whole groups and whole micro-batches
        raise ValueError(f"--batch-size {B} must hold whole groups of --num-generations {G} (and split evenly into "
                         f"--micro-batch-size {cfg.micro_batch_size}). Use e.g. --batch-size {max(k, B // k * k)}.")
    total = cfg.rollout.max_prompt_length + cfg.rollout.max_completion_length
    if engine_kind(cfg) == "vllm" and total > cfg.vllm.max_model_len:
        raise ValueError(f"--rollout.max-prompt-length + --rollout.max-completion-length = {total} exceeds "
                         f"--vllm.max-model-len {cfg.vllm.max_model_len}. Raise --vllm.max-model-len or shorten them.")
    validate_multi_turn(cfg)
    validate_inference_ranks(cfg)
    validate_distill(cfg)
    if cfg.data.reward_weights and len(cfg.data.reward_weights) != len(reward_names(cfg)):
        raise ValueError(f"--data.reward-weights has {len(cfg.data.reward_weights)} values for "
                         f"{len(reward_names(cfg))} reward functions: give one weight per function.")
    if cfg.eval.reward is not None and cfg.eval.reward not in reward_names(cfg):
        raise ValueError(f"--eval.reward {cfg.eval.reward!r} is not one of this run's reward functions "
                         f"({', '.join(reward_names(cfg))}): name one of them, or add it to --data.rewards.")
    scoring.check_rewards(reward_names(cfg), cfg.data, rows)  # rm:PATH reads only the config here: no model loads
    validate_model(cfg, rows)
    if eval_every(cfg) and not rows:
        raise ValueError(f"--eval.num-prompts {cfg.eval.num_prompts} holds out every prompt of --dataset {cfg.dataset!r} "
                         "for evaluation: none is left to train on. Lower --eval.num-prompts (below the dataset's row "
                         "count) or pass an evaluation split with --data.eval-split.")
    return checkpoints.resolve_resume(cfg.output_dir, cfg.resume, cfg.overwrite)


BUILTIN_MODELS = {"builtin:tiny": False, "builtin:tiny-tools": True}  # --model builtin:* -> has a chat template


def validate_model(cfg, rows):
    """--model: a built-in name, a GGUF file or a checkpoint; an image-text one to train on --dataset's images."""
    from transformers import AutoConfig
    if cfg.model.startswith("builtin:") and cfg.model not in BUILTIN_MODELS:
        raise ValueError(f"--model {cfg.model!r}: the built-in models are {' and '.join(BUILTIN_MODELS)} (multi-turn)")
    if BUILTIN_MODELS.get(cfg.model) is False and any(isinstance(r.get("prompt"), list) for r in rows):
        raise ValueError(f"--dataset {cfg.dataset!r} has chat-message prompts and --model {cfg.model} has no chat "
                         "template to render them. Use --model builtin:tiny-tools or a chat model, or plain-text prompts.")
    gguf = models.gguf_source(cfg.model, cfg.policy.gguf_file)
    if gguf and not os.path.isfile(gguf):
        raise FileNotFoundError(f"GGUF file {gguf!r} not found: pass --model path/to/file.gguf, or --model FOLDER "
                                "--policy.gguf-file NAME.gguf")
    if not cfg.model.startswith("builtin:") and not gguf:
        models.check_model_path(cfg.model)
    config = None if cfg.model.startswith("builtin:") or gguf else AutoConfig.from_pretrained(  # GGUF: text models only
        cfg.model, trust_remote_code=cfg.policy.trust_remote_code)
    image_text = config is not None and models.is_image_text(config)
    context_parallel.check(cfg, int(os.environ.get("WORLD_SIZE", 1)), {"--model": config})  # (all three: launch.setup)
    if cfg.rollout.compile_decode and config is not None:
        rollout.check_compile_decode(config, f"--model {cfg.model!r}")
    if any(r.get("image") is not None for r in rows) and not image_text:
        raise ValueError(f"--dataset {cfg.dataset!r} has images but --model {cfg.model!r} is a text-only model. "
                         "Use an image-text checkpoint (e.g. Qwen2.5-VL) or a text dataset.")


PLAIN_INITS = (True, False, "gaussian", None)  # others (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA, ...) may rewrite the base


def lora_settings(lora):
    """From the flags or a continued adapter's config: its largest rank, DoRA, lora_bias, and what it trains besides
    lora_A / lora_B (token rows, modules, parameters) or may change in the base weights as PEFT loads it (its init)."""
    if not lora.adapter:
        return dict(r=lora.r, use_dora=lora.use_dora, lora_bias=False, beyond=None)
    with open(os.path.join(lora.adapter, "adapter_config.json")) as f:
        c = json.load(f)
    init = c.get("init_lora_weights")
    beyond = next((f"{k}={c[k]}" for k in ("trainable_token_indices", "modules_to_save", "target_parameters")
                   if c.get(k)), None) or (f"init_lora_weights={init} (PEFT may rewrite the base weights as it loads "
                                           "it)" if init not in PLAIN_INITS else None)
    return dict(r=max([c["r"], *(c.get("rank_pattern") or {}).values()]), use_dora=c.get("use_dora", False),
                lora_bias=c.get("lora_bias", False), beyond=beyond)


def validate_lora_sync(cfg, model_path):
    """--lora.sync, on the checkpoint folder the engine will load (a GGUF file's conversion, the built-in model's
    folder), before the config is recorded: adapter unless the engine cannot serve the adapter as trained, then merged
    with one line saying why; a mode the user asked for that cannot work is refused by name. Fills in the default."""
    lora, on, vllm = cfg.lora, bool(cfg.lora.r or cfg.lora.adapter), engine_kind(cfg) == "vllm"
    if lora.sync not in (None, "adapter", "merged") or (lora.sync and not on):
        raise ValueError(f"--lora.sync {lora.sync!r}: use adapter or merged, with LoRA on (--lora.r or --lora.adapter)")
    if not on or lora.sync == "merged":
        return
    s, trc = lora_settings(lora), cfg.policy.trust_remote_code
    why = (f"the continued adapter's {s['beyond']}: it sends lora_A / lora_B only" if s["beyond"] else
           "DoRA (--lora.use-dora): vLLM's LoRA has no magnitude vector" if s["use_dora"] else
           "lora_bias: vLLM's LoRA has no bias" if s["lora_bias"] else
           f"rank {s['r']}: above vLLM's largest LoRA rank (512)" if s["r"] > 512 and vllm else
           "--vllm.sleep-level 2 drops the base weights at every sleep, and an adapter sync never resends them"
           if vllm and cfg.vllm.enable_sleep_mode and cfg.vllm.sleep_level >= 2 else None)
    if not why and (lora.adapter or lora.target_modules):  # (the default targets are linear layers)
        embeddings = weight_sync.embedding_targets(model_path, lora, trc)
        why = embeddings and f"LoRA on embeddings ({', '.join(embeddings)}): it sends linear layers' lora_A/B only"
    if not why and vllm:  # the class the engine will build: imports vLLM (as the engine does anyway)
        name, served = weight_sync.vllm_lora_class(model_path, trc)
        why = None if served else f"{name}: vLLM has no LoRA for this architecture"
    if lora.sync == "adapter" and why:
        raise ValueError(f"--lora.sync adapter cannot serve {why}. Use --lora.sync merged.")
    if why and os.environ.get("RANK", "0") == "0":
        print(f"--lora.sync merged (the default here): the adapter sync cannot serve {why}", flush=True)
    lora.sync = "merged" if why else "adapter"


def validate_numbers(cfg):
    """Counts and sizes that must be positive, and the ranges of the other numbers: refused by flag, before a
    ZeroDivisionError (--batch-size 0), torch's message (--optim.lr -1) or a run that trains wrongly without a word
    (--loss.beta -0.1 rewards drifting from the reference; --max-bad-steps 0 stops after the first step)."""
    optim.check_optim(cfg.optim)
    r, ls = cfg.rollout, cfg.loss
    counts = {"--max-steps": cfg.max_steps, "--batch-size": cfg.batch_size, "--micro-batch-size": cfg.micro_batch_size,
              "--num-generations": cfg.num_generations, "--steps-per-generation": cfg.steps_per_generation,
              "--num-iterations": cfg.num_iterations, "--dynamic-sampling-max-rounds": cfg.dynamic_sampling_max_rounds,
              "--max-bad-steps": cfg.max_bad_steps, "--kl-horizon": cfg.kl_horizon, "--eval.n-samples": cfg.eval.n_samples,
              "--rollout.max-prompt-length": r.max_prompt_length,
              "--rollout.max-completion-length": r.max_completion_length,
              "--loss.max-completion-length": 1 if ls.max_completion_length is None else ls.max_completion_length}
    if bad := [f"{flag} {value}" for flag, value in counts.items() if value < 1]:
        raise ValueError(f"{', '.join(bad)}: must be >= 1.")
    ranges = {  # the refusal -> whether a value is out of its range
        f"--rollout.temperature {r.temperature} must be > 0 (the log-probs divide by it)": not r.temperature > 0,
        f"--loss.beta {ls.beta} must be >= 0 (0 = no KL term)": not ls.beta >= 0,
        f"--loss.dual-clip {ls.dual_clip} must be > 1 (unset = off)": ls.dual_clip is not None and not ls.dual_clip > 1,
        f"--loss.epsilon {ls.epsilon} and --loss.epsilon-high {ls.epsilon_high} must be >= 0":
            not ls.epsilon >= 0 or (ls.epsilon_high is not None and not ls.epsilon_high >= 0),
        f"--kl-target {cfg.kl_target} must be > 0 (unset = a fixed KL coefficient)":
            cfg.kl_target is not None and not cfg.kl_target > 0,
        f"--micro-batch-tokens {cfg.micro_batch_tokens} must be >= 0 (0 = off)": cfg.micro_batch_tokens < 0,
        f"--eval.every {cfg.eval.every}, --log.episodes-every {cfg.log.episodes_every} and --checkpoint.every "
        f"{cfg.checkpoint.every} must be >= 0 (0 = never)":
            min(cfg.eval.every or 0, cfg.checkpoint.every, cfg.log.episodes_every) < 0,
        f"--gamma {cfg.gamma} must be in (0, 1] and --lam {cfg.lam} in [0, 1].":
            not (0 < cfg.gamma <= 1 and 0 <= cfg.lam <= 1),
        "--ema.decay must be in [0, 1) (0 = off) and --critic.value-clip > 0.":
            not 0 <= cfg.ema.decay < 1 or cfg.critic.value_clip <= 0,
        "--rollout.top-p must be in (0, 1], --rollout.top-k >= 0 (0 = off) and --rollout.max-mismatch >= 0 (0 = off).":
            not (0 < r.top_p <= 1) or r.top_k < 0 or r.max_mismatch < 0,
        "--rollout.max-turns must be >= 1, --rollout.max-turn-tokens >= 0, --rollout.tool-timeout-s and "
        "--rollout.env-timeout-s > 0.": min(r.max_turns - 1, r.max_turn_tokens) < 0 or min(r.tool_timeout_s,
                                                                                          r.env_timeout_s) <= 0,
        "--rollout.inference-ranks and --rollout.max-staleness must be >= 0, --rollout.timeout-s > 0.":
            r.max_staleness < 0 or r.timeout_s <= 0 or r.inference_ranks < 0,
        f"--rollout.inflight-updates {r.inflight_updates}: tokens per chunk, > 0 (0: off).": r.inflight_updates < 0}
    if bad := next((message for message, out in ranges.items() if out), None):
        raise ValueError(bad)


def validate_ignored_flags(cfg):
    """What the chosen mode would not use, refused by name: READS, and the cases that need a message of their own."""
    if verifiers(cfg):  # (its environment runs on one rank's engine, with its own tools and rewards)
        if tool_names(cfg):
            raise ValueError("--data.tools with --env verifiers:...: the environment brings its own tools. Drop it.")
        if cfg.eval.every:
            raise ValueError("--eval.every with --env verifiers:...: evaluation scores a dataset's answers, and a "
                             "taskset's rewards are its environment's (they are in the training metrics). Drop it.")
        if cfg.rollout.inflight_updates or (engine_kind(cfg) == "vllm" and cfg.vllm.tp > 1):
            raise ValueError("--env verifiers:... runs on an engine of its own (one rank's, colocated or a "
                             "generator's) and keeps no per-token weight versions: drop --vllm.tp > 1 and "
                             "--rollout.inflight-updates.")
    validate_read_flags(cfg)
    r = cfg.rollout
    sharded = cfg.data.rm_shard_gb != tasks.DataConfig().rm_shard_gb  # one rank per TP group scores: no sharding
    if engine_kind(cfg) == "vllm" and cfg.vllm.tp > 1 and not r.inference_ranks and sharded and any(
            n.startswith("rm:") for n in reward_names(cfg)):
        raise ValueError(f"--data.rm-shard-gb {cfg.data.rm_shard_gb} would be ignored: with --vllm.tp {cfg.vllm.tp} one "
                         "rank per TP group scores, with its own copy of the reward model. Drop --data.rm-shard-gb.")
    if r.inference_ranks and r.max_staleness > 0 and cfg.loss.sampler_correction == "none":
        raise ValueError(f"--loss.sampler-correction none with --rollout.inference-ranks and --rollout.max-staleness "
                         f"{r.max_staleness} would train samples from older weights with no correction for the policy "
                         "that generated them. Use a correction (the default sequence_mask, or token_truncate) or "
                         "--rollout.max-staleness 0.")


def flag_text(path, value):
    """A flag and its value: --gamma 0.9, --dynamic-sampling, --policy.share-prompts False, --data.rewards a b."""
    flag, value = "--" + path.replace("_", "-"), " ".join(map(str, value)) if isinstance(value, tuple) else value
    return flag if value is True else f"{flag} {value}"


def flags_set(cfg, default, prefix=""):
    """-> [(dotted path, value)] of the fields of cfg (its sections' too) set away from their defaults."""
    out = []
    for f in dataclasses.fields(cfg):
        value, was = getattr(cfg, f.name), getattr(default, f.name)
        out += (flags_set(value, was, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else
                [(prefix + f.name, value)] * (value != was))
    return out


def validate_read_flags(cfg):
    """READS: a flag set away from its default where nothing reads it is refused, named. With --env verifiers:..., the
    flags that an environment of its own (package.module:make_env) would read are named in one message."""
    rules = [(p, v, READS.get(p, READS.get(p.partition(".")[0] + ".*"))) for p, v in flags_set(cfg, type(cfg)())]
    unread = [(p, v, rule) for p, v, rule in rules if isinstance(rule, tuple) and not rule[0](cfg)]
    factory = dataclasses.replace(cfg, env="module:make_env") if verifiers(cfg) else None
    if taskset := ["--" + p.replace("_", "-") for p, _, rule in unread if factory and rule[0](factory)]:
        raise ValueError(f"--env {cfg.env} does not read {', '.join(taskset)} (its taskset and environment decide "
                         "them). Drop them.")
    for path, value, (_, why) in unread[:1]:
        named = flag_text(path, value) if path in READS else "--" + path.partition(".")[0] + ".*"
        given = "" if path in READS else f" ({flag_text(path, value)})"
        raise ValueError(f"{named}{why(cfg) if callable(why) else why}, so it would be ignored{given}. Drop it, or "
                         "turn on what reads it.")


# ---- Which flags each setting reads: READS ----

def verifiers(c):
    return (c.env or "").startswith("verifiers:")


def multi_turn(c):
    return bool(tool_names(c) or c.env)


SCALED = {"rloo": "are not scaled", "gae": "are whitened over the global batch's tokens"}  # (and reinforce_pp's)
VF = " is not read by --env verifiers:... (its taskset and environment decide it)"
# A grpo.Config field's dotted path ("section.*": a section's fields without a key of their own) -> (when it is read,
# the refusal's text after "--flag VALUE"), None (always read), or the function holding its rule. A flag set where it
# is not read is refused; tests/test_flags.py walks grpo.Config: a new field needs a rule.
READS = {
    **dict.fromkeys(("model", "output_dir", "max_steps", "seed", "env", "resume", "overwrite", "num_generations",
                     "batch_size", "micro_batch_size", "micro_batch_tokens", "steps_per_generation", "num_iterations",
                     "advantage_estimator", "dynamic_sampling", "max_bad_steps", "ema.decay", "optim.*", "log.*",
                     "policy.*", "rollout.*", "data.*", "loss.*", "checkpoint.*", "eval.*", "lora.adapter",
                     "distill.teacher", "ptx.dataset", "wandb.mode")),
    "dataset": (lambda c: not verifiers(c), VF),
    "env_args": "hubs.check_env",  # read by --env verifiers:... and package.module:make_env factories
    "scale_rewards": (lambda c: c.advantage_estimator == "grpo" or (c.advantage_estimator, c.scale_rewards) == (
        "rloo", "none"), lambda c: f" does nothing with --advantage-estimator {c.advantage_estimator}: its advantages "
                                   + SCALED.get(c.advantage_estimator, SCALED["gae"])),
    "reward_aggregation": (lambda c: c.advantage_estimator == "grpo", lambda c: " (GDPO: each reward function "
                           "normalised within its group) applies to --advantage-estimator grpo only; "
                           f"{c.advantage_estimator} uses the weighted sum of the rewards"),
    "gamma": (lambda c: c.advantage_estimator in ppo.TOKEN_ESTIMATORS, " is read by --advantage-estimator gae and "
              "reinforce_pp only (their returns' discount)"),
    "lam": (lambda c: c.advantage_estimator == "gae", " is GAE's lambda: only --advantage-estimator gae reads it"),
    "dynamic_sampling_max_rounds": (lambda c: c.dynamic_sampling, " bounds the rounds of --dynamic-sampling only"),
    "kl_target": (lambda c: c.loss.beta > 0, ": the KL term needs --loss.beta > 0"),
    "kl_horizon": (lambda c: c.kl_target is not None, " is the adaptive KL's horizon: only --kl-target reads it"),
    "policy.fp32_lm_head": (lambda c: engine_kind(c) == "hf", " runs the engine's lm-head in fp32, which only the HF "
                            "engine does (--rollout.engine hf)"),
    "policy.gguf_file": (lambda c: not c.model.startswith("builtin:"), " names a file of --model's folder"),
    "lora.*": (lambda c: c.lora.r > 0 and not c.lora.adapter, " shapes a new adapter: it needs --lora.r > 0 (a "
               "continued --lora.adapter brings its own settings)"),
    "lora.r": (lambda c: not c.lora.adapter, " sizes a new adapter; --lora.adapter continues one with its own rank"),
    "lora.dropout": (lambda c: bool(c.lora.r or c.lora.adapter), " is LoRA's: it needs --lora.r or --lora.adapter"),
    "lora.sync": "validate_lora_sync",
    "vllm.*": (lambda c: engine_kind(c) == "vllm", ": only the vLLM engine reads them; the HF engine (--rollout.engine "
               "hf) runs one copy per rank"),
    "vllm.sync_bucket_mb": (lambda c: engine_kind(c) == "vllm" or c.rollout.inference_ranks > 0, " sizes the weight "
                            "sync of the vLLM engine and of --rollout.inference-ranks only"),
    "vllm.max_model_len": (lambda c: engine_kind(c) == "vllm" or multi_turn(c), " sizes the vLLM engine and caps "
                           "multi-turn episodes: the HF engine's single-turn rollouts never read it"),
    **dict.fromkeys(("rollout.max_turns", "rollout.max_turn_tokens"), (
        lambda c: multi_turn(c) and not verifiers(c), " is read by multi-turn episodes only (--data.tools or --env)")),
    "log.episodes_every": (multi_turn, " writes multi-turn episodes only (single-turn: --log.completions-every)"),
    "rollout.max_total_length": (lambda c: multi_turn(c) or c.rollout.max_total_length == c.vllm.max_model_len,
                                 " caps multi-turn episodes only (--data.tools or --env)"),  # (== fill_defaults' value)
    "rollout.tool_timeout_s": (lambda c: bool(tool_names(c)) and not verifiers(c), " bounds --data.tools' calls only"),
    "rollout.env_timeout_s": (lambda c: bool(c.env), " bounds --env's calls only"),
    **dict.fromkeys(("rollout.max_staleness", "rollout.timeout_s", "rollout.inflight_updates"), (
        lambda c: c.rollout.inference_ranks > 0, " needs --rollout.inference-ranks (the colocated loop has no "
        "generators: it updates weights between batches only)")),
    "rollout.compile_decode": (lambda c: engine_kind(c) == "hf", " compiles the HF engine's decode step; vLLM compiles "
                               "its own (CUDA graphs)"),
    **{f"loss.{f}": (lambda c, f=f: f in losses.LOSSES[c.loss.loss_type].get("reads", ()), " is not read by this "
                     "--loss.loss-type") for e in losses.LOSSES.values() for f in e.get("reads", ())},  # (losses says)
    "loss.kl_in_reward": (lambda c: c.advantage_estimator in ppo.TOKEN_ESTIMATORS, " puts the KL into per-token "
                          "rewards: use it with --advantage-estimator gae or reinforce_pp (with grpo/rloo the KL is a "
                          "loss term: --loss.beta)"),
    **dict.fromkeys(("loss.kl_estimator", "loss.use_bias_correction_kl"), (
        lambda c: c.loss.beta > 0 and not ppo.kl_in_reward(c), lambda c: " is not read while the KL is in the "
        "reward (its estimator is --loss.reward-kl-estimator)" if ppo.kl_in_reward(c) else ": the KL term needs "
        "--loss.beta > 0")),
    "loss.reward_kl_estimator": (ppo.kl_in_reward, ": the KL is not in the reward (it needs --loss.beta > 0 with "
                                 "reinforce_pp, or gae --loss.kl-in-reward)"),
    "loss.sampler_correction_cap": (lambda c: c.loss.sampler_correction != "none", ": --loss.sampler-correction "
                                    "none applies no cap"),
    "data.tools": (lambda c: not verifiers(c), " is not read by --env verifiers:... (its environment brings its own)"),
    **dict.fromkeys(("data.prompt_column", "data.answer_column"), (
        lambda c: c.dataset not in tasks.BUILTIN_TASKS and not verifiers(c), " is not read by a built-in task (its "
        "rows are made, not read)")),
    "data.size": (lambda c: c.dataset in tasks.BUILTIN_TASKS and not verifiers(c), " sizes a built-in task only (a "
                  "file or hub dataset is read whole)"),
    **dict.fromkeys(("data.split", "data.eval_split", "data.chat_template", "data.system_prompt"), (
        lambda c: not verifiers(c), VF)),
    "data.overlong_cache": (lambda c: "overlong" in reward_names(c), " shapes --data.rewards overlong only"),
    **dict.fromkeys(("data.rm_batch_size", "data.rm_shard_gb"), (
        lambda c: any(n.startswith("rm:") for n in reward_names(c)), " is read by --data.rewards rm:PATH only")),
    **dict.fromkeys(("data.http_timeout_s", "data.http_retries"), (
        lambda c: any(n.startswith(("http://", "https://")) for n in reward_names(c)), " is read by reward servers "
        "only (--data.rewards http://...)")),
    "openenv.*": (lambda c: (c.env or "").startswith("openenv:"), ": only --env openenv:URL reads them"),
    "wandb.*": (lambda c: c.wandb.mode != "disabled", " is read with --wandb.mode online or offline only"),
    "checkpoint.save_merged": (lambda c: bool(c.lora.r or c.lora.adapter), " merges a LoRA adapter into the saved "
                               "policy: it needs LoRA (--lora.r)"),
    "checkpoint.allow_changes": (lambda c: c.resume is not None, " says what may change on --resume only"),
    "critic.*": (lambda c: c.advantage_estimator == "gae", ": only --advantage-estimator gae trains a critic"),
    "critic.freeze_actor_steps": (lambda c: c.advantage_estimator == "gae", " trains the critic alone first: only "
                                  "--advantage-estimator gae has a critic"),
    "ptx.*": (lambda c: bool(c.ptx.dataset), " is read with --ptx.dataset only"),
    "eval.n_samples": (lambda c: eval_every(c) > 0, " is read by evaluations only (--eval.every)"),
    "eval.reward": (lambda c: eval_every(c) > 0, " is the evaluations' check: read by evaluations only (--eval.every)"),
    "eval.use_ema": (lambda c: c.ema.decay > 0 and eval_every(c) > 0, " evaluates the EMA weights: turn the EMA on "
                     "with --ema.decay (e.g. 0.992), and evaluate (--eval.every)"),
    "distill.coef": (lambda c: bool(c.distill.teacher), " weights the distillation advantage, which needs a teacher "
                     "(--distill.teacher PATH)"),
}


def reward_names(cfg):
    return list(cfg.data.rewards) or (["env"] if cfg.env else scoring.DEFAULT_REWARDS.get(cfg.dataset, ["accuracy"]))


def tool_names(cfg):
    return list(cfg.data.tools) or tasks.DEFAULT_TOOLS.get(cfg.dataset, [])


def validate_multi_turn(cfg):
    """--data.tools / --env: importable, a chat template to render turns with, and the limits that apply."""
    r = cfg.rollout
    if r.max_total_length is not None and r.max_total_length <= r.max_prompt_length:
        raise ValueError(f"--rollout.max-total-length {r.max_total_length} must exceed --rollout.max-prompt-length "
                         f"{r.max_prompt_length} (it caps prompt + every turn).")
    if engine_kind(cfg) == "vllm" and (r.max_total_length or 0) > cfg.vllm.max_model_len:
        raise ValueError(f"--rollout.max-total-length {r.max_total_length} exceeds --vllm.max-model-len "
                         f"{cfg.vllm.max_model_len}. Raise --vllm.max-model-len or lower it.")
    hubs.check_env(cfg)
    if not (tool_names(cfg) or cfg.env):
        return
    episodes.load_tools(tool_names(cfg), cfg.data.import_timeout_s)  # (later loads find the modules imported)
    if BUILTIN_MODELS.get(cfg.model) is False:
        raise ValueError("--data.tools / --env need a checkpoint with a chat template (tool results and observations "
                         f"are chat messages); {cfg.model} has none. Pass --model builtin:tiny-tools or a chat model.")


def check_chat_template(cfg, model_path):
    """Multi-turn episodes render tool results and observations with the checkpoint's chat template (a GGUF file's:
    once converted, still before any collective)."""
    if not (tool_names(cfg) or cfg.env) or BUILTIN_MODELS.get(cfg.model) is False:  # refused in validate
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
    """--critic.model reads the policy's token ids (check_token_ids; pad positions are masked), or a clear refusal."""
    if cfg.advantage_estimator != "gae" or not cfg.critic.model:
        return
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
    if os.path.isdir(cfg.critic.model) and not any(os.path.exists(os.path.join(cfg.critic.model, f)) for f in files):
        raise ValueError(f"--critic.model {cfg.critic.model!r} has no tokenizer files (tokenizer.json, "
                         "tokenizer_config.json, ...): the check that it reads the policy's token ids needs them. Save "
                         "the policy's tokenizer into that directory (AutoTokenizer.from_pretrained(MODEL)"
                         ".save_pretrained(CRITIC_DIR)) if the critic was trained with it, or leave --critic.model empty.")
    check_token_ids(cfg, model_path, cfg.critic.model, f"--critic.model {cfg.critic.model!r}", "policy",
                    "the critic reads the policy's token ids, which must mean the same tokens. Use a critic of the "
                    "policy's family (its vocabulary holding the policy's with the same ids, same bos/eos/unk), or "
                    "leave --critic.model empty to start from the policy's checkpoint.")


def check_token_ids(cfg, model_path, path, named, who, why):
    """The checkpoint at `path` (`named`: its flag and value) reads the policy's token ids: every policy token at the
    same id in its vocabulary (a superset is fine), the same bos/eos/unk ids; else a refusal saying what differs, then
    `why` (the reason and the fix)."""
    from transformers import AutoTokenizer
    policy, other = (AutoTokenizer.from_pretrained(p, trust_remote_code=cfg.policy.trust_remote_code)
                     for p in (model_path, path))
    want, got = ({k: getattr(t, k) for k in ("bos_token_id", "eos_token_id", "unk_token_id")} for t in (policy, other))
    ov = other.get_vocab()
    missing = [t for t, i in policy.get_vocab().items() if ov.get(t) != i]
    differs = ([f"{len(missing)} {who} tokens missing or with other ids, e.g. {missing[0]!r}"] if missing else []) + [
        f"{k} {got[k]} vs {want[k]}" for k in want if got[k] != want[k]]
    if differs:
        raise ValueError(f"{named} has another tokenizer than --model {cfg.model!r} ({'; '.join(differs)}): {why}")


def validate_distill(cfg):
    """--distill.*: a teacher that exists and a positive weight (--distill.coef without a teacher: READS)."""
    d = cfg.distill
    if not d.teacher:
        return
    if not d.coef > 0:
        raise ValueError(f"--distill.coef {d.coef} must be > 0 (to turn distillation off, drop --distill.teacher).")
    if cfg.dynamic_sampling:  # it keeps the groups whose rewards differ: the teacher's signal needs none of that
        raise ValueError("--dynamic-sampling keeps only groups whose rewards differ and drops the rest from the loss, "
                         "their distillation term with them; with --distill.teacher every group has a signal. Drop "
                         "--dynamic-sampling.")
    gguf = models.gguf_source(d.teacher)
    if gguf and not os.path.isfile(gguf):
        raise FileNotFoundError(f"--distill.teacher {d.teacher!r}: no such GGUF file. Pass a .gguf file or a "
                                "checkpoint directory.")
    if not gguf:
        models.check_model_path(d.teacher, "--distill.teacher")


def check_teacher(cfg, model_path, teacher_path):
    """--distill.teacher scores the student's sampled token ids: it must read them as the student does
    (check_token_ids) and be the same kind of model (an image-text student's teacher sees the same image inputs)."""
    from transformers import AutoConfig
    trust = cfg.policy.trust_remote_code
    kinds = [models.is_image_text(AutoConfig.from_pretrained(p, trust_remote_code=trust))
             for p in (model_path, teacher_path)]
    if kinds[0] != kinds[1]:
        raise ValueError(f"--distill.teacher {cfg.distill.teacher!r} is {'an image-text' if kinds[1] else 'a text'} "
                         f"model and --model {cfg.model!r} {'an image-text' if kinds[0] else 'a text'} one: the teacher "
                         "must read the student's inputs as they are. Use a teacher of the same kind (an image-text "
                         "teacher of the student's family for an image-text student).")
    check_token_ids(cfg, model_path, teacher_path, f"--distill.teacher {cfg.distill.teacher!r}", "student",
                    "the teacher scores the student's sampled token ids, which must mean the same tokens to both. Use "
                    "a teacher of the student's family (its vocabulary holding the student's with the same ids, the "
                    "same bos/eos/unk); a teacher with another tokenizer would need the text re-tokenized and its "
                    "log-probs aligned across the two tokenizations (cross-tokenizer distillation, e.g. TRL's GOLD), "
                    "which this does not do.")


def validate_inference_ranks(cfg):
    """--rollout.inference-ranks: a world with trainers left, whole engines, and only what the split supports."""
    r, world = cfg.rollout, int(os.environ.get("WORLD_SIZE", 1))
    idle = (r.inflight_updates and not r.max_staleness and "--rollout.max-staleness 0: each batch starts at the newest"
            " weights, no update can arrive during it" or r.inflight_updates >= r.max_completion_length and
            not (tool_names(cfg) or cfg.env) and  # an episode's later turns begin with a chunk: they take newer weights
            f"--rollout.max-completion-length {r.max_completion_length}: no completion is long enough to be cut")
    if idle and os.environ.get("RANK", "0") == "0":
        print(f"--rollout.inflight-updates {r.inflight_updates} does nothing with {idle}; chunks only cost time",
              flush=True)
    if not r.inference_ranks:
        return
    if r.inference_ranks >= world:
        raise ValueError(f"--rollout.inference-ranks {r.inference_ranks} leaves no trainer in a world of {world} "
                         f"ranks: launch more (torchrun --nproc-per-node {r.inference_ranks + 1} or more) or use fewer.")
    tp = cfg.vllm.tp if engine_kind(cfg) == "vllm" else 1
    if r.inference_ranks % tp:
        raise ValueError(f"--rollout.inference-ranks {r.inference_ranks} is not a multiple of --vllm.tp {tp}: every "
                         "engine needs all of its TP ranks.")
    if r.inflight_updates and tp > 1:
        raise ValueError("--rollout.inflight-updates with --vllm.tp > 1: an engine's TP ranks would have to agree on "
                         "the chunk at which to switch weights, which they do not yet. Use --vllm.tp 1, or drop "
                         "--rollout.inflight-updates (weights then change between batches).")


def eval_every(cfg):
    """--eval.every; unset: before and after training where the dataset has an eval split (a verifiers taskset not)."""
    if cfg.eval.every is None:
        split = cfg.data.eval_split or cfg.dataset in tasks.BUILTIN_TASKS
        return cfg.max_steps if split and "rows" not in (hubs.hub_of(cfg.env)[0] or {}) else 0
    return cfg.eval.every
