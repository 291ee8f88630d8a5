"""Real FSDP2 under torchrun (gloo, 2 ranks) with real vLLM engines."""
import sys
import time

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
    global loss; the HF-format copy is gathered on rank 0 only."""
    ref = str(tmp_path / "ref.pt")
    run([sys.executable, "tests/dist_invariance.py", text_dir, ref, "ref"], timeout=300)
    _, out, _ = torchrun("tests/dist_invariance.py", text_dir, ref, "check", timeout=300)
    for r in (0, 1):
        for what in ("INVARIANT", "GLOBAL STATS", "NAN AND GATHER"):
            assert f"rank {r} {what} OK" in out, out[-3000:]
