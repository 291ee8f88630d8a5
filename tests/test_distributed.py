"""Real FSDP2 under torchrun (gloo, 2 ranks) with real vLLM engines."""
import json
import math
import os
import shutil
import sys
import time

import torch
from safetensors.torch import load_file

from conftest import run, torchrun


def test_fsdp2_fused_logprob_grads_equal_unsharded(text_dir):
    _, out, _ = torchrun("tests/dist_fsdp_grads.py", text_dir, timeout=300)
    for r in (0, 1):
        assert f"rank {r} GRADS OK" in out and f"rank {r} DORA MERGE OK" in out, out[-3000:]


def test_fsdp2_policy_syncs_into_both_engines_and_mismatch_fails_fast(text_dir):
    t0 = time.time()
    code, out, _ = torchrun("tests/dist_engine_sync.py", text_dir, timeout=300, check=False)
    assert "rank 0 SYNC OK" in out and "rank 1 SYNC OK" in out, out[-4000:]
    # both ranks raise the same message and exit non-zero; nobody waits on a collective
    for r in (0, 1):
        assert f"rank {r} MISMATCH RAISED: weight sync: " in out, out[-4000:]
    assert code != 0 and time.time() - t0 < 240


def test_update_gradient_invariant_to_ranks_micro_batches_and_steps_per_generation(text_dir, tmp_path):
    """Every loss type and option: one update's gradient (and its metrics) on 2 ranks x micro-batches of 3 x
    steps_per_generation 2 equals one process with the minibatch as one micro-batch (float64, <= 1e-5 relative).
    Also: batch-std / GDPO / RLOO advantages from 2 ranks equal one big batch's; a NaN on one rank shows in the
    global loss; the HF-format copy is gathered on rank 0 only. Then all of it again (the critic too)
    with each of the 2 data-parallel ranks a context-parallel group of 2 ranks that splits its rows (4 ranks), the
    automatic sweep of loss types and fields there packed several fields to a case (its loss code is the 2-rank
    cut's; each packed field still moves the gradient: dist_invariance.packed)."""
    ref = str(tmp_path / "ref.pt")
    # one thread, as torchrun gives each rank: the tiny float64 passes gain nothing from a second (measured with two:
    # 0.38 CPU-s per case, against 0.27 per rank for a sharded rank's five passes with one)
    run([sys.executable, "tests/dist_invariance.py", text_dir, ref, "ref"], timeout=300, env={"OMP_NUM_THREADS": "1"})
    for mode, nproc in (("check", 2), ("cp", 4)):  # cp: each data-parallel rank's rows split over 2 ranks
        _, out, _ = torchrun("tests/dist_invariance.py", text_dir, ref, mode, nproc=nproc, timeout=300)
        for r in (0, 1):  # (the data-parallel rank: with cp, each group's two ranks say it)
            for what in ("INVARIANT", "GLOBAL STATS", "NAN AND GATHER"):
                assert out.count(f"rank {r} {what} OK") == nproc // 2, out[-3000:]


def test_bf16_mixed_precision_on_cpu_gradient_close_to_fp32_and_fp32_state(text_dir):
    """--policy.dtype bfloat16 on CPU runs the CUDA recipe's FSDP2 mixed precision (tests/dist_bf16.py states the
    tolerance and why): first-step gradient within 5% of the fp32 run's per tensor, fp32 master weights, gradients,
    log-probs and AdamW state. With --policy.fp32-lm-head, the trainer's and the HF engine's log-probs equal a float64
    norm + head + log-softmax on the bf16 decoder's output (<= 1e-5; plain bf16 is ~2e-3 off)."""
    _, out, _ = torchrun("tests/dist_bf16.py", text_dir, timeout=300)
    for r in (0, 1):
        for what in ("BF16 GRADS", "FP32 STATE", "FP32 HEAD"):
            assert f"rank {r} {what} OK" in out, out[-3000:]


def test_bf16_run_completes_and_its_checkpoint_resumes_in_both_dtypes(tmp_path):
    """grpo.py --policy.dtype bfloat16 (HF engine in bf16) for 2 steps with a checkpoint; the checkpoint holds fp32
    master weights and resumes for a third step under --policy.dtype bfloat16 (with the vLLM CPU build's engine in
    bf16) and float32 (HF engine) alike."""
    common = ["--log.completions-every", "0", "--batch-size", "8", "--num-generations", "4"]
    a = str(tmp_path / "bf16")
    torchrun("grpo.py", "--output-dir", a, "--max-steps", "2", "--checkpoint.every", "2", "--policy.dtype", "bfloat16",
             "--rollout.engine", "hf", *common, timeout=300)
    weights = load_file(os.path.join(a, "checkpoint-2", "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {torch.float32}
    for dtype in ("bfloat16", "float32"):
        b = str(tmp_path / f"resume-{dtype}")
        shutil.copytree(a, b)
        _, log, _ = torchrun("grpo.py", "--output-dir", b, "--max-steps", "3", "--resume", "latest", "--policy.dtype",
                             dtype, "--rollout.engine", "vllm" if dtype == "bfloat16" else "hf", *common,
                             "--checkpoint.allow-changes", "max_steps", "policy.dtype", "rollout.engine", timeout=300)
        assert "resumed from" in log and "Attempted to load weight" not in log, log[-3000:]
        with open(os.path.join(b, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        assert [r["step"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows), rows
        # the engine computes in the trainer's dtype: fp32 on both sides agrees to ~1e-7, bf16 (8 bits) to ~1e-3
        lo, hi = (1e-5, 1e-2) if dtype == "bfloat16" else (0, 1e-5)
        assert lo < rows[-1]["logprob_mismatch/mean_abs"] < hi, rows[-1]

