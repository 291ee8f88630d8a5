"""Reward models (rm:PATH) and reward servers (http://) as rewards: scores against a direct run of the model, a real
HTTP server on 127.0.0.1 (answers, errors, timeouts, garbage), and one short grpo.py run that mixes them."""
import json
import math
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import models
import scoring
import tasks
from conftest import run
from tiny_models import build_tiny_reward_model

PROMPTS = ["max 3 8 1 =", [{"role": "user", "content": "What is 12 + 30?"}], "hi",
           [{"role": "system", "content": "be brief"}, {"role": "user", "content": "max 1 2 ="}], "x", "max 9 =", "?"]
COMPLETIONS = [" 8", "The answer is \\boxed{42}.", "", " 2", "a much longer completion than the others are", " 9", "42"]


@pytest.fixture(scope="module")
def rm_dirs(tmp_path_factory):
    """A Qwen2 reward model with a chat template and a Llama one without (plain prompt + completion)."""
    return {"qwen2": build_tiny_reward_model(str(tmp_path_factory.mktemp("rm-qwen2")), arch="qwen2", seed=1),
            "llama": build_tiny_reward_model(str(tmp_path_factory.mktemp("rm-llama")), arch="llama",
                                             chat_template=False, seed=2)}


def direct_scores(path, prompts, completions):
    """Reference: the checkpoint loaded afresh, one unpadded text per forward, texts built here from the template."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    model, tok = AutoModelForSequenceClassification.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    out = []
    for p, c in zip(prompts, completions):
        turns = [{"role": "user", "content": p}] if isinstance(p, str) else p
        if tok.chat_template:
            text = tok.apply_chat_template(turns + [{"role": "assistant", "content": c}], tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(p + c if isinstance(p, str) else "\n".join([m["content"] for m in turns] + [c]))["input_ids"]
        with torch.no_grad():
            out.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_reward_model_scores_equal_a_direct_run(rm_dirs, arch):
    """Batched (3 per pass, right-padded) scores == the model run on each text alone; the copy is frozen fp32 on CPU."""
    fn = scoring.resolve_reward("rm:" + rm_dirs[arch], tasks.DataConfig(rm_batch_size=3))
    got, ref = fn(PROMPTS, COMPLETIONS), direct_scores(rm_dirs[arch], PROMPTS, COMPLETIONS)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                               rtol=0, atol=1e-5)  # padding changes matmul shapes: fp32 rounding, not exact bits
    assert torch.tensor(ref).std() > 0.1  # distinct texts get distinct scores: the check above is not vacuous
    model, tok = models.load_reward_model(rm_dirs[arch], "cpu")
    assert not model.training and model.dtype == torch.float32 and tok.padding_side == "right"
    assert not any(p.requires_grad for p in model.parameters())


def test_several_reward_models_mixed_with_a_function(rm_dirs):
    """Two reward models and a Python function in one score_rewards call: each column is its own source's scores."""
    data = tasks.DataConfig(rm_batch_size=2)
    fns = [(n, scoring.resolve_reward(n, data)) for n in ("rm:" + rm_dirs["qwen2"], "format", "rm:" + rm_dirs["llama"])]
    rows = [{"prompt": p, "answer": "8"} for p in PROMPTS]
    r, failed = scoring.score_rewards(fns, rows, COMPLETIONS, [[1]] * len(rows), set())
    assert r.shape == (len(rows), 3) and failed == [0, 0, 0]
    torch.testing.assert_close(r[:, 0].double(), torch.tensor(direct_scores(rm_dirs["qwen2"], PROMPTS, COMPLETIONS),
                                                               dtype=torch.float64), rtol=0, atol=1e-5)
    torch.testing.assert_close(r[:, 2].double(), torch.tensor(direct_scores(rm_dirs["llama"], PROMPTS, COMPLETIONS),
                                                               dtype=torch.float64), rtol=0, atol=1e-5)
    assert r[:, 1].tolist() == [float("\\boxed{" in c) for c in COMPLETIONS]


def test_reward_model_bad_paths(tmp_path, text_dir):
    """Not a 1-label classifier (a causal LM, a 2-label classifier) or no checkpoint: one clear error, config only."""
    two = build_tiny_reward_model(str(tmp_path / "two"), num_labels=2)
    for path, message in [(text_dir, "is not a one-label sequence classifier"),
                          (two, "num_labels 2"), (str(tmp_path / "none"), "no config.json there")]:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            scoring.check_rewards(["accuracy", "rm:" + path], tasks.DataConfig())
    for url in ("http://", "http://host:port/x"):
        with pytest.raises(ValueError, match="is not a reward server URL"):
            scoring.check_rewards([url], tasks.DataConfig())
    with pytest.raises(ValueError, match="--data.http-retries >= 0"):
        scoring.check_rewards([], tasks.DataConfig(http_retries=-1))


# ----------------------------------------------------------------------------------------------------------
# A reward server on 127.0.0.1, started by the tests
# ----------------------------------------------------------------------------------------------------------

def server_reward(completion, ids):
    """What the test server answers for one sample (None for completions that say 'skip')."""
    return None if "skip" in completion else len(completion) / 10 + len(ids) / 100


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        state = self.server.state
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        state["requests"].append(body)
        mode, n = state["mode"], len(body["completions"])
        if mode == "slow":
            time.sleep(state["delay_s"])
        answers = {"ok": {"rewards": [server_reward(c, i) for c, i in zip(body["completions"], body["completion_ids"])]},
                   "slow": {"rewards": [0.0] * n}, "short": {"rewards": [1.0] * (n - 1)}, "trickle": {"rewards": [0.5] * n},
                   "nonfinite": {"rewards": [float("nan"), float("inf"), 1.0][:n]},
                   "text": {"rewards": ["good"] * n}, "no_key": {"scores": [1.0] * n}}
        payload = b"not json" if mode == "garbage" else json.dumps(answers.get(mode, {})).encode()
        try:
            self.send_response(500 if mode == "error" else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            for i in range(len(payload) if mode == "trickle" else 0):  # one byte at a time over delay_s in all
                self.wfile.write(payload[i:i + 1])
                time.sleep(state["delay_s"] / len(payload))
            self.wfile.write(b"" if mode == "trickle" else payload)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
            pass

    def log_message(self, *_):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    srv.state = {"mode": "ok", "requests": [], "delay_s": 0.0}
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def url_of(srv):
    return f"http://127.0.0.1:{srv.server_address[1]}/score"


def test_http_rewards_arrive_with_the_columns(server):
    rows = [{"prompt": p, "answer": str(i)} for i, p in enumerate(PROMPTS[:4])]
    completions, ids = ["a", "bb skip", "ccc", ""], [[1], [2, 3], [4, 5, 6], []]
    fn = scoring.resolve_reward(url_of(server), tasks.DataConfig())
    r, failed = scoring.score_rewards([("http", fn)], rows, completions, ids, set())
    expected = [server_reward(c, i) for c, i in zip(completions, ids)]
    assert failed == [0] and [None if math.isnan(x) else pytest.approx(x) for x in r[:, 0].tolist()] == expected
    (body,) = server.state["requests"]  # one POST for the whole batch
    assert body == {"prompts": PROMPTS[:4], "completions": completions, "answer": ["0", "1", "2", "3"],
                    "completion_ids": ids}


@pytest.mark.parametrize("mode,tries", [("error", 3), ("slow", 3), ("garbage", 3), ("short", 1), ("text", 1),
                                        ("no_key", 1), ("refused", 0)])
def test_http_failures_give_counted_none_rewards(server, capsys, mode, tries):
    """Server errors, timeouts and bad JSON are retried (2 retries here); wrong-length, non-numeric or key-less answers
    are not; either way every sample gets None, counted in the failures, and nothing raises. A Python reward beside it
    is unaffected."""
    server.state.update(mode=mode, delay_s=1.0)
    url = url_of(server)
    if mode == "refused":  # nothing listens there
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}/score"
    data = tasks.DataConfig(http_timeout_s=0.3, http_retries=2)
    fns = [("http", scoring.resolve_reward(url, data)), ("format", scoring.format_reward)]
    rows = [{"prompt": p} for p in PROMPTS[:3]]
    t0 = time.time()
    r, failed = scoring.score_rewards(fns, rows, ["\\boxed{1}", "b", "c"], [[1], [2], [3]], set())
    secs = time.time() - t0
    assert failed == [3, 0] and torch.isnan(r[:, 0]).all() and r[:, 1].tolist() == [1.0, 0.0, 0.0]
    assert len(server.state["requests"]) == tries  # one POST per try, never one per sample
    assert secs < 3 * 0.3 + 0.5 + 1.0 + 2.0, secs  # 3 tries x timeout + backoff (0.5 + 1 s) + slack
    assert "reward function 'http' raised" in capsys.readouterr().err


def test_http_deadline_is_per_try_and_nonfinite_answers_are_failures(server, capsys):
    """A server that trickles its answer (every read is quick, the whole takes 1.5 s) misses a 1.0 s timeout: the
    deadline covers the whole try, not each socket read. NaN / Infinity in an answer become None, counted as failed."""
    server.state.update(mode="trickle", delay_s=1.5)
    fns = [("http", scoring.resolve_reward(url_of(server), tasks.DataConfig(http_timeout_s=1.0, http_retries=0)))]
    rows = [{"prompt": p} for p in PROMPTS[:3]]
    t0 = time.time()
    r, failed = scoring.score_rewards(fns, rows, ["a", "b", "c"], [[1], [2], [3]], set())
    assert failed == [3] and torch.isnan(r[:, 0]).all() and time.time() - t0 < 1.4
    assert "no complete answer within --data.http-timeout-s 1 s" in capsys.readouterr().err
    server.state.update(mode="nonfinite")
    r, failed = scoring.score_rewards(fns, rows, ["a", "b", "c"], [[1], [2], [3]], set())
    assert failed == [2] and r[:, 0].isnan().tolist() == [True, True, False] and r[2, 0] == 1.0
    assert "reward function 'http' returned nan for a sample" in capsys.readouterr().err


def test_grpo_run_mixes_accuracy_reward_model_and_server(tmp_path, rm_dirs, server):
    """One process, 2 steps: the per-function means are those of each source on the step's completions (the reward
    model re-run directly on the texts the server received), and reward/mean is their weighted sum."""
    out, rm = str(tmp_path / "mixed"), "rm:" + rm_dirs["qwen2"]
    run([sys.executable, "grpo.py", "--output-dir", out, "--max-steps", "2", "--rollout.engine", "hf",
         "--num-generations", "4", "--batch-size", "16", "--micro-batch-size", "16", "--log.completions-every", "0",
         "--data.rewards", "accuracy", rm, url_of(server), "--data.reward-weights", "1", "0.5", "2"], timeout=300)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 2 and len(server.state["requests"]) == 2  # one POST per step
    for row, body in zip(rows, server.state["requests"]):
        assert len(body["completions"]) == 16 and row["reward/failed"] == 0 and row["reward/rm_truncated"] == 0
        rm_ref = direct_scores(rm_dirs["qwen2"], body["prompts"], body["completions"])
        http_ref = [server_reward(c, i) for c, i in zip(body["completions"], body["completion_ids"])]
        http_ref = [x for x in http_ref if x is not None]
        assert row[f"reward/{rm}/mean"] == pytest.approx(sum(rm_ref) / len(rm_ref), abs=1e-5)
        assert row[f"reward/{url_of(server)}/mean"] == pytest.approx(sum(http_ref) / len(http_ref), abs=1e-6)
        weighted = (row["reward/accuracy/mean"] + 0.5 * row[f"reward/{rm}/mean"]
                    + 2 * row[f"reward/{url_of(server)}/mean"])
        assert row["reward/mean"] == pytest.approx(weighted, abs=1e-4)


def test_sharded_reward_model_scores_equal_a_direct_run(rm_dirs):
    """--data.rm-shard-gb 0 on 2 ranks: FSDP2-sharded reward model, uneven texts per rank (tests/dist_rm_shard.py)."""
    from conftest import torchrun
    _, out, _ = torchrun("tests/dist_rm_shard.py", rm_dirs["qwen2"], timeout=300)
    assert out.count("RM SHARD OK") == 2, out[-3000:]


# ----------------------------------------------------------------------------------------------------------
# What the reward model reads: the policy's conversation, scored at its last real token, cut from the left
# ----------------------------------------------------------------------------------------------------------

EOS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # ends in eos: no newline after


def own_forward(path, ids):
    """Reference: the classifier's own forward on one unpadded id list (no pad token in the checkpoint: pools the
    last position; with one, the last non-pad one)."""
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


def test_reward_model_without_pad_token_scores_the_last_real_token(tmp_path):
    """No pad token (pad set to eos) and a template ending in eos: each text is scored at its final eos, as the
    classifier scores the hand-built text alone, whatever the batch's padding (3 texts per pass, lengths differ)."""
    from transformers import AutoTokenizer
    path = build_tiny_reward_model(str(tmp_path / "rm"), chat_template=EOS_TEMPLATE, pad=False, seed=3)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.pad_token is None
    prompts, completions = ["max 3 8 1 =", "What is 12 + 30?", "hi", "x"], [" 8", "The answer is 42.", "", "a b c d e"]
    got = scoring.resolve_reward("rm:" + path, tasks.DataConfig(rm_batch_size=3))(prompts, completions)
    ref, early = [], []
    for p, c in zip(prompts, completions):
        ids = tok(f"<|im_start|>user\n{p}<|im_end|><|im_start|>assistant\n{c}<|im_end|>", add_special_tokens=False)
        ids = ids["input_ids"]
        assert ids[-1] == tok.eos_token_id
        ref.append(own_forward(path, ids))
        early.append(own_forward(path, ids[:-1]))  # what pooling at the last non-eos token reads
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                               rtol=0, atol=1e-5)
    assert min(abs(a - b) for a, b in zip(ref, early)) > 1e-3  # one token early would be visibly different


def test_reward_model_sees_the_system_prompt_the_policy_saw(rm_dirs):
    """--data.system-prompt reaches the reward model's conversation as it reaches the policy's (tasks.encode_prompt):
    first, unless the prompt opens with its own system turn; not on text prompts the policy read raw
    (--data.chat-template false)."""
    from transformers import AutoTokenizer
    path = rm_dirs["qwen2"]
    tok = AutoTokenizer.from_pretrained(path)
    turn = lambda role, text: f"<|im_start|>{role}\n{text}<|im_end|>\n"  # noqa: E731 - CHAT_TEMPLATE by hand
    prompts = ["hi", [{"role": "user", "content": "max 1 2 ="}],
               [{"role": "system", "content": "terse"}, {"role": "user", "content": "x"}]]
    completions = [" 2", "The answer is 2.", " y"]
    expected = [turn("system", "be brief") + turn("user", "hi") + turn("assistant", " 2"),
                turn("system", "be brief") + turn("user", "max 1 2 =") + turn("assistant", "The answer is 2."),
                turn("system", "terse") + turn("user", "x") + turn("assistant", " y")]
    raw = [turn("user", "hi") + turn("assistant", " 2")] + expected[1:]  # the text prompt without the system turn
    for chat_template, texts in [(True, expected), (False, raw)]:
        data = tasks.DataConfig(rm_batch_size=2, system_prompt="be brief", chat_template=chat_template)
        got = scoring.resolve_reward("rm:" + path, data)(prompts, completions)
        ref = [own_forward(path, tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                                   rtol=0, atol=1e-5)


def test_reward_model_cuts_long_prompts_from_the_left(tmp_path):
    """A text over the reward model's context (48 positions here) loses the start of its prompt's content (the first
    header stays) and keeps the whole completion; it is scored as the classifier scores those 48 tokens alone, and counted in .truncated (the
    reward/rm_truncated metric). A text that fits is untouched."""
    from transformers import AutoTokenizer
    path = build_tiny_reward_model(str(tmp_path / "rm"), max_positions=48, seed=4)
    tok = AutoTokenizer.from_pretrained(path)
    long_prompt, short_prompt = "What is 12 + 30? " * 12 + "max 3 8 1 =", "hi"
    completion = " The answer is \\boxed{42}."
    fn = scoring.resolve_reward("rm:" + path, tasks.DataConfig(rm_batch_size=2))
    got = fn([short_prompt, long_prompt], [completion, completion])
    texts = [f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n{completion}<|im_end|>\n"
             for p in (short_prompt, long_prompt)]
    short_ids, long_ids = (tok(t, add_special_tokens=False)["input_ids"] for t in texts)
    assert len(short_ids) <= 48 < len(long_ids)
    head = tok("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    kept = head + long_ids[-(48 - len(head)):]
    assert long_ids[:len(head)] == head and tok.decode(kept).endswith(f"<|im_start|>assistant\n{completion}<|im_end|>\n")  # the completion is whole
    ref = [own_forward(path, short_ids), own_forward(path, kept)]
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                               rtol=0, atol=1e-5)
    assert fn.truncated == 1 and abs(own_forward(path, long_ids) - ref[1]) > 1e-3  # reading it all would differ


def test_sharded_reward_model_failing_on_one_rank_keeps_the_ranks_in_step(rm_dirs):
    """A sharded reward model whose forward raises on rank 0 only: every rank gives that batch None and the next batch
    scores exactly on both (tests/dist_rm_shard_fail.py), within the timeout (a retry on one rank only hangs)."""
    from conftest import torchrun
    _, out, _ = torchrun("tests/dist_rm_shard_fail.py", rm_dirs["qwen2"], timeout=150)
    assert out.count("RM SHARD FAILURE OK") == 2, out[-3000:]


def test_reward_model_truncation_keeps_the_templates_own_bos_and_header(tmp_path):
    """A chat template that writes its own BOS first (as Llama-3's <|begin_of_text|>, Gemma's <bos>): cutting a long
    text keeps that BOS and the first header, and drops the prompt content's first tokens; the result is the template's
    prefix followed by the full text's last tokens, scored as the classifier scores those ids."""
    from tiny_models import CHAT_TEMPLATE
    from transformers import AutoTokenizer
    path = build_tiny_reward_model(str(tmp_path / "rm"), max_positions=48, seed=5,
                                   chat_template="<|endoftext|>" + CHAT_TEMPLATE)  # <|endoftext|> plays the BOS
    tok = AutoTokenizer.from_pretrained(path)
    prompt, completion = "What is 12 + 30? " * 12 + "max 3 8 1 =", " The answer is \\boxed{42}."
    fn = scoring.resolve_reward("rm:" + path, tasks.DataConfig(rm_batch_size=2))
    got = fn([prompt], [completion])
    full = tok(f"<|endoftext|><|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{completion}<|im_end|>\n",
               add_special_tokens=False)["input_ids"]
    head = tok("<|endoftext|><|im_start|>user\n", add_special_tokens=False)["input_ids"]
    assert full[:len(head)] == head and len(full) > 48
    kept = head + full[-(48 - len(head)):]
    assert fn.truncated == 1
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor([own_forward(path, kept)], dtype=torch.float64), rtol=0, atol=1e-5)


def test_reward_model_sees_text_prompts_as_the_policy_does(rm_dirs):
    """A policy without a chat template reads a text prompt raw (tasks.encode_prompt: no user turn, no system prompt,
    whatever --data.chat-template says): the reward model, given the policy's processor, sees no system prompt either;
    a policy with a template wraps it, system prompt included."""
    from transformers import AutoTokenizer
    path = rm_dirs["qwen2"]
    tok = AutoTokenizer.from_pretrained(path)
    plain = AutoTokenizer.from_pretrained(path)
    plain.chat_template = None
    data = tasks.DataConfig(rm_batch_size=2, system_prompt="be brief", chat_template=True)
    turn = lambda role, text: f"<|im_start|>{role}\n{text}<|im_end|>\n"  # noqa: E731 - CHAT_TEMPLATE by hand
    for policy, text in [(plain, turn("user", "hi") + turn("assistant", " 2")),
                         (tok, turn("system", "be brief") + turn("user", "hi") + turn("assistant", " 2"))]:
        assert ("be brief" in tasks.encode_prompt({"prompt": "hi"}, policy, 64, True, "be brief")["text"]) == \
            ("be brief" in text)  # what the policy saw
        got = scoring.resolve_reward("rm:" + path, data, processor=policy)(["hi"], [" 2"])
        want = own_forward(path, tok(text, add_special_tokens=False)["input_ids"])
        assert abs(got[0] - want) < 1e-5, (policy.chat_template is None, got, want)


def test_rm_text_marks_only_the_contents_as_cuttable():
    """rm_text's cuttable spans are the messages' contents and the completion, found in the rendered text in order
    (also when the template trims them): never the template's own BOS and headers."""
    from types import SimpleNamespace
    from external_rewards import rm_text
    render = lambda turns, tokenize: "<bos>" + "".join(f"<{m['role']}>{m['content'].strip()}</>" for m in turns)  # noqa: E731
    tok = SimpleNamespace(chat_template="trims", apply_chat_template=render)
    text, spans = rm_text("  user text ", " answer", tok, system_prompt="sys")
    assert text == "<bos><system>sys</><user>user text</><assistant>answer</>"
    assert [text[a:b] for a, b in spans] == ["sys", "user text", "answer"]
