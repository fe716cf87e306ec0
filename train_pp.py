"""Pretrain a Llama with torchrun + pipeline parallelism (and, with --tp, 3D parallelism).

    torchrun --standalone --nproc_per_node=4 train_pp.py --pp 4 --schedule 1f1b    # 4 GPUs
    torchrun --standalone --nproc_per_node=4 train_pp.py --pp 4 --schedule interleaved
    torchrun --standalone --nproc_per_node=8 train_pp.py --pp 4                   # + 2-way FSDP
    torchrun --standalone --nproc_per_node=8 train_pp.py --pp 2 --tp 4            # + TP: 3D
    torchrun --standalone --nproc_per_node=2 train_pp.py --pp 2 --schedule 1f1b    # no GPU: gloo

The decoder is cut into consecutive groups of layers, one group per *stage*; the token embeddings
go with the first stage, the final norm and lm_head with the last. Each rank runs its stage(s)
only and passes activations forward (and their gradients backward) to its neighbours with
point-to-point sends. torch.distributed.pipelining does the scheduling and the sends.

What this changes in train_tp.py, its neighbour (`diff train_tp.py train_pp.py` shows each
change; the flags and their checks, the stages and the last stage's loss are lib/pipeline.py, part
of this lesson):
  1. A DeviceMesh (pp, dp, tp) instead of (dp, tp): dp = world_size / (pp x tp) pipelines each
     train on their own 1/dp of the global batch. With --tp > 1 every stage's matrices are split
     over tp ranks exactly as train_tp.py splits the model's (apply_tensor_parallel,
     lib/tensor_parallel.py; here --tp defaults to 1), and with dp > 1 every stage is sharded over
     its dp group with FSDP2 (fully_shard), as train_tp.py shards the whole model: 3D
     parallelism, as used for BLOOM-176B.
  2. No rank holds the whole model: build_stages() (lib/pipeline.py) keeps this rank's layers, under
     the full model's parameter names (layers.<original index>), so the stages' state dicts
     together are exactly the full model's, and checkpoints are the same DCP directories as
     train_tp.py's and train_fsdp.py's. model.pt is read back from the last of them on rank 0.
  3. Gradient accumulation *is* the pipeline: the rank's share of the batch is cut into m
     micro-batches, and the schedule streams them through the stages, so that every stage is
     busy with a different micro-batch. The loop calls schedule.step() once per optimizer step;
     the loss function runs on the last stage only.
  4. Everything global needs a reduction over the pipeline too: the loss exists on the last stage
     only, and each rank holds only its own layers' gradients, so the gradient norm that
     clipping uses is combined over the pp group.
  Not here: train_tp.py's --sequence-parallel and its vocabulary-parallel loss (see Limits), and
  FSDP's bf16 policy (autocast runs inside each stage instead).

The bubble: a stage cannot start before the previous one has handed it its first micro-batch,
nor finish before the last one has handed back its last gradient. With p stages and m
micro-batches, GPipe (all forwards, then all backwards) and 1F1B (one forward, one backward in
the steady state: the same bubble, but at most p micro-batches' activations alive instead of m)
leave each rank idle (p-1)/(m+p-1) of the step. Interleaved 1F1B gives each rank v smaller
stages (rank r holds stages r, r+p, r+2p, ...), which cuts the bubble to (p-1)/(v*m+p-1), at the
price of v times more sends. So: many micro-batches (m >= 4p is a common rule), and the default
micro-batch size here is 1 sequence (as in Megatron-LM and torchtitan).

Layouts. The mesh is (pp, dp, tp), tp varying fastest, and torchrun numbers ranks node by node:
a TP group is tp consecutive ranks (keep it inside a node: two all-reduces per layer need
NVLink), a stage's dp replicas come next, and the pipeline, whose traffic is the lightest (one
activation per micro-batch between neighbouring stages), spans the rest, across nodes.
  - One 8-GPU node: --pp 8 (one pipeline), or --pp 4 / --pp 2 with FSDP over the other factor
    (dp 2 or 4): fewer stages, a smaller bubble; or --pp 2 --tp 4.
  - Several nodes, every node running the same command, e.g. 4 nodes x 8 GPUs:
        SCRIPT=train_pp.py NNODES=4 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./run_ddp.sh --pp 4 --tp 8
    tp 8 (one node) x pp 4 (one stage per node); or --pp 4 --tp 4: 2 FSDP replicas of each stage
    inside a node; or --pp 32: one long pipeline, whose only network traffic is activations.

Limits: every rank first builds the whole model on the CPU (with the seed, so the weights equal
every other script's) and then keeps its own stages; the model must fit in host memory once per
local process. Tied embeddings (the 1b preset) put one tensor on the first and the last stage and
are refused with --pp > 1. --precision fp16 is refused (a grad scaler across stages is not
implemented); bf16 autocast works as everywhere else. With --tp, lm_head's logits are gathered
on the last stage (train_tp.py's vocabulary-parallel loss is not used across the pipeline).

Files: to run it, copy it with lib/pipeline.py, lib/sharded_checkpoints.py, lib/tensor_parallel.py and the
library every lesson shares: lib/checkpoints.py, lib/flags.py, data.py, lib/distributed.py, lib/metrics.py, model.py,
lib/model_config.py, lib/exits.py, lib/training.py. A module that only an optional feature needs
(--streaming, --plan, another --data, ...) is imported where that feature is used. Its neighbour is
train_tp.py: `diff train_tp.py train_pp.py`.
"""

import math
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.data import DistributedSampler, Subset
from tqdm import tqdm

from lib import checkpoints, distributed, exits, flags, training
from lib.distributed import from_rank0
from lib.metrics import Metrics, NonFiniteGuard, Throughput, bar_postfix
from lib.pipeline import (
    SCHEDULES,
    PipelineLoss,
    RankModel,
    bubble_fraction,
    build_parser,
    build_stages,
    check_pipeline_args,
    clip_grad_norm_over_pipeline,
    load_checkpoint_weights,
    split_layers,
    stage_ids_of_rank,
)
from lib.sharded_checkpoints import (
    load_sharded_checkpoint,
    prepare_out_dir,
    safe_load_options,
    save_sharded_checkpoint,
)
from lib.tensor_parallel import apply_tensor_parallel, layer_plan
from model import IGNORE_INDEX, LlamaForPretraining


def main():
    parser = build_parser()  # lib/pipeline.py: every script's flags, and --pp, --tp, --schedule, ...
    args = parser.parse_args()
    rank, local_rank, world_size, device = distributed.torchrun_rank()  # as in train_ddp.py
    if not args.check:  # the process group, as in train_ddp.py
        dist.init_process_group(
            distributed.backend_for(args.backend, device), store=distributed.rendezvous_store(),
            rank=rank, world_size=world_size, device_id=device if device.type == "cuda" else None,
        )  # fmt: skip
    is_main = rank == 0  # global rank 0 alone prints, writes files and shows the progress bar
    run, pp, v, dp = check_pipeline_args(parser, args, world_size, device)
    microbatches = run.accumulation  # m: the micro-batches the schedule streams per step
    if args.check:  # every flag passed: stop before any work (run_ddp.sh checks this way first)
        print(f"{parser.prog}: the flags are fine (--check: nothing was run)")
        return
    tp = args.tp  # tensor-parallel ranks inside each stage (default 1: none)
    num_stages = pp * v
    # The 3D mesh: rank = (pp_rank * dp + dp_rank) * tp + tp_rank. The last dimension varies
    # fastest: a tensor-parallel group is tp consecutive ranks, on one node (its all-reduces, in
    # every layer, need NVLink); next come the dp replicas of a stage (FSDP's gathers); the
    # pipeline is the outermost dimension, the one that crosses nodes (its traffic, one
    # activation per micro-batch between neighbours, is the lightest). torchtitan's order.
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    dp_group = mesh["dp"].get_group()
    pp_rank = mesh.get_local_rank("pp")  # which stage(s) of its pipeline this rank runs
    pp_group = mesh["pp"].get_group()  # the ranks of this rank's pipeline, one per stage
    resume_path = from_rank0(lambda: prepare_out_dir(args, "train_pp.py"), is_main)

    # ---- data ----------------------------------------------------------------------------------
    train_ds, val_ds, tokenizer = training.build_datasets(args, run.tokenizer)
    steps_per_epoch = training.steps_per_epoch(train_ds, args)
    attn_mask = training.attention_masks(args, run, tokenizer)  # mask(x): None unless asked

    # The shards are per pipeline (dp rank), not per process: every stage of one pipeline reads
    # the same samples. The first stage needs the tokens, the last the targets, and all of them
    # the target count and the attention mask; reading a batch of token ids costs nothing next to
    # sending it. Over the dp ranks, step s covers samples [s*B, (s+1)*B) of one shuffle, as in
    # every other script.
    # (--streaming: never called; step_batches reads this rank's shard of the stream instead.)
    def order_for_epoch(epoch: int) -> list[int]:
        sampler = DistributedSampler(train_ds, dp, dp_rank, shuffle=True, seed=args.seed)
        sampler.set_epoch(epoch)  # the same shuffle on every rank, a new one each epoch
        return list(sampler)

    val_set = Subset(val_ds, range(min(len(val_ds), args.eval_batches * args.batch_size)))
    rows = microbatches * run.micro_batch_size  # sequences per pipeline per step
    val_loader = training.ValidationShard(val_set, dp_rank, dp, rows)

    # ---- model, stages, data parallelism, optimizer, resume ------------------------------------
    model, config = training.build_model(args, run.model, tokenizer.get_vocab_size())
    # Applied to the whole model's layers before the split: the stages hold these same layers.
    if args.activation_checkpointing:
        training.apply_activation_checkpointing(model)
    if args.compile:
        training.compile_layers(model, loss=False)  # the last stage runs PipelineLoss
    stage_models = build_stages(model, pp_rank, pp, v, device, run.precision)
    del model  # the layers of the other ranks' stages are freed with it
    if tp > 1:
        # Tensor parallelism inside each stage: train_tp.py's split of every matrix over the tp
        # ranks. The stage's inputs and outputs stay plain replicated tensors, so the pipeline
        # sends exactly what it would without TP. lm_head all-gathers the logits here
        # (loss_parallel=False): the vocabulary-parallel loss of train_tp.py would need its
        # loss_parallel() context around the schedule's backward of the last stage too.
        for stage_model in stage_models:
            for layer in training.decoder_layers(stage_model):
                parallelize_module(layer, mesh["tp"], layer_plan())
            apply_tensor_parallel(stage_model, mesh["tp"], loss_parallel=False)
    if dp > 1:
        # FSDP across the pipelines: each layer a unit, then each stage the root of the rest
        # (embeddings, final norm, lm_head), as train_fsdp.py does for the whole model. The
        # weights stay gathered between forward and backward (ZeRO-2's choice): with m
        # micro-batches, freeing them would re-gather them m times per step. The schedule tells
        # FSDP when the last backward of the step is done, and only then are gradients
        # reduce-scattered (averaged over dp, like DDP).
        for stage_model in stage_models:
            for layer in stage_model.layers.values():
                fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
            fully_shard(stage_model, mesh=mesh["dp"], reshard_after_forward=False)
    # From here on, `model` is this rank's part of the model: every parameter of its stages,
    # once, under the full model's names (RankModel), for the optimizer, the gradient norm and
    # the checkpoints. The stages (the same modules) run the computation.
    model = RankModel(stage_models)
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
    # The runtime side: a PipelineStage per stage knows its index, its neighbours' ranks in the
    # pp group, and sends/receives activations and gradients. The schedule orders the forwards,
    # backwards and sends of all micro-batches. scale_grads=False: the loss is already
    # normalised by the global number of targets (the schedule would divide by m again).
    stages = [
        PipelineStage(stage_model, s, num_stages, device, group=pp_group)
        for stage_model, s in zip(stage_models, stage_ids_of_rank(pp_rank, pp, v), strict=True)
    ]
    loss_fn = PipelineLoss()  # summed cross-entropy x loss_fn.scale, set by run_pipeline
    schedule = SCHEDULES[args.schedule](  # ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B
        stages if args.schedule == "interleaved" else stages[0],
        n_microbatches=microbatches,
        loss_fn=loss_fn,
        scale_grads=False,
    )
    is_first = any(stage.is_first for stage in stages)  # this rank feeds the tokens in
    is_last = any(stage.is_last for stage in stages)  # this rank computes the loss
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
        layers = [len(r) for r in split_layers(config.num_hidden_layers, num_stages)]
        bubble = bubble_fraction(args.schedule, pp, microbatches, v)
        formula = "(p-1)/(v*m+p-1)" if args.schedule == "interleaved" else "(p-1)/(m+p-1)"
        print(
            f"pipeline: {args.schedule} schedule, {num_stages} stages on {pp} ranks "
            f"({v} per rank), layers per stage {layers}, m = {microbatches} micro-batches of "
            f"{run.micro_batch_size} sequences per pipeline, {dp} data-parallel pipelines, "
            f"tensor parallel {tp} inside each stage; "
            f"bubble {formula} = {bubble:.1%}"
        )
        if args.plan:  # tools/memory_plan.py's estimate (a tool: imported only for --plan)
            from lib import memory

            print(
                memory.estimate_for_run(
                    args, run, config, world_size, tp, pp, args.schedule, v
                )
            )

    # ---- training loop -------------------------------------------------------------------------
    guard = NonFiniteGuard(device, skip=args.skip_nonfinite)
    throughput = Throughput(config, args, device, world_size)  # tokens/s, MFU, ...
    stop_request = exits.StopRequest(device)  # Ctrl-C, SIGTERM: stop cleanly (see there)
    final_checkpoint = resume_path  # model.pt is read back from the last checkpoint
    bar = tqdm(range(start_step, args.max_steps), initial=start_step, total=args.max_steps,
               desc="train", disable=not is_main)  # fmt: skip

    def run_pipeline(x, y, scale, losses, train: bool):
        """One pass of the schedule over the pipeline's batch x, y (rows, T), m micro-batches.

        Only the first stage reads x and only the last computes the loss on y; every stage gets
        the attention mask (a keyword argument reaches every stage), built from x, which every
        rank of the pipeline has read.
        """
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        mask = attn_mask(x)
        loss_fn.scale = scale  # what the last stage multiplies each micro-batch's loss sum by
        run = schedule.step if train else schedule.eval
        run(
            *((x,) if is_first else ()),
            target=y if is_last else None,
            losses=losses,
            return_outputs=False,  # keep no logits: the losses are all this loop needs
            **({} if mask is None else {"attn_mask": mask}),
        )

    for step in bar:
        lr = optimizer.param_groups[0]["lr"]
        # On the device first, asynchronously, and the targets counted there: a count made on
        # the CPU and copied over would make the CPU wait for the previous step every step.
        micro_batches = [
            (x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            for x, y in next(batches)
        ]
        # Normalise by the number of targets in the whole global batch (all micro-batches, all
        # dp ranks), as in every script. FSDP averages gradients over dp ranks; the factor dp
        # undoes that, leaving sum of all losses / all targets.
        global_tokens = sum((y != IGNORE_INDEX).sum() for _, y in micro_batches)
        dist.all_reduce(global_tokens, group=dp_group)
        # One batch for the whole pipeline: the schedule cuts it back into the same m micro-batches.
        x = torch.cat([x for x, _ in micro_batches])  # (m * micro, T)
        y = torch.cat([y for _, y in micro_batches])
        step_loss = torch.zeros((), device=device)
        losses = []  # filled on the last stage: one scaled loss per micro-batch
        run_pipeline(x, y, dp / global_tokens, losses, train=True)
        if is_last:
            step_loss += torch.stack(losses).sum().detach()
        # The global loss, on every rank: the last stage's, sent along the pipeline (the other
        # stages add zeros), then added up over the pipelines; the scaled losses add up to dp x
        # the mean loss. (No wait for it here: the all-reduces are queued like any other kernel.)
        dist.all_reduce(step_loss, group=pp_group)
        dist.all_reduce(step_loss, group=dp_group)
        step_loss /= dp
        grad_norm = clip_grad_norm_over_pipeline(
            model.parameters(), args.grad_clip if args.grad_clip > 0 else math.inf, pp_group
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
            loss = step_loss.item()
            figures = throughput.figures()
            bar.set_postfix(bar_postfix(loss, lr, figures))
            metrics.log(step=done, loss=loss, lr=lr, **figures, grad_norm=grad_norm.item())
        if do_eval:
            # Forward only, through the same pipeline: the schedule's eval() runs the forwards
            # and the loss of every micro-batch, no backward. Sums, added up over the micro-
            # batches, the pipeline and the dp ranks, divided once. (Switching between eval()
            # and step() makes the schedule infer again the shapes its stages send: one extra
            # forward of one micro-batch, which changes no result.)
            val_sum = torch.zeros((), device=device)
            val_tokens = torch.zeros((), device=device, dtype=torch.long)
            with torch.no_grad():
                for vx, vy in val_loader:
                    losses = []
                    run_pipeline(vx, vy, 1.0, losses, train=False)
                    if is_last:
                        val_sum += torch.stack(losses).sum()
                        val_tokens += (vy != IGNORE_INDEX).sum().to(device)
            dist.all_reduce(val_sum, group=pp_group)  # the last stage's sums, on every stage
            dist.all_reduce(val_tokens, group=pp_group)
            dist.all_reduce(val_sum, group=dp_group)
            dist.all_reduce(val_tokens, group=dp_group)
            val_loss = (val_sum / val_tokens).item()
            metrics.log_validation(done, val_loss)  # printed on rank 0 too
            throughput.restart()  # keep evaluation time out of the tokens/s figure
        if do_save:
            # Every rank writes its own stages' parameters and AdamW state, under the full
            # model's names (a collective, never inside is_main).
            data_position = training.data_positions(batches)  # --streaming; a collective
            with save_sharded_checkpoint(
                args, done, model, optimizer, scheduler, config, tokenizer, is_main, data_position
            ) as (state, path):
                dcp.save(state, checkpoint_id=path)  # each rank its own shards, no gather
            final_checkpoint = os.path.join(args.out_dir, "checkpoints", f"step_{done:07d}")
            throughput.restart()
        if stop:
            raise exits.Stopped(done, stop_request.signal)  # exits.run says so and exits

    # ---- outputs -------------------------------------------------------------------------------
    # The last checkpoint already holds every tensor of the model, under its full name, whatever
    # the layout that wrote it (pp, dp, interleaved): rank 0 reads it back into a plain model
    # (DCP without collectives), rather than gathering every stage's tensors over the network
    # with code of its own. Like resuming, it needs --out-dir on a filesystem rank 0 can read.
    if is_main:
        plain = LlamaForPretraining(config)
        load_checkpoint_weights(plain, final_checkpoint)  # safe_load in this process alone
        training.finish_run(args, plain, config, tokenizer, device)
    stop_request.finish()  # no collective of it left in flight when the process group goes
    dist.barrier()  # the run is over when rank 0's files are written, for every rank
    dist.destroy_process_group()


if __name__ == "__main__":
    # A known failure ends in one line; the process ends with os._exit once main() is over
    # (exits.end_process: torch.distributed's C++ teardown can abort a finished run).
    exits.run(main, os_exit=True)
