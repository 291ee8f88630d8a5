"""Tools and environments the multi-turn tests pass as --data.tools tools_for_tests:<name> and
--env tools_for_tests:<name>."""
import asyncio

from tool_models import multiply  # noqa: F401 - the tool the warmed-up tiny model calls


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
    """Three turns: each assistant turn is answered with 'turn k', rewarded by step_reward; done after the third."""

    def reset(self, row):
        self.t = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_text):
        self.t += 1
        done = self.t >= 3
        return (None if done else [{"role": "user", "content": f"turn {self.t}"}]), step_reward(assistant_text), done


def make_counting_env():
    return CountingEnv()


class EndlessEnv(CountingEnv):
    """Never done: only --rollout.max-turns or a length limit ends its episodes."""

    def step(self, assistant_text):
        self.t += 1
        return [{"role": "user", "content": f"turn {self.t}"}], 0.0, False
