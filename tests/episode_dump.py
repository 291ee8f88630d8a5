"""Runs grpo.main and records, independently of the code under test, what the engine sampled (every engine call's
prompt ids, sampled ids and log-probs), what the trainer forwarded (every micro-batch's input ids), the per-token
log-probs the loss received and their gradients, and the advantages. Saved to <output-dir>/dump.pt for
tests/test_episodes.py (an inference rank's, --rollout.inference-ranks, to dump-rank<world rank>.pt: its engine calls
(engine_loads: the weight loads before each), and the batches it sent: step, version, engine calls from..to)."""
import os

import torch
import tyro

import grpo
import inference_ranks
import rollout

record = {"engine": [], "forward": [], "loss": [], "samples": [], "advantages": [], "loads": 0, "engine_loads": [],
          "batches": []}


def wrap_engine(cls):
    real, real_load = cls.generate, cls.load_weights

    def generate(self, prompts, **kw):
        loads = record["loads"]
        outs = real(self, prompts, **kw)
        record.setdefault("generate_calls", []).append(len(prompts))
        for p, o in zip(prompts, outs):
            for c in o:
                record["engine"].append((list(p["prompt_token_ids"]), list(c.token_ids), list(c.logprobs)))
                record["engine_loads"].append(loads)
        return outs

    def load_weights(self, *args, **kw):
        record["loads"] += 1
        return real_load(self, *args, **kw)
    cls.generate, cls.load_weights = generate, load_weights


wrap_engine(rollout.VLLMEngine)
wrap_engine(rollout.HFEngine)
real_model_inputs, real_policy_loss, real_advantages = grpo.model_inputs, grpo.losses.policy_loss, grpo.compute_advantages


def model_inputs(run, batch, rows):
    mb = real_model_inputs(run, batch, rows)
    record["forward"].append({"rows": list(rows), "input_ids": mb["input_ids"].cpu(),
                              "attention_mask": mb["attention_mask"].cpu()})
    return mb


def policy_loss(**kw):
    logps = kw["logps"]
    if kw.get("num_items") is None:  # grpo.idle_rows' probe (it passes no counts), not a micro-batch
        return real_policy_loss(**kw)
    if not logps.is_leaf:  # (forward-only rows come as leaves, whose gradient the check after their pass fills)
        logps.retain_grad()  # the gradient of the loss w.r.t. each position's log-prob, read after backward
    record["loss"].append({"logps": logps, "mask": kw["mask"].cpu(), "engine_logps": kw["sampler_logps"].cpu()})
    return real_policy_loss(**kw)


def compute_advantages(run, rewards, batch):
    fields = real_advantages(run, rewards, batch)
    totals = (rewards * torch.tensor(run.weights)).nansum(-1).tolist()  # [N] each sample's weighted reward
    record["samples"].append([{k: s.get(k) for k in ("prompt_ids", "completion_ids", "completion_mask", "engine_logps",
                                                 "truncated", "text", "messages", "turns", "tool_calls", "tool_errors",
                                                 "staleness", "env_error", "ended")}
                              | {"env_reward": s["row"].get("env_reward"), "reward": r}
                              for s, r in zip(batch.samples, totals)])
    record["advantages"].append(fields["fields"]["advantages"].cpu())
    for key, x in (("returns", fields["fields"].get("returns")), ("old_values", batch.old_values)):  # gae only (else None)
        record.setdefault(key, []).append(None if x is None else x.cpu())
    return fields


def send_batch(run, step, version, *args):
    first = len(record["engine"])
    real_send_batch(run, step, version, *args)
    record["batches"].append({"step": step, "version": version, "engine_calls": (first, len(record["engine"]))})


real_send_batch = inference_ranks.send_batch
grpo.model_inputs, grpo.losses.policy_loss, grpo.compute_advantages = model_inputs, policy_loss, compute_advantages
inference_ranks.send_batch = send_batch
cfg = tyro.cli(grpo.Config)
try:
    grpo.main(cfg)
finally:
    for r in record["loss"]:
        r["grad"] = torch.zeros_like(r["logps"]).cpu() if r["logps"].grad is None else r["logps"].grad.cpu()
        r["logps"] = r["logps"].detach().cpu()
    rank = os.environ.get("GLOBAL_RANK", os.environ.get("RANK", "0"))
    torch.save(record, os.path.join(cfg.output_dir, "dump.pt" if rank == "0" else f"dump-rank{rank}.pt"))
