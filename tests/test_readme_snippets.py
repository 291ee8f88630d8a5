"""The README's Extending snippets, written to a folder on the import path and run through the loaders grpo.py uses
(tasks.load_dataset_rows, scoring.resolve_reward / score_rewards, episodes.load_tools / run_tool_calls, user_code.resolve /
start_env / step_env), so they cannot rot; and the docs' links: every docs page reachable from the README, every
relative link and anchor pointing at something that exists, no internal issue numbers."""
import glob
import inspect
import os
import re
import sys

import pytest

import episodes
import scoring
import tasks
import user_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def snippet_files(text):
    """```python blocks whose first line is `# NAME.py` -> {NAME.py: code}; a ```jsonl block -> {the last `NAME.jsonl`
    named before it: its lines}."""
    files = {}
    for m in re.finditer(r"```(\w+)\n(.*?)```", text, re.S):
        lang, body = m.groups()
        if lang == "python" and (name := re.match(r"# (\w+\.py)\n", body)):
            files[name.group(1)] = body
        elif lang == "jsonl":
            files[re.findall(r"`([\w.-]+\.jsonl)`", text[:m.start()])[-1]] = body
    return files


EXTENDING = README.split("\n## Extending\n", 1)[1].split("\n## ", 1)[0]
SNIPPETS = snippet_files(EXTENDING)


@pytest.fixture
def snippets(tmp_path, monkeypatch):
    """The snippets as files in a fresh folder that is on sys.path (what PYTHONPATH does) and is the working directory
    (where the README's commands name `my_data.jsonl`)."""
    for name, body in SNIPPETS.items():
        (tmp_path / name).write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in SNIPPETS:
        sys.modules.pop(name.removesuffix(".py"), None)


def test_the_readme_has_each_snippet():
    assert {"my_data.jsonl", "my_rewards.py", "my_tools.py", "my_env.py"} <= set(SNIPPETS), sorted(SNIPPETS)
    for name in ("my_rewards:exact_answer", "my_tools:word_count", "my_env:make_env", "my_data.jsonl"):
        assert re.search(rf"--\S+ {re.escape(name)}\b", EXTENDING), f"no command line in the README uses {name}"


def test_dataset_and_reward_snippets(snippets):
    rows = tasks.load_dataset_rows("my_data.jsonl")
    assert [type(r["prompt"]) for r in rows] == [str, list] and [r["answer"] for r in rows] == ["5", "3"]
    name = "my_rewards:exact_answer"
    scoring.check_rewards([name], tasks.DataConfig(), rows)  # what flags.validate runs on every rank
    fn = scoring.resolve_reward(name, tasks.DataConfig())
    batch = [rows[0], rows[1], rows[0], rows[1]]  # one row per completion, as grpo.py scores them
    completions = ["5", " 3\nbecause 7 - 4 = 3", "6", "three"]
    rewards, failed = scoring.score_rewards([(name, fn)], batch, completions, [[1]] * 4, set())
    # the README's rule: 1 when the completion's first line is the row's answer
    assert rewards[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0] and failed == [0]


def test_tool_snippet(snippets):
    tools = episodes.load_tools(["my_tools:word_count"], timeout_s=60)  # also builds its JSON schema, or refuses
    assert list(tools) == ["word_count"]
    calls = episodes.parse_tool_calls('<tool_call>{"name": "word_count", "arguments": {"text": "one two  three"}}'
                                      '</tool_call>')
    [(text, is_error, _)] = episodes.run_tool_calls(calls, tools, timeout_s=5)
    assert (text, is_error) == ("3", False)


def test_environment_snippet(snippets):
    make_env = user_code.resolve("my_env:make_env", "--env", timeout_s=60)
    row = tasks.load_dataset_rows("my_data.jsonl")[0]  # answer 5
    env, messages = episodes.start_env(make_env, row)
    assert messages[-1]["role"] == "user"
    higher, _, done = episodes.step_env(env, "I guess 2")
    assert higher[0]["content"] == "higher" and not done
    assert episodes.step_env(env, "then 7")[0][0]["content"] == "lower"
    assert episodes.step_env(env, "5") == (None, 1.0, True)
    env, _ = episodes.start_env(make_env, row)
    assert [episodes.step_env(env, g)[1:] for g in ("1", "2", "3")] == [(None, False), (None, False), (0.0, True)]
    assert scoring.resolve_reward("env")(["p"], ["c"], env_reward=[1.0]) == [1.0]  # the env reward reads the sum


def test_import_rule_message_is_the_one_the_readme_quotes(tmp_path, monkeypatch):
    """Without the snippet folder on the path, the reward does not resolve, and the error is the README's quote."""
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("my_rewards", None)
    with pytest.raises(ValueError) as e:
        scoring.resolve_reward("my_rewards:exact_answer", tasks.DataConfig())
    assert f"`{e.value}`" in README.replace("\n", " ")


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_docs_links_resolve_and_reach_every_page():
    pages = {os.path.join(ROOT, "README.md"): README, **{p: open(p).read() for p in DOCS}}
    anchors = {p: {slug(h) for h in re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", t, flags=re.S), re.M)}
               for p, t in pages.items()}
    broken, linked = [], set()
    for page, text in pages.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if page.endswith("README.md"):
                linked.add(full)
            if not os.path.exists(full) or (anchor and anchor not in anchors.get(full, set())):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target}")
    assert broken == [], broken
    assert [os.path.relpath(p, ROOT) for p in DOCS if p not in linked] == []


def test_no_internal_issue_numbers_in_the_docs():
    found = [f"{os.path.relpath(p, ROOT)}: {m.group(0)}" for p in [os.path.join(ROOT, "README.md"), *DOCS]
             for m in re.finditer(r".{0,30}(\b[Ii]ssues? #?\d+|(?<![#\w&])#\d+\b|the issue's).{0,30}", open(p).read())]
    assert found == [], found


def test_docs_cite_only_names_that_exist():
    """Every `module.name` the README and docs/ cite (a function, class or constant of a top-level module) exists, so a
    rename or a move cannot leave a page pointing at nothing; docs/step.md, the traced step, cites every stage.
    docs/benchmarks.md is left out: its dated entries name what existed when they were measured."""
    import glob
    import importlib
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    modules = sorted(os.path.basename(f)[:-3] for f in glob.glob(os.path.join(root, "*.py")))
    cite = re.compile(r"(?<![-\w/.])(" + "|".join(modules) + r")\.([A-Za-z_]\w*)(?![-\w]|\.\w)")
    missing, cited = [], {}
    for path in [os.path.join(root, "README.md"), *sorted(glob.glob(os.path.join(root, "docs", "*.md")))]:
        if path.endswith("benchmarks.md"):
            continue
        text = re.sub(r"```(?:bash|sh)?\n.*?```|`[^`\n]*--[^`\n]*`", "", open(path).read(), flags=re.S)  # commands
        for module, name in cite.findall(text):
            if name in ("py", "md", "jsonl", "json", "txt", "parquet", "gguf"):
                continue
            cited.setdefault(os.path.basename(path), set()).add(f"{module}.{name}")
            if not hasattr(importlib.import_module(module), name):
                missing.append(f"{os.path.basename(path)}: {module}.{name}")
    assert not missing, missing
    stages = {f"grpo.{f}" for f in ("sample_prompts", "sync_weights", "generate", "score", "old_and_ref_logps",
                                    "compute_advantages", "update", "maybe_checkpoint")} | {"metrics.step_row"}
    assert stages <= cited["step.md"], stages - cited["step.md"]
    main = inspect.getsource(importlib.import_module("grpo").main)
    assert all(s.split(".")[1] + "(" in main for s in stages)  # the page's stages are main()'s


def test_bench_scripts_use_only_names_that_exist():
    """Every `module.name` (and `from module import name`) of a top-level module in bench/*.py exists: the benchmarks
    run by hand, so no test imports them, and a rename (losses.sampler_ratio folded into policy_loss) left
    bf16_mismatch.py failing on its first batch."""
    import ast
    import glob
    import importlib
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    modules = {os.path.basename(f)[:-3] for f in glob.glob(os.path.join(root, "*.py"))}
    missing = []
    for path in sorted(glob.glob(os.path.join(root, "bench", "*.py"))):
        tree, names = ast.parse(open(path).read()), {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {a.asname or a.name: a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module in modules and not node.level:
                missing += [f"{path}: from {node.module} import {a.name}" for a in node.names
                            if not hasattr(importlib.import_module(node.module), a.name)]
        missing += [f"{os.path.basename(path)}: {names[n.value.id]}.{n.attr}" for n in ast.walk(tree)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in names
                    and not hasattr(importlib.import_module(names[n.value.id]), n.attr)]
    assert not missing, missing
