"""The tensor-parallel plan of train_tp.py (and of train_pp.py's stages): which matrix of the
Llama is split by columns, which by rows, and what runs replicated or split along the sequence,
with torch.distributed.tensor.parallel.

    for layer in model.layers:                 # in place: each layer's matrices over the tp ranks
        parallelize_module(layer, mesh["tp"], layer_plan(sequence_parallel))
    apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)  # the rest
    replicate_partial_grads(model.parameters())  # before clipping, with sequence parallelism
"""

import os

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lib import model_config, training
from lib.distributed import divide_ranks
from lib.flags import number_arg
from lib.parallel import fsdp
from lib.parallel.layout import Layout
from model import LlamaConfig

# Tensor parallelism. A linear layer computes Y = X A (nn.Linear stores A transposed, as weight
# (out, in)). Split A by columns, A = [A1 A2], and rank i computes Y_i = X A_i from the whole X:
# no communication, and each rank holds a slice of Y's features. Split the next matrix B by rows,
# B = [B1; B2], and rank i computes Y_i B_i from exactly its own slice: Y B = Y_1 B_1 + Y_2 B_2,
# a sum of partial results, which one all-reduce adds up (Megatron-LM, Shoeybi et al. 2019).
#
# Sequence parallelism (--sequence-parallel; Korthikanti et al. 2022, "Reducing Activation
# Recomputation in Large Transformer Models", as torchtitan applies it). Between those pairs of
# matrices the activations are whole on every tp rank: the residual stream, the RMSNorms, the
# residual adds. They are tp identical copies of the same work and the same memory. Split them
# along the sequence instead (Shard(1) of (B, T, d)): each rank keeps T/tp positions of them,
# which is correct because a norm and an add act on each position alone. The all-reduce after the
# embedding, wo and w2 becomes a reduce-scatter (each rank receives the sums of its own positions
# only), and an all-gather brings the whole sequence back right before the next attention, MLP or
# lm_head, which need every position. An all-reduce is a reduce-scatter followed by an
# all-gather, so the traffic is the same (backward: the same pair, the other way round). What
# shrinks is memory: what autograd stores for the norms (their inputs and normalised outputs) and
# the residual stream between layers (all that --activation-checkpointing keeps) take 1/tp per
# rank. The all-gathered inputs of wq/wk/wv and w1/w3 are still stored whole, as without it
# (Megatron-LM stores its piece and gathers it again in backward; ColwiseParallel does not).


def add_flags(parser) -> None:
    """train_tp.py's flags: FSDP's (it shards across the tp groups), --tp, --sequence-parallel."""
    fsdp.add_flags(parser)
    parser.add_argument(
        "--tp",
        type=number_arg(int, 1),
        default=None,
        help="tensor-parallel ranks per group, at most the GPUs of one node; it must divide the "
        "number of ranks, and FSDP shards over the dp = world_size / tp groups (default: the "
        "processes of one node, torchrun's LOCAL_WORLD_SIZE: TP inside nodes, FSDP across)",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="also split the activations around the norms (and the residual stream) along the "
        "sequence over the tp ranks: the same traffic, 1/tp of their memory per rank (needs "
        "--tp 2 or more and a --seq-length divisible by --tp)",
    )


def setup(parser, args, world_size: int, device) -> Layout:
    """train_tp.py's grid, dp x tp ranks (HSDP: replicate x shard x tp), its flags checked before
    any work (ValueError through parser.error): --tp (default: the processes of one node) divides
    the ranks and the model's heads and hidden units; --sequence-parallel splits the sequence
    evenly; --replicate divides dp; no mixture of experts. The mesh is built unless --check."""
    tp = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if args.tp is None else args.tp
    try:
        dp = data_parallel_size(world_size, tp)
        check_tensor_parallel(model_config.model_shape(args), tp)
        if args.sequence_parallel:
            check_sequence_parallel(tp, args.seq_length)
    except ValueError as e:
        parser.error(str(e))
    model_config.refuse_experts(parser, args, "train_tp.py")  # MoE: not here (NO_EXPERTS: why)
    fsdp.check_replicate(parser, args, dp)
    sizes = dict(tp=tp, sequence_parallel=args.sequence_parallel, **fsdp.options(args))
    if args.check:
        return Layout(world_size, dp, **sizes)
    # rank = dp_rank * tp + tp_rank: mesh["tp"] is this rank's TP group (tp consecutive ranks);
    # FSDP's dimensions, the ranks that hold the same TP shard in the other groups, come first.
    mesh, fsdp_mesh, dp_rank, dp_group = fsdp.grid(args, dp, device, inner=[(tp, "tp")])
    return Layout(
        world_size, dp, **sizes, mesh=mesh, fsdp_mesh=fsdp_mesh, dp_rank=dp_rank, dp_group=dp_group
    )


def describe(layout: Layout) -> str:
    """train_tp.py's grid, and FSDP's over it: the start-up summary's line."""
    text = f"dp {layout.dp} x tp {layout.tp} (sequence parallel {layout.sequence_parallel}); "
    return text + fsdp.describe(layout)


def data_parallel_size(world_size: int, tp: int) -> int:
    """dp = world_size / tp; ValueError unless --tp divides the number of ranks."""
    return divide_ranks(world_size, "--tp", tp, "dp x tp")


def check_tensor_parallel(config: LlamaConfig, tp: int) -> None:
    """ValueError unless every split is into whole pieces: whole attention heads (query and
    key/value) and whole MLP hidden units per rank. The vocabulary need not divide: DTensor
    splits a dimension of any size (as torch.chunk does: the last rank may get fewer rows)."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % tp:
            raise ValueError(
                f"--tp {tp} does not divide the model's {name} ({value}): each tensor-parallel "
                f"rank must compute whole heads and hidden units; choose a --tp that divides it"
            )


def check_sequence_parallel(tp: int, seq_length: int) -> None:
    """ValueError unless --sequence-parallel can split every sequence into tp equal pieces."""
    if tp == 1:
        raise ValueError(
            "--sequence-parallel splits each sequence over the tensor-parallel ranks, but tp is "
            "1 (--tp, default: the processes of one node): pass --tp 2 or more, or drop "
            "--sequence-parallel"
        )
    if seq_length % tp:
        # Uneven pieces would each be taken for 1/tp of the sequence, and the gathers fail.
        raise ValueError(
            f"--sequence-parallel needs a --seq-length divisible by --tp {tp}, got "
            f"{seq_length}: each tensor-parallel rank holds an equal piece of every sequence"
        )


def replicate_module(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Keep a module whole on every tp rank, its parameters turned into Replicate DTensors.

    Why not leave them plain tensors: then every parameter of the model is a DTensor on the same
    mesh, so gradient clipping, FSDP on top (2D) and DCP checkpoints treat them all alike. The
    forward sees plain activations, wrapped and unwrapped at no cost. Their gradients need no
    all-reduce: every tp rank computes the same one, because the norm's input and the gradient
    flowing back into its output are the same on every tp rank (both come out of an all-reduce).
    """
    distribute_module(
        module,
        tp_mesh,
        input_fn=lambda mod, inputs, mesh: tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs
        ),
        output_fn=lambda mod, output, mesh: output.to_local(),
    )


def wait_for_output(module, args, output):
    """Forward hook: the embedding's output as a plain tensor, its all-reduce complete.

    RowwiseParallel issues its all-reduce (with sequence parallelism, its reduce-scatter)
    asynchronously and returns a tensor that waits for it on first use. Given as it is to a
    torch.compile'd layer (--compile), its gradient comes back as the wrong type (torch 2.13:
    "AttributeError: 'Tensor' object has no attribute '_local_tensor'" in backward). clone()
    waits, at the cost of one copy of (B, T, hidden) per forward (of (B, T/tp, hidden) with
    sequence parallelism).
    """
    return output.clone()


def parallelize_norm(norm: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """An RMSNorm, its weight replicated: run whole on every tp rank, or (sequence parallelism)
    on this rank's T/tp positions alone.

    SequenceParallel takes a plain input (B, T/tp, d) as this rank's Shard(1) of the sequence and
    returns a DTensor of that layout, which the next piece all-gathers. Its weight's gradient is a
    Partial DTensor (each rank's sum over its own positions): DTensor adds the pieces up (an
    all-reduce of d numbers) where it is read, in clip_grad_norm_, AdamW or FSDP's reduce-scatter.
    """
    if sequence_parallel:
        parallelize_module(norm, tp_mesh, SequenceParallel())
    else:
        replicate_module(norm, tp_mesh)


def replicate_partial_grads(parameters) -> None:
    """Sum every Partial gradient over its ranks, in place: a Replicate (or still sharded) DTensor.

    With sequence parallelism the norms' weight gradients are Partial: each tp rank holds its sum
    over its own positions, and the whole gradient is their sum, taken where it is read. Call this
    before clip_grad_norm_: it measures such a gradient right, but torch 2.11 then leaves it
    unscaled (its in-place multiply does not reach a Partial DTensor's pieces; 2.13 scales it).
    Summed first, clipping is the same on every torch, at the cost of the all-reduce of a few
    numbers per norm that the optimizer would otherwise do.
    """
    for p in parameters:
        grad = p.grad
        if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
            placements = [Replicate() if pl.is_partial() else pl for pl in grad.placements]
            p.grad = grad.redistribute(grad.device_mesh, placements)


def layer_plan(sequence_parallel: bool = False) -> dict:
    """The tensor-parallel plan of one decoder layer, for parallelize_module(layer, tp_mesh,
    plan): Megatron's, wq, wk, wv, w1 and w3 split by columns, wo and w2 by rows, so that
    attention and the MLP each end in one all-reduce (with sequence_parallel, a reduce-scatter
    into this rank's positions, the residual stream staying split along the sequence)."""
    # The layout of the residual stream between the layers (see apply_tensor_parallel).
    stream = Shard(1) if sequence_parallel else Replicate()
    return {
        # The attention's input x, whole (all-gathered from the sequence pieces with sequence
        # parallelism), as one Replicate DTensor for wq, wk and wv: the gradients they send
        # back into it are added up first, then all-reduced (or reduce-scattered) once, not
        # once per projection. One layout per positional argument of DecoderLayer's call
        # attention(x, cos, sin, attn_mask, cache): the others (cos, sin (T, hd) of the
        # whole sequence; attn_mask None, a dense mask or a BlockMask; the KV cache) are the
        # same on every rank and pass through untouched (None).
        "attention": PrepareModuleInput(
            input_layouts=(stream, None, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None, None),
        ),
        # Columnwise: each rank computes nh/tp query heads and nkv/tp key/value heads from the
        # whole (replicated) input, without communication. Attention is per head, so it runs
        # on those local heads alone: model.Attention reads the head counts from the
        # projections' outputs (use_local_output: plain local tensors). With grouped-query
        # attention the query heads of a rank are exactly those that use its kv heads.
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        # Rowwise: wo's input features are the heads, so its rows split like them; each rank
        # multiplies its own heads' output, and one all-reduce adds up the partial sums (or a
        # reduce-scatter: each rank receives the sums of its own positions only).
        "attention.wo": RowwiseParallel(output_layouts=stream),
        # The same in the MLP: w1 (gate) and w3 (up) by columns, so each rank holds whole
        # hidden units and silu(w1 x) * w3 x is local; w2 (down) by rows, one all-reduce (or
        # reduce-scatter).
        "feed_forward": PrepareModuleInput(
            input_layouts=(stream,), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=stream),
    }


def apply_tensor_parallel(
    module: nn.Module,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool = False,
    loss_parallel: bool = True,
) -> None:
    """Split the rest of `module`'s weights over `tp_mesh` (a 1-D mesh: the tp ranks of one
    group), in place, once the lesson has given each decoder layer its layer_plan: the embedding,
    the norms and lm_head.

    The contract, for this script and for train_pp.py's pipeline stages: `module` has any subset
    of LlamaForPretraining's attributes `tok_embeddings`, `layers`, `norm`, `lm_head`, and only
    those it has are parallelised. `layers` may be an nn.ModuleList or an nn.ModuleDict (keyed by
    the original layer index: its values are the layers). Activations between the parallelised
    pieces (the residual stream) stay plain tensors, so the module's own forward runs unchanged
    (a stage may send its output to the next stage as it is): whole, replicated tensors of the
    usual shapes, or with sequence_parallel=True this rank's own T/tp positions, (B, T/tp, d),
    which needs T divisible by tp (check_sequence_parallel). One exception: with
    loss_parallel=True, lm_head returns a DTensor sharded over the vocabulary (Shard(-1)), and
    the cross-entropy on it, and its backward, must run inside
    torch.distributed.tensor.parallel.loss_parallel(). With loss_parallel=False, lm_head
    all-gathers the full logits (plain tensor; vocab x more traffic and memory).
    The head counts must divide (check_tensor_parallel). If the module holds both the embedding
    and lm_head and they share one weight (tie_word_embeddings), they still share it afterwards.
    """
    # What the module has (a pipeline stage sets what it lacks to None).
    embeddings, norm, lm_head = (
        getattr(module, name, None) for name in ("tok_embeddings", "norm", "lm_head")
    )
    tied = embeddings is not None and lm_head is not None and lm_head.weight is embeddings.weight
    # The layout of the residual stream, and all that sequence parallelism changes in the plan:
    # whole on every tp rank, or split along the sequence (dim 1 of (B, T, d)). The embedding,
    # wo and w2 deliver their sums in this layout (all-reduce, or reduce-scatter); attention, the
    # MLP and lm_head take their input from it (as it is, or all-gathered); the norms run on it.
    stream = Shard(1) if sequence_parallel else Replicate()
    if embeddings is not None:
        # The embedding table split by vocabulary rows (RowwiseParallel on an nn.Embedding): each
        # rank looks up the token ids that fall in its own rows and outputs zeros for the others;
        # one all-reduce sums the pieces into the whole embedding, replicated on every rank (or
        # one reduce-scatter, into this rank's positions of it).
        style = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
        parallelize_module(embeddings, tp_mesh, style)
        embeddings.register_forward_hook(wait_for_output)
    for layer in training.decoder_layers(module) if hasattr(module, "layers") else ():
        # Norms are tiny and act on each position's feature vector: whole weights, run on the
        # whole sequence, or (sequence parallelism) on this rank's positions.
        parallelize_norm(layer.attention_norm, tp_mesh, sequence_parallel)
        parallelize_norm(layer.ffn_norm, tp_mesh, sequence_parallel)
    if norm is not None:
        parallelize_norm(norm, tp_mesh, sequence_parallel)
    if lm_head is not None:
        # Columnwise over the vocabulary, on the whole sequence (all-gathered from the pieces):
        # each rank computes the logits of its own vocab slice. Kept sharded for loss_parallel
        # (the softmax needs each token's max and sum over the vocab, and its target's logit:
        # three all-reduces of one number per token), or all-gathered into the full logits.
        style = (
            ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
            if loss_parallel
            else ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
        )
        parallelize_module(lm_head, tp_mesh, style)
        if tied:
            # Both are split by vocabulary rows (Shard(0) of a (vocab, hidden) matrix), so one
            # DTensor serves both; parallelize_module had given each a copy of its own.
            lm_head.weight = embeddings.weight


def local_outputs(module, args, output):
    """Forward hook: the model's (loss_sum, num_tokens), as plain tensors.

    Under loss_parallel the cross-entropy of the vocab-sharded logits is a DTensor, replicated
    over the tp ranks; its local value is the whole loss. Plain tensors keep the training loop and
    training.evaluate unchanged (and backward through to_local still reaches every shard).
    """
    if isinstance(output, tuple):
        return tuple(t.to_local() if isinstance(t, DTensor) else t for t in output)
    return output
