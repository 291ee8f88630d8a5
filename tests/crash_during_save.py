"""Runs grpo.main with a save that is killed midway at step `crash-at` (the first argument): the HF files and this
rank's resume state of the new checkpoint are in its temporary directory when rank 0 gets SIGKILL (no Python cleanup
runs, as with the OOM killer or a node failure). Used by tests/test_grpo.py."""
import os
import signal
import sys

import tyro

import checkpoints
import grpo

crash_at = int(sys.argv.pop(1))
real = checkpoints.save_resume_state


def dying_save(module, optimizer, path, rank, trainer_state, **kwargs):
    out = real(module, optimizer, path, rank, trainer_state, **kwargs)
    if trainer_state["step"] == crash_at and rank == 0:
        print(f"killing rank 0 while saving step {crash_at}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return out


checkpoints.save_resume_state = dying_save
grpo.main(tyro.cli(grpo.Config))
