"""Documented flags that no other test exercised: each test fails if its flag were silently ignored."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, run


def probe(name, out, *flags, check=True):
    code, log, _ = run([sys.executable, "tests/flag_probe.py", name, "--output-dir", str(out), "--rollout.engine", "hf",
                        "--log.completions-every", "0", "--batch-size", "16", *flags], timeout=300, check=check)
    return code, log, int(log.rsplit("probe: ", 1)[1].split()[0])


def test_gradient_checkpointing_runs_the_layers_under_checkpoint(tmp_path):
    """--policy.gradient-checkpointing: the training forward runs each decoder layer under activation checkpointing
    (2 layers x 1 micro-batch per update); without the flag, never."""
    _, _, on = probe("checkpointing", tmp_path / "on", "--max-steps", "1", "--policy.gradient-checkpointing")
    _, _, off = probe("checkpointing", tmp_path / "off", "--max-steps", "1")
    assert on >= 2 and off == 0, (on, off)


def test_max_bad_steps_writes_a_checkpoint_and_stops(tmp_path):
    """--max-bad-steps 2 with a loss that is always NaN: both updates skipped, checkpoint-2 written, the run stops with
    the message (the default, 3, would write checkpoint-3)."""
    out = tmp_path / "bad"
    code, log, _ = probe("nan_loss", out, "--max-steps", "10", "--max-bad-steps", "2", check=False)
    assert code != 0 and "2 consecutive steps had a NaN/Inf loss or gradient norm (--max-bad-steps 2)" in log, log[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and all(r["skipped_updates"] == 1 for r in rows)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2"]


def test_overlong_cache_sets_the_penalty_ramp():
    """--data.overlong-cache reaches DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), written out here:
    0 up to L_max - L_cache tokens, then linear down to -1 at L_max."""
    import scoring
    import tasks
    L, cache = 10, 3
    fn = scoring.resolve_reward("overlong", tasks.DataConfig(overlong_cache=cache), max_completion_length=L)
    lens = list(range(L + 1))
    expected = [0.0 if n <= L - cache else (L - cache - n) / cache for n in lens]
    assert fn([""] * len(lens), [""] * len(lens), completion_ids=[[1] * n for n in lens]) == pytest.approx(expected)


def test_lora_dropout_reaches_the_adapters(text_dir):
    """--lora.dropout: every adapter's dropout has that rate, so once the adapters are non-zero two training forwards
    differ and two eval forwards do not."""
    import models
    model, _ = models.load_policy(text_dir, lora=models.LoraConfig(r=8, dropout=0.3))
    drops = [m for n, m in model.named_modules() if n.endswith("lora_dropout.default")]
    assert drops and all(isinstance(m, torch.nn.Dropout) and m.p == 0.3 for m in drops)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        model.train()
        a, b = model(input_ids=ids).logits, model(input_ids=ids).logits
        model.eval()
        c, d = model(input_ids=ids).logits, model(input_ids=ids).logits
    assert not torch.equal(a, b) and torch.equal(c, d)


ENGINE_PROBE = r"""
import json, sys, torch
import models, rollout, weight_sync
path, kv_gb = sys.argv[1], float(sys.argv[2])
engine = rollout.VLLMEngine(path, seed=0, cfg=rollout.VLLMConfig(max_model_len=256, kv_cache_gb=kv_gb,
                            sync_bucket_mb=0), dtype="float32", show_progress=False)
cache = engine.llm.llm_engine.vllm_config.cache_config
calls, real = [0], engine.llm.collective_rpc
def counted(method, *a, **kw):
    calls[0] += method == "reload_weights"
    return real(method, *a, **kw)
engine.llm.collective_rpc = counted
model, _ = models.load_policy(path)
reloads = {}
for bucket_mb in (0, rollout.VLLMConfig.sync_bucket_mb):  # 0 as the engine was built from it, then the default set
    if bucket_mb:  # on the same engine (one engine per process)
        engine.bucket_mb = bucket_mb
    calls[0] = 0
    engine.load_weights(weight_sync.iter_engine_weights(model, torch.float32))
    reloads[bucket_mb] = calls[0]
print("PROBE " + json.dumps({"kv_bytes": cache.kv_cache_memory_bytes, "reloads": reloads,
                             "layers": model.config.num_hidden_layers}))
"""


def test_vllm_kv_cache_and_sync_bucket_flags_reach_the_engine(text_dir):
    """--vllm.kv-cache-gb is the engine's KV-cache budget on CPU (when VLLM_CPU_KVCACHE_SPACE is not set); --vllm.sync-bucket-mb
    sizes the weight sync's reload calls: 0 MB sends one decoder layer per call (at least one call per layer), the
    default 1024 MB all of this tiny model in one."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # set, it overrides the flag
    out = subprocess.run([sys.executable, "-c", ENGINE_PROBE, text_dir, "0.25"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    got = json.loads(out.split("PROBE ", 1)[1].splitlines()[0])
    assert got["kv_bytes"] == 2**28
    assert got["reloads"]["0"] >= got["layers"] and got["reloads"]["1024"] == 1, got


def test_mask_truncated_completions_leaves_them_out_of_the_loss(tmp_path):
    """--rollout.mask-truncated-completions (DAPO's overlong filtering): the loss mask of every completion cut at
    --rollout.max-completion-length is all zero, the others' is their tokens (3 tokens: the tiny policy rarely stops
    that early, so most of the 16 are cut)."""
    out = tmp_path / "mask"
    run([sys.executable, "tests/episode_dump.py", "--output-dir", str(out), "--max-steps", "1", "--rollout.engine", "hf",
         "--rollout.max-completion-length", "3", "--rollout.mask-truncated-completions", "--batch-size", "16",
         "--micro-batch-size", "16", "--policy.no-share-prompts", "--log.completions-every", "0"], timeout=300)
    rec = torch.load(out / "dump.pt", weights_only=False)
    samples = rec["samples"][0]
    assert any(s["truncated"] for s in samples)
    assert sorted(i for f in rec["forward"] for i in f["rows"]) == list(range(16))  # every row, in some micro-batch
    for fwd, loss in zip(rec["forward"], rec["loss"]):
        for k, i in enumerate(fwd["rows"]):
            n = len(samples[i]["completion_ids"])
            expected = [0.0 if samples[i]["truncated"] else 1.0] * n
            assert loss["mask"][k, :n].tolist() == expected and not loss["mask"][k, n:].any(), (i, loss["mask"][k])
