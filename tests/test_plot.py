"""bench/plot.py: the real script on two small metrics.jsonl files."""
import json
import sys

from PIL import Image

from conftest import run


def write_run(path, rows):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_two_runs(tmp_path):
    # run a: everything, eval every other step; run b: no KL/entropy, pass@1 instead of accuracy, a NaN reward, a half-written last line
    write_run(tmp_path / "a", [{"step": s, "reward/mean": 0.1 * s, "kl": 0.01 * s, "entropy": 2.0 - 0.1 * s,
                                "completion_len/mean": 20.0 + s, "time/step": 1.5,
                                **({"eval/accuracy": 0.2 * s} if s % 2 == 0 else {})} for s in range(1, 6)])
    write_run(tmp_path / "b", [{"step": s, "reward/mean": float("nan") if s == 2 else 0.05 * s,
                                "completion_len/mean": 30.0 - s, "time/step": 2.0,
                                **({"eval/pass@1": 0.1 * s} if s % 2 == 0 else {})} for s in range(1, 5)])
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rewa')  # a run still writing its last line
    out = tmp_path / "both.png"
    _, log, _ = run([sys.executable, "bench/plot.py", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)])
    assert str(out) in log
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(out) as im:
        assert im.format == "PNG" and im.size == (1200, 700)  # FIG_SIZE_IN (12, 7) x DPI 100
    _, log, _ = run([sys.executable, "bench/plot.py", str(tmp_path / "b")])  # default: <first dir>/curves.png
    with Image.open(tmp_path / "b" / "curves.png") as im:
        assert im.size == (1200, 700)


def test_plot_without_metrics_is_one_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    code, log, _ = run([sys.executable, "bench/plot.py", str(tmp_path / "empty")], check=False)
    assert code != 0 and "no metrics.jsonl in" in log and "--output-dir" in log
    assert "Traceback" not in log and len(log.strip().splitlines()) == 1
    assert not (tmp_path / "empty" / "curves.png").exists()
