"""PPO with a critic (GAE), REINFORCE++, EMA, DAPO dynamic sampling and the ptx loss: grpo.py end to end on tiny
models (the advantage math itself is checked against float64 references in test_losses.py, and its invariance to
ranks in dist_invariance.py)."""
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import run, torchrun
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
    torchrun("grpo.py", "--output-dir", out, "--advantage-estimator", estimator, "--critic.lr", "1e-3",
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
    (e_0 = the initial model); --eval.use-ema evaluates with it and the live weights come back for training."""
    out, d = str(tmp_path / "ema"), 0.6
    run([sys.executable, "grpo.py", "--output-dir", out, "--max-steps", "4", "--ema.decay", str(d), "--optim.lr", "1e-2",
         "--checkpoint.every", "1", "--checkpoint.keep", "0", "--eval.every", "2", "--eval.use-ema",
         "--eval.num-prompts", "8", *QUIET], timeout=600)
    load = lambda *p: {k: v.double() for k, v in load_file(os.path.join(out, *p, "model.safetensors")).items()}  # noqa: E731
    e = load("builtin-tiny", "rank0")
    for k in range(1, 5):
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
         "--optim.warmup-steps", "0", *QUIET], timeout=600)
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
    """r_t = -beta KL_t on each completion token, plus the sequence reward on the last one (float64 loop)."""
    import ppo
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([3, 5, 1, 0])
    cm = (torch.arange(5)[None] < lens[:, None]).double()
    rewards, kl, beta = torch.randn(4, generator=g, dtype=torch.float64), torch.rand(4, 5, generator=g, dtype=torch.float64), 0.3
    want = torch.zeros(4, 5, dtype=torch.float64)
    for i in range(4):
        for t in range(int(lens[i])):
            want[i, t] = -beta * float(kl[i, t]) + (float(rewards[i]) if t == lens[i] - 1 else 0.0)
    torch.testing.assert_close(ppo.token_rewards(rewards, lens, cm, kl * cm, beta), want)
    torch.testing.assert_close(ppo.token_rewards(rewards, lens, cm), want + beta * kl * cm)  # no KL term


def test_ema_of_bf16_weights_keeps_small_increments_and_swaps_back_exactly():
    """With bf16 weights, 0.008 x a one-ulp move (6e-5 at 1.0) is below bf16's resolution (0.0039 at 1.0): a bf16 EMA
    would never move. Reference: the float64 formula. ema_weights puts the EMA in and the live weights back bit for bit."""
    import plumbing
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    ema = plumbing.ema_init([("w", p)], 0.992)
    with torch.no_grad():
        p.fill_(1.0078125)  # the next bf16 value after 1.0
    for _ in range(10):
        plumbing.ema_update(ema, [("w", p)], 0.992)
    want = 1.0 + (1 - 0.992 ** 10) * 0.0078125  # float64
    assert ema["w"].dtype == torch.float32 and abs(ema["w"][0].item() - want) < 1e-6
    live = p.detach().clone()
    with plumbing.ema_weights(ema, [("w", p)]):
        assert torch.equal(p.detach(), ema["w"].to(torch.bfloat16))
    assert torch.equal(p.detach(), live)
