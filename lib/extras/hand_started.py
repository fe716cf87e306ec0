"""Ranks started by hand, without torchrun: each process given RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT itself. lib/distributed.py's rendezvous_store imports this file only then; torchrun,
the usual launcher, has a rendezvous of its own."""

import datetime
import os

import torch.distributed as dist

from lib.exits import TrainingError

WAIT = datetime.timedelta(minutes=5)  # how long a rank waits for the others


def rendezvous() -> dist.Store:
    """The store where the ranks meet (env://), saying first what this rank waits for and for how
    long; TrainingError if the others never all come."""
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    ranks = os.environ.get("WORLD_SIZE")
    waiting = f"waiting up to {WAIT.seconds} s for the others at {where}"
    print(f"rank {os.environ['RANK']} of {ranks} (no torchrun): {waiting}", flush=True)
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=WAIT))
    except (dist.DistError, RuntimeError, ValueError) as e:  # the others never came
        reason = str(e).strip().splitlines()[0][:120]
        same = "MASTER_ADDR, MASTER_PORT and WORLD_SIZE"
        raise TrainingError(
            f"the {ranks} ranks never all met at {where} ({reason}): start every RANK from 0 "
            f"with the same {same}, or launch with torchrun"
        ) from e
    return store
