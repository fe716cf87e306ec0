"""Pretrain a Llama in one process, with nn.DataParallel over every visible GPU.

    python train_dp.py                                  # all visible GPUs, or the CPU
    CUDA_VISIBLE_DEVICES=0,1 python train_dp.py         # choose the GPUs

The starting point: one process splits each batch over the GPUs and runs a copy of the model on
each, in threads; GPU 0 gathers the results and the gradients. On a CPU: one-process training.

Read it top to bottom: the flags, the data, the model, the training loop, the outputs. What
every lesson does alike is in lib/ (around each step, when to log, evaluate, save and stop:
lib/loop.py); what this lesson teaches is here. To run it elsewhere, copy it with model.py,
data.py, masks.py and the lib/ folder.
"""

import torch

from lib import exits, flags, training
from lib.checkpoints.one_file import Checkpoints, TrainingState
from lib.loop import TrainingLoop
from lib.parallel.replica import Replica
from model import IGNORE_INDEX


def main():
    parser = flags.build_parser("Pretrain a Llama in one process with nn.DataParallel.")
    args = parser.parse_args()
    num_gpus = torch.cuda.device_count()
    device = torch.device("cuda", 0) if num_gpus else torch.device("cpu")
    devices = max(num_gpus, 1)  # how many GPUs share each batch
    dp, dp_rank = 1, 0  # one process (train_ddp.py: one per GPU, each reading its share)
    settings = flags.run_settings(parser, args, devices, device, replicas=devices)  # checked
    if flags.check_only(parser, args):  # --check: every flag passed; nothing is run
        return
    checkpoints = Checkpoints(args)  # the whole model in one .pt file, written by rank 0
    resume_path = checkpoints.prepare_out_dir()

    # ---- data ----------------------------------------------------------------------------------
    train_ds, val_set, tokenizer = training.build_datasets(args, settings.tokenizer)
    attn_mask = training.attention_masks(args, settings, tokenizer)  # mask(x): None unless asked

    # The samples this process reads in an epoch: a shuffle seeded by seed + epoch (a new order
    # each epoch, the same one after a resume).
    def epoch_order(epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(args.seed + epoch)
        return torch.randperm(len(train_ds), generator=generator).tolist()

    # ---- model, optimizer, resume --------------------------------------------------------------
    # Built on the meta device (shapes, no storage), sharded there; then each rank gives its part
    # storage and values, each weight drawn from a seed of its own: the same in every layout.
    model, config = training.build_model(args, settings.model, tokenizer.get_vocab_size())
    training.prepare_layers(model, args)  # --activation-checkpointing, --compile
    model.to_empty(device=device)
    training.init_weights(model, config, args, device)
    optimizer = training.build_optimizer(model, args, device.type)
    scheduler = training.build_scheduler(optimizer, args)
    scaler = torch.amp.GradScaler(device.type, enabled=settings.precision == "fp16")
    # What a checkpoint holds and a resume restores, with the step, RNG and data position.
    state = TrainingState(model, optimizer, scheduler, scaler, config, tokenizer)
    start_step, data_position = checkpoints.resume(resume_path, state)
    # On CPU or a single GPU, DataParallel simply calls the module: the same code runs everywhere.
    # DataParallel sums each replica's gradients into the original model's, on GPU 0.
    dp_model = torch.nn.DataParallel(Replica(model, device, settings.precision))
    # --micro-batch-size auto: the largest that fits, measured with the model as it trains.
    settings = flags.measured(settings, args, dp_model, attn_mask, optimizer, config, device)
    rows = settings.micro_batch_size * devices  # sequences per forward: DataParallel splits them
    val_loader = training.ValidationShard(val_set, dp_rank, dp, rows, device)  # its share
    start, shard = (start_step, data_position), (dp_rank, dp)  # (for --streaming)
    batches = training.step_batches(
        args, settings, train_ds, epoch_order, rows, device, start, shard
    )

    def evaluate() -> torch.Tensor:
        totals = training.evaluate(dp_model, val_loader, device, settings, attn_mask)
        return totals

    def save(step: int) -> None:
        checkpoints.save(step, state, training.data_positions(batches))

    # ---- training loop -------------------------------------------------------------------------
    loop = TrainingLoop(args, settings, state, device, start_step)
    for step in loop:
        micro_batches = training.to_device(next(batches), device)
        # Normalise by the number of targets in the whole global batch, not per micro-batch: then
        # every target token weighs the same however the batch is split (micro-batches, ranks),
        # and padded batches give the same gradient as one big batch would.
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


if __name__ == "__main__":
    # A known failure ends in one line (lib/exits.py), and the process with os._exit once main()
    # is over: torch.distributed's C++ teardown can abort a finished run (exits.end_process).
    exits.run(main, os_exit=True)
