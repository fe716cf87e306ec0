"""Pretrain a Llama with torchrun + DDP + ZeRO-1: AdamW's state sharded over the ranks.

    torchrun --standalone --nproc_per_node=8 train_zero1.py        # 8 GPUs on one machine
    torchrun --standalone --nproc_per_node=2 train_zero1.py        # no GPU: 2 CPU processes, gloo
    SCRIPT=train_zero1.py ./run_ddp.sh                             # with restarts; several nodes

Under DDP every rank keeps a full copy of everything: weights, gradients and AdamW's two moments,
which in fp32 are twice the weights. ZeRO-1 (stage 1 of Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models") keeps each moment on one rank only.
What this changes in train_ddp.py (`diff train_ddp.py train_zero1.py` shows exactly this):
  1. The optimizer is torch.distributed.optim.ZeroRedundancyOptimizer around the same AdamW:
     each rank holds the moments of ~1/N of the parameters and updates only those; step() then
     broadcasts each rank's updated parameters to the others. Gradients are still all-reduced by
     DDP, so everything before optimizer.step() is unchanged, and so are the results.
  2. Saving is a collective: consolidate_state_dict(to=0) gathers every rank's shard of the
     optimizer state on rank 0 first, so the checkpoint holds the full state, as train_ddp.py's
     does: checkpoints resume in train_dp.py, train_ddp.py and here, at any world size.
Per-GPU memory for AdamW in fp32: 16 bytes per parameter under DDP, 8 + 8/N here (weights and
gradients stay replicated; train_fsdp.py shards those too). `python -m tools.memory_plan` compares.

Files: to run it, copy it with the library every lesson shares: lib/checkpoints.py, lib/flags.py, data.py,
lib/distributed.py, lib/metrics.py, model.py, lib/model_config.py, lib/exits.py, lib/training.py. A module that only
an optional feature needs (--streaming, --plan, another --data, ...) is imported where that feature
is used. Its neighbour is train_ddp.py: `diff train_ddp.py train_zero1.py`.
"""

import math
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, Subset
from tqdm import tqdm

from lib import checkpoints, distributed, exits, flags, training
from lib.metrics import Metrics, NonFiniteGuard, Throughput, bar_postfix, router_figures
from model import IGNORE_INDEX


def main():
    parser = flags.build_parser("Pretrain a Llama with torchrun + DDP + ZeRO-1.", distributed=True)
    args = parser.parse_args()
    rank, local_rank, world_size, device = distributed.torchrun_rank()  # as in train_ddp.py
    if not args.check:  # the process group, as in train_ddp.py
        dist.init_process_group(
            distributed.backend_for(args.backend, device), store=distributed.rendezvous_store(),
            rank=rank, world_size=world_size, device_id=device if device.type == "cuda" else None,
        )  # fmt: skip
    is_main = rank == 0  # global rank 0 alone prints, writes files and shows the progress bar
    run = flags.run_settings(parser, args, world_size, device)  # micro-batch, accumulation, ...
    if args.check:  # every flag passed: stop before any work (run_ddp.sh checks this way first)
        print(f"{parser.prog}: the flags are fine (--check: nothing was run)")
        return
    resume_path = distributed.from_rank0(lambda: checkpoints.prepare_out_dir(args), is_main)

    # ---- data ----------------------------------------------------------------------------------
    train_ds, val_ds, tokenizer = training.build_datasets(args, run.tokenizer)
    steps_per_epoch = training.steps_per_epoch(train_ds, args)
    attn_mask = training.attention_masks(args, run, tokenizer)  # mask(x): None unless asked

    # Each rank reads every world_size-th sample of one shared shuffle. Over the ranks, step s
    # covers exactly samples [s*B, (s+1)*B) of that shuffle: the same global batch that
    # train_dp.py draws, whatever the number of ranks.
    # (--streaming: never called; step_batches reads this rank's shard of the stream instead.)
    def order_for_epoch(epoch: int) -> list[int]:
        sampler = DistributedSampler(train_ds, world_size, rank, shuffle=True, seed=args.seed)
        # set_epoch reseeds the shuffle with seed + epoch: without it every epoch would repeat the
        # first one's order. All ranks pass the same epoch, so their shards stay disjoint.
        sampler.set_epoch(epoch)
        return list(sampler)

    val_set = Subset(val_ds, range(min(len(val_ds), args.eval_batches * args.batch_size)))

    # ---- model, optimizer, resume --------------------------------------------------------------
    model, config = training.build_model(args, run.model, tokenizer.get_vocab_size())
    model.to(device)
    optimizer = training.build_optimizer(model, args, device.type)
    # ZeRO-1: the same AdamW, but each rank keeps the moments of only ~1/N of the parameters and
    # updates only those; step() then broadcasts each rank's updated parameters to the others.
    # AdamW allocates its state lazily, so the one built above cost nothing: its groups carry
    # every setting (weight decay, betas, eps, fused) into each rank's local AdamW.
    optimizer = ZeroRedundancyOptimizer(
        optimizer.param_groups, optimizer_class=torch.optim.AdamW, lr=args.lr
    )
    scheduler = training.build_scheduler(optimizer, args)
    scaler = torch.amp.GradScaler(device.type, enabled=run.precision == "fp16")
    start_step, data_position = 0, None  # data_position: where the stream is (--streaming)
    if resume_path:  # every rank loads the same file: the one rank 0 chose
        ckpt = checkpoints.load_checkpoint(resume_path)
        start_step, data_position = checkpoints.restore_checkpoint(
            ckpt, model, optimizer, scheduler, scaler, config, args, tokenizer
        )
        if is_main:
            print(f"resumed from {resume_path} at step {start_step}")
    if args.activation_checkpointing:
        training.apply_activation_checkpointing(model)
    if args.compile:
        training.compile_layers(model)
    # DDP broadcasts rank 0's weights to every rank here, then all-reduces gradients in buckets
    # while backward is still running. forward_sync_buffers=False: the only buffers (RoPE tables)
    # are constants, so re-broadcasting them before every forward would be wasted traffic
    # (lib/distributed.py: torch before 2.13 calls it broadcast_buffers=False).
    device_ids = [local_rank] if device.type == "cuda" else None
    ddp_model = DDP(model, device_ids=device_ids, **distributed.NO_FORWARD_BUFFER_SYNC)
    if args.micro_batch_size == "auto":  # measure the largest that fits, with the wrapped model
        from lib.auto_batch import auto_micro_batch_size  # only for --micro-batch-size auto

        run = auto_micro_batch_size(
            args, run, ddp_model, attn_mask, optimizer, config.vocab_size, device
        )
    # Every world_size-th validation sample, nothing dropped or repeated, and the same number of
    # batches on every rank (training.ValidationShard): the summed loss is the whole set's.
    val_loader = training.ValidationShard(val_set, rank, world_size, run.micro_batch_size)
    batches = training.step_batches(
        train_ds, order_for_epoch, run.micro_batch_size, run.accumulation,
        steps_per_epoch, start_step, args.num_workers, pin_memory=device.type == "cuda",
        shard=(rank, world_size),  # --streaming: this rank's shard of the stream
        data_position=data_position,  # --streaming: where to go on reading it
    )  # fmt: skip
    metrics = Metrics(args.out_dir, is_main, start_step, args.tensorboard)
    if is_main:
        print(flags.describe_run(args, run, config, device))
        checkpoints.record_run(args, run, start_step)  # OUT_DIR/args.jsonl: the settings
        if args.plan:  # tools/memory_plan.py's estimate (a tool: imported only for --plan)
            from lib import memory

            print(memory.estimate_for_run(args, run, config, world_size))

    # ---- training loop -------------------------------------------------------------------------
    guard = NonFiniteGuard(device, skip=args.skip_nonfinite)
    throughput = Throughput(config, args, device, world_size)  # tokens/s, MFU, ...
    stop_request = exits.StopRequest(device)  # Ctrl-C, SIGTERM: stop cleanly (see there)
    bar = tqdm(range(start_step, args.max_steps), initial=start_step, total=args.max_steps,
               desc="train", disable=not is_main)  # fmt: skip
    for step in bar:
        lr = optimizer.param_groups[0]["lr"]
        # Copy the whole step's micro-batches to the device first, asynchronously (from pinned
        # memory), and count their targets there: counting on the CPU and copying the count over
        # would make the CPU wait, every step, for the GPU to finish the step before.
        micro_batches = [
            (x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            for x, y in next(batches)
        ]
        # Normalise by the number of targets in the whole global batch (all micro-batches, all
        # ranks), not per micro-batch: then every target token weighs the same however the batch
        # is split, and padded batches give the same gradient as one big batch would.
        global_tokens = sum((y != IGNORE_INDEX).sum() for _, y in micro_batches)
        dist.all_reduce(global_tokens)
        step_loss = torch.zeros((), device=device)
        for i, (x, y) in enumerate(micro_batches):
            # Gradient accumulation: all-reduce only after the last micro-step. no_sync() must
            # wrap the forward as well as the backward: DDP prepares its reduction in forward.
            sync = i == run.accumulation - 1
            with nullcontext() if sync else ddp_model.no_sync():
                with training.autocast(device, run.precision):
                    loss_sum, _ = ddp_model(x, y, attn_mask(x))
                # DDP averages gradients over ranks (sums, then divides by world_size); the
                # factor world_size undoes that division, leaving sum of all losses / all tokens.
                loss = loss_sum * world_size / global_tokens
                scaler.scale(loss).backward()
            step_loss += loss_sum.detach()
        # The global loss, on every rank (no wait for it here: the all-reduce is queued like any
        # other kernel). Every rank then takes the same decisions about it below.
        dist.all_reduce(step_loss)
        scaler.unscale_(optimizer)  # measure and clip the true gradients, not fp16-scaled ones
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), args.grad_clip if args.grad_clip > 0 else math.inf
        )
        # Under fp16 an infinite gradient is the grad scaler's business (it skips that step).
        if guard.step_ok(step + 1, step_loss, None if scaler.is_enabled() else grad_norm):
            scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        throughput.step()
        done = step + 1
        last = done == args.max_steps
        # After Ctrl-C or SIGTERM, every rank stops after the same step, with a checkpoint there.
        stop = stop_request.all_reduce() and not last
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
            bar.set_postfix(bar_postfix(loss, lr, figures))
            # A mixture of experts' routing, summed over the ranks: a collective, on every rank.
            metrics.log(step=done, loss=loss, lr=lr, **figures, grad_norm=grad_norm.item(),
                        **router_figures(model))  # fmt: skip
        if do_eval:
            # Every rank evaluates its own shard with the unwrapped model (no DDP hooks run),
            # then the sums are added up: the result is the loss over the whole validation set.
            val_sum, val_tokens = training.evaluate(
                model, val_loader, device, run.precision, attn_mask
            )
            dist.all_reduce(val_sum)
            dist.all_reduce(val_tokens)
            val_loss = (val_sum / val_tokens).item()
            metrics.log_validation(done, val_loss)  # printed on rank 0 too
            throughput.restart()  # keep evaluation time out of the tokens/s figure
        if do_save:
            # A collective: every rank sends its shard of the optimizer state to rank 0, so it
            # is called here by all ranks, never inside the rank-0-only branch below. The
            # checkpoint then holds the full, unsharded state: any world size loads it.
            optimizer.consolidate_state_dict(to=0)
            data_position = training.data_positions(batches)  # --streaming; a collective
            # Rank 0 builds and writes it (no collective in there: the other ranks do not run it),
            # and every rank learns whether it could: if not (a full disk), all stop with its
            # message, instead of the others failing in the next collective.
            distributed.from_rank0(
                checkpoints.save_checkpoint, is_main,
                args, done, model, optimizer, scheduler, scaler, config, tokenizer, data_position,
            )  # fmt: skip
            throughput.restart()
        if stop:
            raise exits.Stopped(done, stop_request.signal)  # exits.run says so and exits

    # ---- outputs -------------------------------------------------------------------------------
    if is_main:
        # model, not ddp_model: the plain weights, with no `module.` prefix on every name.
        training.finish_run(args, model, config, tokenizer, device)
    stop_request.finish()  # no collective of it left in flight when the process group goes
    dist.barrier()  # the run is over when rank 0's files are written, for every rank
    # Release DDP's reducer (it holds the process group from C++) while the group still exists:
    # were the group destroyed by it at exit, gloo's destructor would wait for its worker
    # threads while holding the GIL, and a worker freeing a tensor needs the GIL (an occasional
    # hang at exit, seen with train_zero1.py's many async broadcasts; pytorch/pytorch#56297).
    del ddp_model
    dist.destroy_process_group()


if __name__ == "__main__":
    # A known failure ends in one line; the process ends with os._exit once main() is over
    # (exits.end_process: torch.distributed's C++ teardown can abort a finished run).
    exits.run(main, os_exit=True)
