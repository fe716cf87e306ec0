"""Joining the process group that torchrun set up, and the rules every rank keeps in it.

    rank, local_rank, world_size, device = setup_distributed(args.backend)

torchrun starts one copy of a script per GPU and tells each its RANK, LOCAL_RANK and
WORLD_SIZE; `setup_distributed` joins the group and picks the device of the local rank.
`from_rank0` runs what only rank 0 may do (write files) and shares its result or its error with
every rank; `main_process_first` lets one process per node fill a cache while the others wait.
"""

import contextlib
import os
import signal
from collections.abc import Iterator

import torch
import torch.distributed as dist

from stopping import TrainingError, end_with_os_exit, end_with_parent


def setup_distributed(backend: str | None) -> tuple[int, int, int, torch.device]:
    """Join the process group torchrun set up; returns (rank, local_rank, world_size, device).

    The device comes from the *local* rank (the process's index on its own machine), so the same
    code runs on one node or many. Run without torchrun, this is a group of one process.
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
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
                f"launch at most that many processes per node (--nproc_per_node)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # NCCL moves CUDA tensors between GPUs directly; gloo works on CPU tensors.
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("--backend nccl needs CUDA GPUs; use --backend gloo on CPU")
    if "RANK" in os.environ:
        # torchrun's env:// rendezvous: MASTER_ADDR/PORT are set by torchrun, never hard-coded.
        # After torchrun restarts the group (--max-restarts), that store can still hold the last
        # attempt's addresses, and a new worker may connect to its dead predecessor (seen with
        # torch 2.13 and gloo). A key prefix per attempt keeps the attempts apart.
        store, _, _ = next(dist.rendezvous("env://"))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend, store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank,
            world_size=world_size, device_id=device if device.type == "cuda" else None,
        )  # fmt: skip
    else:
        # Plain `python train_ddp.py`: a group of one, kept in memory, so the code below is the
        # same at every world size.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    end_with_os_exit()  # see stopping.end_process: no abort at exit after a finished run
    return rank, local_rank, world_size, device


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
