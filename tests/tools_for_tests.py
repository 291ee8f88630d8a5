"""Tools and environments the multi-turn tests pass as --data.tools tools_for_tests:<name> and
--env tools_for_tests:<name>."""
import asyncio
import time

from tasks import multiply  # noqa: F401 - the tool builtin:tiny-tools calls


async def async_add(a: int, b: int) -> int:
    """Add two integers, asynchronously.

    Args:
        a: the first term
        b: the second term
    """
    await asyncio.sleep(0)
    return a + b


async def async_hang(a: int) -> int:
    """Never answers in time.

    Args:
        a: anything
    """
    await asyncio.sleep(30)
    return a


def step_reward(text):
    """The reward CountingEnv gives for one assistant turn (the test recomputes it from the episode's messages)."""
    return len(text) / 10


class CountingEnv:
    """`turns` turns (3): each assistant turn is answered with 'turn k', rewarded by step_reward; done after the last."""

    def __init__(self, turns=3):
        self.turns = turns

    def reset(self, row):
        self.t = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_text):
        self.t += 1
        done = self.t >= self.turns
        return (None if done else [{"role": "user", "content": f"turn {self.t}"}]), step_reward(assistant_text), done


def make_counting_env(turns=3):
    return CountingEnv(turns)


class EndlessEnv(CountingEnv):
    """Never done: only --rollout.max-turns or a length limit ends its episodes."""

    def step(self, assistant_text):
        self.t += 1
        return [{"role": "user", "content": f"turn {self.t}"}], 0.0, False


def quitting_tool(a: int) -> int:
    """Raises SystemExit (a BaseException, not an Exception).

    Args:
        a: anything
    """
    raise SystemExit(f"tool quit on {a}")


class FlakyEnv(CountingEnv):
    """CountingEnv whose row["fail"] says how it breaks: "reset" / "step" raise, "reset_hang" / "step_hang" sleep 5 s,
    "step_exit" raises SystemExit (the step ones on the first step()); anything else behaves. `closed`: the row["fail"]
    of each one episodes.py closed (close(): when its episode ended)."""
    closed = []

    def reset(self, row):
        self.fail = row.get("fail")
        if self.fail == "reset":
            raise RuntimeError("deliberate reset failure")
        if self.fail == "reset_hang":
            time.sleep(5)
        return super().reset(row)

    def step(self, assistant_text):
        if self.fail == "step":
            raise ValueError("deliberate step failure")
        if self.fail == "step_hang":
            time.sleep(5)
        if self.fail == "step_exit":
            raise SystemExit("environment quit")
        return super().step(assistant_text)

    def close(self):
        FlakyEnv.closed.append(self.fail)
