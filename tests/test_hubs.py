"""Environments from the hubs (hubs.py). OpenEnv: a real server (tests/openenv_for_tests.py: an environment served by
openenv's own create_app under uvicorn, in a subprocess on a free local port), reached through openenv-core's own
client; what the server must have received and answered is recomputed here from its rules (letter_reward,
observation_text); grpo.py runs on it end to end, token-exact, with failing sessions contained."""
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, free_port, with_earlier_defaults
from transformers import AutoTokenizer

pytest.importorskip("openenv.core", reason="openenv-core is on the CPU stack only (requirements-cpu.txt)")
from openenv_for_tests import SLOW_RESET_S, TURNS, letter_reward, observation_text  # noqa: E402

import grpo  # noqa: E402
import hubs  # noqa: E402
from episodes import start_envs  # noqa: E402
from user_code import call_all  # noqa: E402


def start_server():
    """The server's log goes to a file: a pipe nobody reads would fill up and stall it."""
    port, log = free_port(), tempfile.NamedTemporaryFile("w+", suffix="-openenv.log")
    proc = subprocess.Popen([sys.executable, "tests/openenv_for_tests.py", str(port)], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    url, t0 = f"http://127.0.0.1:{port}", time.time()
    while proc.poll() is None and time.time() - t0 < 120:
        try:
            urllib.request.urlopen(url + "/health", timeout=5).read()
            return proc, url, log
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the OpenEnv test server did not start: {open(log.name).read()}")


@pytest.fixture(scope="module")
def server():
    proc, url, log = start_server()
    yield url
    proc.kill()  # (a session of the hang test still sleeps in step(): no graceful shutdown to wait for)
    log.close()


def config(url, **openenv):
    return grpo.Config(env=f"openenv:{url}", openenv=hubs.OpenEnvConfig(**openenv),
                       rollout=grpo.RolloutConfig(env_timeout_s=30))


def test_openenv_sessions_many_at_once(server):
    """32 episodes at once, as episodes.py runs them (every reset, then every step of a turn, each at once), one
    session each: the row's columns reach the server's reset (its letter), the reset observation joins the prompt,
    each observation is the next user message (the text field, or the whole observation as JSON), the rewards
    step() returns add up to the server's last reward or their sum, done comes after TURNS steps. Twice, through a
    server with 32 slots: closed sessions free theirs."""
    actions = [["1 11", "no ones", "111"], ["ab", "bbb", ""]]
    for mode, field in (("last", "text"), ("sum", "")):
        make_env = hubs.load_env(config(server, observation_field=field, reward=mode))
        envs = [make_env() for _ in range(32)]
        letters = ["1", "b"] * 16
        starts = call_all([lambda e=e, c=c: e.reset({"prompt": "Go.", "letter": c, "answer": 1})
                           for e, c in zip(envs, letters)], 30)
        assert [s for s, _, _ in starts] == [[{"role": "user", "content": "Go." + (f" Count the {c}s." if field else
                                               json.dumps({"text": f" Count the {c}s.", "turn": 0}))}]
                                             for c in letters]
        totals = [0.0] * 32
        for turn in range(TURNS):
            steps = call_all([lambda e=e, i=i: e.step(actions[i % 2][turn]) for i, e in enumerate(envs)], 30)
            for i, (out, err, _) in enumerate(steps):
                assert err is None, err
                new, reward, done = out
                text = observation_text(turn + 1, letters[i], actions[i % 2][turn])
                assert done == (turn + 1 == TURNS)
                assert new == (None if done else [{"role": "user", "content": text if field else
                                                   json.dumps({"text": text, "turn": turn + 1})}])
                totals[i] += reward  # what episodes.py does with step()'s rewards
        rewards = [[letter_reward(a, c) for a in actions[i % 2]] for i, c in enumerate(letters)]
        assert totals == [r[-1] if mode == "last" else sum(r) for r in rewards]
        assert all(err is None for _, err, _ in call_all([e.close for e in envs], 30))


def test_episodes_close_their_sessions(server, tool_model):
    """episodes.run_episodes on the server with a scripted engine (each turn: "1" and the end of turn): 32 episodes,
    twice, through the server's 32 slots, so the second round opens its sessions only if the first round's were closed
    when their episodes ended. Each episode takes the server's TURNS steps and its reward is the server's last."""
    import episodes
    import rollout
    tok = AutoTokenizer.from_pretrained(tool_model)
    ids = tok("1", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    engine = SimpleNamespace(generate=lambda prompts, **_: [[rollout.Completion(ids, [-0.5] * len(ids), False)]
                                                            for _ in prompts])
    cfg = config(server, observation_field="text")
    cfg.rollout = grpo.RolloutConfig(env_timeout_s=30, max_turns=TURNS + 1, max_completion_length=64,
                                     max_total_length=512)
    def encode(row, messages):
        return tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"]
    for _ in range(2):
        groups = episodes.run_episodes(engine, tok, [{"row": {"prompt": "Go.", "letter": "1"}}] * 16, n=2, seeds=None,
                                       rollout_cfg=cfg.rollout, temperature=1.0, make_env=hubs.load_env(cfg),
                                       encode=encode)
        assert all(e["env_error"] is None and e["turns"] == TURNS and e["row"]["env_reward"] == letter_reward("1", "1")
                   for g in groups for e in g), next(e["env_error"] for g in groups for e in g)


def test_openenv_failures_raise(server):
    """What episodes.py turns into env_error: an observation without the named text, a connection the server drops
    mid-step (raised at once), a step that hangs past --rollout.env-timeout-s (episodes.py stops waiting then; openenv's
    client raises a second later, which ends the call's thread). Each closes its session."""
    cfg = config(server, observation_field="text")
    cfg.rollout.env_timeout_s = 3.0
    make_env = hubs.load_env(cfg)
    raised = {}
    for mode in ("bad", "drop", "hang"):
        env, t0 = make_env(), time.time()
        env.reset({"prompt": "", "mode": mode})
        with pytest.raises(Exception) as e:
            env.step("1")
        raised[mode] = (type(e.value).__name__, str(e.value), time.time() - t0)
        assert env.client is None  # the session went (closed in the background)
    assert raised["bad"][:2] == ("ValueError", "bad observation from the server: 'text' "
                                               "(--openenv.observation-field) is None, not text")
    assert raised["drop"][0] == "ConnectionClosedOK"  # the close, not a timeout
    assert raised["hang"][0] == "TimeoutError" and raised["hang"][2] >= 4.0  # (the client's limit: 1 s past the flag)
    cfg.rollout.env_timeout_s = SLOW_RESET_S - 0.5  # a reset answered after episodes.py stopped waiting for it (within
    made, make_env = [], hubs.load_env(cfg)         # the client's limit) is closed, not left holding a server slot
    eps = [{"row": {"prompt": "", "mode": "slow"}, "tool_time_s": 0.0, "env": None, "messages": []}]
    start_envs(eps, lambda: made.append(make_env()) or made[-1], lambda row, messages: [], 1.0, set())
    assert eps[0]["env_error"] == "env.reset() timed out after 1 s (--rollout.env-timeout-s)"
    time.sleep(SLOW_RESET_S)
    assert made[0].client is None


def test_openenv_flags_fail_fast(server):
    """One clear message per bad flag, at start-up."""
    dead = f"http://127.0.0.1:{free_port()}"
    cases = [(config(server, action_field="code"), "--openenv.action-field 'code': the server's actions have no such "
              "field (its fields: metadata, message). Name one of them."),
             (config(server, observation_field="stdout"), "--openenv.observation-field 'stdout': the server's "
              "observations have no such field (its fields: done, reward, metadata, text, turn)."),
             (config(server, action_field="metadata"), "--openenv.action-field 'metadata': an action here is one text "
              "field, but the server's actions also require message."),  # (every step would fail its validation)
             (config(server, reward="mean"), "--openenv.reward 'mean': use last or sum."),
             (config(dead), f"--env openenv:{dead}: no OpenEnv server answers at {dead} ([Errno 111] Connection "
              "refused). Start the server first, or fix the URL (openenv:http://HOST:PORT).")]
    for cfg, message in cases:
        with pytest.raises(ValueError) as e:
            hubs.load_env(cfg)
        assert str(e.value).startswith(message), str(e.value)
    from flags import validate_ignored_flags
    with pytest.raises(ValueError, match=r"^--openenv\.\*: only --env openenv:URL reads them, so it would be ignored"):
        validate_ignored_flags(grpo.Config(env="tools_for_tests:make_counting_env",
                                           openenv=hubs.OpenEnvConfig(reward="sum")))


def test_grpo_on_an_openenv_server(tmp_path, server, tool_model, smollm2_dir):
    """grpo.py on the server (tests/episode_dump.py records what the engine sampled), two runs at once:
    builtin:tiny-tools for 2 steps with rows whose sessions fail (a bad observation, a dropped connection, a hung
    step), and SmolLM2-135M-Instruct (the real checkpoint, LoRA) for one step with --openenv.reward sum. The failed
    episodes end with env_error, counted in reward/failed, and the run goes on; each other episode is token-exact with
    the server's reward (check_episode)."""
    rows = [{"prompt": "12*31?", "letter": "1"}, {"prompt": "Say 4.", "letter": "4"}]
    failing = [{"prompt": f"{mode}?", "letter": "1", "mode": mode} for mode in ERRORS]
    runs = {"tiny": (tool_model, rows + failing, 2, ["--rollout.env-timeout-s", "2", "--rollout.max-turns", "4"]),
            "smollm2": (smollm2_dir[0], [{"prompt": "Reply with one word.", "letter": "4"}], 1,
                        ["--openenv.reward", "sum", "--lora.r", "8", "--rollout.max-turns", "2"])}
    procs = {}
    for name, (model, data, steps, extra) in runs.items():
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in data))
        cmd = [sys.executable, "tests/episode_dump.py", "--model", model, "--dataset", str(tmp_path / f"{name}.jsonl"),
               "--output-dir", str(tmp_path / name), "--max-steps", str(steps), "--env", f"openenv:{server}",
               "--openenv.observation-field", "text", "--rollout.engine", "hf", "--num-generations", "2",
               "--batch-size", str(2 * len(data)), "--micro-batch-size", str(2 * len(data)),
               "--rollout.max-completion-length", "48", "--log.completions-every", "0", "--optim.lr", "1e-5", *extra]
        procs[name] = subprocess.Popen(with_earlier_defaults(cmd), cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                       stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})  # a core each
    t0 = time.time()
    for name, (model, data, steps, extra) in runs.items():
        log = procs[name].communicate(timeout=600)[0]
        assert procs[name].returncode == 0, log[-5000:]
        out = str(tmp_path / name)
        metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        rec = torch.load(os.path.join(out, "dump.pt"), weights_only=False)
        eos = AutoTokenizer.from_pretrained(model).eos_token_id
        failed, modes = [], set()  # per step, the failing rows' episodes whose first turn reached the server (ended)
        for step in rec["samples"]:
            tried = [s for s in step if mode_of(s) in ERRORS and s["completion_ids"][
                s["completion_mask"].index(0) - 1 if 0 in s["completion_mask"] else -1] == eos]
            assert all(s["env_error"] == ERRORS[mode_of(s)] for s in tried)
            failed.append(len(tried))
            modes |= {mode_of(s) for s in tried}
            good = [check_episode(s, rec["engine"], model, sum_rewards="sum" in extra) for s in step
                    if mode_of(s) not in ERRORS]
            print(f"{name}: done {time.time() - t0:.0f}s after the start of the wait; turns the server got: {good}")
        assert [m["reward/failed"] for m in metrics] == failed
        assert modes == {r["mode"] for r in data if "mode" in r}  # each failure reached the server at least once


def mode_of(sample):
    return sample["messages"][0]["content"].split("?")[0]


ERRORS = {"bad": "env.step() raised ValueError: bad observation from the server: 'text' (--openenv.observation-field) "
                 "is None, not text",
          "drop": "env.step() raised ConnectionClosedOK: received 1000 (OK); then sent 1000 (OK)",
          "hang": "env.step() timed out after 2 s (--rollout.env-timeout-s)"}


def check_episode(s, engine_calls, model, sum_rewards):
    """-> the number of model turns sent to the server. The mask-1 tokens are exactly the engine's samples at the
    positions it produced them; the turns that ended (an end-of-turn token) went to the server as its action's message
    and each observation it answered is the next user message; env_reward is the server's last (or summed) reward for
    them; no model turn follows the server's done; the episode's ids decode to the chat template's rendering of its
    messages (observations inserted by the template), where the model wrote no other special token."""
    tok = AutoTokenizer.from_pretrained(model)
    ids, P = s["prompt_ids"] + s["completion_ids"], len(s["prompt_ids"])
    model_pos = [0] * len(s["completion_ids"])
    for p, c, _ in engine_calls:
        if c and len(p) >= P and ids[:len(p) + len(c)] == p + c:
            model_pos[len(p) - P:len(p) - P + len(c)] = [1] * len(c)
    assert model_pos == s["completion_mask"]
    letter = "1" if s["messages"][0]["content"].startswith("12*31?") else "4"  # (the rows' letters)
    assert s["messages"][0]["content"].endswith(f" Count the {letter}s.")
    turns = [m["content"] for m in s["messages"] if m["role"] == "assistant"]
    ends = [i for i, (m, n) in enumerate(zip(s["completion_mask"], s["completion_mask"][1:] + [0])) if m and not n]
    sent = [t for t, i in zip(turns, ends) if s["completion_ids"][i] == tok.eos_token_id]
    observations = [m["content"] for m in s["messages"][1:] if m["role"] == "user"]
    assert observations == [observation_text(t, letter, a) for t, a in enumerate(sent, 1)][:len(observations)]
    rewards = [letter_reward(a, letter) for a in sent]
    assert s["env_reward"] == ((sum(rewards) if sum_rewards else rewards[-1]) if sent else None)
    assert len(turns) <= TURNS and (len(sent) < TURNS or len(turns) == TURNS)
    specials = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    if all(t == tok.eos_token_id for t, m in zip(s["completion_ids"], s["completion_mask"]) if m and t in specials):
        decoded = tok.decode(ids)
        shown = [m for m in s["messages"] if not m.get("unseen")]  # (not what came after the last turn)
        rendered = tok.apply_chat_template(shown, tokenize=False,
                                           add_generation_prompt=shown[-1]["role"] == "user")  # cut there
        assert rendered.startswith(decoded) and rendered[len(decoded):] in ("", "\n", tok.eos_token + "\n")
    return len(sent)
