"""TRL's GRPOTrainer on the setting bench/trl_compare.py gives it; run by that script with TRL's own virtualenv.

    /work/trl-venv/bin/python bench/trl_driver.py --model DIR --data rows.jsonl --steps-file steps.jsonl ...

Imports nothing from this repository but answers.py, for --reward final_number (TRL is never a dependency of the
product; math-verify, which answers.py imports, is installed in TRL's virtualenv). Writes one JSON line per optimizer
step to --steps-file: wall time at the step's end, this process's RSS then, and the mean completion length TRL logs.
bench/learning_compare.py runs it for learning, with --save-dir (the final model) and --log-file (TRL's per-step
logs: loss, grad_norm, learning_rate, reward).
"""
import argparse
import json
import os
import re
import time


def rss_gb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def max_digit_reward(prompts, completions, answer, **_):
    """1 - |d - max| / 9 for the completion's first character d when it is a digit, else 0 (scoring.max_digit_reward)."""
    out = []
    for c, a in zip(completions, answer):
        c = c if isinstance(c, str) else c[0]["content"]
        out.append(1 - abs(int(c[0]) - int(a)) / 9 if c[:1].isdigit() else 0.0)
    return out


def accuracy_reward(prompts, completions, answer, **_):
    """1 when the \\boxed{} (else last) number equals the answer: a plain stand-in for math-verify (same cost class)."""
    out = []
    for c, a in zip(completions, answer):
        c = c if isinstance(c, str) else c[0]["content"]
        boxed = re.findall(r"\\boxed\{([^}]*)\}", c)
        nums = re.findall(r"-?\d+", boxed[-1] if boxed else c)
        out.append(float(bool(nums) and nums[-1] == a))
    return out


def final_number_reward(prompts, completions, answer, **_):
    """Our final_number reward (scoring.final_number_reward): answers.extract_number of the completion == the gold."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import answers
    out = []
    for c, a in zip(completions, answer):
        c = c if isinstance(c, str) else c[0]["content"]
        got, gold = answers.extract_number(c), answers.gold_number(a)
        out.append(float(got is not None and gold is not None and abs(got - gold) < 1e-6))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="jsonl rows with prompt (text or chat messages) and answer")
    ap.add_argument("--reward", default="accuracy", choices=["accuracy", "max_digit", "final_number"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16, help="completions per optimizer step")
    ap.add_argument("--max-completion-length", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cuda", action="store_true", help="train on the GPU in bf16 autocast (use_cpu=False, bf16=True), "
                    "as bench/gpu_check.py runs it")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--warmup-steps", type=int, default=0, help="> 0: constant_with_warmup")
    ap.add_argument("--adam-beta2", type=float, default=0.999)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-dir", default=None, help="save the final model (and tokenizer) here")
    ap.add_argument("--log-file", default=None, help="append TRL's per-step log dicts here (jsonl)")
    ap.add_argument("--dump-dir", default=None, help="save each step's loss inputs (batch<k>.pt) and the weights after "
                    "it (params<k>.pt) here, for bench/learning_replay.py")
    ap.add_argument("--dump-steps", type=int, default=3, help="the first this-many steps are dumped")
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--steps-file", required=True)
    args = ap.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in open(args.data)]
    lengths, lr_now = [], []
    dump = lambda step: args.dump_dir and step <= args.dump_steps  # noqa: E731

    class Dumping(GRPOTrainer):  # the batch exactly as TRL's loss sees it (one loss call per step here)
        def _compute_loss(self, model, inputs):
            if dump(self.state.global_step + 1):
                torch.save({k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)},
                           os.path.join(args.dump_dir, f"batch{self.state.global_step + 1}.pt"))
            return super()._compute_loss(model, inputs)

    class StepLog(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])
            if logs and args.log_file:
                with open(args.log_file, "a") as f:
                    f.write(json.dumps({"step": state.global_step, **logs}) + "\n")

        def on_step_begin(self, _args, state, control, optimizer=None, **kw):
            lr_now.append(optimizer.param_groups[0]["lr"])  # the lr this step's update uses

        def on_step_end(self, _args, state, control, model=None, **kw):
            with open(args.steps_file, "a") as f:
                f.write(json.dumps({"step": state.global_step, "t": time.time(), "rss_gb": rss_gb(),
                                    "lr": lr_now[-1]}) + "\n")
            if dump(state.global_step):
                torch.save(model.state_dict(), os.path.join(args.dump_dir, f"params{state.global_step}.pt"))

    cfg = GRPOConfig(output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
                     num_generations=args.num_generations, max_completion_length=args.max_completion_length,
                     learning_rate=args.lr, beta=0.0, loss_type="dapo", num_iterations=1, temperature=args.temperature,
                     adam_beta2=args.adam_beta2, warmup_steps=args.warmup_steps,
                     lr_scheduler_type="constant_with_warmup" if args.warmup_steps else "linear",
                     max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=not args.cuda,
                     bf16=args.cuda, seed=args.seed, dataloader_num_workers=0, disable_tqdm=True)
    if args.dump_dir:
        os.makedirs(args.dump_dir, exist_ok=True)
    trainer = Dumping(model=args.model, reward_funcs=[{"accuracy": accuracy_reward,
                                                          "max_digit": max_digit_reward,
                                                          "final_number": final_number_reward}[args.reward]],
                          args=cfg, train_dataset=Dataset.from_list(rows), callbacks=[StepLog()])
    trainer.train()
    if args.save_dir:
        trainer.save_model(args.save_dir)
        trainer.processing_class.save_pretrained(args.save_dir)
    with open(args.steps_file, "a") as f:  # completion tokens per step from TRL's own log (mean length x batch)
        f.write(json.dumps({"completion_len": lengths, "batch_size": args.batch_size}) + "\n")


if __name__ == "__main__":
    main()
