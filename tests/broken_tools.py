"""A broken `multiply` for --data.tools broken_tools:multiply (the name the warmed-up tiny model calls)."""
import itertools
import threading
import time

_calls, _lock = itertools.count(1), threading.Lock()


def multiply(a: int, b: int) -> int:
    """Multiply two integers (broken on purpose: every odd-numbered call raises, every even-numbered one hangs, so any
    two calls take both paths whatever the model wrote).

    Args:
        a: the first factor
        b: the second factor
    """
    with _lock:
        n = next(_calls)
    if n % 2:
        raise ValueError(f"deliberate failure for a={a}")
    time.sleep(5)  # far past --rollout.tool-timeout-s in the test
    return a * b
