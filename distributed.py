"""What the lessons' processes share: torchrun's ranks, the process group's store, and the rules
every rank keeps in it.

    rank, local_rank, world_size, device = distributed.torchrun_rank()
    dist.init_process_group(distributed.backend_for(args.backend, device),
                            store=distributed.rendezvous_store(), rank=rank, world_size=world_size)

torchrun starts one copy of a script per GPU and tells each its RANK, LOCAL_RANK and
WORLD_SIZE; `torchrun_rank` reads them and picks the device of the local rank, and each lesson
joins the group itself.
`from_rank0` runs what only rank 0 may do (write files) and shares its result or its error with
every rank; `main_process_first` lets one process per node fill a cache while the others wait.
"""

import contextlib
import inspect
import os
import signal
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from stopping import TrainingError, end_with_parent


def torchrun_rank() -> tuple[int, int, int, torch.device]:
    """(rank, local_rank, world_size, device) of this process, from torchrun's environment.

    torchrun starts one copy of a script per GPU and tells each its RANK, LOCAL_RANK (its index
    on its own machine) and WORLD_SIZE. The device comes from the *local* rank, so the same code
    runs on one node or many: cuda:LOCAL_RANK (made the current GPU), or the CPU without CUDA.
    Run without torchrun, this is rank 0 of 1.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Started by torchrun, which stops its workers when it is stopped (SIGTERM, passed on)
        # but cannot when it is killed (SIGKILL, an OOM killer): the kernel then sends this rank
        # the SIGTERM instead, and it stops as it would on torchrun's (stopping.StopRequest),
        # rather than train on, an orphan, with no one to watch it or restart it.
        end_with_parent(signal.SIGTERM)
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # Set without RANK by run_ddp.sh's --check: one process checks the flags for that many.
    world_size = world_size_from_env()
    if not torch.cuda.is_available():
        return rank, local_rank, world_size, torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
            f"launch at most that many processes per node (--nproc_per_node)"
        )
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return rank, local_rank, world_size, device


def backend_for(flag: str | None, device: torch.device) -> str:
    """--backend, or the one for the device: NCCL moves CUDA tensors between GPUs directly,
    gloo works on CPU tensors. ValueError for nccl without a GPU (cli.run_settings asks too, for
    --check, which joins no group)."""
    backend = flag or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("--backend nccl needs CUDA GPUs; use --backend gloo on CPU")
    return backend


def rendezvous_store() -> dist.Store:
    """Where the ranks meet to form the process group (init_process_group's store).

    Under torchrun: its env:// rendezvous, at the MASTER_ADDR and MASTER_PORT torchrun sets
    (never hard-coded). After torchrun restarts the group (--max-restarts), that store can still
    hold the last attempt's addresses, and a new worker may connect to its dead predecessor
    (seen with torch 2.13 and gloo): a key prefix per attempt keeps the attempts apart. Plain
    `python train_ddp.py`: a group of one, in memory, so the code is the same at every size.
    """
    if "RANK" not in os.environ:
        if world_size_from_env() > 1:  # (run_ddp.sh's --check stops before it joins a group)
            raise ValueError(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} without torchrun: launch the processes "
                f"with torchrun (or run_ddp.sh), or leave WORLD_SIZE unset for one process"
            )
        return dist.HashStore()
    store, _, _ = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"attempt_{attempt}", store)


def world_size_from_env() -> int:
    """The number of processes of the run: WORLD_SIZE, which torchrun sets (and run_ddp.sh, for
    --check without torchrun), else 1. ValueError in one line unless it is a positive integer:
    one of 0 would divide the batch by zero, a negative one pass every check."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(
            f"WORLD_SIZE={value!r} in the environment is not a positive integer: it is the "
            f"number of processes of the run (torchrun sets it; for --check, set it to the "
            f"number the run will have, or leave it unset for one)"
        )
    return size


def divide_ranks(world_size: int, flag: str, size: int, grid: str) -> int:
    """world_size / size: the other side of a grid of ranks one of whose sides is `flag`'s value
    (e.g. "--tp", 2, "dp x tp"). ValueError in one line unless size is at least 1 and divides
    the number of ranks."""
    if size < 1:
        raise ValueError(f"{flag} {size} must be at least 1")
    if world_size % size:
        raise ValueError(
            f"{flag} {size} must divide the number of ranks ({world_size}): the ranks form a grid "
            f"of {grid}; launch a multiple of {size} processes (torchrun --nproc_per_node) or "
            f"choose a {flag} that divides {world_size}"
        )
    return world_size // size


def from_rank0(fn, is_main: bool, *args):
    """Run fn(*args) on global rank 0 alone; every rank gets its result, or raises its error
    (a ValueError or TrainingError).

    For the work only the writing rank may do (creating --out-dir, choosing the checkpoint to
    resume from, saving one): without this broadcast, the other ranks would learn of a failure
    on rank 0 only by waiting forever in the next collective (or failing in it), and each might
    choose a different checkpoint.
    """
    box = [None, None]  # [result, error]
    if is_main:
        try:
            box[0] = fn(*args)
        except (ValueError, TrainingError) as e:
            box[1] = e
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise box[1]
    return box[0]


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Run the body on each node's LOCAL_RANK 0 first, then on the other ranks.

    The first process fills the caches (tokenizer, tokenized dataset); the others wait at a
    barrier and then find everything cached instead of all computing it at once. The barrier
    is collective: every rank must enter this block. Without torch.distributed it just runs.
    """
    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    # LOCAL_RANK (set by torchrun) rather than the global rank: with a cache on each node's
    # local disk, every node needs its own first process.
    is_first = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    if not is_first:
        dist.barrier()  # wait until the first processes are done
    try:
        yield
    finally:
        # Release the others even if the body raised: they then hit the same error and exit
        # cleanly, instead of waiting at the barrier forever.
        if is_first:
            dist.barrier()


# -------------------------------------------------------------------------------------------------
# The torch APIs this suite uses that are newer than the oldest torch it supports (2.11): each is
# one feature check (never a version-string comparison), the new API where this torch has it, the
# older equivalent where not, with the version that brought the new one. This is the one place:
# everything else in the suite is the same call on every supported torch (2.11 to 2.15).

# DDP(forward_sync_buffers=False), torch 2.13: no re-broadcast of the buffers before every
# forward (the initial sync stays). Before 2.13 that was broadcast_buffers=False, since
# deprecated, which also skips the initial sync: the same for buffers that every rank computes
# identically (this model's only buffers are its RoPE tables).
NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)

# dist.all_gather_single and dist.reduce_scatter_single, torch 2.13; the same calls were named
# all_gather_into_tensor and reduce_scatter_tensor before (deprecated since 2.13).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)
