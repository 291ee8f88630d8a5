"""Faults injected by the test: damaged checkpoints, a failed save, a changed flag on resume, a second run on one
output directory, pickles where data belongs, NaN/inf and wrong-length rewards. Each asserts the message and that no
checkpoint or metrics line is lost or mixed. The functions are called directly (a 1-rank gloo group), plus one real
torchrun run (HF engine) that goes through all of it end to end."""
import errno
import json
import math
import os
import pickle
import random
import shutil
import socket
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, torchrun, torchrun_cmd, with_earlier_defaults

import checkpoints
import inference_ranks
import messages
import optim
import scoring
import tasks


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A world of one (gloo), so that save_checkpoint / lock_output_dir run their collectives for real."""
    mine = not dist.is_initialized()
    if mine:
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    if mine:
        dist.destroy_process_group()


def tiny_training(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def train_step(model, optimizer):
    model(torch.randn(3, 8)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def save(out, step, model, optimizer):
    state = {"step": step, "config": {}}
    return checkpoints.save_checkpoint(out, 0, step, [
        lambda path: checkpoints.save_resume_state(model, optimizer, path, 0, state)], state)


def three_checkpoints(out):
    """checkpoint-1..3 of a tiny model; -> {step: parameters at that step}."""
    model, optimizer = tiny_training()
    saved = {}
    for step in (1, 2, 3):
        train_step(model, optimizer)
        save(out, step, model, optimizer)
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return saved


def shard_of(ckpt):
    return os.path.join("dcp", next(f for f in os.listdir(os.path.join(ckpt, "dcp")) if f.endswith(".distcp")))


def overwrite_floats(path, n=64):
    """n float32s in the middle of the file replaced by other values (the size stays)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(np.full(n, 0.123, dtype=np.float32).tobytes())


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


# fault -> (what the test does to checkpoint-3, what the message must name)
FAULTS = {
    "64 floats of a dcp shard overwritten": (lambda c: overwrite_floats(os.path.join(c, shard_of(c))), "is not what was saved"),
    "truncated dcp shard": (lambda c: truncate(os.path.join(c, shard_of(c))), "bytes, the manifest says"),
    "truncated rng file": (lambda c: truncate(os.path.join(c, "rng-rank0.pt")), "rng-rank0.pt has"),
    "emptied trainer_state.json": (lambda c: open(os.path.join(c, "trainer_state.json"), "w").close(),
                                   "trainer_state.json has 0 bytes"),
    "dcp metadata deleted": (lambda c: os.remove(os.path.join(c, "dcp", ".metadata")), "dcp/.metadata is missing"),
    "no manifest (save cut short)": (lambda c: os.remove(os.path.join(c, "manifest.json")), "no manifest.json"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_damaged_checkpoint_is_skipped_or_refused(tmp_path, group, capsys, fault):
    """--resume latest takes the newest checkpoint that verifies and says which it skipped and why; --resume PATH to
    the damaged one is refused naming the file; the good one loads bit for bit."""
    out = str(tmp_path / "run")
    saved = three_checkpoints(out)
    damage, named = FAULTS[fault]
    ckpt3 = os.path.join(out, "checkpoint-3")
    damage(ckpt3)
    capsys.readouterr()
    assert checkpoints.resolve_resume(out, "latest", False) == os.path.join(out, "checkpoint-2")
    printed = capsys.readouterr().out
    assert "--resume latest: skipped checkpoint-3 (" in printed and named in printed, printed
    assert checkpoints.resolve_resume(out, "auto", False) == os.path.join(out, "checkpoint-2")
    with pytest.raises(ValueError, match="damaged or unfinished checkpoint") as e:
        checkpoints.resolve_resume(out, ckpt3, False)
    assert named in str(e.value)
    with pytest.raises(FileExistsError, match="already holds checkpoints"):  # a damaged one still counts as a run's
        checkpoints.resolve_resume(out, None, False)
    model, optimizer = tiny_training(seed=1)
    train_step(model, optimizer)  # optimizer state to load into
    checkpoints.load_checkpoint(os.path.join(out, "checkpoint-2"), model, optimizer, 0)
    assert all(torch.equal(v, saved[2][k]) for k, v in model.state_dict().items())


def test_no_checkpoint_verifies(tmp_path, group):
    out = str(tmp_path / "run")
    three_checkpoints(out)
    for step in (1, 2, 3):
        overwrite_floats(os.path.join(out, f"checkpoint-{step}", "rng-rank0.pt"), n=4)
    for resume in ("latest", "auto"):  # auto must not start fresh over damaged checkpoints
        with pytest.raises(ValueError, match="no checkpoint in .* verifies: checkpoint-3 .*checkpoint-2 .*checkpoint-1"):
            checkpoints.resolve_resume(out, resume, False)


def test_failed_save_leaves_no_temp_dir_and_says_no_space(tmp_path, group, capsys):
    """A save that hits ENOSPC: the unfinished .tmp-checkpoint-* is removed, the error says "no space left on device"
    in words and names the newest complete checkpoint, which still verifies. A temp dir left by a killed save is
    removed at the next start."""
    out = str(tmp_path / "run")
    model, optimizer = tiny_training()
    save(out, 1, model, optimizer)

    def disk_full(path):
        with open(os.path.join(path, "partial.bin"), "wb") as f:
            f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(path, "partial.bin"))
    with pytest.raises(OSError, match="no space left on device") as e:
        checkpoints.save_checkpoint(out, 0, 2, [disk_full], {"step": 2})
    assert "checkpoint-1" in str(e.value)
    assert sorted(os.listdir(out)) == ["checkpoint-1"]
    assert checkpoints.verify(os.path.join(out, "checkpoint-1")) is None
    import torch.distributed.checkpoint.filesystem as dcp_files
    real = dcp_files._write_item
    dcp_files._write_item = lambda *a, **k: disk_full(os.path.join(out, ".tmp-checkpoint-3"))  # full inside DCP
    try:
        with pytest.raises(OSError, match="no space left on device"):
            save(out, 3, model, optimizer)
    finally:
        dcp_files._write_item = real
    assert sorted(os.listdir(out)) == ["checkpoint-1"]
    os.makedirs(os.path.join(out, ".tmp-checkpoint-7", "dcp"))  # what a killed save leaves
    capsys.readouterr()
    checkpoints.restore_interrupted_replace(out)
    assert sorted(os.listdir(out)) == ["checkpoint-1"] and ".tmp-checkpoint-7" in capsys.readouterr().out


class Marker:
    """Unpickling this creates a file: what a hostile checkpoint or message could do with any code."""
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_rng_states_load_as_data_and_resume_bit_exact(tmp_path, group):
    """RNG states saved as tensors load with weights_only=True and continue every stream exactly; an rng file that
    holds a pickled object (a checkpoint from elsewhere, its manifest in order) is refused without running it."""
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    np.random.randn()  # a cached Gaussian in numpy's state too
    state = checkpoints.rng_state()
    expected = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3))
    torch.save(state, tmp_path / "rng.pt")
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    checkpoints.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3))
    assert got[:4] == expected[:4] and torch.equal(got[4], expected[4])

    out = str(tmp_path / "run")
    model, optimizer = tiny_training()
    ckpt = save(out, 1, model, optimizer)
    marker = str(tmp_path / "code-ran")
    with open(os.path.join(ckpt, "rng-rank0.pt"), "wb") as f:
        pickle.dump({"python": Marker(marker)}, f)
    checkpoints.write_manifest(ckpt)
    with pytest.raises(pickle.UnpicklingError):
        checkpoints.load_checkpoint(ckpt, model, optimizer, 0)
    assert not os.path.exists(marker)


def test_cross_rank_messages_are_data_not_code(tmp_path):
    """What a generator sends a trainer round-trips exactly (bf16 tensors, dtypes, NaN, a dataset row by index); bytes
    holding a pickle are refused without running it."""
    rows = [{"prompt": "p0", "image": object()}, {"prompt": "p1", "answer": "3"}]
    msg = {"step": 4, "version": 3, "samples": [{"row": rows[1], "prompt_ids": [1, 2], "engine_logps": [-0.5, float("nan")],
                                                  "truncated": False, "mm": {"pixel_values": torch.randn(2, 3).bfloat16()}}],
           "meta": {"dtype": torch.bfloat16, "shapes": [(2, 3), ()]}}
    got = messages.decode(messages.encode(msg, rows), rows)
    sample = got["samples"][0]
    assert sample["row"] is rows[1] and sample["prompt_ids"] == [1, 2] and math.isnan(sample["engine_logps"][1])
    assert torch.equal(sample["mm"]["pixel_values"], msg["samples"][0]["mm"]["pixel_values"])
    assert got["meta"] == {"dtype": torch.bfloat16, "shapes": [[2, 3], []]}

    marker = str(tmp_path / "code-ran")
    hostile = pickle.dumps({"samples": Marker(marker)})
    payload = torch.frombuffer(bytearray(len(hostile).to_bytes(8, "little") + hostile), dtype=torch.uint8)

    class Bridge:  # what recv_object reads from the network: the size, then the payload
        def recv(self, tensors, src, tag):
            tensors[0].copy_(torch.tensor([payload.numel()]) if tag % 2 == 0 else payload)
            return types.SimpleNamespace(wait=lambda timeout: True)
    link = types.SimpleNamespace(bridge=Bridge(), device=torch.device("cpu"), timeout=None, world_rank=0, role="trainer")
    with pytest.raises(Exception):
        inference_ranks.recv_object(link, 1, 0, "receiving a batch")
    assert not os.path.exists(marker)


def test_resume_refuses_changed_settings_and_lists_them(tmp_path):
    import tyro

    import grpo
    record = lambda *args, world=2: checkpoints.config_record(tyro.cli(grpo.Config, args=list(args)),  # noqa: E731
                                                              train_rows=100, world_size=world)
    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 3, "config": record()}))
    changed = record("--batch-size", "16", "--loss.loss-type", "grpo", "--max-steps", "200")
    with pytest.raises(ValueError) as e:
        checkpoints.check_config(str(ckpt), changed)
    msg = str(e.value)
    assert "--batch-size: 64 in the checkpoint, 16 now" in msg and "--loss.loss-type: 'dapo' in the checkpoint, 'grpo' now" in msg
    assert "--max-steps: 100 in the checkpoint, 200 now" in msg and "--checkpoint.allow-changes max_steps" in msg
    with pytest.raises(ValueError) as e:  # allowed: max_steps no longer listed, the others still are
        checkpoints.check_config(str(ckpt), changed, ("max-steps",))
    assert "--max-steps" not in str(e.value).split("settings:")[1].split("Resume")[0] and "--batch-size" in str(e.value)
    with pytest.raises(ValueError, match="ranks .*: 2 in the checkpoint, 1 now"):
        checkpoints.check_config(str(ckpt), record(world=1))
    with pytest.raises(ValueError, match="only these may change on resume"):
        checkpoints.check_config(str(ckpt), record(), ("batch_size",))
    # logging, checkpoint cadence, output paths never count; max_steps and lr do, with the opt-in
    checkpoints.check_config(str(ckpt), record("--log.completions-every", "0", "--wandb.mode", "offline",
                                               "--checkpoint.every", "5", "--output-dir", "elsewhere"))
    checkpoints.check_config(str(ckpt), record("--max-steps", "200", "--optim.lr", "3e-3"), ("--max-steps", "optim.lr"))
    # a checkpoint written before a flag existed resumes at that flag's default, and is refused when it is set
    older = {k: v for k, v in record().items() if k != "env_args"}
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 3, "config": older}))
    defaults = checkpoints.config_record(grpo.Config())
    checkpoints.check_config(str(ckpt), record(), defaults=defaults)
    with pytest.raises(ValueError, match="--env-args: None in the checkpoint, '{}' now"):
        checkpoints.check_config(str(ckpt), record("--env-args", "{}"), defaults=defaults)


def test_new_lr_applies_on_resume():
    """The saved scheduler restores the old base lr; apply_lr makes the new peak lr the one the next update uses:
    new lr x the schedule's factor at the restored position (warmup 2, cosine over 10 updates, as written here)."""
    factor = lambda u: (u + 1) / 3 if u < 2 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (u - 2) / 8))  # noqa: E731
    model, optimizer = tiny_training()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, optim.lr_lambda(2, "cosine", 10))
    for _ in range(4):
        train_step(model, optimizer)
        scheduler.step()
    saved_opt, saved_sched = optimizer.state_dict(), scheduler.state_dict()

    def resumed(lr, total=10):
        model, optimizer = tiny_training()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, optim.lr_lambda(2, "cosine", total))
        optimizer.load_state_dict(saved_opt)
        scheduler.load_state_dict(saved_sched)
        checkpoints.apply_lr(scheduler, lr)
        return optimizer, scheduler
    same_opt, _ = resumed(1e-2)  # unchanged lr: untouched, bit for bit
    assert same_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    new_opt, new_sched = resumed(4e-3)
    assert new_opt.param_groups[0]["lr"] == pytest.approx(4e-3 * factor(4), rel=1e-12)
    new_sched.step()
    assert new_opt.param_groups[0]["lr"] == pytest.approx(4e-3 * factor(5), rel=1e-12)
    # the same lr and a longer run (--max-steps, cosine over 20 updates): the stretched schedule applies at once
    long = lambda u: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (u - 2) / 18))  # noqa: E731
    long_opt, _ = resumed(1e-2, total=20)
    assert long_opt.param_groups[0]["lr"] == pytest.approx(1e-2 * long(4), rel=1e-12)


def test_second_run_on_an_output_dir_is_refused_and_a_dead_runs_lock_taken_over(tmp_path, group, capsys):
    out = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time, checkpoints; "
                               "print(checkpoints.take_lock(sys.argv[1]), flush=True); time.sleep(120)", out],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "None"
        with pytest.raises(FileExistsError, match="is in use by another run") as e:
            checkpoints.lock_output_dir(out, 0, torch.device("cpu"))
        assert f"host {socket.gethostname()}, pid {holder.pid}," in str(e.value)
    finally:
        holder.kill()
        holder.wait()
    capsys.readouterr()
    checkpoints.lock_output_dir(out, 0, torch.device("cpu"))  # the holder was killed: its lock is free
    assert f"took over the lock of a run that is no longer running (host {socket.gethostname()}, pid {holder.pid}," in \
        capsys.readouterr().out
    assert f"pid {os.getpid()}," in open(os.path.join(out, checkpoints.LOCK)).read()
    checkpoints._held.pop().close()


def test_nonfinite_and_wrong_length_rewards(capsys):
    """NaN/inf become None, counted as failed, the first one printed once with the function's name; a result longer
    or shorter than the batch is one error naming the function and both lengths (never a per-sample retry)."""
    rows = [{"prompt": "p"}] * 4
    nanny = lambda p, c, **_: [float("nan"), 1.0, float("inf"), -float("inf")]  # noqa: E731
    printed = set()
    for _ in range(2):
        r, failed = scoring.score_rewards([("nanny", nanny), ("len", lambda p, c, **_: [len(x) for x in c])], rows,
                                        ["a", "bb", "c", "d"], [[1]] * 4, printed)
        assert failed == [3, 0] and r[:, 0].isnan().tolist() == [True, False, True, True] and r[1, 0] == 1.0
    err = capsys.readouterr().err
    assert err.count("reward function 'nanny' returned nan for a sample: NaN/inf rewards become None") == 1
    for n in (5, 3):
        with pytest.raises(scoring.RewardLengthError, match=f"reward function 'sized' returned {n} rewards for 4 completions"):
            scoring.score_rewards([("sized", lambda p, c, **_: [1.0] * n)], rows, ["a"] * 4, [[1]] * 4, set())


def test_end_to_end_second_launcher_damaged_checkpoint_changed_flag(tmp_path):
    """Real torchrun (2 ranks, HF engine): a second launch on a running run's directory is refused naming the holder;
    the first run, stopped by SIGTERM, has metrics and checkpoints that are all its own. Then its last checkpoint's
    dcp shard is damaged: a resume with a changed flag is refused listing it (nothing written), and --resume latest
    skips the damaged one (naming the file), resumes from the one before and writes the same steps again exactly."""
    import signal
    out = str(tmp_path / "run")
    common = ["grpo.py", "--output-dir", out, "--checkpoint.every", "4", "--checkpoint.keep", "0",
              "--rollout.engine", "hf", "--log.completions-every", "0", "--log.no-progress"]
    first = subprocess.Popen(with_earlier_defaults(torchrun_cmd(*common, "--max-steps", "100000")), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    lock = os.path.join(out, checkpoints.LOCK)
    deadline = time.time() + 300
    while time.time() < deadline and first.poll() is None and not (os.path.exists(lock) and open(lock).read()):
        time.sleep(0.2)  # until the first run holds the directory
    holder = open(lock).read().strip().split(", since")[0]
    code, log, _ = torchrun(*common, "--max-steps", "100000", "--resume", "auto", check=False, timeout=300)
    first.send_signal(signal.SIGTERM)
    first_log, _ = first.communicate(timeout=300)
    assert "SIGTERM: checkpoint written" in first_log, first_log[-3000:]  # (torchrun itself exits 1 on SIGTERM)
    assert code != 0 and f"is in use by another run ({holder}" in log, log[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    n = len(rows)
    steps = checkpoints.checkpoint_steps(out)
    assert [r["step"] for r in rows] == list(range(1, n + 1)) and steps[-1] == n and len(steps) >= 2, (n, steps)
    assert all(checkpoints.verify(os.path.join(out, f"checkpoint-{s}")) is None for s in steps)

    last, before = os.path.join(out, f"checkpoint-{n}"), steps[-2]
    shard = shard_of(last)
    overwrite_floats(os.path.join(last, shard))
    code, log, _ = torchrun(*common, "--max-steps", str(n), "--resume", "latest", "--loss.loss-type", "grpo",
                            check=False, timeout=300)
    assert code != 0 and "--loss.loss-type: 'dapo' in the checkpoint, 'grpo' now" in log and "--max-steps" in log
    assert [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))] == rows
    _, log, _ = torchrun(*common, "--max-steps", str(n), "--resume", "latest", "--checkpoint.allow-changes",
                         "max_steps", timeout=300)
    assert f"skipped checkpoint-{n} ({shard} is not what was saved" in log
    assert f"checkpoint-{before} at step {before}" in log
    again = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in again] == list(range(1, n + 1)) and again[:before] == rows[:before]
    skip = ("time/", "tokens_per_s", "mem/")
    for x, y in zip(again[before:], rows[before:]):
        assert {k: v for k, v in x.items() if not k.startswith(skip)} == {k: v for k, v in y.items() if not k.startswith(skip)}
    assert checkpoints.verify(last) is None
    # one more step with a new peak lr (opted in): the update uses it, not the lr the saved scheduler held
    assert n >= 5 and rows[-1]["lr"] == 1e-3  # past the 5 warmup updates: the flat part of the constant schedule
    torchrun(*common, "--max-steps", str(n + 1), "--resume", "latest", "--optim.lr", "2e-3",
             "--checkpoint.allow-changes", "max_steps", "optim.lr", timeout=300)
    assert [json.loads(line)["lr"] for line in open(os.path.join(out, "metrics.jsonl"))][n:] == [2e-3]


def test_hanging_reward_function_is_cut_off(capsys):
    """--data.reward-timeout-s: a user function that does not return in time gives its call's samples None (counted
    as failed) after the limit, not after the call; a function beside it is unaffected."""
    fn = scoring.resolve_reward("rewards_for_tests:hangs", tasks.DataConfig(reward_timeout_s=0.5))
    t0 = time.time()
    r, failed = scoring.score_rewards([("hangs", fn), ("len", lambda p, c, **_: [len(x) for x in c])],
                                    [{"prompt": "p"}] * 3, ["a", "bb", "c"], [[1]] * 3, set())
    assert time.time() - t0 < 1.5 and failed == [3, 0] and r[:, 0].isnan().all() and r[:, 1].tolist() == [1, 2, 1]
    assert "no result within --data.reward-timeout-s 0.5 s" in capsys.readouterr().err


def test_workers_exit_when_torchrun_is_killed(tmp_path):
    """SIGKILL to torchrun: the kernel sends its workers SIGTERM (PR_SET_PDEATHSIG), so none lives on orphaned; they
    take the preemption path (a checkpoint at the next update) and exit."""
    import signal
    out = str(tmp_path / "run")
    launcher = subprocess.Popen(with_earlier_defaults(torchrun_cmd(
        "grpo.py", "--output-dir", out,
        "--max-steps", "100000", "--rollout.engine", "hf", "--log.completions-every", "0", "--log.no-progress")), cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and not (os.path.exists(metrics) and open(metrics).read()):
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 60
    while time.time() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in workers):
        time.sleep(0.2)
    alive = [pid for pid in workers if os.path.exists(f"/proc/{pid}")]
    for pid in alive:  # (a failed test must not leave them behind)
        os.kill(int(pid), signal.SIGKILL)
    assert not alive
    latest = checkpoints.latest_checkpoint(out)
    assert latest is not None and checkpoints.verify(latest) is None


def test_start_is_decided_again_once_the_directory_is_locked(tmp_path, group):
    """Between reading the output directory (validation, before any collective) and holding its lock, another run may
    write a checkpoint there, or a crash may have left one mid-replace (.old-checkpoint-N, put back under the lock):
    the run refuses with a message instead of starting fresh over it (and mixing metrics and checkpoints)."""
    out = str(tmp_path / "run")
    fresh = checkpoints.resolve_resume(out, None, False)  # the decision this run took at validation: start fresh
    three_checkpoints(out)  # meanwhile another run wrote checkpoints 1..3
    with pytest.raises(FileExistsError, match="already holds checkpoints"):  # the fresh-start rule, now it applies
        checkpoints.take_output_dir(out, None, False, fresh, 0, torch.device("cpu"))
    checkpoints._held.pop().close()
    # a replace cut between its two renames: only .old-checkpoint-3 is left, so --resume auto saw nothing to resume
    os.rename(os.path.join(out, "checkpoint-3"), os.path.join(out, ".old-checkpoint-3"))
    for step in (1, 2):
        shutil.rmtree(os.path.join(out, f"checkpoint-{step}"))
    assert checkpoints.resolve_resume(out, "auto", False) is None
    with pytest.raises(FileExistsError, match=r"start from .*checkpoint-3, not scratch"):
        checkpoints.take_output_dir(out, "auto", False, None, 0, torch.device("cpu"))
    checkpoints._held.pop().close()
    assert checkpoints.resolve_resume(out, "auto", False).endswith("checkpoint-3")  # put back: the next start resumes


def test_a_resume_that_fails_to_load_leaves_metrics_jsonl_whole(tmp_path, monkeypatch):
    """checkpoints.start_run cuts metrics.jsonl (and episodes.jsonl) to the checkpoint's step only once everything is
    loaded: a critic whose state fails to load (load_more) ends the resume with the rows of the steps after the
    checkpoint still there (the run is not resumed, so nothing may be lost)."""
    from types import SimpleNamespace

    import checkpoints
    metrics, episodes = tmp_path / "metrics.jsonl", tmp_path / "episodes.jsonl"
    for log in (metrics, episodes):
        log.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    run = SimpleNamespace(module=None, optimizer=opt, ema=None, rank=0, metrics_path=str(metrics),
                          scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0), cfg=SimpleNamespace(
                              optim=SimpleNamespace(lr=0.1), output_dir=str(tmp_path)))
    monkeypatch.setattr(checkpoints, "load_checkpoint", lambda *a, **k: {
        "scheduler": run.scheduler.state_dict(), "step": 2, "bad_steps": 0})

    def critic_fails(state):
        raise RuntimeError("critic state unreadable")
    with pytest.raises(RuntimeError, match="critic state unreadable"):
        checkpoints.start_run(run, str(tmp_path / "checkpoint-2"), critic_fails)
    for log in (metrics, episodes):
        assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4, 5]
    checkpoints.start_run(run, str(tmp_path / "checkpoint-2"))  # loaded: the steps after 2 go (they are rerun)
    for log in (metrics, episodes):  # (--log.episodes-every's file too)
        assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]


def test_a_sigterm_that_lands_during_the_stop_vote_is_not_lost(tmp_path, monkeypatch):
    """The real SIGTERM handler (checkpoints.start_run's) with the signal delivered while this rank's stop vote is in
    flight (inside the collective, after its vote was cast): the vote says "go on", and the next one stops and saves.
    The flag is never written back from a vote; assigning the vote to it dropped this signal, and the run trained on
    until torchrun's SIGKILL 30 s later (seen once in the suite: test_sigterm_writes_checkpoint_before_exit)."""
    import signal
    from types import SimpleNamespace
    run = SimpleNamespace(sigterm=False, rank=1, start_step=0, bad_steps=0, device=torch.device("cpu"),
                          cfg=SimpleNamespace(max_steps=100, checkpoint=SimpleNamespace(every=0)))
    before = signal.getsignal(signal.SIGTERM)
    try:
        checkpoints.start_run(run, None)

        def vote_with_the_signal_in_flight(flag, device):
            os.kill(os.getpid(), signal.SIGTERM)  # its Python handler runs at the next bytecode, after `flag` was read
            for _ in range(100):
                pass
            return flag
        monkeypatch.setattr(checkpoints, "any_rank", vote_with_the_signal_in_flight)
        saved = []
        assert not checkpoints.maybe_save(run, 1, lambda r, step: saved.append(step)) and saved == []
        assert run.sigterm  # the handler ran inside the vote
        monkeypatch.setattr(checkpoints, "any_rank", lambda flag, device: flag)  # a world of one
        assert checkpoints.maybe_save(run, 2, lambda r, step: saved.append(step)) and saved == [2]
    finally:
        signal.signal(signal.SIGTERM, before)
