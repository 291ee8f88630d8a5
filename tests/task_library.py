"""A task library written for the tests, used as a researcher's own: `--dataset task_library:rows` (rows from Python,
no file) and its own check `--data.rewards task_library:first_letter` (its answers are letters, not numbers, so
math-verify could not score them)."""
import random


def rows(n=300, seed=0):
    """'k 3 x =' -> 'k': the first letter of the prompt. The last two rows repeat training rows (a generator that
    draws from a small space does that), which the held-out split must leave out."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        letters = rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(1, 3))
        out.append({"prompt": " ".join(letters + [str(rng.randrange(10))]) + " =", "answer": letters[0]})
    return out + out[:2]


def first_letter(prompts, completions, answer=None, **_):
    """1 when the completion starts with the answer's letter, else 0."""
    return [float(c.strip()[:1] == a) for c, a in zip(completions, answer)]


def unseeded():
    """A generator that forgot its seed: other rows on every call."""
    return [{"prompt": str(random.random())} for _ in range(3)]


def not_dicts():
    return ["a prompt"]


def as_dataset():
    import datasets
    return datasets.Dataset.from_list(rows(20))
