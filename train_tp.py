"""Pretrain a Llama with torchrun + tensor parallelism (Megatron-style), FSDP2 across groups.

    torchrun --standalone --nproc_per_node=8 train_tp.py --model 7b --tp 8   # TP=8 in one node
    torchrun --standalone --nproc_per_node=8 train_tp.py --model 1b --tp 4   # 2D: TP 4 x FSDP 2
    torchrun --standalone --nproc_per_node=2 train_tp.py --tp 2              # no GPU: 2 CPU ranks
    NNODES=4 NODE_RANK=0 MASTER_ADDR=10.0.0.1 SCRIPT=train_tp.py ./run_ddp.sh --model 70b --tp 8
        # 4 nodes x 8 GPUs, the same command on every node (NODE_RANK 0..3): TP=8 inside each
        # node (NVLink), FSDP over the 4 nodes (dp = 32 / 8 = 4)

The ranks form one (dp, tp) grid: world_size = dp x tp. Ranks are numbered node by node, and the
tp dimension is the inner (fastest-changing) one, so each TP group is tp consecutive ranks: the
GPUs of one node when tp <= GPUs per node. That is where TP belongs: it communicates inside
every layer, twice per forward and twice per backward, and only NVLink is fast enough for that.
FSDP communicates once per layer per pass and overlaps it with compute: it crosses nodes.

What this changes in train_fsdp.py (`diff train_fsdp.py train_tp.py` shows exactly this):
  1. A DeviceMesh (dp, tp) instead of one flat group of ranks. The tp ranks of a group read the
     same samples; the data is split over the dp groups only, exactly as train_fsdp.py splits it
     over ranks, so every global batch is the same as in train_dp.py.
  2. apply_tensor_parallel(): every matrix is split over the tp ranks of a group, with
     torch.distributed.tensor.parallel (parallelize_module, ColwiseParallel, RowwiseParallel).
     In attention and in the MLP the first projections are split by columns (each rank computes
     whole heads / whole hidden units) and the last one by rows, so each block needs a single
     all-reduce in forward and one in backward. The embedding is split by vocabulary rows,
     lm_head by vocabulary columns, and the cross-entropy is computed on the vocab-sharded
     logits (loss_parallel) without ever gathering them. RMSNorm weights are replicated.
  3. FSDP (fully_shard) is then applied over the dp dimension only, on top of TP (2D
     parallelism); with dp = 1 there is no FSDP at all, and with tp = 1 this is train_fsdp.py.
     The order is torchtitan's: TP, activation checkpointing, compile, FSDP.
  4. The loss, the target count and the validation sums are all-reduced over the dp group, not
     over every rank: the tp ranks of a group hold the same (replicated) loss.
  Checkpoints (DCP directories, model.pt gathered on rank 0) are train_fsdp.py's own functions:
  DCP saves DTensors of any layout, and reshards on load, so a run can resume with another --tp.
  Not here: --zero-stage (FSDP is ZeRO-3), --cpu-offload, fp16, sequence parallelism.
"""

import contextlib
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, DistributedSampler, Subset
from tqdm import tqdm

import common
import memory_plan
from model import IGNORE_INDEX, LlamaConfig, LlamaForPretraining
from train_ddp import from_rank0, setup_distributed  # the same setup: nothing changes there
from train_fsdp import load_sharded_checkpoint, prepare_out_dir, save_sharded_checkpoint

# -------------------------------------------------------------------------------------------------
# Tensor parallelism. A linear layer computes Y = X A (nn.Linear stores A transposed, as weight
# (out, in)). Split A by columns, A = [A1 A2], and rank i computes Y_i = X A_i from the whole X:
# no communication, and each rank holds a slice of Y's features. Split the next matrix B by rows,
# B = [B1; B2], and rank i computes Y_i B_i from exactly its own slice: Y B = Y_1 B_1 + Y_2 B_2,
# a sum of partial results, which one all-reduce adds up (Megatron-LM, Shoeybi et al. 2019).


def data_parallel_size(world_size: int, tp: int) -> int:
    """dp = world_size / tp; ValueError unless --tp divides the number of ranks."""
    if tp < 1:
        raise ValueError(f"--tp {tp} must be at least 1")
    if tp > world_size or world_size % tp:
        raise ValueError(
            f"--tp {tp} must divide the number of ranks ({world_size}): the ranks form a grid of "
            f"dp x tp; launch a multiple of {tp} processes (torchrun --nproc_per_node) or "
            f"choose a --tp that divides {world_size}"
        )
    return world_size // tp


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

    RowwiseParallel issues its all-reduce asynchronously and returns a tensor that waits for it on
    first use. Given as it is to a torch.compile'd layer (--compile), its gradient comes back as
    the wrong type (torch 2.13: "AttributeError: 'Tensor' object has no attribute '_local_tensor'"
    in backward). clone() waits, at the cost of one copy of (B, T, hidden) per forward.
    """
    return output.clone()


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool = True):
    """Split `module`'s weights over `tp_mesh` (a 1-D mesh: the tp ranks of one group), in place.

    The contract, for this script and for train_pp.py's pipeline stages: `module` has any subset
    of LlamaForPretraining's attributes `tok_embeddings`, `layers`, `norm`, `lm_head`, and only
    those it has are parallelised. `layers` may be an nn.ModuleList or an nn.ModuleDict (keyed by
    the original layer index: its values are the layers). Activations between the parallelised
    pieces stay plain, replicated tensors of the usual shapes, so the module's own forward runs
    unchanged (a stage may send its output to the next stage as it is), with one exception: with
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
    if embeddings is not None:
        # The embedding table split by vocabulary rows (RowwiseParallel on an nn.Embedding): each
        # rank looks up the token ids that fall in its own rows and outputs zeros for the others;
        # one all-reduce sums the pieces into the whole embedding, replicated on every rank.
        parallelize_module(embeddings, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
        embeddings.register_forward_hook(wait_for_output)
    for layer in common.decoder_layers(module) if hasattr(module, "layers") else ():
        plan = {
            # Columnwise: each rank computes nh/tp query heads and nkv/tp key/value heads from the
            # whole (replicated) input, without communication. Attention is per head, so it runs
            # on those local heads alone: model.Attention reads the head counts from the
            # projections' outputs (use_local_output: plain local tensors). With grouped-query
            # attention the query heads of a rank are exactly those that use its kv heads.
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            # Rowwise: wo's input features are the heads, so its rows split like them; each rank
            # multiplies its own heads' output, and one all-reduce adds up the partial sums.
            "attention.wo": RowwiseParallel(),
            # The same in the MLP: w1 (gate) and w3 (up) by columns, so each rank holds whole
            # hidden units and silu(w1 x) * w3 x is local; w2 (down) by rows, one all-reduce.
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
        parallelize_module(layer, tp_mesh, plan)
        # Norms are tiny and act on whole feature vectors: replicated, computed on every rank.
        replicate_module(layer.attention_norm, tp_mesh)
        replicate_module(layer.ffn_norm, tp_mesh)
    if norm is not None:
        replicate_module(norm, tp_mesh)
    if lm_head is not None:
        # Columnwise over the vocabulary: each rank computes the logits of its own vocab slice.
        # Kept sharded for loss_parallel (the softmax needs each token's max and sum over the
        # vocab, and its target's logit: three all-reduces of one number per token), or
        # all-gathered into the full logits.
        style = (
            ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
            if loss_parallel
            else ColwiseParallel(output_layouts=Replicate())
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
    common.evaluate unchanged (and backward through to_local still reaches every shard).
    """
    if isinstance(output, tuple):
        return tuple(t.to_local() if isinstance(t, DTensor) else t for t in output)
    return output


def main():
    parser = common.build_parser(
        "Pretrain a Llama with torchrun + tensor parallelism (Megatron-style), FSDP2 across "
        "tensor-parallel groups."
    )
    parser.add_argument(
        "--backend",
        choices=["nccl", "gloo"],
        default=None,
        help="process group backend (default: nccl on GPU, gloo on CPU)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel ranks per group, at most the GPUs of one node; it must divide the "
        "number of ranks, and FSDP shards over the dp = world_size / tp groups (default: the "
        "processes of one node, torchrun's LOCAL_WORLD_SIZE: TP inside nodes, FSDP across)",
    )
    args = parser.parse_args()
    rank, local_rank, world_size, device = setup_distributed(args.backend)
    is_main = rank == 0  # global rank 0 alone prints, writes files and shows the progress bar
    if args.tp is None:
        args.tp = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dp = data_parallel_size(world_size, args.tp)
    # Only the dp groups split the batch: the tp ranks of a group work on the same samples.
    if args.micro_batch_size == "auto":
        # Its probe runs the model's forward and backward outside loss_parallel(), which the
        # vocabulary-sharded loss needs.
        parser.error(
            "--micro-batch-size auto is not supported by train_tp.py; give a number "
            "(python memory_plan.py --tp N estimates what fits)"
        )
    accumulation = common.check_args(parser, args, devices=dp)
    check_tensor_parallel(common.model_shape(args), args.tp)  # before any data work
    precision = common.resolve_precision(args.precision, device)
    args.attention = common.resolve_attention(args, device)
    if precision == "fp16":
        raise ValueError(
            "train_tp.py supports --precision bf16 or fp32: fp16 needs loss scaling of sharded "
            "gradients, which this script does not implement"
        )
    if args.check:  # every flag passed: stop before any work (run_ddp.sh checks this way first)
        print(f"{parser.prog}: the flags are fine (--check: nothing was run)")
        return
    # The grid of ranks: rank = dp_rank * tp + tp_rank. mesh["tp"] is this rank's TP group (tp
    # consecutive ranks), mesh["dp"] the ranks that hold the same shard in the other groups.
    mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    dp_group = mesh["dp"].get_group()
    resume_path = from_rank0(lambda: prepare_out_dir(args, script="train_tp.py"), is_main)

    # ---- data ----------------------------------------------------------------------------------
    train_ds, val_ds, tokenizer = common.build_datasets(args)
    steps_per_epoch = common.steps_per_epoch(train_ds, args)
    # Each dp group reads every dp-th sample of one shared shuffle. Over the groups, step s covers
    # exactly samples [s*B, (s+1)*B) of that shuffle: the same global batch that train_dp.py
    # draws, whatever the grid. All tp ranks of a group pass the same dp_rank: the same samples.
    sampler = DistributedSampler(train_ds, dp, dp_rank, shuffle=True, seed=args.seed)

    def order_for_epoch(epoch: int) -> list[int]:
        # set_epoch reseeds the shuffle with seed + epoch: without it every epoch would repeat the
        # first one's order. All ranks pass the same epoch, so their shards stay disjoint.
        sampler.set_epoch(epoch)
        return list(sampler)

    val_set = Subset(val_ds, range(min(len(val_ds), args.eval_batches * args.batch_size)))
    # Every dp-th validation sample, nothing dropped or repeated (a DistributedSampler would pad
    # or drop to even out the shards): the summed loss is that of the whole set.
    val_shard = Subset(val_set, range(dp_rank, len(val_set), dp))
    val_loader = DataLoader(val_shard, batch_size=args.micro_batch_size)

    # ---- model, sharding, optimizer, resume -----------------------------------------------------
    model, config = common.build_model(args, tokenizer.get_vocab_size())
    model.to(device)
    # torchtitan's order: TP first (it changes the layers' computation), then activation
    # checkpointing and compilation of each (now tensor-parallel) layer, then FSDP around them.
    if args.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], loss_parallel=True)
    if args.activation_checkpointing:
        common.apply_activation_checkpointing(model)
    if args.compile:
        common.compile_layers(model, loss=False)  # loss_parallel(): see compile_layers
    if dp > 1:
        # bf16: weights are all-gathered in bf16 (half the traffic and memory of fp32) and
        # gradients reduce-scattered in fp32 into fp32 shards, which stay the master weights
        # AdamW updates. fp32: no casts at all, so the result equals train_dp.py's.
        bf16 = precision == "bf16"
        mp_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        )
        # Layers first, then the root, as in train_fsdp.py, but over mesh["dp"]: each TP shard
        # is split again over the dp groups (a parameter becomes a 2-D DTensor on the grid), and
        # gradients are reduce-scattered between the ranks that hold the same TP shard.
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"], mp_policy=mp_policy)
        fully_shard(model, mesh=mesh["dp"], mp_policy=mp_policy)
    if args.tp > 1:
        # Registered last, so that it runs after FSDP's own hooks: they see the model's outputs.
        model.register_forward_hook(local_outputs)
    # Built after sharding, on the shards: AdamW's state is sharded like them.
    optimizer = common.build_optimizer(model, args, device.type)
    scheduler = common.build_scheduler(optimizer, args)
    start_step = 0
    if resume_path:  # every rank loads the same directory: the one rank 0 chose
        start_step = load_sharded_checkpoint(
            resume_path, model, optimizer, scheduler, config, args, tokenizer
        )
        if is_main:
            print(f"resumed from {resume_path} at step {start_step}")
    if is_main:
        print(common.describe_run(args, config, accumulation, dp, device, precision))
        print(
            f"parallelism: {world_size} ranks = dp {dp} x tp {args.tp} (tensor parallel "
            f"{args.tp > 1}, FSDP {dp > 1}), activation checkpointing "
            f"{args.activation_checkpointing}"
        )
        if args.plan:
            print(memory_plan.plan_for_run(args, config, world_size, precision))

    # ---- training loop -------------------------------------------------------------------------
    batches = common.step_batches(
        train_ds,
        order_for_epoch,
        args.micro_batch_size,
        accumulation,
        steps_per_epoch,
        start_step,
        args.num_workers,
        pin_memory=device.type == "cuda",
    )
    metrics = common.Metrics(args.out_dir, is_main, start_step)
    guard = common.NonFiniteGuard(device, skip=args.skip_nonfinite)
    throughput = common.Throughput(config, args, device, world_size)  # tokens/s, MFU, ...
    stop_request = common.StopRequest(device)  # Ctrl-C, SIGTERM: stop cleanly (see there)
    # The cross-entropy of vocab-sharded logits, forward and backward, runs under loss_parallel.
    vocab_parallel = loss_parallel if args.tp > 1 else contextlib.nullcontext
    bar = tqdm(
        range(start_step, args.max_steps),
        initial=start_step,
        total=args.max_steps,
        disable=not is_main,
        desc="train",
    )
    for step in bar:
        lr = optimizer.param_groups[0]["lr"]
        # Copied to the device first, asynchronously, and counted there (as train_fsdp.py).
        micro_batches = [
            (x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            for x, y in next(batches)
        ]
        # Normalise by the number of targets in the whole global batch (all micro-batches, all dp
        # groups), not per micro-batch: then every target token weighs the same however the batch
        # is split. Summed over the dp group only: the tp ranks of a group count the same tokens.
        global_tokens = sum((y != IGNORE_INDEX).sum() for _, y in micro_batches)
        dist.all_reduce(global_tokens, group=dp_group)
        step_loss = torch.zeros((), device=device)
        for i, (x, y) in enumerate(micro_batches):
            if dp > 1:
                # Gradient accumulation: reduce-scatter only after the last micro-step.
                model.set_requires_gradient_sync(i == accumulation - 1)
            with vocab_parallel():
                # autocast as in train_fsdp.py: with bf16 weights from the policy it changes no
                # matmul, but still runs cross-entropy and softmax in fp32.
                with common.autocast(device, precision):
                    loss_sum, _ = model(x, y, common.build_attn_mask(x, args, tokenizer))
                # FSDP averages gradients over the dp groups: the factor dp undoes that, leaving
                # sum of all losses / all tokens. (TP needs no factor: each rank's gradient is
                # its own shard's gradient of that one loss.)
                loss = loss_sum * dp / global_tokens
                loss.backward()
            step_loss += loss_sum.detach()
        # The global loss, on every rank (no wait for it here: the all-reduce is queued like any
        # other kernel). Every rank then takes the same decisions about it below.
        dist.all_reduce(step_loss, group=dp_group)
        # The gradients are DTensors (sharded over tp, and over dp too with FSDP): clip_grad_norm_
        # adds up the squared norms of the shards over the grid, so every rank measures (and
        # clips by) the norm of the whole gradient. Replicated norm weights are counted once.
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), args.grad_clip if args.grad_clip > 0 else math.inf
        )
        if isinstance(grad_norm, DTensor):  # a plain tensor for one rank (no TP, no FSDP)
            grad_norm = grad_norm.full_tensor()  # replicated on every rank: no traffic
        if guard.step_ok(step + 1, step_loss, grad_norm):
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        throughput.step()
        done = step + 1
        last = done == args.max_steps
        # After Ctrl-C or SIGTERM, every rank stops after the same step, with a checkpoint there.
        stop = stop_request.agreed() and not last
        do_log, do_eval, do_save = (
            done % interval == 0 or last
            for interval in (args.log_interval, args.eval_interval, args.save_interval)
        )
        do_save = do_save or stop  # saved once, if this step saves anyway
        if do_log or do_eval or do_save:
            guard.check(args.out_dir)  # never log, evaluate or save a NaN state

        if do_log:
            # Reading a value from the GPU waits for it; doing so only every log_interval steps
            # keeps the GPU queue full in between.
            loss = (step_loss / global_tokens).item()
            figures = throughput.figures()
            bar.set_postfix(common.bar_postfix(loss, lr, figures))
            metrics.log(step=done, loss=loss, lr=lr, **figures, grad_norm=grad_norm.item())
        if do_eval:
            # Every rank evaluates (each layer's forward is a collective over its tp group, and
            # FSDP's all-gathers over dp); each dp group its own shard of the data, and the sums
            # are added up over the dp groups.
            with vocab_parallel():
                val_sum, val_tokens = common.evaluate(
                    model, val_loader, device, precision, args, tokenizer
                )
            dist.all_reduce(val_sum, group=dp_group)
            dist.all_reduce(val_tokens, group=dp_group)
            val_loss = (val_sum / val_tokens).item()
            metrics.log_validation(done, val_loss)  # printed on rank 0 too
            throughput.restart()  # keep evaluation time out of the tokens/s figure
        if do_save:
            # Every rank: each writes its own shards (a collective, never inside is_main).
            save_sharded_checkpoint(
                args, done, model, optimizer, scheduler, config, tokenizer, is_main
            )
            throughput.restart()
        if stop:
            raise common.Stopped(done, stop_request.signal)  # common.run says so and exits

    # ---- outputs -------------------------------------------------------------------------------
    # Gather the full weights from their TP (and FSDP) shards: a collective, so every rank calls
    # it; with cpu_offload=True only rank 0 receives them, in CPU memory (the others get an empty
    # dict). Loaded into a plain model, they make the same model.pt as every other script writes.
    full_state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if is_main:
        plain = LlamaForPretraining(config)
        plain.load_state_dict(full_state)
        common.finish_run(args, plain, config, tokenizer, device)
    dist.barrier()  # the run is over when rank 0's files are written, for every rank
    dist.destroy_process_group()


if __name__ == "__main__":
    common.run(main)
