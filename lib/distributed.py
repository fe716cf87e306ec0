"""What the processes of a lesson share: their ranks (from torchrun), the store where they meet, the
rules every rank keeps; and at the end, the one place for the torch APIs newer than 2.11 in use.

    rank, local_rank, world_size, device = distributed.torchrun_rank()
    options = distributed.group_options(args, device)  # backend, store, device
    dist.init_process_group(rank=rank, world_size=world_size, **options)
"""

import contextlib
import datetime
import inspect
import os
import signal
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lib.exits import TrainingError, end_with_parent, failure_store


def torchrun_rank() -> tuple[int, int, int, torch.device]:
    """(rank, local_rank, world_size, device) from torchrun's environment (RANK, LOCAL_RANK: the
    index on its own machine, WORLD_SIZE); rank 0 of 1 without torchrun. The device follows the
    *local* rank, so one node or many run the same code: cuda:LOCAL_RANK (made current), or CPU."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun passes its SIGTERM on, but killed (SIGKILL, OOM) it cannot: the kernel then
        # sends this rank SIGTERM, and it stops (StopRequest) rather than train on as an orphan.
        end_with_parent(signal.SIGTERM)
    # Set without RANK by run_ddp.sh's --check: one process checks the flags for that many.
    world_size = world_size_from_env()
    rank, local_rank = (rank_from_env(name, world_size) for name in ("RANK", "LOCAL_RANK"))
    if not torch.cuda.is_available():
        return rank, local_rank, world_size, torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        has = f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}"
        raise ValueError(f"{has}; launch at most that many processes per node (--nproc_per_node)")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return rank, local_rank, world_size, device


def group_options(args, device: torch.device) -> dict:
    """The options of init_process_group other than rank and world size: the backend, the store
    where the ranks meet (rendezvous_store), how long a collective may wait for the other ranks
    (--dist-timeout) and, on a GPU, the device (NCCL then binds the group to it at once)."""
    offload = getattr(args, "cpu_offload", False)  # (train_fsdp.py and later)
    return {
        "backend": backend_for(args.backend, device, offload),
        "store": rendezvous_store(),
        "timeout": datetime.timedelta(minutes=args.dist_timeout),
        "device_id": device if device.type == "cuda" else None,
    }


def backend_for(flag: str | None, device: torch.device, cpu_offload: bool = False) -> str:
    """--backend, or the backend of the device: NCCL between GPUs, gloo for CPU tensors. With
    --cpu-offload on GPUs, a backend for each device ("cuda:nccl,cpu:gloo"): the gradients then
    live on the CPU, and clip_grad_norm_'s all-reduce of them needs a CPU backend (NCCL has
    none)."""
    backend = flag or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("--backend nccl needs CUDA GPUs; use --backend gloo on CPU")
    if backend == "nccl" and cpu_offload:
        return "cuda:nccl,cpu:gloo"
    return backend


def rendezvous_store() -> dist.Store:
    """Where the ranks meet. Under torchrun: its env:// rendezvous, with a key prefix for each
    restart attempt (--max-restarts), or else a new worker may find the address of the last
    attempt and connect to its dead predecessor (torch 2.13, gloo). Plain `python train_ddp.py`:
    a group of one, in memory. Ranks started by hand: lib/extras/hand_started.py."""
    if "RANK" not in os.environ:
        if world_size_from_env() > 1:  # (run_ddp.sh's --check stops before it joins a group)
            size = f"WORLD_SIZE={os.environ['WORLD_SIZE']}"
            raise ValueError(
                f"{size} without torchrun: launch the processes with torchrun (or run_ddp.sh), "
                "or leave WORLD_SIZE unset for one process"
            )
        return dist.HashStore()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        store, _, _ = next(dist.rendezvous("env://"))
    else:
        from lib.extras import hand_started

        store = hand_started.rendezvous()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    failure_store.append(dist.PrefixStore(f"attempt_{attempt}", store))  # (exits.say_once)
    return failure_store[-1]


def world_size_from_env() -> int:
    """The number of processes of the run: WORLD_SIZE (set by torchrun, or by run_ddp.sh for
    --check), else 1. ValueError unless a positive integer (0 would divide the batch by zero)."""
    value = os.environ.get("WORLD_SIZE", "1")
    size = int(value) if value.strip().isdecimal() else 0
    if size < 1:
        raise ValueError(
            f"WORLD_SIZE={value!r} in the environment is not a positive integer: it is the "
            "number of processes of the run (torchrun sets it; for --check, set it to the number "
            "the run will have, or leave it unset for one)"
        )
    return size


def rank_from_env(name: str, world_size: int) -> int:
    """RANK or LOCAL_RANK (set by torchrun), 0 where unset; ValueError unless 0 to world_size-1."""
    value = os.environ.get(name, "0")
    if value.strip().isdecimal() and int(value) < world_size:
        return int(value)
    bound = f"from 0 to WORLD_SIZE - 1 = {world_size - 1}"
    unset = "torchrun sets it; leave it unset for one process"
    raise ValueError(f"{name}={value!r} in the environment is not an integer {bound} ({unset})")


def divide_ranks(world_size: int, flag: str, size: int, grid: str) -> int:
    """world_size / size: the other side of a grid of ranks, one of whose sides is the value of
    `flag` (e.g. "--tp", 2, "dp x tp"); ValueError unless size is at least 1 and divides
    world_size."""
    if size < 1:
        raise ValueError(f"{flag} {size} must be at least 1")
    if world_size % size:
        raise ValueError(
            f"{flag} {size} must divide the number of ranks ({world_size}): the ranks form a grid "
            f"of {grid}; launch a multiple of {size} processes (torchrun --nproc_per_node) or "
            f"choose a {flag} that divides {world_size}"
        )
    return world_size // size


# -------------------------------------------------------------------------------------------------
# Waiting while one rank works alone. A collective of the run's group gives up after --dist-timeout
# (NCCL's watchdog then aborts the whole job): long enough for a step, far too short for what one
# rank may do alone while the others wait: tokenize a corpus of 100 GB, write model.pt at 70b. So
# the others wait on a gloo group of its own, whose timeout is LONG_WAIT: a wait, not a collective
# of the step. (A rank that dies meanwhile closes its connections: the others learn of it at once.)

LONG_WAIT = datetime.timedelta(hours=24)
_waiting_group: list = []  # (the run's group, its waiting group), made by waiting_group()


def waiting_group() -> dist.ProcessGroup | None:
    """The gloo group, with the timeout LONG_WAIT, on which ranks wait for one rank's long work;
    made the first time it is needed, by every rank at the same point (new_group is a collective:
    every caller of this calls it on every rank). None in a process of its own."""
    if dist.get_world_size() == 1:
        return None
    if not _waiting_group or _waiting_group[0] is not dist.group.WORLD:  # (a group made anew)
        _waiting_group[:] = [dist.group.WORLD, dist.new_group(backend="gloo", timeout=LONG_WAIT)]
    return _waiting_group[1]


def from_rank0(fn, is_main: bool, *args):
    """Run fn(*args) on global rank 0 alone; every rank gets its result or raises its error (a
    ValueError or TrainingError). For what only the writing rank may do (create --out-dir, choose
    or save a checkpoint): else the others would learn of its failure by waiting forever. The
    others wait on waiting_group(), however long fn takes (model.pt at the end of a run)."""
    box = [None, None]  # [result, error]
    group = waiting_group()  # (before fn: every rank makes it at the same point)
    if is_main:
        try:
            box[0] = fn(*args)
        except (ValueError, TrainingError) as e:
            box[1] = e
        except BaseException as e:  # anything else (a bug, Ctrl-C): rank 0 raises it itself,
            # and the others stop with its first line rather than wait for it forever.
            reason = (str(e).strip() or type(e).__name__).splitlines()[0]
            failed = [None, TrainingError(f"rank 0 failed: {reason}")]
            dist.broadcast_object_list(failed, src=0, group=group)
            raise
    dist.broadcast_object_list(box, src=0, group=group)
    if box[1] is not None:
        raise box[1]
    return box[0]


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Run the body on each node's LOCAL_RANK 0 first (it fills the caches), then on the other
    ranks (they find them filled). A collective: every rank enters it. The others wait on
    waiting_group(), however long the first take (tokenizing a big corpus)."""
    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    # LOCAL_RANK, not the global rank: the cache on the local disk of each node needs a first.
    is_first = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    group = waiting_group()
    if not is_first:
        dist.barrier(group=group)  # wait until the first processes are done
    try:
        yield
    finally:
        # Even if the body raised: the others then meet the same error, not a barrier forever.
        if is_first:
            dist.barrier(group=group)


# -------------------------------------------------------------------------------------------------
# The torch APIs newer than the oldest supported (2.11): each a feature check (no version compared),
# the new API where present, else the older one. All else is the same call on torch 2.11 to 2.15.

# DDP(forward_sync_buffers=False), torch 2.13: no buffer broadcast before every forward. Before,
# broadcast_buffers=False, also skipping the first sync: the same here (buffers: RoPE tables only).
NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)

# torch 2.13's names; before, all_gather_into_tensor and reduce_scatter_tensor (deprecated since).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
