"""Pretrain a Llama with torchrun + context parallelism: every sequence split over cp ranks.

    torchrun --standalone --nproc_per_node=8 train_cp.py --model 1b --cp 8 --seq-length 4096
    torchrun --standalone --nproc_per_node=8 train_cp.py --cp 2  # 2D: dp 4 x cp 2, GPUs or CPUs

What this adds to train_fsdp.py: for sequences too long for one GPU's activations, the cp ranks of
a group split every sequence, each running its T / cp tokens through every layer: the zigzag slice
(rank r keeps chunks r and 2cp-1-r of 2cp: the same causal work on every rank); in every layer they
all-gather the keys and values of the whole sequence for their queries. FSDP shards over all ranks:
to it the cp ranks are data-parallel like the others. docs/context-parallel.md: why an all-gather
(Llama 3's choice), not a ring; the memory; the cost.

Read it top to bottom: the flags, the data, the model, the training loop, the outputs. What
every lesson does alike is in lib/ (around each step, when to log, evaluate, save and stop:
lib/loop.py); what this lesson teaches is here. To run it elsewhere, copy it with model.py,
data.py, masks.py and the lib/ folder.
Read it against the lesson before: `diff train_fsdp.py train_cp.py`.
"""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.data import DistributedSampler

from lib import distributed, exits, flags, training
from lib.checkpoints.sharded import Checkpoints, TrainingState
from lib.loop import TrainingLoop
from lib.parallel import context_parallel
from lib.parallel.context_parallel import ContextParallel, zigzag_slice
from masks import document_ids
from model import IGNORE_INDEX


def main():
    parser = flags.build_parser("Pretrain a Llama with torchrun + CP + FSDP2.", sharded=True)
    context_parallel.add_flags(parser)  # --cp, and FSDP's
    args = parser.parse_args()
    # torchrun starts N copies of this script, each with its RANK, LOCAL_RANK (its index on its
    # own machine) and WORLD_SIZE in the environment; each computes on the GPU of its local rank.
    rank, local_rank, world_size, device = distributed.torchrun_rank()
    # Join the process group: each rank waits here until all world_size have joined; from then on
    # the collectives (all_reduce, broadcast, ...) run among them: nccl between GPUs, gloo on CPU.
    if not args.check:  # (--check: one process checks the flags, with no group)
        options = distributed.group_options(args, device)  # backend, store (torchrun's), GPU
        dist.init_process_group(rank=rank, world_size=world_size, **options)
    # The grid: dp x cp ranks. Only the dp groups split the batch: a cp group shares its sequences.
    layout = context_parallel.setup(parser, args, world_size, device)  # checked; the meshes
    settings = flags.run_settings(parser, args, layout.dp, device, context_parallel=True)
    dp, dp_rank = layout.dp, layout.dp_rank  # the data-parallel groups, and which this rank is in
    if flags.check_only(parser, args):  # --check: every flag passed; nothing is run
        return
    checkpoints = Checkpoints(args)  # DCP: every rank writes its own shards
    resume_path = checkpoints.prepare_out_dir()

    # ---- data ----------------------------------------------------------------------------------
    train_ds, val_set, tokenizer = training.build_datasets(args, settings.tokenizer)

    # --document-mask: the document of each token of the whole sequences x (B, T), from which
    # each rank builds its own rows of the mask (never the (T, T) one); else None.
    def doc_ids(x: torch.Tensor) -> torch.Tensor | None:
        return document_ids(x, tokenizer.bot_id) if args.document_mask else None

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
    training.prepare_layers(model, args)  # --activation-checkpointing, --compile
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
    # cp_model(x, y, doc_ids(x)) takes whole sequences and runs this rank's zigzag slice of them
    # through `model` (lib/parallel/context_parallel.py); checkpoints and model.pt are `model`'s.
    cp_model = ContextParallel(model, layout.mesh["cp"])
    cp_rank = layout.mesh.get_local_rank("cp")  # (its slice of every sequence: zigzag_slice)
    # Built on the shards, AdamW's state is sharded like them (in CPU memory with offload).
    optimizer = training.build_optimizer(model, args, "cpu" if offload else device.type)
    scheduler = training.build_scheduler(optimizer, args)
    scaler = torch.amp.GradScaler(device.type, enabled=settings.precision == "fp16")
    # What a checkpoint holds and a resume restores, with the step, RNG and data position.
    state = TrainingState(model, optimizer, scheduler, scaler, config, tokenizer)
    # dcp.load: each rank reads just its shards' pieces, however many ranks wrote them (lib/).
    start_step, data_position = checkpoints.resume(resume_path, state)
    # --micro-batch-size auto: the largest that fits, measured with the model as it trains.
    settings = flags.measured(settings, args, cp_model, doc_ids, optimizer, config, device)
    rows = settings.micro_batch_size  # sequences per forward pass, on each rank
    val_loader = training.ValidationShard(val_set, dp_rank, dp, rows, device)  # its share
    start, shard = (start_step, data_position), (dp_rank, dp)  # (for --streaming)
    batches = training.step_batches(
        args, settings, train_ds, epoch_order, rows, device, start, shard
    )

    def evaluate() -> torch.Tensor:
        # Each rank its slice of its share (every forward gathers each layer: all run it); the
        # sums over all ranks: each target is in exactly one rank's slice.
        totals = training.evaluate(cp_model, val_loader, device, settings, doc_ids)
        dist.all_reduce(totals)  # (loss sum, targets, their bytes)
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
    describe = context_parallel.describe(layout)  # at start-up
    loop = TrainingLoop(args, settings, state, device, start_step, layout, describe)
    for step in loop:
        micro_batches = training.to_device(next(batches), device)
        # Normalise by the number of targets in the whole global batch, not per micro-batch: then
        # every target token weighs the same however the batch is split (micro-batches, ranks),
        # and padded batches give the same gradient as one big batch would.
        # Each target is in exactly one rank's slice: the slices' counts add up to the batch count.
        slices = [zigzag_slice(y, cp_rank, layout.cp) for _, y in micro_batches]
        global_tokens = sum((y != IGNORE_INDEX).sum() for y in slices)
        dist.all_reduce(global_tokens)
        step_loss = torch.zeros((), device=device)
        for i, (x, y) in enumerate(micro_batches):
            # Gradient accumulation: reduce-scatter only after the last micro-step; before it,
            # each layer accumulates its unsharded gradients locally (FSDP's no_sync).
            model.set_requires_gradient_sync(i == settings.accumulation - 1)
            with training.autocast(device, settings.precision):  # x, y: whole sequences
                loss_sum, _ = cp_model(x, y, doc_ids(x))  # the loss of this rank's slice of them
            # The reduce-scatter divides by world_size too, as DDP does; the factor undoes that.
            loss = loss_sum * world_size / global_tokens
            scaler.scale(loss).backward()
            step_loss += loss_sum.detach()
        dist.all_reduce(step_loss)  # the global loss on every rank (queued): the same decisions
        scaler.unscale_(optimizer)  # measure and clip the true gradients, not fp16-scaled ones
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
