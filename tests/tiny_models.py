"""Tiny random checkpoints built on the fly (no hub): a text Qwen2 (models.build_tiny_model) and a Qwen2.5-VL.

The VLM needs the test-only torchvision shim on PYTHONPATH (tests/cpu_vision_shim) on machines without torchvision.
"""
import json
import os

import torch

VLM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _bpe_tokenizer(text, specials, pad_token="<|endoftext|>", **kwargs):
    """A byte-level BPE tokenizer (300 tokens) trained on one sentence; eos <|im_end|>, pad <|endoftext|> (or none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([text] * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token=pad_token, **kwargs)


def build_tiny_vlm(path, seed=0):
    """A tiny random Qwen2.5-VL (text hidden 128 / 2 heads, vision depth 2) with a byte-level BPE tokenizer."""
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    tok = _bpe_tokenizer("What colour is the square in the picture? It is red, green or blue. The answer is 42.",
                         VLM_SPECIALS, padding_side="left", chat_template=CHAT_TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VLM_SPECIALS}
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
                         tie_word_embeddings=True, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                         bos_token_id=ids["<|endoftext|>"]),
        vision_config=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=128,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(cfg).save_pretrained(path)
    improc = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    Qwen2_5_VLProcessor(image_processor=improc, tokenizer=tok, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path


def stopping_copy(src, dst, every):
    """A copy of a tiny random model that ends a turn on every `every`-th ordinary token too (its generation config's
    eos list), so episodes have several turns: a random model seldom samples its one end token."""
    import shutil

    from transformers import AutoTokenizer
    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(dst)
    special = set(tok.all_special_ids) | {tok.convert_tokens_to_ids(t) for t in tok.get_added_vocab()}
    gen = json.load(open(os.path.join(dst, "generation_config.json")))
    gen["eos_token_id"] = [tok.eos_token_id] + [i for i in range(len(tok)) if i % every == 0 and i not in special]
    json.dump(gen, open(os.path.join(dst, "generation_config.json"), "w"))
    return str(dst)


def build_tiny_reward_model(path, *, arch="qwen2", chat_template=True, num_labels=1, seed=0, pad=True,
                            max_positions=1024):
    """A tiny random one-label sequence classifier (a reward model: Qwen2 or Llama) with a byte-level BPE tokenizer,
    with or without a chat template (True: CHAT_TEMPLATE, or the template given), with or without a pad token, and a
    context of `max_positions` tokens."""
    from transformers import LlamaConfig, LlamaForSequenceClassification, Qwen2Config, Qwen2ForSequenceClassification
    tok = _bpe_tokenizer("max 3 8 1 = 8. What is 12 + 30? The answer is \\boxed{42}. user assistant system",
                         ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                         pad_token="<|endoftext|>" if pad else None,
                         chat_template=CHAT_TEMPLATE if chat_template is True else chat_template or None)
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForSequenceClassification),
                             "llama": (LlamaConfig, LlamaForSequenceClassification)}[arch]
    cfg = config_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                     num_labels=num_labels, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                     bos_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores spread well beyond float noise
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
