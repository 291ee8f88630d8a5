"""--env verifiers:TASKSET (hubs.py): a verifiers v1 environment written for the tests (tests/vf_turns.py: two model
turns per episode, an in-process harness, the local subprocess runtime) drives its episodes against the engine served
on 127.0.0.1 to verifiers' own token-aware client (TrainClientConfig -> renderers.client.generate); grpo.py trains on
the traces' tokens. What the engine sampled is recorded independently (tests/episode_dump.py)."""
import json
import os
import sys
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
import torch
from conftest import run

COMMON = ["--env", "verifiers:tests/vf_turns.py", "--num-generations", "4", "--batch-size", "8", "--micro-batch-size",
          "8", "--log.completions-every", "0", "--vllm.max-model-len", "512", "--optim.lr", "1e-5", "--eval.every", "0",
          "--policy.no-share-prompts"]  # rows = samples


def letters(text):  # the test environment's reward, written again
    return sum(c.isalpha() for c in text) / max(1, len(text))


def check_trained_tokens(out):
    """Every trained row is exactly the last engine call of its episode (prompt + sampled ids); its loss mask is 1
    exactly where an engine call sampled the token; the loss's behaviour log-probs are the engine's at those positions,
    and the trainer's recompute agrees with them. -> (model tokens, inserted tokens, max |trainer - engine|)."""
    rec = torch.load(os.path.join(out, "dump.pt"), weights_only=False)
    n_model, n_inserted, worst = 0, 0, 0.0
    step, seen = 0, 0  # a step's micro-batches cover its samples once
    for fwd, loss in zip(rec["forward"], rec["loss"]):
        samples = rec["samples"][step]
        seen += len(fwd["rows"])
        step, seen = (step + 1, 0) if seen == len(samples) else (step, seen)
        for k, i in enumerate(fwd["rows"]):
            s, ids = samples[i], fwd["input_ids"][k][fwd["attention_mask"][k].bool()].tolist()
            P, T = len(s["prompt_ids"]), len(ids) - len(s["prompt_ids"])
            assert ids == s["prompt_ids"] + s["completion_ids"]
            mine = [(p, c, lp) for p, c, lp in rec["engine"] if c and ids[:len(p) + len(c)] == p + c]
            model, engine_lp = torch.zeros(T), torch.zeros(T)
            for p, c, lp in mine:
                model[len(p) - P:len(p) - P + len(c)] = 1
                engine_lp[len(p) - P:len(p) - P + len(c)] = torch.tensor(lp)
            if s["env_error"] is None:
                assert max(len(p) + len(c) for p, c, _ in mine) == len(ids)  # the last call ends the row
            assert torch.equal(loss["mask"][k, :T], model)
            assert torch.equal(loss["engine_logps"][k, :T][model.bool()], engine_lp[model.bool()])
            worst = max(worst, (loss["logps"][k, :T] - engine_lp)[model.bool()].abs().max().item() if mine else 0.0)
            n_model, n_inserted = n_model + int(model.sum()), n_inserted + int(T - model.sum())
    assert worst <= 1e-3
    return rec, n_model, n_inserted, worst


def test_verifiers_environment_trains_token_exactly(tmp_path, tool_model):
    """grpo.py, 2 steps, 8 episodes of 2 turns each (HF engine): the trained ids and behaviour log-probs are the
    engine's (check_trained_tokens), the observation between the turns is inserted (mask 0), the reward is the
    environment's, concurrent episodes share engine calls, and task 1, whose run() raises, fails alone: env_error,
    counted in reward/failed, one traceback printed, the run finishes."""
    out = str(tmp_path / "vf")
    _, log, _ = run([sys.executable, "tests/episode_dump.py", "--model", tool_model, "--output-dir", out,
                     "--max-steps", "2", "--rollout.engine", "hf", "--rollout.max-completion-length", "32",
                     "--env-args", json.dumps({"taskset": {"size": 4, "fail": "raise"}}), *COMMON],
                    timeout=600, earlier_defaults=False)
    rec, n_model, n_inserted, worst = check_trained_tokens(out)
    print(f"model tokens {n_model}, inserted {n_inserted}, engine vs trainer max {worst:.1e}")
    assert n_model and n_inserted
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    samples = [s for step in rec["samples"] for s in step]
    failed = [s for s in samples if s["env_error"]]
    assert [r["reward/failed"] for r in rows] == [sum(s["env_error"] is not None for s in step) for step in
                                                  rec["samples"]]
    assert all("task 1 fails on purpose" in s["env_error"] and s["env_reward"] is None for s in failed)
    assert log.count("task 1 fails on purpose: its episode ends with reward None") == 1
    ok = [s for s in samples if not s["env_error"]]
    def last(s):  # what verifiers' Segment.last_reply gives the environment: the last assistant message, stripped
        return ([m for m in s["messages"] if m["role"] == "assistant"][-1].get("content") or "").strip()
    assert ok and all(s["env_reward"] == letters(last(s)) for s in ok)
    assert all(s["ended"] == ("token_budget" if s["truncated"] else "done") for s in ok)  # a trace the budget cut
    assert [r["episodes/unfinished_frac"] for r in rows] == pytest.approx(
        [sum(s["ended"] == "token_budget" for s in step) / len(step) for step in rec["samples"]])
    assert any(s["turns"] == 2 and "Go on." in [m.get("content") for m in s["messages"]] for s in ok)
    assert max(rec["generate_calls"]) > 1  # one engine call answers several episodes


def test_verifiers_on_smollm2_through_grpo(tmp_path, smollm2_dir):
    """grpo.py, one step on the real SmolLM2 checkpoint (its chat template, LoRA, the HF engine), 2 tasks x 2 episodes
    of 2 turns: the trained ids, mask and behaviour log-probs are the engine's (check_trained_tokens), each episode is
    one context (the second turn continues the first), and the engine's log-probs equal a float64 recompute by the
    transformers model on the trained ids."""
    from transformers import AutoModelForCausalLM
    out = str(tmp_path / "vf")
    run([sys.executable, "tests/episode_dump.py", "--model", smollm2_dir[0], "--output-dir", out, "--max-steps", "1",
         "--rollout.engine", "hf", "--rollout.max-completion-length", "8", "--lora.r", "8", "--env-args",
         json.dumps({"taskset": {"size": 2}}), *COMMON[:2], "--num-generations", "2", "--batch-size", "4",
         "--micro-batch-size", "4", "--rollout.env-timeout-s", "300", *COMMON[8:]], timeout=600,
        earlier_defaults=False)  # the timeout: a loaded machine took > 60 s for these episodes (twice in seven runs)
    rec, n_model, n_inserted, _ = check_trained_tokens(out)
    assert n_model and n_inserted
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir[0], dtype=torch.float64)
    for e in rec["samples"][0]:
        assert e["env_error"] is None and e["turns"] == 2
        ids = e["prompt_ids"] + e["completion_ids"]
        mask = torch.tensor([0] * len(e["prompt_ids"]) + e["completion_mask"])
        with torch.no_grad():
            logps = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])
        engine_lp = torch.tensor([0.0] * len(e["prompt_ids"]) + list(e["engine_logps"]), dtype=torch.float64)
        diff = (logps[:, 0] - engine_lp[1:])[mask[1:].bool()].abs()
        assert diff.max() <= 1e-3, diff


class FakeEngine:
    """Samples 'ok' then the end-of-turn token, log-prob -0.5 each; records its calls."""

    def __init__(self, tok):
        self.ids = tok("ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        self.calls, self.temperatures = [], []

    def generate(self, prompts, *, n, temperature, top_p, top_k, max_tokens):
        import rollout
        self.calls.append(len(prompts))
        self.temperatures.append(temperature)
        return [[rollout.Completion(self.ids[:m], [-0.5] * len(self.ids[:m]), m < len(self.ids))] for m in max_tokens]


@pytest.mark.parametrize("fail, why", [("hang", "TimeoutError"), ("silent", "0 sampled tokens")])
def test_served_routes_and_failing_environments(tool_model, fail, why):
    """hubs.verifiers_episodes against a scripted engine, the taskset named as an installed module: an environment
    that hangs on task 1 ends its episodes at --rollout.env-timeout-s, one whose harness never calls the model gives a
    trace without tokens (both: env_error, no model token); task 0's episodes are the engine's tokens and log-probs
    exactly. The server answers /v1/models and chat completions (OpenAI's client reads the engine's sample), and refuses
    other sampling settings with a message."""
    import hubs
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tool_model)
    engine, r = FakeEngine(tok), SimpleNamespace(top_p=1.0, top_k=0, max_completion_length=16, max_total_length=256,
                                                 env_timeout_s=8.0, max_prompt_length=2)  # (a loaded 2-core CI machine took > 2 s for a healthy episode)
    args = json.dumps({"taskset": {"size": 2, "fail": fail}})
    starts = [{"row": row, "prompt_ids": [1, 2, 3]} for row in hubs.verifiers_rows("vf_turns", args)]  # (tests/: path)
    groups = hubs.verifiers_episodes("vf_turns", args, engine, tok, starts, n=2, rollout_cfg=r,
                                     temperature=1.0, printed=set())
    assert all(why in e["env_error"] and e["completion_ids"] == [] for e in groups[1]), groups[1][0]["env_error"]
    assert all(e["prompt_ids"] == [2, 3] for e in groups[1])  # its row's prompt, cut as --rollout.max-prompt-length
    for e in groups[0]:
        model = [t for t, m in zip(e["completion_ids"], e["completion_mask"]) if m]
        assert e["env_error"] is None and model == engine.ids * 2 and e["turns"] == 2
        assert [lp for lp, m in zip(e["engine_logps"], e["completion_mask"]) if m] == [-0.5] * len(model)
    assert sum(engine.calls) == 4  # task 0's two episodes, two turns each (batched as they arrive: test above)
    if fail != "hang":
        return

    requests, stop = hubs.queue.Queue(), hubs.threading.Event()
    server = hubs.http_server(tok, 256, requests, 5.0)
    url = f"http://127.0.0.1:{server.server_port}"
    run_sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 16}
    prompts, generate = [], engine.generate
    engine.generate = lambda p, **kw: prompts.extend(p) or generate(p, **kw)
    hubs.threading.Thread(target=hubs.serve_engine, args=(engine, requests, run_sampling, 256, stop.is_set,
                                                          time.time() + 60)).start()
    try:
        assert json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0] == {
            "id": tool_model, "object": "model", "max_model_len": 256}
        from openai import OpenAI  # an environment's own chat call (a judge, a simulated user), through OpenAI's client
        messages = [{"role": "user", "content": "Say ok."}]
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model=tool_model, messages=messages, max_tokens=8)
        assert reply.choices[0].message.content == tok.decode(engine.ids, skip_special_tokens=True)
        assert engine.temperatures[-1] == 1.0  # the run's, as the request asked for none
        client.chat.completions.create(model=tool_model, messages=messages, max_tokens=8, temperature=0.0, user="judge")
        assert engine.temperatures[-1] == 0.0  # a chat call (a judge) samples as it asks: nothing it samples trains
        assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == len(engine.ids)
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert prompts[-1]["prompt_token_ids"] == tok(text, add_special_tokens=False)["input_ids"]
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=b"{}"))
        assert "no route /v1/completions" in e.value.read().decode()
        for route in ("/v1/chat/completions", "/inference/v1/generate"):  # a body that is not JSON: answered 400
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(urllib.request.Request(url + route, data=b"{"), timeout=10)
            assert e.value.code == 400 and "JSONDecodeError" in e.value.read().decode()
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
    import rollout  # a reply as vLLM's route gives it: cut after the first stop id (kept), cut by max_tokens = length
    from renderers.client import _parse_completion_logprobs
    c = rollout.Completion([5, 7, 9], [-1.0, -2.0, -3.0], True)
    for stops, ids, finish in (({7}, [5, 7], "stop"), ({11}, [5, 7, 9], "length")):
        choice = hubs.generate_reply(c, stops)[1]["choices"][0]
        assert (choice["token_ids"], choice["finish_reason"]) == (ids, finish)
        assert _parse_completion_logprobs(choice, ids) == c.logprobs[:len(ids)]  # (verifiers' client reads them)
    q = hubs.Request([1, 2], {"temperature": 0.7, "max_tokens": 4})
    hubs.answer_batch(engine, [q], run_sampling, 256)
    assert q.reply[0] == 400 and "--rollout.temperature" in q.reply[1]["error"]["message"]
    for asked in ({"min_p": 0.5}, {"repetition_penalty": 1.2}, {"stop": ["</answer>"]}, {"n": 2}):  # the engine
        q = hubs.Request([1, 2], {"max_tokens": 4, **asked})  # cannot honour them
        hubs.answer_batch(engine, [q], run_sampling, 256)
        assert q.reply[0] == 400 and repr(asked)[1:-1] in q.reply[1]["error"]["message"], (asked, q.reply)


def test_verifiers_flags_fail_fast(tool_model, tmp_path):
    """What the verifiers path cannot honour stops in validate (every rank, before any collective), naming the flag."""
    import flags
    import grpo
    import launch
    from rollout import RolloutConfig, VLLMConfig
    from tasks import DataConfig
    env = dict(model=tool_model, env="verifiers:tests/vf_turns.py")
    cases = {"args without a hub": (dict(model=tool_model, env_args="{}"), "--env-args is read by --env verifiers:... "
                                    "and package.module:make_env factories (no --env given)"),
             "args with openenv": (dict(model=tool_model, env_args="{}", env="openenv:http://127.0.0.1:9"),
                                   "factories, not by --env openenv:http://127.0.0.1:9"),
             "bad args": (dict(env_args="[1]", **env), "not a JSON object"),
             "unknown field": (dict(env_args='{"taskset": {"nope": 1}}', **env), "nope"),
             "no taskset": (dict(model=tool_model, env="verifiers:no_such_taskset"), "no_such_taskset"),
             "dotted": (dict(model=tool_model, env="verifiers:verifiers.v1.tasksets.no_such"),  # (it named
                        "tasksets.no_such: No module named 'verifiers.v1.tasksets.no_such'"),  # tasksets.verifiers)
             "no target": (dict(model=tool_model, env="verifiers:"), "--env verifiers:TASKSET"),  # (an empty
             "no url": (dict(model=tool_model, env="openenv:"), "--env openenv:http://HOST:PORT"),  # shell variable)
             "dataset": (dict(dataset="max_digit", **env), "does not read --dataset (its taskset"),
             "system prompt": (dict(data=DataConfig(system_prompt="Be brief."), **env), "read --data.system-prompt"),
             "turns": (dict(rollout=RolloutConfig(max_turns=3), **env), "read --rollout.max-turns"),
             "tools": (dict(data=DataConfig(tools=("tools_for_tests:multiply",)), **env), "--data.tools with --env"),
             "tp": (dict(vllm=VLLMConfig(tp=2), rollout=RolloutConfig(engine="vllm"), **env), "--vllm.tp > 1"),
             "inflight": (dict(rollout=RolloutConfig(inference_ranks=1, inflight_updates=8), **env),
                          "--rollout.inflight-updates"),
             "eval": (dict(eval=grpo.EvalConfig(every=2), **env), "--eval.every with --env verifiers")}
    for name, (kw, message) in cases.items():
        with pytest.raises(ValueError) as e:
            flags.validate(grpo.Config(**kw), [])
        assert message in str(e.value), (name, str(e.value))
    hang = tmp_path / "vf_hangs.py"  # a taskset whose import takes 20 s: its loading is bounded like any user module
    hang.write_text("import time\ntime.sleep(20)\n")  # (finite: without the bound this test fails, not hangs)
    cfg = grpo.Config(model=tool_model, env=f"verifiers:{hang}", data=DataConfig(import_timeout_s=1))
    for stage in (launch.load_rows, lambda c: flags.validate(c, [])):  # load_rows first, as setup calls them
        with pytest.raises(ValueError, match=r"did not finish within 1 s \(--data.import-timeout-s\)"):
            stage(cfg)
    (tmp_path / "vf_empty.py").write_text("")  # no Taskset exported: verifiers' own reason, as a flag error
    with pytest.raises(ValueError, match=r"--env verifiers:\S*vf_empty.py: .*defines no `__all__`"):
        flags.validate(grpo.Config(model=tool_model, env=f"verifiers:{tmp_path / 'vf_empty.py'}"), [])
    import hubs  # a taskset named as a dotted module loads (verifiers itself would look for it in its own package)
    (tmp_path / "vfpkg").mkdir()
    (tmp_path / "vfpkg" / "__init__.py").write_text("")
    (tmp_path / "vfpkg" / "turns.py").write_text("from vf_turns import *  # noqa\nfrom vf_turns import __all__  # noqa\n")
    sys.path.insert(0, str(tmp_path))
    assert len(hubs.load_verifiers("vfpkg.turns", None)[1]) == len(hubs.load_verifiers("vf_turns", None)[1])
    sys.path.remove(str(tmp_path))
    # the renderer's own fields pass through: a tool parser lets a tool environment's calls be read
    from renderers import create_renderer
    from transformers import AutoTokenizer
    config = hubs.load_verifiers("vf_turns", '{"renderer": {"tool_parser": "qwen3"}}')[2]
    renderer = create_renderer(AutoTokenizer.from_pretrained(tool_model), config)
    assert renderer.supports_tools and type(renderer).__name__ == "TokenExactRenderer"


def test_chat_route_reads_what_openai_sends(tool_model):
    """/v1/chat/completions: text given as OpenAI content parts is the same prompt as the plain string (was the parts'
    Python repr, through the chat template), and what the reply cannot carry (log-probs, special tokens) is refused
    instead of silently left out."""
    import hubs
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tool_model)
    plain = hubs.chat_request(tok, {"messages": [{"role": "user", "content": "Say ok."}]})
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "ok."}]
    assert hubs.chat_request(tok, {"messages": [{"role": "user", "content": parts}]}) == plain
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    for body in ({"logprobs": True}, {"top_logprobs": 2, "logprobs": True}, {"skip_special_tokens": False},
                 {"messages": [{"role": "user", "content": image}]}, {"tools": tools}):
        with pytest.raises(ValueError, match="logprobs|skip_special_tokens|image_url|tools"):
            hubs.chat_request(tok, {"messages": [{"role": "user", "content": "hi"}], **body})
    assert hubs.chat_request(tok, {"messages": [{"role": "user", "content": "Say ok."}], "logprobs": False})[0] \
        == plain[0]


def test_a_task_prompt_is_not_said_cut(tool_model, capsys, monkeypatch):
    """--rollout.max-prompt-length does not apply to a verifiers environment (it renders its own prompts): a task
    prompt longer than it is neither cut nor said to be (was: the run printed a cut that never happened)."""
    import grpo
    import tasks
    from transformers import AutoTokenizer
    monkeypatch.setattr(tasks, "_cut_said", [])
    cfg = grpo.Config(model=tool_model, env="verifiers:tests/vf_turns.py", batch_size=2, num_generations=2)
    cfg.rollout.max_prompt_length = 2
    tok = AutoTokenizer.from_pretrained(tool_model)
    run = SimpleNamespace(cfg=cfg, rows=[{"prompt": "Say ok, then say ok again.", "vf_task": 0}], order=[0],
                          processor=tok, tools={}, dp_rank=0, world=1, tp=1, batch_ranks=1, ds_extra_rounds=0)
    ids = grpo.sample_prompts(run, 0)[0]["prompt_ids"]
    text = tok.apply_chat_template([{"role": "user", "content": run.rows[0]["prompt"]}], tokenize=False,
                                   add_generation_prompt=True)
    whole = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == whole and "max-prompt-length" not in capsys.readouterr().out
