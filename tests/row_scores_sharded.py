"""Run under torchrun with 2 CPU ranks: are model.row_scores' figures on logits sharded over the
vocabulary (train_tp.py's lm_head under loss_parallel) those of the whole logits? Prints "rank R:
same" per rank, or what differs.

    python -m torch.distributed.run --nproc_per_node=2 tests/row_scores_sharded.py
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from lib.exits import end_process
from model import IGNORE_INDEX, row_scores

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)  # the same logits and targets on both ranks
logits = torch.randn(4, 6, 10)  # (B, T, vocab): each rank holds 5 of the 10 tokens' logits
targets = torch.randint(0, 10, (4, 6))
targets[0] = logits[0].argmax(-1)  # row 0: every target greedy, from either half
targets[1, 2:] = logits[1, 2:].argmax(-1)  # row 1: two misses at most
targets[2, :3] = IGNORE_INDEX  # row 2: half of it ignored
targets[3] = IGNORE_INDEX  # row 3: nothing to score
expected = row_scores(logits, targets)
assert expected[0, 1] == 0 and expected[:, 1].sum() > 0  # both kinds of target are here
mesh = init_device_mesh("cpu", (2,))
sharded = distribute_tensor(logits, mesh, [Shard(-1)])
with loss_parallel():
    actual = row_scores(sharded, targets)
same = torch.allclose(actual[:, 0], expected[:, 0], atol=1e-5)
same &= torch.equal(actual[:, 1], expected[:, 1])
print(
    f"rank {rank}: {'same' if same else f'differ: {actual.tolist()} != {expected.tolist()}'}\n",
    end="",
    flush=True,
)
dist.destroy_process_group()
end_process(0)  # no interpreter teardown: it can abort after a group (lib/exits.py)
