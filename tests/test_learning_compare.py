"""bench/learning_compare.py's table: per-seed accuracies, means with standard errors, the paired difference."""
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")


def test_table_means_errors_and_paired_difference(tmp_path, capsys):
    """Score files for 3 paired seeds and one unpaired seed -> the means and standard errors of statistics.stdev /
    sqrt(n), and the paired difference over the paired seeds only."""
    spec = importlib.util.spec_from_file_location("learning_compare", os.path.join(BENCH, "learning_compare.py"))
    learning_compare = importlib.util.module_from_spec(spec)  # by path: bench/ on sys.path would shadow rollout.py
    spec.loader.exec_module(learning_compare)
    hits = {"ours": {0: 40, 1: 30, 2: 35, 3: 20}, "trl": {0: 30, 1: 33, 2: 25}}  # right answers of 64 held-out
    for system, seeds in hits.items():
        for seed, k in seeds.items():
            os.makedirs(tmp_path / system / f"s{seed}")
            scores = {"held-out 64": {"last_integer": [1.0] * k + [0.0] * (64 - k)},
                      "fresh 128": {"last_integer": [1.0] * (2 * k) + [0.0] * (128 - 2 * k)}}
            (tmp_path / system / f"s{seed}" / "score.json").write_text(json.dumps(scores))
    learning_compare.render(str(tmp_path))
    out = capsys.readouterr().out.strip().splitlines()
    last = next(line for line in out if line.startswith("| mean"))
    ours, trl = [hits["ours"][s] / 64 for s in range(4)], [hits["trl"][s] / 64 for s in range(3)]
    diffs = [o - t for o, t in zip(ours, trl)]
    se = lambda x: statistics.stdev(x) / math.sqrt(len(x))  # noqa: E731
    want = (f"{statistics.mean(ours):.3f} +- {se(ours):.3f} (4) | {statistics.mean(trl):.3f} +- {se(trl):.3f} (3) | "
            f"{statistics.mean(diffs):+.3f} +- {se(diffs):.3f} (3)")
    assert last.startswith("| mean +- s.e. (n) | " + want), last
    m, t = statistics.mean(diffs), 4.303  # the two-sided 95% t quantile at 2 degrees of freedom
    assert f"held-out 64: ours - TRL {m:+.3f}, 95% interval [{m - t * se(diffs):+.3f}, {m + t * se(diffs):+.3f}]" in \
        "\n".join(out)


def test_training_rows_are_written_after_an_ours_run(tmp_path):
    """A seed's rows file for TRL is written after ours has run in the same process (whose recipe import puts bench/
    first on sys.path, where bench/rollout.py shadowed rollout.py: the bench stopped at seed 3 with a circular
    import); the rows are launch.load_rows' training rows at that seed."""
    code = (f"import sys; sys.path[:0] = [{BENCH!r}]; import learning_compare as lc, recipe_smollm2; "
            f"print(lc.train_rows_file({str(tmp_path)!r}, 7))")
    out = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(BENCH), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    import grpo
    import launch
    want = [r["prompt"] for r in launch.load_rows(grpo.Config(dataset="small_arith", seed=7))[0]]
    assert [json.loads(line)["prompt"] for line in open(out.stdout.split()[-1])] == want
