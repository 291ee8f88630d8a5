"""Runs grpo.main with a weight sync that never reaches the engine after the first step (a stale engine, as a broken
sync would leave it): --rollout.max-mismatch must stop the run on every rank. Used by tests/test_grpo.py."""
import tyro

import grpo

real = grpo.sync_weights
calls = {"n": 0}


def stale_sync(run, stale):
    calls["n"] += 1
    if calls["n"] == 1:
        return real(run, stale)
    run.engine.wake_up()  # claims success, sends nothing
    return {"time/sync": 0.0, "sync/bytes": 0}


grpo.sync_weights = stale_sync
grpo.main(tyro.cli(grpo.Config))
