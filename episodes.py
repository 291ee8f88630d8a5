"""episodes.py: multi-turn rollouts (tool calls, environments), token-exact.

An episode is the prompt's ids followed by turns: the ids the engine sampled for each model turn, exactly as sampled,
then the tokenised messages that answer it (tool results or environment observations, with the chat template's turn
separators and the next assistant header), until a model turn calls no tool (and the environment, if any, is done),
--rollout.max-turns, or a length limit. Model text is never re-tokenised.

    prompt_ids       <|im_start|>user\\nWhat is 123 * 45?<|im_end|>\\n<|im_start|>assistant\\n
    completion_ids   <tool_call>{"name": "multiply", ...}</tool_call><|im_end|>        model turn 1 (engine ids)
                     \\n<|im_start|>user\\n<tool_response>\\n5535\\n</tool_response><|im_end|>\\n
                     <|im_start|>assistant\\n                                          inserted (tokenised)
                     5535<|im_end|>                                                      model turn 2 (engine ids)
    completion_mask  1 ... 1 | 0 ... 0 | 1 ... 1    (engine_logps are 0 where the mask is 0)

Only mask-1 tokens reach the loss and the engine/trainer log-prob comparison. --rollout.max-completion-length counts
model tokens; --rollout.max-total-length caps prompt + everything after it. An episode that stops at a length limit
before its model finished is `truncated` (what --rollout.mask-truncated-completions drops).
"""
import functools
import json
import os
import re
import sys
import traceback

from rollout import later_seed
from user_code import TimedOut, call_all, call_bounded, resolve

SENTINEL = "\u2063EPISODE-SENTINEL\u2063"  # stands in for a model turn when rendering the template around it


def load_tools(names, timeout_s=0):
    """--data.tools -> {tool name: function}, each module imported within timeout_s (resolve). Each needs type
    hints and a docstring with an Args: section (the chat template gets its JSON schema, get_json_schema)."""
    from transformers.utils import get_json_schema
    tools = {}
    for name in names:
        fn = resolve(name, "--data.tools", timeout_s)
        try:
            get_json_schema(fn)
        except Exception as e:  # noqa: BLE001 - transformers raises several kinds
            raise ValueError(f"--data.tools {name!r}: no JSON schema from its signature and docstring ({e}). Give "
                             "every argument a type hint and a line in an 'Args:' docstring section.") from e
        tools[fn.__name__] = fn
    return tools


# ---- Tool calls: parse (the model's own format) and run (per-call timeout, sync or async) ----

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(text):
    """Hermes / Qwen format: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number per turn.
    -> [{"name", "arguments"}] or, for a call that is not valid JSON of that shape, [{"error": why}].
    Swap this function for a model with another format."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError('expected {"name": ..., "arguments": {...}}')
            args = call.get("arguments", {})
            args = json.loads(args) if isinstance(args, str) else args  # some models send arguments as a JSON string
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
            calls.append({"name": call["name"], "arguments": args})
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            calls.append({"error": f"could not parse tool call {body[:200]!r}: {e}"})
    return calls


def run_tool_calls(calls, tools, timeout_s):
    """Run every call at once (call_all) -> [(content, is_error, seconds)]. A call that did not parse or names no known
    tool is not run, and one that raises or times out answers with its error text too (the episode goes on)."""
    results = [(f"Error: {c['error']}", True, 0.0) if "error" in c else None if c["name"] in tools else
               (f"Error: unknown tool {c['name']!r}; the tools are {', '.join(tools)}", True, 0.0) for c in calls]
    todo = [i for i, r in enumerate(results) if r is None]
    thunks = [functools.partial(call_bounded, tools[calls[i]["name"]], calls[i]["arguments"], timeout_s) for i in todo]
    for i, (out, err, secs) in zip(todo, call_all(thunks, timeout_s)):
        text = (f"Error: tool {calls[i]['name']!r} {err}" if isinstance(err, TimedOut) else
                f"Error: {type(err).__name__}: {err}" if err is not None else
                out if isinstance(out, str) else json.dumps(out, default=str))
        results[i] = (text, err is not None, secs)
    return results


# ---- Environments: each reset/step call contained like a tool call (an error or a hang ends that episode only) ----

def start_env(make_env, row):
    env = make_env()
    messages = list(env.reset(row))
    if not messages and row.get("prompt") is None:
        raise ValueError("returned no messages for a row without a prompt: reset(row) must return the prompt")
    return env, messages


def start_envs(eps, make_env, encode, timeout_s, printed):
    """make_env() + reset(row) of every episode at once, each within `timeout_s` -> their prompt ids (the row's own
    prompt where that failed: end_with_env_error)."""
    for e, (out, err, secs) in zip(eps, call_all([functools.partial(start_env, make_env, e["row"]) for e in eps],
                                                 timeout_s)):
        e["tool_time_s"] += secs  # environment time counts with tool time
        if err is None:
            e["env"], e["messages"] = out
            e["row"] = {"prompt": list(out[1]), **e["row"]}  # a row without a prompt: reset wrote it
        else:
            end_with_env_error(e, "reset", err, timeout_s, printed)
        e["prompt_ids"] = encode(e["row"], e["messages"] or chat_messages(""))  # (no prompt at all: an empty one)


def step_env(env, text):
    new, reward, done = env.step(text)
    return new, None if reward is None else float(reward), bool(done)


def end_with_env_error(e, call, err, timeout_s, printed):
    """A reset/step that raised or passed --rollout.env-timeout-s: the episode ends here with no reward (None, counted
    in reward/failed); the first such failure of the run prints its traceback."""
    what = (f"env.{call}() timed out after {timeout_s:g} s (--rollout.env-timeout-s)" if isinstance(err, TimedOut)
            else f"env.{call}() raised {type(err).__name__}: {err}")
    e["ended"], e["env_error"], e["env_reward"] = "env_error", what, None
    say_env_failure(what, "" if isinstance(err, TimedOut) else "\n" + "".join(traceback.format_exception(err)), printed)


def say_env_failure(what, detail, printed):
    """The run's first environment failure, printed with its detail (a traceback); later ones are only counted."""
    if "env" not in printed:
        printed.add("env")
        rank = os.environ.get("GLOBAL_RANK", os.environ.get("RANK", "0"))  # an inference rank: its world rank
        print(f"[rank {rank}] {what}: its episode ends with reward None (later environment failures are counted in "
              f"reward/failed, not printed){detail}", file=sys.stderr, flush=True)


# ---- Token-exact continuation: the ids to insert after a model turn ----

def inserted_ids(tok, new_messages, last_model_id, tools_schema):
    """The ids that follow a finished model turn, tokenised on their own: the chat template's end of the assistant
    turn, `new_messages` (tool results / observations) and the next assistant header, i.e. the text after SENTINEL in
    the template's rendering of [user, assistant=SENTINEL] + new_messages, less the model's own last token (its
    end-of-turn, e.g. <|im_end|>), already in the episode."""
    stand_in = [{"role": "user", "content": "."}, {"role": "assistant", "content": SENTINEL}]
    text = tok.apply_chat_template(stand_in + new_messages, tools=tools_schema, tokenize=False,
                                   add_generation_prompt=True)
    after = text[text.index(SENTINEL) + len(SENTINEL):]  # e.g. '<|im_end|>\n<|im_start|>user\n<tool_response>...'
    end = tok.decode([last_model_id], skip_special_tokens=False)
    if end and after.startswith(end):
        after = after[len(end):]
    return tok(after, add_special_tokens=False)["input_ids"]


def chat_messages(prompt):
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


# ---- The episode loop: every active episode advances one model turn per engine call ----

def answer_messages(answers, tools, rollout_cfg, printed):
    """[(episode, tool calls)] after a model turn -> per episode the messages to insert, or None when it is over:
    the tools' answers for every episode that called one, the environment's for the others (all calls at once, each
    within its timeout; an environment that fails ends its episode, end_with_env_error)."""
    r = rollout_cfg
    flat = [call for _, calls in answers for call in calls]
    results = iter(run_tool_calls(flat, tools, r.tool_timeout_s) if flat else [])
    steps = iter(call_all([functools.partial(step_env, e["env"], e["text"]) for e, calls in answers
                           if not calls and e["env"] is not None], r.env_timeout_s))
    out = []
    for e, calls in answers:
        new = [] if calls else None
        for call, (content, err, secs) in zip(calls, results):  # (zip takes from `results` only while calls last)
            e["tool_calls"] += 1
            e["tool_errors"] += int(err)
            e["tool_time_s"] += secs
            new.append({"role": "tool", "name": call.get("name", "?"), "content": content})
        if not calls and e["env"] is not None:
            step, err, secs = next(steps)
            e["tool_time_s"] += secs
            if err is not None:
                end_with_env_error(e, "step", err, r.env_timeout_s, printed)
            new, reward, done = step if err is None else (None, None, True)
            if reward is not None:
                e["env_reward"] = (e["env_reward"] or 0.0) + reward
                e["messages"][-1]["reward"] = reward  # on the assistant turn it scores (episodes.jsonl)
            if done and new:  # after the last turn: in the transcript (episodes.jsonl), never shown to the model
                e["messages"] += [{**m, "unseen": True} for m in new]
            new = None if done or not new else new
        out.append(new)
    return out


def share_from_leader(eps, tp):
    """(collective over the TP group when tp > 1) Every rank's episodes become those of its TP group's first rank, where
    the tools and environments ran: tools may answer differently on another rank (time, randomness, outside state).
    vLLM's own TP group carries it, so engines (and generator ranks) that take different numbers of calls never meet."""
    if tp == 1:
        return
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group
    group = get_tp_group()  # --vllm.tp > 1 is vLLM only (launch refuses it with the HF engine)
    box = [[{k: v for k, v in e.items() if k not in ("env", "image")} for e in eps]  # each rank keeps its own image data
           if group.rank_in_group == 0 else None]
    dist.broadcast_object_list(box, src=group.ranks[0], group=group.cpu_group)
    for e, theirs in zip(eps, box[0]):
        e.update(theirs)


def run_episodes(engine, tok, starts, *, n, seeds, rollout_cfg, temperature, tools=None, make_env=None,
                 encode=None, printed=None, tp=1):
    """starts: per prompt {"row", "prompt_ids"} (with an environment, `encode(row, messages)` builds each episode's
    prompt from env.reset(row), or from the row's prompt when reset fails); n episodes each. -> [[episode dict] * n]
    per prompt: prompt_ids, completion_ids, completion_mask, engine_logps, truncated, text (the last model turn),
    messages, turns, tool_calls, tool_errors, tool_time_s (tools and environment), env_reward (sum of step()'s rewards;
    None if none; env.unfinished's when it has one: end_episodes), env_error (None, or why the environment ended the
    episode), ended ("done", "env_error" or one of UNFINISHED). `printed`: failures already printed.
    tp > 1 (collective over the TP group): only its first rank runs tools and environments; the others take its
    episodes after every turn, so the group feeds its shared engine the same turns."""
    from transformers.utils import get_json_schema
    r, tools = rollout_cfg, tools or {}
    schema = [get_json_schema(f) for f in tools.values()] or None  # what the prompt's template got
    eps = [{"row": start["row"], "prompt_ids": list(start.get("prompt_ids", [])), "completion_ids": [],
            "completion_mask": [], "engine_logps": [], "truncated": False, "text": "", "turns": 0, "tool_calls": 0,
            "tool_errors": 0, "tool_time_s": 0.0, "env_reward": None,
            "seed": seeds[i][j] if seeds else None, "env": None, "env_error": None,
            "ended": None, "messages": chat_messages(start["row"].get("prompt") or []),
            "image": {k: v for k, v in start.get("engine", {}).items() if k in ("multi_modal_data", "hf_inputs")}}
           for i, start in enumerate(starts) for j in range(n)]  # ("image": every turn sees it)
    printed, lead = set() if printed is None else printed, tp == 1 or int(os.environ.get("RANK", 0)) % tp == 0
    if make_env and lead:
        start_envs(eps, make_env, encode, r.env_timeout_s, printed)
    share_from_leader(eps, tp)
    for turn in range(r.max_turns):
        active = [e for e in eps if e["ended"] is None]
        budgets = [turn_budget(e, r) for e in active]  # [(tokens, the limit that sets them)]
        for e, (b, limit) in zip(active, budgets):  # (an active episode is not truncated yet)
            e["ended"], e["truncated"] = (limit, True) if b <= 0 else (None, False)  # a limit before the model finished
        active, budgets = [e for e in active if e["ended"] is None], [b for b in budgets if b[0] > 0]
        if not active and tp == 1:  # (with tp > 1 every rank takes the same number of turns: share_from_leader)
            break
        requests = [{"prompt_token_ids": e["prompt_ids"] + e["completion_ids"], **e["image"]} for e in active]
        turn_seeds = [[later_seed(e["seed"], "turn", turn)] for e in active] if seeds else None
        outs = engine.generate(requests, n=1, temperature=temperature, top_p=r.top_p, top_k=r.top_k,
                               max_tokens=[b for b, _ in budgets], seeds=turn_seeds) if active else []
        answers = []
        for e, out, (_, limit) in zip(active, outs, budgets):
            c = out[0]
            e["completion_ids"] += c.token_ids
            e["completion_mask"] += [1] * len(c.token_ids)
            e["engine_logps"] += c.logprobs
            if c.versions is not None:  # --rollout.inflight-updates; inserted tokens get -1 (no version sampled them)
                e.setdefault("engine_versions", []).extend(c.versions)
            e["turns"] += 1
            e["text"] = tok.decode(c.token_ids, skip_special_tokens=True)
            e["messages"].append({"role": "assistant", "content": e["text"]})
            calls = parse_tool_calls(e["text"]) if tools else []
            # cut by the token budget mid-turn, or a tool call that no model turn is left to read (cut, not run)
            if c.truncated or not c.token_ids or (calls and turn == r.max_turns - 1):
                e["ended"], e["truncated"] = limit if c.truncated or not c.token_ids else "max_turns", True
            else:
                answers.append((e, calls))
        for e, new in zip([e for e, _ in answers], answer_messages(answers, tools, r, printed) if lead else []):
            if new is None or turn == r.max_turns - 1:  # no more model turns: nothing to insert
                e["ended"] = e["ended"] or ("done" if new is None else "max_turns")  # (or env_error)
                e["messages"] += [{**m, "unseen": True} for m in new or []]
                continue
            ids = inserted_ids(tok, new, e["completion_ids"][-1], schema)
            if len(e["prompt_ids"]) + len(e["completion_ids"]) + len(ids) >= r.max_total_length:
                e["ended"], e["truncated"] = "max_total_length", True  # no room for the answer and a model token
                e["messages"] += [{**m, "unseen": True} for m in new]
                continue
            e["messages"] += new
            e["completion_ids"] += ids
            e["completion_mask"] += [0] * len(ids)
            e["engine_logps"] += [0.0] * len(ids)
            if "engine_versions" in e:
                e["engine_versions"] += [-1] * len(ids)
        share_from_leader(eps, tp)
    end_episodes(eps, make_env, r.env_timeout_s, printed, lead, tp)
    return [eps[i * n:(i + 1) * n] for i in range(len(starts))]


# Where the framework, not the environment or tool flow, ends an episode: its "ended" (else "done" or "env_error")
UNFINISHED = ("max_turns", "token_budget", "max_total_length", "max_turn_tokens")


def turn_budget(e, r):
    """-> (the tokens the next model turn of episode `e` may take, the limit that sets them)."""
    left = {"token_budget": r.max_completion_length - sum(e["completion_mask"]),
            "max_total_length": r.max_total_length - len(e["prompt_ids"]) - len(e["completion_ids"]),
            "max_turn_tokens": r.max_turn_tokens or float("inf")}
    limit = min(left, key=left.get)
    return left[limit], limit


def unfinished_reward(env, reason):
    reward = env.unfinished(reason)
    return None if reward is None else float(reward)


def end_episodes(eps, make_env, timeout_s, printed, lead, tp):
    """Each episode the framework ended (UNFINISHED) whose environment has unfinished(reason) -> float | None gets that
    reward in place of its step rewards' sum (a call that raises or hangs: env_error); then every environment with a
    close() is closed (e.g. a hub's session: the server frees it), all within timeout_s, what a close raises ignored;
    each episode's "ended" says how it ended, and env_reward becomes a column of its row."""
    todo = [e for e in eps if e["ended"] in UNFINISHED and hasattr(e["env"], "unfinished")] if lead else []
    calls = [functools.partial(unfinished_reward, e["env"], e["ended"]) for e in todo]
    for e, (reward, err, secs) in zip(todo, call_all(calls, timeout_s)):
        e["tool_time_s"] += secs
        if err is None:
            e["env_reward"] = reward
        else:
            end_with_env_error(e, "unfinished", err, timeout_s, printed)
    share_from_leader(eps, tp)
    call_all([e["env"].close for e in eps if hasattr(e["env"], "close")], timeout_s)
    for e in eps:
        e.pop("seed"), e.pop("env"), e.pop("image")
        if not make_env:
            e.pop("env_error")
        else:  # the reward stage reads it as a column (the `env` reward function, or any other)
            e["row"] = {**e["row"], "env_reward": e.pop("env_reward")}
