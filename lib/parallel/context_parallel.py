"""Context parallelism (CP) of train_cp.py: every sequence split over the cp ranks of a group,
and attention run over the whole sequence by all-gathering each layer's keys and values.

    cp_model = ContextParallel(model, mesh["cp"])    # model: sharded or not, left unchanged
    loss_sum, num_tokens = cp_model(x, y, doc_ids)   # x, y (B, T): the whole sequences

Each rank computes the loss of its slice of every sequence only: its T / cp tokens go through
the embeddings, every layer, lm_head and the cross-entropy, and so do their activations. Only
attention needs the other tokens: the cp ranks all-gather the layer's rotated keys and values,
and each rank's queries attend to those of the whole sequence, causally by position.

The zigzag split. Under causal attention a late token attends to more keys than an early one,
so cp contiguous slices would give the last rank most of the work. The sequence is cut into
2 x cp chunks instead, and rank r holds chunks r and 2cp-1-r: one early, one late. With cp = 2:

    positions:  | chunk 0 | chunk 1 | chunk 2 | chunk 3 |
    rank 0:       chunk 0                       chunk 3     its queries see 1 + 4 chunks of keys
    rank 1:                 chunk 1   chunk 2               its queries see 2 + 3 chunks of keys

Every rank does the same attention work. Its tokens are not positions 0..T/cp-1: the model gets
their positions (position_ids) for RoPE. Why an all-gather rather than a ring, and why not
PyTorch's own context_parallel: docs/context-parallel.md.
"""

import functools
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention.bias import causal_lower_right

from lib import distributed, model_config
from lib.distributed import divide_ranks
from lib.flags import number_arg
from lib.parallel import fsdp
from lib.parallel.layout import Layout

# -------------------------------------------------------------------------------------------------
# The zigzag split


def add_flags(parser) -> None:
    """train_cp.py's flags: FSDP's (it shards over all ranks), and --cp."""
    fsdp.add_flags(parser)
    parser.add_argument(
        "--cp",
        type=number_arg(int, 1),
        default=None,
        help="context-parallel ranks per group: each holds 1/cp of every sequence. It must divide "
        "the number of ranks (dp = world_size / cp groups split the batch) and --seq-length must "
        "be divisible by 2 x cp (default: the processes of one node, torchrun's LOCAL_WORLD_SIZE)",
    )


def setup(parser, args, world_size: int, device) -> Layout:
    """train_cp.py's grid, dp x cp ranks, checked before any work (ValueError through
    parser.error): --cp (default: the processes of one node) divides the ranks, 2 x cp divides
    --seq-length; no mixture of experts. FSDP shards over all ranks (HSDP: --replicate rows of
    them): to it the cp ranks are data-parallel like the others. Meshes built unless --check."""
    cp = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if args.cp is None else args.cp
    try:
        dp = data_parallel_size(world_size, cp, args.seq_length)
    except ValueError as e:
        parser.error(str(e))
    model_config.refuse_experts(parser, args, "train_cp.py")  # MoE: not here (NO_EXPERTS: why)
    fsdp.check_replicate(parser, args, world_size)
    if args.check:
        return Layout(world_size, dp, cp=cp, **fsdp.options(args))
    # rank = dp_rank * cp + cp_rank: mesh["cp"] is this rank's CP group (cp consecutive ranks),
    # mesh["dp"] the ranks that hold the same slice in the other groups. Each target is in one
    # rank's slice: the sums of the batch add up over all ranks (dp_group None).
    mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    fsdp_mesh = fsdp.hsdp_mesh(args, world_size, device)
    dp_rank = mesh.get_local_rank("dp")
    return Layout(
        world_size, dp, cp=cp, **fsdp.options(args), mesh=mesh, fsdp_mesh=fsdp_mesh, dp_rank=dp_rank
    )


def describe(layout: Layout) -> str:
    """train_cp.py's grid, and FSDP's over it: the start-up summary's line."""
    text = f"dp {layout.dp} x cp {layout.cp}; "
    return text + fsdp.describe(layout)


def data_parallel_size(world_size: int, cp: int, seq_length: int) -> int:
    """dp = world_size / cp; ValueError unless --cp divides the number of ranks and every
    sequence splits into 2 x cp equal chunks."""
    dp = divide_ranks(world_size, "--cp", cp, "dp x cp")
    if seq_length % (2 * cp):
        raise ValueError(
            f"--seq-length {seq_length} must be divisible by 2 x --cp = {2 * cp}: each of the "
            f"{cp} ranks of a group holds two equal chunks of every sequence (the zigzag split)"
        )
    return dp


def zigzag_chunks(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) of every sequence that cp rank `cp_rank` holds."""
    return cp_rank, 2 * cp - 1 - cp_rank


def zigzag_positions(seq_len: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """(T / cp,) the positions in the sequence of the tokens that cp rank `cp_rank` holds."""
    L = seq_len // (2 * cp)  # chunk length
    return torch.cat(
        [torch.arange(c * L, (c + 1) * L, device=device) for c in zigzag_chunks(cp_rank, cp)]
    )


def zigzag_slice(t: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's share of t (B, T, ...) along dim 1: its two chunks, (B, T / cp, ...)."""
    L = t.size(1) // (2 * cp)
    return torch.cat([t[:, c * L : (c + 1) * L] for c in zigzag_chunks(cp_rank, cp)], dim=1)


def in_sequence_order(gathered: torch.Tensor) -> torch.Tensor:
    """The whole sequence from every rank's zigzag slice: gathered (cp, ..., T / cp, hd) in rank
    order -> (..., T, hd) in position order."""
    cp = gathered.size(0)
    early, late = gathered.chunk(2, dim=-2)  # (cp, ..., L, hd): rank r's chunks r and 2cp-1-r
    chunks = [early[r] for r in range(cp)] + [late[r] for r in reversed(range(cp))]
    return torch.cat(chunks, dim=-2)  # chunks 0, 1, ..., 2cp-1


# -------------------------------------------------------------------------------------------------
# Attention of this rank's queries to the whole sequence


@functools.cache
def lower_right(queries: int, keys: int):
    """causal_lower_right(queries, keys), made once per shape: a description with no storage,
    the same for every forward. (Made in a later step, its tensor subclass would meet
    --comm-ledger's dispatch mode, under which no tensor subclass can be constructed.)"""
    return causal_lower_right(queries, keys)


def chunk_masks(
    seq_len: int, cp_rank: int, cp: int, document_ids: torch.Tensor | None, device=None
) -> list:
    """The attention masks of cp rank `cp_rank`'s two query chunks, for attend_to_sequence:
    chunk c's L queries against keys 0..(c+1)L-1 (those after it are masked anyway).

    The same in every layer: ContextParallel builds them once per forward, and every layer uses
    (and autograd keeps) that one copy. Without document_ids: the queries are the last L of
    those positions, so the causal mask is aligned to the bottom-right corner
    (causal_lower_right), which lets SDPA use its causal kernels (flash attention on GPU) instead
    of a dense mask. With document_ids (B, T), of the whole sequence (masks.document_ids): the
    rule of masks.create_causal_mask + create_document_mask as a boolean mask of just these rows,
    (B, 1, L, (c+1)L) per chunk, never the (T, T) mask.
    """
    L = seq_len // (2 * cp)
    masks = []
    for c in zigzag_chunks(cp_rank, cp):
        keys = (c + 1) * L
        if document_ids is None:
            masks.append(lower_right(L, keys))
            continue
        q_pos = torch.arange(c * L, keys, device=device)
        k_pos = torch.arange(keys, device=device)
        causal = q_pos[:, None] >= k_pos[None, :]  # (L, keys)
        docs = document_ids[:, :keys]  # (B, keys)
        same_document = docs[:, c * L :, None] == docs[:, None, :]  # (B, L, keys)
        masks.append((causal & same_document)[:, None])  # (B, 1, L, keys); True = attend
    return masks


def attend_to_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_rank: int,
    cp: int,
    masks: list,
    enable_gqa: bool,
) -> torch.Tensor:
    """Causal attention of cp rank `cp_rank`'s queries q (B, nh, T / cp, hd) to the keys and
    values of the whole sequence, k and v (B, nkv, T, hd) in position order; (B, nh, T / cp, hd).

    Each of the rank's two query chunks, chunk c, attends to keys 0..(c+1)L-1 only, under its
    mask from chunk_masks.
    """
    L = q.size(2) // 2
    outputs = []
    for j, (c, mask) in enumerate(zip(zigzag_chunks(cp_rank, cp), masks, strict=True)):
        q_chunk = q[:, :, j * L : (j + 1) * L]  # (B, nh, L, hd): positions cL..(c+1)L-1
        keys = (c + 1) * L
        y = F.scaled_dot_product_attention(
            q_chunk, k[:, :, :keys], v[:, :, :keys], attn_mask=mask, enable_gqa=enable_gqa
        )
        outputs.append(y)  # (B, nh, L, hd)
    return torch.cat(outputs, dim=2)  # (B, nh, 2L, hd)


class GatherFromRanks(torch.autograd.Function):
    """All-gather x from every rank of a group, stacked: (group size, *x.shape).

    Its backward is a reduce-scatter: every rank used every rank's x, so the gradient of the
    piece that rank r sent is the sum of what all ranks computed for it, and it goes back to r.
    (torch.distributed.nn.functional.all_gather does the same, deprecated in torch 2.13.)
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        # Concatenated along dim 0, then viewed as stacked (gloo takes only the first form).
        gathered = x.new_empty((n * x.size(0), *x.shape[1:]))
        distributed.all_gather_single(gathered, x.contiguous(), group=group)
        return gathered.view(n, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x = grad.new_empty(grad.shape[1:])
        distributed.reduce_scatter_single(grad_x, grad.flatten(0, 1).contiguous(), group=ctx.group)
        return grad_x, None  # the sum over ranks of the gradient of this rank's x


# -------------------------------------------------------------------------------------------------
# The model, run on this rank's slice of every sequence


class ContextParallel(nn.Module):
    """model(x, y) over whole sequences, computed by each rank of the cp group for its zigzag
    slice of them. Called as the model is (training.evaluate and auto_batch call it so too):

        loss_sum, num_tokens = cp_model(x, y, document_ids)

    x, y (B, T): the whole sequences, the same on every rank of the group. document_ids (B, T):
    --document-mask's masks.document_ids(x, bot_id), or None for plain causal attention.
    Returns the loss summed over this rank's targets, and their count: summed over the group,
    they are the whole sequences' (the caller all-reduces them).

    The model is a submodule only for train()/eval(); save and load the model itself.
    """

    def __init__(self, model: nn.Module, cp_mesh):
        super().__init__()
        self.model = model
        self.group = cp_mesh.get_group()
        self.cp_rank, self.cp = cp_mesh.get_local_rank(), cp_mesh.size()

    def forward(self, input_ids, targets, document_ids=None, scores: bool = False):
        T = input_ids.size(1)
        positions = zigzag_positions(T, self.cp_rank, self.cp, input_ids.device)  # (T / cp,)
        masks = chunk_masks(T, self.cp_rank, self.cp, document_ids, input_ids.device)

        # Called by every attention layer with this rank's queries, keys and values (B, heads,
        # T / cp, hd), rotated by their own positions. Autograd sees the gather: in backward,
        # the keys' and values' gradients go back to the ranks that computed them.
        @torch.compiler.disable  # --compile: the layer compiles around the gather
        def attend(q, k, v, enable_gqa):
            kv = GatherFromRanks.apply(torch.stack((k, v)), self.group)  # (cp, 2, B, nkv, T/cp, hd)
            k_all, v_all = in_sequence_order(kv)  # (B, nkv, T, hd) each
            return attend_to_sequence(q, k_all, v_all, self.cp_rank, self.cp, masks, enable_gqa)

        return self.model(
            zigzag_slice(input_ids, self.cp_rank, self.cp),
            zigzag_slice(targets, self.cp_rank, self.cp),
            attend,
            position_ids=positions,
            scores=scores,  # (--eval-tasks: each row's sums over the slice, added up as the loss)
        )
