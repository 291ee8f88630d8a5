"""Multi-turn episodes (episodes.py): tool calls and environments, token-exact training. The policy is a tiny random
Qwen2 warmed up to call a `multiply` tool (builtin:tiny-tools, models.build_tiny_tool_model); grpo.py runs under tests/episode_dump.py, which
records what the engine sampled and what the trainer forwarded, independently of the code under test."""
import itertools
import json
import os
import re
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import run, torchrun

COMMON = ["--num-generations", "4", "--batch-size", "8", "--micro-batch-size", "8", "--log.completions-every", "0",
          "--vllm.max-model-len", "512", "--optim.lr", "1e-5"]  # small updates: the policy keeps calling its tool


def dump(out):
    return torch.load(os.path.join(out, "dump.pt"), weights_only=False)


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------------------------------------
# Pieces: the parser, the tool runner, the limits of the episode loop
# ----------------------------------------------------------------------------------------------------------

def test_parse_tool_calls_hermes_format():
    from episodes import parse_tool_calls
    text = ('<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call> and '
            '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call><tool_call>{"name": 3}</tool_call>'
            '<tool_call>{not json</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[:2] == [{"name": "multiply", "arguments": {"a": 2, "b": 3}}, {"name": "add", "arguments": {"a": 1}}]
    assert "error" in calls[2] and "error" in calls[3] and len(calls) == 4
    assert parse_tool_calls("no call here, <tool_call> unclosed") == []


def test_run_tool_calls_errors_timeouts_sync_and_async():
    import broken_tools
    from tools_for_tests import async_add, async_hang, multiply

    from episodes import run_tool_calls
    tools = {"multiply": multiply, "broken_multiply": broken_tools.multiply, "async_add": async_add,
             "async_hang": async_hang}
    calls = [{"name": "multiply", "arguments": {"a": 6, "b": 7}}, {"name": "async_add", "arguments": {"a": 1, "b": 2}},
             {"name": "broken_multiply", "arguments": {"a": 2, "b": 1}},   # raises
             {"name": "broken_multiply", "arguments": {"a": 3, "b": 1}},   # sync, sleeps 5 s
             {"name": "async_hang", "arguments": {"a": 1}},                # async, sleeps 30 s
             {"name": "multiply", "arguments": {"x": 1}},                  # wrong arguments
             {"name": "nope", "arguments": {}}, {"error": "could not parse tool call"}]
    t0 = time.time()
    out = run_tool_calls(calls, tools, timeout_s=0.5)
    assert time.time() - t0 < 3  # all at once, none waited for past its timeout
    assert [o[:2] for o in out[:2]] == [("42", False), ("3", False)]
    assert all(err for _, err, _ in out[2:])
    assert "ValueError: deliberate failure for a=2" in out[2][0]
    assert "timed out after 0.5 s" in out[3][0] and "timed out after 0.5 s" in out[4][0]
    assert "TypeError" in out[5][0] and "unknown tool 'nope'" in out[6][0] and "could not parse" in out[7][0]


def test_max_turns_max_total_length_and_model_token_budget(tool_model):
    """An environment that never ends: --rollout.max-turns stops it; --rollout.max-total-length caps prompt + all
    turns (cut episodes are truncated); --rollout.max-completion-length counts model tokens only."""
    from tools_for_tests import EndlessEnv

    import episodes
    import rollout
    import tasks
    engine = rollout.HFEngine(tool_model, seed=0)
    tok = engine.tok  # short questions, and the calculator task's: what the model was warmed up on (its turns end)
    starts = [{"row": {"prompt": p}} for p in ("12*3?", "45*7?", *(r["prompt"][0]["content"]
                                                                   for r in tasks.calculator_task(2, 0)))]
    encode = lambda row, messages: tasks.encode_prompt({"prompt": messages}, tok, 128)["prompt_ids"]  # noqa: E731
    seeds = rollout.completion_seeds(0, 0, 0, len(starts), 3)

    def episodes_with(**limits):
        cfg = rollout.RolloutConfig(**{"max_completion_length": 200, "max_total_length": 400, **limits})
        out = episodes.run_episodes(engine, tok, starts, n=3, seeds=seeds, rollout_cfg=cfg, temperature=1.0,
                                    make_env=EndlessEnv, encode=encode)
        return [e for o in out for e in o]

    eps = episodes_with(max_turns=3)
    done = [e for e in eps if not e["truncated"]]  # (which episodes end each turn within budget depends on samples)
    assert done and all(e["turns"] <= 3 for e in eps) and all(e["turns"] == 3 for e in done)
    assert all(sum(1 for m in e["messages"] if m["role"] == "assistant") == 3 for e in done)
    # the environment's answer to the last turn is in the transcript, marked: no turn was left to read it
    assert all(e["ended"] == "max_turns" and e["messages"][-1] == {"role": "user", "content": "turn 3", "unseen": True}
               and not any(m.get("unseen") for m in e["messages"][:-1]) for e in done)
    # the stitched ids read exactly as the chat template renders the episode's messages (second code path); only
    # where the model's turns hold no special token but their final <|im_end|> (message content drops them)
    specials = {i for i, t in tok.added_tokens_decoder.items() if t.special}  # <|im_start|>, <|im_end|>, ...
    def model_specials(e):
        return [t for t, m in zip(e["completion_ids"], e["completion_mask"]) if m and t in specials]
    clean = [e for e in eps if model_specials(e) == [tok.eos_token_id] * 3]  # each turn's end, nothing else
    assert clean
    for e in clean:
        rendered = tok.apply_chat_template([m for m in e["messages"] if not m.get("unseen")], tokenize=False)
        assert tok.decode(e["prompt_ids"] + e["completion_ids"]) + "\n" == rendered
    for e in episodes_with(max_turns=50, max_total_length=60):
        assert len(e["prompt_ids"]) + len(e["completion_ids"]) <= 60 and e["truncated"]
        assert e["turns"] >= 1
    # a budget every first turn that ended fits (the same seeds draw the same first turns) and a later turn cannot
    ended = [e["completion_mask"].index(0) for e in eps if 0 in e["completion_mask"]]  # their model tokens
    assert ended
    for e0, e in zip(eps, episodes_with(max_turns=50, max_completion_length=max(ended) + 1)):
        assert sum(e["completion_mask"]) <= max(ended) + 1 and e["truncated"]
        if 0 in e0["completion_mask"]:  # its first turn fits: the observation after it is in, but does not count
            assert len(e["completion_ids"]) > sum(e["completion_mask"])


# ----------------------------------------------------------------------------------------------------------
# grpo.py end to end
# ----------------------------------------------------------------------------------------------------------

def test_a_tool_call_on_the_last_turn_is_cut_not_run(tool_model):
    """--rollout.max-turns 1 leaves no turn to read a tool's answer: the call is not run (no tool message, not
    counted) and the episode is truncated (so --rollout.mask-truncated-completions drops it)."""
    from tools_for_tests import multiply

    import episodes
    import rollout
    import tasks
    engine = rollout.HFEngine(tool_model, seed=0)
    tok, tools = engine.tok, {"multiply": multiply}
    prompts = [r["prompt"][0]["content"] for r in tasks.calculator_task(2, 0)]  # what it was warmed up on
    starts = [{"row": {"prompt": p}, **tasks.encode_prompt({"prompt": p}, tok, 128, tools=list(tools.values()))}
              for p in prompts]
    cfg = rollout.RolloutConfig(max_completion_length=64, max_total_length=400, max_turns=1)
    eps = [e for o in episodes.run_episodes(engine, tok, starts, n=4, seeds=rollout.completion_seeds(0, 0, 0, 2, 4),
                                            rollout_cfg=cfg, temperature=1.0, tools=tools) for e in o]
    called = [e for e in eps if episodes.parse_tool_calls(e["text"])]
    assert called, "the warmed-up model calls its tool on a first turn"
    assert all(e["truncated"] and e["tool_calls"] == 0 and all(m["role"] != "tool" for m in e["messages"])
               for e in called)


def test_rewards_see_the_model_tokens_only():
    """completion_ids for reward functions: every model turn's ids, inserted ids (mask 0) left out."""
    import batching
    assert batching.model_ids({"completion_ids": [5, 6, 7, 8, 9], "completion_mask": [1, 1, 0, 0, 1]}) == [5, 6, 9]
    assert batching.model_ids({"completion_ids": [5, 6]}) == [5, 6]  # single turn: all of them


def answered_calls(samples):
    """Each assistant turn's tool calls (parsed here) against the tool messages that follow it, in order, those the
    tool answered (no parse error, no error message) -> [(answer text, arguments)]."""
    import episodes
    answered = []
    for s in samples:
        ms = s["messages"]
        for i, m in enumerate(ms):
            if m["role"] == "assistant":
                follow = list(itertools.takewhile(lambda x: x["role"] == "tool", ms[i + 1:]))
                answered += [(t["content"], c["arguments"]) for c, t in zip(episodes.parse_tool_calls(m["content"]), follow)
                             if "error" not in c and not t["content"].startswith("Error")]
    return answered


def test_builtin_tiny_tools_quickstart(tmp_path):
    """The multi-turn quickstart, one command: --model builtin:tiny-tools --dataset calculator (whose default tool is
    tasks:multiply) under torchrun, 3 steps (under tests/episode_dump.py, which records the episodes). The model calls
    its tool and the tool answers: the product of the arguments the model wrote, recomputed here."""
    out = str(tmp_path / "quickstart")
    _, log, secs = torchrun("tests/episode_dump.py", "--model", "builtin:tiny-tools", "--dataset", "calculator",
                            "--max-steps", "3", "--rollout.max-completion-length", "64", "--output-dir", out, timeout=600)
    rows, samples = metrics(out), [s for step in dump(out)["samples"] for s in step]
    print(f"quickstart: {secs:.0f}s; tool calls per episode {[round(r['tool_calls/mean'], 2) for r in rows]}")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["tool_calls/mean"] > 0.3 for r in rows)
    answered = answered_calls(samples)
    assert len(answered) > len(samples) // 4 and all(int(res) == args["a"] * args["b"] for res, args in answered)


def test_tool_run_is_token_exact_vllm(tmp_path, tool_model, tool_rows):
    """2 GRPO steps with a real tool through vLLM (one process; step 2 samples from weights synced after an update):
    tool results are in the episodes; on the model's turns the trainer forwards exactly the ids vLLM sampled (token by
    token, at the positions the engine produced them); the loss's gradient w.r.t. the inserted positions' log-probs is
    exactly 0; engine vs trainer log-probs of the model's tokens agree to 1e-3."""
    out = str(tmp_path / "tools")
    run([sys.executable, "tests/episode_dump.py", "--model", tool_model, "--dataset", tool_rows, "--output-dir", out,
         "--max-steps", "2", "--data.tools", "tools_for_tests:multiply", "--data.rewards",
         "rewards_for_tests:async_alternating", "--rollout.max-turns", "3", "--rollout.engine", "vllm",
         "--rollout.max-completion-length", "64", "--policy.no-share-prompts", *COMMON],  # rows = samples here
        timeout=600)
    rows, rec = metrics(out), dump(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(1 <= r["turns/mean"] <= 3 for r in rows) and min(r["tool_calls/mean"] for r in rows) > 0
    assert max(r["logprob_mismatch/mean_abs"] for r in rows) <= 1e-3
    samples = [s for step in rec["samples"] for s in step]
    # tool results appear: a <tool_response> with the right product of the arguments the model wrote
    answered = answered_calls(samples)
    assert answered and all(int(res) == args["a"] * args["b"] for res, args in answered)
    assert all(s["turns"] <= 3 for s in samples)

    engine_calls = rec["engine"]
    n_model, n_inserted, diffs = 0, 0, []
    assert len(rec["forward"]) == len(rec["loss"]) == len(rec["samples"]) == 2  # one micro-batch per step here
    for fwd, loss, step_samples in zip(rec["forward"], rec["loss"], rec["samples"]):
        for k, i in enumerate(fwd["rows"]):
            ids = fwd["input_ids"][k][fwd["attention_mask"][k].bool()].tolist()  # what the trainer forwarded
            # every engine call whose prompt + sampled ids is a prefix of this row: its sampled ids sit right after
            # its prompt, and those positions are exactly the loss mask's 1s (model tokens); all others are 0
            mine = [(p, c, lp) for p, c, lp in engine_calls if ids[:len(p) + len(c)] == p + c and c]
            P = len(step_samples[i]["prompt_ids"])
            model_pos = torch.zeros(len(ids) - P)
            engine_lp = torch.zeros(len(ids) - P)
            for p, c, lp in mine:
                assert len(p) >= P and ids[len(p):len(p) + len(c)] == c
                model_pos[len(p) - P:len(p) - P + len(c)] = 1
                engine_lp[len(p) - P:len(p) - P + len(c)] = torch.tensor(lp)
            T = len(ids) - P
            mask = loss["mask"][k, :T]
            assert torch.equal(mask, model_pos), (mask, model_pos)  # token by token
            inserted = (model_pos == 0)
            grad = loss["grad"][k, :T]
            assert (grad[inserted] == 0).all()  # inserted tokens get no gradient
            assert not inserted.any() or (loss["logps"][k, :T][inserted] != 0).any()  # though their log-probs are real
            diffs.append((loss["logps"][k, :T] - engine_lp)[model_pos.bool()].abs())
            n_model, n_inserted = n_model + int(model_pos.sum()), n_inserted + int(inserted.sum())
    assert n_inserted > 0 and n_model > 0
    # every row has a nonzero advantage (async_alternating), so each one's model tokens do get gradient
    assert all((adv != 0).all() for adv in rec["advantages"])
    assert all((loss["grad"] != 0).any(-1).all() for loss in rec["loss"])
    diffs = torch.cat(diffs)
    print(f"model tokens {n_model}, inserted {n_inserted}, mismatch mean {diffs.mean():.2e} max {diffs.max():.2e}")
    assert diffs.mean() <= 1e-3


def test_failing_tools_do_not_stop_the_run(tmp_path, tool_model, tool_rows):
    """A tool that raises (odd calls) or hangs (even calls) under --rollout.tool-timeout-s: the model reads the error text,
    the episode goes on, tool_errors counts them, and the run finishes (HF engine, LoRA, the grpo loss)."""
    out = str(tmp_path / "broken")
    t0 = time.time()
    run([sys.executable, "tests/episode_dump.py", "--model", tool_model, "--dataset", tool_rows, "--output-dir", out,
         "--max-steps", "2", "--data.tools", "broken_tools:multiply", "--data.rewards",
         "rewards_for_tests:async_length", "--rollout.tool-timeout-s", "0.5", "--rollout.engine", "hf",
         "--rollout.max-completion-length", "64", "--lora.r", "8", "--loss.loss-type", "grpo", *COMMON],
        timeout=300)
    rows, rec = metrics(out), dump(out)
    assert [r["step"] for r in rows] == [1, 2]
    samples = [s for step in rec["samples"] for s in step]
    tool_msgs = [m["content"] for s in samples for m in s["messages"] if m["role"] == "tool"]
    raised = [m for m in tool_msgs if "ValueError: deliberate failure" in m]
    timed_out = [m for m in tool_msgs if "timed out after 0.5 s" in m]
    print(f"{len(tool_msgs)} tool answers: {len(raised)} raised, {len(timed_out)} timed out; {time.time() - t0:.0f}s")
    assert len(tool_msgs) >= 2 and raised and timed_out  # any two calls take both paths
    assert sum(r["tool_errors"] for r in rows) == sum(s["tool_errors"] for s in samples) == len(
        [m for m in tool_msgs if m.startswith("Error")]) >= len(raised) + len(timed_out)
    # the episode went on after the error: a model turn follows each error message in the trained ids
    assert any(s["turns"] >= 2 and s["tool_errors"] for s in samples)


def test_environment_reward_reaches_the_advantages(tmp_path, tool_model, tool_rows):
    """An environment with 3 turns whose rewards come from step(): each episode has 3 model turns and 2 inserted
    observations, env_reward is the sum of the step rewards (recomputed here from the episode's assistant turns),
    and the advantages are its group-normalised values (float64 reference)."""
    out = str(tmp_path / "env")
    run([sys.executable, "tests/episode_dump.py", "--model", tool_model, "--dataset", tool_rows, "--output-dir", out,
         "--max-steps", "2", "--env", "tools_for_tests:make_counting_env", "--rollout.max-turns", "5",
         "--rollout.max-completion-length", "300", "--rollout.engine", "hf", *COMMON],  # 3 turns fit: a done episode
        timeout=300)
    from tools_for_tests import step_reward
    from transformers import AutoTokenizer
    eos = AutoTokenizer.from_pretrained(tool_model).eos_token_id
    rows, rec = metrics(out), dump(out)
    assert [r["step"] for r in rows] == [1, 2] and all("reward/env/mean" in r for r in rows)
    for samples, adv in zip(rec["samples"], rec["advantages"]):
        done = [s for s in samples if not s["truncated"]]
        assert done and all(s["turns"] == 3 for s in done)
        observations = [[m["content"] for m in s["messages"] if m["role"] == "user"][1:] for s in done]
        assert all(o == ["turn 1", "turn 2"] for o in observations)
        # step() saw every assistant turn but one cut by the token budget (no end-of-turn token)
        turns = [[m["content"] for m in s["messages"] if m["role"] == "assistant"] for s in samples]
        turns = [t[:-1] if s["completion_ids"][-1] != eos else t for t, s in zip(turns, samples)]
        expected = torch.tensor([sum(map(step_reward, t)) for t in turns], dtype=torch.float64)
        assert torch.allclose(torch.tensor([s["env_reward"] for s in samples], dtype=torch.float64), expected)
        g = expected.view(-1, 4)
        ref = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).flatten()
        assert torch.allclose(adv.double(), ref, atol=1e-5), (adv, ref)
        assert ref.abs().max() > 0.1  # the rewards did differ within groups


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_image_prompts_reach_every_turn_of_an_episode(tmp_path, vlm_dir, engine):
    """An image dataset with a 3-turn environment (tiny random Qwen2.5-VL, 2 steps): every turn's engine request
    carries the start prompt's image, so the engine's log-probs of its samples equal the trainer's (which forwards the
    image with the whole episode) on every step; a turn sent without the image (its placeholder tokens read as text)
    moves them by ~1e-2. A random VLM seldom ends a turn: the test checkpoint stops on half its ordinary tokens too."""
    from PIL import Image
    from tiny_models import stopping_copy
    model = stopping_copy(vlm_dir, tmp_path / "vlm", every=2)
    rows = []
    for i, colour in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255), (200, 200, 0)]):
        Image.new("RGB", (56, 56), colour).save(tmp_path / f"img{i}.png")
        rows.append({"prompt": "What colour is the square?", "image": f"img{i}.png", "answer": str(i)})
    (tmp_path / "images.jsonl").write_text("\n".join(json.dumps(r) for r in rows * 4))
    out = str(tmp_path / "out")
    run([sys.executable, "grpo.py", "--model", model, "--dataset", str(tmp_path / "images.jsonl"), "--output-dir", out,
         "--max-steps", "2", "--env", "tools_for_tests:make_counting_env", "--rollout.max-turns", "3",
         "--rollout.max-completion-length", "48", "--rollout.engine", engine, *COMMON], timeout=600)
    rows = metrics(out)
    print([(r["turns/mean"], r["logprob_mismatch/mean_abs"]) for r in rows])
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["turns/mean"] > 2 and r["logprob_mismatch/mean_abs"] < 1e-3 for r in rows), rows


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp"])
def test_multi_turn_token_estimators_skip_the_inserted_tokens(tmp_path, tool_model, tool_rows, estimator):
    """--advantage-estimator gae / reinforce_pp with tool calls, 2 steps (one process, HF engine): on every episode, the
    advantages (and gae's returns) are those of verl's GAE loop (float64, tests/test_losses.py) on the recorded critic
    values (reinforce_pp: values 0, lambda 1, i.e. the discounted return-to-go), with the reward on the last model token
    and the inserted tool tokens skipped (mask 0: no step, no advantage, no return), whitened over the model tokens.
    Episodes with a tool answer between two model turns are among them."""
    from test_losses import _ref_whiten, _verl_gae
    out, gamma, lam = str(tmp_path / estimator), 0.99, 0.9 if estimator == "gae" else 1.0
    run([sys.executable, "tests/episode_dump.py", "--model", tool_model, "--dataset", tool_rows, "--output-dir", out,
         "--max-steps", "2", "--data.tools", "tools_for_tests:multiply", "--data.rewards",
         "rewards_for_tests:async_alternating", "--rollout.max-turns", "3", "--rollout.engine", "hf",
         "--rollout.max-completion-length", "64", "--advantage-estimator", estimator, "--gamma", str(gamma),
         *(["--lam", str(lam), "--critic.lr", "1e-3"] if estimator == "gae" else []), *COMMON], timeout=600)
    rows, rec = metrics(out), dump(out)
    assert [r["step"] for r in rows] == [1, 2] and all(("critic/loss" in r) == (estimator == "gae") for r in rows)
    spanned = 0
    for samples, adv, ret, values in zip(rec["samples"], rec["advantages"], rec["returns"], rec["old_values"]):
        T = adv.shape[1]
        m = torch.tensor([s["completion_mask"] + [0] * (T - len(s["completion_mask"])) for s in samples],
                         dtype=torch.float64)  # [N, T]: 1 on model tokens, 0 on inserted tokens and padding
        r = torch.zeros_like(m)
        for i, s in enumerate(samples):
            r[i, max(t for t in range(T) if m[i, t])] = s["reward"]  # the reward on the last model token
            first_gap = s["completion_mask"].index(0) if 0 in s["completion_mask"] else None
            spanned += first_gap is not None and 1 in s["completion_mask"][first_gap:]  # model, inserted, model
        v = torch.zeros_like(m) if values is None else values.double()
        want_adv, want_ret = _verl_gae(r, v, m, gamma, lam)
        torch.testing.assert_close(adv.double(), _ref_whiten(want_adv, m), rtol=1e-4, atol=1e-4)
        assert (adv[m == 0] == 0).all()
        if estimator == "gae":
            torch.testing.assert_close(ret.double() * m, want_ret * m, rtol=1e-5, atol=1e-5)
            assert (ret[m == 0] == 0).all()
    assert spanned > 0  # episodes with a tool answer between two model turns
    assert estimator != "gae" or any(v.abs().max() > 0 for v in rec["old_values"])  # a critic that moved


@pytest.mark.parametrize("where", ["colocated", "inference ranks"])
def test_tools_and_environments_run_on_the_tp_leader_only(tmp_path, tool_model, tool_rows, where):
    """--vllm.tp 2 with a tool and an environment whose answers name the rank that ran them (tests/rank_tools.py), with
    one TP group: colocated on 2 ranks (1 step), both ranks' episodes (each trains its half of the group's) hold rank
    0's answers only; on 2 generator ranks (+ 1 trainer; 2 steps: the second after a weight push into the TP 2
    generators) the trained episodes hold the first generator's (its side rank 0) answers only. The trainer's log-probs
    of the model's tokens match the shared engine's: both ranks fed it the same turns. (Colocated steps after a sync
    into a TP 2 engine under tool episodes: test_compat's tp2 multi-turn run.)"""
    import re
    out, ranks = str(tmp_path / "tp"), ["--rollout.inference-ranks", "2"] if where == "inference ranks" else []
    steps = [1, 2] if ranks else [1]
    torchrun("tests/episode_dump.py", "--model", tool_model, "--dataset", tool_rows, "--output-dir", out,
             "--max-steps", str(len(steps)), "--data.tools", "rank_tools:multiply", "--env", "rank_tools:make_rank_env",
             "--rollout.max-turns", "3", "--rollout.engine", "vllm", "--vllm.tp", "2",
             "--rollout.max-completion-length", "64", *ranks, *COMMON, nproc=3 if ranks else 2, timeout=900)
    rows = metrics(out)
    assert [r["step"] for r in rows] == steps and max(r["logprob_mismatch/mean_abs"] for r in rows) <= 1e-3
    for name in ("dump.pt", "dump-rank1.pt") if not ranks else ("dump.pt",):
        rec = torch.load(os.path.join(out, name), weights_only=False)
        inserted = [m for step in rec["samples"] for s in step for m in s["messages"][1:] if m["role"] != "assistant"]
        ranks = [r for m in inserted for r in re.findall(r"\(rank (\d+)\)", m["content"])]
        print(f"{name}: {len(inserted)} inserted messages, ranks {sorted(set(ranks))}")
        assert ranks and set(ranks) == {"0"}, (name, ranks)


def test_multi_turn_flags_fail_fast(tool_model):
    """Bad multi-turn flags stop in validate (before any collective), with the flag in the message."""
    import flags
    import grpo
    from rollout import RolloutConfig
    from tasks import DataConfig
    cases = {"no chat template": (dict(dataset="calculator"), "builtin:tiny has none. Pass --model builtin:tiny-tools"),
             "unknown builtin": (dict(model="builtin:tools"), "the built-in models are builtin:tiny and builtin:tiny-tools"),
             "tool import": (dict(model=tool_model, data=DataConfig(tools=("tools_for_tests:nope",))),
                             "--data.tools 'tools_for_tests:nope': module 'tools_for_tests'"),
             "tool schema": (dict(model=tool_model, data=DataConfig(tools=("tools_for_tests:make_counting_env",))),
                             "no JSON schema"),
             "env import": (dict(model=tool_model, env="no_such_module:make"), "--env 'no_such_module:make'"),
             "turns": (dict(rollout=RolloutConfig(max_turns=0)), "--rollout.max-turns must be >= 1"),
             "env timeout": (dict(rollout=RolloutConfig(env_timeout_s=0)), "--rollout.env-timeout-s > 0")}
    for name, (kw, message) in cases.items():
        with pytest.raises(ValueError) as e:
            flags.validate(grpo.Config(**kw), [])
        assert message in str(e.value), (name, str(e.value))


def test_calculator_task_tool_and_reward():
    """--dataset calculator: products of large numbers, the multiply tool by default, exact-answer reward."""
    import flags
    import scoring
    import tasks
    rows = tasks.load_dataset_rows("calculator", size=50)
    for r in rows:
        a, b = (int(x) for x in r["prompt"][0]["content"].split("What is ")[1].split("?")[0].split(" * "))
        assert int(r["answer"]) == a * b == tasks.multiply(a, b) and a >= 10_000
    import grpo
    cfg = grpo.Config(dataset="calculator")
    assert flags.tool_names(cfg) == ["tasks:multiply"] and flags.reward_names(cfg) == ["final_number"]
    answer = rows[0]["answer"]
    assert scoring.final_number_reward([None] * 3, [f"It is {answer}", f"{int(answer) + 1}", "no idea"],
                                     answer=[answer] * 3) == [1.0, 0.0, 0.0]


def test_a_tool_that_raises_systemexit_is_reported_as_that_error():
    """A BaseException (SystemExit) in a tool's thread is the tool's error text, at once, not a timeout."""
    from tools_for_tests import quitting_tool

    from episodes import run_tool_calls
    t0 = time.time()
    (out,) = run_tool_calls([{"name": "quitting_tool", "arguments": {"a": 7}}], {"quitting_tool": quitting_tool}, 5.0)
    assert out[:2] == ("Error: SystemExit: tool quit on 7", True) and time.time() - t0 < 2


FAILS = {None: None, "reset": "env.reset() raised RuntimeError: deliberate reset failure",
         "reset_hang": "env.reset() timed out after 0.5 s (--rollout.env-timeout-s)",
         "step": "env.step() raised ValueError: deliberate step failure",
         "step_hang": "env.step() timed out after 0.5 s (--rollout.env-timeout-s)",
         "step_exit": "env.step() raised SystemExit: environment quit"}


def test_environment_failures_end_their_episode_with_reward_none(text_dir, capsys, monkeypatch, tmp_path):
    """An environment whose reset/step raises (SystemExit too) or hangs past --rollout.env-timeout-s ends that episode
    only: the others run their 3 turns, the failed ones stop where their environment failed, with env_error saying why;
    the first failure's traceback prints once; every environment that was reset is closed when its episode ends; the
    reward stage gives them None (NaN), counted in reward/failed. The policy always ends its turn at once (end-of-turn
    logit +1e4), so which path each episode takes is fixed."""
    from tools_for_tests import FlakyEnv

    import distributed
    import episodes
    import grpo
    import rollout
    import scoring
    import tasks
    engine = rollout.HFEngine(text_dir, seed=0)
    tok = engine.tok
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    eos = tok.eos_token_id
    engine.model.lm_head.register_forward_hook(lambda m, i, o: o.index_fill(-1, torch.tensor([eos]), 1e4))
    rows = [{"prompt": f"row {k}", "fail": f} for k, f in enumerate(FAILS)]
    encode = lambda row, messages: tasks.encode_prompt({"prompt": messages}, tok, 64)["prompt_ids"]  # noqa: E731
    cfg = rollout.RolloutConfig(max_turns=4, max_completion_length=20, max_total_length=400, env_timeout_s=0.5)
    printed, t0 = set(), time.time()
    out = episodes.run_episodes(engine, tok, [{"row": r} for r in rows], n=2,
                                seeds=rollout.completion_seeds(0, 0, 0, 6, 2),
                                rollout_cfg=cfg, temperature=1.0, make_env=FlakyEnv, encode=encode, printed=printed)
    assert time.time() - t0 < 4.5  # each hang waited for 0.5 s once (all episodes' calls at once), not 5 s each
    assert sorted(map(str, FlakyEnv.closed)) == sorted(str(f) for f in FAILS for _ in range(2)
                                                       if f not in ("reset", "reset_hang"))
    for row, eps in zip(rows, out):
        for e in eps:
            assert e["env_error"] == FAILS[row["fail"]]
            assert e["turns"] == {None: 3, "reset": 0, "reset_hang": 0}.get(row["fail"], 1)
            assert e["row"]["env_reward"] == (0.0 if row["fail"] is None else None)  # step_reward("") = 0
            if row["fail"] in ("reset", "reset_hang"):  # no environment prompt: the row's own, and no model turn
                own = encode(row, [{"role": "user", "content": row["prompt"]}])
                assert e["completion_ids"] == [] and e["prompt_ids"] == own
    err = capsys.readouterr().err
    assert printed == {"env"} and err.count("its episode ends with reward None") == 1
    assert "RuntimeError: deliberate reset failure" in err and "Traceback" in err
    # the reward stage: None (NaN) for every failed episode, each counted once in reward/failed
    monkeypatch.setattr(distributed, "global_sums", lambda named, device: {k: float(v) for k, v in named.items()})
    run_ = SimpleNamespace(reward_fns=[("env", scoring.env_reward)], weights=[1.0], printed_errors=set(), device="cpu",
                           cp_group=None, cfg=SimpleNamespace(output_dir=str(tmp_path)))
    samples = [e for eps in out for e in eps]
    before = [dict(s) for s in samples]
    scored = grpo.score(run_, samples)
    rewards, counts = scored.rewards, scored.counts
    assert samples == before  # the stage returns what it found and writes nothing into the samples
    assert rewards[:, 0].isnan().tolist() == [r["fail"] is not None for r in rows for _ in range(2)]
    assert counts["failed"] == 10 and rewards[:2, 0].tolist() == [0.0, 0.0]
    with pytest.raises(grpo.console.UserError, match="every episode's environment failed.*then run again"):
        grpo.score(run_, samples[2:])  # no sample left to learn from; no checkpoint to resume from: none is suggested
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / grpo.checkpoints.MANIFEST).touch()  # a finished save
    with pytest.raises(grpo.console.UserError, match=r"Fix them, then --resume latest\."):
        grpo.score(run_, samples[2:])


def test_a_failing_environment_does_not_stop_the_run(tmp_path, tool_model):
    """grpo.py, 2 steps, a 2-row dataset (both rows in every step): the environment raises in reset() on one row. The
    run finishes; each step counts that row's 4 episodes in reward/failed; the traceback prints once."""
    data = tmp_path / "flaky.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "fail": f}) for p, f in [("12*3?", "reset"), ("45*7?", None)]))
    out = str(tmp_path / "flaky")
    _, log, _ = run([sys.executable, "grpo.py", "--model", tool_model, "--dataset", str(data), "--output-dir", out,
                     "--max-steps", "2", "--env", "tools_for_tests:FlakyEnv", "--rollout.max-turns", "4",
                     "--rollout.max-completion-length", "64", "--rollout.engine", "hf", *COMMON], timeout=300)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and [r["reward/failed"] for r in rows] == [4, 4]
    assert log.count("env.reset() raised RuntimeError: deliberate reset failure: its episode ends") == 1


def test_env_args_are_the_factorys_keyword_arguments(tool_model):
    """--env-args JSON reaches a package.module:make_env factory as keyword arguments (here: 2 turns, not its default
    3), through the loader grpo.py uses (hubs.load_env); a name the factory does not take, or anything but a JSON
    object, is refused in validate naming both flags."""
    import flags
    import grpo
    import hubs
    import rollout
    import tasks
    cfg = grpo.Config(model=tool_model, env="tools_for_tests:make_counting_env", env_args='{"turns": 2}')
    engine = rollout.HFEngine(tool_model, seed=0)
    starts = [{"row": {"prompt": r["prompt"][0]["content"]}} for r in tasks.calculator_task(2, 0)]
    encode = lambda row, messages: tasks.encode_prompt({"prompt": messages}, engine.tok, 128)["prompt_ids"]  # noqa: E731
    out = episodes_run(engine, starts, hubs.load_env(cfg), encode)
    done = [e for e in out if not e["truncated"]]
    assert done and all(e["turns"] == 2 for e in done) and all(e["turns"] <= 2 for e in out)
    for args, said in (('{"turn": 2}', "unexpected keyword argument 'turn'"), ("[2]", "a JSON object"),
                       ("{turns: 2}", "a JSON object")):
        with pytest.raises(ValueError, match="--env-args") as e:
            flags.validate(grpo.Config(model=tool_model, env="tools_for_tests:make_counting_env", env_args=args), [])
        assert said in str(e.value) and "tools_for_tests:make_counting_env" in str(e.value), str(e.value)


def episodes_run(engine, starts, make_env, encode, n=2):
    import episodes
    import rollout
    cfg = rollout.RolloutConfig(max_completion_length=200, max_total_length=400, max_turns=5)
    out = episodes.run_episodes(engine, engine.tok, starts, n=n, seeds=rollout.completion_seeds(0, 0, 0, len(starts), n),
                                rollout_cfg=cfg, temperature=1.0, make_env=make_env, encode=encode)
    return [e for o in out for e in o]


def check_episodes(out, log, rows, per_step):
    """episodes.jsonl (--log.episodes-every 1) against what task_library.SeedGame (--env-args log) saw, whatever was
    sampled: each line is an episode the environment saw (its prompt from reset(), the turns step() got, each rewarded
    on its message, the reason unfinished() got = "ended", last the answer no turn was left to read, marked unseen,
    when the turn limit ended it); its reward is the hook's for an unfinished one (None:
    unscored) else the step rewards' sum; episodes/unfinished_frac counts them; reward/mean and reward/env/mean are
    the mean of the scored rewards. -> (the episodes, how many the framework ended, {step: mean scored reward})."""
    from task_library import UNFINISHED_REWARD, seed_prompt
    with open(os.path.join(out, "episodes.jsonl")) as f:
        eps = [json.loads(line) for line in f]
    with open(log) as f:
        seen = [json.loads(line) for line in f]
    assert [e["step"] for e in eps] == [r["step"] for r in rows[1:] for _ in range(per_step)]
    trained = {e["row"]["seed"] for e in eps}
    mine = sorted((s["seed"], s["texts"], s["unfinished"]) for s in seen if s["seed"] in trained)  # (not evaluation's)
    unfinished = lambda e: e["ended"] if e["ended"] in UNFINISHED_REWARD else None  # noqa: E731
    rewarded = lambda e: [m["content"] for m in e["messages"] if m["role"] == "assistant" and "reward" in m]  # noqa
    assert mine == sorted((e["row"]["seed"], rewarded(e), unfinished(e)) for e in eps)
    for e in eps:
        assert e["messages"][0] == {"role": "user", "content": seed_prompt(e["row"]["seed"])}
        assert all(m["reward"] == 0.25 for m in e["messages"] if "reward" in m)
        assert e["ended"] in (*UNFINISHED_REWARD, "done") and e["truncated"] == (e["ended"] not in ("done", "max_turns"))
        want = UNFINISHED_REWARD[e["ended"]] if unfinished(e) else 0.25 * len(rewarded(e))
        assert e["reward"] == want, e
        late = [{"role": "user", "content": "go on", "unseen": True}] * (e["ended"] == "max_turns")
        if e["ended"] != "max_total_length":  # (which may cut before a turn, or after one: then its answer is unseen)
            assert [m for m in e["messages"] if m.get("unseen")] == late == e["messages"][len(e["messages"]) - len(late):]
    n_unfinished = sum(map(bool, map(unfinished, eps)))
    assert n_unfinished == round(sum(per_step * r["episodes/unfinished_frac"] for r in rows[1:]))
    means = {}
    for r in rows[1:]:
        scored = [e["reward"] for e in eps if e["step"] == r["step"] and e["reward"] is not None]
        means[r["step"]] = sum(scored) / len(scored) if scored else float("nan")
        assert r["reward/mean"] == pytest.approx(means[r["step"]], nan_ok=True)
        assert r["reward/env/mean"] == pytest.approx(means[r["step"]], nan_ok=True)
    return eps, n_unfinished, means


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_unfinished_episodes_prompts_from_reset_and_the_episodes_file(tmp_path, tool_model, engine):
    """grpo.py, 2 steps and two evaluations, on rows of seeds only (task_library:seed_rows, no prompt column): the
    environment (task_library.SeedGame, --env-args) writes each prompt in reset(), scores what the framework ended in
    unfinished(reason) and records what it saw. With --rollout.max-turns 2 and --rollout.max-turn-tokens 12, whatever
    is sampled: every engine call (tests/episode_dump.py's record) samples at most 12 tokens and some hit that; each
    line of episodes.jsonl (--log.episodes-every 1) is an episode the environment saw (its prompt, the turns step()
    got, each rewarded on its message, the reason unfinished() got = "ended"), its reward the hook's for an unfinished
    one (None: unscored) else the step rewards' sum; episodes/unfinished_frac counts those; reward/mean and
    reward/env/mean are the mean of the scored rewards, as the console line and the completions table say."""
    out, log = str(tmp_path / "out"), str(tmp_path / "env.jsonl")
    _, text, _ = run([sys.executable, "tests/episode_dump.py", "--model", tool_model, "--output-dir", out,
                      "--dataset", "task_library:seed_rows", "--env", "task_library:SeedGame", "--env-args",
                      json.dumps({"log": log}), "--max-steps", "2", "--rollout.max-turns", "2",
                      "--rollout.max-turn-tokens", "12", "--rollout.max-completion-length", "20",
                      "--log.episodes-every", "1", "--eval.every", "2", "--eval.num-prompts", "2",
                      "--rollout.engine", engine, *COMMON, "--log.completions-every", "1"],
                     timeout=400, env={"COLUMNS": "250"})
    rows, rec = metrics(out), dump(out)
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/accuracy" in rows[2]  # prompt-less held-out rows evaluate
    sampled = [len(c) for _, c, _ in rec["engine"]]
    assert max(sampled) == 12 and all(n >= 1 for n in sampled)
    eps, n_unfinished, means = check_episodes(out, log, rows, 8)
    assert n_unfinished > 0  # (odd seeds need 3 turns: --rollout.max-turns 2 ends them)
    lines = dict(re.findall(r"step (\d)/2 reward (\S+) ", text))
    tables = re.findall(r"│ Game \d+: say a number\. +│.*│ (\S+) +│ (\S+) +│", text)  # (reward, advantage) per row
    for r in rows[1:]:
        assert lines[str(r["step"])] == f"{means[r['step']]:.3f}"
        shown = [reward for reward, _ in tables[8 * (r["step"] - 1):8 * r["step"]]]
        assert shown == [f"{float('nan') if e['reward'] is None else e['reward']:.3f}" for e in eps
                         if e["step"] == r["step"]]


def test_a_row_without_a_prompt_needs_one_from_reset(tmp_path):
    """A row without a prompt whose environment's reset() returns no messages: that episode ends with an env_error
    saying so (one line); without --env, such rows are refused at load naming --data.prompt-column."""
    import episodes
    import grpo
    import launch
    from task_library import SeedGame
    eps = [{"row": {"seed": 3, "empty": True}, "tool_time_s": 0.0, "messages": []}]
    episodes.start_envs(eps, lambda: SeedGame(str(tmp_path / "log")), lambda row, messages: messages, 5.0, set())
    assert eps[0]["env_error"] == ("env.reset() raised ValueError: returned no messages for a row without a prompt: "
                                   "reset(row) must return the prompt") and eps[0]["row"] == {"seed": 3, "empty": True}
    assert launch.load_rows(grpo.Config(dataset="task_library:seed_rows", env="task_library:SeedGame"))[0][0] == {"seed": 0}
    with pytest.raises(ValueError, match="has no column 'prompt'.*--data.prompt-column"):
        launch.load_rows(grpo.Config(dataset="task_library:seed_rows"))


def test_the_unfinished_hook_replaces_the_reward_or_fails_the_episode(tmp_path):
    """episodes.end_episodes on episodes the framework ended: the hook's reward replaces the step rewards' sum (None:
    unscored); an environment without the hook keeps the sum, one that is done is not asked; a hook that raises ends
    its episode as an env failure; every environment is closed either way (SeedGame records itself on close)."""
    import episodes
    from task_library import SeedGame

    class Raising(SeedGame):
        def unfinished(self, reason):
            raise RuntimeError("no score")

    class NoHook:
        closed = False

        def close(self):
            NoHook.closed = True
    log = str(tmp_path / "seen.jsonl")
    envs = [SeedGame(log), SeedGame(log), SeedGame(log), Raising(log), NoHook()]
    for k, env in enumerate(envs[:4]):
        env.reset({"seed": k})
    ended = ["max_turns", "max_turn_tokens", "done", "token_budget", "max_turns"]
    eps = [{"row": {"seed": k}, "env": env, "ended": why, "env_reward": 0.25, "env_error": None, "tool_time_s": 0.0,
            "seed": None, "image": {}} for k, (env, why) in enumerate(zip(envs, ended))]
    episodes.end_episodes(eps, True, 5.0, set(), True, 1)
    assert [e["row"]["env_reward"] for e in eps] == [-1.0, None, 0.25, None, 0.25]
    assert [e["ended"] for e in eps] == ["max_turns", "max_turn_tokens", "done", "env_error", "max_turns"]
    assert eps[3]["env_error"] == "env.unfinished() raised RuntimeError: no score" and NoHook.closed
    with open(log) as f:
        assert sorted(json.loads(line)["unfinished"] or "" for line in f) == ["", "", "max_turn_tokens", "max_turns"]
