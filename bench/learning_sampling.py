"""Our sampler (vLLM, one seed per completion) against TRL's (transformers generate) on the same prompts at T 0.7.

    python bench/learning_sampling.py --base BASE_FOLDER --n 256      # 4 held-out small_arith prompts x 256 each

Draws --n completions (32 tokens) of each prompt with each sampler: ours through rollout.VLLMEngine.generate (what
grpo.py runs), TRL's with model.generate and the GenerationConfig GRPOTrainer builds (do_sample, temperature 0.7,
top_p 1, top_k 0, its eos ids), run in TRL's virtualenv. One scorer for both (a float32 transformers forward here):
per prompt, the total variation distance of the first token's empirical distribution from the exact one
(softmax(logits / 0.7) in float64), next to the same distance for --n draws from the exact distribution itself (the
noise floor); with --logprobs, the mean log-prob per token of the samples under the T = 0.7 distribution; the mean length; the share
that ended with EOS; and the final_number reward rate. Equal samplers give equal numbers within their errors.
"""
import argparse
import json
import math
import os
import subprocess
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

HF_SAMPLER = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
base, n, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompts = json.load(sys.stdin)
tok = AutoTokenizer.from_pretrained(base)
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
eos = [tok.eos_token_id] + [e for e in ([model.generation_config.eos_token_id] if isinstance(
    model.generation_config.eos_token_id, int) else model.generation_config.eos_token_id or []) if e != tok.eos_token_id]
gc = GenerationConfig(max_new_tokens=32, do_sample=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=eos, temperature=0.7, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                      disable_compile=True)  # GRPOTrainer's generation_kwargs (trl 1.16, transformers path)
torch.manual_seed(seed)
out = []
for p in prompts:
    ids = torch.tensor([p] * 64)
    rows = []
    for _ in range(n // 64):
        with torch.no_grad():
            g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc)[:, len(p):]
        for r in g.tolist():
            cut = next((i + 1 for i, t in enumerate(r) if t in eos), len(r))
            rows.append(r[:cut])
    out.append(rows)
json.dump({"samples": out, "eos": eos}, sys.stdout)
"""


def mean_se(xs):
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1) / len(xs))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True)
    p.add_argument("--n", type=int, default=256, help="samples per prompt (a multiple of 64)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--trl-python", default="/work/trl-venv/bin/python")
    p.add_argument("--logprobs", action="store_true", help="also score every sample's mean log-prob (a forward of "
                   "each: slow on a CPU)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import rollout
    import scoring
    import tasks
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.base)
    rows = tasks.load_dataset_rows("small_arith", split="test", size=args.prompts)
    prompts = [tok.apply_chat_template(r["prompt"], tokenize=True, add_generation_prompt=True) for r in rows]
    prompts = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in prompts]
    hf = json.loads(subprocess.run([args.trl_python, "-c", HF_SAMPLER, args.base, str(args.n), "0"],
                                   input=json.dumps(prompts), capture_output=True, text=True, check=True).stdout)
    engine = rollout.VLLMEngine(args.base, seed=0, cfg=rollout.VLLMConfig(max_model_len=128), dtype="float32",
                                show_progress=False)
    seeds = [[1000 * i + j for j in range(args.n)] for i in range(len(prompts))]
    ours = [[c.token_ids for c in o] for o in engine.generate([{"prompt_token_ids": q} for q in prompts], n=args.n,
                                                              temperature=0.7, max_tokens=32, seeds=seeds)]
    del engine
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
    eos = set(hf["eos"])
    gen = torch.Generator().manual_seed(0)
    result = {}
    for name, samples in (("ours (vLLM)", ours), ("TRL (generate)", hf["samples"])):
        res = result[name] = {"tv_first": [], "tv_floor": [], "logp_per_token": [], "length": [], "eos": [],
                              "reward": []}
        for i, (q, ss) in enumerate(zip(prompts, samples)):
            with torch.no_grad():
                exact = torch.log_softmax(model(torch.tensor([q])).logits[0, -1].double() / 0.7, -1).exp()  # [V]
            first = torch.bincount(torch.tensor([s[0] for s in ss]), minlength=exact.numel()).double() / len(ss)
            floor = torch.bincount(torch.multinomial(exact, len(ss), replacement=True, generator=gen),
                                   minlength=exact.numel()).double() / len(ss)
            res["tv_first"].append(0.5 * (first - exact).abs().sum().item())
            res["tv_floor"].append(0.5 * (floor - exact).abs().sum().item())
            texts = tok.batch_decode(ss, skip_special_tokens=True)
            res["reward"] += scoring.final_number_reward(None, texts, answer=[rows[i]["answer"]] * len(ss))
            res["length"] += [len(s) for s in ss]
            res["eos"] += [float(s[-1] in eos) for s in ss]
            for k in range(0, len(ss) if args.logprobs else 0, 32):
                chunk = ss[k:k + 32]
                T = max(len(s) for s in chunk)
                ids = torch.tensor([q + s + [0] * (T - len(s)) for s in chunk])
                with torch.no_grad():
                    lp = torch.log_softmax(model(ids).logits[:, len(q) - 1:-1].double() / 0.7, -1)  # [b, T, V]
                tok_lp = lp.gather(-1, ids[:, len(q):, None])[..., 0]  # [b, T]
                res["logp_per_token"] += [tok_lp[j, :len(s)].mean().item() for j, s in enumerate(chunk)]
        print(f"{name:16s} first-token TV per prompt {', '.join(f'{x:.3f}' for x in res['tv_first'])} "
              f"(draws from the exact distribution: {', '.join(f'{x:.3f}' for x in res['tv_floor'])}); " +
              "; ".join(f"{k} %.4f +- %.4f" % mean_se(res[k]) for k in ("logp_per_token", "length", "eos", "reward")
                        if res[k]),
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({k: {m: (v if m.startswith("tv") else mean_se(v)) for m, v in r.items() if v}
                       for k, r in result.items()}, f, indent=1)


if __name__ == "__main__":
    main()
