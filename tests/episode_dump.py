"""Runs grpo.main and records, independently of the code under test, what the engine sampled (every engine call's
prompt ids, sampled ids and log-probs), what the trainer forwarded (every micro-batch's input ids), the per-token
log-probs the loss received and their gradients, and the advantages. Saved to <output-dir>/dump.pt for
tests/test_episodes.py."""
import os

import torch
import tyro

import grpo
import rollout

record = {"engine": [], "forward": [], "loss": [], "samples": [], "advantages": []}


def wrap_engine(cls):
    real = cls.generate

    def generate(self, prompts, **kw):
        outs = real(self, prompts, **kw)
        for p, o in zip(prompts, outs):
            for c in o:
                record["engine"].append((list(p["prompt_token_ids"]), list(c.token_ids), list(c.logprobs)))
        return outs
    cls.generate = generate


wrap_engine(rollout.VLLMEngine)
wrap_engine(rollout.HFEngine)
real_micro_batch, real_policy_loss, real_advantages = grpo.micro_batch, grpo.losses.policy_loss, grpo.compute_advantages


def micro_batch(run, batch, rows):
    mb = real_micro_batch(run, batch, rows)
    record["forward"].append({"rows": list(rows), "input_ids": mb["input_ids"].cpu(),
                              "attention_mask": mb["attention_mask"].cpu()})
    return mb


def policy_loss(logps, *args, **kw):
    if logps.requires_grad:  # a micro-batch of forward-only rows (all advantages 0) has no graph: its gradient is 0
        logps.retain_grad()  # the gradient of the loss w.r.t. each position's log-prob, read after backward
    record["loss"].append({"logps": logps, "mask": args[2].cpu(), "engine_logps": kw["sampler_logps"].cpu()})
    return real_policy_loss(logps, *args, **kw)


def compute_advantages(run, rewards, batch):
    real_advantages(run, rewards, batch)
    record["samples"].append([{k: s.get(k) for k in ("prompt_ids", "completion_ids", "completion_mask", "engine_logps",
                                                 "truncated", "text", "messages", "turns", "tool_calls", "tool_errors")}
                              | {"env_reward": s["row"].get("env_reward"), "reward": s["reward"]}
                              for s in batch["samples"]])
    record["advantages"].append(batch["advantages"].cpu())


grpo.micro_batch, grpo.losses.policy_loss, grpo.compute_advantages = micro_batch, policy_loss, compute_advantages
cfg = tyro.cli(grpo.Config)
try:
    grpo.main(cfg)
finally:
    for r in record["loss"]:
        r["grad"] = torch.zeros_like(r["logps"]).cpu() if r["logps"].grad is None else r["logps"].grad.cpu()
        r["logps"] = r["logps"].detach().cpu()
    rank = os.environ.get("RANK", "0")  # under torchrun each rank records its own share
    torch.save(record, os.path.join(cfg.output_dir, "dump.pt" if rank == "0" else f"dump-rank{rank}.pt"))
