"""docs/compatibility.md cannot drift from the code: every cell's flags go through the real validation (launch.validate
on a parsed grpo.Config, plus the critic loader for gae, which refuses image-text checkpoints); refused cells must be
refused with their text, every other cell accepted, and every test a cell names must exist."""
import os
import re

import pytest
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what each row/column of the table turns on (on top of the baseline: text, single-turn, grpo, vLLM, TP 1, colocated)
FEATURES = {"colocated": [], "grpo": [], "rloo": ["--advantage-estimator", "rloo"],
            "gae": ["--advantage-estimator", "gae"], "reinforce_pp": ["--advantage-estimator", "reinforce_pp"],
            "dynamic sampling": ["--dynamic-sampling"], "LoRA": ["--lora.r", "8"],
            "EMA evaluation": ["--ema.decay", "0.9", "--eval.use-ema"], "image-text": [],  # the model and rows do it
            "multi-turn": ["--data.tools", "tools_for_tests:multiply"], "HF engine": ["--rollout.engine", "hf"],
            "TP > 1": ["--rollout.engine", "vllm", "--vllm.tp", "2"],
            "inference ranks": ["--rollout.inference-ranks", "1"]}
CELLS = {("TP > 1", "inference ranks"): ["--rollout.inference-ranks", "2"],  # a cell's own flags, where it needs any
         ("HF engine", "TP > 1"): ["--rollout.engine", "hf"]}


def table():
    """docs/compatibility.md -> {(row, column): cell text}."""
    lines = [x for x in open(os.path.join(ROOT, "docs", "compatibility.md")).read().splitlines() if x.startswith("|")]
    split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    columns = split(lines[0])[1:]
    return {(row[0], col): cell for row in map(split, lines[2:]) for col, cell in zip(columns, row[1:])}


def test_the_table_covers_every_pair_it_names():
    cells = table()
    rows, columns = {r for r, _ in cells}, {c for _, c in cells}
    assert len(cells) == 11 * 6 and rows | columns <= set(FEATURES), sorted(rows | columns)
    bad = [(k, v) for k, v in cells.items() if not re.fullmatch(r'tested \(`\w+`.*\)|refused: ".+"|accepted, untested|—', v)]
    assert not bad, bad


def test_named_tests_exist():
    source = "".join(open(os.path.join(ROOT, "tests", f)).read() for f in os.listdir(os.path.join(ROOT, "tests"))
                     if f.startswith("test_") and f.endswith(".py"))
    names = {m.group(1) for cell in table().values() if (m := re.match(r"tested \(`(\w+)`", cell))}
    assert names and not [n for n in names if f"def {n}(" not in source]


def validate_cell(row, col, tmp_path, text_dir, vlm_dir, monkeypatch):
    """The real checks on the cell's flags: launch.validate, and for gae the critic loader (it refuses at setup)."""
    import grpo
    import models
    flags = FEATURES[row] + FEATURES[col] + CELLS.get((row, col), [])
    image = "image-text" in (row, col)
    monkeypatch.setenv("WORLD_SIZE", "3" if "inference ranks" in (row, col) else "2")
    cfg = tyro.cli(grpo.Config, args=["--output-dir", str(tmp_path / f"{row}-{col}"), "--model",
                                      vlm_dir if image else text_dir, *flags])
    rows = [{"prompt": [{"role": "user", "content": "3*4?"}], "answer": "12", **({"image": "x.png"} if image else {})}]
    grpo.validate(cfg, rows)
    if cfg.advantage_estimator == "gae":
        models.load_critic(cfg.critic.model or cfg.model)


@pytest.mark.parametrize("cell", sorted(k for k, v in table().items() if v != "—"), ids=" x ".join)
def test_each_cell_is_refused_or_accepted_as_the_table_says(cell, tmp_path, text_dir, vlm_dir, monkeypatch):
    text = table()[cell]
    if text.startswith("refused"):
        with pytest.raises(ValueError) as e:
            validate_cell(*cell, tmp_path, text_dir, vlm_dir, monkeypatch)
        assert text.split('"', 1)[1][:-1] in str(e.value), (cell, str(e.value))
    else:
        validate_cell(*cell, tmp_path, text_dir, vlm_dir, monkeypatch)
