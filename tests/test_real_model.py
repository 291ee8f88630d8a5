"""The real pretrained SmolLM2-135M-Instruct (Llama architecture, BPE tokenizer, chat template) from its GGUF file."""
import os

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

