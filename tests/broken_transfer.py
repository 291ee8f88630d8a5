"""Runs grpo.main with --rollout.inference-ranks and a weight transfer that breaks after the first applied version:
from the generator's third weight load on (the start-up load and one applied version stay intact), the HF engine
scales one tensor (the final norm, re-pushed with every version) by 3 right after loading it, as a transfer that
corrupts one tensor would leave it. The trainers' probe check (--rollout.max-mismatch) must stop the run. Used by
tests/test_async.py."""
import torch
import tyro

import grpo
import rollout

real_load, loads = rollout.HFEngine.load_weights, {"n": 0}


def load_then_perturb(engine, named_tensors):
    real_load(engine, named_tensors)
    loads["n"] += 1
    if loads["n"] >= 3:
        with torch.no_grad():
            engine.model.model.norm.weight.mul_(3.0)


rollout.HFEngine.load_weights = load_then_perturb
grpo.main(tyro.cli(grpo.Config))
