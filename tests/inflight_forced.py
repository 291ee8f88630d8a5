"""Runs grpo.main with --rollout.inference-ranks and --rollout.inflight-updates, forcing a weight update
mid-batch: on a generator, a batch that began under a version older than its step waits, before its second chunk,
until the step's version is staged (the trainers push it at the start of that step, before they wait for the
batch), so refresh loads it between chunks. <output-dir>/received-rank<r>.jsonl: each sample's engine_versions
(and an episode's completion_mask)."""
import json
import os
import time

import tyro

import grpo
import inference_ranks

real_refresh, real_send, real_receive = inference_ranks.refresh, inference_ranks.send_batch, inference_ranks.receive_batch
state = {"step": None, "calls": 0}


def send_batch(run, step, *a, **k):
    state["step"], state["calls"] = step, 0
    return real_send(run, step, *a, **k)


def refresh(run, staged, cond):
    state["calls"] += 1
    if state["calls"] == 2 and run.link.version < state["step"]:  # before the second chunk of the batch's first round
        deadline = time.time() + 60
        while time.time() < deadline:
            with cond:
                if any(v >= state["step"] for v, _, _ in staged["versions"]):
                    break
            time.sleep(0.01)
    return real_refresh(run, staged, cond)


def receive(run, step):
    samples, metrics = real_receive(run, step)
    with open(os.path.join(run.cfg.output_dir, f"received-rank{run.rank}.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "versions": [s.get("engine_versions") for s in samples],
                            "masks": [s.get("completion_mask") for s in samples]}) + "\n")
    return samples, metrics


inference_ranks.refresh, inference_ranks.send_batch, inference_ranks.receive_batch = refresh, send_batch, receive
grpo.main(tyro.cli(grpo.Config))
