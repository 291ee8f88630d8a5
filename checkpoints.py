"""checkpoints.py: checkpoints, written and read. A checkpoint is written atomically (a temp dir, then one rename):
the policy in Hugging Face format, the sharded model and optimizer for exact resume, RNG states as data, the trainer
state. A manifest of its files (size and CRC-32 of each), written last, defines a complete checkpoint and is checked
before anything in it is read; the run's resolved config, recorded in it, is compared with the resuming run's; and a
lock gives an output directory to one run at a time. launch.py / flow_launch.py call the checks at start-up.

The checks are plain functions without collectives (but lock_output_dir): every rank checks the same files, raises
the same error. The writes and loads are marked "(collective)"."""
import atexit
import dataclasses
import errno
import fcntl
import json
import os
import random
import shutil
import signal
import socket
import time
import traceback
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

import console
import models
import weight_sync
from distributed import any_rank, full_tensor
from optim import ema_weights, trainable

MANIFEST, LOCK = "manifest.json", ".lock"

# Fields that cannot change what a run computes (paths, logging, waits, memory knobs): never compared on resume
FREE_ON_RESUME = ("output_dir", "resume", "overwrite", "log.", "wandb.", "checkpoint.", "rollout.timeout_s",
                  "vllm.gpu_memory_utilization", "vllm.kv_cache_gb", "vllm.enable_sleep_mode", "vllm.sleep_level",
                  "vllm.sync_bucket_mb", "vllm.block_size", "policy.gradient_checkpointing", "data.import_timeout_s",
                  "data.reward_timeout_s", "data.http_timeout_s", "data.http_retries", "data.rm_batch_size",
                  "rollout.tool_timeout_s", "rollout.env_timeout_s")
# Fields that change the run but may change on resume when named in --checkpoint.allow-changes: what changes then
CHANGEABLE_ON_RESUME = {
    "max_steps": "the run ends at the new step (a cosine schedule is stretched to the new length)",
    "optim.lr": "the new peak lr applies from the first resumed update (the schedule's shape is kept)",
    "optim.max_grad_norm": "clipping uses the new norm",
    "max_bad_steps": "the stop after bad steps uses the new count",
    "eval.every": "evaluations follow the new cadence (0 <-> nonzero changes the training rows: refused by train_rows)",
    "eval.n_samples": "evaluations draw the new number of samples",
    "micro_batch_size": "the same gradient, summed in other groups (equal to rounding, not bit for bit)",
    "micro_batch_tokens": "the same gradient, summed in other groups (equal to rounding, not bit for bit)",
    "policy.dtype": "the policy computes in the new precision (the master weights and optimizer state stay fp32)",
    "rollout.engine": "generation moves to the other engine, whose samples differ",
}
# Derived facts recorded next to the config, and the flags that decide them
DERIVED = {"train_rows": "training rows (--dataset, --data.size, --eval.every, --eval.num-prompts)",
           "world_size": "ranks (torchrun --nproc-per-node x nodes)"}


@dataclass(kw_only=True)
class RunState:
    """What grpo.py's and flow_grpo.py's Run records share (launch.Run, flow_launch.Run): the checkpointed state
    save_run, start_run, maybe_save and preempted read, the data order, the reward functions."""
    cfg: object  # grpo.Config or flow_grpo.Config
    rank: int
    world: int  # the ranks that hold rows of their own (world / N with --policy.context-parallel N)
    device: torch.device
    rows: list
    eval_rows: list
    order: np.ndarray  # data order, the same on every rank: position = step
    module: torch.nn.Module = None  # the FSDP2 root the optimizer trains
    ref_module: torch.nn.Module | None = None  # a frozen copy (None: no reference, or the adapter-disabled base)
    optimizer: torch.optim.Optimizer = None
    scheduler: object = None
    ema: dict | None = None  # {name: float32 EMA of a trainable (sharded) parameter} (--ema.decay > 0)
    reward_fns: list = field(default_factory=list)  # [(name, fn)]
    weights: list = field(default_factory=list)
    metrics_path: str = ""
    start_step: int = 0
    bad_steps: int = 0
    sigterm: bool = False
    printed_errors: set = field(default_factory=set)
    config_record: dict = field(default_factory=dict)  # config_record(): saved, compared on resume


# ---- Manifest: the files of a complete checkpoint, their sizes and CRC-32s ----

def file_crc(path, chunk=1 << 24):
    """CRC-32 of a file, read in 16 MiB blocks (zlib's CRC runs at GB/s: a check for damage, not for tampering)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def write_manifest(path):
    """(rank 0, after every file of the checkpoint is written) {relative path: [bytes, crc32]} of each file, written
    to a temp name and renamed: its presence marks the checkpoint complete, its entries let resume check it."""
    full_paths = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    files = {os.path.relpath(full, path): [os.path.getsize(full), file_crc(full)] for full in full_paths}
    tmp = os.path.join(path, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": 1, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST))


def verify(path):
    """-> None when every file in the checkpoint's manifest has its recorded size and CRC-32, else why not (naming
    the file). Sizes are checked first (cheap: truncation, an emptied file), then contents."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (the save did not finish, or the checkpoint predates manifests)"
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    for rel, (size, _) in sorted(files.items()):
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        if os.path.getsize(full) != size:
            return f"{rel} has {os.path.getsize(full)} bytes, the manifest says {size}"
    for rel, (_, crc) in sorted(files.items()):
        if file_crc(os.path.join(path, rel)) != crc:
            return f"{rel} is not what was saved (its CRC-32 differs from the manifest's)"
    return None


# ---- Resume state as data (no pickle), and a new lr that really applies ----

def rng_state():
    """Every RNG state as tensors and plain values, so that it loads with torch.load(weights_only=True) (no pickle)."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, torch.tensor(mt, dtype=torch.int64), gauss],
            "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(rng):
    """The inverse of rng_state."""
    version, mt, gauss = rng["python"]
    random.setstate((version, tuple(mt.tolist()), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"])


def apply_lr(scheduler, lr):
    """--optim.lr changed on resume: the restored scheduler keeps the old base lr, so set the new one, and the lr of
    the next update to new lr x the schedule's factor at the restored position (LambdaLR's own formula). Also when
    the lr is the same: a changed --max-steps stretches a cosine schedule, and the restored lr is the old one's."""
    scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
    for group, f in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = lr, lr * f(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


# ---- The resolved config, recorded in trainer_state.json and compared on resume ----

def config_record(cfg, **derived):
    """The resolved config as {dotted field: JSON value} plus derived facts (train_rows), less FREE_ON_RESUME."""
    flat = {}

    def walk(prefix, obj):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(f"{prefix}{f.name}.", value)
            else:
                flat[prefix + f.name] = value
    walk("", cfg)
    flat.update(derived)
    return {k: v for k, v in json.loads(json.dumps(flat, default=str)).items() if not k.startswith(FREE_ON_RESUME)}


def check_config(path, record, allow=(), defaults=None):
    """--resume: refuse a checkpoint written with settings other than `record`, listing every difference and how
    to go on; a field of CHANGEABLE_ON_RESUME may differ when --checkpoint.allow-changes names it. A field the
    checkpoint predates (written by code without that flag) counts as its value in `defaults` (config_record of the
    default config), so a run resumes across an update that added a flag unless the flag is set."""
    allow = [a.lstrip("-").replace("-", "_") for a in allow]
    if unknown := [a for a in allow if a not in CHANGEABLE_ON_RESUME]:
        raise ValueError(f"--checkpoint.allow-changes {' '.join(unknown)}: only these may change on resume: "
                         f"{', '.join(CHANGEABLE_ON_RESUME)}.")
    with open(os.path.join(path, "trainer_state.json")) as f:
        saved = json.load(f).get("config", {})
    missing = "(not set)"
    saved = {**{k: v for k, v in (defaults or {}).items() if k in record}, **saved}
    diffs = [k for k in sorted(set(saved) | set(record))
             if saved.get(k, missing) != record.get(k, missing) and k not in allow]
    if not diffs:
        return
    lines = "\n".join(f"  {DERIVED.get(k, '--' + k.replace('_', '-'))}: {saved.get(k, missing)!r} in the checkpoint, "
                      f"{record.get(k, missing)!r} now" for k in diffs)
    may = [k for k in diffs if k in CHANGEABLE_ON_RESUME]
    raise ValueError(f"--resume {path}: the checkpoint was written with other settings:\n{lines}\nResume with the "
                     "checkpoint's values" + (f", or accept the change with --checkpoint.allow-changes {' '.join(may)}"
                                              if may else "") +
                     "; to change anything else, start a new run from its weights (--model PATH, or --lora.adapter "
                     "PATH) in a new --output-dir.")


# ---- One run per output directory ----

_held = []  # open lock files: an flock holds while its file stays open, i.e. until this process ends, however


def lock_message(output_dir):
    try:
        with open(os.path.join(output_dir, LOCK)) as f:
            holder = f.read().strip()
    except OSError:
        holder = ""
    return (f"--output-dir {output_dir!r} is in use by another run ({holder or 'holder unknown'}). Wait for it to "
            "end or stop it, or use another --output-dir.")


def take_lock(output_dir):
    """Give output_dir to this process (rank 0 of a run): an flock on output_dir/.lock, which the kernel releases
    when the process dies however it dies; the file names the holder (host, pid, start). A dead run's lock is free
    and taken over, with a note. -> None, or the message naming the live holder. (NFS needs working flock.)"""
    os.makedirs(output_dir, exist_ok=True)
    f = open(os.path.join(output_dir, LOCK), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return lock_message(output_dir)
    f.seek(0)
    if before := f.read().strip():  # a clean exit empties the file: this run died without releasing it
        print(f"{output_dir}: took over the lock of a run that is no longer running ({before})", flush=True)
    f.truncate(0)
    f.write(f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    _held.append(f)
    atexit.register(lambda: f.closed or (f.truncate(0), f.close()))  # a clean exit leaves an empty lock file
    return None


def lock_output_dir(output_dir, rank, device):
    """(collective) Rank 0 takes output_dir for this run; when a live run holds it, every rank raises the same message
    naming that run. Called before the run touches its checkpoints or metrics."""
    held = take_lock(output_dir) if rank == 0 else None
    if any_rank(held is not None, device):
        raise FileExistsError(held or lock_message(output_dir))  # the user's to fix (console.user_input)


# ---- Output directory rules (no collective: every rank reads the same directory and raises the same error) ----

def checkpoint_steps(output_dir, finished=True):
    """Steps of output_dir's checkpoint-<step> folders, ascending: those with a manifest (finished saves), or all."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    return sorted(int(d[11:]) for d in names if d.startswith("checkpoint-") and d[11:].isdigit() and (
        not finished or os.path.exists(os.path.join(output_dir, d, MANIFEST))))


def latest_checkpoint(output_dir):
    steps = checkpoint_steps(output_dir)
    return os.path.join(output_dir, f"checkpoint-{steps[-1]}") if steps else None


def go_on(output_dir):
    """After a fix: from the newest complete checkpoint when there is one, else from the start."""
    return "then --resume latest" if latest_checkpoint(output_dir) else "then run again (there is no checkpoint yet)"


def take_output_dir(output_dir, resume, overwrite, resume_path, rank, device):
    """(collective) Lock output_dir for this run, put back a checkpoint a crash left mid-replace, and decide the
    start again now that no other run can write here: if another run wrote a checkpoint after `resume_path` was
    chosen (before this one held the lock), every rank refuses rather than start over it. Then --overwrite clears."""
    lock_output_dir(output_dir, rank, device)
    if rank == 0:  # (take_lock made output_dir)
        restore_interrupted_replace(output_dir)
    dist.barrier()
    now = resolve_resume(output_dir, resume, overwrite, say=False)
    if now != resume_path:
        raise FileExistsError(f"--output-dir {output_dir!r} changed while this run was starting (another run wrote "
                              f"there before this one held it): it would now start from {now or 'scratch'}, not "
                              f"{resume_path or 'scratch'}. Start this run again.")
    if rank == 0 and overwrite and not resume_path:
        clear_output_dir(output_dir)
    dist.barrier()


def resolve_resume(output_dir, resume, overwrite, say=True):
    """The checkpoint to start from (or None). No --resume + a directory holding checkpoints -> error (--overwrite:
    fresh); --resume latest -> the newest checkpoint whose files match its manifest (rank 0 says which newer ones it
    skipped and why), an error if there is none; --resume auto -> the same, or fresh when there is no checkpoint at
    all (preemptible clusters relaunch the same command); --resume PATH -> that checkpoint, refused (naming the file)
    when it does not verify. Nothing in a checkpoint is read before its manifest checks out."""
    steps = checkpoint_steps(output_dir, finished=False)[::-1]
    if resume in (None, ""):
        if steps and not overwrite:
            raise FileExistsError(f"--output-dir {output_dir!r} already holds checkpoints (newest: checkpoint-"
                                  f"{steps[0]}). Pass --resume latest to continue that run, a new --output-dir, or "
                                  "--overwrite to delete them and start fresh.")
        return None
    if resume not in ("latest", "auto"):
        if not os.path.isdir(resume):
            raise FileNotFoundError(f"--resume {resume!r}: no such directory. Pass a checkpoint-<step> directory, "
                                    "'latest' or 'auto'.")
        if why := verify(resume):
            raise ValueError(f"--resume {resume!r}: damaged or unfinished checkpoint: {why}. Pass another "
                             "checkpoint-<step>, or --resume latest for the newest one that verifies.")
        return resume
    skipped = []
    for step in steps:
        path = os.path.join(output_dir, f"checkpoint-{step}")
        if (why := verify(path)) is None:
            if skipped and say and os.environ.get("RANK", "0") == "0":
                print(f"--resume {resume}: skipped " + "; ".join(skipped), flush=True)
            return path
        skipped.append(f"checkpoint-{step} ({why})")
    if skipped:
        raise ValueError(f"--resume {resume}: no checkpoint in {output_dir!r} verifies: {'; '.join(skipped)}. Resume "
                         "from a copy of a good one (--resume PATH), or start fresh with --overwrite (no --resume).")
    if resume == "latest":
        raise FileNotFoundError(f"--resume latest: no complete checkpoint in {output_dir!r}. Use --resume auto to start "
                                "fresh when there is none, or check --output-dir.")
    return None


def clear_output_dir(output_dir):
    """--overwrite on a fresh start: remove the old run's checkpoints and metrics (rank 0, before anything is written)."""
    for d in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        if d.startswith(("checkpoint-", ".tmp-checkpoint-", ".old-checkpoint-")):
            shutil.rmtree(os.path.join(output_dir, d), ignore_errors=True)
    for log in ("metrics.jsonl", "episodes.jsonl"):
        if os.path.exists(os.path.join(output_dir, log)):
            os.remove(os.path.join(output_dir, log))


def restore_interrupted_replace(output_dir):
    """(rank 0, holding the lock) A crash between the two renames of replace_dir leaves `.old-checkpoint-N` without
    `checkpoint-N`: put it back. A `.tmp-checkpoint-N` is a save that never finished: remove it."""
    for d in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        final = os.path.join(output_dir, d[len(".old-"):])
        if d.startswith(".old-checkpoint-") and not os.path.exists(final):
            os.replace(os.path.join(output_dir, d), final)
        if d.startswith(".tmp-checkpoint-"):
            shutil.rmtree(os.path.join(output_dir, d), ignore_errors=True)
            print(f"removed {d} in {output_dir}: a save that did not finish", flush=True)


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save every this many steps (0 = only at the end and on SIGTERM). Atomic: written to a temp dir, then renamed."""
    keep: int = 2
    """Keep only the newest N checkpoints up to the one just written (0 = keep all); newer ones are never touched."""
    save_merged: bool = False
    """LoRA: also save a merged full model under checkpoint-N/merged."""
    allow_changes: tuple[str, ...] = ()
    """--resume: settings that may differ from the checkpoint's (max_steps, optim.lr, optim.max_grad_norm,
    max_bad_steps, eval.every, eval.n_samples, micro_batch_size, micro_batch_tokens, policy.dtype, rollout.engine); any
    other difference is refused."""


def gather_on_rank0(named_tensors, rank):
    """(collective) {name: full CPU tensor} on rank 0, {} elsewhere, one tensor at a time: never a whole model per
    rank (a 7B fp32 policy on 8 ranks would otherwise take ~224 GB of host RAM)."""
    out = {}
    for name, t in named_tensors:
        full = full_tensor(t)
        if rank == 0:
            out[name] = full.detach().cpu()
        del full
    return out


def save_hf(policy, processor, path, rank, save_merged=False):
    """(collective) The policy in Hugging Face format (the adapter for LoRA, plus merged/ on request), written by rank 0.
    processor None: flow_grpo.py's diffusers transformer, the adapter (PeftModel.from_pretrained(pipe.transformer,
    path)) or the full model as its config + safetensors (from_pretrained)."""
    peft = models.is_peft(policy)
    keys = [(k, v) for k, v in policy.state_dict().items() if not peft or "lora_" in k]  # PEFT saves only adapters
    full = gather_on_rank0(keys, rank)
    if rank == 0 and (peft or processor is not None):
        policy.save_pretrained(path, state_dict=full)
    elif rank == 0:  # diffusers' save_pretrained takes no state_dict
        from safetensors.torch import save_file
        policy.save_config(path)
        save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(path, "diffusion_pytorch_model.safetensors"))
    if rank == 0 and processor is not None:
        processor.save_pretrained(path)
    del full
    if save_merged and peft:
        merged = gather_on_rank0(weight_sync.iter_engine_weights(policy, torch.float32), rank)
        if rank == 0:
            policy.get_base_model().save_pretrained(os.path.join(path, "merged"), state_dict=merged)
            processor.save_pretrained(os.path.join(path, "merged"))


def save_sharded(path, module, optimizer, extra=None):
    """(collective) Model + optimizer state (+ `extra` tensors such as the EMA), sharded: torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(module, optimizer)
    dcp.save({"model": msd, "optim": osd, **(extra or {})}, checkpoint_id=path)


def load_sharded(path, module, optimizer, extra=None):
    """(collective) The inverse of save_sharded: loads in place into module, optimizer and the `extra` tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(module, optimizer)
    state = {"model": msd, "optim": osd, **(extra or {})}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def save_resume_state(module, optimizer, path, rank, trainer_state, extra=None):
    """(collective) Sharded model + optimizer (+ extra), RNG per rank, trainer_state.json (save_checkpoint then writes
    the manifest, which marks the checkpoint complete)."""
    save_sharded(os.path.join(path, "dcp"), module, optimizer, extra)
    torch.save(rng_state(), os.path.join(path, f"rng-rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump(trainer_state, f)


def replace_dir(tmp, final):
    """Move tmp into final's place; the old final survives as .old-* until the new one is in (see restore_...)."""
    old = os.path.join(os.path.dirname(final), ".old-" + os.path.basename(final))
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(output_dir, keep, step, write_fns, trainer_state):
    """(collective) checkpoint-<step>, atomically: each write_fn(tmp_path) on every rank into a temp dir, the manifest,
    one rename. Then keep the newest `keep` up to this step; a newer one (another run's, ours before a resume) stays."""
    rank = dist.get_rank()
    final, tmp = os.path.join(output_dir, f"checkpoint-{step}"), os.path.join(output_dir, f".tmp-checkpoint-{step}")
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        for write in write_fns:
            write(tmp)
        dist.barrier()
        if rank == 0:
            write_manifest(tmp)  # last: what it lists is the complete checkpoint
            replace_dir(tmp, final)  # a crash before this leaves the previous checkpoint as the latest
    except BaseException as e:  # (DCP's CheckpointException is a BaseException)
        if rank == 0:  # (a rank that fails alone is ended by torchrun; the next run removes the temp dir)
            shutil.rmtree(tmp, ignore_errors=True)
        if os.strerror(errno.ENOSPC) not in "".join(traceback.format_exception(e)):  # DCP wraps each rank's error
            raise
        latest = latest_checkpoint(output_dir)
        raise OSError(errno.ENOSPC, f"saving checkpoint-{step} failed: no space left on device in {output_dir!r}. The "
                      "unfinished save was removed" + (f"; the newest complete checkpoint is {latest}" if latest else "")
                      + f". Free space (or lower --checkpoint.keep), {go_on(output_dir)}.") from e
    if rank == 0:
        older = [s for s in checkpoint_steps(output_dir) if s < step]
        for s in older[:max(0, len(older) - (keep - 1))] if keep else []:
            shutil.rmtree(os.path.join(output_dir, f"checkpoint-{s}"), ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path, module, optimizer, rank, extra=None):
    """Sharded model + optimizer (+ extra) + this rank's RNG states -> trainer_state dict. resolve_resume has checked
    the manifest first (DCP's own metadata file is a pickle: see the README on what a checkpoint is trusted for)."""
    load_sharded(os.path.join(path, "dcp"), module, optimizer, extra)
    set_rng_state(torch.load(os.path.join(path, f"rng-rank{rank}.pt"), weights_only=True))
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)


# ---- A run's checkpoints (grpo.py's and flow_grpo.py's Run): when to save, what is saved, resume ----

def maybe_save(run, steps_done, save, max_bad_steps=3, flag=None):
    """(collective) save(run, steps_done) every --checkpoint.every steps, at the last step, on SIGTERM and after
    max_bad_steps bad steps in a row (flow_grpo.py: 3; then raise, naming `flag`, their option) -> SIGTERM: stop now?"""
    every, stop = run.cfg.checkpoint.every, preempted(run)
    too_bad = run.bad_steps >= max_bad_steps  # the same on every rank: skips follow the global loss and norm
    if steps_done == run.cfg.max_steps or stop or too_bad or (every and steps_done % every == 0):
        save(run, steps_done)
    if too_bad:
        raise RuntimeError(f"{run.bad_steps} consecutive steps had a NaN/Inf loss or gradient norm"
                           + (f" ({flag} {max_bad_steps})" if flag else "") + f"; a checkpoint was written at step "
                           f"{steps_done}. Lower --optim.lr or check the rewards, then --resume latest.")
    return stop


def preempted(run):
    """(collective) Has any rank got SIGTERM? The vote reads the handler's flag and never writes it back: a signal
    that lands while the vote is in flight (its handler runs after this rank's vote was cast) counts at the next."""
    return any_rank(run.sigterm, run.device)


def save_run(run, steps_done, state, policy, processor, subdir=(), more_writes=(), save_merged=False):
    """(collective) checkpoint-<steps_done>: the policy in HF format (in `subdir`), `more_writes`, the EMA's weights
    in HF format (ema/<subdir>), then the sharded model + optimizer (+ EMA), RNG and trainer_state.json: the step, bad
    steps, lr schedule and recorded config (compared on resume), and the run's own `state`."""
    state = {"step": steps_done, "bad_steps": run.bad_steps, "scheduler": run.scheduler.state_dict(),
             "config": run.config_record, **state}
    ema = {"ema": run.ema} if run.ema else None

    def save_ema_hf(path):  # the EMA's weights in the policy's place (the adapter for LoRA), in its dtype
        with ema_weights(run.ema, trainable(run.module)):
            save_hf(policy, processor, os.path.join(path, "ema", *subdir), run.rank)
    writes = [lambda path: save_hf(policy, processor, os.path.join(path, *subdir), run.rank, save_merged),
              *more_writes, *([save_ema_hf] if run.ema else []),
              lambda path: save_resume_state(run.module, run.optimizer, path, run.rank, state, extra=ema)]
    return save_checkpoint(run.cfg.output_dir, run.cfg.checkpoint.keep, steps_done, writes, state)


def start_run(run, path, load_more=None):
    """(collective) Load checkpoint `path` into the run's module, optimizer (+ EMA) and lr schedule, with its start and
    bad steps, then load_more(its state) (the critic's) -> its trainer state ({} without `path`: a fresh start). A new
    --optim.lr (--checkpoint.allow-changes) applies. Only once all loaded, rank 0 cuts metrics.jsonl to the start
    step, and SIGTERM (preemption) asks for a save at the next safe point."""
    state = {}
    if path:
        state = load_checkpoint(path, run.module, run.optimizer, run.rank, extra={"ema": run.ema} if run.ema else None)
        run.scheduler.load_state_dict(state["scheduler"])
        apply_lr(run.scheduler, run.cfg.optim.lr)
        run.start_step, run.bad_steps = state["step"], state["bad_steps"]
        if load_more:
            load_more(state)
        if run.rank == 0:
            print(f"resumed from {path} at step {state['step']}", flush=True)
    if run.rank == 0:
        for log in (run.metrics_path, os.path.join(run.cfg.output_dir, "episodes.jsonl")):
            console.trim_metrics(log, run.start_step)
    signal.signal(signal.SIGTERM, lambda *_: setattr(run, "sigterm", True))
    return state
