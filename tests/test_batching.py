"""batching.micro_batch_plan on simulated ranks, without a launch: each rank's plan runs in a thread and its
all_gathers meet at a barrier. What a pass costs is read from token_logprobs.collate, the input the forward runs (its
gradient invariance is in tests/dist_invariance.py)."""
import threading

import pytest
import torch

import batching
from token_logprobs import collate


def make_samples(seed, prompts, G, longest):
    """`prompts` groups of G samples sharing a prompt of 3-11 tokens; completions of 1..longest tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(prompts):
        prompt = torch.randint(2, 50, (int(torch.randint(3, 12, (), generator=g)),), generator=g).tolist()
        out += [{"prompt_ids": prompt, "completion_ids": [7] * int(torch.randint(1, longest + 1, (), generator=g))}
                for _ in range(G)]
    return out


def plans(monkeypatch, ranks, mbs, budget, packing=None):
    """ranks: [(samples, idle [n] bool or None)] -> each rank's micro_batch_plan over all its rows, the ranks run as
    threads whose all_gather_cat meets at a barrier (every rank's tensor, in rank order)."""
    me, sent, meet = threading.local(), [None] * len(ranks), threading.Barrier(len(ranks), timeout=10)

    def gather(t):
        sent[me.rank] = t
        meet.wait()
        out = torch.cat(sent)
        meet.wait()  # everyone has read this round before the next one writes
        return out

    def run(r, samples, idle):
        me.rank = r
        got[r] = batching.micro_batch_plan(torch.arange(len(samples)), idle, mbs, "cpu", budget, samples, packing)
    monkeypatch.setattr(batching.distributed, "all_gather_cat", gather)
    got = [None] * len(ranks)
    threads = [threading.Thread(target=run, args=(r, *rank)) for r, rank in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert None not in got, "a rank's plan failed (see its thread's traceback)"
    return got


def tokens(samples, mb, packing):
    """Tokens in the input collate builds for the rows mb."""
    chosen = [samples[i] for i in mb.tolist()]
    T = max(len(s["completion_ids"]) for s in chosen)
    return collate(chosen, 0, "cpu", T, **(packing or {}))["input_ids"].numel()


@pytest.mark.parametrize("packing", [None, {"pair_cost": 30.0}])
@pytest.mark.parametrize("with_idle", [False, True])
def test_token_budget_plan_covers_every_row_within_budget_with_equal_passes_on_every_rank(monkeypatch, packing,
                                                                                       with_idle):
    """Three ranks of 16 rows (completions of 1-40 tokens; rank 2's of 1-150, so it needs more passes and has rows
    longer than the budget): every row runs exactly once; a pass holds <= --micro-batch-size rows and <= the budget
    of collated tokens unless it is one row; every rank runs as many forward-only passes (first) and backward
    passes; a rank runs a filler only when all its forward-only passes are single rows, and trains an idle row only
    when all its live passes are single rows (it splits passes before it adds work)."""
    mbs, budget = 8, 120
    g = torch.Generator().manual_seed(1)
    ranks = [(make_samples(r, 4, 4, 150 if r == 2 else 40), torch.rand(16, generator=g) < [0.2, 0.9, 0.4][r]
              if with_idle else None) for r in range(3)]
    got = plans(monkeypatch, ranks, mbs, budget, packing)
    assert any(mb is not None and len(mb) == 1 and tokens(ranks[2][0], mb, packing) > budget for mb, _ in got[2])
    for (samples, idle), plan in zip(ranks, got):
        idle = torch.zeros(16, dtype=torch.bool) if idle is None else idle
        assert sorted(sum((mb.tolist() for mb, _ in plan if mb is not None), [])) == list(range(16))
        assert all(mb is None or len(mb) <= mbs and (len(mb) == 1 or tokens(samples, mb, packing) <= budget)
                   for mb, _ in plan)
        backward = [b for _, b in plan]
        assert backward == sorted(backward)  # forward-only passes first
        assert all(b or idle[mb].all() for mb, b in plan if mb is not None)  # live rows always train
        live = [mb for mb, b in plan if b and not idle[mb].all()]
        forward = [mb for mb, b in plan if not b and mb is not None]
        if None in [mb for mb, _ in plan]:
            assert all(len(mb) == 1 for mb in forward)
        if any(b and idle[mb].all() for mb, b in plan):  # idle rows trained: one per pass, the live ones split
            assert all(len(mb) == 1 for mb, b in plan if b and idle[mb].all()) and all(len(mb) == 1 for mb in live)
    assert len({tuple(sum(b == k for _, b in plan) for k in (False, True)) for plan in got}) == 1
    if not with_idle:
        assert not any(b is False for plan in got for _, b in plan)


def test_shared_prompt_rows_stay_together_when_the_budget_allows(monkeypatch):
    """Two prompts of 10 tokens, 4 completions of 5-8 tokens each: with shared-prompt packing a budget of 40 holds
    one prompt's 4 completions in one row of 36 tokens per pass; one row per sample holds 2 rows of <= 18 per pass.
    Where --micro-batch-size would cut a prompt's rows apart, the pass ends before them."""
    samples = [{"prompt_ids": [p] * 10, "completion_ids": [7] * n} for p in (3, 4) for n in (5, 8, 6, 7)]
    shared = plans(monkeypatch, [(samples, None)], 8, 40, {"pair_cost": 1e9})[0]
    assert sorted(sorted(mb.tolist()) for mb, _ in shared) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [collate([samples[i] for i in mb.tolist()], 0, "cpu", 8, pair_cost=1e9)["input_ids"].shape
            for mb, _ in shared] == [(1, 36)] * 2
    plain = plans(monkeypatch, [(samples, None)], 8, 40)[0]
    assert [len(mb) for mb, _ in plain] == [2] * 4 and all(tokens(samples, mb, None) <= 40 for mb, _ in plain)
    threes = make_samples(0, 4, 3, 20)  # groups of 3 under --micro-batch-size 8: a pass takes whole groups
    passes = [set(mb.tolist()) for mb, _ in plans(monkeypatch, [(threes, None)], 8, 10**6, {"pair_cost": 1e9})[0]]
    assert len(passes) == 2 and all(any(set(range(j, j + 3)) <= p for p in passes) for j in range(0, 12, 3))


def test_without_a_budget_the_passes_are_cut_in_batch_order(monkeypatch):
    """--micro-batch-tokens 0: micro-batches of --micro-batch-size rows in batch order, as before the budget existed
    (the docstring's example); with no idle rows the cut needs no collective."""
    samples = make_samples(0, 2, 4, 20)
    rank0, rank1 = torch.zeros(8, dtype=torch.bool), torch.ones(8, dtype=torch.bool)
    rank0[7], rank1[0] = True, False
    got = plans(monkeypatch, [(samples, rank0), (samples, rank1)], 3, 0)
    shape = [[(None if mb is None else mb.tolist(), b) for mb, b in plan] for plan in got]
    assert shape[0] == [([7], False), (None, False), ([0, 1, 2], True), ([3, 4, 5], True), ([6], True)]
    assert [(len(mb), b) for mb, b in got[1]] == [(3, False), (2, False), (1, True), (1, True), (1, True)]
    monkeypatch.setattr(batching.distributed, "all_gather_cat", None)  # would fail if called
    assert [mb.tolist() for mb, _ in batching.micro_batch_plan(torch.arange(8), None, 3, "cpu")] == \
        [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_budget_passes_give_the_log_probs_of_the_rows_in_their_order(text_dir, tmp_path):
    """The update's log-probs (check_mismatch's input when no old log-probs exist) and the no-grad log-probs under a
    budget, for rows out of order with idle ones among them, equal logps_of's without a budget (passes in batch order);
    so do the critic's values (ppo.values) of every row."""
    from types import SimpleNamespace

    import torch.distributed as dist

    import grpo
    import losses
    import models
    import ppo
    import token_logprobs
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        policy, _ = models.load_policy(text_dir, dtype=torch.float64)
        critic = {"module": token_logprobs.TokenValues(models.load_critic(text_dir, dtype=torch.float64))}
        torch.nn.init.normal_(critic["module"].policy.score.weight, generator=torch.Generator().manual_seed(1))  # not 0
        g = torch.Generator().manual_seed(0)
        samples = [{"prompt_ids": torch.randint(2, 40, (4,), generator=g).tolist(), "engine_logps": [-1.0] * (1 + i % 7),
                    "completion_ids": torch.randint(2, 40, (1 + i % 7,), generator=g).tolist(), "truncated": False}
                   for i in range(12)]
        batch = batching.build_batch(samples, False, torch.device("cpu"))
        batch.advantages = torch.randn(12, generator=g, dtype=torch.float64).index_fill(0, torch.tensor([2, 5]), 0)
        rows, got = torch.tensor([7, 3, 11, 0, 5, 2, 9]), {}
        for budget in (0, 20):
            cfg = SimpleNamespace(micro_batch_size=3, micro_batch_tokens=budget, rollout=SimpleNamespace(
                temperature=1.0, top_k=0, top_p=1.0, max_completion_length=7))
            run = SimpleNamespace(cfg=cfg, device=torch.device("cpu"), world=1, module=token_logprobs.TokenLogprobs(policy),
                                  packing={}, processor=SimpleNamespace(pad_token_id=0))
            got[budget] = grpo.logps_of(run, run.module, batch, rows)["logps"]
            got["values", budget] = ppo.values(critic, batch, 3, 0, torch.device("cpu"), budget)  # [12, T]
            if budget:
                got["update"] = grpo.accumulate_gradients(run, batch, rows, losses.LossConfig(loss_type="dapo"))["trainer_logps"]
        torch.testing.assert_close(got[20], got[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(got["update"], got[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(got["values", 20], got["values", 0], rtol=0, atol=1e-12)
    finally:
        dist.destroy_process_group()


def test_a_pass_split_to_even_out_the_ranks_stays_within_the_budget(monkeypatch):
    """Shared prompts: rank 0's 8 completions of one prompt fit the budget of 500 as one packed row (477 tokens),
    rank 1's (537) need two passes, so rank 0 splits its pass. Its halves by row count would not both fit: collate
    packs the second (completions of 139, 77, 66, 97 tokens) as 4 rows of 144 = 576 tokens, for a part of a pass that
    fits is packed anew. The split is made where both parts fit."""
    group = lambda p, lengths: [{"prompt_ids": [p] * 5, "completion_ids": [7] * n} for n in lengths]  # noqa: E731
    ranks = [(group(3, [20, 3, 22, 48, 139, 77, 66, 97]), None), (group(4, [138, 82, 64, 17, 18, 75, 88, 47]), None)]
    packing = {"pair_cost": 100.0}
    got = plans(monkeypatch, ranks, 16, 500, packing)
    assert [len(plan) for plan in got] == [2, 2]
    for (samples, _), plan in zip(ranks, got):
        sizes = [tokens(samples, mb, packing) for mb, _ in plan]
        assert max(sizes) <= 500, sizes
