"""Runs grpo.main and appends each evaluation's completions with their engine's log-probs (one JSON line per evaluation,
per rank) to <output-dir>/eval-rank<R>.jsonl, recorded outside the code under test: which weights did it use?
EVAL_DUMP_DELAY_S: seconds each evaluation waits first (weights pushed after it are then staged when it runs)."""
import json
import os
import time

import tyro

import grpo

real_eval_rollouts = grpo.eval_rollouts


def eval_rollouts(run, *args):
    time.sleep(float(os.environ.get("EVAL_DUMP_DELAY_S", 0)))  # lets pushes that follow an EVAL's land before it runs
    outs = real_eval_rollouts(run, *args)
    with open(os.path.join(run.cfg.output_dir, f"eval-rank{run.rank}.jsonl"), "a") as f:
        f.write(json.dumps([[c["text"], [float(x) for x in c["engine_logps"]]] for o in outs for c in o]) + "\n")
    return outs


grpo.eval_rollouts = eval_rollouts
grpo.main(tyro.cli(grpo.Config))
