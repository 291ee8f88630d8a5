"""scoring.py: reward functions: the built-in ones, what --data.rewards names (a built-in, package.module:function,
rm:PATH, http://...), and calling them so that a failure is contained: a raise, a NaN or a hang costs its samples
their reward (None, counted in reward/failed), never the run.

Every reward function has one signature, sync or async:
    fn(prompts: list, completions: list[str], **columns) -> list[float | None]
`columns` holds the dataset's other columns (one list per column, aligned with completions) plus `completion_ids`.
None means "does not apply to this sample" (it becomes NaN and is left out of the statistics).
Besides Python functions, `rm:PATH` names a reward model, `http://HOST:PORT/PATH` a reward server (external_rewards.py).
"""
import ast
import asyncio
import functools
import inspect
import math
import operator
import os
import re
import sys
import traceback

import torch

import answers
import console
import models
import user_code
from external_rewards import RewardBatchFailed, http_reward, reward_model_reward
from tasks import DataConfig, wraps_text_prompts


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
            ok = used == sorted(nums) and abs(_safe_eval(ast.parse(eq, mode="eval").body) - tgt) < 1e-6
        except (ValueError, SyntaxError, ZeroDivisionError):
            ok = False
        out.append(float(ok))
    return out


def env_reward(prompts, completions, env_reward=None, **_):
    """--env: the episode's reward from the environment (the sum of what step() returned); None where it gave none."""
    return [None if r is None else float(r) for r in (env_reward or [None] * len(completions))]


def max_digit_reward(prompts, completions, answer=None, **_):
    """1 - |d - answer| / 9 for the completion's first character d when it is a digit, else 0 (dense, in [0, 1])."""
    stripped = (c.lstrip(" ") for c in completions)
    return [1.0 - abs(int(s[0]) - int(a)) / 9.0 if s[:1].isdigit() else 0.0 for s, a in zip(stripped, answer)]


def digit_reward(prompts, completions, answer=None, **_):
    """1.0 when the completion's first character (after spaces) is the answer, else 0. No credit for a wrong digit: with
    it (0.1) the default run settled on one constant digit before it learned to read the prompt (docs, quickstart)."""
    return [float(c.lstrip(" ")[:1] == str(a)) for c, a in zip(completions, answer)]


def overlong_penalty(max_completion_length, cache):
    """DAPO soft overlong punishment (arXiv 2503.14476, eq. 13): 0 up to L_max - L_cache, then linear to -1."""
    soft = max_completion_length - cache  # the penalty starts past this length

    def overlong_reward(prompts, completions, completion_ids=None, **_):
        return [0.0 if len(ids) <= soft else (soft - len(ids)) / cache if len(ids) <= max_completion_length else -1.0
                for ids in completion_ids]
    return overlong_reward


REWARDS = {"accuracy": accuracy_reward, "format": format_reward, "countdown": countdown_reward,
           "max_digit": max_digit_reward, "digit": digit_reward, "final_number": final_number_reward, "env": env_reward}
DEFAULT_REWARDS = {"find_digit": ["digit"], "max_digit": ["max_digit"], "arith": ["accuracy", "format"],
                   "countdown": ["countdown", "format"], "small_arith": ["final_number"], "calculator": ["final_number"]}


def eval_check(cfg, reward_fns):
    """The held-out check -> (name, reward function): --eval.reward's, a built-in task's own, else the first reward's
    (not math-verify's whatever the task: a task whose answers are not numbers has its own check)."""
    if cfg.eval.reward:
        return cfg.eval.reward, dict(reward_fns)[cfg.eval.reward]
    if cfg.dataset in DEFAULT_REWARDS:
        return DEFAULT_REWARDS[cfg.dataset][0], resolve_reward(DEFAULT_REWARDS[cfg.dataset][0])
    return reward_fns[0]


def best_constant_accuracy(rows, check):
    """The held-out accuracy of the best fixed completion, the same text for every prompt: what a policy that ignores
    its prompt can reach. A fixed text is right only on rows whose answer it gives, so trying each distinct gold answer
    as every row's completion finds the best one exactly. None without gold answers."""
    golds = sorted({str(r["answer"]) for r in rows if r.get("answer") is not None})
    prompts = [r.get("prompt") for r in rows]
    columns = {k: [r.get(k) for r in rows] for k in (rows or [{}])[0] if k != "prompt"}
    right = [sum((x or 0.0) >= 1.0 - 1e-6 for x in check(prompts, [g] * len(rows), **columns)) for g in golds]
    return max(right) / len(rows) if right else None


def resolve_reward(name, data=None, *, max_completion_length=256, device="cpu", processor=None):
    """A REWARDS name | 'overlong' | 'package.module:function' | 'rm:PATH' | 'http(s)://HOST:PORT/PATH' -> a reward
    function; `data` (DataConfig) holds the options of the last four; `processor`, the policy's, decides (as
    encode_prompt) whether rm: sees text prompts as a user turn."""
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
        return user_code.within(lambda: run(prompts, completions, **columns), timeout_s, late)
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
        else:  # (an http:// reward resolves to its URL check and a closure: nothing calls out)
            resolve_reward(name, data)


class RewardLengthError(console.UserError, ValueError):
    """A reward function returned more or fewer rewards than completions: a bug in it, raised at the step it happens
    by the ranks that called it (one message each, no traceback)."""
    one_rank = True


class NonFiniteReward(ValueError):
    """A reward function returned NaN or inf for a sample: that sample gets None, counted as failed."""


def call_reward(fn, prompts, completions, columns, name="reward"):
    """Run one reward function (sync or async) -> (rewards, n_failed, first error). A batch that raises is retried
    sample by sample so that only the failing samples become None; a NaN/inf reward becomes None too (counted as failed;
    a NonFiniteReward when nothing raised); a wrong-length result raises RewardLengthError (with both lengths)."""
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
    raised), failures per function (NaN/inf and raised). Functions get the rows' other columns plus completion_ids.
    Each function's first traceback is printed once (names already in `printed` stay quiet)."""
    columns = {k: [r.get(k) for r in rows] for k in (rows[0] if rows else {}) if k not in ("prompt", "image")}
    columns["completion_ids"] = completion_ids
    prompts = [r.get("prompt") for r in rows]  # (None: an environment's row whose reset failed)
    cols, failed = [], []
    for name, fn in reward_fns:
        r, n_failed, err = call_reward(fn, prompts, completions, columns, name)
        key = f"{name} (NaN/inf)" if isinstance(err, NonFiniteReward) else name
        if err is not None and key not in printed:  # first traceback (and first NaN/inf) of each function, once
            printed.add(key)
            what = (f"{err}: NaN/inf rewards become None, counted in reward/failed" if key != name
                    else "raised (its samples get reward None):\n" + "".join(traceback.format_exception(err)))
            print(f"[rank {os.environ.get('GLOBAL_RANK', os.environ.get('RANK', '0'))}] reward function {name!r} {what}",
                  file=sys.stderr, flush=True)
        cols.append([float("nan") if x is None else x for x in r])
        failed.append(n_failed)
    return torch.tensor(cols, dtype=torch.float32).T, failed  # [N, K]
