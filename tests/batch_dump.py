"""Runs grpo.main with --rollout.inference-ranks and records, on each trainer, every batch it receives from the
generators before anything trains on it: <output-dir>/received-rank<r>.jsonl, one line per step: [[prompt, answer,
masked, rewards]] per sample. tests/test_inflight.py checks dynamic sampling on a generator against it."""
import json
import os

import tyro

import grpo
import inference_ranks

real_receive = inference_ranks.receive_batch


def receive_and_record(run, step):
    samples, metrics = real_receive(run, step)
    with open(os.path.join(run.cfg.output_dir, f"received-rank{run.rank}.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "samples": [[s["row"]["prompt"], s["row"]["answer"], bool(s.get("top_up")),
                                                        s.get("rewards")] for s in samples]}) + "\n")
    return samples, metrics


inference_ranks.receive_batch = receive_and_record
grpo.main(tyro.cli(grpo.Config))
