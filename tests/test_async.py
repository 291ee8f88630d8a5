"""Asynchronous rollouts on dedicated inference ranks (--rollout.inference-ranks): real torchrun + gloo, the real vLLM
engine on the generator (the HF engine where the test needs bit-exact sampling across runs)."""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
import tyro

from conftest import ROOT, run, torchrun, with_earlier_defaults
from test_compat import COMBO, EMA_EVAL
from test_episodes import COMMON as EPISODE_FLAGS, dump
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


@pytest.mark.parametrize("inflight", [0, 1])
def test_ema_evaluation_on_an_inference_rank_then_the_live_weights_generate(tmp_path, inflight):
    """1 trainer + 1 generator, S = 0 (also with --rollout.inflight-updates 1: the live twin, staged while the EMA is
    evaluated, must not be loaded between its chunks), --eval.use-ema with the EMA ~ the initial weights
    (decay 1 - 1e-6), evaluated
    at steps 0, 2 and 4 (the last): tests/eval_dump.py records the generator's evaluations, and steps 2's and 4's
    greedy texts and engine log-probs == step 0's (the live weights, updates at lr 5e-2 later, answer differently);
    every step's batch, step 3's (generated after the EMA evaluation) included, matches the trainer's log-probs and
    the probe: the live weights came back before any batch."""
    out = str(tmp_path / "run")
    torchrun("tests/eval_dump.py", "--output-dir", out, "--rollout.max-staleness", "0", "--eval.num-prompts", "2",
             *ASYNC[:2], *EMA_EVAL, *COMBO, "--max-steps", "4", "--rollout.inflight-updates", str(inflight),
             timeout=600, env={"EVAL_DUMP_DELAY_S": "1" if inflight else "0"})  # the live twin staged by then
    rows = {r["step"]: r for r in metrics(out)}
    assert sorted(rows) == [0, 1, 2, 3, 4] and all("eval/reward" in rows[s] for s in (0, 2, 4)), rows
    assert all(rows[s]["logprob_mismatch/mean_abs"] <= 1e-3 and rows[s]["async/probe_mismatch"] < 1e-3
               and rows[s]["async/staleness_max"] == 0 for s in (1, 2, 3, 4)), rows
    evals = [json.loads(x) for x in open(os.path.join(out, "eval-rank0.jsonl"))]  # the generator's, one per evaluation
    pairs = [(a, b) for e in evals[1:] for a, b in zip(evals[0], e, strict=True)]
    assert len(evals) == 3 and pairs and all(a[0] == b[0] for a, b in pairs), evals  # the same greedy texts
    assert max(abs(x - y) for a, b in pairs for x, y in zip(a[1], b[1], strict=True)) < 1e-4, pairs


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
    independent of --max-steps, so the straight run's checkpoint-3, copied with its metrics rows, stands for a 3-step
    run's.)"""
    common = ["--rollout.engine", "hf", "--eval.every", "3", "--eval.num-prompts", "4", "--rollout.max-staleness", "0",
              *ASYNC, "--checkpoint.keep", "0"]
    a, b, c = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "colocated")
    torchrun("grpo.py", "--output-dir", a, "--max-steps", "40", "--checkpoint.every", "3", *common, timeout=600)
    check_learned(metrics(a), 0, "1 trainer + 1 generator (hf)")
    torchrun("grpo.py", "--output-dir", c, "--max-steps", "6", *common[:6], "--log.completions-every", "0", nproc=1,
             timeout=300, env={"OMP_NUM_THREADS": "1"})  # one thread, as torchrun gives each of the split's ranks
    os.makedirs(b)  # b as a 3-step run leaves it: a's checkpoint-3 and its metrics rows up to step 3
    shutil.copytree(os.path.join(a, "checkpoint-3"), os.path.join(b, "checkpoint-3"))
    with open(os.path.join(b, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in metrics(a) if r["step"] <= 3)
    _, log, _ = torchrun("grpo.py", "--output-dir", b, "--max-steps", "6", "--resume", "latest",
                         "--checkpoint.allow-changes", "max_steps", *common, timeout=300)
    assert "resumed from" in log
    ra, rb = metrics(a)[:7], metrics(b)
    assert [r["step"] for r in rb] == [0, 1, 2, 3, 4, 5, 6] and "eval/accuracy" in rb[6]
    # (sync/bytes too: the resumed run's first push sends every weight, the straight run's the trained layers only)
    skip = ("time/", "tokens_per_s", "mem/", "async/trainer_wait_s", "async/generator_wait_s", "sync/bytes")
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


def test_killed_generator_stops_the_trainers_with_its_name_across_two_nodes(tmp_path):
    """Two torchrun agents meeting through c10d rendezvous (the multi-node launch, here on one machine): node 0 holds
    two trainers, node 1 the generator serving both, with --rollout.inflight-updates 1 (the generator takes weights
    between one-token chunks: it is killed mid-batch with pushes arriving; on CPU the trainers' side is the same
    without). kill -9 the generator mid-run: the trainers' node exits non-zero within --rollout.timeout-s plus a few
    seconds; one line names inference rank 2 for the run (both trainers waited on it: only the first to report it
    prints), no trainer prints a raw collective traceback (the second trainer's FSDP collective is closed under it:
    found by review), no process is left."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out, timeout_s = tmp_path / "killed", 20
    nodes = [subprocess.Popen(with_earlier_defaults([
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n), "--nproc_per_node",
        str(2 - n),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "killed", "grpo.py",
        "--output-dir", str(out), "--max-steps", "100000", "--rollout.timeout-s", str(timeout_s),
        "--rollout.inflight-updates", "1", *ASYNC]), cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for n in (0, 1)]
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (out / "metrics.jsonl").exists():
            time.sleep(0.5)
        time.sleep(1.0)  # a few steps in
        pids = {**_rank_pids(nodes[0].pid), **_rank_pids(nodes[1].pid)}  # RANK as each agent set it: the world rank
        assert sorted(pids) == [0, 1, 2], pids
        os.kill(pids[2], 9)
        t0 = time.time()
        log, _ = nodes[0].communicate(timeout=timeout_s + 60)
        secs = time.time() - t0
        nodes[1].communicate(timeout=60)
    finally:
        for p in nodes:
            p.kill()
    assert nodes[0].returncode != 0 and nodes[1].returncode != 0
    assert secs < timeout_s + 10, secs
    named = re.findall(r"rank (\d) \(trainer\): .*inference rank 2: no answer", log)
    assert len(named) == 1 and log.count("no answer") == 1, log[-4000:]  # one message, from one trainer
    assert not re.findall(r"\[rank\d\]: (?:RuntimeError|torch\.distributed\.DistBackendError)", log), log[-4000:]
    alive = [pid for pid in pids.values() if os.path.exists(f"/proc/{pid}") and
             open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    assert not alive, alive


@pytest.mark.parametrize("world,args,message", [
    ("1", ["--rollout.inference-ranks", "1"], "--rollout.inference-ranks 1 leaves no trainer in a world of 1"),
    ("4", ["--rollout.inference-ranks", "3", "--vllm.tp", "2"], "is not a multiple of --vllm.tp 2"),
    ("2", ["--rollout.inference-ranks", "1", "--rollout.max-staleness", "-1"], "--rollout.max-staleness must be >= 0"),
])
def test_inference_rank_config_checks(tmp_path, monkeypatch, world, args, message):
    """flags.validate: every rank, before any collective (WORLD_SIZE as torchrun sets it)."""
    import flags
    import grpo
    monkeypatch.setenv("WORLD_SIZE", world)
    cfg = tyro.cli(grpo.Config, args=["--output-dir", str(tmp_path / "o"), "--rollout.engine", "vllm", *args])
    with pytest.raises(ValueError, match=re.escape(message)):
        flags.validate(cfg, [])


# ----------------------------------------------------------------------------------------------------------
# Multi-turn episodes (tools, environments) on the inference ranks: tests/episode_dump.py records both sides
# ----------------------------------------------------------------------------------------------------------

FLAKY_ROWS = [("12*3?", None), ("45*7?", "step"), ("88*2?", None), ("31*9?", "reset"), ("64*5?", "step_hang"),
              ("27*4?", None), ("53*6?", None), ("19*8?", None),  # tests/tools_for_tests.py FlakyEnv: how each breaks
              ("72*3?", None), ("15*9?", None)]  # held out: --eval.num-prompts 2


def check_episodes_token_exact(samples, generator):
    """Every trained episode's model tokens (mask 1) are exactly ids one engine call of the generator sampled, at the
    positions it sampled them after exactly the ids it was given; every other completion token is inserted (mask 0);
    and every batch the generator sent was generated between two weight loads (no swap inside an episode).
    -> (model tokens, inserted tokens)."""
    calls, n_model, n_inserted = generator["engine"], 0, 0
    for s in samples:
        ids, P = s["prompt_ids"] + s["completion_ids"], len(s["prompt_ids"])
        model_pos = [0] * len(s["completion_ids"])
        for p, c, _ in calls:
            if c and len(p) >= P and ids[:len(p) + len(c)] == p + c:
                model_pos[len(p) - P:len(p) - P + len(c)] = [1] * len(c)
        assert s["completion_mask"] == model_pos, (s["completion_mask"], model_pos)
        n_model, n_inserted = n_model + sum(model_pos), n_inserted + len(model_pos) - sum(model_pos)
    for b in generator["batches"]:
        loads = generator["engine_loads"][slice(*b["engine_calls"])]
        assert loads and len(set(loads)) == 1, (b, loads)
    return n_model, n_inserted


def test_episodes_on_an_inference_rank_equal_the_colocated_loop(tmp_path, tool_model):
    """The warmed-up tool model calls `multiply`; FlakyEnv (an environment of 3 observed turns) raises in reset() on
    one row, in step() on another and hangs in step() past --rollout.env-timeout-s on a third. 1 trainer + 1 generator
    at S = 0 against the colocated loop on one process, 2 steps (HF engine: seeded per completion, bit for bit across
    processes): the trained samples are the same (prompt and completion ids, masks, messages, env rewards and errors),
    so are the advantages, the loss's log-probs and their gradients, and the metrics (reward/failed counts the broken
    episodes; tool_time_s holds the environment's hang), evaluations included (greedy episodes on 2 held-out rows,
    generated on the generator). The first environment failure prints once, from the generator. On the generator:
    the trained ids are the engine's on model turns, inserted tokens masked, each batch generated by one weight load."""
    data = tmp_path / "flaky.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "fail": f}) for p, f in FLAKY_ROWS))
    flags = ["tests/episode_dump.py", "--model", tool_model, "--dataset", str(data), "--max-steps", "2",
             "--data.tools", "tools_for_tests:multiply", "--env", "tools_for_tests:FlakyEnv", "--rollout.max-turns", "4",
             "--rollout.env-timeout-s", "1", "--rollout.max-completion-length", "64", "--rollout.engine", "hf",
             *EPISODE_FLAGS, "--batch-size", "16", "--micro-batch-size", "16", "--eval.every", "1",
             "--eval.num-prompts", "2"]
    a, c = str(tmp_path / "async"), str(tmp_path / "colocated")
    _, log, _ = torchrun(*flags, "--output-dir", a, "--rollout.max-staleness", "0", *ASYNC, timeout=600)
    run([sys.executable, *flags, "--output-dir", c], timeout=600, env={"OMP_NUM_THREADS": "1"})
    ra, rc, da, dc = metrics(a), metrics(c), dump(a), dump(c)
    keys = ("prompt_ids", "completion_ids", "completion_mask", "messages", "env_reward", "env_error", "reward", "turns",
            "tool_calls", "truncated")
    assert [[{k: s[k] for k in keys} for s in step] for step in da["samples"]] == \
        [[{k: s[k] for k in keys} for s in step] for step in dc["samples"]]
    for x, y in zip(da["advantages"] + [r["logps"] for r in da["loss"]] + [r["grad"] for r in da["loss"]],
                    dc["advantages"] + [r["logps"] for r in dc["loss"]] + [r["grad"] for r in dc["loss"]]):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-6)
    skip = ("time/", "tokens_per_s", "mem/", "async/", "tool_time_s")
    assert [r["step"] for r in ra] == [r["step"] for r in rc] == [0, 1, 2] and all("eval/reward" in r for r in ra)
    for x, y in zip(ra, rc):
        k = [k for k in y if not k.startswith(skip)]
        assert [x[k] for k in k] == pytest.approx([y[k] for k in k], rel=1e-4, abs=1e-6), k
    ra = ra[1:]  # the training steps
    samples = [s for step in da["samples"] for s in step]
    assert all(s["staleness"] == 0 for s in samples) and all(r["async/staleness_max"] == 0 for r in ra)
    errors = {s["env_error"] for s in samples} - {None}
    assert {"env.reset() raised RuntimeError: deliberate reset failure", "env.step() raised ValueError: deliberate "
            "step failure", "env.step() timed out after 1 s (--rollout.env-timeout-s)"} == errors
    assert len(re.findall(r"\[rank (\d)\] env\.\w+\(\) .*: its episode ends with reward None", log)) == 1
    assert "[rank 1] env." in log  # printed once, by the generator (world rank 1) where the environment runs
    assert [r["reward/failed"] for r in ra] == [sum(s["env_error"] is not None for s in step) for step in da["samples"]]
    hung = sum(s["env_error"] == "env.step() timed out after 1 s (--rollout.env-timeout-s)" for s in samples)
    assert sum(r["tool_time_s"] for r in ra) * 16 >= hung * 0.95  # each episode whose step() hung waited its 1 s
    assert min(r["tool_calls/mean"] for r in ra) > 0 and max(s["turns"] for s in samples) >= 3
    n_model, n_inserted = check_episodes_token_exact(samples, torch.load(os.path.join(a, "dump-rank1.pt"),
                                                                         weights_only=False))
    print(f"{len(samples)} episodes, turns {sorted({s['turns'] for s in samples})}, {n_model} model tokens, "
          f"{n_inserted} inserted, {len(errors)} kinds of environment failure")
    assert n_model > 0 and n_inserted > 0


def test_episodes_learn_at_staleness_one_with_broken_tools(tmp_path, tool_model):
    """1 trainer + 1 generator at S = 1: CountingEnv rewards each model turn by its length (3 observed turns), and the
    model's `multiply` calls go to a broken tool (odd calls raise, even ones hang past --rollout.tool-timeout-s). The
    reward rises (the model learns to write longer turns: measured 1.4 -> 13 over 30 steps); no episode is more than
    one version old, and each episode's staleness is its step minus the version its generator held for the whole
    batch (one weight load per batch, though versions arrive while it generates); the tool errors are counted and
    answered, the run finishes; the trained ids are the engine's on model turns."""
    data = tmp_path / "products.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{a}*{b}?"}) for a in range(11, 43, 4) for b in (3, 7)))
    out = str(tmp_path / "s1")
    torchrun("tests/episode_dump.py", "--model", tool_model, "--dataset", str(data), "--output-dir", out,
             "--max-steps", "24", "--env", "tools_for_tests:make_counting_env", "--data.tools", "broken_tools:multiply",
             "--rollout.tool-timeout-s", "0.5", "--rollout.max-turns", "4", "--rollout.max-completion-length", "96",
             "--rollout.engine", "hf", *EPISODE_FLAGS, "--batch-size", "16", "--micro-batch-size", "16",
             "--optim.lr", "1e-4", "--rollout.max-staleness", "1", *ASYNC, timeout=600)
    rows, rec = metrics(out), dump(out)
    generator = torch.load(os.path.join(out, "dump-rank1.pt"), weights_only=False)
    first, last = (sum(r["reward/mean"] for r in rs) / 6 for rs in (rows[:6], rows[-6:]))
    print(f"episodes at S=1: reward {first:.2f} -> {last:.2f}, tool errors {sum(r['tool_errors'] for r in rows):.0f}")
    assert [r["step"] for r in rows] == list(range(1, 25)) and last - first >= 2.0, (first, last)
    assert max(r["async/staleness_max"] for r in rows) <= 1 and sum(r["async/staleness_mean"] for r in rows) / 24 > 0.5
    version = {b["step"]: b["version"] for b in generator["batches"]}
    for step, samples in enumerate(rec["samples"]):
        assert {s["staleness"] for s in samples} == {step - version[step]} and step - version[step] <= 1
    assert sum(r["tool_errors"] for r in rows) > 0 and all(r["tool_time_s"] > 0 for r in rows)
    n_model, n_inserted = check_episodes_token_exact([s for st in rec["samples"] for s in st], generator)
    assert n_model > 0 and n_inserted > 0 and generator["loads"] >= 12


def test_an_episode_row_travels_as_its_dataset_row_plus_new_columns():
    """An environment's episode carries a copy of its dataset row plus env_reward (episodes.run_episodes): it crosses
    to the trainer as the row's index and the new column, so a row holding what JSON cannot carry (an image, bytes)
    arrives whole; a dict that only looks like a row (other values) is sent as itself."""
    import inference_ranks
    import messages
    rows = [{"prompt": "p0", "image": object(), "answer": "1"}, {"prompt": "p1", "image": b"\x89PNG", "answer": "3"}]
    episode_row = {**rows[1], "env_reward": 2.5}
    lookalike = {"prompt": rows[1]["prompt"], "answer": "4"}
    got = messages.decode(messages.encode({"samples": [{"row": episode_row}, {"row": rows[0]},
                                                                     {"row": lookalike}]}, rows), rows)["samples"]
    assert got[0]["row"] == episode_row and got[0]["row"]["image"] is rows[1]["image"]
    assert got[1]["row"] is rows[0] and got[2]["row"] == lookalike


def test_all_rewards_failing_on_a_generator_stops_with_one_message(tmp_path):
    """--dynamic-sampling scores on the generator. A reward function that raises on every sample stops the run as the
    colocated loop does (test_grpo.test_all_rewards_failing_stops_the_run): one `error:` line (the generator forwards
    it to the trainers, which print it), no trainer traceback, and the generator's reward failure labelled with its
    world rank (found by review: the trainer's 'no answer' traceback, and [rank 0] for the generator)."""
    code, log, _ = torchrun("grpo.py", "--output-dir", str(tmp_path / "x"), "--max-steps", "3", "--rollout.engine",
                            "hf", "--rollout.inference-ranks", "1", "--rollout.max-staleness", "1", "--dynamic-sampling",
                            "--data.rewards", "rewards_for_tests:always_raises", "--eval.every", "0",
                            "--rollout.timeout-s", "60", check=False, timeout=300)
    assert code != 0 and log.count("every reward function failed") == 1, log[-3000:]
    assert "[rank 1] reward function 'rewards_for_tests:always_raises' raised" in log, log[-3000:]
    assert "RuntimeError: rank 0 (trainer)" not in log, log[-3000:]


def test_a_generator_that_lost_its_trainer_names_it(monkeypatch, capsys):
    """The staging thread of a generator whose trainer died (killed mid-push) hands its wait's failure to the main
    thread (inference_ranks.raise_staged_error, between batches or chunks): console.run_script prints it as the one
    line naming trainer rank 0, as a trainer names a dead generator; it said 'a peer left the run: see the first
    message' instead, and with the trainer killed there is no first message (seen on a two-node kill -9 of the
    trainer). In process, no launch."""
    from datetime import timedelta

    import console
    import inference_ranks

    def closed():
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
    link = inference_ranks.Link("generator", 1, 2, 1, 1, timedelta(seconds=20), None, None, torch.device("cpu"))
    staged = {"error": None}
    try:
        inference_ranks._wait(closed, link, "receiving weights from trainer rank 0")
    except RuntimeError as e:
        staged["error"] = e
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        console.run_script(lambda cfg: inference_ranks.raise_staged_error(link, staged), None)
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "trainer rank 0: no answer" in err and len(err.splitlines()) == 1, err
