"""metrics.py: the console line of a step."""
import math
from types import SimpleNamespace

import pytest


@pytest.mark.parametrize("gap, probe, shown", [(2e-3, None, "mismatch 2.0e-03"), (math.nan, 3e-4, "mismatch 3.0e-04"),
                                               (math.nan, None, None)])
def test_the_step_line_shows_a_mismatch_or_nothing_never_nan(monkeypatch, gap, probe, shown):
    """Colocated: the engine/trainer mismatch. Inference ranks whose every token is stale (the metric is NaN): the
    weight-transfer probe's mismatch when it ran, else no mismatch at all; never 'nan'."""
    import metrics
    lines = []
    monkeypatch.setattr(metrics.console, "log_row", lambda path, row, line, bar, mode: lines.append(line))
    row = {"step": 3, "reward/mean": 0.5, "reward/digit/mean": 0.5, "loss": 0.1, "completion_len/mean": 2.0,
           "clip_ratio/region": 0.0, "logprob_mismatch/mean_abs": gap, "time/step": 1.0, "tokens_per_s": 10.0,
           **({"async/probe_mismatch": probe} if probe is not None else {})}
    run = SimpleNamespace(rank=0, reward_fns=[("digit", None)], metrics_path="", cfg=SimpleNamespace(
        max_steps=5, wandb=SimpleNamespace(mode="disabled"), log=SimpleNamespace(completions_every=0, episodes_every=0)))
    metrics.log_step(run, row, None, None, None)
    assert "nan" not in lines[0] and (shown in lines[0] if shown else "mismatch" not in lines[0]), lines[0]
