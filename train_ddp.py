"""Pretrain a Llama with torchrun + DistributedDataParallel: one process per GPU.

    torchrun --standalone --nproc_per_node=4 train_ddp.py          # 4 GPUs on one machine
    torchrun --standalone --nproc_per_node=2 train_ddp.py          # no GPU: 2 CPU processes, gloo
    python train_ddp.py                                            # a single process (world size 1)
    ./run_ddp.sh                                                   # the same, with restarts; and
                                                                   # several nodes (see README)

What this adds to train_dp.py (`diff train_dp.py train_ddp.py` shows exactly this):
  1. setup_distributed(): torchrun starts N copies of this script and tells each its RANK,
     LOCAL_RANK and WORLD_SIZE; each joins the process group and takes the GPU of its local rank.
  2. A DistributedSampler gives each rank its own 1/N of every global batch; set_epoch reshuffles.
  3. DDP wraps the model and all-reduces (averages) gradients during backward; no_sync() skips
     that on all but the last micro-step of gradient accumulation.
  4. Losses and evaluation sums are all-reduced, so logs show the global batch, not one rank's.
  5. Only global rank 0 writes files; every collective is called by every rank.
"""

import math
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from tqdm import tqdm

import common
import memory_plan
from model import IGNORE_INDEX


def setup_distributed(backend: str | None) -> tuple[int, int, int, torch.device]:
    """Join the process group torchrun set up; returns (rank, local_rank, world_size, device).

    The device comes from the *local* rank (the process's index on its own machine), so the same
    code runs on one node or many. Run without torchrun, this is a group of one process.
    """
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # Set without RANK by run_ddp.sh's --check: one process checks the flags for that many.
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
                f"launch at most that many processes per node (--nproc_per_node)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # NCCL moves CUDA tensors between GPUs directly; gloo works on CPU tensors.
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("--backend nccl needs CUDA GPUs; use --backend gloo on CPU")
    if "RANK" in os.environ:
        # torchrun's env:// rendezvous: MASTER_ADDR/PORT are set by torchrun, never hard-coded.
        # After torchrun restarts the group (--max-restarts), that store can still hold the last
        # attempt's addresses, and a new worker may connect to its dead predecessor (seen with
        # torch 2.13 and gloo). A key prefix per attempt keeps the attempts apart.
        store, _, _ = next(dist.rendezvous("env://"))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend, store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank,
            world_size=world_size, device_id=device if device.type == "cuda" else None,
        )  # fmt: skip
    else:
        # Plain `python train_ddp.py`: a group of one, kept in memory, so the code below is the
        # same at every world size.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return rank, local_rank, world_size, device


def from_rank0(fn, is_main: bool, *args):
    """Run fn(*args) on global rank 0 alone; every rank gets its result, or raises its error
    (a ValueError or common.TrainingError).

    For the work only the writing rank may do (creating --out-dir, choosing the checkpoint to
    resume from, saving one): without this broadcast, the other ranks would learn of a failure
    on rank 0 only by waiting forever in the next collective (or failing in it), and each might
    choose a different checkpoint.
    """
    box = [None, None]  # [result, error]
    if is_main:
        try:
            box[0] = fn(*args)
        except (ValueError, common.TrainingError) as e:
            box[1] = e
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise box[1]
    return box[0]


def main():
    parser = common.build_parser("Pretrain a Llama with torchrun + DistributedDataParallel.")
    parser.add_argument(
        "--backend",
        choices=["nccl", "gloo"],
        default=None,
        help="process group backend (default: nccl on GPU, gloo on CPU)",
    )
    parser.add_argument(
        "--zero1",
        action="store_true",
        help="ZeRO-1: shard AdamW's state over the ranks (ZeroRedundancyOptimizer); "
        "weights and gradients stay replicated as in DDP",
    )
    args = parser.parse_args()
    rank, local_rank, world_size, device = setup_distributed(args.backend)
    is_main = rank == 0  # global rank 0 alone prints, writes files and shows the progress bar
    accumulation = common.check_args(parser, args, devices=world_size)
    precision = common.resolve_precision(args.precision, device)
    args.attention = common.resolve_attention(args, device)
    if args.check:  # every flag passed: stop before any work (run_ddp.sh checks this way first)
        print(f"{parser.prog}: the flags are fine (--check: nothing was run)")
        return
    resume_path = from_rank0(lambda: common.prepare_out_dir(args), is_main)

    # ---- data ----------------------------------------------------------------------------------
    train_ds, val_ds, tokenizer = common.build_datasets(args)
    steps_per_epoch = common.steps_per_epoch(train_ds, args)
    # Each rank reads every world_size-th sample of one shared shuffle. Over the ranks, step s
    # covers exactly samples [s*B, (s+1)*B) of that shuffle: the same global batch that
    # train_dp.py draws, whatever the number of ranks.
    sampler = DistributedSampler(train_ds, world_size, rank, shuffle=True, seed=args.seed)

    def order_for_epoch(epoch: int) -> list[int]:
        # set_epoch reseeds the shuffle with seed + epoch: without it every epoch would repeat the
        # first one's order. All ranks pass the same epoch, so their shards stay disjoint.
        sampler.set_epoch(epoch)
        return list(sampler)

    val_set = Subset(val_ds, range(min(len(val_ds), args.eval_batches * args.batch_size)))
    # Every world_size-th validation sample, nothing dropped or repeated (a DistributedSampler
    # would pad or drop to even out the shards): the summed loss is that of the whole set.
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))

    # ---- model, optimizer, resume --------------------------------------------------------------
    model, config = common.build_model(args, tokenizer.get_vocab_size())
    model.to(device)
    optimizer = common.build_optimizer(model, args, device.type)
    if args.zero1:
        # ZeRO-1 (stage 1 of Rajbhandari et al.): the same AdamW, but each rank keeps the moments
        # of only ~1/N of the parameters and updates only those; step() then broadcasts each
        # rank's updated parameters to the others. Gradients are still all-reduced by DDP, so
        # everything up to optimizer.step() is unchanged. AdamW allocates its state lazily, so
        # the one built above cost nothing: its groups carry every setting (weight decay, betas,
        # eps, fused) into each rank's local AdamW.
        optimizer = ZeroRedundancyOptimizer(
            optimizer.param_groups, optimizer_class=torch.optim.AdamW, lr=args.lr
        )
    scheduler = common.build_scheduler(optimizer, args)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    start_step = 0
    if resume_path:  # every rank loads the same file: the one rank 0 chose
        ckpt = common.load_checkpoint(resume_path)
        start_step = common.restore_checkpoint(
            ckpt, model, optimizer, scheduler, scaler, config, args, tokenizer
        )
        if is_main:
            print(f"resumed from {resume_path} at step {start_step}")
    if args.activation_checkpointing:
        common.apply_activation_checkpointing(model)
    if args.compile:
        common.compile_layers(model)
    # DDP broadcasts rank 0's weights to every rank here, then all-reduces gradients in buckets
    # while backward is still running. forward_sync_buffers=False: the only buffers (RoPE tables)
    # are constants, so re-broadcasting them before every forward would be wasted traffic.
    ddp_model = DDP(
        model,
        device_ids=[local_rank] if device.type == "cuda" else None,
        forward_sync_buffers=False,
    )
    if args.micro_batch_size == "auto":  # measure the largest that fits, with the wrapped model
        accumulation = common.auto_micro_batch_size(
            args, ddp_model, tokenizer, optimizer, device, precision, world_size
        )
    val_loader = DataLoader(val_shard, batch_size=args.micro_batch_size)
    if is_main:
        print(common.describe_run(args, config, accumulation, world_size, device, precision))
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
    bar = tqdm(
        range(start_step, args.max_steps),
        initial=start_step,
        total=args.max_steps,
        disable=not is_main,
        desc="train",
    )
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
            sync = i == accumulation - 1
            with nullcontext() if sync else ddp_model.no_sync():
                with common.autocast(device, precision):
                    loss_sum, _ = ddp_model(x, y, common.build_attn_mask(x, args, tokenizer))
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
            # Every rank evaluates its own shard with the unwrapped model (no DDP hooks run),
            # then the sums are added up: the result is the loss over the whole validation set.
            val_sum, val_tokens = common.evaluate(
                model, val_loader, device, precision, args, tokenizer
            )
            dist.all_reduce(val_sum)
            dist.all_reduce(val_tokens)
            val_loss = (val_sum / val_tokens).item()
            metrics.log_validation(done, val_loss)  # printed on rank 0 too
            throughput.restart()  # keep evaluation time out of the tokens/s figure
        if do_save:
            if args.zero1:
                # A collective: every rank sends its shard of the optimizer state to rank 0, so
                # it is called here by all ranks, never inside the rank-0-only branch below.
                # The checkpoint then holds the full, unsharded state: any world size loads it.
                optimizer.consolidate_state_dict(to=0)
            state = None
            if is_main:  # no collective in here: the other ranks are not in this branch
                state = common.checkpoint_state(
                    model, optimizer, scheduler, scaler, done, config, args, tokenizer
                )
            # Rank 0 writes it, and every rank learns whether it could: if not (a full disk),
            # all stop with its message, instead of the others failing in the next collective.
            from_rank0(
                common.save_checkpoint, is_main, args.out_dir, done, state, args.keep_checkpoints
            )
            throughput.restart()
        if stop:
            raise common.Stopped(done, stop_request.signal)  # common.run says so and exits

    # ---- outputs -------------------------------------------------------------------------------
    if is_main:
        # model, not ddp_model: the plain weights, with no `module.` prefix on every name.
        common.finish_run(args, model, config, tokenizer, device)
    dist.barrier()  # the run is over when rank 0's files are written, for every rank
    # Release DDP's reducer (it holds the process group from C++) while the group still exists:
    # were the group destroyed by it at exit, gloo's destructor would wait for its worker
    # threads while holding the GIL, and a worker freeing a tensor needs the GIL (an occasional
    # hang at exit, seen with --zero1's many async broadcasts; pytorch/pytorch#56297).
    del ddp_model
    dist.destroy_process_group()


if __name__ == "__main__":
    common.run(main)
