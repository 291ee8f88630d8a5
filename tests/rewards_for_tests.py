"""Reward functions the end-to-end tests pass as --data.rewards rewards_for_tests:<name>."""
import asyncio

_calls = {"n": 0}


def flaky(prompts, completions, **_):
    """Raises on every third sample it scores (a buggy user reward); the trainer must keep going."""
    out = []
    for c in completions:
        _calls["n"] += 1
        if _calls["n"] % 3 == 0:
            raise RuntimeError("flaky reward: deliberate failure")
        out.append(float(len(c) % 2))
    return out


async def async_length(prompts, completions, **_):
    await asyncio.sleep(0)
    return [min(len(c), 8) / 8 for c in completions]


async def async_alternating(prompts, completions, **_):
    """0, 1, 0, 1, ... by position: every group of two or more samples has a learning signal whatever was sampled, so
    a test's checks never hinge on what this CPU's arithmetic drew (groups are contiguous in a reward call)."""
    await asyncio.sleep(0)
    return [float(i % 2) for i in range(len(completions))]


def other_on_rank_1(prompts, completions, **_):
    """async_alternating's rewards on rank 0; on rank 1 others (a reward that is not deterministic, seen from the two
    ranks of a context-parallel group, which score the same rows)."""
    import os
    return [float(i % 2 if os.environ.get("RANK", "0") != "1" else i % 3) for i in range(len(completions))]


def half_none(prompts, completions, **_):
    """Applies only to every other sample (None elsewhere)."""
    return [float(c[:1].isdigit()) if i % 2 else None for i, c in enumerate(completions)]


def always_raises(prompts, completions, **_):
    raise ValueError("this reward function is broken")


def always_one(prompts, completions, **_):
    """A reward that is not a correctness check (like `format`): it must not count as accuracy."""
    return [1.0] * len(completions)



def first_is_digit(prompts, completions, **_):
    """1 when the completion starts with a digit: fixed once the first token is drawn, so a critic can learn the value
    of every later state exactly (and the mean before it)."""
    return [float(c[:1].isdigit()) for c in completions]


def even_prompts_agree(prompts, completions, **_):
    """1 for every completion of a prompt whose first digit is even (a group whose rewards all agree); whether the
    completion starts with a digit otherwise (mostly informative groups)."""
    first = lambda p: int(next(ch for ch in p if ch.isdigit()))  # noqa: E731
    return [1.0 if first(p) % 2 == 0 else float(c[:1].isdigit()) for p, c in zip(prompts, completions)]


def length_fraction(prompts, completions, **_):
    """len(completion) / 64 characters: varies inside almost every group, so a short run is sure to update the policy
    (an accuracy reward on 8 samples of a small model can be all zero: zero advantages, no update)."""
    return [min(len(c), 64) / 64 for c in completions]


def always_nan(prompts, completions, **_):
    """A reward that breaks without raising: NaN for every sample (and inf for one), as a broken server or a 0/0."""
    return [float("inf") if i == 1 else float("nan") for i in range(len(completions))]


def hangs(prompts, completions, **_):
    """A reward call that does not come back in time (a stuck sandbox, a deadlock)."""
    import time
    time.sleep(5)
    return [1.0] * len(completions)


def answer_parity(prompts, completions, answer, **_):
    """1 for every sample of a row whose answer is even (a group whose rewards all agree); 0, 1, 0, 1, ... by position
    for the others (groups are contiguous in a call): which groups carry a signal never hinges on what was sampled."""
    return [1.0 if int(a) % 2 == 0 else float(i % 2) for i, a in enumerate(answer)]
