"""Pretrain a Llama with torchrun + FSDP2: parameters, gradients and optimizer state sharded.

    torchrun --standalone --nproc_per_node=8 train_fsdp.py --model 1b       # ZeRO-3 on 8 GPUs
    torchrun --standalone --nproc_per_node=8 train_fsdp.py --zero-stage 2   # ZeRO-2
    torchrun --standalone --nproc_per_node=8 train_fsdp.py --cpu-offload    # states in CPU memory
    torchrun --standalone --nproc_per_node=2 train_fsdp.py                  # no GPU: 2 CPU ranks
    NNODES=4 NODE_RANK=0 MASTER_ADDR=10.0.0.1 SCRIPT=train_fsdp.py ./run_ddp.sh --replicate 4
        # HSDP on 4 nodes x 8 GPUs (the same command on every node, NODE_RANK 0..3): ZeRO-3
        # inside each node, 4 replicas of it across the nodes
    python -m tools.memory_plan --model 1b --world-size 8                         # which one fits?

What this changes in train_zero1.py (`diff train_zero1.py train_fsdp.py` shows each change; the
sharded checkpoints of point 5 are calls into lib/sharded_checkpoints.py, part of this lesson):
  1. fully_shard() instead of DDP and ZeroRedundancyOptimizer: every parameter is split into
     world_size pieces (along dim 0), one per rank. Applied to each decoder layer and then to
     the root (embeddings, final norm, lm_head), it makes each layer a unit whose full weights
     are all-gathered just before its forward and its backward, and freed right after.
     Gradients are reduce-scattered: each rank receives the sum (averaged, as DDP) of only its
     own shard's gradients.
       --zero-stage 3 (ZeRO-3): weights freed after forward and gathered again for backward.
       --zero-stage 2 (ZeRO-2): weights kept gathered from forward to backward (one all-gather
       fewer per layer, the memory of the full model in between); gradients and optimizer
       state stay sharded.
  2. The optimizer is built on the sharded parameters (DTensors): AdamW's state is sharded too,
     and each rank updates only its own shard. (ZeRO-1, train_zero1.py, shards only that.)
  3. Gradient accumulation: set_requires_gradient_sync(False) on all but the last micro-step
     keeps the unsharded gradients locally instead of reduce-scattering them each time.
  4. bf16: FSDP's MixedPrecisionPolicy gathers the weights in bf16 for compute and reduces the
     gradients in fp32 into fp32 shards (the master weights). --cpu-offload keeps the shards,
     their gradients and AdamW's state in CPU memory, and runs the optimizer step there (the
     idea of ZeRO-Offload).
  5. Checkpoints: every rank writes its own shards with torch.distributed.checkpoint (DCP), into
     a directory per step (lib/sharded_checkpoints.py); model.pt gathers the full weights onto rank
     0, plain as ever.
  6. --replicate R (HSDP, hybrid sharding): the ranks form an R x S grid (S = world_size / R).
     Each parameter is sharded over the S ranks of a row (a shard group, say one node) and the
     R rows hold replicas of it: gradients are reduce-scattered within each row, then each
     shard is all-reduced with the same shard of the other rows. Each rank still reads its own
     1/world_size of the batch: the replicas are data-parallel too. It pays off across nodes:
     the slow link between them carries one all-reduce of 1/S of the gradients per step,
     instead of every layer's all-gathers and reduce-scatters; the price is the memory of FSDP
     over S ranks, not over all of them. --replicate world_size shards nothing (S = 1): DDP.

Files: to run it, copy it with lib/sharded_checkpoints.py and the library every lesson shares:
lib/checkpoints.py, lib/flags.py, data.py, lib/distributed.py, lib/metrics.py, model.py, lib/model_config.py, lib/exits.py,
lib/training.py. A module that only an optional feature needs (--streaming, --plan, another --data,
...) is imported where that feature is used. Its neighbour is train_zero1.py: `diff train_zero1.py
train_fsdp.py`.
"""

import math

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.data import DistributedSampler, Subset
from tqdm import tqdm

from lib import checkpoints, distributed, exits, flags, training
from lib.distributed import divide_ranks, from_rank0
from lib.metrics import Metrics, NonFiniteGuard, Throughput, bar_postfix, router_figures
from lib.sharded_checkpoints import (
    load_sharded_checkpoint,
    prepare_out_dir,
    safe_load_options,
    save_sharded_checkpoint,
)
from model import IGNORE_INDEX, LlamaForPretraining


def main():
    parser = flags.build_parser(
        "Pretrain a Llama with torchrun + FSDP2 (ZeRO-2/3 sharding, optional CPU offload).",
        distributed=True,
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
    parser.add_argument(
        "--replicate",
        type=flags.number_arg(int, 1),
        default=1,
        help="HSDP: shard within groups of world_size / R ranks (say, one node each) and keep R "
        "replicas of the shards; 1: plain FSDP over all ranks",
    )
    args = parser.parse_args()
    rank, local_rank, world_size, device = distributed.torchrun_rank()  # as in train_ddp.py
    if not args.check:  # the process group, as in train_ddp.py
        dist.init_process_group(
            distributed.backend_for(args.backend, device), store=distributed.rendezvous_store(),
            rank=rank, world_size=world_size, device_id=device if device.type == "cuda" else None,
        )  # fmt: skip
    is_main = rank == 0  # global rank 0 alone prints, writes files and shows the progress bar
    run = flags.run_settings(parser, args, world_size, device)  # micro-batch, accumulation, ...
    if run.precision == "fp16":
        raise ValueError(
            "train_fsdp.py supports --precision bf16 or fp32: fp16 needs loss scaling of sharded "
            "gradients, which this script does not implement"
        )
    # HSDP's grid: --replicate replicas of shard groups of `shards` ranks (or ValueError).
    shards = divide_ranks(world_size, "--replicate", args.replicate, "replicas x shards")
    if args.check:  # every flag passed: stop before any work (run_ddp.sh checks this way first)
        print(f"{parser.prog}: the flags are fine (--check: nothing was run)")
        return
    resume_path = from_rank0(lambda: prepare_out_dir(args, "train_fsdp.py"), is_main)

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

    # ---- model, sharding, optimizer, resume -----------------------------------------------------
    model, config = training.build_model(args, run.model, tokenizer.get_vocab_size())
    # Activation checkpointing and compilation go inside the sharding units, as in torchtitan:
    # each layer's all-gather then wraps the (checkpointed, compiled) layer.
    if args.activation_checkpointing:
        training.apply_activation_checkpointing(model)
    if args.compile:
        training.compile_layers(model)
    model.to(device)
    # bf16: weights are all-gathered in bf16 (half the traffic and memory of fp32) and gradients
    # reduce-scattered in fp32 into fp32 shards, which stay the master weights AdamW updates.
    # fp32: no casts at all, so the result equals train_ddp.py's (the tests hold that).
    bf16 = run.precision == "bf16"
    mp_policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32 if bf16 else None
    )
    offload = {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")}
    # The grid of ranks: rank = replica * shards + shard. mesh["shard"] is this rank's shard
    # group (consecutive ranks: one node, with torchrun's numbering), mesh["replicate"] the ranks
    # that hold the same shard in the other groups. A 2-D mesh makes fully_shard do HSDP; with
    # --replicate 1 there is none: plain FSDP over all ranks (no all-reduce step, no new groups).
    mesh = None
    if args.replicate > 1:
        mesh = init_device_mesh(
            device.type, (args.replicate, shards), mesh_dim_names=("replicate", "shard")
        )
    shard_options = dict(
        mesh=mesh,
        reshard_after_forward=args.zero_stage == 3, mp_policy=mp_policy,
        **(offload if args.cpu_offload else {}),
    )  # fmt: skip
    # Layers first, then the root: the root's unit takes what no layer owns (embeddings, final
    # norm, lm_head). fully_shard changes the model in place: `model` is the sharded model now,
    # its parameters DTensors that each hold this rank's 1/world_size (HSDP: 1/shards).
    for layer in model.layers:
        fully_shard(layer, **shard_options)
    fully_shard(model, **shard_options)
    # Built after sharding, on the shards: AdamW's state is sharded like them. With offload,
    # the shards live in CPU memory and so does the update.
    optimizer = training.build_optimizer(model, args, "cpu" if args.cpu_offload else device.type)
    scheduler = training.build_scheduler(optimizer, args)
    start_step, data_position = 0, None  # data_position: where the stream is (--streaming)
    if resume_path:  # every rank loads the same directory: the one rank 0 chose
        # DCP reads, on each rank, just the pieces its shards cover, whatever the number of
        # ranks that wrote them; safe_load_options: no pickle in the directory can run code.
        with load_sharded_checkpoint(
            resume_path, model, optimizer, scheduler, config, args, tokenizer
        ) as (state, train_state):
            dcp.load(state, **safe_load_options(resume_path))  # in place, into `state`'s shards
        start_step, data_position = train_state["step"], train_state.get("data")
        if is_main:
            print(f"resumed from {resume_path} at step {start_step}")
    if args.micro_batch_size == "auto":  # measure the largest that fits, with the sharded model
        from lib.auto_batch import auto_micro_batch_size  # only for --micro-batch-size auto

        run = auto_micro_batch_size(
            args, run, model, attn_mask, optimizer, config.vocab_size, device
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
        sharding = f"FSDP ZeRO-{args.zero_stage} over {world_size} ranks"
        if args.replicate > 1:
            sharding = (
                f"HSDP {args.replicate} x {shards} (replicas x shard group), ZeRO-{args.zero_stage}"
            )
        print(
            f"sharding: {sharding}, cpu offload {args.cpu_offload}, activation checkpointing "
            f"{args.activation_checkpointing}"
        )
        if args.plan:  # tools/memory_plan.py's estimate (a tool: imported only for --plan)
            from lib import memory

            print(
                memory.estimate_for_run(
                    args, run, config, world_size, replicate=args.replicate
                )
            )

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
            # Gradient accumulation: reduce-scatter only after the last micro-step; before it,
            # each layer accumulates its unsharded gradients locally (FSDP's no_sync).
            model.set_requires_gradient_sync(i == run.accumulation - 1)
            # autocast as in train_ddp.py: with bf16 weights from the policy it changes no
            # matmul, but still runs cross-entropy and softmax in fp32.
            with training.autocast(device, run.precision):
                loss_sum, _ = model(x, y, attn_mask(x))
            # The reduce-scatter averages gradients over ranks, as DDP's all-reduce does: the
            # factor world_size undoes that division, leaving sum of all losses / all tokens.
            # HSDP too: it averages over the shard group, then over the replicas (world_size).
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
            # Every rank evaluates its own shard of the data (the forward all-gathers each layer,
            # so every rank must run it), then the sums are added up over ranks.
            val_sum, val_tokens = training.evaluate(
                model, val_loader, device, run.precision, attn_mask
            )
            dist.all_reduce(val_sum)
            dist.all_reduce(val_tokens)
            val_loss = (val_sum / val_tokens).item()
            metrics.log_validation(done, val_loss)  # printed on rank 0 too
            throughput.restart()  # keep evaluation time out of the tokens/s figure
        if do_save:
            # Every rank: each writes its own shards (a collective, never inside is_main).
            data_position = training.data_positions(batches)  # --streaming; a collective
            with save_sharded_checkpoint(
                args, done, model, optimizer, scheduler, config, tokenizer, is_main, data_position
            ) as (state, path):
                dcp.save(state, checkpoint_id=path)  # each rank its own shards, no gather
            throughput.restart()
        if stop:
            raise exits.Stopped(done, stop_request.signal)  # exits.run says so and exits

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
        training.finish_run(args, plain, config, tokenizer, device)
    stop_request.finish()  # no collective of it left in flight when the process group goes
    dist.barrier()  # the run is over when rank 0's files are written, for every rank
    dist.destroy_process_group()


if __name__ == "__main__":
    # A known failure ends in one line; the process ends with os._exit once main() is over
    # (exits.end_process: torch.distributed's C++ teardown can abort a finished run).
    exits.run(main, os_exit=True)
