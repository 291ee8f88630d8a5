"""torchrun --nproc_per_node 2 tests/dist_rm_shard_fail.py RM_DIR: a sharded rm:PATH reward model (--data.rm-shard-gb
0) whose forward fails on rank 0 only (its score head raises in the first pass, after that pass's all-gathers). Both
ranks give the batch None through scoring.call_reward (no sample-by-sample retry on rank 0 alone, whose collectives would
no longer match rank 1's). Then a chat template that raises on one of rank 0's rows only: again None on both ranks
(the texts are rendered inside the ranks' agreement). The next batch scores exactly on both: the ranks stayed in step."""
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import scoring  # noqa: E402
import tasks  # noqa: E402
from test_external_rewards import COMPLETIONS, PROMPTS, direct_scores  # noqa: E402

dist.init_process_group("gloo")
rank, path = dist.get_rank(), sys.argv[1]
fn = scoring.resolve_reward("rm:" + path, tasks.DataConfig(rm_batch_size=2, rm_shard_gb=0.0))
armed = [rank == 0]


def fail_once(module, inputs, output):
    if armed[0]:
        armed[0] = False
        raise RuntimeError("injected reward-model failure on rank 0")


fn.model.score.register_forward_hook(fail_once)
mine = slice(0, 5) if rank == 0 else slice(5, 7)  # 3 passes on rank 0, 1 on rank 1
scores, failed, err = scoring.call_reward(fn, PROMPTS[mine], COMPLETIONS[mine], {})
print(f"rank {rank}: first batch {scores}, failed {failed}, error {err!r}", flush=True)
assert scores == [None] * len(scores) and failed == len(scores) and "rank(s) [0]" in str(err)
template = fn.tok.chat_template
fn.tok.chat_template = "{% for m in messages %}{% if '12 + 30' in m['content'] %}{{ raise_exception('bad row') }}" \
    "{% endif %}{% endfor %}" + template  # PROMPTS[1]: one of rank 0's rows
scores, failed, err = scoring.call_reward(fn, PROMPTS[mine], COMPLETIONS[mine], {})
print(f"rank {rank}: template failure {scores}, failed {failed}, error {err!r}", flush=True)
assert scores == [None] * len(scores) and failed == len(scores) and "rank(s) [0]" in str(err)
fn.tok.chat_template = template
scores, failed, err = scoring.call_reward(fn, PROMPTS[mine], COMPLETIONS[mine], {})
ref = direct_scores(path, PROMPTS[mine], COMPLETIONS[mine])
assert failed == 0 and max(abs(a - b) for a, b in zip(scores, ref)) < 1e-5, (scores, ref, err)
dist.barrier()
print(f"rank {rank}: RM SHARD FAILURE OK", flush=True)
dist.destroy_process_group()
