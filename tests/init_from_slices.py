"""Run under torchrun with 4 CPU ranks: --init-from in train_tp.py's 2-D layout (TP over 2 ranks,
FSDP over the 2 groups, so FSDP shards TP's shards again). Prints per rank "rank R: moved M,
holds H, whole W, same S": the bytes of model.pt it moved to its device, those its shards hold,
those of the whole model, and whether the weights gathered back are model.pt's.

    python -m torch.distributed.run --nproc_per_node=4 tests/init_from_slices.py DIR
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from lib import training
from lib.checkpoints import finished_run
from lib.exits import end_process
from lib.parallel import tensor_parallel
from model import LlamaConfig, LlamaForPretraining

dist.init_process_group("gloo")
rank = dist.get_rank()
config = LlamaConfig(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
)  # fmt: skip
path = Path(sys.argv[1]) / "model.pt"
if rank == 0:
    torch.save(LlamaForPretraining(config, seed=1).state_dict(), path)
dist.barrier()
source = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # as open_weights
finished_run.open_weights = lambda out_dir: (source, config, None)  # (no run's folder needed)

mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
with torch.device("meta"):
    model = LlamaForPretraining(config)
for layer in model.layers:
    parallelize_module(layer, mesh["tp"], tensor_parallel.layer_plan(False))
tensor_parallel.apply_tensor_parallel(model, mesh["tp"], False)
for layer in model.layers:
    fully_shard(layer, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
model.to_empty(device="cpu")

# Tensor.to, counting the bytes of each tensor of model.pt (or a view of one) that it moves.
mapped = {t.untyped_storage().data_ptr() for t in source.values()}
moved, to = [], torch.Tensor.to


def counting_to(self, *args, **kwargs):
    if self.untyped_storage().data_ptr() in mapped:
        moved.append(self.numel() * self.element_size())
    return to(self, *args, **kwargs)


torch.Tensor.to = counting_to
training.init_weights(model, config, SimpleNamespace(init_from="run", seed=0), torch.device("cpu"))
torch.Tensor.to = to
holds = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
whole = sum(t.numel() * t.element_size() for t in source.values())
same = all(torch.equal(p.full_tensor(), source[name]) for name, p in model.named_parameters())
line = f"rank {rank}: moved {sum(moved)}, holds {holds}, whole {whole}, same {same}"
print(line + "\n", end="", flush=True)  # one write (tests/scaler_agrees.py says why)
dist.destroy_process_group()
end_process(0)  # no interpreter teardown: it can abort after a group (lib/exits.py)
