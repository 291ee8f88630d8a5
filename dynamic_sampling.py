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


def fill_batch(run, samples, rewards, counts, draw, pools=None, n_pools=None):
    """(collective) Per pool (a trainer's batch; pools: each of this rank's groups' pool of n_pools, by default pool r
    on rank r), keep the first informative groups in (round, rank, position) order, as verl's recipe/dapo keeps the
    first of its generation batches; while any pool is short, draw(rnd) -> (samples, rewards, counts: grpo.score's)
    another round (all ranks alike, at most --dynamic-sampling-max-rounds); then top each pool up with its first
    uninformative groups, flagged `top_up` (out of the loss and every statistic), spread evenly among the kept ones.
    -> {"samples": pool by pool, "rewards", "counts": summed over the rounds, "metrics", "sizes": {pool: this rank's
    samples of it}}."""
    cfg, G, rank, world = run.cfg, run.cfg.num_generations, dist.get_rank(), dist.get_world_size()
    pools = [rank] * (len(samples) // G) if pools is None else pools
    n_pools = world if n_pools is None else n_pools
    groups, tallies = [], []  # (round, pool, good, samples, rewards); per round [world, n_pools, (good, spare)]

    def sort(ss, rs, rnd):
        tally = torch.zeros(world, n_pools, 2, dtype=torch.float64)
        for i, (pool, good) in enumerate(zip(pools, informative_groups(rs, run.weights, G).tolist())):
            groups.append((rnd, pool, good, ss[i * G:(i + 1) * G], rs[i * G:(i + 1) * G]))
            tally[rank, pool, int(not good)] += 1
        tallies.append(distributed.all_reduce(tally, run.device))  # one small all-reduce per round

    sort(samples, rewards, 0)
    need = tallies[0].sum((0, 2))  # [n_pools] round 0 draws each pool's groups once
    rnd = 1
    while rnd < cfg.dynamic_sampling_max_rounds and (sum(tallies)[:, :, 0].sum(0) < need).any():
        more, more_rewards, more_counts = draw(rnd)
        counts = {k: v + more_counts[k] for k, v in counts.items()}
        sort(more, more_rewards, rnd)
        rnd += 1
    flat = torch.stack(tallies).view(-1, n_pools, 2)  # [rounds * world, n_pools, 2] in (round, rank) order
    filled = need - flat[:, :, 0].sum(0).clamp(max=need)  # [n_pools] top-up groups
    # [rounds * world, n_pools, 2] how many groups each (round, rank) may add: the pool's need less those ahead of it
    take = torch.stack([need, filled], -1) - (flat.cumsum(0) - flat)
    chosen = {}
    for r, pool, good, ss, rs in groups:
        if take[r * world + rank, pool, int(not good)] > 0:
            take[r * world + rank, pool, int(not good)] -= 1
            for s in ss:  # (the round: a trainer fed by several engines puts their groups in the colocated order)
                s.update(ds_round=r, **({} if good else {"top_up": True}))
            chosen.setdefault(pool, ([], []))[int(not good)].append((ss, rs))
    out = [g for _, (keep, fill) in sorted(chosen.items()) for g in spread(keep, fill)]
    metrics = {"frac_zero_std": float(tallies[0][:, :, 1].sum() / need.sum()), "dynamic_sampling/rounds": rnd,
               "dynamic_sampling/masked_groups": float(filled.sum())}
    return {"samples": [s for g in out for s in g[0]], "rewards": torch.cat([g[1] for g in out] or [rewards[:0]]),
            "counts": counts, "metrics": metrics,
            "sizes": {pool: G * (len(keep) + len(fill)) for pool, (keep, fill) in chosen.items()}}


def fill_on_generator(run, samples, score, draw, pools):
    """(generators, collective among them; --rollout.inference-ranks) fill_batch on an engine's share of the step,
    pooled per trainer over the engines that hold its prompts (pools: each group's trainer; counts per round over
    distributed.CONTROL_GROUP): the groups the colocated rule keeps. The engine's leader scores (grpo.score) and
    keeps; its other TP ranks generate along (draw(rnd) -> round rnd's samples) and score nothing. -> (samples, each
    with its "rewards" [K]; {"counts": summed over the rounds, "dynamic_sampling": the metrics}; {trainer: samples})."""
    lead = run.rank % run.tp == 0
    samples, pools = (samples, pools) if lead else ([], [])
    first = score(samples)  # a batching.Scored

    def more(rnd):
        ss = draw(rnd)  # every TP rank of the engine generates (the engine's collective)
        got = score(ss if lead else [])
        return ss if lead else [], got.rewards, got.counts
    t0 = time.time()  # time/dynamic_sampling: the extra rounds, as colocated
    got = fill_batch(run, samples, first.rewards, first.counts, more, pools, run.link.n_data)
    samples, metrics = got["samples"], got["metrics"]
    run.ds_extra_rounds += metrics["dynamic_sampling/rounds"] - 1  # the next step's prompts follow them
    for s, r in zip(samples, got["rewards"].tolist()):
        s["rewards"] = r
    metrics["time/dynamic_sampling"] = time.time() - t0
    return samples, {"counts": got["counts"], "dynamic_sampling": metrics}, got["sizes"]


def colocated_order(samples, G):
    """(trainers) The groups that the engines serving this trainer kept and topped up, engine by engine, in the
    colocated batch's order: the kept ones by (round, engine, position), the top-ups likewise, spread among them."""
    groups = [samples[i:i + G] for i in range(0, len(samples), G)]
    keep, fill = ([g for g in groups if bool(g[0].get("top_up")) == m] for m in (False, True))
    chosen = spread(*(sorted(x, key=lambda g: g[0]["ds_round"]) for x in (keep, fill)))  # (a stable sort)
    return [{k: v for k, v in s.items() if k != "ds_round"} for g in chosen for s in g]


def received(samples, metrics):
    """(trainers) A batch the generators scored and filled (fill_on_generator) -> (rewards [N, K], counts); their
    metrics stay in `metrics`."""
    return torch.tensor([s.pop("rewards") for s in samples], dtype=torch.float32), metrics.pop("counts")


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
