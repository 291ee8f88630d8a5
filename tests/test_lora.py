"""LoRA sync: what the engine receives equals PEFT's own merge_and_unload for every adapter kind we accept (plain,
rsLoRA, DoRA, lora_bias, embeddings, a continued adapter next to its frozen reference copy); what the sync or the fused
head cannot serve exactly is refused at load time with a message."""
import copy

import pytest
import torch
from peft import IA3Config, LoraConfig as PeftLoraConfig, get_peft_model

import models
import rollout

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
    sent = dict(rollout.iter_engine_weights(model, torch.float32))
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
