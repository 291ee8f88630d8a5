"""external_rewards.py: rewards computed outside the trainer's Python functions: a reward model (`rm:PATH`, a
one-label sequence classifier, frozen on each rank, optionally FSDP2-sharded) and a reward server
(`http://HOST:PORT/PATH`: POST {"prompts", "completions", <columns>} -> {"rewards": [...]}, retried with backoff).
Both return reward functions with the one signature of tasks.py: fn(prompts, completions, **columns) -> list[float].
"""
import http.client
import json
import time
import urllib.parse
import urllib.request

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import models
from user_code import within


class RewardBatchFailed(Exception):
    """The whole batch failed at its source (a server down, timing out or answering garbage): every sample gets None,
    without the sample-by-sample retry a raising Python function gets."""


def rm_text(prompt, completion, tok, system_prompt=None):
    """Prompt + completion as the reward model reads them: the conversation the policy saw (`system_prompt` first, as
    tasks.encode_prompt puts it, unless the prompt opens with its own), through the reward model's own chat template
    when it has one (the completion as the assistant turn); else a text prompt directly followed by the completion, or
    the turns' texts and the completion one per line. -> (text, [(start, end)] character spans of the messages'
    contents and the completion: the only text rm_batch may cut, never the template's BOS or headers)."""
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    turns = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
              else "".join(c.get("text", "") for c in m["content"])} for m in turns]  # image-text: its text parts
    if system_prompt and turns[0]["role"] != "system":
        turns = [{"role": "system", "content": system_prompt}] + turns
    if not getattr(tok, "chat_template", None):
        text = prompt + completion if len(turns) == 1 and isinstance(prompt, str) else "\n".join(
            [m["content"] for m in turns] + [completion])
        return text, [(0, len(text))]
    text = tok.apply_chat_template(turns + [{"role": "assistant", "content": completion}], tokenize=False)
    spans, at = [], 0
    for part in [m["content"] for m in turns] + [completion]:  # found in order; a content the template altered stays
        part = part if part in text[at:] else part.strip()  # a template that trims the contents
        lo = text.find(part, at) if part else -1
        if lo >= 0:
            spans, at = spans + [(lo, lo + len(part))], lo + len(part)
    return text, spans


def rm_batch(tok, texts, max_len):
    """(text, cuttable spans) pairs -> (input_ids [B, T] right-padded, lengths [B], number cut). A text over `max_len`
    tokens loses its first tokens inside the spans (the prompt's contents from the start; the completion only once no
    prompt is left): the chat template's BOS and headers, special tokens the tokenizer adds (BOS, CLS, SEP) and the end
    the score is read at stay (as the policy's own prompts are cut from the left, --rollout.max-prompt-length)."""
    plain = not getattr(tok, "chat_template", None)  # a chat-templated text already holds its special tokens
    enc = tok([t for t, _ in texts], add_special_tokens=plain, return_offsets_mapping=True)
    rows, cut = [], 0
    for ids, offsets, (_, spans) in zip(enc["input_ids"], enc["offset_mapping"], texts):
        over = len(ids) - max_len if max_len else 0
        if over > 0:
            inside = [i for i, (lo, hi) in enumerate(offsets) if hi > lo and any(a <= lo and hi <= b for a, b in spans)]
            drop = set(inside[:over])  # added specials span (0, 0); template tokens lie outside every span
            ids, cut = [t for i, t in enumerate(ids) if i not in drop], cut + 1
        rows.append(ids)
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(r, dtype=torch.long) for r in rows], batch_first=True,
                                          padding_value=tok.pad_token_id)  # [B, T] right-padded
    return ids, torch.tensor([len(r) for r in rows]), cut


def last_token_scores(model, ids, lens):
    """The scalar head at each row's last real token (OpenRLHF reads its reward model at the last attended position,
    openrlhf/models/model.py). transformers pools at the last token that is not the pad id, one token early when pad is
    eos and the text ends in eos; so a head that scores every position (`score`: [B, T, 1]) is read here at lens - 1,
    and other heads (a CLS pooler) keep the model's own pooling. -> [B] float."""
    seen = {}
    head = getattr(model, "score", None)
    hook = head.register_forward_hook(lambda m, i, o: seen.update(out=o)) if head is not None else None
    try:
        logits = model(input_ids=ids, attention_mask=(torch.arange(ids.shape[1]) < lens[:, None]).long().to(ids.device))
    finally:
        if hook is not None:
            hook.remove()
    every = seen.get("out")
    if every is not None and every.dim() == 3:  # [B, T, 1]
        return every[torch.arange(len(lens)), lens.to(every.device) - 1, 0].float()
    return logits.logits[:, 0].float()


def agree(n_pass, err, sharded, device, model):
    """(collective when sharded) -> the largest number of passes over ranks. A failure on any rank raises
    RewardBatchFailed on every rank (never a sample-by-sample retry on one rank: its passes would no longer match the
    others' collectives), after every rank resets FSDP2's state (an aborted forward leaves its gathered parameters and
    iteration state differing between ranks); unsharded, the error itself is raised."""
    if not sharded:
        if err is not None:
            raise err
        return n_pass
    flags = torch.zeros(dist.get_world_size() + 1, dtype=torch.long, device=device)  # [passes, failed on rank r]
    flags[0], flags[1 + dist.get_rank()] = n_pass, int(err is not None)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    failed = flags[1:].nonzero().flatten().tolist()
    if failed:
        model.reset_iter_state()  # FSDP2's recovery after an aborted forward: reshard all, clear the iteration state
        raise RewardBatchFailed(f"the sharded reward model failed on rank(s) {failed}: every rank gives this batch "
                                "None") from err
    return int(flags[0])


@torch.no_grad()
def reward_model_scores(model, tok, render, batch_size, device, sharded=False, max_len=None):
    """The reward model's scalar head at each text's last real token, `batch_size` texts per forward pass ->
    (list[float], texts cut to `max_len`); render() -> rm_text's (text, spans) pairs. Sharded: every forward is a
    collective, so each rank runs as many as the busiest one (padding passes on a one-token text), and the ranks agree
    after rendering and batching (a template raising on one rank's rows fails the batch on every rank) and after each
    pass."""
    batches, texts, err = [], [], None
    try:
        texts = render()
        batches = [rm_batch(tok, texts[i:i + batch_size], max_len) for i in range(0, len(texts), batch_size)]
    except Exception as e:  # noqa: BLE001 - agreed on below, raised on every rank
        err = e
    n_pass, out = agree(len(batches), err, sharded, device, model), []
    for i in range(n_pass):
        ids, lens, _ = batches[i] if i < len(batches) else (torch.tensor([[tok.pad_token_id]]), torch.tensor([1]), 0)
        try:
            out += last_token_scores(model, ids.to(device), lens).tolist()
        except Exception as e:  # noqa: BLE001
            err = e
        agree(0, err, sharded, device, model)
    return out[:len(texts)], sum(b[2] for b in batches)


def reward_model_reward(path, device, batch_size, shard_gb=float("inf"), system_prompt=None, chat_template=True):
    """`rm:PATH`: a frozen one-label sequence classifier (a reward model, e.g. InstructGPT arXiv 2203.02155) scores the
    conversation the policy saw (`system_prompt` on chat prompts, and on text ones when `chat_template` wraps them as
    a user turn, as --data.chat-template does) + completion, cut from the left to its context, on the trainer's
    device: replicated on each rank, or FSDP2-sharded when its weights exceed `shard_gb` (models.load_reward_model).
    `.truncated` counts the texts cut since scoring.take_rm_truncated last took it (reward/rm_truncated)."""
    model, tok = models.load_reward_model(path, device, shard_gb)
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    limits = [getattr(model.config.get_text_config(), "max_position_embeddings", None),
              tok.model_max_length if tok.model_max_length < 1e9 else None]  # transformers' "no limit" is 1e30
    max_len = min([n for n in limits if n], default=None)  # the most tokens it reads (None when neither says)

    def rm_reward(prompts, completions, **_):
        scores, cut = reward_model_scores(
            model, tok, lambda: [rm_text(p, c, tok, system_prompt if chat_template or not isinstance(p, str) else None)
                                 for p, c in zip(prompts, completions)],
            batch_size, torch.device(device), sharded, max_len)
        rm_reward.truncated = getattr(rm_reward, "truncated", 0) + cut  # scoring.take_rm_truncated
        return scores
    rm_reward.model, rm_reward.tok = model, tok
    return rm_reward


def post_rewards(url, payload, n, timeout_s, retries):
    """POST JSON `payload`, read {"rewards": [n numbers or null]}; a failed try (no connection, HTTP error, no whole
    answer within timeout_s, bad JSON) is retried with exponential backoff. -> n rewards (NaN/inf answers are passed
    on: scoring.call_reward makes them None, counted as failed); RewardBatchFailed when no try gets a valid answer.
    A try's whole exchange (connect, send, every byte of the answer) must end within timeout_s: urllib's timeout
    bounds each socket operation only, and a server that trickles its answer never trips it."""
    body, err = json.dumps(payload, default=str).encode(), None  # default=str: dates etc. travel as text
    late = TimeoutError(f"no complete answer within --data.http-timeout-s {timeout_s:g} s")

    def post():
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(0.5 * 2 ** (attempt - 1))
        try:
            answer = within(post, timeout_s, late)
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
    u = urllib.parse.urlsplit(url)
    try:
        u.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        u = None
    if u is None or u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"--data.rewards {url!r} is not a reward server URL: use http://HOST:PORT/PATH.")

    def remote_reward(prompts, completions, **columns):
        if not completions:  # a rank with nothing to score this time (evaluation rows < ranks)
            return []
        payload = {"prompts": prompts, "completions": completions, **columns}
        return post_rewards(url, payload, len(completions), timeout_s, retries)
    return remote_reward
