"""models.py + rollout.py against the real vLLM engine (CPU build) and real transformers models."""
import copy
import itertools
import re
import shutil

import pytest
import torch
import transformers

import flags
import grpo
import models
import rollout
import token_logprobs
import weight_sync

PROMPTS = [[24, 12, 35, 38, 5, 38, 9, 43], [24, 12, 35, 38, 9, 43], [30, 17, 30, 38, 6]]


def hf_logps(model, prompt, completion, temperature=1.0):
    """Naive reference: full logits -> log_softmax(logits / T) at the completion tokens."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def greedy(engine, prompts=PROMPTS, n_tokens=8):
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], n=1, temperature=0.0, max_tokens=n_tokens)
    return [o[0].token_ids for o in outs]


def sync(engine, model):
    engine.load_weights(weight_sync.iter_engine_weights(model, torch.float32))


@pytest.fixture
def base_model(text_dir, engine):
    model, _ = models.load_policy(text_dir)
    yield model
    fresh, _ = models.load_policy(text_dir)
    sync(engine, fresh)  # leave the shared engine with the checkpoint's weights


def test_text_checkpoint_loads_as_causal_lm(text_dir):
    model, tok = models.load_policy(text_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert tok.padding_side == "left" and tok.pad_token is not None
    token_logprobs.check_head_transform(model)


def test_sync_perturbed_weights_changes_then_restores_greedy_output(engine, base_model):
    before = greedy(engine)
    original = copy.deepcopy(base_model.state_dict())
    with torch.no_grad():
        for p in base_model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    sync(engine, base_model)
    assert greedy(engine) != before
    base_model.load_state_dict(original)
    sync(engine, base_model)
    assert greedy(engine) == before


def test_one_attention_projection_reaches_fused_qkv(engine, base_model):
    out = engine.generate([{"prompt_token_ids": PROMPTS[0]}], n=1, temperature=1.0, max_tokens=8, seeds=[[7]])[0][0]
    with torch.no_grad():
        base_model.model.layers[0].self_attn.k_proj.weight.add_(0.3 * torch.randn(base_model.model.layers[0].self_attn.k_proj.weight.shape))
    ref = hf_logps(base_model, PROMPTS[0], out.token_ids)
    assert (ref - torch.tensor(out.logprobs, dtype=torch.float64)).abs().max() > 1e-3  # the change matters
    sync(engine, base_model)
    # same tokens, scored by the engine with the new k_proj (greedy-free: prompt + forced continuation via logprobs)
    out2 = engine.generate([{"prompt_token_ids": PROMPTS[0]}], n=1, temperature=1.0, max_tokens=8, seeds=[[7]])[0][0]
    ref2 = hf_logps(base_model, PROMPTS[0], out2.token_ids)
    assert (ref2 - torch.tensor(out2.logprobs, dtype=torch.float64)).abs().max() < 1e-4


def test_layer_buckets_never_split_a_layer():
    t = torch.zeros(256)  # 1 KiB
    names = ["model.embed_tokens.weight", "model.layers.0.a", "model.layers.0.b", "model.layers.1.a",
             "model.layers.1.b", "model.layers.10.a", "model.norm.weight"]
    buckets = [[n for n, _ in b] for b in weight_sync.layer_buckets(((n, t) for n in names), 1)]
    assert buckets == [["model.embed_tokens.weight"], ["model.layers.0.a", "model.layers.0.b"],
                       ["model.layers.1.a", "model.layers.1.b"], ["model.layers.10.a"], ["model.norm.weight"]]
    assert len(list(weight_sync.layer_buckets(((n, t) for n in names), 10**9))) == 1


def test_bucketed_sync_matches_trainer(engine, base_model):
    with torch.no_grad():
        for p in base_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.bucket_mb, old = 0, engine.bucket_mb  # one decoder layer per reload call
    try:
        sync(engine, base_model)
    finally:
        engine.bucket_mb = old
    out = engine.generate([{"prompt_token_ids": PROMPTS[2]}], n=1, temperature=1.0, max_tokens=8, seeds=[[11]])[0][0]
    assert (hf_logps(base_model, PROMPTS[2], out.token_ids) - torch.tensor(out.logprobs, dtype=torch.float64)).abs().max() < 1e-4


def test_logprob_agreement_engine_vs_trainer_t07(engine, base_model):
    """Engine (processed log-probs, T=0.7, top-p 1) vs the trainer's fused log-probs of the same tokens, float32, after
    a real optimizer update of every parameter and a sync (so a sync that left any part of the engine stale, e.g. the
    CPU backend's re-packed lm-head, shows), at the precision fp32 gives (1.7e-7 mean, 9.5e-7 max measured; a sync
    that skipped the lm-head and embeddings measured 0.19 mean): mean <= 1e-5, max <= 1e-4, margins for other CPU
    kernels."""
    opt = torch.optim.AdamW(base_model.parameters(), lr=1e-2)
    batch = grpo.collate([{"prompt_ids": p, "completion_ids": p[:3]} for p in PROMPTS], 0, torch.device("cpu"), 3)
    (-token_logprobs.TokenLogprobs(base_model)(batch, 1.0)[0].sum()).backward()
    opt.step()
    sync(engine, base_model)
    outs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], n=4, temperature=0.7, max_tokens=8,
                          seeds=rollout.completion_seeds(1, 0, 0, len(PROMPTS), 4))
    samples = [{"prompt_ids": p, "completion_ids": c.token_ids} for p, o in zip(PROMPTS, outs) for c in o]
    T = max(len(s["completion_ids"]) for s in samples)
    batch = grpo.collate(samples, 0, torch.device("cpu"), T)
    with torch.no_grad():
        trainer, _ = token_logprobs.TokenLogprobs(base_model)(batch, 0.7)
    diffs, naive_diffs = [], []
    for i, (s, c) in enumerate(zip(samples, [c for o in outs for c in o])):
        n = len(c.token_ids)
        diffs.append((trainer[i, :n].double() - torch.tensor(c.logprobs, dtype=torch.float64)).abs())
        naive_diffs.append((hf_logps(base_model, s["prompt_ids"], c.token_ids, 0.7) - trainer[i, :n].double()).abs())
    mean_abs, max_abs = torch.cat(diffs).mean().item(), torch.cat(diffs).max().item()
    print(f"measured engine vs trainer |dlogp| after an update and a sync (float32, T=0.7): mean {mean_abs:.2e}, "
          f"max {max_abs:.2e}")
    assert mean_abs <= 1e-5 and max_abs <= 1e-4, (mean_abs, max_abs)
    assert torch.cat(naive_diffs).max() < 1e-5  # fused trainer path == naive log_softmax path


def test_shared_prompt_blocks_keep_engine_logprobs_exact(engine, base_model):
    """Prompts longer than the CPU block size (32): the 4 completions of each reuse its full blocks from the prefix
    cache, written in the same step. Their log-probs still equal the naive full-forward ones."""
    assert engine.llm.llm_engine.vllm_config.cache_config.block_size == 32  # vLLM's CPU default (128) shares nothing
    prompts = [[3 + (7 * i + k) % 45 for i in range(70)] for k in range(2)]  # 2 full blocks + 6 tokens each
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], n=4, temperature=1.0, max_tokens=8,
                           seeds=rollout.completion_seeds(2, 0, 0, len(prompts), 4))
    diffs = torch.cat([(hf_logps(base_model, p, c.token_ids) - torch.tensor(c.logprobs, dtype=torch.float64)).abs()
                       for p, o in zip(prompts, outs) for c in o])
    assert diffs.mean() <= 1e-4 and diffs.max() <= 1e-3, (diffs.mean(), diffs.max())
    from vllm import SamplingParams  # and the sharing happened: later copies of a prompt hit its 2 full blocks
    engine.llm.reset_prefix_cache()
    outs = engine.llm.generate([{"prompt_token_ids": prompts[0]}] * 4,
                               [SamplingParams(max_tokens=2, seed=k, detokenize=False) for k in range(4)], use_tqdm=False)
    assert [o.num_cached_tokens for o in outs][1:] == [64] * 3, [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("variant", [{}, {"use_dora": True, "use_rslora": True}])
def test_lora_merged_sync_matches_peft_model(engine, text_dir, variant):
    policy, _ = models.load_policy(text_dir, lora=models.LoraConfig(r=8, alpha=16, **variant))
    assert models.is_peft(policy)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=5e-2)
    ids = torch.tensor([PROMPTS[0] + [5, 6, 7, 8]])
    for _ in range(5):  # a few real training steps so lora_B is far from zero
        loss = -torch.log_softmax(policy(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    policy.eval()
    sync(engine, policy)
    engine_greedy = greedy(engine, n_tokens=6)
    with torch.no_grad():
        for p, eg in zip(PROMPTS, engine_greedy):
            hf = policy.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            assert hf == eg
    out = engine.generate([{"prompt_token_ids": PROMPTS[1]}], n=1, temperature=1.0, max_tokens=8, seeds=[[3]])[0][0]
    assert (hf_logps(policy, PROMPTS[1], out.token_ids) - torch.tensor(out.logprobs, dtype=torch.float64)).abs().max() < 1e-4
    # the reference under PEFT is the adapter-disabled module, which equals the base checkpoint
    base, _ = models.load_policy(text_dir)
    kind, ref = models.build_reference(policy, text_dir, beta=0.1, lora=models.LoraConfig(r=8))
    assert kind == "disabled_adapter" and ref is policy
    with policy.disable_adapter():
        ref_lp = hf_logps(policy, PROMPTS[1], out.token_ids)
    torch.testing.assert_close(ref_lp, hf_logps(base, PROMPTS[1], out.token_ids))
    assert not torch.allclose(ref_lp, hf_logps(policy, PROMPTS[1], out.token_ids))
    sync(engine, base)


def test_reference_rules(text_dir):
    policy, _ = models.load_policy(text_dir)
    assert models.build_reference(policy, text_dir, beta=0.0) == ("none", None)
    kind, ref = models.build_reference(policy, text_dir, beta=0.04)
    assert kind == "copy" and ref is not policy and not any(p.requires_grad for p in ref.parameters())
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(ref.parameters(), policy.parameters()))
    peft_policy, _ = models.load_policy(text_dir, lora=models.LoraConfig(r=4))
    n_before = sum(p.numel() for p in peft_policy.parameters())
    kind, ref = models.build_reference(peft_policy, text_dir, beta=0.04, lora=models.LoraConfig(r=4))
    assert kind == "disabled_adapter" and ref is peft_policy
    assert sum(p.numel() for p in peft_policy.parameters()) == n_before  # no copy, no new adapter


def test_name_mismatch_raises_one_clear_error(engine, base_model, monkeypatch):
    class Renamed(torch.nn.Module):  # names like a PEFT model whose prefixes were not stripped
        def __init__(self, inner):
            super().__init__()
            self.config = inner.config
            self.wrapper = inner
    with pytest.raises(ValueError, match=r"not known to the engine:\n  wrapper\.model\.embed_tokens\.weight"):
        weight_sync.check_sync_names(engine, Renamed(base_model))
    weight_sync.check_sync_names(engine, base_model)  # the real names pass
    assert engine.unknown_names(["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight"]) == []
    monkeypatch.setattr(engine, "model_path", "Qwen/a-hub-id")  # --model a hub id: no folder to list, the engine decides
    weight_sync.check_sync_names(engine, base_model)


def test_vlm_loads_with_image_text_class(vlm_dir, text_dir):
    model, processor = models.load_policy(vlm_dir)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    names = dict(model.named_parameters())
    assert any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("model.language_model.") for n in names)
    assert not any(n.startswith("model.layers.") for n in names)
    assert all(not p.requires_grad for n, p in names.items() if n.startswith("model.visual."))
    assert all(p.requires_grad for n, p in names.items() if n.startswith("model.language_model."))
    assert processor.tokenizer.padding_side == "left"
    unfrozen, _ = models.load_policy(vlm_dir, freeze_vision=False)
    assert all(p.requires_grad for n, p in unfrozen.named_parameters() if n.startswith("model.visual."))
    lora, _ = models.load_policy(vlm_dir, lora=models.LoraConfig(r=4))
    assert not any("lora_" in n and "visual" in n for n, _ in lora.named_parameters())
    assert any("lora_" in n and "language_model" in n for n, _ in lora.named_parameters())
    assert type(models.load_policy(text_dir)[0]).__name__ == "Qwen2ForCausalLM"


def test_vlm_engine_sync_and_logprobs(vlm_dir):
    """In its own process: one vLLM engine per process (the text engine lives in this one)."""
    from conftest import run
    import sys
    _, out, _ = run([sys.executable, "tests/vlm_engine_check.py", vlm_dir], timeout=300)
    assert "VLM OK" in out, out[-3000:]


def test_unhandled_head_transform_fails_loudly(text_dir):
    model, _ = models.load_policy(text_dir)
    model.config.final_logit_softcapping = 0.5  # claims a softcap the model does not apply
    with pytest.raises(ValueError, match="head transform is not handled"):
        token_logprobs.check_head_transform(model)


def test_continued_adapter_reference_is_a_frozen_copy(text_dir, tmp_path):
    """Re-training an existing adapter: the reference is that adapter, frozen, under a second name."""
    first, _ = models.load_policy(text_dir, lora=models.LoraConfig(r=4))
    with torch.no_grad():
        for n, p in first.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    first.save_pretrained(tmp_path / "adapter")
    cont = models.LoraConfig(adapter=str(tmp_path / "adapter"))
    policy, _ = models.load_policy(text_dir, lora=cont)
    kind, ref = models.build_reference(policy, text_dir, beta=0.1, lora=cont)
    assert kind == "adapter" and ref is policy
    assert all(not p.requires_grad for n, p in policy.named_parameters() if ".reference." in n)
    assert any(p.requires_grad for n, p in policy.named_parameters() if ".default." in n)
    saved = hf_logps(first, PROMPTS[0], [5, 6, 7])
    with torch.no_grad():  # train the live adapter away from the saved one
        for n, p in policy.named_parameters():
            if ".default." in n and "lora_B" in n:
                p.add_(1.0)
    policy.set_adapter("reference")
    torch.testing.assert_close(hf_logps(policy, PROMPTS[0], [5, 6, 7]), saved)
    policy.set_adapter("default")
    assert not torch.allclose(hf_logps(policy, PROMPTS[0], [5, 6, 7]), saved)


def test_partial_sync_sends_whole_layers_for_a_q_only_adapter(engine, base_model, text_dir):
    """LoRA on q_proj only: the partial sync (trainable/merged weights) must still send k/v of the same layers,
    because vLLM fuses q/k/v and a reload of q alone corrupts the fused weight."""
    policy, _ = models.load_policy(text_dir, lora=models.LoraConfig(r=4, target_modules=("q_proj",)))
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    sent = [n for n, _ in weight_sync.iter_engine_weights(policy, torch.float32, full=False)]
    assert "model.layers.0.self_attn.k_proj.weight" in sent and "model.embed_tokens.weight" not in sent
    sync(engine, base_model)  # engine = base weights, then the partial update on top
    engine.load_weights(weight_sync.iter_engine_weights(policy, torch.float32, full=False))
    out = engine.generate([{"prompt_token_ids": PROMPTS[0]}], n=1, temperature=1.0, max_tokens=8, seeds=[[2]])[0][0]
    diff = (hf_logps(policy, PROMPTS[0], out.token_ids) - torch.tensor(out.logprobs, dtype=torch.float64)).abs().max()
    assert diff < 1e-4, diff


def test_topk_topp_logprobs_match_engine_after_updates(engine, base_model):
    """The trainer scores the distribution the engine sampled from (temperature 0.8, top-p 0.9, top-k 5), through
    several real weight updates and syncs: mean |engine - trainer| <= 1e-3 (fp32). Full-softmax log-probs, what the
    trainer used before, are far off on the same tokens."""
    opt = torch.optim.AdamW(base_model.parameters(), lr=2e-2)
    module = token_logprobs.TokenLogprobs(base_model)
    for update in range(3):
        sync(engine, base_model)
        outs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], n=4, temperature=0.8, top_p=0.9, top_k=5,
                               max_tokens=8, seeds=rollout.completion_seeds(3, update, 0, len(PROMPTS), 4))
        samples = [{"prompt_ids": p, "completion_ids": c.token_ids} for p, o in zip(PROMPTS, outs) for c in o]
        engine_lp = [c.logprobs for o in outs for c in o]
        batch = grpo.collate(samples, 0, torch.device("cpu"), max(len(s["completion_ids"]) for s in samples))
        lp, _ = module(batch, 0.8, top_k=5, top_p=0.9)  # [B, T]
        with torch.no_grad():
            full, _ = module(batch, 0.8)
        diffs = torch.cat([(lp[i, :len(e)].detach().double() - torch.tensor(e, dtype=torch.float64)).abs()
                           for i, e in enumerate(engine_lp)])
        full_diffs = torch.cat([(full[i, :len(e)].double() - torch.tensor(e, dtype=torch.float64)).abs()
                                for i, e in enumerate(engine_lp)])
        assert diffs.mean() <= 1e-3, (update, diffs.mean())
        assert full_diffs.mean() > 0.05, full_diffs.mean()  # the truncation matters at this setting
        (-lp.sum()).backward()  # a real update of every parameter, then the next round syncs it
        opt.step()
        opt.zero_grad()


def test_completion_seeds_distinct_across_the_run_and_reproducible():
    seeds = [s for step in range(3) for rank in range(4) for row in rollout.completion_seeds(7, step, 16 * rank, 16, 8)
             for s in row]
    assert len(set(seeds)) == len(seeds) == 3 * 4 * 16 * 8 and all(0 <= s < 2**63 for s in seeds)
    assert rollout.completion_seeds(7, 2, 1, 16, 8) == rollout.completion_seeds(7, 2, 1, 16, 8)
    assert rollout.completion_seeds(8, 2, 1, 16, 8) != rollout.completion_seeds(7, 2, 1, 16, 8)
    whole = rollout.completion_seeds(7, 2, 0, 16, 8)  # a batch cut in two draws what it draws whole
    assert rollout.completion_seeds(7, 2, 0, 6, 8) + rollout.completion_seeds(7, 2, 6, 10, 8) == whole


def test_held_out_rows_draw_the_same_seeds_however_they_are_cut_over_ranks(monkeypatch):
    """grpo.eval_rollouts: each held-out row's n samples take the same seeds whether the rows are cut (strided) over 1,
    2 or 3 data-parallel ranks or TP groups (as one rank draws them), and no two completions share a seed. Checked to
    fail when the seeds were keyed by the rank's first place (dp * rows) plus the row's index in the rank's share."""
    import types
    got = []
    monkeypatch.setattr(grpo, "encode_prompt", lambda row, *a: {})
    monkeypatch.setattr(grpo, "rollouts", lambda run, enc, n, t, seeds: got.extend(zip((e["row"]["i"] for e in enc), seeds)))
    cfg = grpo.Config()
    cfg.eval.n_samples = 4
    run = types.SimpleNamespace(cfg=cfg, eval_rows=[{"i": i} for i in range(7)], processor=None, tools={})
    layouts = []
    for n_dp in (1, 2, 3):
        got.clear()
        for dp in range(n_dp):
            grpo.eval_rollouts(run, 5, dp, n_dp)
        layouts.append(dict(got))
    assert sorted(layouts[0]) == list(range(7)) and layouts[1] == layouts[0] and layouts[2] == layouts[0]
    seeds = [s for row in layouts[0].values() for s in row]
    assert len(set(seeds)) == len(seeds) == 7 * 4


@pytest.mark.parametrize("kind", ["vllm", "hf"])
def test_every_completion_draws_its_own_noise(kind, engine, text_dir):
    """One prompt sent 8 times with n=8 (only the sampling noise can tell the 64 completions apart) on two data-parallel
    ranks: nearly all distinct within a rank, no rank repeats the other's, and the same seeds give the same tokens."""
    eng = engine if kind == "vllm" else rollout.HFEngine(text_dir, seed=0)
    prompts = [{"prompt_token_ids": PROMPTS[0]}] * 8

    def draw(rank):
        outs = eng.generate(prompts, n=8, temperature=1.0, max_tokens=8, seeds=rollout.completion_seeds(5, 0, 8 * rank, 8, 8))
        return [tuple(c.token_ids) for o in outs for c in o]

    r0, r1 = draw(0), draw(1)
    assert len(set(r0)) >= 60 and len(set(r1)) >= 60, (len(set(r0)), len(set(r1)))  # shared noise gave 8-17 of 64
    assert len(set(r0) & set(r1)) <= 2
    assert draw(0) == r0  # reproducible: an exact resume redraws the same completions


def test_rank_batch_over_the_token_budget_samples_as_each_prompt_alone(engine, text_dir):
    """32 distinct prompts of 200 tokens x 2 seeded completions (6,400 prompt tokens: more than the 4,096 vLLM's CPU
    engine prefills a step). A prompt cut across steps used to stop the run ('CPU Generator does not use offset': a
    chunked prefill rewinds its seeded generator, which CPU generators cannot); now every prompt is prefilled whole,
    and each completion is the one its seed draws when its prompt is generated alone."""
    vocab = len(transformers.AutoTokenizer.from_pretrained(text_dir))
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (200,), generator=g).tolist()} for _ in range(32)]
    seeds = rollout.completion_seeds(3, 0, 0, 32, 2)
    assert 32 * 200 > engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens  # more than one step
    batch = engine.generate(prompts, n=2, temperature=1.0, max_tokens=6, seeds=seeds)
    alone = [engine.generate([p], n=2, temperature=1.0, max_tokens=6, seeds=[s])[0] for p, s in zip(prompts, seeds)]
    assert [[c.token_ids for c in o] for o in batch] == [[c.token_ids for c in o] for o in alone]
    assert len({tuple(c.token_ids) for o in batch for c in o}) >= 48  # different prompts and seeds, different draws


@pytest.mark.parametrize("top_k", [0, 3])
def test_sampler_frequencies_follow_the_tempered_softmax(top_k):
    """20,000 rows with their own seeds, one step over fixed scores: each token's frequency is within 5 standard
    errors of its probability under softmax((scores + bias) / T) in float64, renormalised over the top k; the banned
    token and those outside the top k never come. Two steps: the second uses each row's next uniform."""
    scores = torch.tensor([1.0, 2.5, 0.3, 2.0, -1.0, 3.0])  # [V]
    bias = torch.tensor([0, 0, 0, 0, 0, token_logprobs.PLACEHOLDER_BIAS])  # token 5 banned
    R, T = 20_000, 0.7
    sampler = rollout.PerCompletionSampler(list(range(R)), T, top_k, 1.0, bias, steps=2)
    p = torch.softmax(scores.double()[:5] / T, 0).tolist() + [0.0]
    if top_k:
        kept = sorted(range(5), key=lambda i: -p[i])[:top_k]
        p = [p[i] / sum(p[j] for j in kept) if i in kept else 0.0 for i in range(6)]
    draws = [sampler.draw(scores.expand(R, 6), torch.arange(R))[0] for _ in range(2)]
    for tokens in draws:
        freq = torch.bincount(tokens, minlength=6).double() / R
        for f, q in zip(freq.tolist(), p):
            assert abs(f - q) <= 5 * (q * (1 - q) / R) ** 0.5, (freq, p)
    assert (draws[0] != draws[1]).float().mean() > 0.3  # a fresh uniform per step, not the same one again


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.7), (2, 0.9), (0, 1.0)])
def test_sampler_at_the_edges_of_its_uniforms_draws_only_kept_tokens(top_k, top_p):
    """Uniforms set by hand at 0, just below 1 and on every exact CDF boundary (where an off-by-one would pick a
    token of probability 0): the token is the first kept one whose cumulative probability, summed in Python over the
    same float32 log-probs, exceeds u times the total, and its log-prob is finite. The kept sets are worked out by hand
    (probabilities at T 0.7: token 5 0.45, tokens 1 and 6 0.22 each, 3 0.11; token 0 banned)."""
    scores = torch.tensor([[1.0, 2.5, 0.3, 2.0, -1.0, 3.0, 2.5]])  # [1, V]: a tie (1 and 6)
    bias = torch.tensor([token_logprobs.PLACEHOLDER_BIAS, 0, 0, 0, 0, 0, 0])
    T = 0.7
    kept = {(3, 1.0): [1, 5, 6], (0, 0.7): [1, 5, 6], (2, 0.9): [1, 5, 6], (0, 1.0): [0, 1, 2, 3, 4, 5, 6]}
    z = ((scores[0] + bias) / T)  # [V], as the sampler computes it
    if top_k or top_p < 1:
        z = torch.full_like(z, float("-inf")).index_copy(0, torch.tensor(kept[top_k, top_p]), z[kept[top_k, top_p]])
    cum = list(itertools.accumulate(z.log_softmax(0).double().exp().tolist()))
    edges = [0.0, 1 - 2 ** -53] + [c / cum[-1] for c in cum if c < cum[-1]]
    sampler = rollout.PerCompletionSampler([0] * len(edges), T, top_k, top_p, bias)
    sampler.u = torch.tensor(edges, dtype=torch.float64)[:, None]  # [rows, 1]
    tokens, logps = sampler.draw(scores.expand(len(edges), -1), torch.arange(len(edges)))
    for u, t, lp in zip(edges, tokens.tolist(), logps.tolist()):
        want = next(i for i, c in enumerate(cum) if i != 0 and c > u * cum[-1])  # token 0's share is ~1e-64
        assert t == want and lp > -30, (u, t, want, lp)


def test_kept_token_moves_masked_picks_to_a_kept_neighbour():
    """What a parallel (CUDA) cumsum's rounding could pick: masked tokens go to the nearest kept one below, or above
    when there is none below."""
    z = torch.tensor([[float("-inf"), -1.0, float("-inf"), float("-inf"), -0.5]] * 3)
    got = rollout.kept_token(z, torch.tensor([0, 3, 4]))
    assert got.tolist() == [1, 1, 4]


@pytest.mark.parametrize("bias", [True, False])
def test_weight_stationary_linear_is_f_linear(bias):
    lin = torch.nn.Linear(24, 40, bias=bias).double()
    for shape in [(3, 24), (2, 5, 24), (1, 1, 24)]:
        x = torch.randn(shape, dtype=torch.float64)
        reference = torch.nn.functional.linear(x, lin.weight, lin.bias)
        torch.testing.assert_close(rollout.weight_stationary_linear(lin, x), reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("stationary_min,repeat,compiled", [(2 ** 17, True, False), (0, True, False),
                                                             (2 ** 17, False, False), (2 ** 17, True, True)])
def test_hf_engine_draws_what_a_naive_per_completion_decode_draws(text_dir, monkeypatch, stationary_min, repeat,
                                                                  compiled):
    """The HF engine against a naive loop per completion: full forward of the prefix, banned-token bias,
    log_softmax(logits / T), then the token where the float64 cumulative probability first exceeds one uniform from
    that completion's own seed, drawn one step at a time (T = 0: plain argmax). Same tokens, log-probs to 1e-5
    (batched cached decode vs full forwards). Three ways: as it runs (each prompt prefilled once, its cache repeated,
    rows leaving the batch as they stop or reach their limit; the tiny model's linears stay F.linear), with every
    linear weight-stationary, and through transformers generate() over the sampler's one-hot scores (what models
    whose cache cannot be repeated use), and --rollout.compile-decode's (every row to the end, in a static cache kept
    per shape, the step compiled by inductor). Each way decodes greedily, samples, and samples with 11 stop tokens, so
    rows stop at different steps; the last two calls share a shape, so the compiled one reuses its cache."""
    monkeypatch.setattr(rollout, "STATIONARY_MIN", stationary_min)
    eng = rollout.HFEngine(text_dir, seed=0, banned_token_ids=[5, 9], compile_decode=compiled)
    eng.repeat_cache = repeat
    cuts, cut = [], transformers.DynamicCache.batch_select_indices  # rows leaving the decode batch
    monkeypatch.setattr(transformers.DynamicCache, "batch_select_indices", lambda c, i: cuts.append(len(i)) or cut(c, i))
    patched = [m for m in eng.model.modules() if isinstance(m, torch.nn.Linear) and "forward" in m.__dict__]
    assert bool(patched) == (stationary_min == 0)
    model, _ = models.load_policy(text_dir)
    prompts, limits = PROMPTS[:2] + [[17]], [8, 5, 8]  # left padding, a 1-token prompt, per-prompt limits
    bias = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    bias[[5, 9]] = token_logprobs.PLACEHOLDER_BIAS
    stops = eng.stop_ids
    caches = []
    for n, T, stop_ids in [(1, 0.0, stops), (3, 0.8, stops), (3, 0.8, stops + list(range(10, 20)))]:
        eng.stop_ids, cuts[:] = stop_ids, []  # the last: many stop tokens, so rows stop at different steps
        seeds = rollout.completion_seeds(3, 0, 0, len(prompts), n)
        outs = eng.generate([{"prompt_token_ids": p} for p in prompts], n=n, temperature=T, max_tokens=limits,
                            seeds=seeds)
        for p, ss, limit, group in zip(prompts, seeds, limits, outs):
            for seed, c in zip(ss, group):
                gen, ids, logps = torch.Generator().manual_seed(seed), list(p), []
                for _ in range(limit):
                    with torch.no_grad():
                        logits = model(torch.tensor([ids])).logits[0, -1].double() + bias  # [V]
                    z = (logits / (T or 1.0)).log_softmax(-1)
                    u = torch.rand(1, generator=gen, dtype=torch.float64).item()
                    cdf = torch.cumsum(z.exp(), 0)  # [V]: the token is the number of entries at or below u * total
                    ids.append(int((cdf <= u * cdf[-1]).sum()) if T else int(z.argmax()))
                    logps.append(z[ids[-1]].item())
                    if ids[-1] in eng.stop_ids:
                        break
                assert c.token_ids == ids[len(p):]
                assert max(abs(a - b) for a, b in zip(c.logprobs, logps)) <= 1e-5
                assert c.truncated == (ids[-1] not in eng.stop_ids)
        assert bool(cuts) == (repeat and not compiled) and cuts == sorted(set(cuts), reverse=True)  # rows left
        stopped = sum(not c.truncated for group in outs for c in group)
        assert stopped >= (5 if len(stop_ids) > len(stops) else 0)  # (measured: 7 of 9 stop, after 3-6 tokens)
        caches.append(eng.static.get((len(prompts) * n, 256)))
    if compiled:  # a cache per shape, the same one again at the same shape (the addresses CUDA graphs replay)
        assert None not in caches and caches[1] is caches[2] is not caches[0]
    else:
        assert caches == [None] * 3


def test_hf_engine_image_and_text_prompts_match_the_trainer(vlm_dir):
    """Tiny Qwen2.5-VL in the HF engine: an image prompt (M-RoPE positions for the image tokens, as the trainer uses),
    then a text-only batch of another size (no position offsets left over from the image call). Engine log-probs equal
    the trainer's to 1e-4."""
    from PIL import Image
    model, processor = models.load_policy(vlm_dir)
    engine = rollout.HFEngine(vlm_dir, seed=0, banned_token_ids=token_logprobs.placeholder_token_ids(model.config))
    row = {"prompt": [{"role": "user", "content": "What colour is the square?"}], "image": Image.new("RGB", (56, 56), (200, 30, 30))}
    image = grpo.encode_prompt(row, processor, 512)
    text = [grpo.encode_prompt({"prompt": [{"role": "user", "content": q}]}, processor, 512) for q in ("Hi there", "2+2?")]
    for encs, n in [([image], 2), (text, 3)]:
        outs = engine.generate([e["engine"] for e in encs], n=n, temperature=1.0, max_tokens=6,
                               seeds=rollout.completion_seeds(4, 0, 0, len(encs), n))
        samples = [{"prompt_ids": e["prompt_ids"], "completion_ids": c.token_ids, **({"mm": e["mm"]} if "mm" in e else {})}
                   for e, o in zip(encs, outs) for c in o]
        batch = grpo.collate(samples, processor.tokenizer.pad_token_id, torch.device("cpu"),
                             max(len(s["completion_ids"]) for s in samples), processor.image_token_id)
        with torch.no_grad():
            lp, _ = token_logprobs.TokenLogprobs(model)(batch, 1.0)
        for i, c in enumerate(c for o in outs for c in o):
            assert (lp[i, :len(c.logprobs)] - torch.tensor(c.logprobs)).abs().max() < 1e-4, (encs is text, i)


def test_hf_engine_ignores_the_checkpoints_sampling_defaults(text_dir, tmp_path):
    """A checkpoint whose generation_config asks for repetition_penalty / top_k / temperature: the HF engine samples
    only with the flags we pass, so its log-probs are the trainer's (T 0.7, top-k 5, top-p 0.9) to <= 1e-4."""
    from transformers import GenerationConfig
    path = str(tmp_path / "ckpt")
    shutil.copytree(text_dir, path)
    model, tok = models.load_policy(text_dir)
    GenerationConfig(do_sample=True, repetition_penalty=1.5, top_k=2, temperature=0.3,
                     eos_token_id=[tok.eos_token_id, 7]).save_pretrained(path)
    eng = rollout.HFEngine(path, seed=0)
    assert eng.stop_ids == sorted({tok.eos_token_id, 7})  # stop ids are kept, sampling defaults are not
    outs = eng.generate([{"prompt_token_ids": p} for p in PROMPTS], n=4, temperature=0.7, top_k=5, top_p=0.9,
                        max_tokens=8, seeds=rollout.completion_seeds(1, 0, 0, len(PROMPTS), 4))
    samples = [{"prompt_ids": p, "completion_ids": c.token_ids} for p, o in zip(PROMPTS, outs) for c in o]
    batch = grpo.collate(samples, 0, torch.device("cpu"), max(len(s["completion_ids"]) for s in samples))
    with torch.no_grad():
        lp, _ = token_logprobs.TokenLogprobs(model)(batch, 0.7, top_k=5, top_p=0.9)
    for i, c in enumerate(c for o in outs for c in o):
        assert (lp[i, :len(c.logprobs)].double() - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max() <= 1e-4


def test_the_trainers_processor_serves_its_hf_engine_and_reference_copy(text_dir, tmp_path, monkeypatch):
    """The checkpoint's tokenizer loads once per process: the HF engine, the reference copy (--loss.beta > 0) and a
    --distill.teacher get the trainer's (a 150k-token Qwen2 tokenizer takes seconds to load under transformers 5).
    Fails with each loading its own (4 loads)."""
    import torch.distributed as dist

    import launch
    loads = []
    real = models.load_processor
    monkeypatch.setattr(models, "load_processor", lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    mine = not dist.is_initialized()  # (an earlier test of this process may have left one)
    if mine:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cfg = grpo.Config(model=text_dir, loss=grpo.losses.LossConfig(beta=0.04),
                          rollout=rollout.RolloutConfig(engine="hf"), optim=grpo.OptimConfig(lr=1e-3))
        built = launch.build_policy(cfg, text_dir, torch.device("cpu"), teacher_path=text_dir)
        engine = launch.build_engine(cfg, text_dir, built["policy"].config, built["processor"], built["precision"], 0,
                                     torch.device("cpu"))
    finally:
        if mine:
            dist.destroy_process_group()
    assert built["ref_kind"] == "copy" and built["teacher_module"] is not None and isinstance(engine, rollout.HFEngine)
    assert loads == [text_dir] and engine.processor is built["processor"], loads


def test_compile_decode_refuses_what_its_static_cache_cannot_hold(vlm_dir, text_dir, tmp_path):
    """--rollout.compile-decode with an image-text model or a sliding-window one: refused by flags.validate (every
    rank, before any collective) and by the engine itself (a GGUF's config is known only there); a plain Qwen2 passes.
    (Its static cache would hold the sliding layers' window, not their positions.)"""
    import tyro
    sliding = tmp_path / "sliding"
    shutil.copytree(text_dir, sliding)
    config = transformers.AutoConfig.from_pretrained(sliding)
    config.use_sliding_window, config.sliding_window = True, 16
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    config.save_pretrained(sliding)
    for model, unfit in [(vlm_dir, "is an image-text model"),
                         (str(sliding), "is a model whose layers cache as StaticSlidingWindowLayer"), (text_dir, None)]:
        cfg = tyro.cli(grpo.Config, args=["--output-dir", str(tmp_path / "o"), "--model", model, "--rollout.engine", "hf",
                                          "--rollout.compile-decode", "--eval.every", "0"])
        if unfit is None:
            flags.validate(cfg, [])
            continue
        with pytest.raises(ValueError, match=re.escape(f"--rollout.compile-decode needs a text model of full-attention "
                                                       f"layers; --model '{model}' {unfit}. Drop")):
            flags.validate(cfg, [])
    with pytest.raises(ValueError, match="--rollout.compile-decode needs a text model .* StaticSlidingWindowLayer"):
        rollout.HFEngine(str(sliding), seed=0, compile_decode=True)
