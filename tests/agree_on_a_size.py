"""Run under torchrun with 2 CPU ranks: --micro-batch-size auto's search when rank 1 alone cannot
reserve the memory of 4 sequences or more. Prints "rank R: best B, probed [...]" per rank.

    python -m torch.distributed.run --nproc_per_node=2 tests/agree_on_a_size.py

Each probe's peak is 10 + 10 n bytes on either rank, and the budget 1000: without the
reservation every rank would try 1, 2, 4, 8 and 16. Rank 1's allocation for 4 fails, so no rank
runs 4: both choose 2, having run 1 and 2 alone. A collective that one rank did not join times
out after 20 s (gloo), so a disagreement fails instead of hanging.
"""

import datetime

import torch
import torch.distributed as dist

from lib.exits import end_process
from lib.extras import auto_batch

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank, cpu = dist.get_rank(), torch.device("cpu")
probed = []


def peak_bytes(n: int) -> float:
    probed.append(n)
    return auto_batch.largest_of_every_rank(10 + 10 * n, cpu)


def reserve(n: int, predicted: float) -> bool:
    allocated = not (rank == 1 and n >= 4)  # rank 1's GPU holds less (another process, ...)
    return auto_batch.every_rank(allocated, cpu)


best, peaks = auto_batch.search_micro_batch_size(16, peak_bytes, 1000, reserve, baseline=10)
line = f"rank {rank}: best {best}, probed {probed}, peaks {peaks}"
print(line + "\n", end="", flush=True)  # one write (tests/scaler_agrees.py says why)
dist.destroy_process_group()
end_process(0)  # no interpreter teardown: it can abort after a group (lib/exits.py)
