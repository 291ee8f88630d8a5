"""external_rewards.py: rewards computed outside the trainer's Python functions: a reward model (`rm:PATH`, a
one-label sequence classifier, frozen on each rank, optionally FSDP2-sharded) and a reward server
(`http://HOST:PORT/PATH`: POST {"prompts", "completions", <columns>} -> {"rewards": [...]}, retried with backoff).
Both return reward functions with the one signature of tasks.py: fn(prompts, completions, **columns) -> list[float].
"""
import http.client
import json
import threading
import time
import urllib.parse
import urllib.request

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import models



class RewardBatchFailed(Exception):
    """The whole batch failed at its source (a server down, timing out or answering garbage): every sample gets None,
    without the sample-by-sample retry a raising Python function gets."""


def _text(content):
    """A chat message's content as text (image-text messages keep their text parts)."""
    return content if isinstance(content, str) else "".join(c.get("text", "") for c in content)


def rm_text(prompt, completion, tok):
    """Prompt + completion as the reward model reads them: through its own chat template when it has one (the prompt's
    turns, then the completion as the assistant turn); else a text prompt directly followed by the completion, or the
    turns' texts and the completion one per line."""
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    turns = [{"role": m["role"], "content": _text(m["content"])} for m in turns]
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(turns + [{"role": "assistant", "content": completion}], tokenize=False)
    return prompt + completion if isinstance(prompt, str) else "\n".join([m["content"] for m in turns] + [completion])


@torch.no_grad()
def reward_model_scores(model, tok, texts, batch_size, device, sharded=False):
    """The reward model's scalar head on each text, `batch_size` texts per forward pass -> list[float]. Chat-templated
    texts already hold their special tokens; plain texts get the tokenizer's (BOS / CLS ...). Sharded: every forward
    is a collective, so each rank runs as many as the busiest one (padding passes on a one-token text)."""
    add_special = not getattr(tok, "chat_template", None)
    n_pass = -(-len(texts) // batch_size)
    if sharded:
        n = torch.tensor([n_pass], device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        n_pass = int(n)
    out = []
    for i in range(n_pass):
        chunk = texts[i * batch_size:(i + 1) * batch_size] or [tok.pad_token]
        enc = tok(chunk, padding=True, add_special_tokens=add_special, return_tensors="pt")
        out += model(**enc.to(device)).logits[:, 0].float().tolist()  # [b, 1] -> b floats
    return out[:len(texts)]


def reward_model_reward(path, device, batch_size, shard_gb=float("inf")):
    """`rm:PATH`: a frozen one-label sequence classifier (a reward model, e.g. InstructGPT arXiv 2203.02155) scores the
    chat-formatted prompt + completion on the trainer's device: replicated on each rank, or FSDP2-sharded when its
    weights exceed `shard_gb` (models.load_reward_model)."""
    model, tok = models.load_reward_model(path, device, shard_gb)
    sharded = any(isinstance(p, DTensor) for p in model.parameters())

    def rm_reward(prompts, completions, **_):
        texts = [rm_text(p, c, tok) for p, c in zip(prompts, completions)]
        return reward_model_scores(model, tok, texts, batch_size, torch.device(device), sharded)
    rm_reward.model = model
    return rm_reward


def check_url(url):
    """An http(s)://HOST[:PORT]/PATH reward URL, or one clear error."""
    u = urllib.parse.urlsplit(url)
    try:
        u.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        u = None
    if u is None or u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"--data.rewards {url!r} is not a reward server URL: use http://HOST:PORT/PATH.")
    return url


def within(call, timeout_s, late):
    """call() on a daemon thread, waited for at most timeout_s (0 = no limit) -> its result, or its exception; the
    exception `late` past the deadline. (Python cannot stop a thread: a late call is left to finish on its own.)"""
    if not timeout_s:
        return call()
    box = {}

    def target():
        try:
            box["out"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise late
    if "error" in box:
        raise box["error"]
    return box["out"]


def post_once(url, body, timeout_s):
    """One POST whose whole exchange (connect, send, every byte of the answer) must end within timeout_s -> the JSON
    answer. urllib's timeout bounds each socket operation only: a server that trickles its answer never trips it."""
    def post():
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    return within(post, timeout_s, TimeoutError(f"no complete answer within --data.http-timeout-s {timeout_s:g} s"))


def post_rewards(url, payload, n, timeout_s, retries):
    """POST JSON `payload`, read {"rewards": [n numbers or null]}; a failed try (no connection, HTTP error, no whole
    answer within timeout_s, bad JSON) is retried with exponential backoff. -> n rewards (NaN/inf answers are passed
    on: tasks.call_reward makes them None, counted as failed); RewardBatchFailed when no try gets a valid answer."""
    body, err = json.dumps(payload, default=str).encode(), None  # default=str: dates etc. travel as text
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(0.5 * 2 ** (attempt - 1))
        try:
            answer = post_once(url, body, timeout_s)
            break
        except (OSError, ValueError, http.client.HTTPException) as e:  # URLError, HTTPError and timeouts are OSErrors
            err = e
    else:
        raise RewardBatchFailed(f"reward server {url}: no answer after {retries + 1} tries ({err!r})") from err
    rewards = answer.get("rewards") if isinstance(answer, dict) else None
    numeric = lambda r: r is None or (isinstance(r, (int, float)) and not isinstance(r, bool))  # noqa: E731
    if not isinstance(rewards, list) or len(rewards) != n or not all(map(numeric, rewards)):
        raise RewardBatchFailed(f"reward server {url} answered {str(answer)[:200]}: expected "
                                f'{{"rewards": [...]}} with {n} numbers or nulls')
    return [None if r is None else float(r) for r in rewards]


def http_reward(url, timeout_s, retries):
    """`http://HOST:PORT/PATH`: a reward server (a vLLM/TGI-served reward model, a sandbox, a judge). The request
    carries the prompts, the completions and every other column, completion_ids included."""
    check_url(url)

    def remote_reward(prompts, completions, **columns):
        if not completions:  # a rank with nothing to score this time (evaluation rows < ranks)
            return []
        payload = {"prompts": prompts, "completions": completions, **columns}
        return post_rewards(url, payload, len(completions), timeout_s, retries)
    return remote_reward
