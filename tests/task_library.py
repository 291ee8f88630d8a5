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


def with_nan():
    """Rows as pandas' records give them: a missing value is NaN (never equal to itself)."""
    return [{"prompt": "a =", "answer": "a", "score": 1.0}, {"prompt": "b =", "answer": "b", "score": float("nan")}]


def boom():
    raise RuntimeError("no rows today")


def slow():
    import time
    time.sleep(5)
    return rows(3)


def not_dicts():
    return ["a prompt"]


def as_dataset():
    import datasets
    return datasets.Dataset.from_list(rows(20))


# ---- An environment whose reset writes the prompt (rows of seeds only) and which scores unfinished episodes ----

UNFINISHED_REWARD = {"max_turns": -1.0, "token_budget": -0.5, "max_total_length": -0.75, "max_turn_tokens": None}


def seed_rows(n=40):
    """Rows without a prompt column: a seed each (SeedGame's reset writes the prompt)."""
    return [{"seed": i} for i in range(n)]


def seed_prompt(seed):
    return f"Game {seed}: say a number."


class SeedGame:
    """--env task_library:SeedGame --env-args '{"log": PATH}': reset(row) writes the prompt from row["seed"] (none
    for a row with "empty": the error when neither gives one); the game is over after 1 turn for even seeds, 3 for odd
    ones (with --rollout.max-turns 2 they never finish); each step() is rewarded 0.25; unfinished(reason) gives
    UNFINISHED_REWARD[reason]. close() appends what this environment saw to PATH, one JSON line: the seed, the texts
    step() got, the reason unfinished() got (None if not called)."""

    def __init__(self, log):
        self.log, self.texts, self.reason = log, [], None

    def reset(self, row):
        self.seed = row["seed"]
        return [] if row.get("empty") else [{"role": "user", "content": seed_prompt(self.seed)}]

    def step(self, assistant_text):
        self.texts.append(assistant_text)
        done = len(self.texts) >= (1 if self.seed % 2 == 0 else 3)
        return (None if done else [{"role": "user", "content": "go on"}]), 0.25, done

    def unfinished(self, reason):
        self.reason = reason
        return UNFINISHED_REWARD[reason]

    def close(self):
        import json
        with open(self.log, "a") as f:  # (one short write per line: episodes close at once, on threads)
            f.write(json.dumps({"seed": self.seed, "texts": self.texts, "unfinished": self.reason}) + "\n")
