"""metrics.py: what a step reports, global over ranks: an update's loss metrics from its micro-batch passes, the step's
row (metrics.jsonl, wandb; dynamic sampling's top-up rows left out) and console line, the held-out evaluation's eval/*
row. Every key: docs/metrics.md.
"""
import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import batching
import console
import distributed
import dynamic_sampling
import episodes
import scoring


@dataclass
class EvalConfig:
    every: int | None = None
    """Evaluate on held-out prompts every this many steps and at step 0 (0 = never; default: at step 0 and the end
    when the dataset has an evaluation split: a built-in task's, or --data.eval-split)."""
    num_prompts: int = 64
    """Held-out prompts per evaluation (split across ranks)."""
    n_samples: int = 1
    """1 = greedy (temperature 0); >1 = sample this many at the rollout temperature and report pass@1."""
    use_ema: bool = False
    """Evaluate the EMA of the policy (--ema.decay > 0) instead of the live weights."""
    reward: str | None = None
    """The held-out check: one of --data.rewards (a score of 1 is a right answer). Default: a built-in task's own
    check, else the first of --data.rewards."""


def step_row(run, step, batch, scored, stats, times):
    """One metrics.jsonl row: global over ranks; update stats averaged over the step's updates. Top-up rows left out."""
    cfg, dev, G = run.cfg, run.device, run.cfg.num_generations
    everyone = distributed.all_gather_cat(scored.rewards.to(dev)).cpu()  # [world * N, K]
    signal = dynamic_sampling.informative_groups(everyone, run.weights, G)
    kept = in_batch(batch, scored.rewards, run.weights, dev)
    samples, rewards = kept["samples"], kept["rewards"]
    n = distributed.global_sums({
        **{f"{name}/sum": rewards[:, k].nansum().item() for k, (name, _) in enumerate(run.reward_fns)},
        **{f"{name}/count": (~rewards[:, k].isnan()).sum().item() for k, (name, _) in enumerate(run.reward_fns)},
        **{key: sum(s.get(key, 0) for s in samples) for key in ("turns", "tool_calls", "tool_errors", "tool_time_s")},
        "unfinished": sum(s.get("ended") in episodes.UNFINISHED for s in samples),
        "model_tokens": kept["completion_mask"].sum().item(), "completion_tokens": kept["lens"].sum().item(),
        "truncated": kept["truncated"].sum().item(), "samples": len(samples),
        "prompt_tokens": sum(len(s["prompt_ids"]) for s in samples[::G])}, dev)  # each prompt once
    rs = kept["everyone"]  # [n] the scored samples' rewards: an unscored one is in no reward mean (none: NaN)
    row = {"step": step + 1, "reward/mean": rs.mean().item(), "reward/std": rs.std().item() if len(rs) > 1 else math.nan,
           **{f"reward/{name}/mean": n[f"{name}/sum"] / n[f"{name}/count"] if n[f"{name}/count"] else math.nan
              for name, _ in run.reward_fns},
           "reward/failed": scored.counts["failed"], "frac_zero_std": 1 - signal.float().mean().item(),
           "frac_zero_std/in_loss": in_loss_zero_std(signal, batch.mask, G, dev),
           "completion_len/mean": n["model_tokens"] / n["samples"],
           "completion_len/clipped_frac": n["truncated"] / n["samples"],
           **{k: float(np.mean([s[k] for s in stats])) for k in stats[0] if k != "skipped_updates"},
           "skipped_updates": sum(s["skipped_updates"] for s in stats), "lr": run.scheduler.get_last_lr()[0],
           "bad_steps": run.bad_steps, **times, "tokens_per_s": (n["completion_tokens"] + n["prompt_tokens"])
           / times["time/step"], "mem/peak_gb": distributed.peak_mem_gb(dev),
           **({"kl_coef": run.kl_ctl.value} if cfg.loss.beta else {})}
    if any(name.startswith("rm:") for name, _ in run.reward_fns):
        row["reward/rm_truncated"] = scored.counts["rm_truncated"]
    if run.tools or run.make_env:  # multi-turn: model turns and tool calls per episode, errors in all
        row.update({"turns/mean": n["turns"] / n["samples"], "tool_calls/mean": n["tool_calls"] / n["samples"],
                    "tool_errors": n["tool_errors"], "tool_time_s": n["tool_time_s"] / n["samples"],
                    "episodes/unfinished_frac": n["unfinished"] / n["samples"]})
    return row


def in_loss_zero_std(signal, mask, G, dev):
    """(collective) Among the groups that reach the loss (any unmasked token), the fraction with no learning signal."""
    in_loss = distributed.all_gather_cat((mask.sum(-1) > 0).to(dev)).cpu().view(-1, G).any(-1)  # [groups]
    return (~signal & in_loss).sum().item() / max(in_loss.sum().item(), 1)


def minibatch_row(run, per_pass, loss_cfg):
    """(collective) One update's metrics from every rank's micro-batch passes [{"loss", "metrics", "mask"}]: the
    minibatch's loss (summed over passes, averaged over ranks) and each policy_loss metric, a weighted mean by what it
    is a mean over (metric_weight), or the min / max of */min, */max."""
    sums, extremes, dev = {"loss": sum(p["loss"].double() for p in per_pass)}, {}, run.device
    for p in per_pass:
        for k, v in p["metrics"].items():
            v = v.double()
            if k.endswith(("/min", "/max")):
                extremes[k] = (torch.minimum if k.endswith("/min") else torch.maximum)(extremes.get(k, v), v)
            else:  # a weighted sum and its weight: the global value is their ratio
                w = metric_weight(k, loss_cfg, p["mask"])
                sums[k], sums[k + "/weight"] = sums.get(k, 0.0) + v * w, sums.get(k + "/weight", 0.0) + w
    totals = distributed.global_sums(sums, dev)  # NaN on any rank shows in the loss
    out = {"loss": totals["loss"] / run.world,
           **{k: totals[k] / max(totals[k + "/weight"], 1) for k in sums if k != "loss" and not k.endswith("/weight")}}
    for op, suffix in ((dist.ReduceOp.MIN, "/min"), (dist.ReduceOp.MAX, "/max")):
        out.update(distributed.global_sums({k: v for k, v in extremes.items() if k.endswith(suffix)}, dev, op))
    return out


def metric_weight(key, loss_cfg, mask):
    """What a policy_loss metric is a mean over: tokens, or sequences with tokens (rows in the loss)."""
    per_row = (key.startswith("off_policy_mask")
               or (key.startswith(("clip_ratio", "ratio/")) and loss_cfg.importance_sampling_level == "sequence")
               or (key.startswith("sampler_ratio") and loss_cfg.sampler_correction.startswith("sequence")))
    return ((mask.sum(-1) > 0).sum() if per_row else mask.sum()).double()


def in_batch(batch, rewards, weights, dev):
    """(collective) The step's statistics leave the top-up rows out: -> {"samples": this rank's others, "rewards":
    theirs [n, K], "everyone": every rank's rewards [n_all] (sample_rewards; the unscored left out), "completion_mask"
    [n, T], "lens" [n], "truncated" [n]}. A step whose every group on every rank is a top-up (nothing trains) reports
    them all, rather than no numbers."""
    samples, kept = batch.samples, ~batch.topped_up  # [N]
    everyone, everyone_kept = (distributed.all_gather_cat(x.to(dev)).cpu()
                               for x in (sample_rewards(rewards, weights), kept))  # [world * N]
    if not everyone_kept.any():
        kept, everyone_kept = torch.ones_like(kept), torch.ones_like(everyone_kept)
    rows, everyone = kept.nonzero().flatten(), everyone[everyone_kept]
    return {"samples": [samples[i] for i in rows.tolist()], "rewards": rewards[rows],
            "everyone": everyone[~everyone.isnan()],
            **{k: getattr(batch, k)[rows.to(getattr(batch, k).device)] for k in ("completion_mask", "lens", "truncated")}}


def sample_rewards(rewards, weights):
    """Rewards [N, K] -> [N]: each sample's weighted sum over the functions that scored it; NaN where none did (an
    unscored sample: advantage 0, left out of reward/mean and reward/std, nan in the completions table)."""
    total = (rewards * torch.tensor(weights, dtype=rewards.dtype)).nansum(-1)  # [N]
    return total.masked_fill(rewards.isnan().all(-1), float("nan"))


def log_episodes(run, step, samples, totals):
    """(collective) --log.episodes-every: every rank's episodes of the step, appended by rank 0 to episodes.jsonl."""
    mine = [{"step": step, "reward": None if math.isnan(t) else t, "ended": s["ended"],
             "turns": s.get("turns"), "truncated": s["truncated"], "env_error": s.get("env_error"),
             "row": {k: v for k, v in s["row"].items() if k not in ("prompt", "image")}, "messages": s["messages"],
             **({"top_up": True} if s.get("top_up") else {})} for s, t in zip(samples, totals)]
    if run.cp_group is not None and dist.get_rank(run.cp_group) != 0:
        return  # the first rank of its context-parallel group holds the same episodes
    everyone = [None] * run.world if run.rank == 0 else None
    dist.gather_object(mine, everyone, dst=0, group=distributed.DATA_GROUP)
    if run.rank == 0:
        with open(os.path.join(run.cfg.output_dir, "episodes.jsonl"), "a") as f:
            f.writelines(json.dumps(e, default=str) + "\n" for rank in everyone for e in rank)


def log_step(run, row, batch, scored, bar):
    """metrics.jsonl, a stdout line, wandb, and every few steps a table of completions (rank 0) and the episodes."""
    cfg = run.cfg
    if cfg.log.episodes_every and row["step"] % cfg.log.episodes_every == 0:
        log_episodes(run, row["step"], batch.samples, sample_rewards(scored.rewards, run.weights).tolist())
    if run.rank != 0:
        return
    by_fn = " (" + ", ".join(f"{n} {row[f'reward/{n}/mean']:.3f}" for n, _ in run.reward_fns) + ")"  # each function's
    gap = row["logprob_mismatch/mean_abs"]  # NaN when every token is stale (inference ranks): the probe's, if any
    gap = row.get("async/probe_mismatch") if math.isnan(gap) else gap
    line = (f"step {row['step']}/{cfg.max_steps} reward {row['reward/mean']:.3f}{by_fn if len(run.reward_fns) > 1 else ''} "
            f"loss {row['loss']:.4f} len {row['completion_len/mean']:.1f} clip {row['clip_ratio/region']:.3f} "
            + ("" if gap is None else f"mismatch {gap:.1e} ") + f"{row['time/step']:.2f}s/step "
            f"{row['tokens_per_s']:.0f} tok/s"
            + "".join(f" eval {k[5:]} {row[k]:.3f}" for k in ("eval/accuracy", "eval/pass@1") if k in row))
    console.log_row(run.metrics_path, row, line, bar, cfg.wandb.mode)
    if cfg.log.completions_every and row["step"] % cfg.log.completions_every == 0:
        totals = sample_rewards(scored.rewards, run.weights).tolist()  # [N] each sample's reward, NaN: unscored
        console.print_completions([{**s, "reward": r} for s, r in zip(batch.samples, totals)], batch.advantages,
                                  cfg.wandb.mode, row["step"], cfg.num_generations)


def eval_row(run, outs, sync_bytes):
    """(collective) This rank's held-out completions [[dict]] -> eval/reward (with the reward weights), eval/accuracy
    (greedy) or eval/pass@1 from the task's accuracy function alone (a format hit is not a correct answer)."""
    cfg, n = run.cfg, run.cfg.eval.n_samples
    scorer = run.rank % run.tp == 0  # one rank per TP group scores
    done = [c for o in outs for c in o] if scorer else []
    ids, texts, rows = [batching.model_ids(c) for c in done], [c["text"] for c in done], [c["row"] for c in done]
    fns = run.reward_fns + [("_accuracy", scoring.eval_check(cfg, run.reward_fns)[1])]  # --eval.reward's check
    # every scoring rank calls the rewards, rows or not: a sharded reward model's forward is a collective
    r = scoring.score_rewards(fns, rows, texts, ids, run.printed_errors)[0] if scorer else torch.zeros(0, len(fns))
    scoring.take_rm_truncated(fns)  # reward/rm_truncated counts the training samples' texts only
    weighted = sample_rewards(r[:, :-1], run.weights)  # [n] NaN: unscored, left out as in reward/mean
    s = distributed.global_sums({"reward": weighted.nansum().item(), "scored": (~weighted.isnan()).sum().item(),
                                 "correct": (r[:, -1] >= 1.0 - 1e-6).sum().item(), "rows": len(rows)}, run.device)
    return {"eval/reward": s["reward"] / s["scored"] if s["scored"] else math.nan, "eval/sync_bytes": sync_bytes,
            ("eval/pass@1" if n > 1 else "eval/accuracy"): s["correct"] / max(s["rows"], 1)}
