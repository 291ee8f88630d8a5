"""A broken `multiply` for --data.tools broken_tools:multiply (the name the warmed-up tiny model calls)."""
import time


def multiply(a: int, b: int) -> int:
    """Multiply two integers (broken on purpose: raises for an even a, hangs for an odd a).

    Args:
        a: the first factor
        b: the second factor
    """
    if a % 2 == 0:
        raise ValueError(f"deliberate failure for a={a}")
    time.sleep(5)  # far past --rollout.tool-timeout-s in the test
    return a * b
