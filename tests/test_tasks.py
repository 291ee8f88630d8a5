"""tasks.py: datasets and reward functions."""
import asyncio
import json
import re
import threading
import time

import pytest

import answers
import scoring
import tasks


@pytest.mark.parametrize("completion,answer,expected", [
    ("The answer is 1,234 apples.", "#### 1234", 1.0),
    ("so we get \\boxed{42}", "42", 1.0),
    ("x = 3.50 dollars", "3.5", 1.0),
    ("first 7 then #### 8", "Natalia sold 48/2 = 24 clips ... #### 8", 1.0),
    ("it is 41", "42", 0.0),
    ("no number here", "42", 0.0),
    ("\\boxed{-5}", "-5", 1.0),
])
def test_accuracy_reward(completion, answer, expected):
    assert scoring.accuracy_reward(["p"], [completion], answer=[answer]) == [expected]


def test_accuracy_reward_without_answers_does_not_apply():
    assert scoring.accuracy_reward(["p"], ["4"], answer=["no digits"]) == [None]
    assert scoring.accuracy_reward(["p", "q"], ["4", "5"]) == [None, None]
    assert scoring.accuracy_reward(["p"], ["\\boxed{4}"], answer=[""]) == [None]


# Expected values written from what the strings mean: is the completion's final answer the gold number?
ANSWER_FORMATS = [
    ("19", "The answer is \\boxed{19}.", 1.0),
    ("19", "\\boxed{18}", 0.0),
    ("19", "19.0", 1.0),
    ("19", "$\\frac{38}{2}$", 1.0),
    ("0.5", "1/2", 1.0),
    ("0.5", "$\\frac{1}{2}$", 1.0),
    ("0.5", "\\boxed{\\dfrac{1}{2}}", 1.0),
    ("2", "\\boxed{\\frac{1}{2}}", 0.0),  # a half, not two (the last digit is a 2)
    ("2", "\\boxed{19/2}", 0.0),
    ("19", "x = 19", 1.0),
    ("19", "19 apples", 1.0),
    ("19", "\\boxed{19 \\text{ apples}}", 1.0),
    ("1234", "The total is $1,234.", 1.0),
    ("-3", "\\boxed{-3}", 1.0),
    ("-3", "The answer is -3.", 1.0),
    ("-3", "3", 0.0),
    ("3", "\\boxed{-3}", 0.0),
    ("18", "First I thought 19, but the answer is 18.", 1.0),  # the final answer counts
    ("19", "First I thought 19, but the answer is 18.", 0.0),
    ("19", "The answer is 19, not 18.", 1.0),
    ("19", "(19)", 1.0),  # math-verify reads nothing here: the plain-number fallback does
    ("12", "3 * 4", 0.0),  # the question restated is not an answer (math-verify alone would compute it: 1.0)
    ("18", "8 + 10 \\boxed{}.", 0.0),
    ("7", "12 - 5", 0.0),
    ("12", "3 \\times 4", 0.0),
    ("12", "3 * 4 = 12", 1.0),
    ("12", "3 * 4 = \\boxed{12}", 1.0),
    ("Natalia sold 48/2 = 24 clips in May, 48 + 24 = 72 in all. #### 72", "She sold \\boxed{72} clips.", 1.0),
    ("Natalia sold 48/2 = 24 clips in May, 48 + 24 = 72 in all. #### 72", "She sold \\boxed{24} clips.", 0.0),
    ("19", "I have no idea.", 0.0),
    ("19", "asdf }{ \\\\ $$ \\frac{", 0.0),
    ("19", "", 0.0),
    # LaTeX gold answers (MATH-style): compared as math, not as their last digit
    ("2\\sqrt{3}", "so \\boxed{2\\sqrt{3}}", 1.0),
    ("(2,-3)", "\\boxed{(2,-3)}", 1.0),
    ("(2,-3)", "\\boxed{(9,-3)}", 0.0),  # same last number, another point
    ("3 - 2\\sqrt{2}", "\\boxed{7 - 4\\sqrt{2}}", 0.0),
    ("3 - 2\\sqrt{2}", "\\boxed{3 - 2\\sqrt{2}}", 1.0),
    ("\\pi", "the answer is \\boxed{\\pi}", 1.0),
    ("\\frac{3}{4}", "\\boxed{0.75}", 1.0),
    ("2000", "\\boxed{2 \\times 10^3}", 1.0),  # scientific notation is a value, not a restated product
    ("1,000", "The answer is 1000.", 1.0),
]


@pytest.mark.parametrize("answer,completion,expected", ANSWER_FORMATS)
def test_accuracy_reward_answer_formats(answer, completion, expected):
    assert scoring.accuracy_reward(["p"], [completion], answer=[answer]) == [expected]


def test_accuracy_reward_off_the_main_thread():
    # math-verify's timeouts use SIGALRM (main thread only): in a thread they are off, the verdicts the same
    got = []
    t = threading.Thread(target=lambda: got.append(scoring.accuracy_reward(
        [""] * len(ANSWER_FORMATS), [c for _, c, _ in ANSWER_FORMATS], answer=[a for a, _, _ in ANSWER_FORMATS])))
    t.start()
    t.join()
    assert got == [[e for _, _, e in ANSWER_FORMATS]]


def test_accuracy_reward_times_out_on_the_main_thread():
    t0 = time.time()  # sympy would compare these towers for a very long time
    assert scoring.accuracy_reward([""], ["$2^{2^{2^{100}}} - 7^{7^{7^7}}$"], answer=["19"]) == [0.0]
    assert time.time() - t0 < 30


def test_accuracy_reward_falls_back_when_math_verify_fails(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("math-verify broke")
    import math_verify
    monkeypatch.setattr(math_verify, "parse", broken)  # (answers imports it on first use)
    r = scoring.accuracy_reward([""] * 4, ["The answer is 1,234.", "\\boxed{-5}", "it is 41", ""],
                              answer=["1234", "-5", "42", "42"])
    assert r == [1.0, 1.0, 0.0, 0.0]


def test_accuracy_reward_unchanged_for_plain_arith_formats():
    # reference: each completion states x as its final answer, so it is right exactly when x is the gold answer
    for row in tasks.load_dataset_rows("arith", size=40, seed=3):
        for x in (int(row["answer"]), int(row["answer"]) + 1):
            for c in (f"{x}", f"The answer is {x}.", f"\\boxed{{{x}}}", f"#### {x}", f"{x} apples", f"= {x:,}",
                      f"3 + 4 = 7, so {x}"):
                ref = float(x == int(row["answer"]))
                assert scoring.accuracy_reward([""], [c], answer=[row["answer"]]) == [ref], (c, row["answer"])


def test_format_countdown_maxdigit_overlong():
    assert scoring.format_reward([""] * 3, ["\\boxed{3}", "#### 12", "just text"]) == [1.0, 1.0, 0.0]
    r = scoring.countdown_reward([""] * 4, ["<answer>(3 + 5) * 2</answer>", "<answer>3 + 5 + 2</answer>",
                                          "<answer>(3 + 5) * 2 * 2</answer>", "<answer>__import__('os')</answer>"],
                               numbers=[[3, 5, 2]] * 4, target=[16] * 4)
    assert r == [1.0, 0.0, 0.0, 0.0]
    assert scoring.max_digit_reward([""] * 3, ["8", " 5x", "a"], answer=["8", "8", "8"]) == [1.0, pytest.approx(1 - 3 / 9), 0.0]
    assert scoring.digit_reward([""] * 4, ["7", " 7x", "8", "a7"], answer=["7"] * 4) == [1.0, 1.0, 0.0, 0.0]
    f = scoring.overlong_penalty(10, 4)  # DAPO: 0 up to 6 tokens, then linear down to -1 at 10, -1 beyond
    assert f([""] * 4, [""] * 4, completion_ids=[[0] * 6, [0] * 8, [0] * 10, [0] * 11]) == [0.0, -0.5, -1.0, -1.0]


def test_call_reward_async_none_and_partial_failures():
    async def async_fn(prompts, completions, **_):
        await asyncio.sleep(0)
        return [len(c) for c in completions]
    assert scoring.call_reward(async_fn, ["a", "b"], ["xy", "z"], {}) == ([2.0, 1.0], 0, None)

    def fails_on_bad(prompts, completions, **_):
        if "bad" in completions:
            raise ValueError("boom")
        return [1.0 for _ in completions]
    rewards, failed, err = scoring.call_reward(fails_on_bad, ["p"] * 3, ["ok", "bad", "ok"], {})
    assert rewards == [1.0, None, 1.0] and failed == 1 and "boom" in str(err)


def test_resolve_reward_names():
    assert scoring.resolve_reward("accuracy") is scoring.accuracy_reward
    assert scoring.resolve_reward("scoring:format_reward") is scoring.format_reward  # no time limit by default
    limited = scoring.resolve_reward("scoring:format_reward", tasks.DataConfig(reward_timeout_s=5))
    assert limited.__wrapped__ is scoring.format_reward  # under --data.reward-timeout-s
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        scoring.resolve_reward("nope")


def test_local_datasets(tmp_path):
    rows = [{"question": "What is 2+2?", "solution": "#### 4"}, {"question": "3+3?", "solution": "#### 6"}]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows))
    got = tasks.load_dataset_rows(str(jl), prompt_column="question", answer_column="solution")
    assert got == [{"prompt": "What is 2+2?", "answer": "#### 4"}, {"prompt": "3+3?", "answer": "#### 6"}]
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert tasks.load_dataset_rows(str(tmp_path / "d.parquet"), prompt_column="question", answer_column="solution") == got
    with pytest.raises(ValueError, match=re.escape("has no column 'prompt' (columns: ['question', 'solution']): pass --data.prompt-column")):
        tasks.load_dataset_rows(str(jl))
    with pytest.raises(FileNotFoundError, match="no such file"):
        tasks.load_dataset_rows(str(tmp_path / "missing.jsonl"))


def test_dataset_errors_name_the_flag_and_the_line(tmp_path):
    """A bad file is one message naming the flag and the file's own line (json.loads of one line would say "line 1";
    of the file, "line 2" for line 8) or row, not a bare KeyError or "no prompt column" for an empty file."""
    good, bad = json.dumps({"prompt": "max 1 2 =", "answer": "2"}) + "\n", '{"prompt": "max 3 4 =", "answer": 4'
    files = {"malformed.jsonl": good * 7 + bad + "\n" + good,
             "row51.jsonl": good * 50 + json.dumps({"answer": "2"}) + "\n\n" + json.dumps({"prompt": None}) + "\n",
             "list.jsonl": good + "[1, 2]\n", "empty.jsonl": "\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"q": "a"}, {"q": None}]), tmp_path / "rows.parquet")
    cases = [("malformed.jsonl", {}, "--dataset '{}' line 8 is not valid JSON (Expecting ',' delimiter, column %d)" % (len(bad) + 1)),
             ("row51.jsonl", {}, "--dataset '{}' line 51 has no 'prompt' (--data.prompt-column) value (2 rows lack "
                                 "one): every row needs a prompt"),
             ("list.jsonl", {}, "--dataset '{}' line 2 is a JSON list, not an object"),
             ("empty.jsonl", {}, "--dataset '{}' is empty (no rows): pass a dataset with at least one prompt"),
             ("rows.parquet", dict(prompt_column="q", flags=("--ptx.dataset", "--ptx.column")),
              "--ptx.dataset '{}' row 2 has no 'q' (--ptx.column) value")]
    for name, kw, message in cases:
        path = str(tmp_path / name)
        with pytest.raises(ValueError) as e:
            tasks.load_dataset_rows(path, **kw)
        assert message.format(path) in str(e.value), (name, str(e.value))


def test_user_module_errors_name_the_flag_and_a_hang_is_bounded(tmp_path, monkeypatch):
    """package.module:function names (--data.rewards, --data.tools, --env): a module that cannot be imported, lacks the
    name, or hangs at import (bounded by --data.import-timeout-s) is one message naming the flag; a module that raises
    anything else at import is a bug in it and keeps its own exception (and traceback)."""
    import episodes
    import user_code
    (tmp_path / "hangs_at_import_t.py").write_text("import time\ntime.sleep(600)\n")
    (tmp_path / "needs_missing_dep.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "divides_by_zero.py").write_text("1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tasks.DataConfig(import_timeout_s=1.0)
    cases = {"no_such_module_xyz:f": "--data.rewards 'no_such_module_xyz:f': no module 'no_such_module_xyz' can be "
                                     "imported. It must be importable: put it in the repo root (next to grpo.py) or on "
                                     "PYTHONPATH",
             "needs_missing_dep:f": "module 'needs_missing_dep' imports 'no_such_dependency_xyz', which is not installed",
             "tasks:no_such_fn": "--data.rewards 'tasks:no_such_fn': module 'tasks' (",
             "justamodule": "--data.rewards: unknown reward 'justamodule'",
             "hangs_at_import_t:f": "--data.rewards 'hangs_at_import_t:f': importing module 'hangs_at_import_t' did not "
                                    "finish within 1 s (--data.import-timeout-s)"}
    for name, message in cases.items():
        t0 = time.time()
        with pytest.raises(ValueError) as e:
            scoring.resolve_reward(name, data)
        assert message in str(e.value) and time.time() - t0 < 10, (name, str(e.value))
    with pytest.raises(ValueError, match=r"^--env 'no_such_module_xyz:Env': no module"):
        user_code.resolve("no_such_module_xyz:Env", "--env", 1.0)
    with pytest.raises(ValueError, match=r"^--data.tools 'hangs_at_import_t:f': importing module"):
        episodes.load_tools(["hangs_at_import_t:f"], 0.5)
    with pytest.raises(ZeroDivisionError):  # not a user error: its traceback points into the module
        scoring.resolve_reward("divides_by_zero:f", data)


def test_builtin_tasks_are_deterministic_and_split():
    a, b = tasks.load_dataset_rows("max_digit", size=5, seed=1), tasks.load_dataset_rows("max_digit", size=5, seed=1)
    assert a == b and tasks.load_dataset_rows("max_digit", split="test", size=5, seed=1) != a
    for row in tasks.load_dataset_rows("countdown", size=20, seed=0):
        assert scoring.countdown_reward([""], [f"<answer>{row['target']}</answer>"], numbers=[row["numbers"]],
                                      target=[row["target"]]) == [0.0]  # the numbers must be used
    for row in tasks.load_dataset_rows("arith", size=20, seed=0):
        assert scoring.accuracy_reward([""], [f"\\boxed{{{row['answer']}}}"], answer=[row["answer"]]) == [1.0]


def test_score_rewards_matrix_nan_and_failures(capsys):
    def boom(prompts, completions, **_):
        raise KeyError("x")
    printed = set()
    r, failed = scoring.score_rewards([("len", lambda p, c, **_: [len(x) for x in c]), ("boom", boom)],
                                    [{"prompt": "p"}, {"prompt": "q"}], ["ab", "c"], [[1], [2]], printed)
    assert r.shape == (2, 2) and r[:, 0].tolist() == [2.0, 1.0] and r[:, 1].isnan().all()
    assert failed == [0, 2] and printed == {"boom"}
    scoring.score_rewards([("boom", boom)], [{"prompt": "p"}], ["a"], [[1]], printed)
    assert capsys.readouterr().err.count("reward function 'boom' raised") == 1  # printed once


def test_small_arith_answers_and_range():
    """small_arith: each answer recomputed from the prompt text by Python's own int arithmetic (not the task's code)."""
    import operator
    import re
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    rows = tasks.load_dataset_rows("small_arith", size=600, seed=1)
    seen_ops = set()
    for row in rows:
        m = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\? Put the answer in \\boxed\{\}\.", row["prompt"][0]["content"])
        a, op, b = int(m[1]), m[2], int(m[3])
        assert 1 <= a <= 20 and 1 <= b <= 20 and row["answer"] == str(ops[op](a, b))
        assert scoring.accuracy_reward([""], [f"\\boxed{{{ops[op](a, b)}}}"], answer=[row["answer"]]) == [1.0]
        seen_ops.add(op)
    assert seen_ops == set(ops)
    assert tasks.load_dataset_rows("small_arith", size=600, seed=1) == rows  # reproducible from the seed


def test_final_number_reward_does_not_credit_an_echo_of_the_question():
    """math-verify evaluates a restated expression ('3 * 4' -> 12), so `accuracy` credits an echo of the question;
    final_number (small_arith's default) wants the answer itself as the last number. Reference: Python's int
    arithmetic on the operands, and the echo the trained SmolLM2 produced."""
    answer = [str(3 * 4)] * 5
    completions = ["3 * 4", "3 * 4 = 12", "\\boxed{12}", "It is 12, not 4.", "3 * 4 = 12. Check: 12 / 3 = 4"]
    assert scoring.final_number_reward([""] * 5, completions, answer=answer) == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert scoring.accuracy_reward([""] * 5, completions, answer=answer) == [0.0, 1.0, 1.0, 0.0, 0.0]  # closed there too
    assert scoring.final_number_reward([""] * 2, ["19 - 19", "19 - 19 = 0"], answer=["0", "0"]) == [0.0, 1.0]
    assert scoring.final_number_reward([""], ["7"], answer=None) == [None]
    assert scoring.DEFAULT_REWARDS["small_arith"] == ["final_number"]


def test_final_number_reads_gold_answers_as_datasets_write_them(capsys):
    """Gold answers as GSM8K and MATH write them (#### 72, \\boxed{}, \\frac, mixed numbers, $, %, LaTeX thousands
    separators) are read like completions; expected values worked out by hand (exact Fractions). A gold that is no
    single number gives its row None (NaN, left out of the statistics), not an exception; a division left undone
    ('24/2', an echo of the question) is no number; the start-up check refuses a dataset whose golds are all
    unreadable and says how many are."""
    from fractions import Fraction as F
    table = [  # gold, its value, a completion that states it, one that does not
        ("She sold 48 + 24 = 72 clips.\n#### 72", F(72), "so 72", "#### 48"),
        ("\\boxed{\\frac{1}{2}}", F(1, 2), "The answer is 1/2.", "The answer is 2."),
        ("2\\frac{1}{2}", F(5, 2), "\\boxed{2.5}", "\\boxed{10.5}"),
        ("#### 6\\frac{1}{4}", F(25, 4), "\\boxed{\\dfrac{25}{4}}", "\\boxed{15.25}"),
        ("3/4", F(3, 4), "\\boxed{\\tfrac34}", "\\boxed{4}"),
        ("-\\frac{1}{2}", F(-1, 2), "\\frac{1}{-2}", "-\\frac{-1}{2}"),
        ("10,\\!000", F(10000), "\\boxed{10{,}000}", "1"),
        ("\\$18.90", F(1890, 100), "It costs $18.90.", "18"),
        ("18\\%", F(18), "\\boxed{18\\%}", "\\boxed{0.18}"),
        (".5", F(1, 2), "\\boxed{x = 0.5}", "5"),
        ("12", F(12), "\\boxed{12}", "\\boxed{24/2}"),  # 24/2 is the question's division, not an answer
        ("4", F(4), "\\boxed{4}", "\\boxed{2^{2}}"),  # an exponent to evaluate: no number
    ]
    for gold, value, right, wrong in table:
        assert answers.gold_number(gold) == float(value), gold
        assert scoring.final_number_reward([""] * 2, [right, wrong], answer=[gold] * 2) == [1.0, 0.0], (gold, right, wrong)
    for gold in ("x^2 + 1", "\\frac{\\sqrt{2}}{2}", "(2, -3)", "1/0", "\\frac{3}{0}", "24/2", None):
        assert answers.gold_number(gold) is None, gold
    gold = [g for g, *_ in table] + ["x^2 + 1"]
    rewards, failed = scoring.score_rewards([("final_number", scoring.final_number_reward)],
                                          [{"prompt": "", "answer": g} for g in gold], [r for _, _, r, _ in table] + ["1"],
                                          [[]] * len(gold), set())
    assert failed == [0] and rewards[:-1, 0].tolist() == [1.0] * len(table) and rewards[-1, 0].isnan()
    scoring.check_rewards(["final_number"], tasks.DataConfig(), [{"answer": g} for g in gold])
    assert f"final_number: 1 of {len(gold)} gold answers are not a single number (e.g. 'x^2 + 1')" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no gold answer is a single number"):
        scoring.check_rewards(["final_number"], tasks.DataConfig(), [{"answer": "x^2 + 1"}, {"answer": "(1, 2)"}])
    scoring.check_rewards(["accuracy"], tasks.DataConfig(), [{"answer": "x^2 + 1"}])  # math-verify reads those


@pytest.mark.parametrize("dataset, alphabet, length, n", [("max_digit", "0123456789 a", 2, 64),
                                                          ("find_digit", "0123456789 a", 2, 64)])
def test_best_constant_accuracy_against_enumerating_every_completion(dataset, alphabet, length, n):
    """The best constant answer's held-out accuracy (scoring.best_constant_accuracy tries only the gold answers) equals
    the best over every completion of up to `length` characters of `alphabet`, each scored by the task's own check on
    every held-out row (float64 counts), and the share of the most common gold answer."""
    import collections
    import itertools
    rows = tasks.load_dataset_rows(dataset, split="test", size=n, seed=3)
    check = scoring.resolve_reward(scoring.DEFAULT_REWARDS[dataset][0])  # the task's own check
    prompts, golds = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    texts = ["".join(t) for k in range(1, length + 1) for t in itertools.product(alphabet, repeat=k)]
    brute = max(sum(x >= 1.0 - 1e-6 for x in check(prompts, [t] * n, answer=golds)) / float(n) for t in texts)
    assert scoring.best_constant_accuracy(rows, check) == brute
    assert brute == collections.Counter(golds).most_common(1)[0][1] / float(n)


def test_best_constant_accuracy_reads_answers_as_the_check_does():
    """`accuracy` (math-verify, then the number reader) on a file's rows: '#### 7' and '7' are one answer, so the best
    constant is right on 3 of 6 rows, where the most common gold string ('7') counts 2; checked by enumerating numbers."""
    rows = [{"prompt": "p", "answer": a} for a in ("1,000", "1000", "7", "#### 7", "7", "3")]
    golds = [r["answer"] for r in rows]
    brute = max(sum(x == 1.0 for x in scoring.accuracy_reward(None, [t] * 6, answer=golds))
                for t in [str(k) for k in range(0, 12)] + ["1000", "1,000"]) / 6.0
    assert scoring.best_constant_accuracy(rows, scoring.accuracy_reward) == brute == 3 / 6
    assert scoring.best_constant_accuracy([{"prompt": "p"}], scoring.countdown_reward) is None  # no golds


def test_a_cut_prompt_is_said_once(capsys, monkeypatch):
    """A prompt longer than --rollout.max-prompt-length keeps its last tokens (left truncation), and the run says so
    once (a dataset's or an environment's long prompt lost its start silently before)."""
    from tiny_models import _bpe_tokenizer
    tok = _bpe_tokenizer("the quick brown fox jumps over the lazy dog", ["<|endoftext|>", "<|im_end|>"])
    monkeypatch.setattr(tasks, "_cut_said", [])
    text = "jumps over the lazy dog the quick brown fox"
    whole = tok(text, add_special_tokens=False)["input_ids"]
    assert len(whole) > 3
    assert tasks.encode_prompt({"prompt": text}, tok, 3, chat_template=False)["prompt_ids"] == whole[-3:]
    tasks.encode_prompt({"prompt": text + " dog"}, tok, 3, chat_template=False)
    assert tasks.encode_prompt({"prompt": "fox"}, tok, 3, chat_template=False)["prompt_ids"] == tok("fox")["input_ids"]
    out = capsys.readouterr().out
    assert out.count("--rollout.max-prompt-length") == 1 and f"a prompt of {len(whole)} tokens" in out, out


def test_a_cut_prompt_is_said_on_the_rank_that_cuts_it(capsys, monkeypatch):
    """Each rank encodes only its share of the prompts (an inference rank, its episodes' resets): a cut on a rank other
    than 0 is said too, naming the rank (was: never said when rank 0's prompts all fit)."""
    from tiny_models import _bpe_tokenizer
    tok = _bpe_tokenizer("the quick brown fox jumps over the lazy dog", ["<|endoftext|>", "<|im_end|>"])
    monkeypatch.setattr(tasks, "_cut_said", [])
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("GLOBAL_RANK", raising=False)
    tasks.encode_prompt({"prompt": "jumps over the lazy dog"}, tok, 3, chat_template=False)
    out = capsys.readouterr().out
    assert out.count("--rollout.max-prompt-length") == 1 and "[rank 1]" in out, out


def test_a_dataset_from_python():
    """--dataset package.module:function: its rows (a list of dicts or a datasets.Dataset), imported like a reward; a
    generator that gives other rows on each call (ranks would differ) or rows that are not dicts is refused by name;
    org/name:config stays a hub dataset's name."""
    got = tasks.load_dataset_rows("task_library:rows")
    assert got == [{"prompt": r["prompt"], "answer": r["answer"]} for r in __import__("task_library").rows()]
    assert tasks.load_dataset_rows("task_library:as_dataset") == got[:20] + got[:2]  # (its rows(20))
    assert [r["score"] for r in tasks.load_dataset_rows("task_library:with_nan")][:2] == [1.0, pytest.approx(float(
        "nan"), nan_ok=True)]  # NaN on both calls is the same row
    for name, said in (("task_library:unseeded", "other rows on each call"), ("task_library:not_dicts", "a str row"),
                       ("task_library:nope", "nope"), ("task_library:boom", "raised RuntimeError: no rows today"),
                       ("task_library:slow", "did not return within 0.5 s (--data.import-timeout-s)"),
                       ("no_such_module_here:rows", "no module 'no_such_module_here' can be imported, and no hub "
                        "dataset"),  # (offline: not on the hub either)
                       ("no_such_pkg.tasks:rows", "no module 'no_such_pkg.tasks' can be imported")):
        with pytest.raises(ValueError) as e:
            tasks.load_dataset_rows(name, timeout_s=0.5)
        assert said in str(e.value) and f"--dataset {name!r}" in str(e.value), (name, str(e.value))
    assert not tasks.is_python_source("openai/gsm8k:main") and not tasks.is_python_source("gsm8k:main")


def test_held_out_rows_leave_out_training_prompts_and_the_check_is_the_tasks(tmp_path, capsys):
    """With no eval split the held-out rows are the last --eval.num-prompts rows, less those whose prompt is also a
    training row's (said once); the held-out check is --eval.reward's, else a built-in task's own, else the first of
    --data.rewards; an --eval.reward that is not a reward of the run is refused."""
    import flags
    import grpo
    import launch
    import scoring
    cfg = grpo.Config(dataset="task_library:rows", output_dir=str(tmp_path), eval=grpo.EvalConfig(every=5),
                      data=tasks.DataConfig(rewards=("format", "task_library:first_letter")))
    train, held = launch.load_rows(cfg)
    everything = __import__("task_library").rows()
    seen = {r["prompt"] for r in everything[:-64]}
    want = [r for r in everything[-64:] if r["prompt"] not in seen]  # (a small space: repeats besides the last two)
    assert train == everything[:-64] and held == want and len(want) <= 62
    assert f"{64 - len(want)} of the last 64 rows of --dataset 'task_library:rows' also appear" in capsys.readouterr().out
    fns = [("format", scoring.format_reward), ("task_library:first_letter", object())]
    assert scoring.eval_check(cfg, fns) == ("format", scoring.format_reward)  # the first reward, not math-verify
    cfg.eval.reward = "task_library:first_letter"
    assert scoring.eval_check(cfg, fns) == ("task_library:first_letter", fns[1][1])
    assert scoring.eval_check(grpo.Config(), [("digit", None)])[0] == "digit"
    cfg.eval.reward = "accuracy"
    with pytest.raises(ValueError, match="--eval.reward 'accuracy' is not one of this run's reward functions"):
        flags.validate(cfg, train)


def test_a_python_task_library_trains_end_to_end(tmp_path):
    """grpo.py on 2 ranks with --dataset task_library:rows and its own check as the only reward: the held-out
    evaluation runs on its rows and the end line names that check (not math-verify)."""
    import json
    from conftest import torchrun
    out = str(tmp_path / "lib")
    _, log, _ = torchrun("grpo.py", "--output-dir", out, "--dataset", "task_library:rows", "--data.rewards",
                         "task_library:first_letter", "--eval.every", "2", "--eval.num-prompts", "16", "--max-steps", "2",
                         "--rollout.engine", "hf", "--log.completions-every", "0", timeout=600)
    rows = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2] and "reward/task_library:first_letter/mean" in rows[1]
    assert "by task_library:first_letter" in log, log[-2000:]
