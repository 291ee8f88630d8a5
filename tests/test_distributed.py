"""Real FSDP2 under torchrun (gloo, 2 ranks) with real vLLM engines."""
import time

from conftest import torchrun


def test_fsdp2_fused_logprob_grads_equal_unsharded(text_dir):
    _, out, _ = torchrun("tests/dist_fsdp_grads.py", text_dir, timeout=300)
    assert "rank 0 GRADS OK" in out and "rank 1 GRADS OK" in out, out[-3000:]


def test_fsdp2_policy_syncs_into_both_engines_and_mismatch_fails_fast(text_dir):
    t0 = time.time()
    code, out, _ = torchrun("tests/dist_engine_sync.py", text_dir, timeout=300, check=False)
    assert "rank 0 SYNC OK" in out and "rank 1 SYNC OK" in out, out[-4000:]
    # both ranks raise the same message and exit non-zero; nobody waits on a collective
    for r in (0, 1):
        assert f"rank {r} MISMATCH RAISED: weight sync: " in out, out[-4000:]
    assert code != 0 and time.time() - t0 < 240
