"""docs/compatibility.md cannot drift from the code: every cell's flags go through the real validation (flags.validate
on a parsed grpo.Config, plus the critic loader for gae); refused cells must be
refused with their text, every other cell accepted, and every test a cell names must exist."""
import json
import os
import re

import pytest
import tyro

from conftest import torchrun
from test_grpo import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what each row/column of the table turns on (on top of the baseline: text, single-turn, grpo, vLLM, TP 1, colocated)
FEATURES = {"colocated": [], "grpo": [], "rloo": ["--advantage-estimator", "rloo"],
            "gae": ["--advantage-estimator", "gae"], "reinforce_pp": ["--advantage-estimator", "reinforce_pp"],
            "dynamic sampling": ["--dynamic-sampling"], "LoRA": ["--lora.r", "8"],
            "EMA evaluation": ["--ema.decay", "0.9", "--eval.use-ema"], "image-text": [],  # the model and rows do it
            "multi-turn": ["--data.tools", "tools_for_tests:multiply"], "HF engine": ["--rollout.engine", "hf"],
            "TP > 1": ["--rollout.engine", "vllm", "--vllm.tp", "2"],
            "inference ranks": ["--rollout.inference-ranks", "1"],
            "distillation": ["--distill.teacher", "MODEL"]}  # the student's own checkpoint: the same tokenizer
CELLS = {("TP > 1", "inference ranks"): ["--rollout.inference-ranks", "2"],  # a cell's own flags, where it needs any
         ("HF engine", "TP > 1"): ["--rollout.engine", "hf"]}


def table():
    """docs/compatibility.md -> {(row, column): cell text}."""
    text = open(os.path.join(ROOT, "docs", "compatibility.md")).read().split("\n\n| capability |", 1)[1]
    lines = ["| capability |" + text.split("\n\n", 1)[0]]  # the first table: the grid
    lines = lines[0].splitlines()
    split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    columns = split(lines[0])[1:]
    return {(row[0], col): cell for row in map(split, lines[2:]) for col, cell in zip(columns, row[1:])}


def test_the_table_covers_every_pair_it_names():
    cells = table()
    rows, columns = {r for r, _ in cells}, {c for _, c in cells}
    assert len(cells) == 12 * 6 and rows | columns <= set(FEATURES), sorted(rows | columns)
    bad = [(k, v) for k, v in cells.items() if not re.fullmatch(r'tested \(`\w+`.*\)|refused: ".+"|accepted, untested|—', v)]
    assert not bad, bad


def test_named_tests_exist():
    source = "".join(open(os.path.join(ROOT, "tests", f)).read() for f in os.listdir(os.path.join(ROOT, "tests"))
                     if f.startswith("test_") and f.endswith(".py"))
    names = {m.group(1) for cell in table().values() if (m := re.match(r"tested \(`(\w+)`", cell))}
    assert names and not [n for n in names if f"def {n}(" not in source]


def validate_cell(row, col, tmp_path, text_dir, vlm_dir, monkeypatch):
    """The real checks on the cell's flags: flags.validate, and for gae the critic loader (it refuses at setup)."""
    import flags
    import grpo
    import models
    image = "image-text" in (row, col)
    cell = [(vlm_dir if image else text_dir) if f == "MODEL" else f
            for f in FEATURES[row] + FEATURES[col] + CELLS.get((row, col), [])]
    monkeypatch.setenv("WORLD_SIZE", "3" if "inference ranks" in (row, col) else "2")
    cfg = tyro.cli(grpo.Config, args=["--output-dir", str(tmp_path / f"{row}-{col}"), "--model",
                                      vlm_dir if image else text_dir, *cell])
    rows = [{"prompt": [{"role": "user", "content": "3*4?"}], "answer": "12", **({"image": "x.png"} if image else {})}]
    flags.validate(cfg, rows)
    if cfg.advantage_estimator == "gae":
        models.load_critic(cfg.critic.model or cfg.model)


@pytest.mark.parametrize("cell", sorted(k for k, v in table().items() if v != "—"), ids=" x ".join)
def test_each_cell_is_refused_or_accepted_as_the_table_says(cell, tmp_path, text_dir, vlm_dir, monkeypatch):
    text = table()[cell]
    if text.startswith("refused"):
        with pytest.raises(ValueError) as e:
            validate_cell(*cell, tmp_path, text_dir, vlm_dir, monkeypatch)
        assert text.split('"', 1)[1][:-1] in str(e.value), (cell, str(e.value))
    else:
        validate_cell(*cell, tmp_path, text_dir, vlm_dir, monkeypatch)


# ---- Combined end-to-end runs: each turns several capabilities on at once; the table's cells name them ----

COMBO = ["--max-steps", "3", "--num-generations", "4", "--batch-size", "8", "--optim.lr", "5e-2",
         "--log.completions-every", "0", "--log.no-progress"]
# EMA ~ the initial weights (decay 1 - 1e-6), evaluated at step 2: its greedy evaluation must equal step 0's
EMA_EVAL = ["--ema.decay", "0.999999", "--eval.use-ema", "--eval.every", "2"]
# rewards_for_tests:answer_parity: even answers -> a group that agrees, odd -> 0, 1, 0, 1 (whatever was sampled)
DYNAMIC = ["--dynamic-sampling", "--dynamic-sampling-max-rounds", "4", "--data.rewards",
           "rewards_for_tests:answer_parity"]


def image_rows(tmp_path, held_out=0):
    """Four coloured squares, each 8 times; then `held_out` rows of other colours (the held-out rows: a question that
    is also a training row's is not evaluated)."""
    from PIL import Image
    rows, held = [], []
    for i, colour in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255), (200, 200, 0)] + [(0, 40 * k, 90) for k in
                                                                                          range(held_out)]):
        Image.new("RGB", (56, 56), colour).save(tmp_path / f"img{i}.png")
        (rows if i < 4 else held).append({"prompt": [{"role": "user", "content": "What colour is the square?"}],
                                          "image": f"img{i}.png", "answer": str(i)})
    (tmp_path / "images.jsonl").write_text("\n".join(json.dumps(r) for r in rows * 8 + held))
    return str(tmp_path / "images.jsonl")


def check_combined(out, ema=False, dynamic=False):
    """3 steps, the engine's log-probs of its samples == the trainer's every step (the weights synced under the
    combination); EMA evaluation: step 2's greedy evaluation == step 0's (the EMA ~ the initial weights; the live
    weights, 2 updates at lr 5e-2 later, answer differently) and step 3's samples again match the live weights;
    dynamic sampling: no zero-signal group reached the loss, every kept group an alternating one (reward mean 0.5)."""
    rows = {r["step"]: r for r in metrics(out)}
    assert [s for s in rows if s > 0] == [1, 2, 3]
    assert all(rows[s]["logprob_mismatch/mean_abs"] <= 1e-3 for s in (1, 2, 3)), rows
    if ema:  # tests/eval_dump.py recorded each evaluation: step 2's completions and log-probs == step 0's, every rank
        assert "eval/reward" in rows[0] and "eval/reward" in rows[2]
        dumps = [[json.loads(x) for x in open(os.path.join(out, f))] for f in os.listdir(out) if f.startswith("eval-")]
        assert dumps and all(len(d) == 2 for d in dumps), dumps
        pairs = [(a, b) for step0, step2 in dumps for a, b in zip(step0, step2, strict=True)]
        assert pairs and all(a[0] == b[0] for a, b in pairs), pairs  # the same greedy texts
        assert max(abs(x - y) for a, b in pairs for x, y in zip(a[1], b[1], strict=True)) < 1e-4, pairs
    if dynamic:
        assert all(rows[s]["frac_zero_std/in_loss"] == 0.0 and rows[s]["reward/mean"] == 0.5 for s in (1, 2, 3))
        assert max(rows[s]["dynamic_sampling/rounds"] for s in (1, 2, 3)) >= 2


def parity_tool_rows(tmp_path):
    """Calculator questions (what builtin:tiny-tools was warmed up on), three with even and three with odd products in
    turn: answer_parity then gives both groups that agree and groups with a signal (most products are even)."""
    import tasks
    rows = tasks.calculator_task(200, 0)
    even, odd = ([r for r in rows if int(r["answer"]) % 2 == p][:3] for p in (0, 1))
    path = tmp_path / "parity.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": r["prompt"][0]["content"], "answer": r["answer"]})
                               for pair in zip(even, odd) for r in pair))
    return str(path)


def test_combined_tp2_multi_turn_rloo_lora_dynamic_sampling_ema_eval(tmp_path, tool_model):
    """2 ranks, one vLLM engine at --vllm.tp 2, tool-calling episodes, rloo, LoRA, dynamic sampling, EMA evaluation."""
    out, tool_rows = str(tmp_path / "run"), parity_tool_rows(tmp_path)
    torchrun("tests/eval_dump.py", "--model", tool_model, "--dataset", tool_rows, "--output-dir", out, "--data.tools",
             "tools_for_tests:multiply", "--rollout.max-turns", "3", "--rollout.max-completion-length", "64",
             "--vllm.max-model-len", "512", "--micro-batch-size", "8", "--rollout.engine", "vllm", "--vllm.tp", "2",
             "--advantage-estimator", "rloo", "--lora.r", "8", "--eval.num-prompts", "2", *DYNAMIC, *EMA_EVAL, *COMBO,
             timeout=600)
    check_combined(out, ema=True, dynamic=True)
    assert metrics(out)[1]["tool_calls/mean"] > 0.5  # the warmed-up model calls its tool (lr 5e-2 may unlearn it later)
    import models
    lora = models.load_policy(tool_model, lora=models.LoraConfig(r=8))[0]  # the adapter sync, the default: every
    adapter_bytes = sum(p.numel() * 4 for n, p in lora.named_parameters() if "lora_" in n)  # sync sends the adapter
    assert {r.get("sync/bytes", 0) for r in metrics(out)} - {0} == {adapter_bytes}, (adapter_bytes, metrics(out))
    # each evaluation's own sync (the baseline's: the first adapter; step 2's: the EMA's) is counted where it ran
    assert [r.get("eval/sync_bytes") for r in metrics(out) if "eval/reward" in r] == [adapter_bytes] * 2, metrics(out)


def test_combined_image_text_hf_engine_rloo_lora_dynamic_sampling_ema_eval(tmp_path, vlm_dir):
    """2 ranks, tiny Qwen2.5-VL on an image dataset, the HF engine, rloo, LoRA, dynamic sampling, EMA evaluation."""
    out = str(tmp_path / "run")
    torchrun("tests/eval_dump.py", "--model", vlm_dir, "--dataset", image_rows(tmp_path, 4), "--output-dir", out,
             "--rollout.engine", "hf", "--advantage-estimator", "rloo", "--lora.r", "8", "--eval.num-prompts", "4",
             *DYNAMIC, *EMA_EVAL, *COMBO, timeout=600)
    check_combined(out, ema=True, dynamic=True)


def check_async(out, staleness=0):
    """Inference ranks: no sample staler than S (and none spanning more than S + 1 versions), and the generators'
    engine scores the weight probe like the trainers (an image-text policy's placeholder tokens included: both sides
    score it without their logit bias)."""
    rows = [r for r in metrics(out) if r["step"] > 0]
    assert all(r["async/staleness_max"] <= staleness and 0 <= r["async/probe_mismatch"] < 1e-3 for r in rows), rows
    assert all(r.get("async/version_spread_max", 0) <= staleness for r in rows), rows


def test_combined_inference_ranks_image_text_lora(tmp_path, vlm_dir):
    """1 trainer + 1 generator (vLLM), tiny Qwen2.5-VL on an image dataset, reinforce_pp, LoRA."""
    out = str(tmp_path / "run")
    torchrun("grpo.py", "--model", vlm_dir, "--dataset", image_rows(tmp_path), "--output-dir", out,
             "--rollout.inference-ranks", "1", "--rollout.max-staleness", "0", "--advantage-estimator", "reinforce_pp",
             "--lora.r", "8", "--data.rewards", "rewards_for_tests:async_alternating", *COMBO, timeout=600)
    check_combined(out)
    check_async(out)


@pytest.mark.parametrize("episodes", [False, True], ids=["single-turn", "episodes"])
def test_combined_inference_ranks_inflight_image_text_lora(tmp_path, vlm_dir, episodes):
    """1 trainer + 1 generator (vLLM), S = 1, --rollout.inflight-updates 2, tiny Qwen2.5-VL (ending a turn on a quarter
    of its tokens) on image prompts, single-turn or in 3-turn environment episodes, rloo, LoRA. tests/inflight_forced.py
    makes each batch that began a version behind load the step's version between chunks, so completions continue
    under new weights (an image prompt as token ids), mid-turn or at an episode's later turn. Every token keeps the
    version that sampled it (-1 exactly on the inserted environment tokens) and its engine log-prob: the tokens of
    the step's version match the trainer's (<= 1e-3, every step), and versions change mid-turn and (episodes) at a
    later turn (a turn's tokens all labelled with its first version passed the rest). (The environment makes each
    episode's prompt from the row's prompt text: rows with a text prompt.)"""
    from tiny_models import stopping_copy
    out, rows = str(tmp_path / "run"), [json.loads(x) for x in open(image_rows(tmp_path))]
    (tmp_path / "env.jsonl").write_text("\n".join(json.dumps({**r, "prompt": r["prompt"][0]["content"]}) for r in rows))
    torchrun("tests/inflight_forced.py", "--model", stopping_copy(vlm_dir, tmp_path / "vlm", every=4), "--dataset",
             str(tmp_path / ("env.jsonl" if episodes else "images.jsonl")), "--output-dir", out,
             "--rollout.inference-ranks", "1", "--rollout.max-staleness", "1", "--rollout.inflight-updates", "2",
             *(["--env", "tools_for_tests:make_counting_env", "--rollout.max-turns", "3", "--data.rewards", "env"]
               if episodes else ["--data.rewards", "rewards_for_tests:async_alternating"]),
             "--rollout.max-completion-length", "24", "--advantage-estimator", "rloo", "--lora.r", "8",
             "--eval.every", "0", *COMBO, timeout=600)
    check_combined(out)
    check_async(out, staleness=1)
    received = [json.loads(x) for x in open(os.path.join(out, "received-rank0.jsonl"))]
    for r in received:
        assert all([x >= 0 for x in v] == [bool(m) for m in (mask or [1] * len(v))]
                   for v, mask in zip(r["versions"], r["masks"], strict=True))
    assert any(0 in (mask or []) for r in received for mask in r["masks"]) == episodes  # inserted tokens: turns
    changes = set()  # where a completion's version changed: between two sampled tokens (mid-turn), or across inserted
    for v in (v for r in received for v in r["versions"]):  # ones
        sampled = [(i, x) for i, x in enumerate(v) if x >= 0]
        changes |= {"across" if j > i + 1 else "mid" for (i, x), (j, y) in zip(sampled, sampled[1:]) if x != y}
    assert changes == ({"mid", "across"} if episodes else {"mid"}), received


def test_combined_tp2_image_text_reinforce_pp(tmp_path, vlm_dir):
    """2 ranks, one vLLM engine at --vllm.tp 2 fed the images, tiny Qwen2.5-VL, reinforce_pp."""
    out = str(tmp_path / "run")
    torchrun("grpo.py", "--model", vlm_dir, "--dataset", image_rows(tmp_path), "--output-dir", out, "--rollout.engine",
             "vllm", "--vllm.tp", "2", "--advantage-estimator", "reinforce_pp", "--data.rewards",
             "rewards_for_tests:async_alternating", *COMBO, timeout=600)
    check_combined(out)


def test_combined_inference_ranks_tp2_gae_dynamic_sampling(tmp_path):
    """1 trainer + 2 generator ranks holding one vLLM engine at --vllm.tp 2, gae: the critic trains on the trainer;
    dynamic sampling on the generators (the engine's leader scores and refills, its TP peer generates along)."""
    out = str(tmp_path / "run")
    torchrun("grpo.py", "--output-dir", out, "--rollout.inference-ranks", "2", "--rollout.engine", "vllm", "--vllm.tp",
             "2", "--rollout.max-staleness", "0", "--advantage-estimator", "gae", *DYNAMIC, *COMBO, nproc=3,
             timeout=600)
    check_combined(out, dynamic=True)
    check_async(out)
    rows = [r for r in metrics(out) if r["step"] > 0]
    assert all(r["critic/grad_norm"] >= 0 and r["critic/loss"] > 0 for r in rows)
    assert rows[-1]["critic/value_mean"] != rows[0]["critic/value_mean"]  # the critic's updates reached its values
