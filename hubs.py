"""hubs.py: environments published through the hubs, named by `--env HUB:TARGET` (HUBS, at the bottom, dispatches
on the prefix; any other --env is the user's package.module:make_env factory, episodes.py).

- openenv:URL: each episode one session on an OpenEnv server; make_env() gives the object episodes.py drives, like a
  user's environment: reset(row) -> messages, step(assistant_text) -> (new_messages | None, reward | None, done),
  close() (called when its episode ends, however it ends).
- verifiers:TASKSET: the environment drives each episode itself against this rank's engine, served on 127.0.0.1;
  its tasks are the dataset and its traces are trained token-exactly.
"""
import asyncio
import functools
import importlib
import inspect
import json
import pathlib
import queue
import sys
import threading
import time
import traceback
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import episodes
import user_code


# ---- OpenEnv (github.com/meta-pytorch/OpenEnv): one WebSocket session per episode, through openenv's own client ----

@dataclass
class OpenEnvConfig:
    action_field: str = "message"
    """--env openenv:URL: the action field that carries the model's turn (the action sent is {field: the turn's text,
    special tokens left out}); checked against the server's /schema at start-up."""
    observation_field: str = ""
    """--env openenv:URL: the observation field whose text is the next user message ("" = the whole observation as
    JSON, as the server sends it: reward, done and metadata left out)."""
    reward: str = "last"
    """--env openenv:URL: the episode's reward from the server's step rewards: last (the last one given, as TRL's
    OpenEnv examples read it) | sum (over the turns, as --env package.module:make_env environments)."""


def openenv_env(cfg, url):
    """--env openenv:URL -> make_env, once openenv-core imports and the server's /schema has --openenv.*'s fields."""
    o = cfg.openenv
    try:
        import openenv.core  # noqa: F401 - seconds to import: here, not in an episode's first timed call
    except ImportError as e:
        raise ValueError(f"--env openenv:{url} needs openenv-core ({e}): ./setup.sh installs it on the CPU stack "
                         "(requirements-cpu.txt); the GPU stack cannot take it (requirements.txt says why).") from None
    if o.reward not in ("last", "sum"):
        raise ValueError(f"--openenv.reward {o.reward!r}: use last or sum.")
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/schema", timeout=min(cfg.rollout.env_timeout_s, 30)) as reply:
            schema = json.load(reply)
    except (OSError, ValueError) as e:  # refused, timed out, not http(s)://, not JSON
        raise ValueError(f"--env openenv:{url}: no OpenEnv server answers at {url} ({getattr(e, 'reason', e)}). Start "
                         "the server first, or fix the URL (openenv:http://HOST:PORT).") from None
    for part, name in (("action", o.action_field), ("observation", o.observation_field)):
        fields = schema.get(part, {}).get("properties", {})
        if name and name not in fields:
            raise ValueError(f"--openenv.{part}-field {name!r}: the server's {part}s have no such field (its fields: "
                             f"{', '.join(fields)}). Name one of them.")
    action = schema.get("action", {})
    others = set(action.get("required", [])) - {o.action_field}
    kind = action.get("properties", {}).get(o.action_field, {}).get("type")  # (None: e.g. an optional string, anyOf)
    if others or kind not in (None, "string"):
        raise ValueError(f"--openenv.action-field {o.action_field!r}: an action here is one text field, but the "
                         "server's actions " + (f"also require {', '.join(sorted(others))}" if others else
                                                f"take {kind} there") + ". Name their text field.")
    return functools.partial(OpenEnvSession, url, o, cfg.rollout.env_timeout_s)


class OpenEnvSession:
    """One episode on the server. A call that fails (the server's error, a dropped connection, no answer within
    --rollout.env-timeout-s, an observation unlike --openenv.observation-field) closes it and raises: env_error."""

    def __init__(self, url, cfg, timeout_s):
        from openenv.core import GenericEnvClient
        t = timeout_s + 1  # episodes.py's deadline for the call comes first (its message names the flag), then this one
        self.client = GenericEnvClient(base_url=url, connect_timeout_s=t, message_timeout_s=t).sync()
        self.cfg, self.total = cfg, 0.0  # total: the sum of what step() returned, as episodes.py adds it up
        self.deadline = time.time() + timeout_s  # episodes.py times make_env() and reset() together

    def reset(self, row):
        """The server's reset() gets the row's other columns (it keeps those its signature names: openenv's rule); the
        observation's text is appended to the prompt's last message (TRL's environment_factory rule)."""
        text, _, _ = self.call(self.client.reset, **{k: v for k, v in row.items() if k not in ("prompt", "image")})
        if time.time() > self.deadline:  # episodes.py stopped waiting: it never gets this session to close it
            self.close()
            raise TimeoutError("reset() answered after --rollout.env-timeout-s")
        messages = episodes.chat_messages(row.get("prompt", ""))  # (a row without one: the observation alone)
        return messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + text}]

    def step(self, assistant_text):
        text, reward, done = self.call(self.client.step, {self.cfg.action_field: assistant_text})
        if reward is not None:  # episodes.py sums what step() returns: with `last`, the change in the last reward
            reward = reward if self.cfg.reward == "sum" else reward - self.total  # (exact to an ulp per turn)
            self.total += reward
        return None if done else [{"role": "user", "content": text}], reward, done

    def call(self, fn, *args, **kwargs):
        """fn(...) -> (the observation's text, reward, done); on any failure the session is closed, the error raised."""
        try:
            result = fn(*args, **kwargs)
            field, obs = self.cfg.observation_field, result.observation
            text = (obs.get(field) if isinstance(obs, dict) else None) if field else json.dumps(obs, ensure_ascii=False)
            if not isinstance(text, str):
                raise ValueError(f"bad observation from the server: {field!r} (--openenv.observation-field) is "
                                 f"{text!r}, not text")
            return text, None if result.reward is None else float(result.reward), bool(result.done)
        except BaseException:
            self.close(wait=False)
            raise

    def close(self, wait=True):
        """Closing the connection ends the session and frees its slot (once the episode ends; a failed call does not
        wait, wait=False: a server stuck in a step answers only at the client's 10 s limit). Idempotent."""
        client, self.client = self.client, None
        if client is not None and wait:
            client.close()
        elif client is not None:
            threading.Thread(target=client.close, daemon=True).start()


# ---- verifiers (--env verifiers:TASKSET): the environment drives the conversation against the served engine ----
# Episodes run at once on an event loop in a thread; this thread owns the engine and answers them in batches. The
# routes served and what trains (as prime-rl's orchestrator/trajectories.py): docs/multi-turn.md, "verifiers".

def load_verifiers(target, args_json, timeout_s=0):
    """TASKSET (an installed package, or a path to its module / package folder) and --env-args (JSON merged into
    verifiers' EnvConfig: "taskset", "agent" and "renderer" fields, e.g. {"renderer": {"tool_parser": "qwen3"}}) ->
    (verifiers Env, its tasks, the renderer's config). Once per process, within timeout_s (0 = no limit)."""
    late = ValueError(f"--env verifiers:{target}: loading the taskset did not finish within {timeout_s:g} s "
                      "(--data.import-timeout-s): it hangs at import or while building its tasks (a loop, a lock or a "
                      "network call?). Fix it, or raise the limit if it is just slow.")
    return user_code.within(lambda: _load_verifiers(target, args_json), timeout_s, late)


@functools.lru_cache(maxsize=None)
def _load_verifiers(target, args_json):
    from renderers.configs import CustomRendererConfig
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config
    path, name = pathlib.Path(target), target
    try:
        if path.suffix == ".py" or path.is_dir():  # a path: its folder goes on sys.path, the module name is the id
            sys.path.insert(0, str(path.resolve().parent))
            name = path.stem
        elif "." in target:  # a dotted module: verifiers takes an id for a bare name and would import it under its own
            name = target.replace(".", "_").lower()  # package (verifiers.v1.tasksets.<id>), so it gets the module,
            sys.modules[name] = importlib.import_module(target)  # imported here (an error names it), as a bare name
        args = json.loads(args_json or "{}")
        if not isinstance(args, dict):
            raise ValueError("not a JSON object")
        renderer = CustomRendererConfig(import_path="hubs:TokenExactRenderer", **args.pop("renderer", {}))
        env = load_environment(resolve_env_config({**args, "taskset": {**args.get("taskset", {}), "id": name}}))
    except (ImportError, TypeError, ValueError, AttributeError) as e:  # (pydantic's errors; verifiers' no __all__)
        raise ValueError(f"--env verifiers:{target}{f' --env-args {args_json}' * bool(args_json)}: {e}") from None
    tasks = list(env.taskset) if env.taskset.bounded else None
    if not tasks:
        raise ValueError(f"--env verifiers:{target}: its taskset yields no tasks or is infinite (bound it in "
                         "--env-args, e.g. its own size field).")
    return env, tasks, renderer


def verifiers_rows(target, args_json, timeout_s=0):
    """The taskset's tasks as dataset rows (prompt: the task's prompt; vf_task: its index)."""
    return [{"prompt": t.data.prompt_text, "vf_task": i}
            for i, t in enumerate(load_verifiers(target, args_json, timeout_s)[1])]


@functools.lru_cache(maxsize=None)
def __getattr__(name):
    """hubs.TokenExactRenderer (the client's import path "hubs:TokenExactRenderer"), built on first use. verifiers'
    DefaultRenderer re-renders the conversation every turn, so a turn whose text does not re-tokenise to its sampled
    ids (or cut by max_tokens) forks the trace. This one continues as episodes.py does: the previous prompt and
    sampled ids, then the inserted messages tokenised on their own (episodes.inserted_ids)."""
    if name != "TokenExactRenderer":
        raise AttributeError(name)
    from renderers import RenderedTokens
    from renderers.configs import DefaultRendererConfig
    from renderers.default import DefaultRenderer

    class TokenExactRenderer(DefaultRenderer):
        config_class = DefaultRendererConfig

        def bridge_to_next_turn(self, previous_prompt_ids, previous_completion_ids, new_messages, *, tools=None):
            if not previous_completion_ids or any(m.get("role") == "assistant" for m in new_messages):
                return None  # (an edited history: verifiers re-renders it)
            ids = episodes.inserted_ids(self._tokenizer, list(new_messages), previous_completion_ids[-1], tools)
            old = len(previous_prompt_ids) + len(previous_completion_ids)
            return RenderedTokens(token_ids=[*previous_prompt_ids, *previous_completion_ids, *ids],
                                  message_indices=[-1] * old + [len(new_messages) - 1] * len(ids),
                                  message_roles=[m["role"] for m in new_messages])
    return TokenExactRenderer


SERVED = ("temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "logprobs", "skip_special_tokens",
          "routed_experts_prompt_start")  # what verifiers' client sends (the last: MoE routing replay, no effect here)
NEUTRAL = {"n": 1, "min_p": 0.0, "min_tokens": 0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0, "stop": [], "stream": False}  # other settings at these values (or None): no change


def chat_request(tok, body):
    """An OpenAI chat completion (an environment's own call, e.g. a judge: nothing it samples trains) -> (prompt ids
    by the chat template, sampling params). What the reply cannot carry (log-probs, ...) is refused, not left out."""
    unread = [k for k in ("logprobs", "top_logprobs", "tools") if body.get(k)] + ["skip_special_tokens"] * (
        body.get("skip_special_tokens") is False)  # (tools: a call would come back as raw text, finish_reason stop)
    if unread:
        raise ValueError(f"{', '.join(unread)}: this route answers the decoded text only (no log-probs, special "
                         "tokens or parsed tool calls)")
    messages = [{**m, "content": parts_text(m["content"])} if isinstance(m.get("content"), list) else m
                for m in body["messages"]]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    sp = {k: v for k, v in body.items() if k not in ("model", "messages", "tools", "max_completion_tokens", "user",
                                                      "store", "metadata")}  # (the last three: bookkeeping)
    sp["max_tokens"] = body.get("max_completion_tokens") or body.get("max_tokens")
    return tok(text, add_special_tokens=False)["input_ids"], sp


def parts_text(parts):
    """OpenAI content parts -> their text (the chat template would render the list's repr); text parts only."""
    other = [p.get("type") for p in parts if p.get("type") != "text"]
    if other:
        raise ValueError(f"content parts {other}: this route takes text only")
    return "".join(p["text"] for p in parts)


def chat_reply(tok, reply, n_prompt):
    """/inference/v1/generate's answer -> an OpenAI chat completion: the sampled ids decoded (no tool calls parsed)."""
    choice = reply["choices"][0]
    text = tok.decode(choice["token_ids"], skip_special_tokens=True)
    return {"id": "chatcmpl-0", "object": "chat.completion", "created": int(time.time()), "model": tok.name_or_path,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": choice["finish_reason"]}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(choice["token_ids"]),
                      "total_tokens": n_prompt + len(choice["token_ids"])}}


class Request:
    """One call waiting for the engine thread: prompt ids and vLLM-style sampling params."""

    def __init__(self, ids, sp, free=False):
        self.ids, self.stops, self.free = [int(t) for t in ids], set(sp.get("stop_token_ids") or []), free  # free: may
        # ask for its own temperature / top-p / top-k (a chat call: nothing it samples trains)
        self.sampling, self.max_tokens = {k: sp.get(k) for k in ("temperature", "top_p", "top_k")}, sp.get("max_tokens")
        self.unserved = {k: v for k, v in sp.items() if k not in SERVED and v is not None and v != NEUTRAL.get(k)}
        self.done, self.reply = threading.Event(), None


def generate_reply(c, stops):
    """An engine Completion -> vLLM's /inference/v1/generate answer, cut after the request's first stop id."""
    end = next((k + 1 for k, t in enumerate(c.token_ids) if t in stops), len(c.token_ids))
    ids, logps = c.token_ids[:end], c.logprobs[:end]
    finish = "length" if c.truncated and end == len(c.token_ids) else "stop"
    return 200, {"request_id": "", "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish, "logprobs": {
        "content": [{"token": f"token_id:{t}", "logprob": lp} for t, lp in zip(ids, logps)]}}]}


def answer_batch(engine, batch, sampling, max_total_length):
    """Requests that arrived together -> one engine call per sampling setting. A token route request samples with the
    run's temperature, top-p and top-k (the trainer's log-probs assume them); a chat call (Request.free) may ask for
    its own. Other settings (min_p, stop strings, penalties) are refused; max_tokens is capped by
    --rollout.max-completion-length and what --rollout.max-total-length leaves."""
    calls = {}  # (temperature, top_p, top_k) -> [(request, max_tokens)]
    for q in batch:
        room = max_total_length - len(q.ids)
        own = {k: v for k, v in q.sampling.items() if v is not None and v != sampling[k]}
        if q.unserved or (own and not q.free) or room <= 0:
            why = (f"{q.unserved} not served: the engine call takes temperature, top_p, top_k, max_tokens and stop "
                   "token ids only" if q.unserved else f"sampling {own}: the engine samples with the run's "
                   f"{sampling} only (--rollout.temperature/top-p/top-k)" if own else f"prompt of {len(q.ids)} "
                   f"tokens leaves no room under --rollout.max-total-length {max_total_length}")
            q.reply = (400, {"error": {"message": why}})
            q.done.set()
            continue
        s = {**sampling, **own}
        calls.setdefault((s["temperature"], s["top_p"], s["top_k"]), []).append(
            (q, min(q.max_tokens or sampling["max_tokens"], sampling["max_tokens"], room)))
    for (temperature, top_p, top_k), todo in calls.items():
        try:
            outs = engine.generate([{"prompt_token_ids": q.ids} for q, _ in todo], n=1, temperature=temperature,
                                   top_p=top_p, top_k=top_k, max_tokens=[m for _, m in todo])
            replies = [generate_reply(o[0], q.stops) for (q, _), o in zip(todo, outs)]
        except Exception as e:  # noqa: BLE001 - answered to every request of the call: their episodes fail, counted
            replies = [(500, {"error": {"message": f"engine: {type(e).__name__}: {e}"}})] * len(todo)
        for (q, _), reply in zip(todo, replies):
            q.reply = reply
            q.done.set()


def serve_engine(engine, requests, sampling, max_total_length, finished, deadline, window_s=0.05):
    """(the engine's thread) Answer requests until `finished()` or the deadline; those arriving within window_s of the
    last one share its engine call."""
    batch = []
    while batch or (not finished() and time.time() < deadline):
        try:
            batch.append(requests.get(timeout=window_s))
        except queue.Empty:
            if batch:
                answer_batch(engine, batch, sampling, max_total_length)
            batch = []


def http_server(tok, max_model_len, requests, wait_s):
    """127.0.0.1, a free port: /inference/v1/generate, /v1/chat/completions (queued for the engine), /v1/models."""
    class Handler(BaseHTTPRequestHandler):
        def send(self, code, payload):
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path.rstrip("/") != "/v1/models":
                return self.send(404, {"error": {"message": f"no route {self.path}"}})
            card = {"id": tok.name_or_path, "object": "model", "max_model_len": max_model_len}  # (the client's prompt-length cap)
            self.send(200, {"object": "list", "data": [card]})

        def do_POST(self):  # noqa: N802
            chat = self.path.rstrip("/") == "/v1/chat/completions"
            if not chat and self.path != "/inference/v1/generate":
                return self.send(404, {"error": {"message": f"no route {self.path}"}})
            try:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                q = (Request(*chat_request(tok, body), free=True) if chat else
                     Request(body["token_ids"], body.get("sampling_params") or {}))
            except (KeyError, TypeError, ValueError) as e:  # not JSON, no fields, a template that refuses it
                return self.send(400, {"error": {"message": f"bad request: {type(e).__name__}: {e}"}})
            requests.put(q)
            code, reply = q.reply if q.done.wait(wait_s) else (503, {"error": {"message": "the rollout ended"}})
            self.send(code, chat_reply(tok, reply, len(q.ids)) if chat and code == 200 else reply)

        def log_message(self, *args):  # no access log
            pass
    server = type("Server", (ThreadingHTTPServer,), {"daemon_threads": True, "request_queue_size": 4096})(
        ("127.0.0.1", 0), Handler)  # (a listen backlog of 5 refuses most of a step's episodes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@functools.lru_cache(maxsize=None)
def event_loop():
    """The run's one event loop for episodes, in its own thread (verifiers' and renderers' module-level asyncio locks
    bind to the first loop that waits on them)."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop


async def run_all(env, tasks, ctx, timeout_s):
    """Every episode at once, each within timeout_s -> [vf Episode or the exception that ended it]."""
    async def one(task):
        try:
            return await asyncio.wait_for(env.run_episode(task, ctx), timeout_s)
        except BaseException as e:  # noqa: BLE001 - an environment's failure ends its episode only
            return e
    async with env.serving():
        return await asyncio.gather(*(one(t) for t in tasks))


def verifiers_record(start, out, printed):
    """A vf Episode (or the exception that ended it) -> episodes.run_episodes' record. One trace with one branch: its
    tokens before the first sampled one are the prompt, the rest the completion (sampled mask: completion_mask, the
    engine's log-probs: engine_logps), the trace's reward env_reward. Anything else (an error, a timeout, no sampled
    tokens, several traces or branches) is an env_error with the row's own prompt (episodes.end_with_env_error)."""
    e = {"row": {**start["row"], "env_reward": None}, "prompt_ids": list(start["prompt_ids"]), "completion_ids": [],
         "completion_mask": [], "engine_logps": [], "truncated": False, "text": "", "messages": [], "turns": 0,
         "tool_calls": 0, "tool_errors": 0, "tool_time_s": 0.0, "env_error": None, "ended": "done"}
    traces = [] if isinstance(out, BaseException) else out.traces
    branches = traces[0].branches if len(traces) == 1 else []
    mask = branches[0].sampled_mask if len(branches) == 1 else []
    if isinstance(out, BaseException):
        why, err = f"episode failed: {type(out).__name__}: {out}", out
    elif not out.ok or any(t.has_error for t in traces):
        err = (out.errors or [x for t in traces for x in t.errors] or [None])[0]
        why = f"episode failed: {err.type}: {err.message}" if err else "episode not ok"
    elif len(traces) != 1 or len(branches) != 1 or not any(mask):
        why, err = (f"{len(traces)} traces, {len(branches)} branches, {sum(mask)} sampled tokens: one trace with one "
                    "branch of sampled tokens is trained per episode"), None
    else:
        b, first = branches[0], mask.index(True)
        e.update(prompt_ids=b.token_ids[:first], completion_ids=b.token_ids[first:], completion_mask=[
            int(m) for m in mask[first:]], engine_logps=b.logprobs[first:], turns=traces[0].num_turns,
            truncated=b.calls[-1].finish_reason == "length" if b.calls else False,
            messages=[m.model_dump(mode="json", exclude_none=True) for m in b.messages])
        e["text"] = next((m.get("content") or "" for m in reversed(e["messages"]) if m["role"] == "assistant"), "")
        e["row"]["env_reward"], e["ended"] = float(traces[0].reward), "token_budget" if e["truncated"] else "done"
        return e
    e["env_error"], e["ended"] = why, "env_error"
    trace = isinstance(err, BaseException) and not isinstance(err, TimeoutError)  # (a timeout has no traceback)
    detail = getattr(err, "traceback", None) or ("".join(traceback.format_exception(err)) if trace else "")
    episodes.say_env_failure(f"--env verifiers: {why}", "\n" + detail if detail else "", printed)
    return e


def verifiers_episodes(target, args_json, engine, tok, starts, *, n, rollout_cfg, temperature, printed):
    """n episodes per start ({"row", "prompt_ids"}) of the row's task against the served engine -> [[record] * n] per
    start. Each has --rollout.env-timeout-s in all (model turns too): a blocked event loop fails those still running."""
    from verifiers.v1 import ModelContext, SamplingConfig, TrainClientConfig
    r, (env, tasks, renderer), model = rollout_cfg, load_verifiers(target, args_json), tok.name_or_path
    sampling = {"temperature": temperature, "top_p": r.top_p, "top_k": r.top_k, "max_tokens": r.max_completion_length}
    requests = queue.Queue()
    deadline = time.time() + r.env_timeout_s + 5.0  # (run_all's own timeouts fire first)
    server = http_server(tok, r.max_total_length, requests, r.env_timeout_s + 10.0)
    url = f"http://127.0.0.1:{server.server_port}/v1"
    client = TrainClientConfig(base_url=url, api_key_var="GRPO_VERIFIERS_NO_KEY", renderer_model_name=model,
                               renderer=renderer)
    ctx = ModelContext(model=model, client=client, sampling=SamplingConfig(**sampling))
    run = [tasks[s["row"]["vf_task"]] for s in starts for _ in range(n)]
    running = asyncio.run_coroutine_threadsafe(run_all(env, run, ctx, r.env_timeout_s), event_loop())
    try:
        serve_engine(engine, requests, sampling, r.max_total_length, running.done, deadline)
    finally:
        server.shutdown()
        server.server_close()  # (one listening socket per rollout otherwise)
    outs = running.result() if running.done() else [TimeoutError(
        f"the environment did not return within {r.env_timeout_s:g} s (--rollout.env-timeout-s)")] * len(run)
    cut = [{**s, "prompt_ids": s["prompt_ids"][-r.max_prompt_length:]} for s in starts]  # a failed episode's row
    eps = [verifiers_record(s, out, printed) for s, out in zip([s for s in cut for _ in range(n)], outs)]
    return [eps[i * n:(i + 1) * n] for i in range(len(starts))]


# ---- dispatch: --env PREFIX:TARGET ----

HUBS = {"openenv": {"check": openenv_env, "make_env": openenv_env},  # (the factory is the check: its server answers)
        "verifiers": {"check": lambda cfg, target: load_verifiers(target, cfg.env_args, cfg.data.import_timeout_s),
                      "rows": verifiers_rows, "episodes": verifiers_episodes}}  # (check: the taskset loads)


def hub_of(env):
    """--env -> (hub entry, target), or (None, None) for a package.module:make_env factory."""
    prefix, _, target = (env or "").partition(":")
    return (HUBS[prefix], target) if prefix in HUBS and target else (None, None)


def check_env(cfg):
    """--env (every rank, before any collective): a hub's checks, or the factory imported (--data.import-timeout-s)."""
    hub, target = hub_of(cfg.env)
    if cfg.env_args is not None and (not cfg.env or hub is HUBS["openenv"]):
        raise ValueError("--env-args is read by --env verifiers:... and package.module:make_env factories" +
                         (f", not by --env {cfg.env}" if cfg.env else " (no --env given)") + ". Drop it.")
    if hub:
        return hub["check"](cfg, target)
    if (cfg.env or "").partition(":")[0] in HUBS:  # e.g. an empty shell variable: not a package.module:make_env
        raise ValueError(f"--env {cfg.env} names no target: pass --env openenv:http://HOST:PORT (an OpenEnv server) "
                         "or --env verifiers:TASKSET.")
    if cfg.env:
        env_factory(cfg, cfg.data.import_timeout_s)


def env_factory(cfg, timeout_s=0):
    """--env package.module:make_env with --env-args (a JSON object) as its keyword arguments -> make_env(), or one
    clear error naming the flags."""
    make_env = user_code.resolve(cfg.env, "--env", timeout_s)
    try:
        kwargs = json.loads(cfg.env_args or "{}")
        inspect.signature(make_env).bind(**kwargs)  # a name make_env does not take is refused here, not mid-run
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"--env-args {cfg.env_args!r} for --env {cfg.env}: give a JSON object of {cfg.env}'s keyword "
                         f"arguments ({e}).") from None
    return functools.partial(make_env, **kwargs)


def load_env(cfg):
    """--env -> make_env: the factory episodes.run_episodes calls, or a hub's episode runner (its "episodes")."""
    hub, target = hub_of(cfg.env)
    if hub and "episodes" in hub:
        return functools.partial(hub["episodes"], target, cfg.env_args)
    return hub["make_env"](cfg, target) if hub else env_factory(cfg)
