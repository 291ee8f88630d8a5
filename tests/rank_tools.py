"""A tool and an environment whose answers name the rank that ran them (--vllm.tp 2 multi-turn test): only each TP
group's first rank may run them, whatever rank trains the episode."""
import os

from tools_for_tests import CountingEnv


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return f"{a * b} (rank {os.environ['RANK']})"


class RankEnv(CountingEnv):
    """CountingEnv whose observations end with the rank that made them."""

    def step(self, assistant_text):
        new, reward, done = super().step(assistant_text)
        return [{**m, "content": f"{m['content']} (rank {os.environ['RANK']})"} for m in new or []] or None, reward, done


def make_rank_env():
    return RankEnv()
