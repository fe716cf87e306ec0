"""Pretrain a Llama with torchrun + context parallelism: every sequence split over cp ranks.

    torchrun --standalone --nproc_per_node=8 train_cp.py --model 1b --cp 8 --seq-length 4096
    torchrun --standalone --nproc_per_node=8 train_cp.py --cp 2              # 2D: dp 4 x cp 2
    torchrun --standalone --nproc_per_node=2 train_cp.py --cp 2              # no GPU: 2 CPU ranks
    NNODES=4 NODE_RANK=0 MASTER_ADDR=10.0.0.1 SCRIPT=train_cp.py ./run_ddp.sh --model 1b --cp 8
        # 4 nodes x 8 GPUs, the same command on every node (NODE_RANK 0..3): each sequence over
        # the 8 GPUs of a node, 4 dp groups (one per node), FSDP over all 32 ranks

Context parallelism is for sequences too long for one GPU's activations: each of the cp ranks of
a group holds T / cp tokens of every sequence, and runs them (and only them) through every layer.
Only attention needs the rest of the sequence; it gets each layer's keys and values from the
other ranks of the group.

What this changes in train_fsdp.py (`diff train_fsdp.py train_cp.py` shows each change; the
split and the attention of point 2 are lib/context_parallel.py, part of this lesson):
  1. A DeviceMesh (dp, cp) instead of one flat group of ranks: world_size = dp x cp, cp the inner
     dimension (cp consecutive ranks, one node's GPUs when cp <= GPUs per node). The cp ranks of
     a group read the same sequences; the data is split over the dp groups only, exactly as
     train_fsdp.py splits it over ranks, so every global batch is the same as in train_dp.py.
  2. ContextParallel(model, cp_mesh["cp"]) runs the model on this rank's slice of every sequence.
     The zigzag split cuts each sequence into 2 x cp chunks, and rank r keeps chunks r and
     2cp-1-r of x and y: under causal attention a late token attends to more keys than an early
     one, and one early plus one late chunk gives every rank the same work. With --cp 2:
         chunks 0 1 2 3  ->  rank 0 holds chunks 0 and 3, rank 1 holds chunks 1 and 2.
     The model gets the positions of its tokens (position_ids) for RoPE, and an attention
     function: in every layer it all-gathers the rotated keys and values over the cp group and
     lets this rank's queries attend to all of them, causally by position. Its backward
     reduce-scatters the keys' and values' gradients back to the ranks that computed them.
  3. FSDP shards over all ranks, dp x cp as one flat group (as torchtitan shards over dp_shard x
     cp flattened): the cp ranks of a group hold the same parameters and compute gradients from
     different tokens of the same sequences, so to FSDP they are data-parallel ranks like any
     other, and its reduce-scatter sums all of them. --replicate R (HSDP) works as in
     train_fsdp.py, over the same ranks: 4D = replicate x shard x cp, as torchtitan's.
  4. The loss is normalised by the global number of targets: each target is in exactly one
     rank's slice, so the slices' counts, all-reduced over all ranks, add up to it. The summed
     losses and the validation sums add up over all ranks the same way.
  5. --document-mask: each rank builds only its rows of the mask (its queries against the keys
     before them, from the document ids of the whole sequence), never the (T, T) mask; SDPA
     runs it (--attention flex is refused). Without it, SDPA's causal kernels (flash on GPU).
  Checkpoints (DCP directories, model.pt gathered on rank 0) are train_fsdp.py's: the same
  sharding over all ranks, so either script resumes the other's, with any --cp.

Why an all-gather of keys and values, not a ring of P2P exchanges: the Llama 3 paper's choice.
Under grouped-query attention K and V are small (Llama 3 70B: 8 key/value heads for 64 query
heads), one collective per layer reads as such, and a document mask stays a plain mask over
global positions. A ring (ring attention) passes key/value blocks from rank to rank, overlaps
each transfer with the attention of the block before, and merges the partial softmaxes by their
log-sum-exp: it never holds the whole K and V, but it is far harder to read. PyTorch's own,
torch.distributed.tensor.experimental.context_parallel, is such a ring; in torch 2.13 it runs on
CUDA only (its SDPA dispatch knows the flash, memory-efficient and cuDNN kernels; on CPU it fails
with "NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does
not have a sharding strategy registered") and takes no attention mask. This version runs on CPU
with gloo as on CUDA with NCCL, document masks included.

Memory: activations are 1/cp per rank (T / cp tokens per layer), except the gathered keys and
values (2 x T x kv_heads x head_dim per layer): with --activation-checkpointing those of one layer
at a time (the recompute in backward gathers them again); without it, autograd keeps every
layer's for backward. Cost: per layer, an all-gather of K and V in forward (and in the recompute)
and a reduce-scatter of their gradients in backward, which nothing overlaps with compute here.
--compile compiles each layer around the gather (one graph break per layer).

Files: to run it, copy it with lib/context_parallel.py, masks.py, lib/sharded_checkpoints.py and the
library every lesson shares: lib/checkpoints.py, lib/flags.py, data.py, lib/distributed.py, lib/metrics.py, model.py,
lib/model_config.py, lib/exits.py, lib/training.py. A module that only an optional feature needs
(--streaming, --plan, another --data, ...) is imported where that feature is used. Its neighbour is
train_fsdp.py: `diff train_fsdp.py train_cp.py`.
"""

import math
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.data import DistributedSampler, Subset
from tqdm import tqdm

from lib import checkpoints, distributed, exits, flags, model_config, training
from lib.context_parallel import ContextParallel, data_parallel_size, zigzag_slice
from lib.distributed import divide_ranks, from_rank0
from lib.metrics import Metrics, NonFiniteGuard, Throughput, bar_postfix
from lib.sharded_checkpoints import (
    load_sharded_checkpoint,
    prepare_out_dir,
    safe_load_options,
    save_sharded_checkpoint,
)
from masks import document_ids
from model import IGNORE_INDEX, LlamaForPretraining


def main():
    parser = flags.build_parser(
        "Pretrain a Llama with torchrun + context parallelism (every sequence split over cp "
        "ranks), FSDP2 over all ranks.",
        distributed=True,
    )
    parser.add_argument(
        "--cp",
        type=flags.number_arg(int, 1),
        default=None,
        help="context-parallel ranks per group: each holds 1/cp of every sequence. It must divide "
        "the number of ranks (dp = world_size / cp groups split the batch) and --seq-length must "
        "be divisible by 2 x cp (default: the processes of one node, torchrun's LOCAL_WORLD_SIZE)",
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
    # Without --cp: the processes of one node (each layer's all-gather on the fastest links).
    cp = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if args.cp is None else args.cp
    dp = data_parallel_size(world_size, cp, args.seq_length)  # or ValueError, before any work
    # Only the dp groups split the batch: the cp ranks of a group work on the same sequences.
    run = flags.run_settings(parser, args, dp, device, context_parallel=True)  # per dp group
    model_config.refuse_experts(parser, args, "train_cp.py")  # MoE: not here (NO_EXPERTS says why)
    if run.precision == "fp16":
        raise ValueError(
            "train_cp.py supports --precision bf16 or fp32: fp16 needs loss scaling of sharded "
            "gradients, which this script does not implement"
        )
    # HSDP's grid: --replicate replicas of shard groups of `shards` ranks (or ValueError).
    shards = divide_ranks(world_size, "--replicate", args.replicate, "replicas x shards")
    if args.check:  # every flag passed: stop before any work (run_ddp.sh checks this way first)
        print(f"{parser.prog}: the flags are fine (--check: nothing was run)")
        return
    # The grid of ranks: rank = dp_rank * cp + cp_rank. cp_mesh["cp"] is this rank's CP group
    # (cp consecutive ranks), cp_mesh["dp"] the ranks that hold the same slice in other groups.
    cp_mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    dp_rank, cp_rank = cp_mesh.get_local_rank("dp"), cp_mesh.get_local_rank("cp")
    resume_path = from_rank0(lambda: prepare_out_dir(args, "train_cp.py"), is_main)

    # ---- data ----------------------------------------------------------------------------------
    train_ds, val_ds, tokenizer = training.build_datasets(args, run.tokenizer)
    steps_per_epoch = training.steps_per_epoch(train_ds, args)
    bot_id = tokenizer.bot_id

    def doc_ids(x: torch.Tensor) -> torch.Tensor | None:
        # --document-mask: the document of each token of the whole sequences x (B, T), from
        # which each rank builds its own rows of the mask; the (T, T) mask is never built.
        return document_ids(x, bot_id) if args.document_mask else None

    # Each dp group reads every dp-th sample of one shared shuffle. Over the groups, step s covers
    # exactly samples [s*B, (s+1)*B) of that shuffle: the same global batch that train_dp.py
    # draws, whatever the grid. All cp ranks of a group pass the same dp_rank: the same samples.
    # (--streaming: never called; step_batches reads this rank's shard of the stream instead.)
    def order_for_epoch(epoch: int) -> list[int]:
        sampler = DistributedSampler(train_ds, dp, dp_rank, shuffle=True, seed=args.seed)
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
    # its parameters DTensors that each hold this rank's 1/world_size (HSDP: 1/shards). The cp
    # ranks are in the mesh like the others: to FSDP they are data-parallel ranks.
    for layer in model.layers:
        fully_shard(layer, **shard_options)
    fully_shard(model, **shard_options)
    # cp_model(x, y, doc_ids(x)) takes whole sequences and runs this rank's slice of them through
    # `model` (lib/context_parallel.py). Checkpoints and model.pt are taken from `model` itself.
    cp_model = ContextParallel(model, cp_mesh["cp"])
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
            args, run, cp_model, doc_ids, optimizer, config.vocab_size, device
        )
    # Every dp-th validation sample, nothing dropped or repeated, and the same number of
    # batches on every rank (training.ValidationShard): the summed loss is the whole set's.
    val_loader = training.ValidationShard(val_set, dp_rank, dp, run.micro_batch_size)
    batches = training.step_batches(
        train_ds, order_for_epoch, run.micro_batch_size, run.accumulation,
        steps_per_epoch, start_step, args.num_workers, pin_memory=device.type == "cuda",
        shard=(dp_rank, dp),  # --streaming: this rank's shard of the stream
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
            f"parallelism: {world_size} ranks = dp {dp} x cp {cp} ({args.seq_length // cp} "
            f"tokens of each sequence per rank); sharding: {sharding}, cpu offload "
            f"{args.cpu_offload}, activation checkpointing {args.activation_checkpointing}"
        )
        if args.plan:  # tools/memory_plan.py's estimate (a tool: imported only for --plan)
            from lib import memory

            print(
                memory.estimate_for_run(
                    args, run, config, world_size, cp=cp, replicate=args.replicate
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
        # is split, and padded batches give the same gradient as one big batch would. Each
        # target is in one rank's slice: the slices' counts add up to the whole batch's.
        global_tokens = sum(
            (zigzag_slice(y, cp_rank, cp) != IGNORE_INDEX).sum() for _, y in micro_batches
        )
        dist.all_reduce(global_tokens)
        step_loss = torch.zeros((), device=device)
        for i, (x, y) in enumerate(micro_batches):
            # Gradient accumulation: reduce-scatter only after the last micro-step; before it,
            # each layer accumulates its unsharded gradients locally (FSDP's no_sync).
            model.set_requires_gradient_sync(i == run.accumulation - 1)
            # autocast as in train_ddp.py: with bf16 weights from the policy it changes no
            # matmul, but still runs cross-entropy and softmax in fp32.
            with training.autocast(device, run.precision):
                # x, y: whole sequences; the loss of this rank's slice of them (see point 2).
                loss_sum, _ = cp_model(x, y, doc_ids(x))
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
            metrics.log(step=done, loss=loss, lr=lr, **figures, grad_norm=grad_norm.item())
        if do_eval:
            # Every rank evaluates its slice of its dp group's shard of the data (the forward
            # all-gathers each layer, so every rank must run it), then the sums are added up
            # over all ranks.
            val_sum, val_tokens = training.evaluate(
                cp_model, val_loader, device, run.precision, doc_ids
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
