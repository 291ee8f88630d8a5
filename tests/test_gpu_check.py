"""bench/gpu_check.py in its reduced form (tiny sizes, CPU): every row runs for real and meets its target, so the
script the first GPU runs is not dead code."""
import os
import re
import sys

from conftest import run


def test_gpu_check_reduced_form_runs_every_check(tmp_path):
    from transformers import AutoConfig, AutoTokenizer
    code, out, _ = run([sys.executable, "bench/gpu_check.py", "--small", "--work", str(tmp_path)], timeout=600,
                       check=False)
    table = out[out.index("\nmachine: "):]
    assert code == 0 and "FAIL" not in table, out[-4000:]
    for check in ("grpo.py vllm: steps done", "grpo.py hf: steps done", "grpo.py lora: steps done",
                  "vllm: peak memory GB", "hf: update MFU", "fused/naive extra memory", "fused/naive time",
                  "flow_grpo.py builtin:tiny-flow: steps done", "fused log p max |error|",
                  "fused weight-gradient relative error", "hf: update top ops (profiler",
                  "generate: ours / transformers", "generate 8 x 16 tokens: one static KV cache",
                  "generate 8 x 16 tokens: HF engine, --rollout.compile-decode", "generate: ours compiled / transformers",
                  "decode log-probs vs one forward, eager / compiled"):
        assert check in table, (check, table)
    assert "failed:" not in table, table  # both static-cache decodes ran (stock generate's compiled only on CUDA)
    # the TRL side by side runs where trl is importable and says it was skipped where not
    import importlib.util
    assert ("ours vs TRL: s/step" in table) == (importlib.util.find_spec("trl") is not None), table
    assert ("TRL not installed: skipped" in table) == (importlib.util.find_spec("trl") is None), table
    # the profiler row names real operations with shares that add up to at most the whole
    ops = next(line for line in table.splitlines() if line.startswith("hf: update top ops")).split("|")[1]
    shares = [float(x) for x in re.findall(r" (\d+)%", ops)]
    assert "aten::" in ops and 0 < sum(shares) <= 100 + len(shares), ops
    # bf16 on both sides: the mismatch is bf16's (~1e-3), not fp32's (~1e-7), and far below the stop threshold
    for engine in ("vllm", "hf"):
        row = next(line for line in table.splitlines() if line.startswith(f"{engine}: engine/trainer mismatch"))
        values = [float(x) for x in re.findall(r"\d\.\de-\d\d", row.split("|")[1])]
        assert len(values) == 3 and all(1e-5 < v < 1e-2 for v in values), row
    # the model built offline: every id of its vocabulary decodes (the engine may sample any of them)
    model = os.path.join(tmp_path, "model")
    assert len(AutoTokenizer.from_pretrained(model)) == AutoConfig.from_pretrained(model).vocab_size == 4096


def test_gpu_check_budget_skips_what_would_not_fit(tmp_path):
    """--budget-s: once spent, each run left gets a "skipped" row instead of starting (a lent GPU's call has a hard
    limit: the table must print inside it), and a skipped row is no failure."""
    code, out, _ = run([sys.executable, "bench/gpu_check.py", "--small", "--work", str(tmp_path), "--only",
                        "hf,trl,flow", "--budget-s", "0.001"], timeout=300, check=False)
    table = out[out.index("\nmachine: "):]
    assert code == 0, out[-3000:]
    for what in ("grpo.py hf", "ours vs TRL", "flow_grpo.py builtin:tiny-flow"):
        assert f"{what}" in table and "skipped: --budget-s spent" in table.split(what, 1)[1].splitlines()[0], table
    assert not os.path.exists(tmp_path / "hf") and not os.path.exists(tmp_path / "flow")  # nothing started


def test_trl_side_by_side_times_from_step_ends():
    """bench/trl_compare.summarise, which gpu_check's side by side with TRL reads: s/step over the steps after the
    first, start-up + step 1, and what follows the last step (our final checkpoint), from wall-clock step ends."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from trl_compare import summarise
    mon = {"start": 100.0, "exit": 160.0, "step_ends": [[110.0, 1.0], [120.0, 1.0], [130.0, 1.0], [140.0, 1.0]],
           "peak_gb": 1.0, "maxrss_gb": 1.0}
    r = summarise(mon, 1, [])
    assert (r["s_per_step"], r["to_step1_s"], r["after_last_s"]) == (10.0, 10.0, 20.0)
