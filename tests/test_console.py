"""The quiet console (console.quiet_libraries): benign library notices and INFO logs hidden, everything else shown.
The 2-rank runs' consoles are checked in test_grpo.py (test_default_run_learns: quiet; a --log.verbose run: chatty)."""
import sys

import pytest
from conftest import run

# One fresh process per case: quiet_libraries changes process-wide logging, warnings and environment.
PROBE = r"""
import logging, sys, warnings
import console
console.quiet_libraries(verbose=sys.argv[1] == "verbose", rank=1)
from transformers.utils import logging as hf_logging
print("bars", hf_logging.is_progress_bar_enabled(), flush=True)
for text in console.BENIGN_NOTICES:
    logging.getLogger("vllm.v1.worker.cpu_worker").warning("x %s y", text)   # how vLLM's modules log (init_logger)
    warnings.warn(f"x {text} y", FutureWarning)
hf_logging.get_logger("transformers.modeling_utils").warning("x %s", console.BENIGN_NOTICES[0])
logging.getLogger("vllm.v1.engine.core").info("MARK-vllm-info")
logging.getLogger("vllm.v1.engine.core").warning("MARK-vllm-warning")
logging.getLogger("vllm.v1.engine.core").error("MARK-vllm-error")
hf_logging.get_logger("transformers.modeling_utils").info("MARK-hf-info")
hf_logging.get_logger("transformers.modeling_utils").warning("MARK-hf-warning")
warnings.warn("MARK-python-warning", FutureWarning)
"""


def probe(mode):
    _, out, _ = run([sys.executable, "-c", PROBE, mode], timeout=180)
    return out


@pytest.fixture(autouse=True)
def _no_user_vllm_logging(monkeypatch):  # an explicit VLLM_LOGGING_* setting would (rightly) keep vLLM's own config
    for k in ("VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH"):
        monkeypatch.delenv(k, raising=False)


def test_quiet_hides_only_the_listed_notices():
    out = probe("quiet")
    assert "bars False" in out  # transformers' own switch reports its bars off
    for text in __import__("console").BENIGN_NOTICES:
        assert text not in out, text
    for mark in ("MARK-vllm-warning", "MARK-vllm-error", "MARK-hf-warning", "MARK-python-warning"):
        assert mark in out, (mark, out)  # unknown warnings and errors still show
    assert "[vllm rank 1] WARNING MARK-vllm-warning" in out
    assert "MARK-vllm-info" not in out and "MARK-hf-info" not in out


def test_verbose_changes_nothing():
    out = probe("verbose")
    assert "bars True" in out
    for text in __import__("console").BENIGN_NOTICES:
        assert text in out, text  # the library's own handlers (or Python's defaults) print them all


def config_fields_without_docstring(cls, seen=None):
    """Fields of a tyro config dataclass (and the dataclasses it nests) with no docstring under them: tyro would show
    such a field's source comment, or nothing, as its --help text."""
    import ast
    import dataclasses
    import inspect
    import textwrap
    seen = set() if seen is None else seen
    if cls in seen:
        return []
    seen.add(cls)
    documented = set()
    for c in [c for c in cls.__mro__ if dataclasses.is_dataclass(c)]:  # a subclass's fields may be its parent's
        body = ast.parse(textwrap.dedent(inspect.getsource(c))).body[0].body
        documented |= {st.target.id for st, nxt in zip(body, body[1:]) if isinstance(st, ast.AnnAssign) and
                       isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)}
    shown = [f for f in dataclasses.fields(cls) if "Suppress" not in str(f.type)]  # tyro.conf.Suppress: not a flag
    missing = [f"{cls.__name__}.{f.name}" for f in shown if f.name not in documented]
    for f in shown:
        group = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(group):
            missing += config_fields_without_docstring(type(group), seen)
    return missing


def test_every_flag_and_group_has_its_own_help():
    """--help is the manual: every flag and every flag group of grpo.py and flow_grpo.py has a docstring (a group
    without one showed a source comment, 'before `rollout`, which shadows the module', as its description)."""
    import flow_grpo
    import grpo
    assert config_fields_without_docstring(grpo.Config) == []
    assert config_fields_without_docstring(flow_grpo.Config) == []


def test_configuration_table_lists_every_flag():
    """The Configuration table (docs/configuration.md; README.md and the other docs pages are read too) names every
    flag of grpo.py, group by group (in backticks), so a new flag cannot go undocumented."""
    import dataclasses
    import glob
    import os

    import grpo
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    docs = "".join(open(p).read() for p in [os.path.join(root, "README.md"), *glob.glob(os.path.join(root, "docs", "*.md"))])
    rows = {}  # a group's rows in several files (a README row added for a new flag, docs/configuration.md) add up
    for line in docs.splitlines():
        if line.startswith("| top level") or line.startswith("| `--"):
            rows[line.split("|")[1].strip()] = rows.get(line.split("|")[1].strip(), "") + line
    missing = []
    for f in dataclasses.fields(grpo.Config):
        flag = f.name.replace("_", "-")
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            row = next((r for k, r in rows.items() if f"`--{flag}.*`" in k), "")
            missing += [f"--{flag}.{g.name.replace('_', '-')}" for g in dataclasses.fields(f.default_factory)
                        if f"`{g.name.replace('_', '-')}`" not in row and f"`--{flag}.{g.name.replace('_', '-')}`" not in row]
        elif f"`--{flag}`" not in rows.get("top level", ""):
            missing.append(f"--{flag}")
    assert missing == [], missing


def test_done_line_compares_the_first_and_last_evaluation(tmp_path, capsys):
    """console.print_done: 'eval: accuracy A -> B by CHECK (best constant answer C)' from the first and the last eval row of
    metrics.jsonl (pass@1 when that is what was logged; no best constant without gold answers), nothing with fewer
    than two evaluations."""
    import json
    import time

    import console
    path = tmp_path / "metrics.jsonl"
    cases = [([{"step": 0, "eval/accuracy": 0.1}, {"step": 1, "reward/mean": 0.5}, {"step": 2, "eval/accuracy": 0.7}],
              0.3, "eval: accuracy 0.10 -> 0.70 by accuracy (best constant answer 0.30)\n"),
             ([{"step": 0, "eval/pass@1": 0.2}, {"step": 4, "eval/pass@1": 0.4}], None,
              "eval: pass@1 0.20 -> 0.40 by accuracy\n"),
             ([{"step": 0, "eval/accuracy": 0.2}, {"step": 1, "reward/mean": 0.5}], 0.3, "")]
    for rows, best, expected in cases:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        console.print_done(str(path), time.time(), best)
        out = capsys.readouterr().out
        assert out.startswith(expected + "done in ") and out.endswith(f"metrics in {path}\n"), out


def test_a_native_crash_prints_the_python_stack():
    """A segfault in native code under console.run_script (as in torch or gloo at a step's end) prints where Python was,
    so a crash seen once in CI can be traced: without faulthandler the log holds only torchrun's 'exitcode -11'."""
    crash = ("import ctypes, console\ndef step_that_crashes(cfg):\n    ctypes.string_at(0)\n"
             "console.run_script(step_that_crashes, None)")
    code, out, _ = run([sys.executable, "-c", crash], timeout=60, check=False)
    assert code == -11 and "Segmentation fault" in out and "step_that_crashes" in out, (code, out)
