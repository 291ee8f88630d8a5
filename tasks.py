"""tasks.py: datasets and prompts: the built-in offline tasks, local and hub datasets, the ptx texts, and how a
row's prompt becomes the ids the engine and the trainer see. Reward functions: scoring.py.

A dataset is a list of rows {"prompt": str | list[chat message], "answer": ..., "image": PIL.Image?, ...}:
a built-in offline task name, a local .jsonl / .parquet file, or a Hugging Face hub dataset ("name" or "name:config").
"""
import functools
import io
import json
import os
import random
import re
from dataclasses import dataclass


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
    """package.module:function rewards, --data.tools and --env (a verifiers taskset: its loading): the longest the
    import of their module may take at start-up; a module that hangs at import stops the run with a message naming it
    (0 = no limit)."""


# ---- Built-in offline tasks ----

def max_digit_task(n, seed):
    """'max 3 8 1 =' -> '8' (the earlier default run: its tiny policy learned the best constant answer, 7, not max)."""
    rng = random.Random(seed)
    picks = [[rng.randrange(10) for _ in range(rng.randint(2, 4))] for _ in range(n)]
    return [{"prompt": "max " + " ".join(map(str, d)) + " =", "answer": str(max(d))} for d in picks]


def arith_task(n, seed, hi=99):
    """Small integer arithmetic (operands 1..hi, + - *) as chat messages, numeric answer (GSM8K-style exact match)."""
    rng = random.Random(seed)
    picks = [(rng.randint(1, hi), rng.randint(1, hi), rng.choice("+-*")) for _ in range(n)]
    return [{"prompt": [{"role": "user", "content": f"What is {a} {op} {b}? Put the answer in \\boxed{{}}."}],
             "answer": str({"+": a + b, "-": a - b, "*": a * b}[op])} for a, b, op in picks]


def countdown_task(n, seed):
    """Countdown: combine the numbers with + - * / to reach the target (TinyZero-style prompts)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        nums = [rng.randint(1, 20) for _ in range(rng.randint(3, 4))]
        target = eval(functools.reduce(lambda expr, x: f"({expr} {rng.choice('+-*')} {x})", nums[1:], str(nums[0])))
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
    picks = [(rng.randint(10_000, 999_999), rng.randint(100, 9_999)) for _ in range(n)]
    return [{"prompt": [{"role": "user", "content": f"What is {a} * {b}? Use the multiply tool, then give the exact "
                         "product as the final number."}], "answer": str(a * b)} for a, b in picks]


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


# small_arith: arith with operands 1..20, which SmolLM2-135M-Instruct partly solves (measured: 21 of 64 held-out prompts
# right greedily; arith's 1..99 under a tenth), so groups hold right and wrong answers (docs/benchmarks.md, "A real
# model"). Only 1200 distinct prompts: load_rows drops the held-out ones from train.
BUILTIN_TASKS = {"find_digit": find_digit_task, "max_digit": max_digit_task, "arith": arith_task,
                 "small_arith": functools.partial(arith_task, hi=20), "countdown": countdown_task,
                 "calculator": calculator_task}
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


def python_rows(name, flag, timeout_s=0):
    """package.module:function -> [(where, row)]: what it returns (a list of dicts or a datasets.Dataset), imported
    and called under the rewards' rule (user_code.resolve, each call within timeout_s). Called twice: rows that differ
    between calls would differ between ranks too, so they are refused (seed the generator)."""
    import user_code
    make = user_code.resolve(name, flag, timeout_s)
    late = ValueError(f"{flag} {name!r} did not return within {timeout_s:g} s (--data.import-timeout-s).")
    try:
        rows, again = (list(user_code.within(make, timeout_s, late)) for _ in range(2))
    except Exception as e:
        raise (e if e is late else ValueError(f"{flag} {name!r} raised {type(e).__name__}: {e}")) from None
    if bad := [type(r).__name__ for r in rows if not isinstance(r, dict)][:1]:
        raise ValueError(f"{flag} {name!r} returned a {bad[0]} row: return a list of dicts or a datasets.Dataset.")
    if not same(rows, again):
        raise ValueError(f"{flag} {name!r} returns other rows on each call, so every rank would train on its own: seed "
                         "its random generator (e.g. random.Random(0)).")
    return [(f"row {i}", r) for i, r in enumerate(rows, 1)]


def same(a, b):
    """a == b, where NaN equals NaN (a missing value in pandas' records is NaN on every call)."""
    if isinstance(a, (dict, list, tuple)) and type(a) is type(b):
        keys = a.keys() if isinstance(a, dict) else range(len(a))
        return len(a) == len(b) and (not isinstance(a, dict) or a.keys() == b.keys()) and all(
            same(a[k], b[k]) for k in keys)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    try:
        return bool(a == b)
    except (ValueError, TypeError):  # (arrays: compared element-wise)
        return False


def is_python_source(name):
    """--dataset pkg.module:function rather than a hub dataset's name[:config]: a dotted module (a hub name without
    an owner/ has no dot), or an importable one."""
    import importlib.util
    module, _, attr = name.partition(":")
    if not attr or "/" in module or "." in module:
        return bool(attr) and "/" not in module
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that does not import, or an empty name
        return False


def load_dataset_rows(name, *, split="train", prompt_column="prompt", answer_column="answer", size=2000, seed=0,
                      flags=("--dataset", "--data.prompt-column"), timeout_s=0, need_prompt=True):
    """-> rows with a 'prompt' key (need_prompt False: maybe not, an environment's reset writes it) and 'answer' when
    answer_column exists. Raises one clear error naming `flags` (the dataset's and the prompt column's) and the row."""
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name](size, seed if split == "train" else seed + 10_000)
    flag, column_flag = flags
    if name.endswith((".jsonl", ".json", ".parquet")):
        rows = read_rows(name, flag)
    elif is_python_source(name):
        rows = python_rows(name, flag, timeout_s)
    else:
        import datasets
        hub_name, _, config = name.partition(":")
        try:
            ds = datasets.load_dataset(hub_name, config or None, split=split)
        except Exception as e:
            if not (config.isidentifier() and hub_name.isidentifier()):  # (else: not a module:function)
                raise
            raise ValueError(f"{flag} {name!r}: no module {hub_name!r} can be imported, and no hub dataset "
                             f"{hub_name!r} (config {config!r}) loads ({type(e).__name__}). A dataset from Python must "
                             "be importable: put it in the repo root (next to grpo.py) or on PYTHONPATH.") from None
        rows = [(f"row {i}", r) for i, r in enumerate(ds, 1)]
    if not rows:
        raise ValueError(f"{flag} {name!r} is empty (no rows{'' if os.path.isfile(name) else f' in split {split!r}'}): "
                         "pass a dataset with at least one prompt.")
    if need_prompt and prompt_column not in rows[0][1]:
        raise ValueError(f"{flag} {name!r} has no column {prompt_column!r} (columns: {sorted(rows[0][1])}): pass "
                         f"{column_flag} NAME with the column to read.")
    if missing := [where for where, r in rows if r.get(prompt_column) is None and need_prompt]:
        raise ValueError(f"{flag} {name!r} {missing[0]} has no {prompt_column!r} ({column_flag}) value"
                         f"{f' ({len(missing)} rows lack one)' if len(missing) > 1 else ''}: every row needs a prompt. "
                         "Fill it in or drop the row.")
    out = []
    for _, r in rows:
        r = dict(r)
        if (prompt := r.pop(prompt_column, None)) is not None:
            r["prompt"] = prompt
        if answer_column in r and answer_column != "answer":
            r["answer"] = r.pop(answer_column)
        if "images" in r and "image" not in r:
            imgs = r.pop("images")
            r["image"] = imgs[0] if isinstance(imgs, list) and imgs else imgs
        image = r.get("image")
        if isinstance(image, str) or (isinstance(image, dict) and image.get("bytes")):
            from PIL import Image
            base = os.path.dirname(name) if os.path.isfile(name) else ""
            r["image"] = Image.open(os.path.join(base, image) if isinstance(image, str)  # a path, relative to the file
                                    else io.BytesIO(image["bytes"])).convert("RGB")  # parquet / hub image struct
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
    """Does a plain-text prompt go in as a user turn of the chat template (--data.chat-template, and a template)?"""
    tok = getattr(processor, "tokenizer", processor)
    return bool(chat_template and (getattr(processor, "chat_template", None) or getattr(tok, "chat_template", None)))


def encode_prompt(row, processor, max_prompt_length, chat_template=True, system_prompt=None, tools=None):
    """Row -> {prompt_ids (the last max_prompt_length; None: all), engine prompt, text, (mm tensors)}. Chat messages
    (and, with chat_template, plain-text prompts wrapped as a user message) go through the tokenizer's chat template
    when it has one, with `tools` (functions; the template gets their JSON schema)."""
    tok = getattr(processor, "tokenizer", processor)
    prompt, image = row.get("prompt"), row.get("image")
    if prompt is None:  # an environment's row without a prompt: its reset writes it (episodes.start_envs)
        return {"prompt_ids": [], "text": "", "engine": {"prompt_token_ids": []}}
    if isinstance(prompt, str) and wraps_text_prompts(processor, chat_template):
        prompt = [{"role": "user", "content": prompt}]
    text = prompt
    if isinstance(prompt, list):
        if system_prompt and prompt[0]["role"] != "system":
            prompt = [{"role": "system", "content": system_prompt}] + prompt
        if image is not None and not any(isinstance(m.get("content"), list) for m in prompt):
            first_user = next(i for i, m in enumerate(prompt) if m["role"] == "user")
            prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": m["content"]}]}
                      if i == first_user else m for i, m in enumerate(prompt)]
        text = processor.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True)
    if image is not None:
        enc = processor(text=[text], images=[image], return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        mm = {k: v for k, v in enc.items() if k in ("pixel_values", "image_grid_thw")}
        engine = {"prompt": text, "multi_modal_data": {"image": image}, "prompt_token_ids": ids, "hf_inputs": mm}
        return {"prompt_ids": ids, "text": text, "mm": mm, "engine": engine}
    ids = tok(text, add_special_tokens=False)["input_ids"]
    max_prompt_length = max_prompt_length or len(ids)  # (None: not cut)
    if len(ids) > max_prompt_length and not _cut_said:  # (each rank encodes its own share: said where it happens)
        _cut_said.append(True)  # (a dataset's or an environment's prompt: its start, chat header included, is lost)
        rank = os.environ.get("GLOBAL_RANK", os.environ.get("RANK", "0"))  # an inference rank: its world rank
        print(f"[rank {rank}] note: a prompt of {len(ids)} tokens is cut to its last {max_prompt_length} (--rollout."
              "max-prompt-length; raise it to keep whole prompts). Said once per rank.", flush=True)
    ids = ids[-max_prompt_length:]  # left truncation
    return {"prompt_ids": ids, "text": text, "engine": {"prompt_token_ids": ids}}


_cut_said = []  # encode_prompt's note on a cut prompt, printed once per process
