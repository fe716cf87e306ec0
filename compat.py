"""The torch APIs this suite uses that are newer than the oldest torch it supports (2.11).

Each is one feature check (never a version-string comparison): the new API where this torch has
it, the older equivalent where not, with the version that brought the new one. Everything else
in the suite is the same call on every supported torch (requirements.txt: 2.11 to 2.15).
"""

import inspect

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

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
