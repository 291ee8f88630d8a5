"""Runs grpo.main with a save that dies midway at step `--crash-at`: the HF files of the new checkpoint are written,
then the resume state raises (as a kill would). Used by tests/test_grpo.py."""
import sys

import tyro

import grpo
import plumbing

crash_at = int(sys.argv.pop(1))
real = plumbing.save_resume_state


def dying_save(module, optimizer, path, rank, trainer_state, **kwargs):
    if trainer_state["step"] == crash_at:
        raise RuntimeError(f"simulated crash while saving step {crash_at}")
    return real(module, optimizer, path, rank, trainer_state, **kwargs)


plumbing.save_resume_state = dying_save
grpo.main(tyro.cli(grpo.Config))
