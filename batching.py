"""batching.py: the records the stages hand on, and how an update cuts the training batch.

`Scored` is what stages 1-4 hand on (samples and rewards). `Batch` holds every tensor the stages after them read:
grpo.old_and_ref_logps builds it (masks, the engine's log-probs, then the trainer's old and reference log-probs and
the critic's values as needed), and grpo.main puts in the advantages grpo.compute_advantages (and with a teacher
grpo.distill_advantages) returns, with dataclasses.replace. Nothing else writes to it. An update trains on
`minibatches` of its rows, each run on every rank as the passes `micro_batch_plan` lays out.

Example, one rank, G = 2, two prompts, completions of 3, 1, 2 and 2 tokens (T = 3):

    completion_mask  [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]]   padding is 0
    mask             the same, with a truncated row zeroed under --rollout.mask-truncated-completions
    advantages       [0.71, -0.71, 0.0, 0.0]                         grpo: one per sample; gae: [N, T]
"""
import itertools
from dataclasses import dataclass, field

import torch

import distributed
import token_logprobs


@dataclass
class Batch:
    """This rank's samples of one step as tensors: N samples (groups of G contiguous), T their longest completion."""
    samples: list  # N dicts from grpo.generate: row, prompt_ids, completion_ids, engine_logps, truncated, text
    # (+ mm: image inputs; completion_mask, turns, tool_calls, ...: episodes.py; top_up: a dynamic-sampling filler,
    # ds_round: the round that drew it; staleness, engine_versions: inference ranks)
    completion_mask: torch.Tensor  # [N, T] 1 on tokens the model wrote; 0 on padding and inserted tool/env tokens
    mask: torch.Tensor  # [N, T] the loss's tokens: completion_mask without truncated rows (with
    # --rollout.mask-truncated-completions), top-up rows, and unscorable rows of the token-level estimators
    engine_logps: torch.Tensor  # [N, T] log-probs the engine sampled each token with (the behaviour policy)
    truncated: torch.Tensor  # [N] bool: stopped by a length limit, not by the model
    fresh: torch.Tensor  # [N, T] 1.0 at tokens the current weights sampled (all, colocated; token_fresh)
    old_logps: torch.Tensor | None = None  # [N, T] the trainer's before this step's updates; None: on-policy, one update
    # (and no teacher)
    ref_logps: torch.Tensor | None = None  # [N, T] the reference policy's (--loss.beta != 0)
    teacher_logps: torch.Tensor | None = None  # [N, T] the teacher's, at the sampling settings (--distill.teacher)
    old_values: torch.Tensor | None = None  # [N, T] the critic's V(s_t) before its update (--advantage-estimator gae)
    advantages: torch.Tensor | None = None  # [N] (grpo, rloo) or [N, T] (reinforce_pp, gae, and with a teacher)
    returns: torch.Tensor | None = None  # [N, T] the critic's targets (gae)

    @property
    def T(self):
        return self.completion_mask.shape[1]

    @property
    def lens(self):  # [N] completion tokens, inserted ones included
        return torch.tensor([len(s["completion_ids"]) for s in self.samples])

    @property
    def topped_up(self):  # [N] bool: dynamic sampling's filler rows, outside every statistic
        return torch.tensor([bool(s.get("top_up")) for s in self.samples], dtype=torch.bool)


@dataclass
class Scored:
    """Stages 1-4's result on this rank: the samples and their rewards."""
    samples: list  # N dicts (groups of G contiguous): row, prompt_ids, completion_ids, engine_logps, truncated, text
    # (+ mm: image inputs; completion_mask, turns, tool_calls, ...: episodes.py; top_up: dynamic sampling's filler)
    rewards: torch.Tensor  # [N, K] one column per reward function; NaN = does not apply, raised, or no episode reward
    counts: dict  # global counts of this step's samples: {"failed": a reward or environment failed, "rm_truncated"}
    metrics: dict = field(default_factory=dict)  # dynamic_sampling/*, async/*, ... : what stages 1-4 report


def model_ids(sample):
    """The ids the model wrote (inserted tool/environment tokens left out): what rewards see as completion_ids."""
    mask = sample.get("completion_mask")
    return sample["completion_ids"] if mask is None else [t for t, m in zip(sample["completion_ids"], mask) if m]


def build_batch(samples, mask_truncated, device):
    """The samples' padded tensors -> Batch (no log-probs of the trainer yet)."""
    T = max(1, max(len(s["completion_ids"]) for s in samples))
    pad = lambda xs: list(xs) + [0.0] * (T - len(xs))  # noqa: E731 (one tensor from lists: no per-sample tensor ops)
    completion_mask = torch.tensor([pad(s.get("completion_mask", [1.0] * len(s["completion_ids"]))) for s in samples],
                                   dtype=torch.float, device=device)  # [N, T]
    engine_logps = torch.tensor([pad(s["engine_logps"]) for s in samples], dtype=torch.float, device=device)  # [N, T]
    truncated = torch.tensor([s["truncated"] for s in samples], device=device)  # [N]
    mask = completion_mask * (~truncated).float()[:, None] if mask_truncated else completion_mask.clone()
    mask[[i for i, s in enumerate(samples) if s.get("top_up")]] = 0  # dynamic sampling's top-up groups
    fresh = torch.tensor([token_fresh(s, T) for s in samples], device=device)  # [N, T]
    return Batch(samples, completion_mask, mask, engine_logps, truncated, fresh)


def token_fresh(s, T):
    """[T] 1.0 at the tokens the step's weights sampled: all of a sample of staleness 0, or with in-flight updates
    (engine_versions; -1: inserted) those of the step's version (= the oldest token's version + the staleness)."""
    v = s.get("engine_versions") or [-1]
    if max(v) < 0:
        return [float(s.get("staleness", 0) == 0)] * T
    now = min(x for x in v if x >= 0) + s["staleness"]
    return [float(x == now) for x in v] + [0.0] * (T - len(v))


# ---- Cutting an update: minibatches, then each rank's micro-batch passes. The gradient of one update does not depend
# on the cut: token-level losses divide by the minibatch's global token count, sequence-level ones by its global row
# count, and FSDP2 averages over ranks.

def minibatches(n, group_size, steps_per_generation, num_iterations, seed):
    """Row indices of each optimizer update: mu passes over the batch, each cut into steps_per_generation slices;
    passes after the first shuffle whole groups."""
    shuffle = torch.Generator().manual_seed(seed)
    size = n // steps_per_generation
    for it in range(num_iterations):
        groups = torch.randperm(n // group_size, generator=shuffle) if it > 0 else torch.arange(n // group_size)
        order = (groups[:, None] * group_size + torch.arange(group_size)).flatten()  # [n]
        for m in range(steps_per_generation):
            yield order[m * size:(m + 1) * size]


def micro_batch_plan(rows, idle, micro_batch_size, device, micro_batch_tokens=0, samples=(), packing=None):
    """(collective unless idle is None and micro_batch_tokens 0) This rank's passes over `rows` -> [(row indices, or
    None for a filler; backward?)].

    Passes take rows in order, at most micro_batch_size; with micro_batch_tokens > 0 the rows are first ordered longest
    first (token_logprobs.length_order) and a pass also holds at most that many tokens of collate's input (rows x
    padded length; `packing`: its shared-prompt settings), a prompt's rows together where they fit; a longer row runs
    alone. `idle` [len(rows)] bool marks rows without a gradient (a zero advantage on every loss token, and nothing
    else in the loss): they run forward only, for their metrics, at a third of the cost (None: every pass alike).
    FSDP2 needs every rank to run the same number of backward passes and of forward-only passes: a rank short of
    passes splits its own, then trains its last idle rows singly (gradient 0; the shortest, with a budget) or runs
    fillers (a forward whose output is dropped). Forward-only passes come first: a no-grad forward after a backward
    drops the gradients of FSDP2's root module (embeddings, final norm; torch 2.13). Example, micro-batches of 3, no
    budget: rank 0 holds 7 live rows and 1 idle, rank 1 one live and 7 idle -> rank 0: [(1 idle, fwd), filler, 3 live,
    3 live, 1 live]; rank 1: [(3 idle, fwd), (2 idle, fwd), 1 live, (1 idle, bwd), (1 idle, bwd)]."""
    budget, packing = micro_batch_tokens, packing or {}
    if budget:  # sorted rows cut in runs pad least (verl's rearrange_micro_batches balances unpadded rows instead)
        order = torch.tensor(token_logprobs.length_order([samples[i] for i in rows.tolist()], bool(packing)))
        rows, idle = rows[order], None if idle is None else idle[order]

    def fits(mb):  # at most micro_batch_size rows and (with a budget) micro_batch_tokens tokens of collate's input
        if len(mb) > micro_batch_size or not budget:
            return len(mb) <= micro_batch_size
        packed_rows, L = token_logprobs.layout([samples[i] for i in mb], **packing)
        return len(packed_rows) * L <= budget

    def passes(rs):  # greedy, in order; with shared prompts a prompt's rows are one unit
        unit = (lambda r: tuple(samples[r]["prompt_ids"])) if budget and packing else (lambda r: r)  # noqa: E731
        return cut([list(u) for _, u in itertools.groupby(rs, unit)], fits)

    def busiest(n):  # (collective) the largest n of any rank
        if idle is None and not budget:  # every rank holds as many rows, cut alike
            return n
        counts = distributed.all_gather_cat(torch.tensor([[n, len(rows)]], device=device)).tolist()  # [world, 2]
        if len({r for _, r in counts}) > 1:  # every rank sees the same counts, so every rank stops here
            raise RuntimeError(f"micro_batch_plan: ranks hold different numbers of rows {[r for _, r in counts]}; "
                               "every rank's minibatch must have as many rows (minibatches() cuts them so)")
        return max(c for c, _ in counts)

    live = passes(rows.tolist() if idle is None else rows[~idle].tolist())
    spare = [] if idle is None else rows[idle].tolist()  # longest first with a budget
    n_back = max(1, busiest(len(live)))  # at least one backward: every parameter gets its gradient
    live = split_passes(live, n_back, fits)
    k = len(spare) - (n_back - len(live))  # idle rows beyond those trained singly (the last, shortest) to fill up
    forward, trained = passes(spare[:k]), [[r] for r in spare[k:]]
    n_fwd = busiest(len(forward)) if idle is not None else 0
    forward = split_passes(forward, n_fwd, fits)
    plan = ([(mb, False) for mb in forward] + [(None, False)] * (n_fwd - len(forward))
            + [(mb, True) for mb in live + trained])
    return [(None if mb is None else torch.tensor(mb, dtype=rows.dtype), back) for mb, back in plan]


def cut(units, fits):
    """Greedy, in order: each pass takes the next unit (a list of rows) while fits(pass); a unit that fits no pass is
    cut into rows -> [[row, ...], ...]."""
    passes = []
    for u in units:
        if passes and fits(passes[-1] + u):
            passes[-1] += u
        elif len(u) > 1 and not fits(u):
            passes += cut([[r] for r in u], fits)
        else:
            passes.append(u)
    return passes


def split_passes(passes, k, fits):
    """Passes cut further in place, the one with most rows in two, until there are k (or all are one row): nearest its
    middle where both parts fit (one row always does; a part of a pass that fits may not: collate packs it anew)."""
    ok = lambda x: len(x) == 1 or fits(x)  # noqa: E731
    while len(passes) < k and any(len(mb) > 1 for mb in passes):
        j = max(range(len(passes)), key=lambda j: len(passes[j]))
        mb, half = passes[j], len(passes[j]) // 2
        near = sorted(range(1, len(mb)), key=lambda i: abs(i - half))  # the middle first
        at = next((i for i in near if ok(mb[:i]) and ok(mb[i:])), half)
        passes[j:j + 1] = [mb[:at], mb[at:]]
    return passes


def in_order(outs, k=None):
    """[(positions, outputs), ...] of a plan's passes -> output k (or the outputs) of every position, in order."""
    return torch.cat([o if k is None else o[k] for _, o in outs])[torch.cat([mb for mb, _ in outs]).argsort()]
