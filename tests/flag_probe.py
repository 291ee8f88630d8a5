"""Runs grpo.main (one process) with a probe, for tests/test_flags.py:
  checkpointing  count the calls of transformers' activation-checkpoint function (a layer run under it)
  nan_loss       every policy loss is NaN (as a diverged run's would be)
The first argument names the probe; the rest are grpo.py flags. Prints `probe: <count>` at the end."""
import math
import sys

import transformers.modeling_utils as modeling_utils
import tyro

import grpo

probe, calls = sys.argv.pop(1), {"n": 0}
if probe == "checkpointing":
    real_checkpoint = modeling_utils.checkpoint

    def checkpoint(*args, **kw):
        calls["n"] += 1
        return real_checkpoint(*args, **kw)
    modeling_utils.checkpoint = checkpoint  # read when gradient_checkpointing_enable builds the layers' function
elif probe == "nan_loss":
    real_loss = grpo.losses.policy_loss

    def policy_loss(*args, **kw):
        loss, metrics = real_loss(*args, **kw)
        calls["n"] += 1
        return loss * math.nan, metrics
    grpo.losses.policy_loss = policy_loss
try:
    grpo.main(tyro.cli(grpo.Config))
finally:
    print(f"probe: {calls['n']}", flush=True)
