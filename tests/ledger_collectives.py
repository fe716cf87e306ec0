"""A few known collectives on a 2-rank gloo group, under the communication ledger alone
(tests/test_comm_ledger.py runs it with torchrun): prints rank 0's rows as JSON."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lib.exits import end_process  # noqa: E402
from lib.extras.comm_ledger import CommLedger  # noqa: E402


def main():
    dist.init_process_group("gloo")
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    x = torch.ones(10)  # 40 bytes
    with CommLedger() as ledger:
        dist.all_reduce(x)
        dist.all_reduce(torch.ones(3, dtype=torch.float64))  # 24 bytes
        dist.broadcast(x, src=0)
        dist.all_gather_into_tensor(torch.empty(20), x)  # its output: 80 bytes
        dist.reduce_scatter_tensor(torch.empty(5), x)  # its input: 40 bytes
        dist.all_to_all_single(torch.empty(10), x)
        funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD).wait()  # functional: 16 bytes
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, torch.empty(10), peer)]
        for work in dist.batch_isend_irecv(ops if rank == 0 else ops[::-1]):
            work.wait()
    if rank == 0:
        print(json.dumps(ledger.rows()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process(0)  # no interpreter teardown: it can abort after a group (lib/exits.py)
