"""dynamic_sampling.py: which groups carry a learning signal, for grpo.py: DAPO's dynamic sampling (keep the groups
whose rewards differ, generate for more prompts until the batch is full of them) and the console hint when no group
has had a signal for several steps.

Extra rounds take the next blocks of the data order: step s, round r reads block s + (extra rounds of the steps before
s) + r, so no prompt is drawn twice before the data runs out, whatever --max-steps is, and a checkpoint that stores
the count of extra rounds resumes on the same prompts.
"""
import time

import torch
import torch.distributed as dist

import distributed


def informative_groups(rewards, weights, group_size):
    """Does each group have a learning signal? rewards [N, K] (NaN = does not apply) -> bool [N / G]: its weighted
    totals over the samples with a finite one (at least two of them) differ."""
    # DAPO, arXiv 2503.14476: filter out groups whose accuracy is all 0 or all 1 (std = 0: zero advantage)
    total = (rewards * torch.tensor(weights, dtype=rewards.dtype)).nansum(-1)  # [N]; inf stays inf
    x = total.masked_fill(rewards.isnan().all(-1) | ~total.isfinite(), float("nan")).view(-1, group_size)  # [groups, G]
    n = x.isfinite().sum(-1)
    dev = (x - x.nanmean(-1, keepdim=True)).nan_to_num(0)
    std = (dev.square().sum(-1) / (n - 1).clamp(min=1)).sqrt()  # Bessel, like the advantages' group std
    return (n >= 2) & (std > 1e-6)


def fill_batch(run, samples, rewards, counts, draw):
    """(collective) Keep the informative groups; while any rank is short of a full batch of them, draw(rnd) ->
    (samples, rewards, counts: grpo.score's) another round (all ranks run the same rounds, at most --dynamic-sampling-max-rounds);
    then top up with uninformative groups flagged `masked`, which leave the loss and every statistic, spread evenly
    among the kept ones.
    -> (samples, rewards, counts summed over the rounds, metrics)."""
    cfg, G, dev = run.cfg, run.cfg.num_generations, run.device
    n_groups = len(samples) // G
    keep, spare = [], []

    def sort(ss, rs):
        for i, good in enumerate(informative_groups(rs, run.weights, G).tolist()):
            (keep if good else spare).append((ss[i * G:(i + 1) * G], rs[i * G:(i + 1) * G]))

    sort(samples, rewards)
    zero = distributed.global_sums({"spare": len(spare), "groups": n_groups}, dev)
    rnd = 1
    while (rnd < cfg.dynamic_sampling_max_rounds  # (a rank that scores nothing, n_groups = 0, is never short)
           and distributed.global_sums({"short": n_groups - len(keep)}, dev, dist.ReduceOp.MAX)["short"] > 0):
        more, more_rewards, more_counts = draw(rnd)
        counts = {k: v + more_counts[k] for k, v in counts.items()}
        sort(more, more_rewards)
        rnd += 1
    filled = max(0, n_groups - len(keep))
    for g in spare[:filled]:
        for s in g[0]:
            s["masked"] = True
    chosen = spread(keep[:n_groups], spare[:filled])
    metrics = {"frac_zero_std": zero["spare"] / zero["groups"], "dynamic_sampling/rounds": rnd,
               **distributed.global_sums({"dynamic_sampling/masked_groups": filled}, dev)}
    return [s for g in chosen for s in g[0]], torch.cat([g[1] for g in chosen] or [rewards[:0]]), counts, metrics


def fill_on_generator(run, samples, score, draw):
    """(generators, collective among them; --rollout.inference-ranks) fill_batch on an engine's share of the step,
    with the colocated rounds and rule: each round every generator draws the next block of the data order, all run
    the same rounds. The engine's leader scores (grpo.score) and keeps; its other TP ranks generate along and score
    nothing. draw(rnd) -> round rnd's samples. -> (samples, each with its "rewards" [K], and for the batch's
    message: {"counts": grpo.score's summed over the rounds, "dynamic_sampling": fill_batch's metrics})."""
    lead = run.rank % run.tp == 0
    samples = samples if lead else []
    rewards, counts = score(samples)

    def more(rnd):
        ss = draw(rnd)  # every TP rank of the engine generates (the engine's collective)
        ss = ss if lead else []
        return (ss, *score(ss))
    t0 = time.time()  # time/dynamic_sampling: the extra rounds, as colocated
    samples, rewards, counts, metrics = fill_batch(run, samples, rewards, counts, more)
    run.ds_extra_rounds += metrics["dynamic_sampling/rounds"] - 1  # the next step's prompts follow them
    for s, r in zip(samples, rewards.tolist()):
        s["rewards"] = r
    return samples, {"counts": counts, "dynamic_sampling": {**metrics, "time/dynamic_sampling": time.time() - t0}}


def received(samples, metrics):
    """(trainers) A batch the generators scored and filled (fill_on_generator) -> (rewards [N, K], counts); their
    metrics stay in `metrics`."""
    return torch.tensor([s.pop("rewards") for s in samples], dtype=torch.float32), metrics.pop("counts")


def in_batch(batch, rewards, dev):
    """(collective) The step's statistics leave the top-up rows out: -> this rank's other samples, their rewards
    [n, K], every rank's weighted totals [n_all], and completion_mask [n, T], lens [n], truncated [n]. A step whose
    every group on every rank is a top-up (nothing trains) reports them all, rather than no numbers."""
    samples, kept = batch.samples, ~batch.topped_up  # [N]
    total = torch.tensor([s["reward"] for s in samples])  # [N] weighted
    everyone, everyone_kept = (distributed.all_gather_cat(x.to(dev)).cpu() for x in (total, kept))  # [world * N]
    if not everyone_kept.any():
        kept, everyone_kept = torch.ones_like(kept), torch.ones_like(everyone_kept)
    rows = kept.nonzero().flatten()
    return ([samples[i] for i in rows.tolist()], rewards[rows], everyone[everyone_kept],
            *(x[rows.to(x.device)] for x in (batch.completion_mask, batch.lens, batch.truncated)))


def spread(keep, fill):
    """The kept groups in order with the `fill` top-up groups at evenly spaced places (j * n // len(fill)), so that
    every minibatch of --steps-per-generation gets its share of informative groups (deterministic: resume is exact)."""
    n = len(keep) + len(fill)
    at, k, f = {j * n // len(fill) for j in range(len(fill))}, iter(keep), iter(fill)
    return [next(f) if i in at else next(k) for i in range(n)]


def hint_if_no_signal(run, frac_zero_std, steps=3):
    """Rank 0, once per run: when the run's first `steps` steps had no group whose rewards differed (frac_zero_std 1.0:
    with grpo/rloo every advantage is 0, nothing trains), say so and what to try."""
    if run.cfg.advantage_estimator not in ("grpo", "rloo") or run.cfg.distill.teacher:  # a signal without groups
        return
    if frac_zero_std < 1.0:  # a run that had a signal is learning: a later lull (a sharpened policy) is not this case
        run.printed_errors.add("no_signal")
    run.no_signal_steps = run.no_signal_steps + 1 if frac_zero_std >= 1.0 else 0
    if run.no_signal_steps != steps or run.rank != 0 or "no_signal" in run.printed_errors:
        return
    run.printed_errors.add("no_signal")
    print(f"warning: for {steps} steps no group had a learning signal (frac_zero_std = 1.0: every completion of a "
          "prompt got the same reward, so every advantage is 0 and the policy does not move). Try: check the rewards "
          "on a few completions (--log.completions-every 1), more completions per prompt (--num-generations) or a "
          "higher --rollout.temperature, an easier dataset or a stronger model, a reward with partial credit, or "
          "--dynamic-sampling.", flush=True)
