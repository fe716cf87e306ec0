"""Pretrain a Llama with torchrun + tensor parallelism (Megatron-style), FSDP2 across groups.

    torchrun --standalone --nproc_per_node=8 train_tp.py --model 1b --tp 4   # 2D: dp 2 x tp 4
    SCRIPT=train_tp.py NNODES=16 ... ./run_ddp.sh --model 70b --tp 8 --replicate 2  # HSDP over TP

What this adds to train_fsdp.py: the ranks form a (dp, tp) grid, and the tp consecutive ranks of
a group (one node: TP talks in every layer) read the same samples. parallelize_module splits
every matrix over them, Megatron's way: wq, wk, wv, w1, w3 by columns, wo, w2 by rows (one
all-reduce each for attention and the MLP), the embedding and lm_head by vocabulary, the loss on
the sharded logits (loss_parallel); --sequence-parallel splits the rest along the sequence.

Read it top to bottom: the flags, the data, the model, the training loop, the outputs. What
every lesson does alike is in lib/ (around each step, when to log, evaluate, save and stop:
lib/loop.py); what this lesson teaches is here. To run it elsewhere, copy it with model.py,
data.py, masks.py and the lib/ folder.
Read it against the lesson before: `diff train_fsdp.py train_tp.py`.
"""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
from torch.utils.data import DistributedSampler

from lib import distributed, exits, flags, training
from lib.checkpoints.sharded import Checkpoints, TrainingState
from lib.loop import TrainingLoop
from lib.parallel import tensor_parallel
from model import IGNORE_INDEX


def main():
    parser = flags.build_parser("Pretrain a Llama with torchrun + TP + FSDP2.", sharded=True)
    tensor_parallel.add_flags(parser)  # --tp, --sequence-parallel, and FSDP's
    args = parser.parse_args()
    # torchrun starts N copies of this script, each with its RANK, LOCAL_RANK (its index on its
    # own machine) and WORLD_SIZE in the environment; each computes on the GPU of its local rank.
    rank, local_rank, world_size, device = distributed.torchrun_rank()
    # Join the process group: each rank waits here until all world_size have joined; from then on
    # the collectives (all_reduce, broadcast, ...) run among them: nccl between GPUs, gloo on CPU.
    if not args.check:  # (--check: one process checks the flags, with no group)
        options = distributed.group_options(args, device)  # backend, store (torchrun's), GPU
        dist.init_process_group(rank=rank, world_size=world_size, **options)
    # The grid: dp x tp ranks. Only the dp groups split the batch: a tp group shares its samples.
    layout = tensor_parallel.setup(parser, args, world_size, device)  # checked; the device mesh
    settings = flags.run_settings(parser, args, layout.dp, device)  # checked
    dp, dp_rank = layout.dp, layout.dp_rank  # the data-parallel groups, and which this rank is in
    if flags.check_only(parser, args):  # --check: every flag passed; nothing is run
        return
    checkpoints = Checkpoints(args)  # DCP: every rank writes its own shards
    resume_path = checkpoints.prepare_out_dir()

    # ---- data ----------------------------------------------------------------------------------
    train_ds, val_set, tokenizer = training.build_datasets(args, settings.tokenizer)
    attn_mask = training.attention_masks(args, settings, tokenizer)  # mask(x): None unless asked

    # The samples this rank reads in an epoch: every dp-th of one shuffle seeded with seed + epoch
    # by set_epoch on every rank (disjoint shares): together, the batches train_dp.py reads.
    def epoch_order(epoch: int) -> list[int]:
        sampler = DistributedSampler(train_ds, dp, dp_rank, shuffle=True, seed=args.seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    # ---- model, optimizer, resume --------------------------------------------------------------
    # Built on the meta device (shapes, no storage), sharded there; then each rank gives its part
    # storage and values, each weight drawn from a seed of its own: the same in every layout.
    model, config = training.build_model(args, settings.model, tokenizer.get_vocab_size())
    # torchtitan's order: TP first (it changes each layer's computation), then activation
    # checkpointing and compilation of the tensor-parallel layers, then FSDP around them, over the
    # dp ranks: each TP shard is split again (2-D DTensors) and reduce-scattered among its holders.
    tp_mesh = layout.mesh["tp"]  # Megatron's plan in every layer, then embedding, norms, lm_head
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, tensor_parallel.layer_plan(args.sequence_parallel))
    tensor_parallel.apply_tensor_parallel(model, tp_mesh, args.sequence_parallel)
    training.prepare_layers(model, args, loss=False)  # (the loss runs on vocabulary shards)
    # bf16: weights gathered in bf16, gradients reduced in fp32 into fp32 shards (else no casts).
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mp_policy = MixedPrecisionPolicy(**bf16 if settings.precision == "bf16" else {})
    # fsdp_mesh: None, FSDP over all ranks, or HSDP's (--replicate R: R replicas of a shard group).
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if args.cpu_offload else None
    options = dict(mesh=layout.fsdp_mesh, reshard_after_forward=args.zero_stage == 3)
    options |= dict(mp_policy=mp_policy) | ({"offload_policy": offload} if offload else {})
    # Layers first, then the root, which takes what no layer owns (embeddings, final norm,
    # lm_head). In place: `model`'s parameters are now DTensors, this rank's share of each.
    for layer in model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    model.to_empty(device="cpu" if offload else device)  # (offload: the shards in CPU memory)
    training.init_weights(model, config, args, device)
    model.register_forward_hook(tensor_parallel.local_outputs)  # (loss, tokens): plain tensors
    # Built on the shards, AdamW's state is sharded like them (in CPU memory with offload).
    optimizer = training.build_optimizer(model, args, "cpu" if offload else device.type)
    scheduler = training.build_scheduler(optimizer, args)
    scaler = torch.amp.GradScaler(device.type, enabled=settings.precision == "fp16")
    # What a checkpoint holds and a resume restores, with the step, RNG and data position.
    state = TrainingState(model, optimizer, scheduler, scaler, config, tokenizer)
    # dcp.load: each rank reads just its shards' pieces, however many ranks wrote them (lib/).
    start_step, data_position = checkpoints.resume(resume_path, state)
    # --micro-batch-size auto: the largest that fits, measured with the model as it trains.
    with loss_parallel():  # (the cross-entropy of vocabulary-sharded logits runs under it)
        settings = flags.measured(settings, args, model, attn_mask, optimizer, config, device)
    rows = settings.micro_batch_size  # sequences per forward pass, on each rank
    val_loader = training.ValidationShard(val_set, dp_rank, dp, rows, device)  # its share
    start, shard = (start_step, data_position), (dp_rank, dp)  # (for --streaming)
    batches = training.step_batches(
        args, settings, train_ds, epoch_order, rows, device, start, shard
    )

    def evaluate() -> torch.Tensor:
        # Each rank its dp group's share (every forward is a collective: all run it); sums added up.
        with loss_parallel():
            totals = training.evaluate(model, val_loader, device, settings, attn_mask)
        dist.all_reduce(totals, group=layout.dp_group)  # (loss sum, targets, their bytes)
        return totals

    def save(step: int) -> None:
        # A collective: every rank writes its own shards, and no rank gathers them (--async-save:
        # copies them to CPU memory, and a thread writes them as training goes on).
        with checkpoints.saving(step, state, training.data_positions(batches)) as (to_save, path):
            if args.async_save and not loop.stopping:  # (the run's last one is written at once)
                group = checkpoints.group  # (a gloo group of its own, for the background thread)
                checkpoints.job = dcp.async_save(to_save, checkpoint_id=path, process_group=group)
            else:
                dcp.save(to_save, checkpoint_id=path)

    # ---- training loop -------------------------------------------------------------------------
    describe = tensor_parallel.describe(layout)  # at start-up
    loop = TrainingLoop(args, settings, state, device, start_step, layout, describe)
    for step in loop:
        micro_batches = training.to_device(next(batches), device)
        # Normalise by the number of targets in the whole global batch, not per micro-batch: then
        # every target token weighs the same however the batch is split (micro-batches, ranks),
        # and padded batches give the same gradient as one big batch would.
        global_tokens = sum((y != IGNORE_INDEX).sum() for _, y in micro_batches)
        dist.all_reduce(global_tokens, group=layout.dp_group)
        step_loss = torch.zeros((), device=device)
        for i, (x, y) in enumerate(micro_batches):
            # Gradient accumulation: reduce-scatter only after the last micro-step; before it,
            # each layer accumulates its unsharded gradients locally (FSDP's no_sync).
            model.set_requires_gradient_sync(i == settings.accumulation - 1)
            with loss_parallel():  # (TP's shards are of this one loss: no factor for them)
                with training.autocast(device, settings.precision):
                    loss_sum, _ = model(x, y, attn_mask(x))
                # The reduce-scatter divides by dp, as DDP does; the factor dp undoes that.
                loss = loss_sum * layout.dp / global_tokens
                scaler.scale(loss).backward()
            step_loss += loss_sum.detach()
        # The global loss, on every rank (queued, no wait): all ranks take the same decisions.
        dist.all_reduce(step_loss, group=layout.dp_group)
        scaler.unscale_(optimizer)  # measure and clip the true gradients, not fp16-scaled ones
        if args.sequence_parallel:  # the norms' gradients are Partial sums: add them up first
            tensor_parallel.replicate_partial_grads(model.parameters())
        # The gradients are sharded DTensors: the norm sums their squares over the ranks, and
        # full_tensor() gives every rank that whole norm as a plain tensor.
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
        grad_norm = grad_norm.full_tensor()
        # Under fp16 an infinite gradient is the grad scaler's business (it skips that step).
        if loop.step_ok(step, step_loss, None if scaler.is_enabled() else grad_norm):
            scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # Log, evaluate, save and stop on a signal, each when it is due (lib/loop.py).
        loop.after_step(step, step_loss / global_tokens, grad_norm, evaluate, save)

    # ---- outputs -------------------------------------------------------------------------------
    # model.pt, written on rank 0 one tensor at a time from the checkpoint of the last step.
    checkpoints.finish(state, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    # A known failure ends in one line (lib/exits.py), and the process with os._exit once main()
    # is over: torch.distributed's C++ teardown can abort a finished run (exits.end_process).
    exits.run(main, os_exit=True)
