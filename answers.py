"""answers.py: reading final answers for the math rewards in tasks.py.

extract_number and gold_number read one number (integers, decimals, fractions in lowest terms, \\boxed{}, '####',
LaTeX fractions and separators) and never evaluate an expression; answer_reward is `accuracy`'s per-sample check:
math-verify first, the number reader where math-verify cannot read a side.
"""
import math
import re
import threading


NUM = r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"  # 12, 1,000, 2.5, .5
_NUMBER = NUM + r"(?:/\d+)?"  # an integer, a decimal or a fraction
_BRACED_OR_DIGIT = r"(?:\{\s*(-?\d+)\s*\}|(\d))"
_FRAC = re.compile(r"(?<![\d.])(-?)(?:(\d+)\s*)?\\[dt]?frac\s*" + _BRACED_OR_DIGIT + r"\s*" + _BRACED_OR_DIGIT)
_NOISE = re.compile(r"\\text\{[^{}]*\}|\\mbox\{[^{}]*\}|\^\{?\\circ\}?|\\[!,;: ]|\\?[$%]|\\left|\\right")


def _frac_to_slash(m):
    """\\frac{a}{b} -> 'a/b' (sign on top), \\frac12 -> '1/2', the mixed number 2\\frac{1}{2} -> '5/2'."""
    sign, whole, a, b = m[1], m[2], int(m[3] or m[4]), int(m[5] or m[6])
    if b == 0:
        return "0/0"  # read as no number
    num, den = (a * (-1 if b < 0 else 1)), abs(b)
    if whole:
        num = int(whole) * den + num
    return f"{'-' if (sign == '-') != (num < 0) else ''}{abs(num)}/{den}"


def _last_boxed(text):
    """The content of the last \\boxed{...}, nested braces included; None without one (or unclosed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def _value(number):
    """'1,000' -> 1000.0, '-5/2' -> -2.5. A fraction counts only in lowest terms ('24/2' is a division left to
    do, as an echo of the question would write it) and with a non-zero denominator; else None."""
    num, _, den = number.replace(",", "").partition("/")
    if not den:
        return float(num)
    if not num.lstrip("-").isdigit() or int(den) == 0 or math.gcd(int(num), int(den)) != 1:
        return None
    return int(num) / int(den)


def _one_number(part):
    """The value of a part that is one number (an 'x =' in front, spaces, $, %, degrees, \\text{units} and LaTeX
    spacing aside)."""
    part = re.sub(r"^\s*[A-Za-z]\w*\s*=", "", _NOISE.sub("", part)).strip().rstrip(".")
    return _value(part) if re.fullmatch(_NUMBER, part) else None


def _answer_part(text):
    """-> (where the text states its answer, boxed?): the last \\boxed{...}'s content, else what follows '####',
    else all of it; \\frac forms as 'a/b', LaTeX thousands separators (1{,}000, 10,\\!000, 10\\,000) as commas."""
    text = _FRAC.sub(_frac_to_slash, re.sub(r"(?<=\d)(?:\{,\}|,?\\[!,])(?=\d{3})", ",", str(text)))
    boxed = _last_boxed(text)
    return (boxed, True) if boxed is not None else (text.split("####")[-1], False)


def extract_number(text):
    """The final numeric answer: the number in the last \\boxed{...} (which must hold one number: \\boxed{3 * 4} is
    none), else the last number (or fraction: 1/2, \\frac{1}{2}, 2\\frac{1}{2}) after '####', else in the whole text.
    Commas dropped."""
    if text is None:
        return None
    part, boxed = _answer_part(text)
    if boxed:
        return _one_number(part)
    nums = re.findall(_NUMBER, part)
    return _value(nums[-1]) if nums else None


def gold_number(answer):
    """A gold answer's number: the answer (inside \\boxed{}, or after '####', or all of it) must be one number, else
    None ('x^2 + 1' holds a 1 but is no number)."""
    return None if answer is None else _one_number(_answer_part(answer)[0])


def _mv_parse(text, timeout_s):
    """math-verify's parse, [] when it fails or times out. (Imported on first use: its LaTeX parser adds ~0.5 s to
    every process's start that never scores a math answer.)"""
    from math_verify import parse
    from math_verify.errors import TimeoutException
    try:
        return parse(text, parsing_timeout=timeout_s)
    except (Exception, TimeoutException):  # noqa: BLE001 - a completion must never crash the reward
        return []


# an answer math-verify would evaluate for us ("3 * 4", "8 + 10", "12 - 5"): a restated question, not a final value;
# scientific notation ("2 \times 10^3") is a value
_UNEVALUATED = re.compile(r"\d\s*(?:[+*\u00d7\u00b7-]|\\times|\\cdot)\s*\(?-?\d")
_SCIENTIFIC = re.compile(r"(?:[*\u00d7\u00b7]|\\times|\\cdot)\s*10\s*\^")
_ARITHMETIC = re.compile(r"(?:[\d\s.,+*/()$\u00d7\u00b7-]|\\times|\\cdot)+")  # numbers and operators only


def _unevaluated(expr):
    """'3 * 4' yes; '2 \\times 10^3', '7 - 4\\sqrt{2}', 'x + 1' no (values in their final form)."""
    expr = _SCIENTIFIC.sub(" e", expr).strip()
    return bool(_ARITHMETIC.fullmatch(expr) and _UNEVALUATED.search(expr))


def answer_reward(answer, completion):
    """One sample of `accuracy`: math-verify (https://github.com/huggingface/Math-Verify) compares the final answers
    (\\boxed{}, LaTeX, fractions, units); where it cannot read a side, or the completion's answer is an unevaluated
    arithmetic expression (which math-verify would compute: "3 * 4" for 12), the final plain numbers are compared."""
    # math-verify times out with SIGALRM, which only the main thread may set: off it, no timeout
    timeout_s = 2 if threading.current_thread() is threading.main_thread() else None
    gold = str(answer).split("####")[-1]  # GSM8K: the worked solution ends with '#### 42'
    # a bare gold answer is LaTeX math ("2\\sqrt{3}", "(2,-3)", "\\pi"): math-verify reads it only between $...$
    bare_math = "$" not in gold and "\\boxed" not in gold and re.search(r"[\d\\]", gold)  # not prose ("no digits")
    g = (bare_math and _mv_parse(f"${gold.strip()}$", timeout_s)) or _mv_parse(gold, timeout_s)
    c = _mv_parse(completion, timeout_s)
    c = [] if c and _unevaluated(str(c[-1])) else c
    if g and c:
        from math_verify import verify
        from math_verify.errors import TimeoutException
        try:
            return float(verify(g, c, timeout_seconds=timeout_s))
        except (Exception, TimeoutException):  # noqa: BLE001
            pass
    target, got = extract_number(gold), extract_number(completion)
    if target is None:
        return 0.0 if g else None  # None: neither checker can read the gold answer
    return float(got is not None and abs(got - target) < 1e-6)
