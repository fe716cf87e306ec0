"""Pretrain a mixture-of-experts Llama with torchrun + expert parallelism over FSDP2.

    torchrun --standalone --nproc_per_node=8 train_ep.py --num-experts 8 --ep 8  # 1 per GPU
    torchrun --standalone --nproc_per_node=8 train_ep.py --num-experts 8 --ep 4  # dp 2 x ep 4
    torchrun --standalone --nproc_per_node=2 train_ep.py --num-experts 4 --ep 2  # no GPU: 2 CPUs
    NNODES=4 NODE_RANK=0 MASTER_ADDR=10.0.0.1 SCRIPT=train_ep.py ./run_ddp.sh --num-experts 64 \
        --ep 8
        # 4 nodes x 8 GPUs, the same command on every node (NODE_RANK 0..3): each layer's 64
        # experts over the 8 GPUs of a node (8 each), 4 copies of that across the nodes

A mixture of experts (--num-experts E, lib/moe.py) has E SwiGLU MLPs per layer where a dense model
has one, and each token uses only k of them: E times the MLP weights for the compute of k.
Expert parallelism spreads each layer's experts over ep ranks instead of copying them all to
every rank, and sends each token to the rank that holds its experts.

What this changes in train_fsdp.py (`diff train_fsdp.py train_ep.py` shows each change; the
dispatch of point 2 and the clipping of point 4 are lib/expert_parallel.py, part of this lesson):
  1. A DeviceMesh (dp, ep): world_size = dp x ep, ep the inner dimension (ep consecutive
     ranks, one node's GPUs when ep <= GPUs per node, where the all-to-alls are fastest). Every
     rank reads its own share of the batch, as in train_fsdp.py: all ranks are data-parallel
     for the model's dense part, and the ep ranks of a group share their experts.
  2. shard_experts(model, ep_mesh["ep"]): rank j of a group keeps experts j*E/ep.. (j+1)*E/ep - 1
     of every MoE layer (w1, w2, w3 become DTensors, Shard(0) over ep). Each rank routes its own
     tokens (the router is replicated, like attention); each layer then sends every (token,
     expert) pair to the rank of its expert with an all-to-all (the counts exchanged first: the
     sizes are uneven), runs its own experts on what it receives, and sends the outputs back
     with a second all-to-all. Dropless: every token reaches its k experts, so the outputs are
     one process's. Backward runs the two all-to-alls in reverse.
  3. FSDP2 over the rest as in train_fsdp.py (all ranks, or --replicate's HSDP grid), and over
     the experts across the dp groups: rank (i, j) and rank (i', j) hold the same experts, and
     their unit shards them over ep_mesh["dp"] (nothing to shard when world_size = ep). The router
     is a unit of its own over all ranks, outside the experts' unit.
     Gradients: the loss is normalised as before (loss_sum x world_size / global tokens), and
     FSDP averages the dense gradients over all ranks. An expert's gradient, though, arrives on
     its rank already summed over the tokens of the whole ep group (the all-to-all's backward
     brings them), and FSDP sums it over dp: divided by dp (FSDP's default) it would be ep
     times too large. set_gradient_divide_factor(world_size) divides it by dp x ep instead.
  4. The gradients are DTensors on two meshes (the experts' dp x ep, the rest on all ranks),
     which torch's clip_grad_norm_ cannot stack: expert_parallel.clip_grad_norm_ takes each
     mesh's norm and combines them.
  Checkpoints (DCP directories, model.pt gathered on rank 0) are train_fsdp.py's: the experts'
  DTensors are saved and loaded by their global shape, so a checkpoint resumes in train_ep.py
  with another --ep or number of ranks, and in train_fsdp.py, and back.

Cost: per MoE layer and micro-batch, the all-to-alls carry k x d values per token each way,
forward and backward, and the host waits for the counts before each dispatch. Memory: the
experts' weights, gradients and optimizer state split ep ways, then FSDP's dp ways: 1/world_size
per rank, like the rest; docs/expert-parallel.md and tools/memory_plan.py --num-experts --ep.

Files: to run it, copy it with lib/expert_parallel.py, lib/moe.py, lib/sharded_checkpoints.py and the library
every lesson shares: lib/checkpoints.py, lib/flags.py, data.py, lib/distributed.py, lib/metrics.py, model.py,
lib/model_config.py, lib/exits.py, lib/training.py. A module that only an optional feature needs
(--streaming, --plan, another --data, ...) is imported where that feature is used. Its neighbour is
train_fsdp.py: `diff train_fsdp.py train_ep.py`.
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

from lib import checkpoints, distributed, exits, flags, model_config, training
from lib.distributed import divide_ranks, from_rank0
from lib.expert_parallel import clip_grad_norm_, data_parallel_size, shard_experts
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
        "Pretrain a mixture-of-experts Llama with torchrun + expert parallelism over FSDP2.",
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
    parser.add_argument(
        "--ep",
        type=flags.number_arg(int, 1),
        default=1,
        help="expert-parallel ranks per group: each holds 1/ep of every layer's experts. It must "
        "divide the number of ranks and --num-experts",
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
            "train_ep.py supports --precision bf16 or fp32: fp16 needs loss scaling of sharded "
            "gradients, which this script does not implement"
        )
    # HSDP's grid: --replicate replicas of shard groups of `shards` ranks (or ValueError).
    shards = divide_ranks(world_size, "--replicate", args.replicate, "replicas x shards")
    # The EP grid: dp groups of ep ranks (or ValueError: --ep must divide the ranks and experts).
    dp = data_parallel_size(world_size, args.ep, model_config.model_shape(args).num_local_experts)
    if args.check:  # every flag passed: stop before any work (run_ddp.sh checks this way first)
        print(f"{parser.prog}: the flags are fine (--check: nothing was run)")
        return
    resume_path = from_rank0(lambda: prepare_out_dir(args, "train_ep.py"), is_main)

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
    # The EP grid: rank = dp_rank * ep + ep_rank. ep_mesh["ep"] is this rank's EP group (ep
    # consecutive ranks), which shares out the experts; ep_mesh["dp"] the ranks that hold the
    # same experts in the other groups. Each rank keeps its E / ep experts of every layer, and
    # each MoE layer dispatches its tokens over the group (lib/expert_parallel.py).
    ep_mesh = init_device_mesh(device.type, (dp, args.ep), mesh_dim_names=("dp", "ep"))
    shard_experts(model, ep_mesh["ep"])
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
    # In each layer, two units first: the router (gate) over all ranks, as the rest of the layer,
    # since every rank routes its own tokens; then the experts over ep_mesh["dp"], the ranks
    # that hold the same experts (FSDP over dp, on top of EP's Shard(0): 2-D DTensors).
    for layer in model.layers:
        fully_shard(layer.feed_forward.gate, **shard_options)
        fully_shard(layer.feed_forward, **{**shard_options, "mesh": ep_mesh["dp"]})
        # An expert's gradient comes back from the all-to-all summed over its EP group's tokens,
        # and the reduce-scatter sums it over dp: divide by all the ranks, dp x ep, as the dense
        # gradients are (FSDP's default, the mean over its mesh, would divide by dp alone).
        layer.feed_forward.set_gradient_divide_factor(world_size)
        if dp > 1:  # a plain sum, then the division: gloo has no reduction that scales as it
            # sums. (With dp = 1 there is no reduction to make, and torch would divide twice.)
            layer.feed_forward.set_force_sum_reduction_for_comms(True)
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
        E = config.num_local_experts
        print(
            f"experts: {E} per layer over the {args.ep} rank{'s' if args.ep > 1 else ''} of each "
            f"EP group ({E // args.ep} each), {dp} group{'s' if dp > 1 else ''}; the experts' FSDP "
            f"over {dp} rank{'s' if dp > 1 else ''}"
        )
        if args.plan:  # tools/memory_plan.py's estimate (a tool: imported only for --plan)
            from lib import memory

            print(
                memory.estimate_for_run(
                    args, run, config, world_size, replicate=args.replicate, ep=args.ep
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
        # The gradients are sharded DTensors on two meshes (the experts' and the rest's): the
        # norm of each mesh's shards, combined, so every rank measures (and clips by) the norm
        # of the whole gradient (expert_parallel.clip_grad_norm_; a plain tensor on every rank).
        grad_norm = clip_grad_norm_(
            model.parameters(), args.grad_clip if args.grad_clip > 0 else math.inf
        )
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
