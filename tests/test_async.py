"""Asynchronous rollouts on dedicated inference ranks (--rollout.inference-ranks): real torchrun + gloo, the real vLLM
engine on the generator (the HF engine where the test needs bit-exact sampling across runs)."""
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import tyro

from conftest import ROOT, torchrun, with_earlier_defaults
from test_grpo import metrics

ASYNC = ["--rollout.inference-ranks", "1", "--log.completions-every", "0"]


def check_learned(rows, staleness, label):
    """Reward rise >= 0.2 over 40 steps (the bar leaves room for a machine whose samples learn more slowly; the task
    starts at ~0.2 and ends near 0.8), no sample older than S versions, the async metrics
    present, and the engine's log-probs of the tokens it sampled equal the trainer's (every step with S = 0; with
    S = 1 the steps whose batch came from the newest weights)."""
    evaluated = {r["step"] for r in rows if "eval/accuracy" in r}  # their weights went out for the evaluation
    rows = [r for r in rows if r["step"] > 0]  # (step 0: the baseline evaluation)
    assert [r["step"] for r in rows] == list(range(1, 41))
    first, last = (sum(r["reward/mean"] for r in rs) / 10 for rs in (rows[:10], rows[-10:]))
    print(f"{label}, S={staleness}: reward {first:.3f} -> {last:.3f}")
    assert last - first >= 0.2, (first, last)
    assert max(r["async/staleness_max"] for r in rows) <= staleness
    for k in ("async/staleness_mean", "async/trainer_wait_s", "async/generator_wait_s", "time/weight_transfer"):
        assert all(math.isfinite(r[k]) and r[k] >= 0 for r in rows), k
    assert all(0 <= r["async/probe_mismatch"] < 1e-3 for r in rows)  # the runtime probe check, every batch's version
    assert all(r["time/weight_transfer"] > 0 for r in rows if r["step"] - 1 not in evaluated)  # every other step pushes
    if staleness == 0:  # each side waits for the other every step: the trainer for the batch, the generator for weights
        assert all(r["async/trainer_wait_s"] > 0 and r["async/generator_wait_s"] > 0 for r in rows[1:])
    checked = [r["logprob_mismatch/mean_abs"] for r in rows if math.isfinite(r["logprob_mismatch/mean_abs"])]
    assert checked and max(checked) < 1e-3, checked
    if staleness == 0:
        assert len(checked) == 40
    else:  # generation of batch s + 1 overlapped training on batch s: most batches were one version old
        assert sum(r["async/staleness_mean"] for r in rows) / len(rows) > 0.5


@pytest.mark.parametrize("nproc,staleness,engine", [(2, 1, "vllm"), (3, 0, "hf"), (3, 1, "hf")])
def test_default_task_learns_on_inference_ranks(tmp_path, nproc, staleness, engine):
    """1 trainer + 1 generator (S = 1) and 2 trainers + 1 generator (S = 0 and 1) on the default task (the fourth
    layout, 1 + 1 with S = 0, is the resume test's straight run). Run through tests/async_probe.py: a fixed probe
    (prompt + completion) scored by the trainer at each push of version v and by the generator's engine each time it
    applies a version must agree to <= 1e-3 for every version applied (each after partial pushes of the changed
    layers); the probe moves between versions, so a transfer that did not land would show."""
    out = tmp_path / "run"
    torchrun("tests/async_probe.py", "--output-dir", str(out), "--max-steps", "40", "--rollout.max-staleness",
             str(staleness), "--rollout.engine", engine, *ASYNC, nproc=nproc, timeout=600)
    check_learned(metrics(str(out)), staleness, f"{nproc - 1} trainer(s) + 1 generator ({engine})")
    read = lambda role: {r["version"]: r["logps"] for r in map(json.loads, open(out / f"probe_{role}.jsonl"))}  # noqa: E731
    trainer, generator = read("trainer"), read("generator")
    assert sorted(trainer) == list(range(40)) and len(generator) >= 20 and set(generator) <= set(trainer)
    for v, lp in generator.items():
        assert max(abs(a - b) for a, b in zip(lp, trainer[v])) <= 1e-3, (v, lp, trainer[v])
    assert max(abs(a - b) for a, b in zip(trainer[0], trainer[39])) > 1e-2


def test_broken_weight_transfer_stops_the_run_at_the_default_staleness(tmp_path):
    """1 trainer + 1 generator at S = 1 (nearly every sample stale, so logprob_mismatch is NaN):
    tests/broken_transfer.py scales the generator engine's final norm by 3 after every weight load from its third on
    (the start-up load and one applied version are intact). The steps trained on intact versions show a tiny finite
    async/probe_mismatch; the trainers' probe check then stops the run before training on the first broken version's
    batch, with a message naming that version and the likely causes, at most S steps after the version was pushed.
    (Without the probe check the run trains all 8 steps and exits 0.)"""
    out = tmp_path / "broken"
    code, log, _ = torchrun("tests/broken_transfer.py", "--output-dir", str(out), "--max-steps", "8",
                            "--rollout.engine", "hf", "--rollout.max-staleness", "1", *ASYNC, timeout=300, check=False)
    assert code != 0, log[-3000:]
    found = re.search(r"weight transfer check failed at version (\d+) .* ([\d.e+-]+) nats per token", log)
    assert found and "Likely causes" in log and "--rollout.max-mismatch 0.1" in log, log[-3000:]
    rows, version = metrics(str(out)), int(found.group(1))  # the run stopped at step len(rows): its batch's version
    assert version >= 2 and version <= len(rows) <= version + 1, (len(rows), found.group(0))  # >= step - S
    assert all(0 <= r["async/probe_mismatch"] < 1e-4 for r in rows), [r["async/probe_mismatch"] for r in rows]
    assert float(found.group(2)) > 0.1


def test_staleness_zero_learns_resumes_exactly_and_equals_the_colocated_loop(tmp_path):
    """1 trainer + 1 generator, S = 0, evaluating every 3 steps on the generator: 40 steps learn (check_learned);
    3 steps + --resume for 3 more == the first 6 of them, evaluations included (the generator restarts from the
    trainers' checkpoint); those == the colocated loop on one rank (the same prompts, seeds and weights: the split
    changes nothing); resuming the finished run exits 0 at once (the stop marker). HF engine on the generator: its
    sampling is seeded per completion, bit for bit across processes. (The constant lr schedule makes steps 1-6
    independent of --max-steps.)"""
    common = ["--rollout.engine", "hf", "--eval.every", "3", "--eval.num-prompts", "4", "--rollout.max-staleness", "0",
              *ASYNC]
    a, b, c = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "colocated")
    torchrun("grpo.py", "--output-dir", a, "--max-steps", "40", "--checkpoint.every", "3", *common, timeout=600)
    check_learned(metrics(a), 0, "1 trainer + 1 generator (hf)")
    torchrun("grpo.py", "--output-dir", c, "--max-steps", "6", *common[:6], "--log.completions-every", "0", nproc=1,
             timeout=300, env={"OMP_NUM_THREADS": "1"})  # one thread, as torchrun gives each of the split's ranks
    torchrun("grpo.py", "--output-dir", b, "--max-steps", "3", *common, timeout=300)
    _, log, _ = torchrun("grpo.py", "--output-dir", b, "--max-steps", "6", "--resume", "latest",
                         "--checkpoint.allow-changes", "max_steps", *common, timeout=300)
    assert "resumed from" in log
    ra, rb = metrics(a)[:7], metrics(b)
    assert [r["step"] for r in rb] == [0, 1, 2, 3, 4, 5, 6] and "eval/accuracy" in rb[6]
    skip = ("time/", "tokens_per_s", "mem/", "async/trainer_wait_s", "async/generator_wait_s")
    for x, y in zip(ra, rb):
        assert {k: v for k, v in x.items() if not k.startswith(skip)} == {k: v for k, v in y.items() if not k.startswith(skip)}
    rc = metrics(c)  # one process vs two: float sums may round differently, the samples may not
    same = ("step", "reward/mean", "completion_len/mean", "eval/reward", "eval/accuracy")
    assert [[x.get(k) for k in same] for x in ra] == [[y.get(k) for k in same] for y in rc]
    for x, y in zip(ra, rc):
        keys = [k for k in y if not k.startswith(skip + ("async/",))]
        assert [x[k] for k in keys] == pytest.approx([y[k] for k in keys], rel=1e-4, abs=1e-6), keys
    _, log, secs = torchrun("grpo.py", "--output-dir", b, "--max-steps", "6", "--resume", "latest", *common, timeout=300)
    assert "at step 6" in log and len(metrics(b)) == 7


def _rank_pids(launcher_pid):
    """{world rank: pid} of torchrun's workers (RANK as torchrun set it at exec)."""
    out = {}
    for pid in subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split():
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        rank = [e.split(b"=", 1)[1] for e in env if e.startswith(b"RANK=")]
        if rank:
            out[int(rank[0])] = int(pid)
    return out


def test_killed_generator_stops_the_trainer_with_its_name_across_two_nodes(tmp_path):
    """Two torchrun agents, one rank each, meeting through c10d rendezvous (the multi-node launch, here on one
    machine): node 0 trains, node 1 generates. kill -9 the generator mid-run: the trainer's node exits non-zero within
    --rollout.timeout-s plus a few seconds, with a message naming inference rank 1, and no process of the job is
    left."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out, timeout_s = tmp_path / "killed", 20
    nodes = [subprocess.Popen(with_earlier_defaults([
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n), "--nproc_per_node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "killed", "grpo.py",
        "--output-dir", str(out), "--max-steps", "100000", "--rollout.timeout-s", str(timeout_s), *ASYNC]), cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for n in (0, 1)]
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (out / "metrics.jsonl").exists():
            time.sleep(0.5)
        time.sleep(1.0)  # a few steps in
        pids = {**_rank_pids(nodes[0].pid), **_rank_pids(nodes[1].pid)}  # RANK as each agent set it: the world rank
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], 9)
        t0 = time.time()
        log, _ = nodes[0].communicate(timeout=timeout_s + 60)
        secs = time.time() - t0
        nodes[1].communicate(timeout=60)
    finally:
        for p in nodes:
            p.kill()
    assert nodes[0].returncode != 0 and nodes[1].returncode != 0
    assert secs < timeout_s + 10, secs
    assert re.search(r"rank 0 \(trainer\): .*inference rank 1: no answer", log), log[-4000:]
    alive = [pid for pid in pids.values() if os.path.exists(f"/proc/{pid}") and
             open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    assert not alive, alive


@pytest.mark.parametrize("world,args,message", [
    ("1", ["--rollout.inference-ranks", "1"], "--rollout.inference-ranks 1 leaves no trainer in a world of 1"),
    ("4", ["--rollout.inference-ranks", "3", "--vllm.tp", "2"], "is not a multiple of --vllm.tp 2"),
    ("2", ["--rollout.inference-ranks", "1", "--rollout.max-staleness", "-1"], "--rollout.max-staleness must be >= 0"),
    ("2", ["--rollout.inference-ranks", "1", "--eval.every", "5", "--eval.use-ema", "--ema.decay", "0.9"],
     "--eval.use-ema is not supported with --rollout.infer"),
    ("2", ["--rollout.inference-ranks", "1", "--dynamic-sampling"], "--dynamic-sampling is not supported with"),
])
def test_inference_rank_config_checks(tmp_path, monkeypatch, world, args, message):
    """launch.validate: every rank, before any collective (WORLD_SIZE as torchrun sets it)."""
    import grpo
    monkeypatch.setenv("WORLD_SIZE", world)
    cfg = tyro.cli(grpo.Config, args=["--output-dir", str(tmp_path / "o"), "--rollout.engine", "vllm", *args])
    with pytest.raises(ValueError, match=re.escape(message)):
        grpo.validate(cfg, [])
