"""Pretrain a Llama with torchrun + tensor parallelism (Megatron-style), FSDP2 across groups.

    torchrun --standalone --nproc_per_node=8 train_tp.py --model 7b --tp 8   # TP=8 in one node
    torchrun --standalone --nproc_per_node=8 train_tp.py --model 1b --tp 4   # 2D: TP 4 x FSDP 2
    torchrun --standalone --nproc_per_node=8 train_tp.py --model 7b --tp 8 --sequence-parallel
        # and the activations around the norms split along the sequence (1/8 of them per GPU)
    torchrun --standalone --nproc_per_node=2 train_tp.py --tp 2              # no GPU: 2 CPU ranks
    NNODES=4 NODE_RANK=0 MASTER_ADDR=10.0.0.1 SCRIPT=train_tp.py ./run_ddp.sh --model 70b --tp 8
        # 4 nodes x 8 GPUs, the same command on every node (NODE_RANK 0..3): TP=8 inside each
        # node (NVLink), FSDP over the 4 nodes (dp = 32 / 8 = 4)

The ranks form one (dp, tp) grid: world_size = dp x tp. Ranks are numbered node by node, and the
tp dimension is the inner (fastest-changing) one, so each TP group is tp consecutive ranks: the
GPUs of one node when tp <= GPUs per node. That is where TP belongs: it communicates inside
every layer, twice per forward and twice per backward, and only NVLink is fast enough for that.
FSDP communicates once per layer per pass and overlaps it with compute: it crosses nodes.

What this changes in train_fsdp.py, its neighbour (`diff train_fsdp.py train_tp.py` shows each
change; the run of point 2 is lib/tensor_parallel.py, part of this lesson):
  1. A DeviceMesh (dp, tp) instead of one flat group of ranks. The tp ranks of a group read the
     same samples; the data is split over the dp groups only, exactly as train_fsdp.py splits it
     over ranks, so every global batch is the same as in train_dp.py.
  2. apply_tensor_parallel() (lib/tensor_parallel.py holds the run): every matrix is split over the
     tp ranks of a group, with torch.distributed.tensor.parallel (parallelize_module,
     ColwiseParallel, RowwiseParallel).
     In attention and in the MLP the first projections are split by columns (each rank computes
     whole heads / whole hidden units) and the last one by rows, so each block needs a single
     all-reduce in forward and one in backward. The embedding is split by vocabulary rows,
     lm_head by vocabulary columns, and the cross-entropy is computed on the vocab-sharded
     logits (loss_parallel) without ever gathering them. RMSNorm weights are replicated.
     With --sequence-parallel (Megatron-LM's sequence parallelism, Korthikanti et al. 2022), what
     runs between those matrices, whole and identical on every tp rank without it (the residual
     stream, the RMSNorms, the residual adds), is split along the sequence instead: each rank
     keeps T/tp positions, since a norm or an add acts on each position alone. The all-reduce
     after wo, w2 and the embedding becomes a reduce-scatter (each rank receives the sums of its
     own positions), and an all-gather rebuilds the whole sequence before attention, the MLP and
     lm_head. An all-reduce is a reduce-scatter plus an all-gather, so the traffic is the same;
     what autograd stores for the norms, and the residual stream between layers (all that
     --activation-checkpointing keeps), take 1/tp of the memory on each rank. --seq-length must
     divide by --tp. No parameter changes its layout: a checkpoint resumes with or without it.
  3. FSDP (fully_shard) is then applied over the dp dimension only, on top of TP (2D
     parallelism); with dp = 1 there is no FSDP at all, and with tp = 1 this is train_fsdp.py.
     The order is torchtitan's: TP, activation checkpointing, compile, FSDP.
  4. The loss, the target count and the validation sums are all-reduced over the dp group, not
     over every rank: the tp ranks of a group hold the same (replicated) loss.
  Checkpoints (DCP directories, model.pt gathered on rank 0) are train_fsdp.py's, from
  lib/sharded_checkpoints.py: DCP saves DTensors of any layout, and reshards on load, so a run can
  resume with another --tp.
  Not here: --zero-stage (FSDP is ZeRO-3), --cpu-offload, fp16.

Files: to run it, copy it with lib/sharded_checkpoints.py, lib/tensor_parallel.py and the library every
lesson shares: lib/checkpoints.py, lib/flags.py, data.py, lib/distributed.py, lib/metrics.py, model.py,
lib/model_config.py, lib/exits.py, lib/training.py. A module that only an optional feature needs
(--streaming, --plan, another --data, ...) is imported where that feature is used. Its neighbour is
train_fsdp.py: `diff train_fsdp.py train_tp.py`.
"""

import contextlib
import math
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
from torch.utils.data import DistributedSampler, Subset
from tqdm import tqdm

from lib import checkpoints, distributed, exits, flags, model_config, training
from lib.distributed import from_rank0
from lib.metrics import Metrics, NonFiniteGuard, Throughput, bar_postfix
from lib.sharded_checkpoints import (
    load_sharded_checkpoint,
    prepare_out_dir,
    safe_load_options,
    save_sharded_checkpoint,
)
from lib.tensor_parallel import (
    apply_tensor_parallel,
    check_sequence_parallel,
    check_tensor_parallel,
    data_parallel_size,
    layer_plan,
    local_outputs,
    replicate_partial_grads,
)
from model import IGNORE_INDEX, LlamaForPretraining


def main():
    parser = flags.build_parser(
        "Pretrain a Llama with torchrun + tensor parallelism (Megatron-style), FSDP2 across "
        "tensor-parallel groups.",
        distributed=True,
    )
    parser.add_argument(
        "--tp",
        type=flags.number_arg(int, 1),
        default=None,
        help="tensor-parallel ranks per group, at most the GPUs of one node; it must divide the "
        "number of ranks, and FSDP shards over the dp = world_size / tp groups (default: the "
        "processes of one node, torchrun's LOCAL_WORLD_SIZE: TP inside nodes, FSDP across)",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="also split the activations around the norms (and the residual stream) along the "
        "sequence over the tp ranks: the same traffic, 1/tp of their memory per rank (needs "
        "--tp 2 or more and a --seq-length divisible by --tp)",
    )
    args = parser.parse_args()
    rank, local_rank, world_size, device = distributed.torchrun_rank()  # as in train_ddp.py
    if not args.check:  # the process group, as in train_ddp.py
        dist.init_process_group(
            distributed.backend_for(args.backend, device), store=distributed.rendezvous_store(),
            rank=rank, world_size=world_size, device_id=device if device.type == "cuda" else None,
        )  # fmt: skip
    is_main = rank == 0  # global rank 0 alone prints, writes files and shows the progress bar
    # Without --tp: the processes of one node (TP inside nodes, FSDP across them).
    tp = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if args.tp is None else args.tp
    dp = data_parallel_size(world_size, tp)
    # Only the dp groups split the batch: the tp ranks of a group work on the same samples.
    if args.micro_batch_size == "auto":
        # Its probe runs the model's forward and backward outside loss_parallel(), which the
        # vocabulary-sharded loss needs.
        parser.error(
            "--micro-batch-size auto is not supported by train_tp.py; give a number "
            "(python -m tools.memory_plan --tp N estimates what fits)"
        )
    run = flags.run_settings(parser, args, dp, device)  # micro-batch, accumulation, ... per dp group
    model_config.refuse_experts(parser, args, "train_tp.py")  # MoE: not here (NO_EXPERTS says why)
    check_tensor_parallel(model_config.model_shape(args), tp)  # before any data work
    if args.sequence_parallel:
        check_sequence_parallel(tp, args.seq_length)
    if run.precision == "fp16":
        raise ValueError(
            "train_tp.py supports --precision bf16 or fp32: fp16 needs loss scaling of sharded "
            "gradients, which this script does not implement"
        )
    if args.check:  # every flag passed: stop before any work (run_ddp.sh checks this way first)
        print(f"{parser.prog}: the flags are fine (--check: nothing was run)")
        return
    # The grid of ranks: rank = dp_rank * tp + tp_rank. mesh["tp"] is this rank's TP group (tp
    # consecutive ranks), mesh["dp"] the ranks that hold the same shard in the other groups.
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    dp_group = mesh["dp"].get_group()
    resume_path = from_rank0(lambda: prepare_out_dir(args, "train_tp.py"), is_main)

    # ---- data ----------------------------------------------------------------------------------
    train_ds, val_ds, tokenizer = training.build_datasets(args, run.tokenizer)
    steps_per_epoch = training.steps_per_epoch(train_ds, args)
    attn_mask = training.attention_masks(args, run, tokenizer)  # mask(x): None unless asked

    # Each dp group reads every dp-th sample of one shared shuffle. Over the groups, step s covers
    # exactly samples [s*B, (s+1)*B) of that shuffle: the same global batch that train_dp.py
    # draws, whatever the grid. All tp ranks of a group pass the same dp_rank: the same samples.
    # (--streaming: never called; step_batches reads this rank's shard of the stream instead.)
    def order_for_epoch(epoch: int) -> list[int]:
        sampler = DistributedSampler(train_ds, dp, dp_rank, shuffle=True, seed=args.seed)
        # set_epoch reseeds the shuffle with seed + epoch: without it every epoch would repeat the
        # first one's order. All ranks pass the same epoch, so their shards stay disjoint.
        sampler.set_epoch(epoch)
        return list(sampler)

    val_set = Subset(val_ds, range(min(len(val_ds), args.eval_batches * args.batch_size)))
    # Every dp-th validation sample, nothing dropped or repeated, and the same number of
    # batches on every rank (training.ValidationShard): the summed loss is the whole set's.
    val_loader = training.ValidationShard(val_set, dp_rank, dp, run.micro_batch_size)

    # ---- model, sharding, optimizer, resume -----------------------------------------------------
    model, config = training.build_model(args, run.model, tokenizer.get_vocab_size())
    model.to(device)
    # torchtitan's order: TP first (it changes the layers' computation), then activation
    # checkpointing and compilation of each (now tensor-parallel) layer, then FSDP around them.
    if tp > 1:
        # Megatron's plan in every decoder layer (layer_plan: wq, wk, wv, w1 and w3 split by
        # columns, wo and w2 by rows, each half ending in one all-reduce), then what surrounds
        # the layers: the embedding, the norms and lm_head (apply_tensor_parallel).
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], layer_plan(args.sequence_parallel))
        apply_tensor_parallel(
            model, mesh["tp"], loss_parallel=True, sequence_parallel=args.sequence_parallel
        )
    if args.activation_checkpointing:
        training.apply_activation_checkpointing(model)
    if args.compile:
        training.compile_layers(model, loss=False)  # loss_parallel(): see compile_layers
    if dp > 1:
        # bf16: weights are all-gathered in bf16 (half the traffic and memory of fp32) and
        # gradients reduce-scattered in fp32 into fp32 shards, which stay the master weights
        # AdamW updates. fp32: no casts at all, so the result equals train_dp.py's.
        bf16 = run.precision == "bf16"
        mp_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        )
        # Layers first, then the root, as in train_fsdp.py, but over mesh["dp"]: each TP shard
        # is split again over the dp groups (a parameter becomes a 2-D DTensor on the grid), and
        # gradients are reduce-scattered between the ranks that hold the same TP shard.
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"], mp_policy=mp_policy)
        fully_shard(model, mesh=mesh["dp"], mp_policy=mp_policy)
    if tp > 1:
        # Registered last, so that it runs after FSDP's own hooks: they see the model's outputs.
        model.register_forward_hook(local_outputs)
    # Built after sharding, on the shards: AdamW's state is sharded like them.
    optimizer = training.build_optimizer(model, args, device.type)
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
        print(
            f"parallelism: {world_size} ranks = dp {dp} x tp {tp} (tensor parallel "
            f"{tp > 1}, sequence parallel {args.sequence_parallel}, FSDP {dp > 1}), activation "
            f"checkpointing {args.activation_checkpointing}"
        )
        if args.plan:  # tools/memory_plan.py's estimate (a tool: imported only for --plan)
            from lib import memory

            print(
                memory.estimate_for_run(
                    args, run, config, world_size, tp=tp, sequence_parallel=args.sequence_parallel
                )
            )

    # ---- training loop -------------------------------------------------------------------------
    guard = NonFiniteGuard(device, skip=args.skip_nonfinite)
    throughput = Throughput(config, args, device, world_size)  # tokens/s, MFU, ...
    stop_request = exits.StopRequest(device)  # Ctrl-C, SIGTERM: stop cleanly (see there)
    # The cross-entropy of vocab-sharded logits, forward and backward, runs under loss_parallel.
    vocab_parallel = loss_parallel if tp > 1 else contextlib.nullcontext
    bar = tqdm(range(start_step, args.max_steps), initial=start_step, total=args.max_steps,
               desc="train", disable=not is_main)  # fmt: skip
    for step in bar:
        lr = optimizer.param_groups[0]["lr"]
        # Copied to the device first, asynchronously, and counted there (as train_fsdp.py).
        micro_batches = [
            (x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            for x, y in next(batches)
        ]
        # Normalise by the number of targets in the whole global batch (all micro-batches, all dp
        # groups), not per micro-batch: then every target token weighs the same however the batch
        # is split. Summed over the dp group only: the tp ranks of a group count the same tokens.
        global_tokens = sum((y != IGNORE_INDEX).sum() for _, y in micro_batches)
        dist.all_reduce(global_tokens, group=dp_group)
        step_loss = torch.zeros((), device=device)
        for i, (x, y) in enumerate(micro_batches):
            if dp > 1:
                # Gradient accumulation: reduce-scatter only after the last micro-step.
                model.set_requires_gradient_sync(i == run.accumulation - 1)
            with vocab_parallel():
                # autocast as in train_fsdp.py: with bf16 weights from the policy it changes no
                # matmul, but still runs cross-entropy and softmax in fp32.
                with training.autocast(device, run.precision):
                    loss_sum, _ = model(x, y, attn_mask(x))
                # FSDP averages gradients over the dp groups: the factor dp undoes that, leaving
                # sum of all losses / all tokens. (TP needs no factor: each rank's gradient is
                # its own shard's gradient of that one loss.)
                loss = loss_sum * dp / global_tokens
                loss.backward()
            step_loss += loss_sum.detach()
        # The global loss, on every rank (no wait for it here: the all-reduce is queued like any
        # other kernel). Every rank then takes the same decisions about it below.
        dist.all_reduce(step_loss, group=dp_group)
        if args.sequence_parallel:  # the norms' gradients are Partial sums: add them up first
            replicate_partial_grads(model.parameters())  # (see there: clipping on every torch)
        # The gradients are DTensors (sharded over tp, and over dp too with FSDP): clip_grad_norm_
        # adds up the squared norms of the shards over the grid, so every rank measures (and
        # clips by) the norm of the whole gradient. Replicated norm weights are counted once.
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), args.grad_clip if args.grad_clip > 0 else math.inf
        )
        if isinstance(grad_norm, DTensor):  # a plain tensor for one rank (no TP, no FSDP)
            grad_norm = grad_norm.full_tensor()  # replicated on every rank: no traffic
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
            # Every rank evaluates (each layer's forward is a collective over its tp group, and
            # FSDP's all-gathers over dp); each dp group its own shard of the data, and the sums
            # are added up over the dp groups.
            with vocab_parallel():
                val_sum, val_tokens = training.evaluate(
                    model, val_loader, device, run.precision, attn_mask
                )
            dist.all_reduce(val_sum, group=dp_group)
            dist.all_reduce(val_tokens, group=dp_group)
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
    # Gather the full weights from their TP (and FSDP) shards: a collective, so every rank calls
    # it; with cpu_offload=True only rank 0 receives them, in CPU memory (the others get an empty
    # dict). Loaded into a plain model, they make the same model.pt as every other script writes.
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
