"""tasks.py: datasets and reward functions.

A dataset is a list of rows {"prompt": str | list[chat message], "answer": ..., "image": PIL.Image?, ...}:
a built-in offline task name, a local .jsonl / .parquet file, or a Hugging Face hub dataset ("name" or "name:config").

Every reward function has one signature, sync or async:
    fn(prompts: list, completions: list[str], **columns) -> list[float | None]
`columns` holds the dataset's other columns (one list per column, aligned with completions) plus `completion_ids`.
None means "does not apply to this sample" (it becomes NaN and is left out of the statistics).
Besides Python functions, `rm:PATH` names a reward model (a one-label sequence classifier, loaded frozen on each
rank) and `http://HOST:PORT/PATH` a reward server: POST {"prompts", "completions", <columns>} -> {"rewards": [...]}.
"""
import ast
import asyncio
import functools
import inspect
import json
import math
import operator
import os
import random
import re
import sys
import traceback
from dataclasses import dataclass

import torch

import answers
import console
import models
import user_code
from external_rewards import RewardBatchFailed, check_url, http_reward, reward_model_reward, within


@dataclass
class DataConfig:
    prompt_column: str = "prompt"
    """Dataset column holding the prompt (plain text or chat messages)."""
    answer_column: str = "answer"
    """Dataset column passed to reward functions as `answer` (optional)."""
    split: str = "train"
    """Hub dataset split for training."""
    eval_split: str | None = None
    """Hub dataset split for evaluation (default: the last eval.num_prompts rows of train, held out)."""
    size: int = 4000
    """Number of prompts generated for built-in tasks."""
    chat_template: bool = True
    """Wrap plain-text prompts as a user message and apply the tokenizer's chat template (when it has one)."""
    system_prompt: str | None = None
    """Optional system message prepended to chat prompts."""
    tools: tuple[str, ...] = ()
    """Tools for multi-turn episodes: package.module:function, with type hints and an Args: docstring (their JSON
    schema goes to the chat template). Tool calls are parsed in the Hermes/Qwen <tool_call> format (episodes.py)."""
    rewards: tuple[str, ...] = ()
    """Reward functions: accuracy | final_number | format | countdown | digit | max_digit | env | overlong |
    package.module:function | rm:PATH (a one-label sequence classifier) | http://HOST:PORT/PATH (a reward server)
    (default: the task's; `env` with --env)."""
    reward_weights: tuple[float, ...] = ()
    """One weight per reward function (default: all 1)."""
    overlong_cache: int = 4
    """DAPO soft overlong penalty: the last this-many tokens before max_completion_length are penalised linearly."""
    rm_batch_size: int = 16
    """rm:PATH rewards: texts per reward-model forward pass."""
    rm_shard_gb: float = 4.0
    """rm:PATH rewards: a reward model whose weights exceed this many GB (bf16 on CUDA, fp32 on CPU) is FSDP2-sharded
    over all ranks instead of copied onto each (0 = always shard, inf = never)."""
    http_timeout_s: float = 60.0
    """http:// rewards: seconds for one whole try (connect, send, the complete answer)."""
    http_retries: int = 2
    """http:// rewards: extra tries after a failed POST (exponential backoff from 0.5 s); then the batch gets None."""
    reward_timeout_s: float = 0.0
    """package.module:function rewards: the longest one call may take; past it the call's samples get None (counted
    in reward/failed) and the run goes on, the stuck call left on its thread (0 = no limit, the default: with a limit
    the call runs on a worker thread, where code that needs the main thread fails, e.g. math-verify's parse/verify)."""
    import_timeout_s: float = 120.0
    """package.module:function rewards, --data.tools and --env: the longest the import of their module may take at
    start-up; a module that hangs at import stops the run with a message naming it (0 = no limit)."""



# ----------------------------------------------------------------------------------------------------------
# Built-in offline tasks
# ----------------------------------------------------------------------------------------------------------


def max_digit_task(n, seed):
    """'max 3 8 1 =' -> '8' (the earlier default run: its tiny policy learned the best constant answer, '7', not the max)."""
    rng = random.Random(seed)
    picks = [[rng.randrange(10) for _ in range(rng.randint(2, 4))] for _ in range(n)]
    return [{"prompt": "max " + " ".join(map(str, d)) + " =", "answer": str(max(d))} for d in picks]


def arith_task(n, seed, hi=99):
    """Small integer arithmetic (operands 1..hi, + - *) with a numeric answer (GSM8K-style exact match), as chat
    messages."""
    rng = random.Random(seed)
    picks = [(rng.randint(1, hi), rng.randint(1, hi), rng.choice("+-*")) for _ in range(n)]
    return [{"prompt": [{"role": "user", "content": f"What is {a} {op} {b}? Put the answer in \\boxed{{}}."}],
             "answer": str({"+": a + b, "-": a - b, "*": a * b}[op])} for a, b, op in picks]


def small_arith_task(n, seed):
    """arith with operands 1..20 (+ - *): a task SmolLM2-135M-Instruct partly solves (measured: 21 of 64 held-out
    prompts right greedily; arith's 1..99 under a tenth), so groups of samples hold right and wrong answers
    (docs/benchmarks.md, "A real model"). Only 1200 distinct prompts: load_rows drops the held-out ones from train."""
    return arith_task(n, seed, hi=20)


def countdown_task(n, seed):
    """Countdown: combine the numbers with + - * / to reach the target (TinyZero-style prompts)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        nums = [rng.randint(1, 20) for _ in range(rng.randint(3, 4))]
        expr = str(nums[0])
        for x in nums[1:]:
            expr = f"({expr} {rng.choice('+-*')} {x})"
        target = eval(expr)
        rows.append({"prompt": [{"role": "user", "content": f"Using the numbers {nums}, make {target}. Use each "
                                 "number once with + - * /. Show the equation in <answer></answer>."}],
                     "numbers": nums, "target": target})
    return rows


def multiply(a: int, b: int) -> int:
    """Multiply two integers exactly.

    Args:
        a: the first factor
        b: the second factor
    """
    return int(a) * int(b)


def calculator_task(n, seed):
    """Products of large numbers (5-6 digits x 3-4 digits): a task for the `multiply` tool (--dataset calculator runs
    with --data.tools tasks:multiply by default); the reward is the exact product as the final number."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10_000, 999_999), rng.randint(100, 9_999)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} * {b}? Use the multiply tool, then give the "
                                 "exact product as the final number."}], "answer": str(a * b)})
    return rows


def find_digit_task(n, seed):
    """'q 7 k =' -> '7': the one digit among 1-3 letters, anywhere. The default run: a constant answer gets about a
    fifth right, and a tiny random policy learns to read the digit in about a minute on a CPU."""
    rng = random.Random(seed)
    picks = [[str(rng.randrange(10))] + rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(1, 3)) for _ in range(n)]
    return [{"prompt": " ".join(rng.sample(p, len(p))) + " =", "answer": p[0]} for p in picks]


def calculator_transcripts(n, seed):
    """Worked calculator_task episodes (the multiply tool called on the prompt's two numbers, its answer, the product
    as the final answer): the supervised warm-up of builtin:tiny-tools."""
    out = []
    for row in calculator_task(n, seed):
        a, b = map(int, re.findall(r"\d+", row["prompt"][0]["content"])[:2])
        call = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}, separators=(",", ":"))
        out.append(row["prompt"] + [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                                    {"role": "tool", "name": "multiply", "content": row["answer"]},
                                    {"role": "assistant", "content": row["answer"]}])
    return out


BUILTIN_TASKS = {"find_digit": find_digit_task, "max_digit": max_digit_task, "arith": arith_task,
                 "small_arith": small_arith_task, "countdown": countdown_task, "calculator": calculator_task}
DEFAULT_TOOLS = {"calculator": ["tasks:multiply"]}


def read_rows(name, flag="--dataset"):
    """A .jsonl/.parquet file -> [(where, row)], `where` naming the row in the user's terms: the file's line number
    for .jsonl (json.loads of one line would say "line 1"), the 1-based row for .parquet."""
    if not os.path.isfile(name):
        raise FileNotFoundError(f"{flag} {name!r}: no such file. Pass an existing .jsonl/.parquet file, a built-in "
                                f"task ({', '.join(BUILTIN_TASKS)}) or a hub dataset name.")
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq
        return [(f"row {i}", r) for i, r in enumerate(pq.read_table(name).to_pylist(), 1)]
    rows = []
    with open(name) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip())
            except json.JSONDecodeError as e:
                raise ValueError(f"{flag} {name!r} line {i} is not valid JSON ({e.msg}, column {e.colno}): every "
                                 "line must be one JSON object. Fix or delete that line.") from None
            if not isinstance(row, dict):
                raise ValueError(f"{flag} {name!r} line {i} is a JSON {type(row).__name__}, not an object: every line "
                                 'must be one JSON object, e.g. {"prompt": "...", "answer": "..."}.')
            rows.append((f"line {i}", row))
    return rows


def load_dataset_rows(name, *, split="train", prompt_column="prompt", answer_column="answer", size=2000, seed=0,
                      flags=("--dataset", "--data.prompt-column")):
    """-> list of rows with a 'prompt' key (and 'answer' when answer_column exists). Raises one clear error naming
    `flags` (the dataset's and the prompt column's) and the row."""
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name](size, seed if split == "train" else seed + 10_000)
    flag, column_flag = flags
    if name.endswith((".jsonl", ".json", ".parquet")):
        rows = read_rows(name, flag)
    else:
        import datasets
        hub_name, _, config = name.partition(":")
        rows = [(f"row {i}", r) for i, r in enumerate(datasets.load_dataset(hub_name, config or None, split=split), 1)]
    if not rows:
        raise ValueError(f"{flag} {name!r} is empty (no rows{'' if os.path.isfile(name) else f' in split {split!r}'}): "
                         "pass a dataset with at least one prompt.")
    if prompt_column not in rows[0][1]:
        raise ValueError(f"{flag} {name!r} has no column {prompt_column!r} (columns: {sorted(rows[0][1])}): pass "
                         f"{column_flag} NAME with the column to read.")
    if missing := [where for where, r in rows if r.get(prompt_column) is None]:
        raise ValueError(f"{flag} {name!r} {missing[0]} has no {prompt_column!r} ({column_flag}) value"
                         f"{f' ({len(missing)} rows lack one)' if len(missing) > 1 else ''}: every row needs a prompt. "
                         "Fill it in or drop the row.")
    rows = [r for _, r in rows]
    out = []
    for r in rows:
        r = dict(r)
        r["prompt"] = r.pop(prompt_column)
        if answer_column in r and answer_column != "answer":
            r["answer"] = r.pop(answer_column)
        if "images" in r and "image" not in r:
            imgs = r.pop("images")
            r["image"] = imgs[0] if isinstance(imgs, list) and imgs else imgs
        if isinstance(r.get("image"), str):  # a path, relative to the dataset file
            from PIL import Image
            base = os.path.dirname(name) if os.path.isfile(name) else ""
            r["image"] = Image.open(os.path.join(base, r["image"])).convert("RGB")
        elif isinstance(r.get("image"), dict) and r["image"].get("bytes"):  # parquet / hub image struct
            import io

            from PIL import Image
            r["image"] = Image.open(io.BytesIO(r["image"]["bytes"])).convert("RGB")
        out.append(r)
    return out


@dataclass
class PtxConfig:
    dataset: str = ""
    """Text for the ptx loss (InstructGPT, arXiv 2203.02155): a .jsonl/.parquet file, a hub dataset or a built-in
    task (prompt + answer). Empty = off."""
    column: str = "text"
    """Column holding the text."""
    coef: float = 0.05
    """Weight of the ptx next-token loss added to the policy loss (OpenRLHF's default)."""
    batch_size: int = 4
    """Texts per rank per optimizer update."""
    max_length: int = 256
    """Tokens per text (longer ones are cut)."""


def ptx_token_rows(cfg: PtxConfig, tokenizer, seed=0):
    """The ptx texts as token-id lists (>= 2 tokens each; no chat template: plain language modelling)."""
    builtin = cfg.dataset in BUILTIN_TASKS
    rows = load_dataset_rows(cfg.dataset, prompt_column="prompt" if builtin else cfg.column, seed=seed)
    texts = [f"{r['prompt'] if isinstance(r['prompt'], str) else r['prompt'][-1]['content']} {r.get('answer', '')}"
             if builtin else str(r["prompt"]) for r in rows]
    out = [tokenizer(t, add_special_tokens=True)["input_ids"][:cfg.max_length] for t in texts]
    out = [ids for ids in out if len(ids) >= 2]
    if not out:
        raise ValueError(f"--ptx.dataset {cfg.dataset!r} has no text of 2 or more tokens in column {cfg.column!r}.")
    return out


def wraps_text_prompts(processor, chat_template=True):
    """Does the policy read a plain-text prompt as a user turn of its chat template (--data.chat-template and a
    template to use), not raw?"""
    tok = getattr(processor, "tokenizer", processor)
    return bool(chat_template and (getattr(processor, "chat_template", None) or getattr(tok, "chat_template", None)))


def encode_prompt(row, processor, max_prompt_length, chat_template=True, system_prompt=None, tools=None):
    """Row -> {prompt_ids, engine prompt, text, (mm tensors)}. Chat messages (and, with chat_template, plain-text
    prompts wrapped as a user message) go through the tokenizer's chat template when it has one, with `tools`
    (functions; the template gets their JSON schema)."""
    tok = getattr(processor, "tokenizer", processor)
    prompt, image = row["prompt"], row.get("image")
    if isinstance(prompt, str) and wraps_text_prompts(processor, chat_template):
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        if system_prompt and prompt[0]["role"] != "system":
            prompt = [{"role": "system", "content": system_prompt}] + prompt
        if image is not None and not any(isinstance(m.get("content"), list) for m in prompt):
            first_user = next(i for i, m in enumerate(prompt) if m["role"] == "user")
            prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": m["content"]}]}
                      if i == first_user else m for i, m in enumerate(prompt)]
        text = processor.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    if image is not None:
        enc = processor(text=[text], images=[image], return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        mm = {k: v for k, v in enc.items() if k in ("pixel_values", "image_grid_thw")}
        return {"prompt_ids": ids, "text": text, "mm": mm,
                "engine": {"prompt": text, "multi_modal_data": {"image": image}, "prompt_token_ids": ids,
                           "hf_inputs": mm}}
    ids = tok(text, add_special_tokens=False)["input_ids"][-max_prompt_length:]  # left truncation
    return {"prompt_ids": ids, "text": text, "engine": {"prompt_token_ids": ids}}


# ----------------------------------------------------------------------------------------------------------
# Reward functions
# ----------------------------------------------------------------------------------------------------------

def accuracy_reward(prompts, completions, answer=None, **_):
    """1.0 when the completion's final answer equals the gold one (see answer_reward); None without a readable answer."""
    if answer is None:
        return [None] * len(completions)
    return [answers.answer_reward(a, c) for c, a in zip(completions, answer)]


def final_number_reward(prompts, completions, answer=None, **_):
    """1.0 when the completion's final number (extract_number: \\boxed{} first, else the last number) equals the gold
    answer (gold_number: '#### 72', '\\boxed{1/2}', '1,000'); None where the gold is no number.
    It never evaluates an expression: math-verify alone credits a completion that restates the question ('3 * 4' for
    12), and GRPO on SmolLM2 learned exactly that (README, "A real model"); `accuracy` now refuses such readings too."""
    if answer is None:
        return [None] * len(completions)
    got, gold = [answers.extract_number(c) for c in completions], [answers.gold_number(a) for a in answer]
    return [None if t is None else float(g is not None and abs(g - t) < 1e-6) for g, t in zip(got, gold)]


def format_reward(prompts, completions, **_):
    """1.0 when the completion states a final answer in a parseable form (\\boxed{}, '#### x' or <answer>...</answer>)."""
    pat = re.compile(r"(\\boxed\{[^{}]+\}|####\s*" + answers.NUM + r"|<answer>.+?</answer>)", re.S)
    return [float(bool(pat.search(c))) for c in completions]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _safe_eval(node):
    if isinstance(node, ast.Expression):
        return _safe_eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_safe_eval(node.left), _safe_eval(node.right))
    raise ValueError("not an arithmetic expression")


def countdown_reward(prompts, completions, numbers=None, target=None, **_):
    """1.0 when <answer>eq</answer> uses each given number exactly once and evaluates to the target."""
    if numbers is None or target is None:
        return [None] * len(completions)
    out = []
    for c, nums, tgt in zip(completions, numbers, target):
        m = re.findall(r"<answer>(.*?)</answer>", c, re.S)
        eq = (m[-1] if m else "").split("=")[0].strip()
        try:
            used = sorted(int(x) for x in re.findall(r"\d+", eq))
            ok = used == sorted(nums) and abs(_safe_eval(ast.parse(eq, mode="eval")) - tgt) < 1e-6
        except (ValueError, SyntaxError, ZeroDivisionError):
            ok = False
        out.append(float(ok))
    return out


def env_reward(prompts, completions, env_reward=None, **_):
    """--env: the episode's reward from the environment (the sum of what step() returned); None where it gave none."""
    return [None if r is None else float(r) for r in (env_reward or [None] * len(completions))]


def max_digit_reward(prompts, completions, answer=None, **_):
    """1 - |d - answer| / 9 for the completion's first character d when it is a digit, else 0 (dense, in [0, 1])."""
    out = []
    for c, a in zip(completions, answer):
        s = c.lstrip(" ")
        out.append(1.0 - abs(int(s[0]) - int(a)) / 9.0 if s[:1].isdigit() else 0.0)
    return out


def digit_reward(prompts, completions, answer=None, **_):
    """1.0 when the completion's first character (after spaces) is the answer, else 0. No credit for a wrong digit: with
    it (0.1) the default run settled on one constant digit before it learned to read the prompt (docs, quickstart)."""
    return [float(c.lstrip(" ")[:1] == str(a)) for c, a in zip(completions, answer)]


def overlong_penalty(max_completion_length, cache):
    """DAPO soft overlong punishment (arXiv 2503.14476, eq. 13): 0 up to L_max - L_cache, then linear to -1."""
    def overlong_reward(prompts, completions, completion_ids=None, **_):
        out = []
        for ids in completion_ids:
            n = len(ids)
            if n <= max_completion_length - cache:
                out.append(0.0)
            elif n <= max_completion_length:
                out.append((max_completion_length - cache - n) / cache)
            else:
                out.append(-1.0)
        return out
    return overlong_reward


REWARDS = {"accuracy": accuracy_reward, "format": format_reward, "countdown": countdown_reward,
           "max_digit": max_digit_reward, "digit": digit_reward, "final_number": final_number_reward, "env": env_reward}
DEFAULT_REWARDS = {"find_digit": ["digit"], "max_digit": ["max_digit"], "arith": ["accuracy", "format"],
                   "countdown": ["countdown", "format"], "small_arith": ["final_number"], "calculator": ["final_number"]}


def accuracy_fn(dataset):
    """The dataset's own correctness check (a built-in task's first reward, else `accuracy`): 1.0 means right."""
    return resolve_reward(DEFAULT_REWARDS.get(dataset, ["accuracy"])[0])


def best_constant_accuracy(rows, dataset):
    """The held-out accuracy of the best fixed completion, the same text for every prompt: what a policy that ignores
    its prompt can reach. A fixed text is right only on rows whose answer it gives, so trying each distinct gold answer
    as every row's completion finds the best one exactly. None without gold answers."""
    golds = sorted({str(r["answer"]) for r in rows if r.get("answer") is not None})
    prompts, columns = [r["prompt"] for r in rows], {k: [r.get(k) for r in rows] for k in (rows or [{}])[0]}
    columns.pop("prompt", None)
    check = accuracy_fn(dataset)
    right = [sum((x or 0.0) >= 1.0 - 1e-6 for x in check(prompts, [g] * len(rows), **columns)) for g in golds]
    return max(right) / len(rows) if right else None


def resolve_reward(name, data=None, *, max_completion_length=256, device="cpu", processor=None):
    """'accuracy' | 'final_number' | 'format' | 'countdown' | 'digit' | 'max_digit' | 'env' | 'overlong' |
    'package.module:function' | 'rm:PATH' | 'http(s)://HOST:PORT/PATH' -> a reward function; `data` (DataConfig) holds the options of the last
    three; `processor`, the policy's, decides (as encode_prompt) whether rm: sees text prompts as a user turn."""
    data = data or DataConfig()
    if name == "overlong":
        return overlong_penalty(max_completion_length, data.overlong_cache)
    if name.startswith("rm:"):
        return reward_model_reward(name[3:], device, data.rm_batch_size, data.rm_shard_gb, data.system_prompt,
                                   data.chat_template if processor is None else
                                   wraps_text_prompts(processor, data.chat_template))
    if name.startswith(("http://", "https://")):
        return http_reward(name, data.http_timeout_s, data.http_retries)
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        fn = user_code.resolve(name, "--data.rewards", data.import_timeout_s)
        return bounded_reward(fn, name, data.reward_timeout_s)
    raise ValueError(f"--data.rewards: unknown reward {name!r}. Use one of {', '.join([*REWARDS, 'overlong'])}, "
                     f"'package.module:function', rm:PATH or http://HOST:PORT/PATH.")


def bounded_reward(fn, name, timeout_s):
    """A user reward function whose every call (sync or async) must end within timeout_s (--data.reward-timeout-s),
    else RewardBatchFailed: its samples get None, with no sample-by-sample retry."""
    def run(prompts, completions, **columns):
        out = fn(prompts, completions, **columns)
        return asyncio.run(out) if inspect.isawaitable(out) else out

    @functools.wraps(fn)
    def bounded(prompts, completions, **columns):
        late = RewardBatchFailed(f"reward function {name!r}: no result within --data.reward-timeout-s {timeout_s:g} s "
                                 "(the call is left running on its thread)")
        return within(lambda: run(prompts, completions, **columns), timeout_s, late)
    return bounded if timeout_s else fn


def check_rewards(names, data, rows=()):
    """For validate(): every name resolves, without loading a reward model (rm: reads its config) or calling out;
    `final_number` needs gold answers that are numbers (refused when none is; rank 0 says how many are not)."""
    if data.rm_batch_size < 1 or data.http_timeout_s <= 0 or data.http_retries < 0 or data.reward_timeout_s < 0:
        raise ValueError("--data.rm-batch-size must be >= 1, --data.http-timeout-s > 0, --data.http-retries >= 0 and "
                         "--data.reward-timeout-s >= 0 (0 = no limit).")
    golds = [r.get("answer") for r in rows] if "final_number" in names else []
    unread = [a for a in golds if answers.gold_number(a) is None]
    if golds and len(unread) == len(golds):
        raise ValueError(f"--data.rewards final_number: no gold answer is a single number (e.g. {str(unread[0])[:60]!r}"
                         "). Use --data.rewards accuracy (math-verify reads expressions, sets and LaTeX).")
    if unread and os.environ.get("RANK", "0") == "0":
        print(f"final_number: {len(unread)} of {len(golds)} gold answers are not a single number (e.g. "
              f"{str(unread[0])[:60]!r}); their completions get no reward (NaN, left out of the statistics)", flush=True)
    for name in names:
        if name.startswith("rm:"):
            models.check_reward_model(name[3:])
        elif name.startswith(("http://", "https://")):
            check_url(name)
        else:
            resolve_reward(name, data)


class RewardLengthError(console.UserError, ValueError):
    """A reward function returned more or fewer rewards than completions: a bug in it, raised at the step it happens
    by the ranks that called it (one message each, no traceback)."""
    one_rank = True


class NonFiniteReward(ValueError):
    """A reward function returned NaN or inf for a sample: that sample gets None, counted as failed."""


def call_reward(fn, prompts, completions, columns, name="reward"):
    """Run one reward function (sync or async) -> (rewards, n_failed, first error). A batch that raises is retried
    sample by sample so that only the failing samples become None; a NaN/inf reward becomes None too (counted as
    failed; reported as a NonFiniteReward when nothing raised); a result of the wrong length raises
    RewardLengthError naming the function and both lengths."""
    def run(p, c, cols):
        out = fn(p, c, **cols)
        out = list(asyncio.run(out) if inspect.isawaitable(out) else out)
        if len(out) != len(c):
            raise RewardLengthError(f"reward function {name!r} returned {len(out)} rewards for {len(c)} completions: "
                                    "it must return one per completion (None where it does not apply).")
        return [None if r is None else float(r) for r in out]
    failed, first = 0, None
    try:
        out = run(prompts, completions, columns)
    except RewardLengthError:
        raise
    except RewardBatchFailed as e:  # failed at its source (e.g. a server): sample-by-sample retries cannot help
        return [None] * len(completions), len(completions), e
    except Exception:  # noqa: BLE001 - reward code is user code: report it, never crash the step
        out = []
        for i in range(len(completions)):
            try:
                out += run(prompts[i:i + 1], completions[i:i + 1], {k: v[i:i + 1] for k, v in columns.items()})
            except RewardLengthError:
                raise
            except Exception as e:  # noqa: BLE001
                out.append(None)
                failed, first = failed + 1, first or e
                if isinstance(e, RewardBatchFailed):  # e.g. past --data.reward-timeout-s: the rest would be too
                    out += [None] * (len(completions) - len(out))
                    failed += len(completions) - i - 1
                    break
    bad = [r for r in out if r is not None and not math.isfinite(r)]
    if bad and first is None:
        first = NonFiniteReward(f"returned {bad[0]} for a sample")
    return [None if r is None or not math.isfinite(r) else r for r in out], failed + len(bad), first


def take_rm_truncated(reward_fns):
    """Texts the reward models (rm:PATH) cut to their context since the last call: read and reset (reward/rm_truncated)."""
    return sum(fn.__dict__.pop("truncated", 0) for name, fn in reward_fns if name.startswith("rm:"))


def score_rewards(reward_fns, rows, completions, completion_ids, printed):
    """[(name, fn)] on one row per completion -> rewards [N, K] (NaN where a function returned None, NaN/inf or
    raised), failures per function (NaN/inf and raised). Functions get the rows' other columns plus completion_ids. Each function's first
    traceback is printed once (names already in `printed` stay quiet)."""
    columns = {k: [r.get(k) for r in rows] for k in (rows[0] if rows else {}) if k not in ("prompt", "image")}
    columns["completion_ids"] = completion_ids
    prompts = [r["prompt"] for r in rows]
    cols, failed = [], []
    for name, fn in reward_fns:
        r, n_failed, err = call_reward(fn, prompts, completions, columns, name)
        key = f"{name} (NaN/inf)" if isinstance(err, NonFiniteReward) else name
        if err is not None and key not in printed:  # first traceback (and first NaN/inf) of each function, once
            printed.add(key)
            what = (f"{err}: NaN/inf rewards become None, counted in reward/failed" if key != name
                    else "raised (its samples get reward None):\n" + "".join(traceback.format_exception(err)))
            print(f"[rank {os.environ.get('RANK', '0')}] reward function {name!r} {what}",
                  file=sys.stderr, flush=True)
        cols.append([float("nan") if x is None else x for x in r])
        failed.append(n_failed)
    return torch.tensor(cols, dtype=torch.float32).T, failed  # [N, K]
