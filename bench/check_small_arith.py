"""Greedy small_arith accuracy of a checkpoint, outside grpo.py: a second code path for the recipe's before/after.

    python bench/check_small_arith.py outputs/recipe_smollm2/converted/SmolLM2-135M-Instruct.Q4_1   # before
    python bench/check_small_arith.py outputs/recipe_smollm2/checkpoint-20                          # after

vLLM loads the folder directly (no trainer, no weight sync), generates greedily from the chat template, and scores two
ways: "the last integer equals a op b", computed here from the prompt text, and `accuracy` (math-verify), which also
credits an echo of the question. Prompt sets: the 64 held-out prompts grpo.py evaluates on, and 128 fresh ones.
"""
import argparse
import json
import operator
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def last_integer_correct(prompt, completion):
    """1.0 when the completion's last integer is a op b for the prompt 'What is a op b? ...'."""
    a, op, b = re.match(r"What is (\d+) ([-+*]) (\d+)", prompt).groups()
    nums = re.findall(r"-?\d+", completion)
    return float(bool(nums) and int(nums[-1]) == OPS[op](int(a), int(b)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a Hugging Face folder (a converted GGUF, or grpo.py's checkpoint-N)")
    p.add_argument("--max-tokens", type=int, default=32, help="completion budget (the recipe's eval uses 32)")
    p.add_argument("--fresh-seed", type=int, default=777, help="seed of the 128 fresh prompts")
    p.add_argument("--json", default=None, help="also write {set: {last_integer: [0/1 per prompt], math_verify: ...}}")
    args = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import scoring
    import tasks
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    tok = AutoTokenizer.from_pretrained(args.checkpoint)
    llm = LLM(model=args.checkpoint, max_model_len=256, enforce_eager=True, seed=0, dtype="float32")
    sets = {"held-out 64 (grpo.py's eval prompts)": tasks.load_dataset_rows("small_arith", split="test", size=64),
            f"fresh 128 (seed {args.fresh_seed})": tasks.load_dataset_rows("small_arith", size=128, seed=args.fresh_seed)}
    scores = {}
    for name, rows in sets.items():
        texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
        outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
        comps = [o.outputs[0].text for o in outs]
        plain = [last_integer_correct(r["prompt"][0]["content"], c) for r, c in zip(rows, comps)]
        mv = scoring.accuracy_reward(None, comps, answer=[r["answer"] for r in rows])
        print(f"{args.checkpoint} | {name}: last-integer {sum(plain) / len(rows):.3f}, "
              f"math-verify {sum(mv) / len(rows):.3f}", flush=True)
        scores[name.split(" (")[0]] = {"last_integer": plain, "math_verify": mv}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(scores, f)


if __name__ == "__main__":
    main()
