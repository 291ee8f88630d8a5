"""On-policy distillation (--distill.teacher): the per-token advantage against a transcription of a reference
implementation, a student equal to its teacher, the teacher's refusals, and short real runs (HF engine, 2 ranks).
The gradient's invariance to ranks and micro-batches: the "distill" case of tests/dist_invariance.py."""
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import tyro

from conftest import torchrun
from test_grpo import metrics


def tinker_incorporate_kl_penalty(advantages_D, sampled_logprobs_D, teacher_logprobs_D, masks_D, kl_penalty_coef,
                                  kl_discount_factor=0.0):
    """A float64 transcription of incorporate_kl_penalty from thinking-machines-lab/tinker-cookbook,
    tinker_cookbook/distillation/train_on_policy.py at commit 9dfcc3a2cf44432d621a01005073dc6d76a1e87a (lines 54-131),
    at its defaults (kl_discount_factor 0: no discount). Per datum: reverse_kl = (sampled - teacher) * mask;
    advantages += -coef * mask * reverse_kl; the logged teacher_kl = sum(reverse_kl) / sum(mask) over the batch.
    (tinker's teacher log-probs carry one leading entry for the first prompt token, dropped there with [1:]; here the
    lists hold the completion tokens only.)"""
    reverse_kl = [[(s - t) * m for s, t, m in zip(S, Tt, M)]
                  for S, Tt, M in zip(sampled_logprobs_D, teacher_logprobs_D, masks_D)]
    assert kl_discount_factor == 0.0
    out = [[a + (-kl_penalty_coef * m * k) for a, m, k in zip(A, M, K)]
           for A, M, K in zip(advantages_D, masks_D, reverse_kl)]
    teacher_kl = sum(sum(k) for k in reverse_kl) / sum(sum(m) for m in masks_D)
    return out, teacher_kl


@pytest.fixture
def world_of_one(tmp_path):
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def distill_batch(g, N=6, T=5):
    """A batch with a multi-turn row (inserted tokens in the middle) and a dynamic-sampling top-up row."""
    import batching
    cm = (torch.arange(T)[None] < torch.tensor([5, 3, 1, 4, 5, 2])[:, None]).double()  # [N, T]
    cm[0, 1:3] = 0  # an episode: two inserted tool tokens
    samples = [{"completion_ids": [1] * int(n)} for n in (5, 3, 1, 4, 5, 2)]
    samples[5]["top_up"] = True  # a top-up row: outside the loss and the metric
    lp = lambda: torch.randn(N, T, generator=g, dtype=torch.float64) - 2  # noqa: E731
    return batching.Batch(samples, completion_mask=cm, mask=cm.clone(), engine_logps=lp(), truncated=torch.zeros(N, dtype=bool),
                          fresh=torch.ones_like(cm), old_logps=lp(), teacher_logps=lp())


@pytest.mark.parametrize("token_level", [False, True])
def test_distill_advantages_equal_tinker_cookbooks_formula(world_of_one, token_level):
    """grpo.distill_advantages (losses.distill_advantages) on [N] (grpo) and [N, T] (gae) reward advantages equals the
    transcription, with the trainer's old log-probs as the sampled log-probs; zero on inserted tool tokens, padding
    and top-up rows; distill/reverse_kl is tinker's teacher_kl."""
    import grpo
    g = torch.Generator().manual_seed(0)
    batch = distill_batch(g)
    N, T = batch.completion_mask.shape
    reward_adv = torch.randn(N, T, generator=g, dtype=torch.float64) if token_level else torch.randn(N, generator=g, dtype=torch.float64)
    run = SimpleNamespace(cfg=SimpleNamespace(distill=SimpleNamespace(coef=0.7)), device=torch.device("cpu"))
    batch.advantages = reward_adv
    fields = m = grpo.distill_advantages(run, batch)
    mask = batch.completion_mask.clone()
    mask[5] = 0  # tinker's mask: the sampled tokens of the datums that train
    per_token = reward_adv if token_level else reward_adv[:, None].expand(N, T)
    want, teacher_kl = tinker_incorporate_kl_penalty(per_token.tolist(), batch.old_logps.tolist(),
                                                     batch.teacher_logps.tolist(), mask.tolist(), 0.7)
    assert fields["advantages"].shape == (N, T) and fields["advantages"].dtype == torch.float64
    torch.testing.assert_close(fields["advantages"], torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-15)
    assert m["distill/reverse_kl"] == pytest.approx(teacher_kl, rel=1e-12)
    distill_part = fields["advantages"] - per_token
    assert (distill_part[0, 1:3] == 0).all() and (distill_part[5] == 0).all() and (distill_part[2, 1:] == 0).all()


def test_a_student_equal_to_its_teacher_gets_exactly_zero(world_of_one):
    """Same log-probs -> every distillation advantage is exactly 0 and so is the metric (no epsilon anywhere)."""
    import grpo
    batch = distill_batch(torch.Generator().manual_seed(1))
    batch.teacher_logps = batch.old_logps.clone()
    run = SimpleNamespace(cfg=SimpleNamespace(distill=SimpleNamespace(coef=3.0)), device=torch.device("cpu"))
    batch.advantages = torch.zeros(6, dtype=torch.float64)
    fields = m = grpo.distill_advantages(run, batch)
    assert torch.equal(fields["advantages"], torch.zeros(6, 5, dtype=torch.float64)) and m["distill/reverse_kl"] == 0.0


def parse(tmp_path, *flags):
    import grpo
    return tyro.cli(grpo.Config, args=["--output-dir", str(tmp_path / "out"), *flags])


def test_teacher_flags_are_refused_by_name(tmp_path, text_dir):
    """--distill.coef without a teacher, a coef <= 0, a missing teacher, --dynamic-sampling (it would drop the groups
    whose rewards agree, distillation signal and all): one message naming the flag."""
    import flags
    import grpo
    rows = [{"prompt": "q 1 =", "answer": "1"}]
    for args, text in [(["--distill.coef", "0.5"], "--distill.coef 0.5 weights the distillation advantage, which needs a teacher"),
                       (["--distill.teacher", text_dir, "--distill.coef", "0"], "--distill.coef 0.0 must be > 0"),
                       (["--distill.teacher", str(tmp_path / "nope")], "--distill.teacher"),
                       (["--distill.teacher", str(tmp_path / "t.gguf")], "no such GGUF file"),
                       (["--distill.teacher", text_dir, "--dynamic-sampling"], "Drop --dynamic-sampling")]:
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            flags.validate(parse(tmp_path, "--model", text_dir, *args), rows)
        assert text in str(e.value), str(e.value)
    flags.validate(parse(tmp_path, "--model", text_dir, "--distill.teacher", text_dir), rows)  # accepted


def test_a_teacher_with_another_tokenizer_is_refused_before_any_collective(tmp_path, text_dir, vlm_dir):
    """launch.teacher_path_for (every rank, before init): another vocabulary -> one message saying what would be
    needed; a text teacher for an image-text student (and the reverse) -> refused; the same tokenizer -> its path."""
    import launch
    import models
    other = models.build_tiny_model(str(tmp_path / "other"), chars=list("0123456789abcdefghij +-=?"))
    cfg = parse(tmp_path, "--model", text_dir, "--distill.teacher", other)
    with pytest.raises(ValueError) as e:
        launch.teacher_path_for(cfg, text_dir)
    msg = str(e.value)
    assert msg.startswith(f"--distill.teacher {other!r} has another tokenizer than --model {text_dir!r} (")
    assert "student tokens missing or with other ids" in msg and "the same bos/eos/unk" in msg and "GOLD" in msg
    for student, teacher in ((vlm_dir, text_dir), (text_dir, vlm_dir)):
        with pytest.raises(ValueError, match="the teacher must read the student's inputs"):
            launch.teacher_path_for(parse(tmp_path, "--model", student, "--distill.teacher", teacher), student)
    same = models.build_tiny_model(str(tmp_path / "same"), seed=1)
    assert launch.teacher_path_for(parse(tmp_path, "--distill.teacher", same), text_dir) == same
    assert launch.teacher_path_for(parse(tmp_path), text_dir) is None


RUN = ["grpo.py", "--rollout.engine", "hf", "--batch-size", "16", "--micro-batch-size", "8", "--eval.every", "0",
       "--optim.weight-decay", "0"]


def test_distillation_runs_on_two_ranks_and_resumes_exactly(tmp_path):
    """builtin:tiny distilled from a second tiny model (seed 1: the same tokenizer) with the task reward, HF engine,
    2 ranks, 2 steps: distill/reverse_kl and time/teacher every step. Resumed from checkpoint-1, step 2 repeats the
    uninterrupted run's metrics (the teacher is rebuilt from its flag; nothing of it is in the checkpoint)."""
    import models
    teacher = models.build_tiny_model(str(tmp_path / "teacher"), seed=1)
    out = str(tmp_path / "run")
    flags = [*RUN, "--output-dir", out, "--max-steps", "2", "--distill.teacher", teacher, "--checkpoint.every", "1"]
    torchrun(*flags, timeout=400)
    full = [r for r in metrics(out) if "loss" in r]
    assert [r["step"] for r in full] == [1, 2]
    assert all(r["distill/reverse_kl"] > 0 and r["time/teacher"] > 0 for r in full), full
    shutil.rmtree(os.path.join(out, "checkpoint-2"))
    torchrun(*flags, "--resume", "latest", timeout=400)
    resumed = [r for r in metrics(out) if "loss" in r]
    assert [r["step"] for r in resumed] == [1, 2]
    for k in ("distill/reverse_kl", "loss", "reward/mean", "grad_norm"):
        assert resumed[1][k] == pytest.approx(full[1][k], rel=1e-6, abs=1e-9), (k, resumed[1][k], full[1][k])


def test_a_student_distilled_from_itself_has_zero_reverse_kl_and_no_gradient(tmp_path):
    """Distillation alone (--data.reward-weights 0) from a teacher with the student's weights (builtin:tiny is
    build_tiny_model with --seed 0): the sharded teacher and student score every sampled token alike, so the reverse
    KL is exactly 0, every advantage is 0 and nothing moves (loss 0 at every step)."""
    import models
    teacher = models.build_tiny_model(str(tmp_path / "teacher"), seed=0)
    out = str(tmp_path / "run")
    torchrun(*RUN, "--output-dir", out, "--max-steps", "2", "--distill.teacher", teacher, "--data.reward-weights", "0",
             timeout=400)
    rows = [r for r in metrics(out) if "loss" in r]
    assert len(rows) == 2 and all(r["distill/reverse_kl"] == 0.0 and r["loss"] == 0.0 for r in rows), rows


def test_distillation_with_tool_episodes_on_an_inference_rank(tmp_path):
    """1 trainer + 1 generator (HF engine), calculator tool episodes from builtin:tiny-tools, its own checkpoint as the
    teacher: the teacher runs on the trainer and scores the episodes' tokens as the student does, so the reverse KL
    over the model's tokens is exactly 0 at both steps (no calculator answer is right this early: every reward is 0,
    so no update moves the student away from its teacher)."""
    import launch
    teacher = launch.tiny_tools_path()
    out = str(tmp_path / "run")
    torchrun("grpo.py", "--model", "builtin:tiny-tools", "--dataset", "calculator", "--rollout.engine", "hf",
             "--rollout.max-completion-length", "64", "--rollout.inference-ranks", "1", "--batch-size", "8",
             "--num-generations", "4", "--micro-batch-size", "8", "--max-steps", "2", "--eval.every", "0",
             "--optim.lr", "5e-3", "--output-dir", out, "--overwrite", "--distill.teacher", teacher, timeout=400)
    rows = [r for r in metrics(out) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["distill/reverse_kl"] == 0.0 for r in rows), rows
    assert all(r["time/teacher"] > 0 for r in rows) and sum(r["tool_calls/mean"] for r in rows) > 0, rows
