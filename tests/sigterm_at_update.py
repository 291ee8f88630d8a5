"""Runs grpo.main and, on rank 1 only (the ranks must agree among themselves; torchrun forwards a SIGTERM to all
its workers, but not at the same instant), sends SIGTERM right after optimizer update number `at` (the first argument; counted from 1 over the whole run) returns: the signal lands
between two updates of a step, at a known place. Rank 0 saves the trainable parameters as they are at that moment
(sorted values: a fingerprint that needs no names) to <output-dir>/at_signal.pt. Used by tests/test_grpo.py."""
import os
import signal
import sys

import torch
import tyro

import grpo
import optim

at = int(sys.argv.pop(1))
real, calls = optim.optimizer_step, {"n": 0}


def optimizer_step(*args, **kw):
    out = real(*args, **kw)
    calls["n"] += 1
    if calls["n"] == at:
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in args[0]]  # a collective: every rank
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(torch.cat([p.detach().flatten().cpu() for p in full]).sort().values,
                       os.path.join(cfg.output_dir, "at_signal.pt"))
        if int(os.environ.get("RANK", "0")) == 1:  # one rank only: the ranks must agree to stop at this boundary
            os.kill(os.getpid(), signal.SIGTERM)
    return out


optim.optimizer_step = optimizer_step
cfg = tyro.cli(grpo.Config)
grpo.main(cfg)
