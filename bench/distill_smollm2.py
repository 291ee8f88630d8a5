"""On-policy distillation on CPU: a smaller SmolLM2 student learns from SmolLM2-135M-Instruct, against GRPO on the reward.

    python bench/distill_smollm2.py                       # ~15-20 min on 2 CPU cores: two 2-rank runs of 10 steps
    python bench/distill_smollm2.py --steps 4 --drop 14-16

The teacher is the packaged SmolLM2-135M-Instruct (GGUF, converted once to float32). The student is the same network
with decoder layers `--drop` removed (layer dropping: Gromov et al., arXiv 2403.17887), so it shares the teacher's
tokenizer. Which layers: measured once on 3 held-out prompts (reverse KL to the teacher, nats/token): without 11-16
(24 layers) 1.8, 20-25 6.4; without 14-16 1.4, 24-26 3.8, 26-28 5.4 (27 layers). Two runs of
bench/recipe_smollm2.py's recipe on small_arith from that student, the same flags, seeds and prompts:

- distill: `--distill.teacher TEACHER --data.reward-weights 0`: the advantage is the teacher's alone (the reward is
  still computed and logged);
- grpo: the reward `final_number` alone (no teacher).

Prints one table: per evaluation step, each run's held-out greedy accuracy (64 prompts) and the distill run's training
reverse KL (distill/reverse_kl, mean over its sampled tokens), then each student's reverse KL to the teacher on the
same held-out prompts (16 completions sampled at the rollout temperature, scored by both models at that temperature),
before training and after each run. Then the machine and its matmul peak (bench/roofline.py).
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from recipe_smollm2 import RECIPE, command, load_avg, machine  # noqa: E402


def build_student(teacher_dir, out, drop):
    """The teacher without decoder layers `drop` (a range lo-hi, inclusive), saved with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    lo, hi = map(int, drop.split("-"))
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    keep = [layer for i, layer in enumerate(model.model.layers) if not lo <= i <= hi]
    for i, layer in enumerate(keep):
        layer.self_attn.layer_idx = i  # the KV cache's index
    model.model.layers = torch.nn.ModuleList(keep)
    model.config.num_hidden_layers = len(keep)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(out)
    return len(keep)


@torch.no_grad()
def heldout_reverse_kl(student_dir, teacher_dir, n_prompts=16, max_tokens=32, temperature=0.7, seed=0):
    """Mean per-token log p_student - log p_teacher over completions the student samples on held-out small_arith
    prompts, both at `temperature` (the rollout's)."""
    import tasks
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(student_dir)
    student, teacher = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
                        for p in (student_dir, teacher_dir))
    rows = tasks.load_dataset_rows("small_arith", split="test", size=n_prompts, seed=0)[:n_prompts]
    total, tokens = 0.0, 0
    torch.manual_seed(seed)
    for row in rows:
        ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = student.generate(**ids, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                               max_new_tokens=max_tokens, pad_token_id=tok.eos_token_id)
        p = ids["input_ids"].shape[1]
        comp = out[0, p:]  # [T]
        lp = [torch.log_softmax(m(out).logits[0, p - 1:-1] / temperature, -1).gather(-1, comp[:, None])[:, 0]
              for m in (student, teacher)]  # [T] each
        total, tokens = total + (lp[0] - lp[1]).sum().item(), tokens + len(comp)
    return total / max(tokens, 1)


def run(name, flags, student, out, nproc):
    """One torchrun of grpo.py -> its metrics rows (the log in <out>/<name>/run.log)."""
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    cmd = command(flags, folder, student, nproc)
    print(f"[{name}]", " ".join(cmd), flush=True)
    t0 = time.time()
    with open(os.path.join(folder, "run.log"), "w") as log:
        rc = subprocess.run(cmd, cwd=os.path.dirname(HERE), stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    if rc != 0:
        sys.exit(f"{name}: grpo.py exited with {rc}; see {folder}/run.log")
    print(f"[{name}] {time.time() - t0:.0f} s", flush=True)
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], time.time() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="outputs/distill_smollm2")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--drop", default="11-16", help="decoder layers to remove from the teacher (inclusive range)")
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    import models
    from roofline import matmul_peak
    t_start = time.time()
    print("machine:", machine(), "|", load_avg(), "(before)", flush=True)
    teacher = models.convert_gguf_once(models.packaged_smollm2(), os.path.join(args.out, "converted"))
    student = os.path.join(args.out, "student")
    n_layers = build_student(teacher, student, args.drop)
    flags = {**RECIPE, "max-steps": str(args.steps), "eval.every": str(args.eval_every), "log.completions-every": "0"}
    results = {name: run(name, f, student, args.out, args.nproc) for name, f in
               [("distill", {**flags, "distill.teacher": teacher, "data.reward-weights": "0"}), ("grpo", flags)]}
    kl = {"before": heldout_reverse_kl(student, teacher, temperature=float(RECIPE["rollout.temperature"]))}
    for name in results:
        ckpt = os.path.join(args.out, name, f"checkpoint-{args.steps}")
        kl[name] = heldout_reverse_kl(ckpt, teacher, temperature=float(RECIPE["rollout.temperature"]))
    rows = {name: {r["step"]: r for r in res[0]} for name, res in results.items()}
    print(f"\nstudent: SmolLM2-135M-Instruct without layers {args.drop} ({n_layers} of 30 layers); teacher: "
          f"SmolLM2-135M-Instruct; small_arith, 2 ranks x 2 prompts x 8 completions a step, {args.steps} steps\n")
    print("| step | distill: held-out acc | distill: reverse KL (train) | distill: reward | grpo: held-out acc | "
          "grpo: reward |")
    print("|---|---|---|---|---|---|")
    fmt = lambda r, k: f"{r[k]:.3f}" if r and k in r else "-"  # noqa: E731
    for step in range(args.steps + 1):
        d, g = rows["distill"].get(step), rows["grpo"].get(step)
        if step == 0 or (d and "eval/accuracy" in d) or step in (1, args.steps):
            print(f"| {step} | {fmt(d, 'eval/accuracy')} | {fmt(d, 'distill/reverse_kl')} | {fmt(d, 'reward/mean')} | "
                  f"{fmt(g, 'eval/accuracy')} | {fmt(g, 'reward/mean')} |")
    print(f"\nheld-out reverse KL to the teacher (nats/token, 16 prompts, sampled at T=0.7): before {kl['before']:.3f}, "
          f"after distill {kl['distill']:.3f}, after grpo {kl['grpo']:.3f}")
    for name, (res, wall) in results.items():
        step_s = [r["time/step"] for r in res if "time/step" in r]
        teacher_s = [r["time/teacher"] for r in res if "time/teacher" in r]
        print(f"{name}: wall {wall:.0f} s, {sum(step_s) / len(step_s):.1f} s/step"
              + (f" (teacher {sum(teacher_s) / len(teacher_s):.1f} s)" if teacher_s else ""))
    print(f"matmul peak fp32: {matmul_peak(1):.0f} GFLOP/s on 1 thread, {matmul_peak(os.cpu_count()):.0f} on "
          f"{os.cpu_count()}; {machine()}; {load_avg()} (after); total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
