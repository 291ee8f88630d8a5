"""distributed.py: the process and its peers: the process group (torchrun or one process; nccl or gloo), the
collectives the stages reduce with (sums and extremes by name, gathers, any-rank flags), and the process's memory
(peak, and freed CPU heap handed back to the OS).

Collectives are marked "(collective)": every rank must call them in the same order.
"""
import functools
import os
import resource
import signal

import torch
import torch.distributed as dist


def full_tensor(t):
    """(collective for a DTensor) The whole tensor on every rank; a plain tensor as is."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


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
    """Under torchrun (Linux): SIGTERM when torchrun dies (prctl PR_SET_PDEATHSIG), so a killed launcher leaves no
    orphaned workers; once the scripts' handler is set, that SIGTERM saves a checkpoint."""
    if "TORCHELASTIC_RUN_ID" in os.environ and _glibc() is not None:
        _glibc().prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the launcher was already gone
            os.kill(os.getpid(), signal.SIGTERM)


CONTROL_GROUP = None  # generators: a gloo group for their own reductions (inference_ranks.connect), never beside the
# staging thread's NCCL weight receives on another communicator
DATA_GROUP = None  # --policy.context-parallel: one rank of each context-parallel group (they hold the same rows)


def data_rank():
    """This rank's place among the ranks the reductions run over (its data-parallel rank under context parallelism)."""
    return dist.get_rank(DATA_GROUP)


def global_sums(named, device, op=dist.ReduceOp.SUM):
    """(collective) {name: number} summed (or MIN / MAX) over ranks -> {name: float}. Every rank passes the same names
    in the same order. NaN on any rank stays NaN."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(device) for v in named.values()]) if named else \
        torch.zeros(0, dtype=torch.float64, device=device)  # values may be device tensors: one host sync, here
    return dict(zip(named, all_reduce(t, device, op).tolist()))


def all_reduce(t, device, op=dist.ReduceOp.SUM):
    """(collective) A tensor reduced over ranks (the generators: over CONTROL_GROUP, on the CPU) -> on the CPU."""
    t = t.to("cpu" if CONTROL_GROUP is not None else device)
    dist.all_reduce(t, op=op, group=CONTROL_GROUP if CONTROL_GROUP is not None else DATA_GROUP)
    return t.cpu()


def all_gather_cat(x):
    """(collective) Concatenate equal-shaped tensors from every rank (of DATA_GROUP) along dim 0, in rank order."""
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(DATA_GROUP))]
    dist.all_gather(out, x.contiguous(), group=DATA_GROUP)
    return torch.cat(out)


def any_rank(flag, device):
    """(collective) True on every rank when `flag` is true on any rank: of all of them, not DATA_GROUP (a SIGTERM or a
    held lock is one rank's own, also within a context-parallel group)."""
    t = torch.tensor([float(flag)], device="cpu" if CONTROL_GROUP is not None else device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=CONTROL_GROUP)
    return t.item() > 0


def release_memory():
    """Give freed CPU heap pages back to the OS (glibc malloc_trim; else a no-op): CPU tensors of varying sizes leave
    holes that glibc keeps mapped, so RSS grows step after step; trimming after the step's big frees keeps it flat."""
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
