"""Expert parallelism (EP) of train_ep.py: each mixture-of-experts layer's experts split over the
ep ranks of a group, and every token sent to the rank that holds its experts, and back.

    dp = data_parallel_size(world_size, ep, num_experts)   # ValueError unless ep divides both
    shard_experts(model, mesh["ep"])   # w1, w2, w3: DTensors, Shard(0); the layers dispatch
    grad_norm = clip_grad_norm_(model.parameters(), max_norm)   # over every mesh the grads are on

Each rank holds E / ep experts of every MoE layer (rank j of the group experts j*E/ep to
(j+1)*E/ep - 1) and all the rest of the model (attention, the router, norms, embeddings, as
data parallelism). It runs its own tokens through everything, and the MoE layer as one process
does (moe.MoEFeedForward.forward: route, sort the (token, slot) pairs by expert, weight the
outputs), except the experts themselves: `dispatch` runs them on their ranks. With ep = 2, E = 4:

    rank 0: its pairs sorted by expert  | e0 e0 e1 | e2 e3 e3 e3 |   -> rank 0 | -> rank 1
    rank 1: its pairs sorted by expert  | e1 | e2 e2 e3 |             -> rank 0 | -> rank 1
      1. counts all-to-all: rank 0 learns it gets 2+1 pairs from itself, 0+1 from rank 1, ...
      2. tokens all-to-all: rank 0 now holds | e0 e0 e1 | e1 | (from rank 0, then rank 1)
      3. regrouped by expert | e0 e0 | e1 e1 |, run_experts with its 2 experts, regrouped back
      4. outputs all-to-all, the reverse of 2: each rank gets its pairs' outputs, in its order

The second all-to-all has uneven splits (how many pairs go to each rank), known only from the
first, so the first one's result is read on the host (a sync) before the second is sent.
Dropless: every pair reaches its expert however many pairs chose the same one, so the outputs
are the one process's; the price is an unbounded message when the router is unbalanced, which
the load-balancing loss keeps in check. Backward runs each all-to-all in reverse (_AllToAll):
the gradients of the outputs go to the experts' ranks, those of the tokens come back.
"""

import functools
import logging
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lib import model_config
from lib.distributed import divide_ranks
from lib.extras.moe import MoEFeedForward
from lib.flags import number_arg
from lib.parallel import fsdp
from lib.parallel.layout import Layout

EXPERT_WEIGHTS = ("w1", "w2", "w3")  # stacked (E, ...): expert first, the dim EP shards

# -------------------------------------------------------------------------------------------------
# The grid of ranks


def add_flags(parser) -> None:
    """train_ep.py's flags: FSDP's (it shards the dense part over all ranks), and --ep."""
    fsdp.add_flags(parser)
    parser.add_argument(
        "--ep",
        type=number_arg(int, 1),
        default=1,
        help="expert-parallel ranks per group: each holds 1/ep of every layer's experts. It must "
        "divide the number of ranks and --num-experts",
    )


def setup(parser, args, world_size: int, device) -> Layout:
    """train_ep.py's grid, (world_size / ep) x ep ranks, checked before any work (ValueError
    through parser.error): --ep divides the ranks and the experts. Every rank reads its own share
    of the batch (dp = world_size). Meshes built unless --check: mesh["ep"] shares out the
    experts, mesh["dp"] (the ranks that hold the same ones) shards them with FSDP."""
    experts = model_config.model_shape(args).num_local_experts
    try:
        groups = data_parallel_size(world_size, args.ep, experts)
    except ValueError as e:
        parser.error(str(e))
    fsdp.check_replicate(parser, args, world_size)
    sizes = dict(ep=args.ep, experts=experts, **fsdp.options(args))
    if args.check:
        return Layout(world_size, world_size, **sizes)
    mesh = init_device_mesh(device.type, (groups, args.ep), mesh_dim_names=("dp", "ep"))
    fsdp_mesh = fsdp.hsdp_mesh(args, world_size, device)
    rank = dist.get_rank()
    return Layout(world_size, world_size, **sizes, mesh=mesh, fsdp_mesh=fsdp_mesh, dp_rank=rank)


def describe(layout: Layout) -> str:
    """train_ep.py's grid, and FSDP's over it: the start-up summary's line."""
    ep, groups, num_experts = layout.ep, layout.world_size // layout.ep, layout.experts
    text = f"experts: {num_experts} per layer over the {ep} ranks of each EP group "
    text += f"({num_experts // ep} each), {groups} group{'s' * (groups > 1)}; the experts' FSDP "
    text += f"over {groups} rank{'s' * (groups > 1)}; "
    return text + fsdp.describe(layout)


def data_parallel_size(world_size: int, ep: int, num_experts: int) -> int:
    """dp = world_size / ep; ValueError in one line unless --ep divides the number of ranks and
    the number of experts (each rank of a group holds as many experts), or if there are none."""
    dp = divide_ranks(world_size, "--ep", ep, "dp x ep")
    if not num_experts:
        raise ValueError(
            "expert parallelism shards a mixture of experts, and this model is dense: give one "
            "with experts (--num-experts, a multiple of --ep, or --init-from a run that has "
            "them), or train a dense model with train_fsdp.py"
        )
    if num_experts % ep:
        raise ValueError(
            f"--ep {ep} must divide --num-experts {num_experts}: each of the {ep} ranks of a "
            f"group holds the same number of every layer's experts"
        )
    return dp


# -------------------------------------------------------------------------------------------------
# The all-to-all, with autograd


class _AllToAll(torch.autograd.Function):
    """dist.all_to_all_single with uneven splits, differentiable: backward sends the gradients
    back the way the tensor came (the same all-to-all, splits swapped)."""

    @staticmethod
    def forward(ctx, x, output_splits: list[int], input_splits: list[int], group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        output_splits, input_splits = ctx.splits
        grad_x = grad_out.new_empty((sum(input_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(
            grad_x, grad_out.contiguous(), input_splits, output_splits, group=ctx.group
        )
        return grad_x, None, None, None


def all_to_all(x, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Send input_splits[r] rows of x (in order) to rank r of `group`; returns the rows received,
    output_splits[r] from rank r, in rank order."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


# -------------------------------------------------------------------------------------------------
# The dispatch


def dispatch(moe: MoEFeedForward, x: torch.Tensor, counts: list[int], group) -> torch.Tensor:
    """moe.run_experts over the ep ranks of `group`: x (M, d) this rank's (token, slot) pairs
    sorted by expert, counts[e] of them for expert e of all E; returns their outputs (M, d),
    in the same order, each computed on the rank that holds its expert."""
    ep = dist.get_world_size(group)
    local = len(counts) // ep  # experts per rank
    # 1. Counts: received[r][e] = how many pairs rank r sends to this rank's expert e. One row
    # (E / ep counts) to each rank, so the split is even and needs no sizes.
    sent = torch.tensor(counts, device=x.device).view(ep, local)  # (ep, local)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    received = received.tolist()  # a sync: the next message's sizes
    input_splits = [sum(counts[r * local : (r + 1) * local]) for r in range(ep)]  # to rank r
    output_splits = [sum(row) for row in received]  # from rank r
    # 2. The pairs to the ranks of their experts: rank-major, then by expert within each rank.
    x = all_to_all(x, output_splits, input_splits, group)  # (R, d), R pairs received
    # 3. Regrouped expert-major for run_experts (each expert's pairs one block), run on this
    # rank's experts (the local shard of the DTensors: E / ep of them), regrouped back.
    blocks = x.split([n for row in received for n in row])  # block r*local+e: rank r, expert e
    by_expert = [blocks[r * local + e] for e in range(local) for r in range(ep)]
    local_counts = [sum(row[e] for row in received) for e in range(local)]
    weights = tuple(getattr(moe, name).to_local() for name in EXPERT_WEIGHTS)  # (local, ...)
    y = moe.run_experts(torch.cat(by_expert), local_counts, weights)  # (R, d)
    blocks = y.split([row[e] for e in range(local) for row in received])  # block e*ep+r
    by_rank = [blocks[e * ep + r] for r in range(ep) for e in range(local)]
    # 4. The outputs back to the ranks of their tokens, in the order they were sent.
    return all_to_all(torch.cat(by_rank), input_splits, output_splits, group)  # (M, d)


def shard_experts(model: nn.Module, ep_mesh) -> None:
    """Keep E / ep experts of every MoE layer on each rank of ep_mesh (w1, w2, w3 become
    DTensors, Shard(0): their global shape and full values stay known to DCP, model.pt and
    clip_grad_norm_), and make each layer dispatch its tokens over that group."""
    for moe in model.modules():
        if isinstance(moe, MoEFeedForward):
            for name in EXPERT_WEIGHTS:
                # On the meta device (the lesson builds there), or the same weights on every
                # rank: each keeps its own slice, with no traffic (src_data_rank=None).
                full = getattr(moe, name).detach()
                shard = distribute_tensor(full, ep_mesh, [Shard(0)], src_data_rank=None)
                setattr(moe, name, nn.Parameter(shard))
            moe.dispatch = functools.partial(dispatch, moe, group=ep_mesh.get_group())


# -------------------------------------------------------------------------------------------------
# Clipping a gradient that lives on two meshes


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for DTensor gradients on different meshes (the experts'
    on dp x ep, the rest on all ranks), which torch's refuses to stack: the norm of each mesh's
    gradients (its DTensors' norms reduced over that mesh), combined into the norm of the whole
    gradient; every gradient is then clipped by it. Returns it (a plain tensor, on every rank)."""
    by_mesh: dict = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p)
    # DTensor warns (once per mesh) that the experts' norm, partial over dp and ep, takes two
    # all-reduces, one per mesh dimension, and that such sums may differ between ranks. Here each
    # is one scalar (nothing to gain from one flattened all-reduce), and every rank ends with the
    # same sum of the same values in the same order: ranks agree (tests/test_ep.py holds the
    # logged norm to one process's). The warning is silenced for this call only.
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        norms = [
            torch.nn.utils.get_total_norm([p.grad for p in params]).full_tensor()
            for params in by_mesh.values()
        ]
    finally:
        log.setLevel(level)
    total = torch.linalg.vector_norm(torch.stack(norms))
    if max_norm < math.inf:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
