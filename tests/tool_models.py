"""A tiny chat model that calls tools, honestly: a random tiny Qwen2 with a character tokenizer and a Hermes-style
chat template, warmed up by a few hundred supervised steps on calculator transcripts (the tool call, the tool's
answer, the final number). The random model alone never writes <tool_call>; after the warm-up it does, by sampling."""
import json
import random

import jinja2
import torch

SPECIALS = ["<|pad|>", "<|im_end|>", "<|im_start|>"]
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # plain added tokens: kept in text
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|im_end|>\n"
    "{% endif %}{%- for m in messages %}{%- if m['role'] == 'tool' %}<|im_start|>tool\n<tool_response>"
    "{{ m['content'] }}</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def transcript(rng):
    a, b = rng.randint(2, 99), rng.randint(2, 9)
    call = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}, separators=(",", ":"))
    return [{"role": "user", "content": f"{a}*{b}?"},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "name": "multiply", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)}]


def build_tool_model(path, *, steps=200, batch=16, lr=3e-3, seed=0):
    """Build, warm up (cross-entropy on every token of `steps` batches of `batch` transcripts) and save to `path`."""
    from tokenizers import Tokenizer, decoders, models as tk_models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import get_json_schema
    rng = random.Random(seed)
    # a byte-level BPE trained on the transcripts (as a real model's tokenizer merges its frequent strings); jinja2
    # with transformers' chat-template settings
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(TEMPLATE)
    corpus = [template.render(messages=transcript(rng), tools=[get_json_schema(multiply)]) for _ in range(500)]
    tk = Tokenizer(tk_models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.add_tokens(TAGS)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|pad|>", eos_token="<|im_end|>",
                                  padding_side="left", chat_template=TEMPLATE)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    texts = lambda: [tok.apply_chat_template(transcript(rng), tools=[multiply], tokenize=False)  # noqa: E731
                     for _ in range(batch)]
    for _ in range(steps):
        enc = tok(texts(), padding=True, padding_side="right", return_tensors="pt", add_special_tokens=False)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        loss = model(**enc, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, loss.item()
