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
import asyncio
import hashlib
import importlib
import inspect
import json
import re
import threading
import time

SENTINEL = "\u2063EPISODE-SENTINEL\u2063"  # stands in for a model turn when rendering the template around it


def resolve(name, flag):
    """'pkg.module:function' -> the object, or one clear error naming the flag."""
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{flag} {name!r}: cannot import it ({e}). Pass package.module:function, importable from the "
                         "working directory or PYTHONPATH.") from e


def load_tools(names):
    """--data.tools -> {tool name: function}. Each needs type hints and a docstring with an Args: section (the chat
    template gets its JSON schema, transformers.utils.get_json_schema)."""
    from transformers.utils import get_json_schema
    tools = {}
    for name in names:
        fn = resolve(name, "--data.tools")
        try:
            get_json_schema(fn)
        except Exception as e:  # noqa: BLE001 - transformers raises several kinds
            raise ValueError(f"--data.tools {name!r}: no JSON schema from its signature and docstring ({e}). Give "
                             "every argument a type hint and a line in an 'Args:' docstring section.") from e
        tools[fn.__name__] = fn
    return tools


# ----------------------------------------------------------------------------------------------------------
# Tool calls: parse (the model's own format) and run (per-call timeout, sync or async)
# ----------------------------------------------------------------------------------------------------------

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


def _call(fn, args, timeout_s):
    out = fn(**args)
    if inspect.isawaitable(out):  # an async tool: cancelled at the timeout
        out = asyncio.run(asyncio.wait_for(out, timeout_s))
    return out


def run_tool_calls(calls, tools, timeout_s):
    """Run every call at once, each in its own daemon thread with `timeout_s` -> [(content, is_error, seconds)].
    A tool that raises or times out answers with the error text (the episode goes on). A timed-out sync tool keeps
    running in its thread (Python cannot stop a thread); the episode does not wait for it."""
    results = [None] * len(calls)
    threads = []
    for i, call in enumerate(calls):
        if "error" in call:
            results[i] = (f"Error: {call['error']}", True, 0.0)
        elif call["name"] not in tools:
            results[i] = (f"Error: unknown tool {call['name']!r}; the tools are {', '.join(tools)}", True, 0.0)
        else:
            def work(i=i, call=call, t0=time.time()):
                try:
                    out = _call(tools[call["name"]], call["arguments"], timeout_s)
                    text = out if isinstance(out, str) else json.dumps(out, default=str)
                    results[i] = (text, False, time.time() - t0)
                except Exception as e:  # noqa: BLE001 - tool code is user code: the model reads the error
                    results[i] = (f"Error: {type(e).__name__}: {e}", True, time.time() - t0)
            threads.append((i, call, threading.Thread(target=work, daemon=True)))
    deadline = time.time() + timeout_s
    for _, _, t in threads:
        t.start()
    for i, call, t in threads:
        t.join(max(0.0, deadline - time.time()))
        if results[i] is None:  # still running (or an async tool's wait_for fired just now)
            results[i] = (f"Error: tool {call['name']!r} timed out after {timeout_s:g} s", True, timeout_s)
    return list(results)  # a copy: a timed-out tool that finishes later writes into the old list only


# ----------------------------------------------------------------------------------------------------------
# Token-exact continuation: the ids to insert after a model turn
# ----------------------------------------------------------------------------------------------------------

def inserted_ids(tok, new_messages, last_model_id, tools_schema):
    """The ids that follow a finished model turn: the chat template's end of the assistant turn, `new_messages`
    (tool results / observations) and the next assistant header, tokenised on their own. The template renders a
    stand-in conversation [user, assistant=SENTINEL] + new_messages; the text after the sentinel is what the template
    puts after a model turn. The model's own last token (its end-of-turn, e.g. <|im_end|>) is already in the episode,
    so its text is not inserted twice."""
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


def turn_seed(seed, turn):
    """Turn 0 samples with the completion's own seed (as a single-turn rollout would); later turns derive theirs."""
    if seed is None or turn == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}:turn{turn}".encode(), digest_size=8).digest(), "little") >> 1


# ----------------------------------------------------------------------------------------------------------
# The episode loop: every active episode advances one model turn per engine call
# ----------------------------------------------------------------------------------------------------------

def answer_messages(answers, tools, timeout_s):
    """[(episode, tool calls)] after a model turn -> per episode the messages to insert, or None when it is over:
    the tools' answers for every episode that called one (all calls at once), the environment's for the others."""
    flat = [call for _, calls in answers for call in calls]
    results = iter(run_tool_calls(flat, tools, timeout_s) if flat else [])
    out = []
    for e, calls in answers:
        new = None
        if calls:
            new = []
            for call in calls:
                content, err, secs = next(results)
                e["tool_calls"] += 1
                e["tool_errors"] += int(err)
                e["tool_time_s"] += secs
                new.append({"role": "tool", "name": call.get("name", "?"), "content": content})
        elif e["env"] is not None:
            new, reward, done = e["env"].step(e["text"])
            if reward is not None:
                e["env_reward"] = (e["env_reward"] or 0.0) + float(reward)
            if done or not new:
                new = None
        out.append(new)
    return out


def run_episodes(engine, tok, starts, *, n, seeds, rollout_cfg, temperature, tools=None, make_env=None,
                 encode=None):
    """starts: per prompt {"row", "prompt_ids"} (with an environment, `encode(row, messages)` builds each episode's
    prompt from env.reset(row)); n episodes each. -> [[episode dict] * n] per prompt, fields: prompt_ids,
    completion_ids, completion_mask, engine_logps, truncated, text (the last model turn), messages, turns,
    tool_calls, tool_errors, tool_time_s, env_reward (sum of the rewards step() returned; None if none)."""
    from transformers.utils import get_json_schema
    r, tools = rollout_cfg, tools or {}
    schema = [get_json_schema(f) for f in tools.values()] or None  # what the prompt's template got
    eps = []
    for i, start in enumerate(starts):
        for j in range(n):
            ep = {"row": start["row"], "prompt_ids": list(start.get("prompt_ids", [])), "completion_ids": [],
                  "completion_mask": [], "engine_logps": [], "truncated": False, "text": "", "turns": 0,
                  "tool_calls": 0, "tool_errors": 0, "tool_time_s": 0.0, "env_reward": None, "done": False,
                  "seed": seeds[i][j] if seeds else None, "env": make_env() if make_env else None,
                  "messages": chat_messages(start["row"]["prompt"])}
            if ep["env"] is not None:
                ep["messages"] = list(ep["env"].reset(start["row"]))
                ep["prompt_ids"] = encode(start["row"], ep["messages"])
            eps.append(ep)
    for turn in range(r.max_turns):
        active = [e for e in eps if not e["done"]]
        budgets = [min(r.max_completion_length - sum(e["completion_mask"]),
                       r.max_total_length - len(e["prompt_ids"]) - len(e["completion_ids"])) for e in active]
        for e, b in zip(active, budgets):
            if b <= 0:  # a length limit before the model finished
                e["done"] = e["truncated"] = True
        active, budgets = [e for e in active if not e["done"]], [b for b in budgets if b > 0]
        if not active:
            break
        outs = engine.generate([{"prompt_token_ids": e["prompt_ids"] + e["completion_ids"]} for e in active], n=1,
                               temperature=temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=budgets,
                               seeds=[[turn_seed(e["seed"], turn)] for e in active] if seeds else None)
        answers = []
        for e, out in zip(active, outs):
            c = out[0]
            e["completion_ids"] += c.token_ids
            e["completion_mask"] += [1] * len(c.token_ids)
            e["engine_logps"] += c.logprobs
            e["turns"] += 1
            e["text"] = tok.decode(c.token_ids, skip_special_tokens=True)
            e["messages"].append({"role": "assistant", "content": e["text"]})
            if c.truncated or not c.token_ids:  # cut by the token budget mid-turn
                e["done"] = e["truncated"] = True
                continue
            calls = parse_tool_calls(e["text"]) if tools else []
            if calls and turn == r.max_turns - 1:  # a tool call no model turn is left to read: cut, not run
                e["done"] = e["truncated"] = True
                continue
            answers.append((e, calls))
        for e, new in zip([e for e, _ in answers], answer_messages(answers, tools, r.tool_timeout_s)):
            if new is None or turn == r.max_turns - 1:  # no more model turns: nothing to insert
                e["done"] = True
                continue
            ids = inserted_ids(tok, new, e["completion_ids"][-1], schema)
            if len(e["prompt_ids"]) + len(e["completion_ids"]) + len(ids) >= r.max_total_length:
                e["done"] = e["truncated"] = True  # the answer would not fit, nor a model token after it
                continue
            e["messages"] += new
            e["completion_ids"] += ids
            e["completion_mask"] += [0] * len(ids)
            e["engine_logps"] += [0.0] * len(ids)
    for e in eps:
        e.pop("done"), e.pop("seed"), e.pop("env")
        if make_env:  # the reward stage reads it as a column (the `env` reward function, or any other)
            e["row"] = {**e["row"], "env_reward": e.pop("env_reward")}
    return [eps[i * n:(i + 1) * n] for i in range(len(starts))]

