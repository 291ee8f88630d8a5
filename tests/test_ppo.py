"""PPO with a critic (GAE), REINFORCE++, EMA, DAPO dynamic sampling and the ptx loss: grpo.py end to end on tiny
models (the advantage math itself is checked against float64 references in test_losses.py, and its invariance to
ranks in dist_invariance.py)."""
import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import run, torchrun
from safetensors.torch import load_file
from test_grpo import metrics

QUIET = ["--log.completions-every", "0", "--log.no-progress"]


def _mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def test_critic_learns_a_known_value(tmp_path):
    """Actor frozen; the reward is fixed once the first token is drawn (rewards_for_tests:first_is_digit), so the value
    of the second token's state is known exactly: explained variance rises from 0 and the value loss falls."""
    out = str(tmp_path / "critic")
    run([sys.executable, "grpo.py", "--output-dir", out, "--max-steps", "20", "--advantage-estimator", "gae",
         "--rollout.engine", "hf", "--data.rewards", "rewards_for_tests:first_is_digit", "--critic.lr", "1e-3",
         "--critic.freeze-actor-steps", "100", "--num-iterations", "2", "--rollout.max-completion-length", "2", *QUIET],
        timeout=900)
    rows = metrics(out)
    for k in ("critic/loss", "critic/value_mean", "critic/clip_frac", "returns/mean", "advantages/mean"):
        assert k in rows[0], k
    first, last = rows[:3], rows[-3:]
    ev = lambda rs: sum(r.get("critic/explained_variance", 0.0) for r in rs) / len(rs)  # noqa: E731
    print(f"explained variance {ev(first):.3f} -> {ev(last):.3f}; value loss {_mean(first, 'critic/loss'):.3f} -> "
          f"{_mean(last, 'critic/loss'):.3f}")
    # the fresh value head is zero (models.load_critic), so the first step's old values explain nothing: exactly 0
    assert rows[0].get("critic/explained_variance", 0.0) == pytest.approx(0.0, abs=1e-6) and ev(last) > 0.25, (ev(first), ev(last))
    assert _mean(last, "critic/loss") < 0.7 * _mean(first, "critic/loss")
    # the frozen actor never moved
    start, end = (load_file(os.path.join(out, *p, "model.safetensors")) for p in (("builtin-tiny", "rank0"),
                                                                                  ("checkpoint-20",)))
    assert all(torch.equal(start[k], end[k]) for k in start)


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp"])
def test_token_level_estimators_learn_the_default_task(tmp_path, estimator):
    """The README's default run with --advantage-estimator gae / reinforce_pp on 2 ranks (HF engine): the same bar as GRPO's
    (mean reward of the last 10 steps >= first 10 + 0.3)."""
    out = str(tmp_path / estimator)
    critic = ["--critic.lr", "1e-3"] if estimator == "gae" else []  # (refused where no critic reads it)
    torchrun("grpo.py", "--output-dir", out, "--advantage-estimator", estimator, *critic,
             "--max-steps", "50", "--rollout.engine", "hf", *QUIET, timeout=900)  # HF: no engine start-up (CI time)
    rows = metrics(out)
    first, last = _mean(rows[:10], "reward/mean"), _mean(rows[-10:], "reward/mean")
    print(f"{estimator}: first-10 mean reward {first:.3f}, last-10 {last:.3f}")
    assert last - first >= 0.3, (first, last)
    if estimator == "gae":
        assert os.path.exists(os.path.join(out, "checkpoint-50", "critic", "model.safetensors"))
    else:  # logged before whitening: with beta 0 and gamma 1 each token's return is its sequence's reward in [0, 1]
        assert all(0 <= r["advantages/mean"] == r["returns/mean"] <= 1 for r in rows)
        assert _mean(rows[-10:], "advantages/mean") > 0.3  # whitened advantages would average ~0


def test_ema_is_the_formula_over_the_recorded_parameters(tmp_path):
    """checkpoint-k/ema equals e_k = d e_(k-1) + (1 - d) p_k computed in float64 from the saved policies p_k
    (e_0 = the initial model); --eval.use-ema evaluates with it (step 2) and the live weights come back for training
    (step 3). 3 steps: a 4th (with its own, unchecked, EMA evaluation) checked nothing the first 3 do not."""
    out, d = str(tmp_path / "ema"), 0.6
    run([sys.executable, "grpo.py", "--output-dir", out, "--max-steps", "3", "--ema.decay", str(d), "--optim.lr", "1e-2",
         "--checkpoint.every", "1", "--checkpoint.keep", "0", "--eval.every", "2", "--eval.use-ema",
         "--eval.num-prompts", "8", *QUIET], timeout=600)
    load = lambda *p: {k: v.double() for k, v in load_file(os.path.join(out, *p, "model.safetensors")).items()}  # noqa: E731
    e = load("builtin-tiny", "rank0")
    for k in range(1, 4):
        p = load(f"checkpoint-{k}")
        e = {n: d * e[n] + (1 - d) * p[n] for n in e}
        saved = load(f"checkpoint-{k}", "ema")
        assert saved.keys() == e.keys()
        worst = max((saved[n] - e[n]).abs().max().item() for n in e)
        moved = max((saved[n] - p[n]).abs().max().item() for n in e)
        assert worst < 1e-6 < moved, (k, worst, moved)  # the EMA, not the live weights
    rows = {r["step"]: r for r in metrics(out)}  # step 0: the baseline evaluation
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2]
    assert rows[3]["logprob_mismatch/mean_abs"] < 1e-3  # after the EMA evaluation the engine has the live weights again


def test_dynamic_sampling_keeps_only_informative_groups(tmp_path):
    """Prompts whose first digit is even get the same reward on every completion (rewards_for_tests:
    even_prompts_agree): with --dynamic-sampling none of those groups reaches the loss, extra rounds are logged, and the
    2 ranks stay in step (the run finishes)."""
    out = str(tmp_path / "ds")
    torchrun("grpo.py", "--output-dir", out, "--max-steps", "3", "--dynamic-sampling", "--rollout.engine", "hf",
             "--dynamic-sampling-max-rounds", "4", "--data.rewards", "rewards_for_tests:even_prompts_agree", *QUIET,
             timeout=600)
    rows = metrics(out)
    assert all(r["frac_zero_std"] > 0 for r in rows)  # before filtering: about half the prompts
    assert all(r["frac_zero_std/in_loss"] == 0.0 for r in rows)
    assert max(r["dynamic_sampling/rounds"] for r in rows) >= 2 and all(r["time/dynamic_sampling"] >= 0 for r in rows)
    plain = str(tmp_path / "plain")  # without it, those groups do reach the loss
    torchrun("grpo.py", "--output-dir", plain, "--max-steps", "1", "--rollout.engine", "hf", "--data.rewards",
             "rewards_for_tests:even_prompts_agree", *QUIET, timeout=600)
    assert metrics(plain)[0]["frac_zero_std/in_loss"] > 0.2


def test_ptx_loss_is_the_next_token_nll_of_the_texts(tmp_path, text_dir):
    """ptx/loss at the first update equals the mean next-token NLL of the first --ptx.batch-size texts under the
    initial model (an independent forward through transformers); with a large coefficient it falls."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    texts = ["max 1 2 = 2", "max 7 3 9 = 9", "max 4 4 = 4", "max 8 0 5 = 8"]
    data = tmp_path / "ptx.jsonl"
    data.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    out = str(tmp_path / "ptx")
    run([sys.executable, "grpo.py", "--output-dir", out, "--model", text_dir, "--max-steps", "5", "--ptx.dataset",
         str(data), "--ptx.column", "body", "--ptx.coef", "1.0", "--ptx.batch-size", "2", "--optim.lr", "1e-2",
         "--optim.warmup-steps", "0", "--rollout.engine", "hf", *QUIET], timeout=600)
    rows = metrics(out)
    model = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float64)
    tok = AutoTokenizer.from_pretrained(text_dir)
    nll, n = 0.0, 0
    for t in texts[:2]:
        ids = torch.tensor([tok(t)["input_ids"]])
        logits = model(ids).logits[0, :-1]
        nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        n += ids.shape[1] - 1
    assert rows[0]["ptx/loss"] == pytest.approx(nll / n, rel=1e-4)
    assert rows[-1]["ptx/loss"] < 0.8 * rows[0]["ptx/loss"]


def test_token_rewards_against_a_loop():
    """r_t = -beta KL_t on each model token, plus the sequence reward on the last model token (float64 loop); a multi-turn
    row that ends with inserted tokens (mask 0: the returns skip them) gets its reward on its last model token."""
    import ppo
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([3, 5, 1, 0, 5])
    cm = (torch.arange(5)[None] < lens[:, None]).double()
    cm[4, 1:3] = cm[4, 4] = 0  # model, inserted x2, model, inserted: the episode hit a length limit after a tool answer
    rewards, kl, beta = torch.randn(5, generator=g, dtype=torch.float64), torch.rand(5, 5, generator=g, dtype=torch.float64), 0.3
    want = torch.zeros(5, 5, dtype=torch.float64)
    for i in range(5):
        model = [t for t in range(5) if cm[i, t]]
        for t in model:
            want[i, t] = -beta * float(kl[i, t]) + (float(rewards[i]) if t == model[-1] else 0.0)
    assert want[4, 3] != 0 and want[4, 4] == 0
    torch.testing.assert_close(ppo.token_rewards(rewards, cm, kl * cm, beta), want)
    torch.testing.assert_close(ppo.token_rewards(rewards, cm), want + beta * kl * cm)  # no KL term


def test_reinforce_pp_with_the_kl_in_the_reward_against_verl(tmp_path):
    """token_level_advantages with reinforce_pp and beta > 0 (one process): float64 loop written from verl b178a3c,
    apply_kl_penalty with core_algos.kl_penalty_forward("kl") (old - ref on the response tokens), the score on the last
    token, compute_reinforce_plus_plus_outcome_advantage (returns reset after EOS, masked_whiten with the unbiased
    variance, eps 1e-8); the `kl` metric is the token mean of that k1."""
    import torch.distributed as dist

    import ppo
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(3)
        N, T, beta, gamma = 5, 6, 0.2, 0.9
        lens = torch.tensor([6, 3, 1, 4, 5])
        cm = (torch.arange(T)[None] < lens[:, None]).double()  # [N, T]
        old, ref = torch.randn(N, T, generator=g, dtype=torch.float64), torch.randn(N, T, generator=g, dtype=torch.float64)
        rewards, weights = torch.randn(N, 2, generator=g, dtype=torch.float64), [1.0, 0.5]
        cfg = SimpleNamespace(advantage_estimator="reinforce_pp", gamma=gamma, lam=1.0,
                              loss=SimpleNamespace(beta=beta, kl_in_reward=False, reward_kl_estimator="k1"))
        batch = SimpleNamespace(old_logps=old, ref_logps=ref, completion_mask=cm, mask=cm.clone(), old_values=None)
        fields, metrics = ppo.token_level_advantages(cfg, rewards, weights, batch, beta, torch.device("cpu"))
    finally:
        if mine:
            dist.destroy_process_group()
    scores = torch.zeros(N, T, dtype=torch.float64)  # verl's token_level_scores: the reward on the last response token
    for i in range(N):
        scores[i, int(lens[i]) - 1] = sum(w * float(x) for w, x in zip(weights, rewards[i]))
    kld = (old - ref) * cm  # kl_penalty_forward(logprob, ref_logprob, "kl") * response_mask
    token_r = scores - beta * kld
    returns, running = torch.zeros(N, T, dtype=torch.float64), torch.zeros(N, dtype=torch.float64)
    for t in reversed(range(T)):
        running = token_r[:, t] + gamma * running
        returns[:, t] = running
        running = running * cm[:, t]
    n = cm.sum()
    mean = (returns * cm).sum() / n
    var = ((returns - mean) ** 2 * cm).sum() / n * n / (n - 1)
    want = (returns - mean) * torch.rsqrt(var + 1e-8) * cm
    torch.testing.assert_close(fields["advantages"], want, rtol=1e-9, atol=1e-9)
    assert metrics["kl"] == pytest.approx(float(kld.sum() / n), rel=1e-9)


def test_ema_of_bf16_weights_keeps_small_increments_and_swaps_back_exactly():
    """With bf16 weights, 0.008 x a one-ulp move (6e-5 at 1.0) is below bf16's resolution (0.0039 at 1.0): a bf16 EMA
    would never move. Reference: the float64 formula. ema_weights puts the EMA in and the live weights back bit for bit."""
    import optim
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    ema = optim.ema_init([("w", p)], 0.992)
    with torch.no_grad():
        p.fill_(1.0078125)  # the next bf16 value after 1.0
    for _ in range(10):
        optim.ema_update(ema, [("w", p)], 0.992)
    want = 1.0 + (1 - 0.992 ** 10) * 0.0078125  # float64
    assert ema["w"].dtype == torch.float32 and abs(ema["w"][0].item() - want) < 1e-6
    live = p.detach().clone()
    with optim.ema_weights(ema, [("w", p)]):
        assert torch.equal(p.detach(), ema["w"].to(torch.bfloat16))
    assert torch.equal(p.detach(), live)


def test_dynamic_sampling_rounds_draw_prompts_no_other_round_or_step_draws(text_dir):
    """16 rows, 2 ranks x 2 prompts a step: with --max-steps 4 the data holds exactly max_steps x prompts-per-step
    rows, where a rule tied to --max-steps re-drew a step's own prompts in its extra rounds. Step 0 takes 3 rounds,
    step 1 one (the loop's bookkeeping: the next step starts after the extra rounds, the count is checkpointed): all
    16 prompts are drawn once, for any --max-steps."""
    import numpy as np
    from transformers import AutoTokenizer

    import grpo
    tok = AutoTokenizer.from_pretrained(text_dir)
    rows = [{"prompt": f"max {i // 4} {i % 4} =", "answer": "0"} for i in range(16)]
    for max_steps in (4, 100):
        cfg = grpo.Config(max_steps=max_steps, batch_size=16, micro_batch_size=16, num_generations=8)
        drawn, extra = [], 0
        for step, rounds in ((0, 3), (1, 1)):
            for rnd in range(rounds):
                for rank in range(2):
                    run = SimpleNamespace(cfg=cfg, dp_rank=rank, world=2, tp=1, batch_ranks=1, rows=rows, processor=tok, tools={},
                                          order=np.random.default_rng(0).permutation(16), ds_extra_rounds=extra)
                    drawn += [p["row"]["prompt"] for p in grpo.sample_prompts(run, step, rnd)]
            extra += rounds - 1  # what main() adds after the step
        assert len(drawn) == 16 and sorted(drawn) == sorted(r["prompt"] for r in rows), (max_steps, drawn)


def test_informative_groups_judge_finite_rewards():
    """A group has a signal when at least two of its samples have a finite weighted reward and those differ; a sample
    every reward function skipped (NaN) is left out (its advantage is 0): the loop below is the reference."""
    import statistics

    import dynamic_sampling
    nan, inf = float("nan"), float("inf")
    groups = [[1, 1, nan, 1], [1, 0, nan, nan], [nan, nan, nan, 1], [0, 0, 0, 0], [0.5, 0.5, inf, 0.5], [2, 1, 0, 2]]
    rewards = torch.tensor([[r, r / 2 if r == r else nan] for g in groups for r in g], dtype=torch.float64)  # [24, 2]
    weights = [1.0, 2.0]
    want = []
    for i in range(len(groups)):
        totals = []
        for row in rewards[4 * i:4 * (i + 1)].tolist():
            t = sum(w * x for w, x in zip(weights, row) if x == x)
            if any(x == x for x in row) and abs(t) != inf:
                totals.append(t)
        want.append(len(totals) >= 2 and statistics.stdev(totals) > 1e-6)
    assert want == [False, True, False, False, False, True]
    assert dynamic_sampling.informative_groups(rewards, weights, 4).tolist() == want


def test_dynamic_sampling_top_up_rows_leave_every_statistic_and_denominator(text_dir):
    """tests/topup_rows_check.py: advantages (--scale-rewards batch, GDPO) and the gradient of grpo / sapo / dr_grpo
    / luspo / dapo with the top-up rows equal those of the batch without them (float64, a world of one)."""
    _, out, _ = run([sys.executable, "tests/topup_rows_check.py", text_dir], timeout=300)
    assert "TOP-UP OK" in out, out[-3000:]


def test_fill_batch_tops_up_with_masked_groups_spread_over_the_minibatches(monkeypatch):
    """dynamic_sampling.fill_batch on one process (the global reductions are the identity): 8 groups of which 2 are
    informative, and a draw that never finds another: after --dynamic-sampling-max-rounds the 6 missing groups are
    uninformative ones flagged masked (every row of them, no other row), and each of the 2 minibatches of
    --steps-per-generation 2 (batching.minibatches) holds one informative group, not both in the first."""
    import batching
    import dynamic_sampling
    monkeypatch.setattr(dynamic_sampling.distributed, "all_reduce", lambda t, dev, op=None: t)
    monkeypatch.setattr(dynamic_sampling.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dynamic_sampling.dist, "get_world_size", lambda: 1)
    G, n_groups, counts = 4, 8, {"failed": 0, "rm_truncated": 0}
    run_ = SimpleNamespace(cfg=SimpleNamespace(num_generations=G, dynamic_sampling_max_rounds=3), weights=[1.0],
                           device=torch.device("cpu"))

    def groups(rnd, good):
        samples = [{"group": (rnd, i)} for i in range(n_groups) for _ in range(G)]
        rewards = torch.tensor([[10.0 + k if i in good else 1.0] for i in range(n_groups) for k in range(G)])  # [N, 1]
        return samples, rewards
    draws = []
    samples, rewards = groups(0, good={0, 1})
    got = dynamic_sampling.fill_batch(
        run_, samples, rewards, counts, lambda rnd: draws.append(rnd) or (*groups(rnd, good=set()), {**counts, "failed": 1}))
    out, out_rewards, counts, metrics = got["samples"], got["rewards"], got["counts"], got["metrics"]
    assert draws == [1, 2] and counts["failed"] == 2 and metrics["dynamic_sampling/rounds"] == 3
    assert metrics["dynamic_sampling/masked_groups"] == 6 and metrics["frac_zero_std"] == 6 / 8
    assert len(out) == n_groups * G and out_rewards.shape == (n_groups * G, 1)
    informative = [(0, 0), (0, 1)]
    for s, r in zip(out, out_rewards[:, 0].tolist()):  # rewards travel with their samples
        assert bool(s.get("top_up")) == (s["group"] not in informative) and (r == 1.0) == bool(s.get("top_up"))
    for rows in batching.minibatches(len(out), G, 2, 1, 0):
        assert sum(out[i]["group"] in informative for i in rows.tolist()) == G  # one informative group each


def test_fill_batch_pools_each_trainers_groups_on_an_engine_serving_two(monkeypatch):
    """An engine (a world of one) holding 2 groups of each of 2 trainers: each trainer's batch is its own pool. Round 0:
    trainer 0's groups have no signal, trainer 1's both do; round 1 (the last, --dynamic-sampling-max-rounds 2):
    trainer 0's first has one. Trainer 0 keeps that one and is topped up with its first group without a signal (round
    0's first, placed first by spread); trainer 1 keeps round 0's, and none of its round 1 groups."""
    import dynamic_sampling
    monkeypatch.setattr(dynamic_sampling.distributed, "all_reduce", lambda t, dev, op=None: t)
    monkeypatch.setattr(dynamic_sampling.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dynamic_sampling.dist, "get_world_size", lambda: 1)
    G, counts = 2, {"failed": 0}
    run_ = SimpleNamespace(cfg=SimpleNamespace(num_generations=G, dynamic_sampling_max_rounds=2), weights=[1.0],
                           device=torch.device("cpu"))

    def groups(rnd, good):  # trainer 0's two groups, then trainer 1's
        samples = [{"group": (rnd, i)} for i in range(4) for _ in range(G)]
        return samples, torch.tensor([[float(k) if i in good else 1.0] for i in range(4) for k in range(G)])
    got = dynamic_sampling.fill_batch(
        run_, *groups(0, {2, 3}), counts, lambda rnd: (*groups(rnd, {0, 2, 3}), counts), pools=[0, 0, 1, 1], n_pools=2)
    out, rewards, metrics, sizes = got["samples"], got["rewards"], got["metrics"], got["sizes"]
    assert [s["group"] for s in out[::G]] == [(0, 0), (1, 0), (0, 2), (0, 3)] and sizes == {0: 2 * G, 1: 2 * G}
    assert [bool(s.get("top_up")) for s in out[::G]] == [True, False, False, False] and len(rewards) == 4 * G
    assert metrics == {"frac_zero_std": 0.5, "dynamic_sampling/rounds": 2, "dynamic_sampling/masked_groups": 1.0}


def test_no_signal_hint_prints_once(capsys):
    """frac_zero_std 1.0 for the run's first 3 steps (grpo): one console hint naming what to try; never for gae or with a
    teacher, and never once a step has had a signal (a later lull of a sharpened policy is not a run without signal)."""
    import dynamic_sampling
    make = lambda teacher="": SimpleNamespace(cfg=SimpleNamespace(advantage_estimator="grpo",  # noqa: E731
                                                                  distill=SimpleNamespace(teacher=teacher)),
                                              rank=0, no_signal_steps=0, printed_errors=set())
    run_ = make()
    for f in [1.0] * 15:
        dynamic_sampling.hint_if_no_signal(run_, f)
    out = capsys.readouterr().out
    assert out.count("no group had a learning signal") == 1 and "--num-generations" in out
    run_ = make()
    for f in [1.0, 1.0, 0.5] + [1.0] * 12:
        dynamic_sampling.hint_if_no_signal(run_, f)
    assert capsys.readouterr().out == ""
    gae = SimpleNamespace(cfg=SimpleNamespace(advantage_estimator="gae"), rank=0, no_signal_steps=0, printed_errors=set())
    distilled = make("teacher/")  # --distill.teacher: every sampled token has a signal whatever the rewards
    for r in (gae, distilled):
        for _ in range(10):
            dynamic_sampling.hint_if_no_signal(r, 1.0)
    assert capsys.readouterr().out == ""


def _token_classifier(path, dropout):
    """A tiny Qwen2 token classifier (one label) whose config asks for dropout everywhere, saved to `path`."""
    from transformers import Qwen2Config, Qwen2ForTokenClassification
    cfg = Qwen2Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, num_labels=1, classifier_dropout=dropout, attention_dropout=dropout,
                      architectures=["Qwen2ForTokenClassification"])
    torch.manual_seed(0)
    Qwen2ForTokenClassification(cfg).save_pretrained(path)
    return path


def test_critic_values_have_no_dropout(tmp_path):
    """A critic checkpoint with dropout 0.3 (HF token classifiers default to 0.1): load_critic turns it off, so values
    in train mode equal those in eval mode; ppo.values (the old values) runs the critic in eval mode whatever the
    module holds (here a dropout load_critic never saw)."""
    import models
    import ppo
    import token_logprobs
    critic = models.load_critic(_token_classifier(str(tmp_path / "c"), 0.3), dtype=torch.float64)
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    out = lambda m: m(input_ids=ids).logits  # noqa: E731
    critic.train()
    a, b = out(critic), out(critic)
    critic.eval()
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, out(critic))
    samples = [{"prompt_ids": [1, 2, 3], "completion_ids": [4, 5]}, {"prompt_ids": [1], "completion_ids": [6, 7, 8]}]
    batch = SimpleNamespace(samples=samples, T=3)
    wrapped = token_logprobs.TokenValues(critic)
    layer = wrapped.policy.model.layers[0]
    layer.mlp = torch.nn.Sequential(layer.mlp, torch.nn.Dropout(0.5))
    with torch.no_grad():
        want = wrapped.eval()(token_logprobs.collate(samples, 0, torch.device("cpu"), 3))
    wrapped.train()  # as update_critic leaves it
    got = ppo.values({"module": wrapped}, batch, 8, 0, torch.device("cpu"))
    torch.testing.assert_close(got, want)


def test_critic_with_another_tokenizer_is_refused(tmp_path, text_dir):
    """--critic.model must mean the same tokens by the same ids: another vocabulary is refused at start-up naming the
    flag, and so is a critic directory without tokenizer files (saying what to do); the policy's own tokenizer, a
    superset of its vocabulary with the same ids, and another pad id pass."""
    import tyro

    import flags
    import grpo
    import models
    other = models.build_tiny_model(str(tmp_path / "other"), chars=list("0123456789 +-=abcxyz\n"))
    same = str(tmp_path / "same")
    from transformers import AutoTokenizer
    _token_classifier(same, 0.0)
    AutoTokenizer.from_pretrained(text_dir).save_pretrained(same)
    wider, other_pad, bare = str(tmp_path / "wider"), str(tmp_path / "other_pad"), str(tmp_path / "bare")
    for d in (wider, other_pad, bare):
        _token_classifier(d, 0.0)
    tok = AutoTokenizer.from_pretrained(text_dir)
    tok.add_tokens(["<critic-only>"])  # a superset of the policy's vocabulary, the policy's ids unchanged
    tok.save_pretrained(wider)
    tok = AutoTokenizer.from_pretrained(text_dir)
    tok.pad_token = tok.convert_ids_to_tokens(5)  # another pad id: pad positions are masked, so it does not matter
    assert tok.pad_token_id != AutoTokenizer.from_pretrained(text_dir).pad_token_id
    tok.save_pretrained(other_pad)
    refused = {other: r"--critic.model .* has another tokenizer than --model .*policy tokens missing or with other ids",
               bare: r"--critic.model .*bare' has no tokenizer files .*save_pretrained\(CRITIC_DIR\)"}
    for critic in (same, wider, other_pad, bare, other):
        cfg = tyro.cli(grpo.Config, args=["--advantage-estimator", "gae", "--critic.model", critic])
        if critic not in refused:
            flags.check_critic_tokenizer(cfg, text_dir)
        else:
            with pytest.raises(ValueError, match=refused[critic]):
                flags.check_critic_tokenizer(cfg, text_dir)


def test_step_statistics_leave_the_top_up_rows_out(monkeypatch):
    """metrics.in_batch (one process, the gather is the identity): reward/mean, reward/std, the per-function
    means, completion_len/*, tokens_per_s read the rows it returns: exactly the rows not flagged top_up, and the
    weighted totals from the rewards; a step whose every row is a top-up reports them all."""
    import metrics
    monkeypatch.setattr(metrics.distributed, "all_gather_cat", lambda x: x)
    G = 2
    samples = [{"top_up": i in (2, 3)} for i in range(6)]
    rewards = torch.arange(12, dtype=torch.float32).view(6, 2)
    batch = SimpleNamespace(samples=samples, completion_mask=torch.ones(6, 3), lens=torch.arange(6) + 1,
                            truncated=torch.tensor([0, 1] * 3), topped_up=torch.tensor([s["top_up"] for s in samples]))
    got = metrics.in_batch(batch, rewards, [1.0, 0.5], torch.device("cpu"))
    rows = [i for i, s in enumerate(samples) if not s["top_up"]]
    assert got["samples"] == [samples[i] for i in rows] and torch.equal(got["rewards"], rewards[rows])
    assert got["everyone"].tolist() == [2 * i + 0.5 * (2 * i + 1) for i in rows]  # the weighted totals
    for key in ("completion_mask", "lens", "truncated"):
        assert torch.equal(got[key], getattr(batch, key)[rows])
    every = SimpleNamespace(**{**vars(batch), "topped_up": torch.ones(6, dtype=torch.bool)})
    assert len(metrics.in_batch(every, rewards, [1.0, 0.5], torch.device("cpu"))["samples"]) == 6 == G * 3


def _critic_cfg(model="", micro_batch_size=8, lr=1e-3, value_clip=10.0):
    """The config fields ppo.build_critic / update_critic read, at test settings."""
    return SimpleNamespace(
        advantage_estimator="gae", max_steps=1, steps_per_generation=1, num_iterations=1,
        micro_batch_size=micro_batch_size, micro_batch_tokens=0,
        critic=SimpleNamespace(model=model, lr=lr, weight_decay=0.0, warmup_steps=0, schedule="constant",
                               max_grad_norm=1.0, value_clip=value_clip),
        policy=SimpleNamespace(attn_implementation=None, trust_remote_code=False, gradient_checkpointing=False,
                               freeze_vision=True), optim=SimpleNamespace(betas=(0.9, 0.999)))


def _image_samples(vlm_dir, images, completion="It is", prompt="What colour is the square?"):
    """One sample per image: the same text prompt and completion, the image tensors from grpo.encode_prompt."""
    import grpo
    import models
    proc = models.load_processor(vlm_dir, True)
    comp = proc.tokenizer(completion, add_special_tokens=False)["input_ids"]
    return proc, [{**grpo.encode_prompt({"prompt": prompt, "image": im}, proc, 512),
                   "completion_ids": comp} for im in images]


def _text_critic_of(vlm_dir, path):
    """A text causal LM (Qwen2; load_critic gives it a fresh value head) that reads the tiny VLM's token ids: the
    VLM's tokenizer, saved with it."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    tok = AutoTokenizer.from_pretrained(vlm_dir)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    config = json.load(open(os.path.join(path, "tokenizer_config.json")))  # no unk token, as Qwen2.5's own files say
    json.dump({**config, "unk_token": None}, open(os.path.join(path, "tokenizer_config.json"), "w"))  # (else qwen2's 0)
    return path


def test_image_text_critic_separates_images_a_text_critic_cannot(tmp_path, vlm_dir):
    """The return depends only on the image (same prompt and completion; red -> 1, blue -> 0). The default critic of an
    image-text policy (its own architecture, fed pixel_values / image_grid_thw) learns values that separate the two
    images; a text --critic.model reads the text only (one placeholder token per image), so its values for the two are
    equal by construction, before and after the same training, whatever the image's size."""
    import torch.distributed as dist
    import tyro
    from PIL import Image
    from transformers import AutoConfig

    import flags
    import grpo
    import ppo
    text_critic = _text_critic_of(vlm_dir, str(tmp_path / "text"))  # passes grpo.py's --critic.model checks
    flags.check_critic_tokenizer(tyro.cli(grpo.Config, args=["--advantage-estimator", "gae", "--critic.model",
                                                              text_critic]), vlm_dir)
    proc, samples = _image_samples(vlm_dir, [Image.new("RGB", (56, 56), c) for c in [(255, 0, 0), (0, 0, 255)] * 2]
                                   + [Image.new("RGB", (84, 56), (255, 0, 0))])
    T, N = len(samples[0]["completion_ids"]), len(samples)
    reward = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])[:, None].expand(N, T)  # gamma 1: every token's return
    mask = torch.ones(N, T)
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        got = {}
        for name, model in [("image", ""), ("text", text_critic)]:
            cfg = _critic_cfg(model)
            critic = ppo.build_critic(cfg, vlm_dir, torch.device("cpu"), torch.distributed.fsdp.MixedPrecisionPolicy(),
                                      torch.float32, AutoConfig.from_pretrained(vlm_dir))
            rows = torch.arange(4)  # trained on the two same-size images; the fifth is only evaluated
            batch = SimpleNamespace(samples=samples, T=T, mask=mask, returns=reward, old_values=None)
            before = ppo.values(critic, batch, 8, proc.tokenizer.pad_token_id, torch.device("cpu"))
            for _ in range(25):
                batch.old_values = ppo.values(critic, batch, 8, proc.tokenizer.pad_token_id, torch.device("cpu"))
                ppo.update_critic(critic, batch, [rows], cfg, proc.tokenizer.pad_token_id, torch.device("cpu"), 1)
            got[name] = (before, ppo.values(critic, batch, 8, proc.tokenizer.pad_token_id, torch.device("cpu")))
            frozen = [n for n, p in critic["model"].named_parameters() if not p.requires_grad]
            assert (name == "image") == bool(frozen) and all(".visual." in n for n in frozen), frozen
    finally:
        if mine:
            dist.destroy_process_group()
    (_, img), (t0, txt) = got["image"], got["text"]
    print(f"image critic: red {img[0].tolist()} blue {img[1].tolist()}; text critic: {txt[0].tolist()} "
          f"{txt[1].tolist()}")
    assert img[[0, 2]].min() > img[[1, 3]].max() + 0.5  # separated: red's values near 1, blue's near 0
    for v in (t0, txt):  # the text critic: one value per token whatever the image (and its size), so it cannot separate
        assert torch.equal(v[0], v[1]) and torch.equal(v[0], v[4]) and torch.equal(v[0], v[2])
    assert (txt[0] - 0.5).abs().max() < 0.25  # it learns the mean return instead


def test_gae_with_an_image_text_policy_on_2_ranks_resumes_and_its_critic_reloads(tmp_path, vlm_dir):
    """GAE end to end on 2 ranks with a tiny Qwen2.5-VL and an image dataset (HF engine): its own-architecture critic
    trains; 4 steps straight == its step-2 checkpoint + --resume for 2 more (critic weights and step 3-4 metrics
    identical); the checkpoint's critic/ passes the --critic.model checks, loads as a trained one-label image-text
    critic (its weights exactly), and starts a run as --critic.model (first values not the fresh head's zeros)."""
    import json
    import shutil

    import tyro
    from PIL import Image

    import flags
    import grpo
    import models
    rows = []
    for i, colour in enumerate([(255, 0, 0), (0, 0, 255)]):
        Image.new("RGB", (56, 56), colour).save(tmp_path / f"img{i}.png")
        rows.append({"prompt": [{"role": "user", "content": "What colour is the square?"}], "image": f"img{i}.png"})
    data = tmp_path / "images.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows * 8))
    common = ["--model", vlm_dir, "--dataset", str(data), "--num-generations", "4", "--batch-size", "8",
              "--data.rewards", "rewards_for_tests:length_fraction", "--advantage-estimator", "gae",
              "--critic.lr", "1e-3",
              "--rollout.engine", "hf", "--rollout.max-completion-length", "8", *QUIET]
    a, b, c = (str(tmp_path / x) for x in "abc")
    torchrun("grpo.py", "--output-dir", a, "--max-steps", "4", "--checkpoint.every", "2", *common, timeout=600)
    os.makedirs(b)  # the interrupted run: the straight run's state at step 2
    shutil.copytree(os.path.join(a, "checkpoint-2"), os.path.join(b, "checkpoint-2"))
    with open(os.path.join(a, "metrics.jsonl")) as f, open(os.path.join(b, "metrics.jsonl"), "w") as g:
        g.writelines(f.readlines()[:2])
    _, log, _ = torchrun("grpo.py", "--output-dir", b, "--max-steps", "4", "--checkpoint.every", "2", "--resume",
                         "latest", *common, timeout=600)
    assert "checkpoint-2 at step 2" in log
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in rb] == [1, 2, 3, 4]
    assert ra[0]["critic/value_mean"] == 0.0 and all(r["critic/loss"] > 0 for r in ra)  # the fresh head, then training
    skip = ("time/", "tokens_per_s", "mem/", "sync/")  # (sync/bytes: the resumed engine's first sync sends it all)
    kept = lambda r: {k: v for k, v in r.items() if not k.startswith(skip)}  # noqa: E731
    assert [kept(r) for r in ra[2:]] == [kept(r) for r in rb[2:]]
    pa, pb = (load_file(os.path.join(d, "checkpoint-4", "critic", "model.safetensors")) for d in (a, b))
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    saved_dir = os.path.join(a, "checkpoint-2", "critic")
    args = ["--advantage-estimator", "gae", "--critic.model", saved_dir]
    flags.check_critic_tokenizer(tyro.cli(grpo.Config, args=args), vlm_dir)
    critic = models.load_critic(saved_dir)
    assert models.is_image_text(critic.config) and critic.score.weight.abs().sum() > 0
    critic.save_pretrained(tmp_path / "again")  # saved again: the same tensors under the same names (none left fresh)
    saved, again = (load_file(os.path.join(d, "model.safetensors")) for d in (saved_dir, tmp_path / "again"))
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)
    policy_keys = set(load_file(os.path.join(vlm_dir, "model.safetensors")))  # the policy checkpoint's layout
    assert set(saved) - {"score.weight", "score.bias"} == policy_keys - {"lm_head.weight"} and "score.weight" in saved
    torchrun("grpo.py", "--output-dir", c, "--max-steps", "1", "--critic.model", saved_dir, *common, timeout=600)
    assert metrics(c)[0]["critic/value_mean"] != 0.0


def test_image_text_critic_gradient_invariant_to_ranks_and_micro_batches(tmp_path, vlm_dir):
    """One image-text critic update (float64, vision tower trained too, images of two sizes, one masked row) on 2 ranks
    x micro-batches of 3 rows equals one process with the whole minibatch as one micro-batch: every weight's change
    and the logged critic metrics (tests/dist_critic_images.py)."""
    ref = str(tmp_path / "ref.pt")
    run([sys.executable, "tests/dist_critic_images.py", vlm_dir, ref, "ref"], timeout=300)
    _, out, _ = torchrun("tests/dist_critic_images.py", vlm_dir, ref, "check", timeout=300)
    for r in (0, 1):
        assert f"rank {r} CRITIC IMAGES INVARIANT OK" in out, out[-3000:]


def test_image_batches_give_each_sample_its_own_image(vlm_dir):
    """Samples whose prompts have the same ids (same text, same image size) but other images, with another prompt
    between them: collate puts equal prompts in adjacent rows, so the image tensors must follow the rows. Each sample's
    log-probs (policy) and values (image-text critic) in one batch equal those of the sample alone, a text-only row
    (an image dataset may mix them) included."""
    from PIL import Image

    import models
    import token_logprobs
    proc, samples = _image_samples(vlm_dir, [Image.new("RGB", (56, 56), c) for c in [(255, 0, 0), (0, 255, 0)]])
    other = _image_samples(vlm_dir, [Image.new("RGB", (56, 56), (0, 0, 0))], prompt="Is it red?")[1]
    import grpo
    text = {**grpo.encode_prompt({"prompt": "Say a colour."}, proc, 512), "completion_ids": samples[0]["completion_ids"]}
    samples = [samples[0], other[0], text, samples[1]]  # red, black (another prompt), a text-only row, green
    assert samples[0]["prompt_ids"] == samples[3]["prompt_ids"] != samples[1]["prompt_ids"] and "mm" not in text
    policy, _ = models.load_policy(vlm_dir, dtype=torch.float64)
    critic = models.load_critic(vlm_dir, dtype=torch.float64)
    torch.nn.init.normal_(critic.score.weight, std=0.05, generator=torch.Generator().manual_seed(0))
    T, pad, cpu = len(samples[0]["completion_ids"]), proc.tokenizer.pad_token_id, torch.device("cpu")
    batch = lambda ss: token_logprobs.collate(ss, pad, cpu, T, proc.image_token_id)  # noqa: E731
    with torch.no_grad():
        for module, out in [(token_logprobs.TokenLogprobs(policy), lambda m, b: m(b, 1.0)[0]),
                            (token_logprobs.TokenValues(critic), lambda m, b: m(b))]:
            together = out(module, batch(samples))  # [4, T]
            alone = torch.cat([out(module, batch([s])) for s in samples])  # [4, T]
            torch.testing.assert_close(together, alone, rtol=1e-9, atol=1e-9)
