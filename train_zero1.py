"""Pretrain a Llama with torchrun + DDP + ZeRO-1: AdamW's state sharded over the ranks.

    torchrun --standalone --nproc_per_node=8 train_zero1.py  # 8 GPUs; no GPU: 8 CPU processes
    SCRIPT=train_zero1.py ./run_ddp.sh                       # restarts, several nodes, Slurm

What this adds to train_ddp.py: ZeRO-1 (Rajbhandari et al. 2019) keeps AdamW's two moments, twice
the fp32 weights, once over all ranks instead of on each: ZeroRedundancyOptimizer updates 1/N of
the parameters on each rank, then broadcasts them. DDP still all-reduces the gradients, so the
results are train_ddp.py's. Saving gathers the optimizer state on rank 0 first (a collective).

Read it top to bottom: the flags, the data, the model, the training loop, the outputs. What
every lesson does alike is in lib/ (around each step, when to log, evaluate, save and stop:
lib/loop.py); what this lesson teaches is here. To run it elsewhere, copy it with model.py,
data.py, masks.py and the lib/ folder.
Read it against the lesson before: `diff train_ddp.py train_zero1.py`.
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from lib import distributed, exits, flags, training
from lib.checkpoints.one_file import Checkpoints, TrainingState
from lib.loop import TrainingLoop
from model import IGNORE_INDEX


def main():
    parser = flags.build_parser("Pretrain a Llama with torchrun + DDP + ZeRO-1.", distributed=True)
    args = parser.parse_args()
    # torchrun starts N copies of this script, each with its RANK, LOCAL_RANK (its index on its
    # own machine) and WORLD_SIZE in the environment; each computes on the GPU of its local rank.
    rank, local_rank, world_size, device = distributed.torchrun_rank()
    # Join the process group: each rank waits here until all world_size have joined; from then on
    # the collectives (all_reduce, broadcast, ...) run among them: nccl between GPUs, gloo on CPU.
    if not args.check:  # (--check: one process checks the flags, with no group)
        options = distributed.group_options(args, device)  # backend, store (torchrun's), GPU
        dist.init_process_group(rank=rank, world_size=world_size, **options)
    settings = flags.run_settings(parser, args, world_size, device)  # checked
    dp, dp_rank = world_size, rank  # data-parallel: every rank reads its share of the batch
    if flags.check_only(parser, args):  # --check: every flag passed; nothing is run
        return
    checkpoints = Checkpoints(args)  # the whole model in one .pt file, written by rank 0
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
    training.prepare_layers(model, args)  # --activation-checkpointing, --compile
    model.to_empty(device=device)
    training.init_weights(model, config, args, device)
    optimizer = training.build_optimizer(model, args, device.type)
    # ZeRO-1: the same AdamW, but each rank keeps the moments of ~1/N of the parameters and
    # updates only those; step() then broadcasts each rank's updated parameters to the others.
    # (AdamW allocates its state at its first step: the one above cost nothing.)
    optimizer = ZeroRedundancyOptimizer(optimizer.param_groups, optimizer_class=type(optimizer))
    scheduler = training.build_scheduler(optimizer, args)
    scaler = torch.amp.GradScaler(device.type, enabled=settings.precision == "fp16")
    # What a checkpoint holds and a resume restores, with the step, RNG and data position.
    state = TrainingState(model, optimizer, scheduler, scaler, config, tokenizer)
    start_step, data_position = checkpoints.resume(resume_path, state)
    # DDP broadcasts rank 0's weights to every rank here, then all-reduces gradients in buckets
    # while backward runs; no buffers re-sent before each forward (the RoPE tables are constants).
    device_ids = [local_rank] if device.type == "cuda" else None
    ddp_model = DDP(model, device_ids=device_ids, **distributed.NO_FORWARD_BUFFER_SYNC)
    # --micro-batch-size auto: the largest that fits, measured with the model as it trains.
    settings = flags.measured(settings, args, ddp_model, attn_mask, optimizer, config, device)
    rows = settings.micro_batch_size  # sequences per forward pass, on each rank
    val_loader = training.ValidationShard(val_set, dp_rank, dp, rows, device)  # its share
    start, shard = (start_step, data_position), (dp_rank, dp)  # (for --streaming)
    batches = training.step_batches(
        args, settings, train_ds, epoch_order, rows, device, start, shard
    )

    def evaluate() -> torch.Tensor:
        # Each rank its share, with the unwrapped model (no DDP hooks); the sums added up.
        totals = training.evaluate(model, val_loader, device, settings, attn_mask)
        dist.all_reduce(totals)  # (loss sum, targets, their bytes)
        return totals

    def save(step: int) -> None:
        # A collective: every rank sends rank 0 its shard of the optimizer state, so the
        # checkpoint holds the whole state, as train_ddp.py's does (any world size resumes it).
        optimizer.consolidate_state_dict(to=0)
        checkpoints.save(step, state, training.data_positions(batches))

    # ---- training loop -------------------------------------------------------------------------
    loop = TrainingLoop(args, settings, state, device, start_step)
    for step in loop:
        micro_batches = training.to_device(next(batches), device)
        # Normalise by the number of targets in the whole global batch, not per micro-batch: then
        # every target token weighs the same however the batch is split (micro-batches, ranks),
        # and padded batches give the same gradient as one big batch would.
        global_tokens = sum((y != IGNORE_INDEX).sum() for _, y in micro_batches)
        dist.all_reduce(global_tokens)
        step_loss = torch.zeros((), device=device)
        for i, (x, y) in enumerate(micro_batches):
            # Gradient accumulation: all-reduce only after the last micro-step. no_sync() must
            # wrap the forward as well as the backward: DDP prepares its reduction in forward.
            sync = i == settings.accumulation - 1
            with nullcontext() if sync else ddp_model.no_sync():
                with training.autocast(device, settings.precision):
                    loss_sum, _ = ddp_model(x, y, attn_mask(x))
                # DDP divides the summed gradients by world_size; the factor world_size undoes that.
                loss = loss_sum * world_size / global_tokens
                scaler.scale(loss).backward()
            step_loss += loss_sum.detach()
        dist.all_reduce(step_loss)  # the global loss on every rank (queued): the same decisions
        scaler.unscale_(optimizer)  # measure and clip the true gradients, not fp16-scaled ones
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
        # Under fp16 an infinite gradient is the grad scaler's business (it skips that step).
        if loop.step_ok(step, step_loss, None if scaler.is_enabled() else grad_norm):
            scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # Log, evaluate, save and stop on a signal, each when it is due (lib/loop.py).
        loop.after_step(step, step_loss / global_tokens, grad_norm, evaluate, save)

    # ---- outputs -------------------------------------------------------------------------------
    # model.pt and the final sample: from `model` itself, whose names have no wrapper's prefix.
    checkpoints.finish(state, device)
    del ddp_model  # its reducer holds the group: freed first (a hang at exit, pytorch#56297)
    dist.destroy_process_group()


if __name__ == "__main__":
    # A known failure ends in one line (lib/exits.py), and the process with os._exit once main()
    # is over: torch.distributed's C++ teardown can abort a finished run (exits.end_process).
    exits.run(main, os_exit=True)
