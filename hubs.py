"""hubs.py: environments published through the hubs, as `--env HUB:ADDRESS` values (HUBS, at the bottom: hub -> the
function that builds its make_env). Each make_env() gives the object episodes.py drives, like a user's environment:
reset(row) -> messages, step(assistant_text) -> (new_messages | None, reward | None, done), and close() (called when
its episode ends, however it ends). Any other --env is the user's package.module:function.
"""
import functools
import json
import threading
import urllib.request
from dataclasses import dataclass

import user_code
from episodes import chat_messages


def make_env_factory(cfg, timeout_s=0):
    """--env -> make_env, checked (a hub's server answers and fits its flags; a user's module imports within
    timeout_s), or one clear error naming the flag: on every rank, before any collective."""
    hub, _, address = cfg.env.partition(":")
    if hub in HUBS:
        return HUBS[hub](address, cfg)
    return user_code.resolve(cfg.env, "--env", timeout_s)


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


def openenv_env(url, cfg):
    """--env openenv:URL -> make_env, once openenv-core imports, the server answers /schema and the fields the
    --openenv.* flags name are in it."""
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
    return functools.partial(OpenEnvSession, url, o, cfg.rollout.env_timeout_s)


class OpenEnvSession:
    """One episode on the server. Any failure of a call (the server's error, a connection it drops, no answer within
    --rollout.env-timeout-s, an observation that does not fit --openenv.observation-field) closes the session and
    raises: episodes.py ends the episode with env_error, reward None."""

    def __init__(self, url, cfg, timeout_s):
        from openenv.core import GenericEnvClient
        t = timeout_s + 1  # episodes.py's deadline for the call comes first (its message names the flag), then this one
        self.client = GenericEnvClient(base_url=url, connect_timeout_s=t, message_timeout_s=t).sync()
        self.cfg, self.total = cfg, 0.0  # total: the sum of what step() returned, as episodes.py adds it up

    def reset(self, row):
        """The server's reset() gets the row's other columns (it keeps those its signature names: openenv's rule); the
        observation's text is appended to the prompt's last message (TRL's environment_factory rule)."""
        text, _, _ = self.call(self.client.reset, **{k: v for k, v in row.items() if k not in ("prompt", "image")})
        messages = chat_messages(row["prompt"])
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
            client, self.client = self.client, None  # not waited for: a server stuck in a step answers the close
            threading.Thread(target=client.close, daemon=True).start()  # handshake only at the client's 10 s limit
            raise

    def close(self):
        """The server ends the session, and frees its slot, when the connection closes (called once the episode
        ends, however it ends; a session that failed is closed already)."""
        if self.client is not None:
            self.client.close()


HUBS = {"openenv": openenv_env}
