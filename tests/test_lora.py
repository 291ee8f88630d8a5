"""LoRA sync: what the engine receives equals PEFT's own merge_and_unload for every adapter kind we accept (plain,
rsLoRA, DoRA, lora_bias, embeddings, a continued adapter next to its frozen reference copy); what the sync or the fused
head cannot serve exactly is refused at load time with a message."""
import copy

import pytest
import torch
from peft import IA3Config, LoraConfig as PeftLoraConfig, get_peft_model

import models
import rollout
import weight_sync
from console import UserError

ATTN = ["q_proj", "k_proj", "v_proj"]  # the Qwen2 projections that carry a bias (lora_bias needs one)


@pytest.fixture(scope="module")
def untied_dir(text_dir, tmp_path_factory):
    """The tiny checkpoint with its own lm head (embeddings untied), so LoRA on the embeddings is servable."""
    model, tok = models.load_policy(text_dir)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() + 0.01)
    path = str(tmp_path_factory.mktemp("tiny-untied"))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def randomize_adapters(model, seed=0):
    """Move every trainable adapter tensor (lora_B off zero, DoRA magnitudes off the weight norms)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
            p.add_(0.3 * torch.randn(p.shape, generator=g))


def assert_sync_equals_peft_merge(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sent = dict(weight_sync.iter_engine_weights(model, torch.float32))
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert sent.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(sent[k], v, rtol=1e-6, atol=1e-6, msg=k)
    base = {models.clean_name(k): v for k, v in before.items() if "lora_" not in k}
    changed = [k for k in sent if not torch.equal(sent[k], base[k])]
    assert changed  # the adapter matters
    after = model.state_dict()  # the training module is untouched, nothing left marked as merged
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(getattr(m, "merged", False) for m in model.modules())
    return changed


@pytest.mark.parametrize("kind", ["lora", "rslora", "dora", "lora_bias"])
def test_sync_equals_merge_and_unload(text_dir, kind):
    extra = {"rslora": dict(use_rslora=True), "dora": dict(use_dora=True), "lora_bias": dict(lora_bias=True)}
    model, _ = models.load_policy(text_dir)
    targets = ATTN if kind == "lora_bias" else models.lora_targets(model)
    model = get_peft_model(model, PeftLoraConfig(r=4, lora_alpha=8, target_modules=targets, **extra.get(kind, {})))
    models.check_lora_supported(model)
    randomize_adapters(model)
    changed = assert_sync_equals_peft_merge(model)
    if kind == "lora_bias":
        assert any(k.endswith("q_proj.bias") for k in changed)


def test_sync_equals_merge_and_unload_dora_on_untied_embeddings(untied_dir):
    lora = models.LoraConfig(r=4, alpha=8, use_dora=True, target_modules=("embed_tokens", "q_proj", "down_proj"))
    model, _ = models.load_policy(untied_dir, lora=lora)
    randomize_adapters(model)
    assert "model.embed_tokens.weight" in assert_sync_equals_peft_merge(model)


def test_continued_dora_adapter_sends_default_not_reference(text_dir, tmp_path):
    model, _ = models.load_policy(text_dir, lora=models.LoraConfig(r=4, alpha=8, use_dora=True, use_rslora=True))
    randomize_adapters(model, seed=1)
    model.save_pretrained(str(tmp_path / "adapter"))
    lora = models.LoraConfig(adapter=str(tmp_path / "adapter"))
    policy, _ = models.load_policy(text_dir, lora=lora)
    kind, _ = models.build_reference(policy, text_dir, beta=0.1, lora=lora)  # loads a frozen 'reference' adapter
    assert kind == "adapter" and "reference" in policy.peft_config
    randomize_adapters(policy, seed=2)  # training moved 'default' away from 'reference'
    assert_sync_equals_peft_merge(policy)


@pytest.mark.parametrize("targets,match", [(("q_proj", "lm_head"), "LoRA on the lm head"),
                                           (("embed_tokens",), "LoRA on tied input embeddings")])
def test_unservable_lora_targets_are_refused_at_load(text_dir, targets, match):
    with pytest.raises(ValueError, match=match):
        models.load_policy(text_dir, lora=models.LoraConfig(r=4, target_modules=targets))


def test_unservable_saved_adapters_are_refused_at_load(text_dir, tmp_path):
    base, _ = models.load_policy(text_dir)
    get_peft_model(copy.deepcopy(base), PeftLoraConfig(r=4, target_modules=ATTN, modules_to_save=["lm_head"])
                   ).save_pretrained(str(tmp_path / "mts"))
    get_peft_model(copy.deepcopy(base), IA3Config(target_modules=["k_proj", "down_proj"],
                                                  feedforward_modules=["down_proj"])).save_pretrained(str(tmp_path / "ia3"))
    with pytest.raises(ValueError, match="modules_to_save"):
        models.load_policy(text_dir, lora=models.LoraConfig(adapter=str(tmp_path / "mts")))
    with pytest.raises(ValueError, match="only LoRA adapters"):
        models.load_policy(text_dir, lora=models.LoraConfig(adapter=str(tmp_path / "ia3")))


# ---- --lora.sync adapter: the engine generates with the adapter itself (vLLM LoRA request, HF engine PEFT layers) ----

def merged_logps(policy, prompt, completion):
    """The independent reference: PEFT's merge_and_unload of the policy, a full forward, log_softmax."""
    return model_logps(copy.deepcopy(policy).merge_and_unload(), prompt, completion)


def model_logps(model, prompt, completion):
    """`model`'s log-probs of `completion` after `prompt` (one full forward, float64 log_softmax)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def test_adapter_sync_on_vllm_at_every_version_and_its_failure(text_dir):
    """tests/lora_engine_check.py, in its own process (one vLLM engine per process): the vLLM engine with LoRA, three
    adapter versions against the merged model, samples changing, no stale prefix cache; a refused adapter."""
    import sys
    from conftest import run
    _, out, _ = run([sys.executable, "tests/lora_engine_check.py", text_dir], timeout=300)
    assert "LORA ENGINE OK" in out, out[-3000:]


def test_adapter_sync_on_the_hf_engine_at_every_version(text_dir):
    """The HF engine with --lora.sync adapter (PEFT layers injected into its copy): at three versions of a moving
    rsLoRA adapter, its log-probs of its own samples equal the merged model's, and its samples change. An adapter it
    cannot take (rank 16 into its rank-8 layers) and a module it has no layer for stop with one message naming
    --lora.sync (not PEFT's size mismatch, nor the image-text hint of a merged sync's unknown names)."""
    engine = rollout.HFEngine(text_dir, seed=0, lora_rank=8)
    policy, _ = models.load_policy(text_dir, lora=models.LoraConfig(r=8, alpha=24, use_rslora=True))
    weight_sync.check_sync_names(engine, policy)
    prompt, seen = [24, 12, 35, 38, 5, 38, 9, 43], []
    for version in range(3):
        randomize_adapters(policy, seed=version)
        engine.load_weights(weight_sync.engine_weights(policy, torch.float32, adapter=True))
        outs = engine.generate([{"prompt_token_ids": prompt}], n=4, temperature=1.0, max_tokens=8,
                               seeds=rollout.completion_seeds(7, 0, 0, 1, 4))[0]
        for c in outs:
            gap = (merged_logps(policy, prompt, c.token_ids) - torch.tensor(c.logprobs, dtype=torch.float64)).abs()
            assert gap.max() < 1e-4, (version, gap.max())
        seen.append([c.token_ids for c in outs])
    assert seen[0] != seen[1] != seen[2]
    wide, _ = models.load_policy(text_dir, lora=models.LoraConfig(r=16, alpha=16))
    with pytest.raises(UserError, match=r"^--lora.sync adapter: the engine refused the adapter: .*"
                                        r"Use --lora.sync merged"):
        engine.load_weights(weight_sync.engine_weights(wide, torch.float32, adapter=True))
    bogus = weight_sync.sync_names(policy, adapter=True)[0].replace("q_proj", "nope_proj")
    with pytest.raises(ValueError, match=r"^--lora.sync adapter: the engine has no LoRA layer for 1 adapter tensors:"
                                         r"(.|\n)*Use --lora.sync merged"):
        weight_sync.raise_unknown_names(engine.unknown_names([bogus]))


@pytest.mark.parametrize("flags,match", [(dict(use_dora=True, sync="adapter"), "DoRA"),
                                         (dict(r=0, sync="adapter"), "with LoRA on"),
                                         (dict(sync="both"), "use adapter or merged")])
def test_lora_sync_flag_is_refused_by_name(text_dir, flags, match):
    with pytest.raises(ValueError, match=match):
        validated(text_dir, **{"r": 8, **flags})


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A tiny GPT-2 checkpoint (2 heads of 64, one layer): an architecture vLLM 0.32 has no LoRA for (its
    GPT2LMHeadModel is not SupportsLoRA), whose input embeddings are named wte."""
    from transformers import GPT2Config, GPT2LMHeadModel
    path = str(tmp_path_factory.mktemp("tiny-gpt2"))
    GPT2LMHeadModel(GPT2Config(n_embd=128, n_head=2, n_layer=1, vocab_size=64, n_positions=64)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama checkpoint's config: an architecture vLLM serves LoRA for."""
    from transformers import LlamaConfig
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=64, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


def validated(model, engine="vllm", **lora):
    """flags.validate_lora_sync's --lora.sync for checkpoint `model`, the engine and LoRA flags given."""
    import flags as flag_checks
    from grpo import Config
    cfg = Config()
    cfg.rollout.engine, cfg.lora = engine, models.LoraConfig(**lora)
    flag_checks.validate_lora_sync(cfg, model)
    return cfg.lora.sync


def test_lora_sync_default_is_adapter_where_the_engine_serves_it(text_dir, llama_dir):
    for lora, want in [(dict(r=8), "adapter"), (dict(r=8, use_dora=True), "merged"), (dict(r=8, sync="merged"), "merged"),
                       (dict(r=1024), "merged")]:  # (vLLM's largest rank is 512: it failed with a bare StopIteration)
        assert validated(text_dir, **lora) == want, lora
    assert validated(llama_dir, r=8) == "adapter"  # Qwen2 (text_dir), Llama: vLLM serves their LoRA


def test_lora_sync_follows_the_engines_architecture_and_what_the_module_is(gpt2_dir, untied_dir, tmp_path, capsys):
    """An architecture vLLM has no LoRA for (GPT-2: vLLM's engine start failed with its own 'does not support LoRA
    yet') defaults to merged with one line saying why, and an explicit --lora.sync adapter is refused by name; the HF
    engine serves GPT-2's adapter. LoRA on an embedding (GPT-2's wte, Qwen2's embed_tokens, a continued adapter's
    regex) is found by what the module is: the adapter sync would send the other layers without its delta."""
    assert validated(gpt2_dir, r=8) == "merged"
    assert capsys.readouterr().out == ("--lora.sync merged (the default here): the adapter sync cannot serve "
                                       "GPT2LMHeadModel: vLLM has no LoRA for this architecture\n")
    with pytest.raises(ValueError, match=r"^--lora.sync adapter cannot serve GPT2LMHeadModel: vLLM has no LoRA for "
                                         r"this architecture. Use --lora.sync merged.$"):
        validated(gpt2_dir, r=8, sync="adapter")
    assert validated(gpt2_dir, "hf", r=8, target_modules=("c_attn", "c_fc")) == "adapter"
    from transformers import GPT2LMHeadModel
    get_peft_model(GPT2LMHeadModel.from_pretrained(gpt2_dir), PeftLoraConfig(r=4, target_modules=r".*\.(wte|c_attn)")
                   ).save_pretrained(str(tmp_path / "regex"))
    capsys.readouterr()
    for model, lora in [(gpt2_dir, dict(r=8, target_modules=("wte", "c_attn"))),
                        (gpt2_dir, dict(adapter=str(tmp_path / "regex"))),
                        (untied_dir, dict(r=8, target_modules=("embed_tokens", "q_proj")))]:
        assert validated(model, "hf", **lora) == "merged", lora
        assert "cannot serve LoRA on embeddings (" in capsys.readouterr().out
        with pytest.raises(ValueError, match=r"^--lora.sync adapter cannot serve LoRA on embeddings \((transformer.wte|"
                                             r"model.embed_tokens)\).*Use --lora.sync merged.$"):
            validated(model, "hf", sync="adapter", **lora)


@pytest.mark.parametrize("kind", [dict(init_lora_weights="olora"), dict(trainable_token_indices=[5, 9, 12, 24, 38])])
def test_continued_adapter_the_adapter_sync_cannot_carry_is_merged(text_dir, tmp_path, kind):
    """A continued adapter whose load changes the base weights (OLoRA/PiSSA/CorDA: PEFT re-runs the init and keeps the
    residual base) or trains token rows (trainable_token_indices: no lora_A/lora_B) got --lora.sync adapter: the engine
    kept the base from disk and got only lora_A/B, another policy (0.17 and 2.2 nats, found by review). Whatever mode
    validate_lora_sync picks, the engine scores what the trainer does, after the first (full) sync and after a
    partial one (full=False: the trainable token rows must count as their embedding's change)."""
    base, _ = models.load_policy(text_dir)
    saved = get_peft_model(base, PeftLoraConfig(r=4, lora_alpha=8, target_modules=models.lora_targets(base), **kind))
    randomize_adapters(saved, seed=3)
    saved.save_pretrained(str(tmp_path / "a"))
    mode = validated(text_dir, "hf", adapter=str(tmp_path / "a"))
    policy, _ = models.load_policy(text_dir, lora=models.LoraConfig(adapter=str(tmp_path / "a")))
    engine = rollout.HFEngine(text_dir, seed=0, lora_rank=4 if mode == "adapter" else 0)
    weight_sync.check_sync_names(engine, policy)
    engine.load_weights(weight_sync.engine_weights(policy, torch.float32, adapter=mode == "adapter"))
    prompt = [24, 12, 35, 38, 5, 38, 9, 43]
    for step in range(2):  # the first sync sends everything; the next only what training changes (full=False)
        if step:
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 0.3) if p.requires_grad else None
            engine.load_weights(weight_sync.engine_weights(policy, torch.float32, full=False,
                                                           adapter=mode == "adapter"))
        for c in engine.generate([{"prompt_token_ids": prompt}], n=2, temperature=1.0, max_tokens=8,
                                 seeds=rollout.completion_seeds(7, step, 0, 1, 2))[0]:
            gap = (model_logps(policy, prompt, c.token_ids) - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max()
            assert gap < 1e-4, (mode, step, gap)


def test_hf_engine_adapter_of_a_rank_other_than_8(text_dir):
    """PEFT's default lora_alpha (8) equals r at r=8, where every other HF-engine adapter test runs: at r=4 the
    engine's layers need alpha_pattern = ranks (scaling 1; found by review: without it 0.66 nats)."""
    engine = rollout.HFEngine(text_dir, seed=0, lora_rank=4)
    policy, _ = models.load_policy(text_dir, lora=models.LoraConfig(r=4, alpha=8))
    randomize_adapters(policy, seed=3)
    engine.load_weights(weight_sync.engine_weights(policy, torch.float32, adapter=True))
    prompt = [24, 12, 35, 38, 5, 38, 9, 43]
    for c in engine.generate([{"prompt_token_ids": prompt}], n=2, temperature=1.0, max_tokens=8,
                             seeds=rollout.completion_seeds(7, 0, 0, 1, 2))[0]:
        gap = (model_logps(policy, prompt, c.token_ids) - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max()
        assert gap < 1e-4, gap


def test_sleep_level_2_falls_back_to_merged(text_dir):
    """--vllm.sleep-level 2 drops the base weights at each sleep, which an adapter sync never resends: merged by
    default, an explicit adapter refused."""
    import flags as flag_checks
    from grpo import Config
    cfg = Config()
    cfg.rollout.engine, cfg.lora = "vllm", models.LoraConfig(r=8)
    cfg.vllm.enable_sleep_mode, cfg.vllm.sleep_level = True, 2
    flag_checks.validate_lora_sync(cfg, text_dir)
    assert cfg.lora.sync == "merged"
    cfg.lora.sync = "adapter"
    with pytest.raises(ValueError, match="sleep-level 2"):
        flag_checks.validate_lora_sync(cfg, text_dir)
