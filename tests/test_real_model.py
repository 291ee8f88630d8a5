"""The real pretrained SmolLM2-135M-Instruct (Llama architecture, BPE tokenizer, chat template) from its GGUF file."""
import math
import os
import re

import pytest
import torch

import models


def test_gguf_conversion_equals_transformers_own_gguf_load(smollm2_dir):
    path, gguf = smollm2_dir
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                     dtype=torch.float32)
    model, tok = models.load_policy(path)
    assert type(model).__name__ == "LlamaForCausalLM" and tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True)
    ids = torch.tensor([list(getattr(ids, "input_ids", ids))])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=1e-5)
        greedy = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    # pretrained behaviour survives the conversion: it restates the sum (measured: "12 + 7 = 9"; a random model babbles)
    assert tok.decode(greedy[0, ids.shape[1]:]).startswith("12 + 7 =")
    mtime = os.path.getmtime(os.path.join(path, "config.json"))
    assert models.convert_gguf(gguf, path) == path and os.path.getmtime(os.path.join(path, "config.json")) == mtime



def test_gguf_reuse_and_refusals(smollm2_dir, text_dir, tmp_path, capsys):
    """A conversion is reused only for the same file (path, size, mtime from os.stat) with its config, tokenizer and
    weights; a file that is not GGUF is refused with one clear error before transformers sees it; multi-turn flags
    need a chat template, a GGUF file's read from its conversion as grpo.py's start-up finds it (model_path_for:
    SmolLM2's has one; the tiny text model has none)."""
    import grpo
    import launch
    from tasks import DataConfig
    path, gguf = smollm2_dir
    st = os.stat(gguf)
    source = {"gguf": os.path.abspath(gguf), "size": st.st_size, "mtime": st.st_mtime}
    assert models.conversion_is_current(path, source)
    assert not models.conversion_is_current(path, {**source, "mtime": st.st_mtime + 1})  # the file changed
    for missing in ("model.safetensors", "tokenizer_config.json"):
        partial = tmp_path / f"no-{missing}"
        partial.mkdir()
        for f in {"gguf_source.json", "config.json", "tokenizer_config.json", "model.safetensors"} - {missing}:
            os.symlink(os.path.join(path, f), partial / f)
        assert not models.conversion_is_current(str(partial), source), missing
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip, not a GGUF file")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        models.convert_gguf_once(str(fake), str(tmp_path / "converted"))
    out = tmp_path / "run"
    (out / "converted").mkdir(parents=True)
    os.symlink(path, out / "converted" / os.path.splitext(os.path.basename(gguf))[0])  # as an earlier run left it
    tools = DataConfig(tools=("tasks:multiply",))
    assert launch.model_path_for(grpo.Config(model=gguf, data=tools, output_dir=str(out))).endswith("Q4_1")
    assert "(reused; kept for later runs)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="has no chat template"):
        launch.model_path_for(grpo.Config(model=text_dir, data=tools))
    assert launch.model_path_for(grpo.Config(model=text_dir)) == text_dir  # single-turn: no template needed


def test_encode_prompt_uses_the_real_chat_template(smollm2_dir):
    """The real BPE tokenizer's ChatML template (SmolLM2's own, with its default system turn)."""
    import grpo
    _, tok = models.load_policy(smollm2_dir[0])
    enc = grpo.encode_prompt({"prompt": "What is 12 + 7?"}, tok, 512, system_prompt="Answer with a number.")
    assert enc["text"] == ("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nWhat is 12 + 7?"
                           "<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "system", "content": "Answer with a number."},
                                   {"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True)
    assert enc["prompt_ids"] == list(getattr(ids, "input_ids", ids))
    default = grpo.encode_prompt({"prompt": "hi"}, tok, 512)["text"]
    assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # the template's own
    assert grpo.encode_prompt({"prompt": "What is 12 + 7?"}, tok, 5)["prompt_ids"] == enc["prompt_ids"][-5:]


def test_engine_matches_trainer_before_and_after_an_update(smollm2_dir):
    """Real vLLM engine vs the trainer's fused log-probs, float32 (own process: one engine per process)."""
    import sys
    from conftest import run
    _, out, _ = run([sys.executable, "tests/real_model_check.py", smollm2_dir[0]], timeout=400)
    assert "REAL MODEL OK" in out, out[-3000:]
    print(next(line for line in out.splitlines() if line.startswith("mean |dlogp|")))


def _two_rank_run(out, *model_args, extra=()):
    import json
    from conftest import torchrun
    args = ["grpo.py", "--output-dir", out, *model_args, "--dataset", "arith", "--max-steps", "2",
            "--num-generations", "4", "--batch-size", "4", "--rollout.max-completion-length", "16",
            "--rollout.max-prompt-length", "96", "--log.completions-every", "0",
            "--data.rewards", "rewards_for_tests:async_alternating", *extra]  # every group has a signal, whatever is drawn
    _, log, secs = torchrun(*args, timeout=600)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return log, secs, rows


def _reuse_conversion(out, smollm2_dir):
    """The session fixture's conversion (models.convert_gguf, 40 s here) stands where a GGUF --model caches its own,
    so the run takes the reuse path of models.convert_gguf_once (the fixture tests the conversion itself)."""
    gguf = smollm2_dir[1]
    os.makedirs(os.path.join(out, "converted"))
    os.symlink(smollm2_dir[0], os.path.join(out, "converted", os.path.splitext(os.path.basename(gguf))[0]))
    return gguf


def test_two_rank_grpo_on_the_real_model_full_fine_tuning(smollm2_dir, tmp_path):
    """`torchrun --nproc_per_node 2 grpo.py --model SmolLM2.gguf`: full fine-tuning, FSDP2 over 2 gloo ranks, the HF
    engine synced each step and matching the trainer's log-probs; the saved checkpoint is the moved model."""
    out = str(tmp_path / "run")
    gguf = _reuse_conversion(out, smollm2_dir)
    log, secs_full, rows = _two_rank_run(out, "--model", gguf, extra=["--optim.lr", "1e-5", "--rollout.engine", "hf"])
    assert "float32 HF folder" in log and "reused" in log
    assert [r["step"] for r in rows] == [1, 2]
    # the engine matches the trainer at step 1 and again after an update + sync at step 2; the updates moved the policy
    assert all(r["logprob_mismatch/mean_abs"] <= 1e-3 for r in rows), rows
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows)
    saved, _ = models.load_policy(os.path.join(out, "checkpoint-2"))
    assert type(saved).__name__ == "LlamaForCausalLM"
    start, _ = models.load_policy(smollm2_dir[0])
    moved = max((a - b).abs().max().item() for a, b in zip(saved.state_dict().values(), start.state_dict().values()))
    assert moved > 1e-7, moved
    print(f"2-rank full fine-tuning on SmolLM2: {secs_full:.0f}s")


def test_lora_adapter_sync_agrees_like_merged_on_the_real_model(smollm2_dir, tmp_path):
    """LoRA on SmolLM2-135M (--model FOLDER --policy.gguf-file NAME), fp32, 2 ranks, the real vLLM engine, 2 steps
    with the adapter moving (lr 1e-3) and a KL term, once per --lora.sync mode: the engine/trainer log-prob mismatch
    is at fp32 precision at both steps (the second after an update and its sync) in both modes and the same to 1e-4, the adapter sync sends a few percent of
    the merged sync's bytes, and the checkpoint holds the adapter."""
    rows = {}
    for mode in ("adapter", "merged"):
        out = str(tmp_path / mode)
        gguf = _reuse_conversion(out, smollm2_dir)
        log, secs, rows[mode] = _two_rank_run(out, "--model", os.path.dirname(gguf), "--policy.gguf-file",
                                              os.path.basename(gguf), extra=[
            "--lora.r", "8", "--lora.sync", mode, "--optim.lr", "1e-3", "--loss.beta", "0.04", "--rollout.engine", "vllm",
            "--vllm.max-model-len", "128"])
        assert "reused" in log and [r["step"] for r in rows[mode]] == [1, 2]
        assert all(r["logprob_mismatch/mean_abs"] <= 1e-3 for r in rows[mode]), (mode, rows[mode])
        assert all(r["grad_norm"] > 0 for r in rows[mode])  # the adapter moves at every update
        assert rows[mode][1]["kl"] > 0
        assert os.path.exists(os.path.join(out, "checkpoint-2", "adapter_model.safetensors"))
        print(f"2-rank LoRA ({mode} sync) on SmolLM2: {secs:.0f}s")
    for a, m in zip(rows["adapter"], rows["merged"]):
        assert abs(a["logprob_mismatch/mean_abs"] - m["logprob_mismatch/mean_abs"]) <= 1e-4, (a, m)
    assert 0 < rows["adapter"][1]["sync/bytes"] < 0.05 * rows["merged"][1]["sync/bytes"]


def test_a_python_task_library_and_an_environment_on_the_real_model(smollm2_dir, tmp_path):
    """The test task library as a researcher's own on SmolLM2, 2 ranks, the HF engine: rows from Python without a
    prompt column (--dataset task_library:seed_rows), an environment configured by --env-args whose reset() writes
    the prompt, turns capped by --rollout.max-turn-tokens: episodes.jsonl holds exactly
    the episodes the environment saw, scored by its rule, counted in episodes/unfinished_frac and reward/mean
    (tests/test_episodes.py's check, whatever the model writes)."""
    import json
    from conftest import torchrun
    from test_episodes import check_episodes
    out, log = str(tmp_path / "run"), str(tmp_path / "env.jsonl")
    gguf = _reuse_conversion(out, smollm2_dir)
    _, text, _ = torchrun("grpo.py", "--output-dir", out, "--model", gguf, "--dataset", "task_library:seed_rows",
                          "--env", "task_library:SeedGame", "--env-args", json.dumps({"log": log}), "--rollout.max-turns",
                          "2", "--rollout.max-turn-tokens", "6", "--rollout.max-completion-length", "16",
                          "--log.episodes-every", "1", "--max-steps", "1", "--num-generations", "4", "--batch-size", "8",
                          "--rollout.engine", "hf", "--optim.lr", "1e-5", "--log.completions-every", "0",
                          "--eval.every", "1", "--eval.num-prompts", "4", timeout=600)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1] and "eval/accuracy" in rows[1]  # held-out rows without prompts too
    assert re.search(r"eval: accuracy \S+ -> \S+ by env", text)  # the environment's reward is the check
    check_episodes(out, log, rows, 16)  # (8 per rank)
