"""Run under torchrun with 2 CPU ranks: does torch's grad scaler make every rank skip a step whose
inf is in one rank's shard of a gradient alone? Prints "rank R: skipped S" per rank.

    python -m torch.distributed.run --nproc_per_node=2 tests/scaler_agrees.py fsdp|tp|pp|pp-alone

fsdp: a gradient sharded over both ranks, as train_fsdp.py shards it; tp: split by columns, then
rows, over a tp mesh of 2, under FSDP over a mesh of one (train_tp.py's 2-D DTensors on 2 ranks);
pp: each rank its own parameters (a pipeline stage, under FSDP over a dp mesh of one), unscaled
by pipeline.unscale_ as train_pp.py does; pp-alone: the same with scaler.unscale_ alone, which
leaves the stage without the inf to step. Each line also gives the rank's scale after update().
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lib.exits import end_process
from lib.parallel import pipeline

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
if sys.argv[1] == "tp":
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
elif sys.argv[1] in ("pp", "pp-alone"):
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    model = torch.nn.Linear(8, 8)  # this rank's stage: parameters no other rank holds
    fully_shard(model, mesh=mesh["dp"])
else:
    fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
before = [p.full_tensor().clone() for p in model.parameters()]
out = model(torch.randn(4, 8))
loss = (out.full_tensor() if hasattr(out, "full_tensor") else out).float().sum()
scaler.scale(loss).backward()
if rank == 1:  # an inf in this rank's piece of one gradient, and nowhere else
    next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("inf")
if sys.argv[1] == "pp":
    pipeline.unscale_(scaler, optimizer, mesh["pp"].get_group())
else:
    scaler.unscale_(optimizer)
scaler.step(optimizer)
scaler.update()
unchanged = all(
    torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters(), strict=True)
)
# One write, line and newline: unbuffered (PYTHONUNBUFFERED), print writes them apart, and the
# other rank's line could come between them.
print(f"rank {rank}: skipped {unchanged}, scale {scaler.get_scale()}\n", end="", flush=True)
dist.destroy_process_group()
end_process(0)  # no interpreter teardown: it can abort after a group (lib/exits.py)
