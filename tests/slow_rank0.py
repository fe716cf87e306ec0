"""Run a train script with rank 0's lone work made slow: the tests of --dist-timeout.

    python -m torch.distributed.run --nproc_per_node=2 tests/slow_rank0.py 8 train_fsdp.py \\
        --dist-timeout 0.1 [flags]     # every rank-0 part takes 8 s more: longer than 6 s
    ... tests/slow_rank0.py step=8 train_fsdp.py ...   # rank 0's first step instead

While one rank works alone (each node's local rank 0 tokenizing, in main_process_first; global
rank 0 choosing, completing or finishing a checkpoint, in from_rank0), the others wait. They must
wait on something made for it, not in a collective of the run's group, which gives up after
--dist-timeout: so the tests make that work take longer than --dist-timeout, and the run must
still end well. Patched before the script imports lib.distributed's names.
"""

import os
import runpy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def slow_down(seconds: float) -> None:
    """Make data.tokenize on each node's local rank 0, and every from_rank0 part, take
    `seconds` more."""
    import data
    from lib import distributed

    tokenize, from_rank0 = data.tokenize, distributed.from_rank0

    def slow_tokenize(*args, **kwargs):
        if os.environ.get("LOCAL_RANK", "0") == "0":
            time.sleep(seconds)
        return tokenize(*args, **kwargs)

    def slow_from_rank0(fn, is_main, *args):
        def slow(*args):
            time.sleep(seconds)
            return fn(*args)

        return from_rank0(slow, is_main, *args)

    data.tokenize, distributed.from_rank0 = slow_tokenize, slow_from_rank0


def slow_step(seconds: float) -> None:
    """Make rank 0's first step take `seconds` more (its first optimizer.zero_grad(), which
    every loop calls once after its step): the others then wait in the next step's collectives,
    which time out if that is longer than --dist-timeout."""
    import torch

    zero_grad, slept = torch.optim.Optimizer.zero_grad, []

    def slow_zero_grad(self, *args, **kwargs):
        if os.environ.get("RANK", "0") == "0" and not slept:
            slept.append(time.sleep(seconds))
        return zero_grad(self, *args, **kwargs)

    torch.optim.Optimizer.zero_grad = slow_zero_grad


if __name__ == "__main__":
    seconds, script, *argv = sys.argv[1:]
    sys.path.insert(0, str(REPO))
    if seconds.startswith("step="):
        slow_step(float(seconds.removeprefix("step=")))
    else:
        slow_down(float(seconds))
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")
