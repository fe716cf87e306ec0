"""Pretrain a Llama with torchrun + FSDP2: parameters, gradients and optimizer state sharded.

    torchrun --standalone --nproc_per_node=8 train_fsdp.py --model 1b       # ZeRO-3 on 8 GPUs
    torchrun --standalone --nproc_per_node=8 train_fsdp.py --zero-stage 2   # ZeRO-2
    torchrun --standalone --nproc_per_node=8 train_fsdp.py --cpu-offload    # states in CPU memory
    torchrun --standalone --nproc_per_node=2 train_fsdp.py                  # no GPU: 2 CPU ranks
    python memory_plan.py --model 1b --world-size 8                         # which one fits?

What this changes in train_ddp.py (`diff train_ddp.py train_fsdp.py` shows exactly this):
  1. fully_shard() instead of DDP: every parameter is split into world_size pieces (along dim
     0), one per rank. Applied to each decoder layer and then to the root (embeddings, final
     norm, lm_head), it makes each layer a unit whose full weights are all-gathered just before
     its forward and its backward, and freed right after. Gradients are reduce-scattered: each
     rank receives the sum (averaged, as DDP) of only its own shard's gradients.
       --zero-stage 3 (ZeRO-3): weights freed after forward and gathered again for backward.
       --zero-stage 2 (ZeRO-2): weights kept gathered from forward to backward (one all-gather
       fewer per layer, the memory of the full model in between); gradients and optimizer
       state stay sharded.
  2. The optimizer is built on the sharded parameters (DTensors): AdamW's state is sharded too,
     and each rank updates only its own shard. (ZeRO-1, train_ddp.py --zero1, shards only that.)
  3. Gradient accumulation: set_requires_gradient_sync(False) on all but the last micro-step
     keeps the unsharded gradients locally instead of reduce-scattering them each time.
  4. bf16: FSDP's MixedPrecisionPolicy gathers the weights in bf16 for compute and reduces the
     gradients in fp32 into fp32 shards (the master weights). --cpu-offload keeps the shards,
     their gradients and AdamW's state in CPU memory, and runs the optimizer step there (the
     idea of ZeRO-Offload).
  5. Checkpoints: every rank writes its own shards with torch.distributed.checkpoint (DCP), into
     a directory per step; model.pt gathers the full weights onto rank 0, plain as ever.
"""

import math
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler, Subset
from tqdm import tqdm

import common
import memory_plan
import safe_dcp
from model import IGNORE_INDEX, LlamaForPretraining
from train_ddp import from_rank0, setup_distributed  # the same setup: nothing changes there

# -------------------------------------------------------------------------------------------------
# Sharded checkpoints: checkpoints/step_NNNNNNN/ holds DCP's files (one per rank, plus the
# .metadata that maps every tensor's pieces) and train_state.pt (schedule, RNG, step, config).

CHECKPOINT_DIR_RE = common.CHECKPOINT_DIR_RE  # step_0000100/
TRAIN_STATE = "train_state.pt"
# AdamW's state keyed per parameter ("state.layers.3.attention.wq.weight.exp_avg",
# "param_groups.layers.3.attention.wq.weight.lr"), not as one list of param_groups: a checkpoint
# then holds nothing that depends on how parameters are spread over ranks, so train_pp.py, whose
# pipeline ranks each own different parameters (and would each write another param_groups list
# under the same key), writes the same directories, and either script resumes the other's.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def prepare_out_dir(args, script: str = "train_fsdp.py") -> str | None:
    """Create --out-dir and choose the checkpoint directory to resume from (None: start fresh).

    As common.prepare_out_dir, for checkpoint directories: called on rank 0 alone. `script` names
    the script in the messages: train_tp.py and train_pp.py write the same directories (and use
    the two functions below).
    """
    common.make_out_dir(args)
    ckpt_dir = os.path.join(args.out_dir, "checkpoints")
    if os.path.isdir(ckpt_dir):  # directories of a run killed mid-save (never renamed)
        for name in os.listdir(ckpt_dir):
            if name.endswith(".tmp"):
                shutil.rmtree(os.path.join(ckpt_dir, name))
    if args.resume == "never":
        if common.list_checkpoints(args.out_dir, CHECKPOINT_DIR_RE):
            raise common.resume_never_error(args.out_dir)
        resume = None
    elif args.resume != "auto":
        if not os.path.isfile(os.path.join(args.resume, TRAIN_STATE)):
            raise ValueError(
                f"--resume: {args.resume} is not a {script} checkpoint directory (the .pt "
                f"checkpoints of train_dp.py/train_ddp.py do not resume here; see the README)"
            )
        resume = args.resume
    else:
        found = common.list_checkpoints(args.out_dir, CHECKPOINT_DIR_RE)
        # A directory is checked through its train state, the file this script loads first.
        resume = common.newest_readable(found, lambda path: os.path.join(path, TRAIN_STATE))
    common.refuse_other_checkpoints(args.out_dir, sharded=True)  # .pt files: train_dp/ddp's
    if resume is None:
        common.start_fresh(args.out_dir)
    return resume


def save_sharded_checkpoint(args, step, model, optimizer, scheduler, config, tokenizer, is_main):
    """A collective: every rank calls it and writes only its own shards (no gather)."""
    path = os.path.join(args.out_dir, "checkpoints", f"step_{step:07d}")
    tmp = f"{path}.tmp"

    def start() -> None:  # rank 0's part
        shutil.rmtree(tmp, ignore_errors=True)  # the leftovers of a run killed mid-save
        try:
            os.makedirs(tmp)
        except OSError as e:  # a full disk
            raise common.save_failed(path, e) from e

    # from_rank0's broadcast: the directory exists before anyone writes into it (or all stop).
    from_rank0(start, is_main)
    # get_state_dict: the model's and AdamW's state keyed by parameter name, as sharded DTensors.
    model_state, optim_state = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    try:
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
    except dcp.api.CheckpointException as e:  # raised on every rank if any rank's write failed
        # (a full disk): the partial directory goes, the previous checkpoints stay as they were.
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        # failures: {rank: (error, traceback)}. Sent between ranks without its context, a full
        # disk shows as torch.save's RuntimeError ("unexpected pos"), not as the OSError.
        cause = next(iter(e.failures.values()))[0]
        raise common.save_failed(path, cause) from e

    def finish() -> None:  # rank 0's part: the train state, then the rename that completes it
        train_state = {
            "scheduler": scheduler.state_dict(),
            "rng": common.rng_state(),
            "step": step,
            "config": config.to_dict(),
            "tokenizer_sha256": common.tokenizer_digest(tokenizer),
            "args": vars(args),
        }
        try:
            common.atomic_save(train_state, os.path.join(tmp, TRAIN_STATE))
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise common.save_failed(path, e) from e
        # Atomic as common.save_checkpoint's files: a directory is complete once renamed.
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)
        for old in common.list_checkpoints(args.out_dir, CHECKPOINT_DIR_RE)[
            : -args.keep_checkpoints
        ]:
            shutil.rmtree(old)

    # On return, the checkpoint is complete for every rank; if rank 0's part failed, every rank
    # raises its error (from_rank0's broadcast), instead of the others waiting for rank 0.
    from_rank0(finish, is_main)


def load_sharded_checkpoint(path, model, optimizer, scheduler, config, args, tokenizer) -> int:
    """Load a checkpoint into the sharded model and optimizer; returns the step to continue from.

    DCP reads, on each rank, just the pieces of the tensors that rank's shards cover, whatever the
    number of ranks that wrote them: a run can resume on a different number of ranks.
    """
    train_state = common.load_checkpoint(os.path.join(path, TRAIN_STATE))
    common.check_resumable(train_state, config, args, tokenizer)  # before changing anything
    model_state, optim_state = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    state = {"model": model_state, "optimizer": optim_state}
    try:
        # dcp.load, minus the pickles that could run code (a crafted checkpoint): see safe_dcp.py.
        safe_dcp.load(state, path)  # in place, into the tensors of `state`
    except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - every rank fails alike
        # CheckpointException derives from BaseException, so it is named. The train state was
        # fine, so the shards are damaged (a disk error), hold what safe_dcp refuses to unpickle,
        # or are of a train_fsdp.py from before optimizer state was keyed per parameter: say
        # which directory, and what to do (rather than resume silently from an older one).
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (error, trace)}
        cause = next(iter(failures.values()))[0] if failures else e
        reason = (str(cause).strip() or type(cause).__name__).splitlines()[0].split(". ")[0]
        raise ValueError(
            f"could not load the sharded checkpoint {path}: {reason}; it "
            f"is damaged, unsafe or from an older version of this script. Resume from another one "
            f"(--resume {os.path.dirname(path)}/step_...), or start fresh in another --out-dir"
        ) from e
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
        options=STATE_DICT_OPTIONS,
    )  # fmt: skip
    scheduler.load_state_dict(train_state["scheduler"])
    common.set_rng_state(train_state["rng"])
    return train_state["step"]


def main():
    parser = common.build_parser(
        "Pretrain a Llama with torchrun + FSDP2 (ZeRO-2/3 sharding, optional CPU offload)."
    )
    parser.add_argument(
        "--backend",
        choices=["nccl", "gloo"],
        default=None,
        help="process group backend (default: nccl on GPU, gloo on CPU)",
    )
    parser.add_argument(
        "--zero-stage",
        type=int,
        choices=[2, 3],
        default=3,
        help="3: weights resharded after forward (least memory); 2: weights kept gathered "
        "until backward (less communication). Gradients and optimizer state: sharded in both",
    )
    parser.add_argument(
        "--cpu-offload",
        action="store_true",
        help="keep sharded weights, gradients and optimizer state in CPU memory; the optimizer "
        "step runs on the CPU (ZeRO-Offload's idea; slower, fits far bigger models)",
    )
    args = parser.parse_args()
    rank, local_rank, world_size, device = setup_distributed(args.backend)
    is_main = rank == 0  # global rank 0 alone prints, writes files and shows the progress bar
    accumulation = common.check_args(parser, args, devices=world_size)
    precision = common.resolve_precision(args.precision, device)
    args.attention = common.resolve_attention(args, device)
    if precision == "fp16":
        raise ValueError(
            "train_fsdp.py supports --precision bf16 or fp32: fp16 needs loss scaling of sharded "
            "gradients, which this script does not implement"
        )
    if args.check:  # every flag passed: stop before any work (run_ddp.sh checks this way first)
        print(f"{parser.prog}: the flags are fine (--check: nothing was run)")
        return
    resume_path = from_rank0(lambda: prepare_out_dir(args), is_main)

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

    # ---- model, sharding, optimizer, resume -----------------------------------------------------
    model, config = common.build_model(args, tokenizer.get_vocab_size())
    # Activation checkpointing and compilation go inside the sharding units, as in torchtitan:
    # each layer's all-gather then wraps the (checkpointed, compiled) layer.
    if args.activation_checkpointing:
        common.apply_activation_checkpointing(model)
    if args.compile:
        common.compile_layers(model)
    model.to(device)
    # bf16: weights are all-gathered in bf16 (half the traffic and memory of fp32) and gradients
    # reduce-scattered in fp32 into fp32 shards, which stay the master weights AdamW updates.
    # fp32: no casts at all, so the result equals train_ddp.py's (the tests hold that).
    bf16 = precision == "bf16"
    mp_policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32 if bf16 else None
    )
    offload = {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")}
    shard_options = dict(
        reshard_after_forward=args.zero_stage == 3, mp_policy=mp_policy,
        **(offload if args.cpu_offload else {}),
    )  # fmt: skip
    # Layers first, then the root: the root's unit takes what no layer owns (embeddings, final
    # norm, lm_head). fully_shard changes the model in place: `model` is the sharded model now,
    # its parameters DTensors that each hold this rank's 1/world_size.
    for layer in model.layers:
        fully_shard(layer, **shard_options)
    fully_shard(model, **shard_options)
    # Built after sharding, on the shards: AdamW's state is sharded like them. With offload,
    # the shards live in CPU memory and so does the update.
    optimizer = common.build_optimizer(model, args, "cpu" if args.cpu_offload else device.type)
    scheduler = common.build_scheduler(optimizer, args)
    start_step = 0
    if resume_path:  # every rank loads the same directory: the one rank 0 chose
        start_step = load_sharded_checkpoint(
            resume_path, model, optimizer, scheduler, config, args, tokenizer
        )
        if is_main:
            print(f"resumed from {resume_path} at step {start_step}")
    if args.micro_batch_size == "auto":  # measure the largest that fits, with the sharded model
        accumulation = common.auto_micro_batch_size(
            args, model, tokenizer, optimizer, device, precision, world_size
        )
    val_loader = DataLoader(val_shard, batch_size=args.micro_batch_size)
    if is_main:
        print(common.describe_run(args, config, accumulation, world_size, device, precision))
        print(
            f"sharding: FSDP ZeRO-{args.zero_stage} over {world_size} ranks, "
            f"cpu offload {args.cpu_offload}, activation checkpointing "
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
            # Gradient accumulation: reduce-scatter only after the last micro-step; before it,
            # each layer accumulates its unsharded gradients locally (FSDP's no_sync).
            model.set_requires_gradient_sync(i == accumulation - 1)
            # autocast as in train_ddp.py: with bf16 weights from the policy it changes no
            # matmul, but still runs cross-entropy and softmax in fp32.
            with common.autocast(device, precision):
                loss_sum, _ = model(x, y, common.build_attn_mask(x, args, tokenizer))
            # The reduce-scatter averages gradients over ranks, as DDP's all-reduce does: the
            # factor world_size undoes that division, leaving sum of all losses / all tokens.
            loss = loss_sum * world_size / global_tokens
            loss.backward()
            step_loss += loss_sum.detach()
        # The global loss, on every rank (no wait for it here: the all-reduce is queued like any
        # other kernel). Every rank then takes the same decisions about it below.
        dist.all_reduce(step_loss)
        # The gradients are sharded DTensors: clip_grad_norm_ all-reduces the squared norms of
        # the shards, so every rank measures (and clips by) the norm of the whole gradient.
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), args.grad_clip if args.grad_clip > 0 else math.inf
        ).full_tensor()  # a DTensor, replicated on every rank: this is its value, no traffic
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
            # Every rank evaluates its own shard of the data (the forward all-gathers each layer,
            # so every rank must run it), then the sums are added up over ranks.
            val_sum, val_tokens = common.evaluate(
                model, val_loader, device, precision, args, tokenizer
            )
            dist.all_reduce(val_sum)
            dist.all_reduce(val_tokens)
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
    # Gather the full weights: a collective, so every rank calls it; with cpu_offload=True only
    # rank 0 receives them, in CPU memory (the others get an empty dict). Loaded into a plain
    # model, they make the same model.pt as every other script writes.
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
