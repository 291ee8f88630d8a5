"""checkpoints.py: what makes a checkpoint safe to resume from. A manifest of its files (size and CRC-32 of each),
written last, defines a complete checkpoint and is checked before anything in it is read; the run's resolved config,
recorded in it, is compared with the resuming run's; and a lock gives an output directory to one run at a time.
plumbing.py writes and loads checkpoints with these; launch.py / flow_launch.py call the checks at start-up.

Plain functions without collectives (but lock_output_dir): every rank checks the same files, raises the same error.
"""
import atexit
import dataclasses
import fcntl
import json
import os
import random
import socket
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist

MANIFEST, LOCK = "manifest.json", ".lock"

# Fields that cannot change what a run computes (paths, logging, waits, memory knobs): never compared on resume
FREE_ON_RESUME = ("output_dir", "resume", "overwrite", "log.", "wandb.", "checkpoint.", "rollout.timeout_s",
                  "vllm.gpu_memory_utilization", "vllm.kv_cache_gb", "vllm.enable_sleep_mode", "vllm.sleep_level",
                  "vllm.sync_bucket_mb", "policy.gradient_checkpointing", "data.import_timeout_s")
# Fields that change the run but may change on resume when named in --checkpoint.allow-changes: what changes then
CHANGEABLE_ON_RESUME = {
    "max_steps": "the run ends at the new step (a cosine schedule is stretched to the new length)",
    "optim.lr": "the new peak lr applies from the first resumed update (the schedule's shape is kept)",
    "optim.max_grad_norm": "clipping uses the new norm",
    "max_bad_steps": "the stop after bad steps uses the new count",
    "eval.every": "evaluations follow the new cadence (0 <-> nonzero changes the training rows: refused by train_rows)",
    "eval.n_samples": "evaluations draw the new number of samples",
    "micro_batch_size": "the same gradient, summed in other groups (equal to rounding, not bit for bit)",
}
# Derived facts recorded next to the config, and the flags that decide them
DERIVED = {"train_rows": "training rows (--dataset, --data.size, --eval.every, --eval.num-prompts)",
           "world_size": "ranks (torchrun --nproc-per-node x nodes)"}


# ----------------------------------------------------------------------------------------------------------
# Manifest: the files of a complete checkpoint, their sizes and CRC-32s
# ----------------------------------------------------------------------------------------------------------

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
    files = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            files[os.path.relpath(full, path)] = [os.path.getsize(full), file_crc(full)]
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


# ----------------------------------------------------------------------------------------------------------
# Resume state as data (no pickle), and a new lr that really applies
# ----------------------------------------------------------------------------------------------------------

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
    the next update to new lr x the schedule's factor at the restored position (LambdaLR's own formula)."""
    if all(base == lr for base in scheduler.base_lrs):
        return
    scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
    for group, f in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = lr, lr * f(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


# ----------------------------------------------------------------------------------------------------------
# The resolved config, recorded in trainer_state.json and compared on resume
# ----------------------------------------------------------------------------------------------------------

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


def flag(name):
    return DERIVED.get(name, "--" + name.replace("_", "-"))


def check_config(path, record, allow=()):
    """--resume: refuse a checkpoint written with settings other than `record`, listing every difference and how
    to go on; a field of CHANGEABLE_ON_RESUME may differ when --checkpoint.allow-changes names it."""
    allow = [a.lstrip("-").replace("-", "_") for a in allow]
    if unknown := [a for a in allow if a not in CHANGEABLE_ON_RESUME]:
        raise ValueError(f"--checkpoint.allow-changes {' '.join(unknown)}: only these may change on resume: "
                         f"{', '.join(CHANGEABLE_ON_RESUME)}.")
    with open(os.path.join(path, "trainer_state.json")) as f:
        saved = json.load(f).get("config", {})
    missing = "(not set)"
    diffs = [k for k in sorted(set(saved) | set(record))
             if saved.get(k, missing) != record.get(k, missing) and k not in allow]
    if not diffs:
        return
    lines = "\n".join(f"  {flag(k)}: {saved.get(k, missing)!r} in the checkpoint, {record.get(k, missing)!r} now"
                      for k in diffs)
    may = [k for k in diffs if k in CHANGEABLE_ON_RESUME]
    raise ValueError(f"--resume {path}: the checkpoint was written with other settings:\n{lines}\nResume with the "
                     "checkpoint's values" + (f", or accept the change with --checkpoint.allow-changes {' '.join(may)}"
                                              if may else "") +
                     "; to change anything else, start a new run from its weights (--model PATH, or --lora.adapter "
                     "PATH) in a new --output-dir.")


# ----------------------------------------------------------------------------------------------------------
# One run per output directory
# ----------------------------------------------------------------------------------------------------------

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
    flag = torch.tensor([float(held is not None)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise FileExistsError(held or lock_message(output_dir))  # the user's to resolve: one message (plumbing.user_input)
