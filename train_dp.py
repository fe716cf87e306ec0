"""Pretrain a Llama in one process, with nn.DataParallel over every visible GPU.

    python train_dp.py                                  # all visible GPUs, or the CPU
    CUDA_VISIBLE_DEVICES=0,1 python train_dp.py         # choose the GPUs

The starting point of the suite. DataParallel is the simplest way to use several GPUs: one
process splits each batch across the GPUs, runs a copy of the model on each (in threads), and
gathers the results on GPU 0. The price is that GPU 0 does extra work for all of them, the
weights are copied to every GPU on every step, and Python's GIL serialises the threads; that is
why train_ddp.py (one process per GPU) is the recipe for real runs. Compare the two with
`diff train_dp.py train_ddp.py`.

Files: to run it, copy it with lib/replica.py and the library every lesson shares: lib/checkpoints.py,
lib/flags.py, data.py, lib/distributed.py, lib/metrics.py, model.py, lib/model_config.py, lib/exits.py, lib/training.py. A
module that only an optional feature needs (--streaming, --plan, another --data, ...) is imported
where that feature is used.
"""

import math

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Subset
from tqdm import tqdm

from lib import checkpoints, exits, flags, training
from lib.metrics import Metrics, NonFiniteGuard, Throughput, bar_postfix, router_figures
from lib.replica import Replica
from model import IGNORE_INDEX


def main():
    parser = flags.build_parser("Pretrain a Llama in one process with nn.DataParallel.")
    args = parser.parse_args()
    num_gpus = torch.cuda.device_count()
    device = torch.device("cuda", 0) if num_gpus else torch.device("cpu")
    devices = max(num_gpus, 1)  # how many devices share each batch
    run = flags.run_settings(parser, args, devices, device, replicas=devices)  # micro-batch, ...
    if args.check:  # every flag passed: stop before any work (run_ddp.sh checks this way first)
        print(f"{parser.prog}: the flags are fine (--check: nothing was run)")
        return
    resume_path = checkpoints.prepare_out_dir(args)

    # ---- data ----------------------------------------------------------------------------------
    train_ds, val_ds, tokenizer = training.build_datasets(args, run.tokenizer)
    steps_per_epoch = training.steps_per_epoch(train_ds, args)
    attn_mask = training.attention_masks(args, run, tokenizer)  # mask(x): None unless asked

    def order_for_epoch(epoch: int) -> list[int]:
        # A new shuffle each epoch, seeded by seed + epoch: a resumed run draws the same order,
        # and so does train_ddp.py's DistributedSampler, over all of its ranks together.
        generator = torch.Generator().manual_seed(args.seed + epoch)
        return torch.randperm(len(train_ds), generator=generator).tolist()

    val_set = Subset(val_ds, range(min(len(val_ds), args.eval_batches * args.batch_size)))

    # ---- model, optimizer, resume --------------------------------------------------------------
    model, config = training.build_model(args, run.model, tokenizer.get_vocab_size())
    model.to(device)
    optimizer = training.build_optimizer(model, args, device.type)
    scheduler = training.build_scheduler(optimizer, args)
    scaler = torch.amp.GradScaler(device.type, enabled=run.precision == "fp16")
    start_step, data_position = 0, None  # data_position: where the stream is (--streaming)
    if resume_path:
        ckpt = checkpoints.load_checkpoint(resume_path)
        start_step, data_position = checkpoints.restore_checkpoint(
            ckpt, model, optimizer, scheduler, scaler, config, args, tokenizer
        )
        print(f"resumed from {resume_path} at step {start_step}")
    if args.activation_checkpointing:
        training.apply_activation_checkpointing(model)
    if args.compile:
        training.compile_layers(model)
    # On CPU or a single GPU, DataParallel simply calls the module: the same code runs everywhere.
    # DataParallel sums each replica's gradients into the original model's, on GPU 0.
    dp_model = nn.DataParallel(Replica(model, device, run.precision))
    if args.micro_batch_size == "auto":  # measure the largest that fits, with the wrapped model
        from lib.auto_batch import auto_micro_batch_size  # only for --micro-batch-size auto

        run = auto_micro_batch_size(
            args, run, dp_model, attn_mask, optimizer, config.vocab_size, device, devices
        )
    # One forward pass takes micro-batch x devices sequences; DataParallel splits them.
    val_loader = DataLoader(val_set, batch_size=run.micro_batch_size * devices)
    batches = training.step_batches(
        train_ds, order_for_epoch, run.micro_batch_size * devices, run.accumulation,
        steps_per_epoch, start_step, args.num_workers, pin_memory=device.type == "cuda",
        data_position=data_position,  # --streaming: where to go on reading it
    )  # fmt: skip
    metrics = Metrics(args.out_dir, True, start_step, args.tensorboard)
    print(flags.describe_run(args, run, config, device))
    checkpoints.record_run(args, run, start_step)  # OUT_DIR/args.jsonl: the settings
    if args.plan:  # tools/memory_plan.py's estimate (a tool: imported only for --plan)
        from lib import memory

        print(memory.estimate_for_run(args, run, config, devices))

    # ---- training loop -------------------------------------------------------------------------
    guard = NonFiniteGuard(device, skip=args.skip_nonfinite)
    throughput = Throughput(config, args, device, devices)  # tokens/s, MFU, ...
    stop_request = exits.StopRequest(device)  # Ctrl-C, SIGTERM: stop cleanly (see there)
    bar = tqdm(range(start_step, args.max_steps), initial=start_step, total=args.max_steps,
               desc="train")  # fmt: skip
    for step in bar:
        lr = optimizer.param_groups[0]["lr"]
        # Copy the whole step's micro-batches to the device first, asynchronously (from pinned
        # memory), and count their targets there: counting on the CPU and copying the count over
        # would make the CPU wait, every step, for the GPU to finish the step before.
        micro_batches = [
            (x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            for x, y in next(batches)
        ]
        # Normalise by the number of targets in the whole batch (all micro-batches), not per
        # micro-batch: then every target token weighs the same however the batch is split, and
        # padded batches give the same gradient as one big batch would.
        global_tokens = sum((y != IGNORE_INDEX).sum() for _, y in micro_batches)
        step_loss = torch.zeros((), device=device)
        for x, y in micro_batches:
            # One loss sum per replica: a vector of length `devices`, gathered on GPU 0.
            loss_sum, _ = dp_model(x, y, attn_mask(x))
            loss_sum = loss_sum.sum()
            loss = loss_sum / global_tokens
            scaler.scale(loss).backward()
            step_loss += loss_sum.detach()
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
        # After Ctrl-C or SIGTERM, the run stops after this step, with a checkpoint there.
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
            # A mixture of experts' routing since the last log; {} for a dense model.
            metrics.log(step=done, loss=loss, lr=lr, **figures, grad_norm=grad_norm.item(),
                        **router_figures(model))  # fmt: skip
        if do_eval:
            val_sum, val_tokens = training.evaluate(
                dp_model, val_loader, device, run.precision, attn_mask
            )
            val_loss = (val_sum / val_tokens).item()
            metrics.log_validation(done, val_loss)  # printed on rank 0 too
            throughput.restart()  # keep evaluation time out of the tokens/s figure
        if do_save:
            data_position = training.data_positions(batches)  # --streaming: where it is
            checkpoints.save_checkpoint(
                args, done, model, optimizer, scheduler, scaler, config, tokenizer, data_position,
            )  # fmt: skip
            throughput.restart()
        if stop:
            raise exits.Stopped(done, stop_request.signal)  # exits.run says so and exits

    # ---- outputs -------------------------------------------------------------------------------
    # model, not dp_model: the plain weights, with no `module.model.` prefix on every name.
    training.finish_run(args, model, config, tokenizer, device)


if __name__ == "__main__":
    exits.run(main)
