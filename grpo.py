"""grpo.py: GRPO-family RL post-training in one file: FSDP2 policy + colocated vLLM engine + pure losses.

    torchrun --nproc_per_node 2 grpo.py                                  # CPU: tiny built-in policy learns offline
    torchrun --nproc_per_node 8 grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset openai/gsm8k:main \\
        --data.prompt-column question --data.rewards accuracy format --rollout.max-completion-length 512 ...
    python grpo.py --help                                                # every flag, with its docstring

One step: sample prompts -> sync weights -> generate -> rewards -> the training batch (old/ref log-probs, critic
values) -> advantages -> steps_per_generation x num_iterations optimizer updates (then the critic's) -> log ->
checkpoint. main() at the bottom reads as that list; docs/step.md traces it function by function.
"""
import dataclasses
import functools
import itertools
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import tyro

import batching
import checkpoints
import console
import context_parallel
import distributed
import dynamic_sampling
import episodes
import hubs
import inference_ranks
import losses
import metrics
import models
import optim
import ppo
import rollout
import scoring
import tasks
import weight_sync
from flags import eval_every
from launch import DistillConfig, setup
from metrics import EvalConfig
from optim import EMAConfig, OptimConfig, trainable
from rollout import RolloutConfig
from tasks import encode_prompt
from token_logprobs import collate

# ---- Config: every field is a CLI flag (tyro); the docstring under it is its --help text ----

@dataclass
class Config:
    model: str = "builtin:tiny"
    """Hub id, local checkpoint folder, or a .gguf file (dequantised once to <output-dir>/converted/). Offline:
    builtin:tiny (a random tiny Qwen2), builtin:tiny-tools (one warmed up to call tools, for --dataset calculator)."""
    dataset: str = "find_digit"
    """Built-in task (find_digit | max_digit | arith | small_arith | countdown | calculator: the last four are chat
    prompts, for a chat model or builtin:tiny-tools), a local .jsonl/.parquet file, package.module:function (its
    rows: a list of dicts or a datasets.Dataset), or a hub dataset (name[:config])."""
    output_dir: str = "outputs/run"
    """Where metrics.jsonl and checkpoint-<step>/ go."""
    max_steps: int = 100
    """Number of steps (one step = one generation batch and its optimizer updates)."""
    seed: int = 0
    """Base seed; each rank derives its own."""
    env: str | None = None
    """Multi-turn episodes: package.module:make_env, called once per episode, whose object has reset(row) -> messages,
    step(assistant_text) -> (new_messages | None, reward | None, done), maybe close() and unfinished(reason) -> reward
    (docs/multi-turn.md); its rewards are the `env_reward` column (default reward `env`). Or openenv:URL (an OpenEnv server; --openenv.*), or verifiers:TASKSET (hubs.py)."""
    env_args: str | None = None
    """JSON object: the keyword arguments of --env package.module:make_env (e.g. '{"max_number": 100}'), or a verifiers
    environment's EnvConfig fields ('{"taskset": {...}}', and "renderer": the client's renderer fields)."""
    resume: str | None = None
    """latest (newest checkpoint in output_dir; error if none) | auto (latest if any, else start fresh) | a path."""
    overwrite: bool = False
    """Start fresh in an output_dir that holds another run's checkpoints, deleting them and its metrics.jsonl."""
    num_generations: int = 8
    """G: completions per prompt (one group; a group never spans ranks)."""
    batch_size: int = 64
    """Completions per rank per optimizer update (a multiple of num_generations)."""
    micro_batch_size: int = 64
    """Completions per forward/backward (gradient accumulation inside one update)."""
    micro_batch_tokens: int = 0
    """0 = off. N > 0: every pass orders this rank's rows by length and cuts micro-batches of at most N tokens of padded
    input (rows x longest row) and --micro-batch-size rows; a longer row runs alone. Less padding, same gradient."""
    steps_per_generation: int = 1
    """Optimizer updates per generation batch (the batch is split into this many minibatches)."""
    num_iterations: int = 1
    """mu: passes over each generation batch (PPO epochs)."""
    scale_rewards: str = "group"
    """group | batch | none: divide grpo's advantages by the group std, the batch std, or nothing (Dr. GRPO)."""
    advantage_estimator: str = "grpo"
    """grpo (group mean baseline) | rloo (leave-one-out) | reinforce_pp (REINFORCE++, arXiv 2501.03262: per-token
    returns, KL in the reward) | gae (PPO with a critic, arXiv 1506.02438)."""
    gamma: float = 1.0
    """Discount for reinforce_pp and gae."""
    lam: float = 1.0
    """GAE lambda (gae)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling (arXiv 2503.14476): replace groups whose rewards all agree by new prompts' groups."""
    dynamic_sampling_max_rounds: int = 3
    """Most generation rounds per step with --dynamic-sampling; then top up with groups kept out of the loss."""
    reward_aggregation: str = "sum_then_normalize"
    """Several reward functions: sum_then_normalize | normalize_then_sum (GDPO; grpo only)."""
    max_bad_steps: int = 3
    """Stop (with a checkpoint) after this many consecutive steps with a NaN/Inf loss or gradient norm."""
    kl_target: float | None = None
    """Adaptive KL (Ziegler et al., arXiv 1909.08593): steer the measured KL to this, starting from --loss.beta."""
    kl_horizon: int = 10000
    """Adaptive KL horizon (in steps)."""
    policy: models.PolicyConfig = field(default_factory=models.PolicyConfig)
    """The trained model: dtype, gradient checkpointing, the FSDP2 layout of its log-prob forward."""
    lora: models.LoraConfig = field(default_factory=models.LoraConfig)
    """LoRA adapters instead of full fine-tuning (off while --lora.r is 0)."""
    # `vllm` is declared before `rollout`, whose name shadows the rollout module in this class body
    vllm: rollout.VLLMConfig = field(default_factory=rollout.VLLMConfig)
    """The vLLM engine (--rollout.engine vllm): tensor parallelism, context length, KV cache, weight-sync buckets."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation: engine, sampling settings, multi-turn tools, inference ranks and their staleness."""
    loss: losses.LossConfig = field(default_factory=losses.LossConfig)
    """The policy loss: type, clipping, KL to the reference, sampler correction."""
    data: tasks.DataConfig = field(default_factory=tasks.DataConfig)
    """Prompts and rewards: dataset, columns and splits, system prompt, tools, reward functions and their weights."""
    openenv: hubs.OpenEnvConfig = field(default_factory=hubs.OpenEnvConfig)
    """--env openenv:URL: which action and observation fields carry the text, and which server rewards count."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and its learning-rate schedule, gradient clipping."""
    log: console.LogConfig = field(default_factory=console.LogConfig)
    """The console: completion tables, the progress bar, library logs."""
    wandb: console.WandbConfig = field(default_factory=console.WandbConfig)
    """Weights & Biases logging (off by default)."""
    checkpoint: checkpoints.CheckpointConfig = field(default_factory=checkpoints.CheckpointConfig)
    """How often checkpoints are written and what they hold."""
    critic: ppo.CriticConfig = field(default_factory=ppo.CriticConfig)
    """The value model of --advantage-estimator gae (PPO)."""
    ema: EMAConfig = field(default_factory=EMAConfig)
    """An exponential moving average of the policy's weights, for evaluation."""
    ptx: tasks.PtxConfig = field(default_factory=tasks.PtxConfig)
    """A supervised (pre-training) loss mixed into the policy loss (InstructGPT's PPO-ptx)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation: greedy accuracy and reward every --eval.every steps."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation: a teacher's per-token log-probs of the sampled tokens as (part of) the advantage."""


# ---- Stages 1-4: prompts, weight sync, generation, rewards ----

def sample_prompts(run, step, rnd=0, trainer=None):
    """This rank's prompts (an inference rank's: trainer `trainer`'s), a function of the seed, step, dynamic-sampling
    round and earlier extra rounds only, so resume is exact; a vLLM TP group shares one batch."""
    cfg = run.cfg
    per_rank = inference_ranks.per_trainer(cfg)
    dp, world, k = (run.dp_rank, run.world, run.batch_ranks) if trainer is None else (trainer, run.link.n_data, 1)
    start = (step + run.ds_extra_rounds + rnd) * per_rank * world + dp * per_rank * k
    rows = [run.rows[int(run.order[(start + i) % len(run.rows)])] for i in range(per_rank * k)]
    cut = None if "rows" in (hubs.hub_of(cfg.env)[0] or {}) else cfg.rollout.max_prompt_length  # verifiers: uncut
    return [{"row": r, **encode_prompt(r, run.processor, cut, cfg.data.chat_template,
                                       cfg.data.system_prompt, list(run.tools.values()) or None)} for r in rows]


def sync_weights(run, stale):
    """Wake the engine and, when it is `stale` (it lacks the policy's current weights, or a discarding sleep dropped its
    weights), push the policy's weights, or its LoRA adapter (--lora.sync adapter) -> {"time/sync", "sync/bytes"}."""
    t0, tally = time.time(), {"bytes": 0}
    run.engine.wake_up()
    if stale or run.engine.needs_full_sync:
        run.engine.load_weights(weight_sync.engine_weights(run.policy, run.precision["sync"], tally=tally,
                                                           full=run.engine.needs_full_sync, adapter=run.engine.adapter))
    return {"time/sync": time.time() - t0, "sync/bytes": tally["bytes"]}


def rollouts(run, prompts, n, temperature, seeds):
    """n rollouts per prompt -> [[dict]]: row, completion_ids, engine_logps, truncated, text: one engine call, or
    multi-turn episodes with --data.tools / --env (episodes.py: they add completion_mask, turns, tool counts)."""
    cfg, tok = run.cfg, getattr(run.processor, "tokenizer", run.processor)
    if "episodes" in (hubs.hub_of(cfg.env)[0] or {}):  # the environment drives its episodes against the served engine
        return run.make_env(run.engine, tok, prompts, n=n, rollout_cfg=cfg.rollout,
                            temperature=temperature, printed=run.printed_errors)
    if run.tools or run.make_env:  # encode: an environment's first messages (env.reset) -> prompt ids, as any chat's
        encode = lambda row, messages: encode_prompt({**row, "prompt": messages}, run.processor,  # noqa: E731
                                                     cfg.rollout.max_prompt_length, True, cfg.data.system_prompt,
                                                     list(run.tools.values()) or None)["prompt_ids"]
        return episodes.run_episodes(run.engine, tok, prompts, n=n, seeds=seeds, rollout_cfg=cfg.rollout,
                                     temperature=temperature, tools=run.tools, make_env=run.make_env, tp=run.tp,
                                     encode=encode, printed=run.printed_errors)
    outs = run.engine.generate([p["engine"] for p in prompts], n=n, temperature=temperature, top_p=cfg.rollout.top_p,
                               top_k=cfg.rollout.top_k, max_tokens=cfg.rollout.max_completion_length, seeds=seeds)
    return [[{"row": p["row"], "completion_ids": c.token_ids, "engine_logps": c.logprobs, "truncated": c.truncated,
              "text": tok.decode(c.token_ids, skip_special_tokens=True),
              **({"engine_versions": c.versions} if c.versions is not None else {})} for c in o]
            for p, o in zip(prompts, outs)]


def generate(run, prompts, step, rnd=0):
    """G completions (or episodes) per prompt, each from its own random stream -> this rank's samples [N]."""
    cfg, G = run.cfg, run.cfg.num_generations
    seeds = rollout.completion_seeds(cfg.seed, f"{step}.{rnd}" if rnd else step, run.dp_rank * len(prompts),
                                     len(prompts), G)  # (the batch's place in the step's: any cut draws the same)
    outs = context_parallel.share_rollouts(run.cp_group, prompts, seeds,  # a context-parallel group: a share each
                                           lambda p, s: rollouts(run, p, G, cfg.rollout.temperature, s), run.tp)
    run.engine.sleep()
    distributed.release_memory()  # CPU: generation's freed buffers go back to the OS, so RSS stays flat across steps
    k = len(prompts) // run.batch_ranks
    lo = distributed.data_rank() % run.batch_ranks * k  # this rank's slice of its TP group's batch
    return [{"prompt_ids": p["prompt_ids"], **({"mm": p["mm"]} if "mm" in p else {}), **c}
            for p, o in zip(prompts[lo:lo + k], outs[lo:lo + k]) for c in o]  # [N = prompts * G]


def score(run, samples):
    """Rewards [N, K] (NaN: does not apply, raised, or the environment failed), global counts -> batching.Scored."""
    rewards, failed = context_parallel.from_first(run.cp_group, *scoring.score_rewards(
        run.reward_fns, [s["row"] for s in samples], [s["text"] for s in samples],
        [batching.model_ids(s) for s in samples], run.printed_errors))  # a context-parallel group: its first rank's
    broken = torch.tensor([s.get("env_error") is not None for s in samples], dtype=torch.bool)  # [N]
    rewards[broken] = float("nan")  # its environment raised or timed out: the episode has no reward
    n = distributed.global_sums({**{f"failed/{k}": f for k, f in enumerate(failed)}, "env_failed": broken.sum().item(),
                                 "samples": len(samples), "rm_truncated": scoring.take_rm_truncated(run.reward_fns)},
                                run.device)
    if all(n[f"failed/{k}"] == n["samples"] for k in range(len(failed))) or n["env_failed"] == n["samples"]:
        raise console.UserError("every reward function failed (raised, or returned NaN/inf) on every sample of this "
                                "step, or every episode's environment failed: stopping (see the messages above). Fix "
                                f"them, {checkpoints.go_on(run.cfg.output_dir)}.")
    failed_total = sum(n[f"failed/{k}"] for k in range(len(failed))) + n["env_failed"]
    return batching.Scored(samples, rewards, {"failed": failed_total, "rm_truncated": n["rm_truncated"]})


def dynamic_sampling_rounds(run, step, scored):
    """(collective) DAPO's dynamic sampling (arXiv 2503.14476): keep the informative groups and draw more rounds of
    prompts until the batch is full of them (dynamic_sampling.fill_batch) -> batching.Scored with dynamic_sampling/*."""
    def extra_round(rnd):  # round rnd of this step: new prompts, G completions each, rewards
        sync_weights(run, stale=False)  # wakes the engine
        more = score(run, generate(run, sample_prompts(run, step, rnd), step, rnd))
        return more.samples, more.rewards, more.counts
    t0 = time.time()
    got = dynamic_sampling.fill_batch(run, scored.samples, scored.rewards, scored.counts, extra_round)
    return batching.Scored(got["samples"], got["rewards"], got["counts"],
                           {**got["metrics"], "time/dynamic_sampling": time.time() - t0})


def serve_generator(run):
    """(--rollout.inference-ranks) A generator rank's whole run: inference_ranks.serve with this file's stages."""
    cfg = run.cfg
    return inference_ranks.serve(run, lambda step, t, rnd: sample_prompts(run, step, rnd, trainer=t),
                                 lambda prompts, seeds: rollouts(run, prompts, cfg.num_generations,
                                                                 cfg.rollout.temperature, seeds),
                                 lambda version, t: eval_rollouts(run, version - 1, t, run.link.n_data),
                                 functools.partial(score, run))


# ---- Stages 5-6: the training batch (old and reference log-probs, the critic's values), advantages over all ranks ----

def pad_id(run):
    return getattr(run.processor, "tokenizer", run.processor).pad_token_id


def model_inputs(run, batch, rows):
    """The model's inputs for `rows` of the batch (token_logprobs.collate; --policy.share-prompts packs them)."""
    return collate([batch.samples[i] for i in rows], pad_id(run), run.device, batch.T,
                   getattr(run.processor, "image_token_id", None), **run.packing)


@torch.no_grad()
def logps_of(run, module, batch, rows, with_entropy=False, truncate=True):
    """Per-token log-probs of `rows`' sampled tokens, no grad, no dropout (as the engine computes them), at the
    sampling settings (truncate=False: no top-k/p) -> {"logps": [len(rows), T], "entropies": [len(rows), T] or None}."""
    c, r, training = run.cfg, run.cfg.rollout, module.training
    k, p = (r.top_k, r.top_p) if truncate else (0, 1.0)
    module.eval()
    plan = batching.micro_batch_plan(torch.arange(len(rows)), None, c.micro_batch_size, run.device,
                                     c.micro_batch_tokens, [batch.samples[i] for i in rows.tolist()], run.packing)
    logps, entropies = [], []
    for mb, _ in plan:
        lp, ent = module(model_inputs(run, batch, rows[mb].tolist()), r.temperature, with_entropy=with_entropy,
                         top_k=k, top_p=p)  # [b, T] each
        logps.append((mb, lp))
        entropies.append((mb, ent))
    module.train(training)
    return {"logps": batching.in_order(logps), "entropies": batching.in_order(entropies) if with_entropy else None}


def reference_logps(run, batch, rows):
    """The reference policy's log-probs [len(rows), T], by models.build_reference's rule."""
    if run.ref_kind == "copy":
        return logps_of(run, run.ref_module, batch, rows)["logps"]
    if run.ref_kind == "disabled_adapter":  # PEFT: the base model is the reference
        with models.adapters_off(run.policy):
            return logps_of(run, run.module, batch, rows)["logps"]
    run.policy.set_adapter("reference")  # a frozen copy of the adapter we continue from
    lp = logps_of(run, run.module, batch, rows)["logps"]
    run.policy.set_adapter("default")  # PEFT marks the active adapter trainable: keep the reference frozen
    for n, p in run.policy.named_parameters():
        p.requires_grad_(p.requires_grad and ".reference." not in n)
    return lp


def old_and_ref_logps(run, samples):
    """The training batch: masks, the engine's log-probs, and only what the loss and the advantage estimator need of
    old / reference / teacher log-probs and the critic's values -> (batching.Batch, {"time/teacher"} or {})."""
    cfg = run.cfg
    batch = batching.build_batch(samples, cfg.rollout.mask_truncated_completions, run.device)
    everything = torch.arange(len(samples))
    lagging = cfg.rollout.inference_ranks and cfg.rollout.max_staleness > 0  # engine weights may be older: recompute
    if (cfg.num_iterations > 1 or cfg.steps_per_generation > 1 or ppo.kl_in_reward(cfg) or lagging
            or run.teacher_module is not None  # else old == current; a teacher compares them to its own
            or (cfg.lora.r or cfg.lora.adapter) and cfg.lora.dropout > 0):  # the sampler ratio needs no-dropout ones
        batch.old_logps = logps_of(run, run.module, batch, everything)["logps"]  # [N, T]
    if cfg.loss.beta != 0:
        batch.ref_logps = reference_logps(run, batch, everything)  # [N, T]
    t_teacher = time.time()
    if run.teacher_module is not None:  # --distill.teacher: its own distribution at the temperature (no top-k/p)
        batch.teacher_logps = logps_of(run, run.teacher_module, batch, everything, truncate=False)["logps"]  # [N, T]
    t_teacher = time.time() - t_teacher
    if run.critic:
        batch.old_values = ppo.values(run.critic, batch, cfg.micro_batch_size, pad_id(run), run.device,
                                      cfg.micro_batch_tokens)  # [N, T]
    return batch, ({"time/teacher": t_teacher} if run.teacher_module is not None else {})


def compute_advantages(run, rewards, batch):
    """Advantages from every rank's rewards -> {"fields": {Batch field: value}, "metrics"}: advantages [N] for
    grpo/rloo, [N, T] for reinforce_pp/gae (with returns, and the mask without unscorable rows: ppo.py)."""
    cfg, G, N = run.cfg, run.cfg.num_generations, rewards.shape[0]
    rewards = rewards.masked_fill(batch.topped_up[:, None], float("nan"))  # NaN everywhere: unscorable, advantage 0
    if cfg.advantage_estimator in ppo.TOKEN_ESTIMATORS:
        fields, more = ppo.token_level_advantages(cfg, rewards, run.weights, batch, run.kl_ctl.value, run.device)
        return {"fields": fields, "metrics": more}
    everyone = distributed.all_gather_cat(rewards.to(run.device)).cpu()  # [world * N, K], groups contiguous
    if cfg.advantage_estimator == "rloo":  # weighted sum; unscorable samples get 0 and stay out of the baseline
        adv = losses.rloo_advantages(metrics.sample_rewards(everyone, run.weights), G)
    else:  # GRPO, arXiv 2402.03300: (r - group mean) / (group std + eps), or GDPO's per-function normalisation
        adv = losses.group_advantages(everyone, run.weights, G, aggregation=cfg.reward_aggregation,
                                      scale=cfg.scale_rewards)
    mine = slice(distributed.data_rank() * N, (distributed.data_rank() + 1) * N)  # this (data-parallel) rank's rows
    return {"fields": {"advantages": adv[mine].to(run.device)}, "metrics": {}}  # [N]


def distill_advantages(run, batch):
    """(collective) On-policy distillation: each sampled token's advantage gains -coef (log p_student - log p_teacher),
    p_student the trainer's old log-probs as in slime's apply_opd_kl_to_advantages (docs/signal-and-losses.md), on top
    of the reward's ([N] becomes [N, T]) -> {"advantages": [N, T], "distill/reverse_kl": its global mean per token}."""
    cm = batch.completion_mask * (~batch.topped_up).to(batch.completion_mask)[:, None]  # [N, T] sampled tokens
    adv = batch.advantages.view(len(cm), -1) + losses.distill_advantages(
        batch.old_logps, batch.teacher_logps, cm, run.cfg.distill.coef)  # [N, T]
    n = distributed.global_sums({"kl": ((batch.old_logps - batch.teacher_logps) * cm).sum().item(),
                                 "tokens": cm.sum().item()}, run.device)
    return {"advantages": adv, "distill/reverse_kl": n["kl"] / max(n["tokens"], 1)}


# ---- Stage 7: policy updates, each on a minibatch cut into micro-batches (batching.py) ----

def minibatch_statistics(run, batch, rows, loss_cfg):
    """What the loss takes over the whole minibatch on all ranks: the top-entropy cut (arXiv 2506.01939) and the loss
    type's `statistics` (losses.LOSSES) -> {"threshold": float or None, "statistics": {name: [N, ...]: rows filled}}."""
    stats_of, q, mask = losses.loss_entry(loss_cfg)["statistics"], loss_cfg.top_entropy_quantile, batch.mask[rows]
    memo = {}

    def current_logps():  # this minibatch's log-probs (and entropies) before the update, computed once if asked for
        if not memo:
            memo.update(logps_of(run, run.module, batch, rows, with_entropy=q < 1))
        return memo["logps"]
    threshold = None
    if q < 1:  # width: all_gather needs one shape on every rank
        current_logps()
        threshold = losses.top_entropy_threshold(memo["entropies"], mask, q, distributed.all_gather_cat,
                                                 len(rows) * run.cfg.rollout.max_completion_length)
    if stats_of is None:
        return {"threshold": threshold, "statistics": {}}
    old, adv = batch.old_logps, batch.advantages[rows].view(len(rows), -1)  # [n, 1] or [n, T]
    got = stats_of(loss_cfg, current_logps, old if old is None else old[rows], adv, mask, distributed.all_gather_cat)
    return {"threshold": threshold, "statistics": {k: v.new_zeros((len(batch.mask), *v.shape[1:])).index_copy(
        0, rows.to(v.device), v) for k, v in got.items()}}  # {name: [N, ...]}


def idle_rows(run, batch, rows, loss_cfg, threshold, statistics):
    """[len(rows)] bool: rows with a zero advantage on every loss token whose log-probs and entropies policy_loss gives
    an all-zero gradient (autograd, at 8 fixed points: entropies of 1e-6, 0.3, 3 and 1e3 (x 1-2), and log-probs 0.01
    or 2 nats off the batch's: with old log-probs, ratios inside and outside any clip; a term acting only between those
    entropies is missed), so a KL term, an entropy bonus or KL-Cov's penalty keeps its rows training;
    accumulate_gradients checks their gradient at their real values and stops the run if the probe missed one. No row
    for image-text models (the weights a pass reaches depend on its rows)."""
    adv = batch.advantages[rows].view(len(rows), -1)  # [n, 1] or [n, T]
    zero = ((adv * batch.mask[rows]) == 0).all(-1).cpu()  # [n]
    if not zero.any() or getattr(run.processor, "image_token_id", None) is not None:
        return zero & False
    old = None if batch.old_logps is None else batch.old_logps[rows]
    base = batch.engine_logps[rows] if old is None else old  # [n, T]
    g, live = torch.Generator().manual_seed(0), torch.zeros(len(rows), dtype=torch.bool, device=base.device)
    for h, s in itertools.product((1e-6, 0.3, 3.0, 1e3), (0.01, 2.0)):
        lp = (base + (s * torch.randn(base.shape, generator=g, dtype=base.dtype)).to(base.device)).requires_grad_()
        ent = (h * (1 + torch.rand(base.shape, generator=g, dtype=base.dtype))).to(base.device).requires_grad_()
        loss, _ = losses.policy_loss(logps=lp, old_logps=old, advantages=batch.advantages[rows], mask=batch.mask[rows],
                                     cfg=loss_cfg, ref_logps=None if batch.ref_logps is None else batch.ref_logps[rows],
                                     sampler_logps=batch.engine_logps[rows], entropies=ent, entropy_threshold=threshold,
                                     statistics={k: v[rows] for k, v in statistics.items()})
        grads = torch.autograd.grad(loss, (lp, ent), allow_unused=True)
        live |= sum(((x if x is not None else torch.zeros_like(lp)) != 0).any(-1) for x in grads).bool()  # [n]
    return zero & ~live.cpu()  # (one host sync for the 8 points)


def accumulate_gradients(run, batch, rows, loss_cfg):
    """Forward + backward of one minibatch (`rows` of this rank) in micro-batches -> {"stats": global metrics,
    "trainer_logps": the trainer's log-probs [len(rows), T] before this update (None when the batch has old_logps)}."""
    dev, mask, r = run.device, batch.mask, run.cfg.rollout
    n = distributed.global_sums({"tokens": mask[rows].sum().item(),
                                 "sequences": len(rows) - batch.topped_up[rows.cpu()].sum().item()}, dev)
    minibatch = minibatch_statistics(run, batch, rows, loss_cfg)
    idle = idle_rows(run, batch, rows, loss_cfg, minibatch["threshold"], minibatch["statistics"])
    pick = lambda x, mb: x[mb] if x is not None else None  # noqa: E731
    per_pass, before, missed = [], [], 0  # before: the trainer's log-probs before this update (the mismatch check)
    for mb, backward in batching.micro_batch_plan(rows, idle, run.cfg.micro_batch_size, dev,
                                                  run.cfg.micro_batch_tokens, batch.samples, run.packing):
        with torch.set_grad_enabled(backward):
            lp, ent = run.module(model_inputs(run, batch, (rows[:1] if mb is None else mb).tolist()), r.temperature,
                                 with_entropy=True, top_k=r.top_k, top_p=r.top_p)  # per-token log-probs [b, T]
            if mb is None:  # a filler: as many forwards as the busiest rank
                continue
            if batch.old_logps is None:
                before.append((mb, lp.detach()))
        if not backward:  # idle rows: the loss must give them no gradient at their real log-probs and entropies
            lp, ent = lp.detach().requires_grad_(), ent.detach().requires_grad_()
        # the clipped surrogate, its aggregation over the minibatch's tokens or rows, the KL term (--loss.*)
        loss, loss_metrics = losses.policy_loss(
            logps=lp, old_logps=pick(batch.old_logps, mb), advantages=batch.advantages[mb], mask=mask[mb],
            cfg=loss_cfg, ref_logps=pick(batch.ref_logps, mb), sampler_logps=batch.engine_logps[mb], entropies=ent,
            num_items=n["tokens"] / run.world, num_rows=n["sequences"] / run.world,
            entropy_threshold=minibatch["threshold"], statistics={k: v[mb] for k, v in minibatch["statistics"].items()})
        loss.backward()  # (idle rows: into the detached leaves above only)
        if not backward:  # a gradient there is one idle_rows' probe missed (a device count: no host sync)
            missed = missed + sum(x.grad.nan_to_num(0).any(-1).sum() for x in (lp, ent) if x.grad is not None)
        per_pass.append({"loss": loss.detach(), "metrics": loss_metrics, "mask": mask[mb]})
    if distributed.global_sums({"missed": missed}, dev)["missed"]:  # (every rank raises)
        raise RuntimeError("the loss gives rows with a zero advantage a gradient that grpo.idle_rows' probe missed "
                           "(they ran forward only): a term of losses.policy_loss is flat where it asks. Add a probe "
                           "point there.")
    before = batching.in_order(before)[rows.argsort().argsort()] if before else None  # [n, T] in the order of rows
    return {"stats": metrics.minibatch_row(run, per_pass, loss_cfg), "trainer_logps": before}


def ptx_backward(run, update_index):
    """InstructGPT's ptx term (arXiv 2203.02155): --ptx.coef x the next-token NLL of a few texts, added to this
    update's gradient; a token mean over all ranks. -> {"ptx/loss": global NLL per token}."""
    cfg, n = run.cfg, run.cfg.ptx.batch_size
    start = (update_index * run.world + distributed.data_rank()) * n  # a context-parallel group: the same texts
    texts = [run.ptx[(start + i) % len(run.ptx)] for i in range(n)]
    samples = [{"prompt_ids": ids[:1], "completion_ids": ids[1:]} for ids in texts]
    mb = collate(samples, pad_id(run), run.device, max(len(t) for t in texts) - 1)
    lp, _ = run.module(mb, 1.0)  # [n, T]: the full softmax, no sampling transforms
    cm = mb["logprob_mask"].to(lp.dtype)
    n_tokens = distributed.global_sums({"tokens": cm.sum().item()}, run.device)["tokens"]
    nll = -(lp * cm).sum() / max(n_tokens / run.world, 1)  # FSDP2 averages over ranks
    (cfg.ptx.coef * nll).backward()
    return {"ptx/loss": distributed.global_sums({"nll": nll.item()}, run.device)["nll"] / run.world}


def check_mismatch(run, batch, trainer_logps):
    """Engine vs trainer log-probs [N, T] of the tokens the current weights sampled (all, colocated; token_fresh)
    before the first update -> mean abs nats (NaN when none is); --rollout.max-mismatch stops the run."""
    cm = batch.completion_mask * batch.fresh
    n = distributed.global_sums({"gap": ((trainer_logps - batch.engine_logps).abs() * cm).sum().item(),
                                 "tokens": cm.sum().item()}, run.device)
    mismatch = n["gap"] / n["tokens"] if n["tokens"] else float("nan")
    limit = run.cfg.rollout.max_mismatch
    if limit and n["tokens"] and mismatch > limit:
        raise RuntimeError(
            f"engine and trainer log-probs of the sampled tokens differ by {mismatch:.3g} nats on average "
            f"(--rollout.max-mismatch {limit}): the update would train on a wrong ratio. Likely causes: the engine "
            "has stale weights (a sync that did not reach it), the engine samples with settings the trainer does not "
            "apply (generation_config, logit processors, top-p/top-k), or a low-precision engine dtype. Fix it, or "
            "raise --rollout.max-mismatch (0 = off) if you accept the gap.")
    return mismatch


def update(run, batch, step):
    """num_iterations passes x steps_per_generation minibatches, one optimizer update each (stops early, a safe point,
    on SIGTERM) -> {"stats": per update, "logprob_mismatch/mean_abs", "changed": whether the weights moved}."""
    cfg, r = run.cfg, run.cfg.rollout
    # --loss.* as used: beta from the KL controller (0: the KL is in the reward); Dr. GRPO's denominator filled in
    loss_cfg = dataclasses.replace(cfg.loss, beta=0.0 if ppo.kl_in_reward(cfg) else run.kl_ctl.value,
                                   max_completion_length=cfg.loss.max_completion_length or r.max_completion_length)
    params = run.optimizer.param_groups[0]["params"]
    frozen = step < cfg.critic.freeze_actor_steps  # PPO warm-up: only the critic learns
    run.module.train()
    stats, mismatch, changed = [], float("nan"), False
    for k, rows in enumerate(batching.minibatches(len(batch.samples), cfg.num_generations, cfg.steps_per_generation,
                                                  cfg.num_iterations, cfg.seed + step)):
        got = accumulate_gradients(run, batch, rows, loss_cfg)
        s = got["stats"]
        if run.ptx:  # --ptx.dataset: a supervised term's gradient joins this update
            s.update(ptx_backward(run, step * cfg.steps_per_generation * cfg.num_iterations + k))
        if not stats:  # before the first update touches the weights. old_logps is None only when this step has one
            # update (on-policy), whose minibatch is every row in order (rows = arange(N)): trainer_logps is [N, T]
            # (with LoRA dropout old_logps is set: the dropout-free log-probs the engine's are compared with)
            mismatch = check_mismatch(run, batch, got["trainer_logps"] if batch.old_logps is None else batch.old_logps)
        if frozen:
            run.optimizer.zero_grad(set_to_none=True)
            grad_norm, skipped = 0.0, False
        else:
            grad_norm, skipped = optim.optimizer_step(params, run.optimizer, run.scheduler, cfg.optim.max_grad_norm,
                                                      s["loss"])
        if run.ema and not (skipped or frozen):  # --ema.decay
            optim.ema_update(run.ema, trainable(run.module), cfg.ema.decay)
        changed |= not (skipped or frozen)
        stats.append({**s, "grad_norm": grad_norm, "skipped_updates": float(skipped)})
        if checkpoints.preempted(run):
            break
    return {"stats": stats, "logprob_mismatch/mean_abs": mismatch, "changed": changed}


def update_critic(run, batch, step):
    """PPO's value function (--advantage-estimator gae): one update per policy minibatch -> its metrics."""
    cfg = run.cfg
    rows = batching.minibatches(len(batch.samples), cfg.num_generations, cfg.steps_per_generation, cfg.num_iterations,
                                cfg.seed + step)
    return ppo.update_critic(run.critic, batch, rows, cfg, pad_id(run), run.device, run.world)


# ---- Stages 8-9: metrics, evaluation, checkpoints ----

def evaluates_ema(run):
    """--eval.use-ema: evaluations generate with the EMA weights (the engine holds them after an evaluation)."""
    return run.cfg.eval.use_ema and run.ema is not None


def evaluate(run, step, stale):
    """Held-out prompts, generated with the policy (synced if the engine is `stale`) or its EMA -> eval/*
    (metrics.eval_row). The engine then holds the EMA (evaluates_ema) or the policy's current weights."""
    use_ema = evaluates_ema(run)
    if run.link:  # the inference ranks generate, with the weights after this step (version step + 1) or their EMA
        ema = trainable(run.module) if use_ema else None
        _, outs, sent = inference_ranks.evaluation_outputs(run, step + 1, ema)
    else:
        with optim.ema_weights(run.ema if use_ema else None, trainable(run.module)):
            sent = sync_weights(run, stale or use_ema)["sync/bytes"]  # a TP group generates together:
            outs = eval_rollouts(run, step, run.dp_rank, run.world // run.batch_ranks)
            run.engine.sleep()
    return metrics.eval_row(run, outs, sent)


def eval_rollouts(run, step, dp, n_dp):
    """Completions of held-out rows dp, dp + n_dp, ...: greedy, or n samples at the rollout temperature, each row's
    seeds keyed by its place among the held-out rows (the same draws however they are cut over ranks)."""
    cfg, n, places = run.cfg, run.cfg.eval.n_samples, range(dp, len(run.eval_rows), n_dp)
    enc = [{"row": run.eval_rows[i], **encode_prompt(run.eval_rows[i], run.processor, cfg.rollout.max_prompt_length,
            cfg.data.chat_template, cfg.data.system_prompt, list(run.tools.values()) or None)} for i in places]
    return rollouts(run, enc, n, 0.0 if n == 1 else cfg.rollout.temperature,
                    [rollout.completion_seeds(cfg.seed + 1, step, i, 1, n)[0] for i in places])


def save(run, steps_done):
    """(collective) checkpoint-<steps_done>: HF policy (+ critic/, ema/), sharded model + optimizer, RNG, state."""
    state = {"ds_extra_rounds": run.ds_extra_rounds, "kl_coef": run.kl_ctl.value,
             **({"critic_scheduler": run.critic["scheduler"].state_dict()} if run.critic else {})}
    critic = [lambda path: ppo.save_critic(run.critic, run.processor, path, run.rank)] if run.critic else []
    return checkpoints.save_run(run, steps_done, state, run.policy, run.processor, more_writes=critic,
                                save_merged=run.cfg.checkpoint.save_merged)


def maybe_checkpoint(run, steps_done):
    """Every --checkpoint.every steps, at the last step, on SIGTERM and after too many bad steps. -> stop now?"""
    stop = checkpoints.maybe_save(run, steps_done, save, run.cfg.max_bad_steps, "--max-bad-steps")
    if stop and run.rank == 0:
        print(f"SIGTERM: checkpoint written at step {steps_done}; exiting", flush=True)
    return stop


# ---- Main: the table of contents ----

def main(cfg: Config):
    t_start = time.time()
    run = setup(cfg)
    if run.link and run.link.role == "generator":  # --rollout.inference-ranks: this rank only generates
        return serve_generator(run)
    bar = console.start_logging(cfg, run.rank, run.start_step)  # rank 0: wandb and the progress bar
    stale = True  # the engine lacks the policy's current weights
    if run.eval_rows and run.start_step == 0:  # the baseline, before any update, logged as step 0
        row0 = {"step": 0, **evaluate(run, -1, stale)}  # every rank generates its share; rank 0 writes
        stale = evaluates_ema(run)  # it holds the EMA now
        if run.rank == 0:
            console.append_metrics(run.metrics_path, row0)

    for step in range(run.start_step, cfg.max_steps):
        t0, report = time.time(), {}  # what the stages report besides their results
        if run.link:  # ---- 1-4. inference ranks: push the weights as version `step`, take their batch of `step` ----
            scored = inference_ranks.trainer_batch(run, step, functools.partial(score, run))
        else:
            # ---- 1. sample prompts: each data-parallel rank its own; a group of G stays on one rank ----
            prompts = sample_prompts(run, step)
            # ---- 2. sync weights into the engine if it is stale ----
            report.update(sync_weights(run, stale))
            # ---- 3. generate G completions per prompt ----
            t_gen = time.time()
            samples = generate(run, prompts, step)
            report["time/generate"] = time.time() - t_gen
            # ---- 4. rewards [N, K] ----
            scored = score(run, samples)
            if cfg.dynamic_sampling:  # DAPO: groups whose rewards all agree make way for new prompts' groups
                scored = dynamic_sampling_rounds(run, step, scored)
        # ---- 5. the training batch: old and reference log-probs, the critic's values (only what is needed) ----
        batch, logp_metrics = old_and_ref_logps(run, scored.samples)
        # ---- 6. advantages over the global batch: group-normalised (grpo), leave-one-out, or per token ----
        advantages = compute_advantages(run, scored.rewards, batch)
        report.update(scored.metrics, **logp_metrics, **advantages["metrics"])
        batch = dataclasses.replace(batch, **advantages["fields"])
        if run.teacher_module is not None:  # --distill.teacher: minus the per-token reverse KL joins the advantages
            distilled = distill_advantages(run, batch)
            batch = dataclasses.replace(batch, advantages=distilled["advantages"])
            report["distill/reverse_kl"] = distilled["distill/reverse_kl"]
        # ---- 7. policy updates: num_iterations passes x steps_per_generation minibatches ----
        t_train = time.time()
        updated = update(run, batch, step)
        t_train = time.time() - t_train
        if len(updated["stats"]) < cfg.steps_per_generation * cfg.num_iterations:  # SIGTERM: resume reruns step
            maybe_checkpoint(run, step)
            break
        stale = updated["changed"]  # the weights moved
        run.ds_extra_rounds += report.get("dynamic_sampling/rounds", 1) - 1  # the next step's prompts follow them
        if run.critic:  # --advantage-estimator gae: the value function's update
            report.update(update_critic(run, batch, step))
        run.bad_steps = run.bad_steps + 1 if all(s["skipped_updates"] for s in updated["stats"]) else 0
        # ---- 8. log (and evaluate) ----
        times = {"time/train": t_train, "time/step": time.time() - t0}  # (time/sync, time/generate: in report)
        row = {**metrics.step_row(run, step, batch, scored, updated["stats"], times), **report,
               "logprob_mismatch/mean_abs": updated["logprob_mismatch/mean_abs"]}
        if run.eval_rows and (step + 1) % eval_every(cfg) == 0:
            row.update(evaluate(run, step, stale))
            stale = evaluates_ema(run)
        run.kl_ctl.update(row.get("kl", 0.0), 1)  # --kl-target: the adaptive controller
        dynamic_sampling.hint_if_no_signal(run, row["frac_zero_std"])
        metrics.log_step(run, row, batch, scored, bar)
        # ---- 9. checkpoint; stop on preemption or repeated bad steps ----
        if maybe_checkpoint(run, step + 1):
            break

    if run.link:  # the generators leave when the trainers do (the end, or a safe stop)
        inference_ranks.stop_generators(run)
    if bar:
        bar.close()
    if run.rank == 0:  # with evaluations: the held-out accuracy before -> after, and the best constant answer's
        name, check = scoring.eval_check(cfg, run.reward_fns)
        console.print_done(run.metrics_path, t_start, scoring.best_constant_accuracy(run.eval_rows, check), name)
    if not isinstance(run.engine, rollout.VLLMEngine):  # vLLM's exit hook tears down its groups and the world itself
        dist.destroy_process_group()


if __name__ == "__main__":
    console.run_script(main, tyro.cli(Config))
