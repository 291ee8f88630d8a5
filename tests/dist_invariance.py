"""The gradient of one optimizer update does not depend on how the batch is cut.

    python tests/dist_invariance.py MODEL_DIR OUT.pt ref        # 1 process, the minibatch as one micro-batch
    torchrun --nproc_per_node 2 tests/dist_invariance.py MODEL_DIR OUT.pt check
    torchrun --nproc_per_node 4 tests/dist_invariance.py MODEL_DIR OUT.pt cp
        # the same 2 data-parallel ranks, each a context-parallel group of 2 ranks that splits its rows
        # (--policy.context-parallel 2): every case of our own, the critic's too, and the sweep (every loss type, every
        # field at another value) packed: per loss type several fields to a case where none hides another (packed)
        # 2 ranks, FSDP2, micro-batches of 3 rows, steps_per_generation 2: the first update's minibatch holds the
        # same 16 rows (8 per rank); its gradient must equal the reference's for every loss type and option. Rows
        # with zero advantage run forward only in the sharded run (beta 0): rank 1 has one row that trains, so it
        # pads its backward passes with single idle rows and rank 0 runs a filler forward (both asserted), with [N]
        # and [N, T] advantages (and on-policy distillation's). The budget_* cases add --micro-batch-tokens 16 (rows
        # of 3-10 tokens): the ranks' passes differ in number and are evened out by splitting; so are the no-grad
        # log-probs' and the critic's passes under the budget.

Float64 model, so the only differences are summation order. Used by tests/test_distributed.py.
"""
import dataclasses
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

import batching
import checkpoints
import context_parallel
import distributed
import grpo
import loss_sweep
import losses
import models
import ppo
import token_logprobs

path, out_file, mode = sys.argv[1:4]
G, REF_ROWS = 4, 16
FLAGS = losses.LossConfig(epsilon=0.1, epsilon_high=0.15)  # as the user sets them; grpo.update then fills in
BASE = dataclasses.replace(FLAGS, max_completion_length=6)  # Dr. GRPO's denominator (the completions' T)


SWEEP = loss_sweep.sweep(FLAGS, max_completion_length=6)  # every loss type, every field at another value, one at a time
OWN = {
    "dapo": BASE,  # FLAGS' own loss type
    "gspo": dataclasses.replace(BASE, loss_type="grpo", importance_sampling_level="sequence"),
    "delta": dataclasses.replace(BASE, loss_type="dapo", delta=1.05),
    "dual_clip": dataclasses.replace(BASE, loss_type="bnpo", dual_clip=1.5),
    "beta_k3_bias": dataclasses.replace(BASE, loss_type="dapo", beta=0.1, use_bias_correction_kl=True),
    "beta_grpo_k2": dataclasses.replace(BASE, loss_type="grpo", beta=0.2, kl_estimator="k2"),
    "entropy_q_dapo": dataclasses.replace(BASE, loss_type="dapo", top_entropy_quantile=0.4),
    "entropy_q_grpo": dataclasses.replace(BASE, loss_type="grpo", top_entropy_quantile=0.6),
    "token_truncate": dataclasses.replace(BASE, loss_type="dr_grpo", sampler_correction="token_truncate",
                                          sampler_correction_cap=1.02),
    "sequence_mask": dataclasses.replace(BASE, loss_type="luspo", sampler_correction="sequence_mask",
                                         sampler_correction_cap=1.05),
    "off_policy_mask": dataclasses.replace(BASE, loss_type="dapo", off_policy_mask_threshold=0.01),
    # minibatch statistics with several tokens selected (the defaults select one): the top-k across ranks
    "clip_cov_band": dataclasses.replace(BASE, loss_type="clip_cov", clip_cov_lb=-1.0, clip_cov_ub=1.0, clip_cov_ratio=0.1),
    "kl_cov_k": dataclasses.replace(BASE, loss_type="kl_cov", kl_cov_ratio=0.1),
    "gmpo_binding": dataclasses.replace(BASE, loss_type="gmpo", gmpo_epsilon=0.05),
    "budget_dapo": dataclasses.replace(BASE, loss_type="dapo"),  # idle rows, fillers and single idle rows trained
    "budget_beta_gspo": dataclasses.replace(BASE, loss_type="grpo", importance_sampling_level="sequence", beta=0.1),
}
BUDGET = 16  # --micro-batch-tokens of the budget_* cases


def loss_gradient(cfg, b, lp, ent):
    """d policy_loss / d (log-probs, entropies) of cfg on the reference rows' batch b at log-probs lp, entropies ent."""
    lp, ent = lp.clone().requires_grad_(), ent.clone().requires_grad_()
    loss, _ = losses.policy_loss(lp, b.old_logps, b.advantages, b.mask, cfg, ref_logps=b.ref_logps,
                                 sampler_logps=b.engine_logps, entropies=ent)
    return torch.cat([(x if x is not None else torch.zeros_like(lp)).flatten()
                      for x in torch.autograd.grad(loss, (lp, ent), allow_unused=True)])


def packed(sweep, *on):
    """The sweep merged for the context-parallel cut (whose loss code is the 2-rank cut's; the model's forward and
    backward and the groups' reductions are what differ): per loss type, each case's field joins the first merged
    case that leaves the field at its base value and stays valid, where every field that moves the loss's gradient
    on its own (loss_gradient on the reference rows) still moves it by 1e-4 of its largest entry, 10x the 1e-5 the
    check allows, so none hides another
    -> {"+".join(names): LossConfig}."""
    base = lambda f: 6 if f == "max_completion_length" else getattr(FLAGS, f)  # noqa: E731 (the sweep's base)
    moves = lambda cfg, f: ((g := loss_gradient(cfg, *on)) - loss_gradient(  # noqa: E731 (10x the check's tolerance)
        dataclasses.replace(cfg, **{f: base(f)}), *on)).abs().max().item() > 1e-4 * g.abs().max().item()
    alone = {name: name.startswith("loss_type=") or moves(cfg, name.split("=")[0]) for name, cfg in sweep.items()}
    merged = []  # [names, LossConfig]
    for name, cfg in sweep.items():
        f = name.split("=")[0]
        for m in (m for m in merged if m[1].loss_type == cfg.loss_type and f not in (n.split("=")[0] for n in m[0])):
            cand = dataclasses.replace(m[1], **{f: getattr(cfg, f)})
            try:
                losses.validate_loss_config(dataclasses.replace(cand, max_completion_length=None))  # as the flags
            except ValueError:
                continue
            if all(moves(cand, n.split("=")[0]) for n in m[0] + [name] if alone[n] and not n.startswith("loss_type=")):
                m[0].append(name)
                m[1] = cand
                break
        else:
            merged.append([[name], cfg])
    return {"+".join(names): cfg for names, cfg in merged}


def make_samples(seed, n):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_ids": torch.randint(2, 50, (int(torch.randint(2, 7, (), generator=g)),), generator=g).tolist(),
             "completion_ids": torch.randint(2, 50, (int(torch.randint(1, 7, (), generator=g)),), generator=g).tolist()}
            for _ in range(n)]


def make_batch(run, samples, seed, plain):
    """Masks, advantages and perturbed old/ref/engine log-probs, identical in both modes for the same samples."""
    N, T = len(samples), 6
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([len(s["completion_ids"]) for s in samples])
    cm = (torch.arange(T)[None] < lens[:, None]).double()  # [N, T]
    mask = cm.clone()
    mask[3] = 0  # a truncated completion, masked out
    current = grpo.logps_of(run, plain, SimpleNamespace(samples=samples, T=T), torch.arange(N))["logps"]  # [N, T]
    noise = lambda s: (torch.randn(N, T, generator=g, dtype=torch.float64) * s * cm)  # noqa: E731
    adv, old, ref, engine = torch.randn(N, generator=g, dtype=torch.float64), *(current + noise(s) for s in (0.1, 0.2, 0.02))
    return batching.Batch(samples, completion_mask=cm, mask=mask, engine_logps=engine, truncated=torch.zeros(N, dtype=bool),
                          fresh=torch.ones_like(cm), old_logps=old, ref_logps=ref, advantages=adv), current


def grads(module):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in module.named_parameters() if p.grad is not None}


distributed.setup_distributed()  # a world of one for "ref"
# "cp": groups of 2 ranks; every reduction over one rank of each group (2 data-parallel ranks, as in "check")
cp_group, distributed.DATA_GROUP = context_parallel.groups(4, 2) if mode == "cp" else (None, None)
torch.manual_seed(0)
policy, _ = models.load_policy(path, dtype=torch.float64)
cfg = SimpleNamespace(micro_batch_size=REF_ROWS if mode == "ref" else 3, micro_batch_tokens=0, distill=SimpleNamespace(coef=0.5),
                      rollout=SimpleNamespace(temperature=0.7, top_k=0, top_p=1.0, max_completion_length=6))
plain = token_logprobs.TokenLogprobs(policy)
run = SimpleNamespace(cfg=cfg, device=torch.device("cpu"), world=dist.get_world_size(distributed.DATA_GROUP),  # this
                      processor=SimpleNamespace(pad_token_id=0), module=plain, packing={})  # (a row per sample)
ref_samples = make_samples(0, REF_ROWS)
if mode == "ref":
    rows_used, samples = torch.arange(REF_ROWS), ref_samples
else:
    rank = distributed.data_rank()  # the data-parallel rank (its group's, under context parallelism)
    samples = ref_samples[rank * 8:(rank + 1) * 8] + make_samples(100 + rank, 8)  # 16 rows: minibatch 1 is ours
    rows_used = next(batching.minibatches(16, G, 2, 1, seed=0))
    assert rows_used.tolist() == list(range(8))
IDLE = slice(9, 16)  # zero advantages: rank 1 keeps one row in the backward (row 3, on rank 0, is masked)
batch, current = make_batch(run, samples, 0, plain)
if mode == "ref":  # every row in one backward pass: the reference for the forward-only rows of the sharded run
    batch.advantages[IDLE] = 0
    batching.micro_batch_plan = lambda rows, *_: [(rows, True)]
else:  # the same perturbations as the reference rows (the reference draws them for all 16 rows)
    ref_batch, current_ref = make_batch(run, ref_samples, 0, plain)
    ref_batch.advantages[IDLE] = 0
    for k in ("advantages", "old_logps", "ref_logps", "engine_logps", "mask"):
        getattr(batch, k)[:8] = getattr(ref_batch, k)[rank * 8:(rank + 1) * 8]
    if cp_group is not None:  # the same module, its rows now split over the group
        plain.cp_group, _ = cp_group, (context_parallel.register(), policy.set_attn_implementation(context_parallel.NAME))
    run.module = models.shard(plain, torch.distributed.fsdp.MixedPrecisionPolicy())

ref_batch, current_ref = (batch, current) if mode == "ref" else (ref_batch, current_ref)
PACKED = {} if mode == "check" else packed(SWEEP, ref_batch, current_ref, grpo.logps_of(
    run, plain, ref_batch, torch.arange(REF_ROWS), with_entropy=True)["entropies"])  # the same in ref and cp
CASES = {**OWN, **({} if mode == "cp" else SWEEP), **({} if mode == "check" else PACKED)}  # ref: all of them
results, advantages, plans = {}, batch.advantages, {}
if mode != "ref":  # record each case's passes: (rows or None for a filler, backward?)
    plan_of = batching.micro_batch_plan
    batching.micro_batch_plan = lambda *a: plans.setdefault(name, plan_of(*a))
for name, loss_cfg in {**CASES, "distill": dataclasses.replace(BASE, loss_type="dapo"),
                       "dapo_old_none": dataclasses.replace(BASE, loss_type="dapo"),
                       "token_level": dataclasses.replace(BASE, loss_type="dapo"),
                       "all_idle": dataclasses.replace(BASE, loss_type="grpo")}.items():
    if name == "distill":  # --distill.teacher: [N, T] advantages from the old and the teacher's log-probs
        batch.teacher_logps = batch.ref_logps
        batch.advantages = advantages
        batch.advantages = grpo.distill_advantages(run, batch)["advantages"]
    if name == "dapo_old_none":  # one process: old = current (None); sharded: old recomputed by a separate forward
        batch.old_logps, batch.advantages, batch.teacher_logps = None if mode == "ref" else current, advantages, None
    if name == "token_level":  # [N, T] advantages (GAE, REINFORCE++): the idle rows' are zero on every token
        batch.advantages = advantages[:, None] * torch.linspace(0.5, 1.5, batch.T, dtype=torch.float64)
    if name == "all_idle":  # no row has a gradient: a backward still runs, every parameter gets a zero gradient
        batch.advantages = torch.zeros_like(advantages)
    run.module.zero_grad(set_to_none=True)
    cfg.micro_batch_tokens = BUDGET if name.startswith("budget") else 0
    stats = grpo.accumulate_gradients(run, batch, rows_used, loss_cfg)["stats"]
    results[name] = {"grads": grads(run.module), "stats": stats}
    cfg.micro_batch_tokens = 0
batch.advantages = advantages
if mode != "ref":  # the no-grad log-probs under the budget: sorted passes, evened out, back in the rows' order
    cfg.micro_batch_tokens = BUDGET
    got = grpo.logps_of(run, run.module, batch, torch.arange(16), with_entropy=True)
    cfg.micro_batch_tokens = 0
    want = grpo.logps_of(run, plain, batch, torch.arange(16), with_entropy=True)
    for a, b in ((got[k], want[k]) for k in ("logps", "entropies")):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def critic_update(batch, rows_used, sharded, budget=0):
    """One critic update with SGD(lr=1) and no clipping: the weight change is minus the gradient."""
    torch.manual_seed(0)
    critic = token_logprobs.TokenValues(models.load_critic(path, dtype=torch.float64), cp_group)
    for p in critic.parameters():  # a non-zero head, so the backbone gets a gradient too
        torch.nn.init.normal_(p, std=0.02) if p.dim() == 2 and p.shape[0] == 1 else None
    module = models.shard(critic, torch.distributed.fsdp.MixedPrecisionPolicy()) if sharded else critic
    before = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in module.named_parameters()}
    opt = torch.optim.SGD(module.parameters(), lr=1.0)
    c = {"module": module, "optimizer": opt, "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)}
    ccfg = SimpleNamespace(micro_batch_size=cfg.micro_batch_size, micro_batch_tokens=budget, critic=SimpleNamespace(value_clip=0.05, max_grad_norm=1e9))
    stats = ppo.update_critic(c, batch, [rows_used], ccfg, 0, torch.device("cpu"),
                             dist.get_world_size(distributed.DATA_GROUP))  # the data-parallel ranks (run.world)
    after = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in module.named_parameters()}
    return {"grads": {n: before[n] - after[n] for n in before}, "stats": {k: v for k, v in stats.items() if k != "critic/lr"}}


g_v = torch.Generator().manual_seed(7)
ref_extra = {k: torch.randn(REF_ROWS, 6, generator=g_v, dtype=torch.float64) for k in ("old_values", "returns")}
for k, v in ref_extra.items():
    setattr(batch, k, v if mode == "ref" else torch.randn(16, 6, dtype=torch.float64))
    if mode != "ref":
        getattr(batch, k)[:8] = v[rank * 8:(rank + 1) * 8]
results["critic"] = critic_update(batch, rows_used, sharded=mode != "ref")
results["critic_budget"] = results["critic"] if mode == "ref" else critic_update(batch, rows_used, True, BUDGET)

if mode == "ref":
    torch.save(results, out_file)
    print("REF SAVED", flush=True)
    dist.destroy_process_group()
else:
    expected = torch.load(out_file)
    worst = {}
    for name, r in results.items():
        e = expected[name]["grads"]
        assert r["grads"].keys() == e.keys(), (name, set(r["grads"]) ^ set(e))
        scale = max(v.abs().max().item() for v in e.values())
        worst[name] = max((r["grads"][k] - e[k]).abs().max().item() for k in e) / (scale or 1.0)  # all_idle: 0
        assert r["stats"].keys() == expected[name]["stats"].keys(), name
        for k in r["stats"]:  # token-weighted metrics equal the one-batch values too
            assert abs(r["stats"][k] - expected[name]["stats"][k]) <= 1e-6 * max(1, abs(expected[name]["stats"][k])), \
                (name, k, r["stats"][k], expected[name]["stats"][k])
    # the passes each rank ran (micro-batches of 3): rank 0 trains 7 rows (row 3 is masked), rank 1 one (rows 1-7 have
    # zero advantage); so 3 backward passes everywhere, rank 1's padded with idle rows, and 2 forward-only passes,
    # rank 0's second a filler. With no gradient anywhere one backward of one row.
    shape = lambda name: [(None if mb is None else len(mb), back) for mb, back in plans[name]]  # noqa: E731
    want = [[(1, False), (None, False), (3, True), (3, True), (1, True)],
            [(3, False), (2, False), (1, True), (1, True), (1, True)]][rank]
    assert shape("dapo") == shape("token_level") == want, (shape("dapo"), shape("token_level"), want)
    # with beta the KL term trains every row but rank 0's masked row 3 (the loss gives it no gradient): one
    # forward-only pass there, a filler on rank 1
    want_beta = [[(1, False), (3, True), (3, True), (1, True)], [(None, False), (3, True), (3, True), (2, True)]][rank]
    assert shape("beta_k3_bias") == want_beta, shape("beta_k3_bias")
    assert shape("all_idle") == [(3, False), (3, False), (1, False), (1, True)], shape("all_idle")
    for name in ("budget_dapo", "budget_beta_gspo"):  # the same passes on both ranks, each within the budget
        kinds = torch.tensor([[sum(not b for _, b in plans[name]), sum(b for _, b in plans[name])]])
        assert (distributed.all_gather_cat(kinds) == kinds).all(), (name, shape(name))
        assert all(mb is None or len(mb) == 1 or token_logprobs.collate([samples[i] for i in mb.tolist()], 0,
                   "cpu", 6)["input_ids"].numel() <= BUDGET for mb, _ in plans[name]), (name, plans[name])
    # with beta only rows without a loss token (row 3) run forward only
    assert all(back or mb is None or batch.mask[mb].sum() == 0 for mb, back in plans["budget_beta_gspo"]), \
        shape("budget_beta_gspo")
    if rank == 0:
        print("relative grad difference per case:", {k: f"{v:.1e}" for k, v in worst.items()}, flush=True)
    bad = {k: v for k, v in worst.items() if not v <= 1e-5}
    assert not bad, bad
    print(f"rank {rank} INVARIANT OK", flush=True)

    # Global reward statistics: each rank's advantages equal those of one big batch on one process, for the batch
    # std, GDPO's final normalisation and RLOO with unscorable (NaN) samples. Rank 1's rewards vary far less.
    g = torch.Generator().manual_seed(5)
    everyone = torch.rand(2 * 8, 2, generator=g)  # [ranks * N, K], groups of G = 4 contiguous
    everyone[8:] = 0.5 + 0.01 * everyone[8:]
    everyone[[2, 9], 1] = float("nan")
    everyone[12] = float("nan")  # unscorable
    mine = everyone[rank * 8:(rank + 1) * 8]
    for est, scale, agg in [("grpo", "batch", "sum_then_normalize"), ("grpo", "group", "normalize_then_sum"),
                            ("rloo", "group", "sum_then_normalize")]:
        run.cfg = SimpleNamespace(num_generations=G, advantage_estimator=est, scale_rewards=scale, reward_aggregation=agg)
        run.weights, run.rank = [1.0, 0.5], rank
        got = SimpleNamespace(topped_up=torch.zeros(8, dtype=torch.bool))  # none of them a dynamic-sampling top-up
        got = grpo.compute_advantages(run, mine, got)["fields"]["advantages"]
        if est == "rloo":
            total = (everyone * torch.tensor([1.0, 0.5])).nansum(-1).masked_fill(everyone.isnan().all(-1), float("nan"))
            want = losses.rloo_advantages(total, G)
        else:
            want = losses.group_advantages(everyone, [1.0, 0.5], G, aggregation=agg, scale=scale)
        torch.testing.assert_close(got, want[rank * 8:(rank + 1) * 8])
    # Token-level estimators: REINFORCE++ and GAE on 2 ranks with different completion lengths equal one big batch
    T_r = (5, 7)  # rank 0's longest completion is 5 tokens, rank 1's 7
    lens_all = torch.tensor([1 + i % 5 for i in range(8)] + [1 + i % 7 for i in range(8)])
    m_all = (torch.arange(7)[None] < lens_all[:, None]).double()  # [16, 7]
    m_all[10] = 0  # a masked (truncated / unscorable) row
    r_all = torch.randn(16, 7, generator=g, dtype=torch.float64) * m_all
    v_all = torch.randn(16, 7, generator=g, dtype=torch.float64) * m_all
    mine = slice(rank * 8, (rank + 1) * 8)
    for est in ppo.TOKEN_ESTIMATORS:
        adv, ret, _ = ppo.token_advantages(est, r_all[mine, :T_r[rank]], m_all[mine, :T_r[rank]],
                                           v_all[mine, :T_r[rank]], gamma=0.9, lam=0.8, device=torch.device("cpu"))
        if est == "reinforce_pp":
            want = losses.reinforce_pp_advantages(r_all, m_all, gamma=0.9)
        else:
            a, want_ret = losses.gae_advantages(r_all, v_all, m_all, gamma=0.9, lam=0.8)
            want = losses.masked_whiten(a, m_all)
            torch.testing.assert_close(ret, want_ret[mine, :T_r[rank]])
        torch.testing.assert_close(adv, want[mine, :T_r[rank]])
    # distill/reverse_kl is one mean over every rank's sampled tokens: each rank's half gives the whole batch's
    run.cfg, lp_all = cfg, torch.randn(2, 16, 7, generator=g, dtype=torch.float64)  # [old / teacher, 16, T]
    half = batching.Batch([{}] * 8, completion_mask=m_all[mine], mask=m_all[mine], engine_logps=lp_all[0][mine],
                          truncated=torch.zeros(8, dtype=bool), fresh=torch.ones_like(m_all[mine]), old_logps=lp_all[0][mine],
                          teacher_logps=lp_all[1][mine], advantages=torch.zeros(8))
    kl = grpo.distill_advantages(run, half)["distill/reverse_kl"]
    assert abs(kl - ((lp_all[0] - lp_all[1]) * m_all).sum().item() / m_all.sum().item()) < 1e-12, kl
    print(f"rank {rank} GLOBAL STATS OK", flush=True)

    # A NaN loss on one rank shows in the logged (global) loss on every rank; the optimizer step would skip.
    run.cfg = cfg
    batch.advantages = batch.advantages.clone()
    if rank == 1:
        batch.advantages[0] = float("nan")
    stats = grpo.accumulate_gradients(run, batch, rows_used, dataclasses.replace(BASE, loss_type="dapo"))["stats"]
    assert stats["loss"] != stats["loss"], stats["loss"]  # NaN

    # The Hugging Face copy is gathered onto rank 0 alone, equal to the unsharded weights; rank 1 keeps nothing.
    full = checkpoints.gather_on_rank0(run.module.policy.state_dict().items(), rank)
    fresh, _ = models.load_policy(path, dtype=torch.float64)
    if rank == 0:
        expected_sd = fresh.state_dict()
        assert full.keys() == expected_sd.keys() and all(v.device.type == "cpu" for v in full.values())
        assert all(torch.equal(full[k], expected_sd[k]) for k in full)  # no update ran: the initial weights
    else:
        assert full == {}
    print(f"rank {rank} NAN AND GATHER OK", flush=True)
    dist.destroy_process_group()
