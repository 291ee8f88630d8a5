"""Our update on TRL's own batches, step after step: each step's parameter change against TRL's.

    /work/trl-venv/bin/python bench/trl_driver.py ... --dump-dir D --dump-steps 4    # TRL's batches and weights
    python bench/learning_replay.py --base BASE_FOLDER --dump D                    # (learning_compare.py --replay)

Reads what TRL's loss saw at step k (prompt and completion ids with their masks, the advantages) and TRL's weights
after step k, and runs our update from the same start on the same batches in one process: token_logprobs.collate and
TokenLogprobs (log-probs at the sampling temperature), losses.policy_loss (dapo, divided by the batch's completion
tokens), optim.optimizer_step (clip at 1.0, AdamW, optim.lr_lambda's warm-up). Three settings: both of TRL's
defaults (betas (0.9, 0.999) and transformers' constant_with_warmup, lr x u/w: 0 at the first step), ours as shipped
(betas (0.9, 0.99), warm-up lr x (u+1)/(w+1)), and ours with TRL's betas. Per step: the lr, the pre-clip gradient norm
(TRL's logged grad_norm beside it), and ||d_ours - d_trl|| / ||d_trl|| with the cosine, d = the step's change of all
parameters. The first setting should match TRL to float32 round-off: then the update itself is the same and only the
defaults differ.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import losses  # noqa: E402
import optim  # noqa: E402
from token_logprobs import TokenLogprobs, collate  # noqa: E402

SETTINGS = {  # name -> (betas, warm-up: lr_lambda's (warmup) -> multiplier of update u); TRL's first: the equivalence
    "ours + TRL betas + TRL warm-up": ((0.9, 0.999), lambda w: (lambda u: u / w if u < w else 1.0)),
    "ours": ((0.9, 0.99), lambda w: optim.lr_lambda(w, "constant", 0)),
    "ours + TRL betas": ((0.9, 0.999), lambda w: optim.lr_lambda(w, "constant", 0)),
}


def samples_of(batch):
    """TRL's left-padded prompts and right-padded completions -> our per-sample id lists."""
    out = []
    for p, pm, c, cm in zip(batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"]):
        out.append({"prompt_ids": p[pm.bool()].tolist(), "completion_ids": c[cm.bool()].tolist()})
    return out


def replay(base, dump, steps, betas, warm, lr, temperature, pad_id):
    """-> per step {lr, grad_norm, rel, cos} of our update against TRL's on TRL's batches."""
    from transformers import AutoModelForCausalLM
    policy = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="sdpa")
    module = TokenLogprobs(policy)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warm)
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    prev_ours = [p.detach().clone() for p in params]
    prev_trl = {n: p.clone() for n, p in zip(names, prev_ours)}
    rows = []
    for k in range(1, steps + 1):
        b = torch.load(os.path.join(dump, f"batch{k}.pt"))
        samples = samples_of(b)
        T = max(len(s["completion_ids"]) for s in samples)
        n_tokens, loss_value = sum(len(s["completion_ids"]) for s in samples), 0.0
        for i in range(0, len(samples), 8):  # micro-batches of 8 rows (memory); the loss divides by the batch's tokens
            mb = collate(samples[i:i + 8], pad_id, "cpu", T)
            lp, _ = module(mb, temperature)  # [8, T]
            mask = mb["logprob_mask"]
            loss, _ = losses.policy_loss(lp, lp.detach(), b["advantages"][i:i + 8].float(), mask,
                                         losses.LossConfig(beta=0.0), num_items=n_tokens)
            loss.backward()
            loss_value += loss.item()
        used_lr = opt.param_groups[0]["lr"]
        gnorm, _ = optim.optimizer_step(params, opt, sched, 1.0, loss_value)
        trl = torch.load(os.path.join(dump, f"params{k}.pt"))
        num = den = dot = dn = 0.0
        for n, p, q in zip(names, params, prev_ours):
            d_ours, d_trl = p.detach() - q, trl[n] - prev_trl[n]  # float32: 540 MB of float64 per copy otherwise
            num, den = num + (d_ours - d_trl).square().sum().item(), den + d_trl.square().sum().item()
            dot, dn = dot + (d_ours * d_trl).sum().item(), dn + d_ours.square().sum().item()
        rows.append({"step": k, "zero_adv_rows": int((b["advantages"] == 0).sum()), "rows": len(samples),
                     "tokens": n_tokens, "trl_num_items": float(b.get("num_items_in_batch", torch.nan)),
                     "lr": used_lr, "grad_norm": gnorm, "rel": (num / den) ** 0.5 if den else float("nan"),
                     "cos": dot / (dn * den) ** 0.5 if dn and den else float("nan"), "d_ours": dn ** 0.5,
                     "d_trl": den ** 0.5})
        prev_ours = [p.detach().clone() for p in params]
        prev_trl = trl
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the folder both started from")
    p.add_argument("--dump", required=True, help="bench/trl_driver.py --dump-dir")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--settings", type=int, default=len(SETTINGS), help="run the first this-many settings")
    p.add_argument("--out", default=None, help="also write the rows as json here")
    args = p.parse_args()
    torch.manual_seed(0)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.base)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    trl_log = {}
    log_path = os.path.join(os.path.dirname(os.path.normpath(args.dump)), "log.jsonl")
    if os.path.exists(log_path):
        trl_log = {r["step"]: r for r in map(json.loads, open(log_path)) if "grad_norm" in r}
    result = {}
    for name, (betas, warm) in list(SETTINGS.items())[:args.settings]:
        rows = result[name] = replay(args.base, args.dump, args.steps, betas, warm(args.warmup_steps), args.lr,
                                     args.temperature, pad)
        for r in rows:
            print(f"{name:32s} step {r['step']}: {r['zero_adv_rows']} of {r['rows']} rows with advantage 0 (forward "
                  f"only in ours), loss over {r['tokens']} tokens (TRL's num_items_in_batch {r['trl_num_items']:.0f}); "
                  f"lr {r['lr']:.3g}, grad norm {r['grad_norm']:.4f} (TRL logged "
                  f"{trl_log.get(r['step'], {}).get('grad_norm', float('nan')):.4f}), |d_ours| {r['d_ours']:.3e}, "
                  f"|d_trl| {r['d_trl']:.3e}, |d_ours - d_trl| / |d_trl| {r['rel']:.2e}, cos {r['cos']:.6f}",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
