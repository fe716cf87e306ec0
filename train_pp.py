"""Pretrain a Llama with torchrun + pipeline parallelism (and, with --tp, 3D parallelism).

    torchrun --standalone --nproc_per_node=4 train_pp.py --pp 4 --schedule 1f1b   # 4 GPUs
    torchrun --standalone --nproc_per_node=8 train_pp.py --pp 2 --tp 4           # 3D: pp x tp
    torchrun --standalone --nproc_per_node=2 train_pp.py --pp 2 --schedule interleaved  # CPU

What this adds to train_tp.py: the decoder is cut into stages of consecutive layers (the
embedding on the first, the norm and lm_head on the last), and each rank of a pipeline runs its
own stages (build_stages), sending activations forward and their gradients back to its
neighbours. The grid is (pp, dp, tp): TP inside each stage, FSDP over the dp pipelines. Gradient
accumulation *is* the pipeline: the schedule (GPipe, 1F1B, interleaved) streams the step's
micro-batches through the stages, each busy with a different one; the loss exists on the last
stage, and the gradient norm is summed over the pipeline. docs/pipeline-parallel.md: the
bubble, the layouts, the limits.

Read it top to bottom: the flags, the data, the model, the training loop, the outputs. What
every lesson does alike is in lib/ (around each step, when to log, evaluate, save and stop:
lib/loop.py); what this lesson teaches is here. To run it elsewhere, copy it with model.py,
data.py, masks.py and the lib/ folder.
Read it against the lesson before: `diff train_tp.py train_pp.py`.
"""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.data import DistributedSampler

from lib import distributed, exits, flags, pipeline, sharded_checkpoints, tensor_parallel, training
from lib.checkpoints import TrainingState
from lib.loop import TrainingLoop
from lib.sharded_checkpoints import ShardedSaves, load_shards, safe_load_options
from model import IGNORE_INDEX


def main():
    parser = flags.build_parser("Pretrain a Llama with torchrun + PP (+ TP).", sharded=True)
    pipeline.add_flags(parser)  # --pp, --tp, --schedule, --stages-per-rank
    args = parser.parse_args()
    # torchrun starts N copies of this script, each with its RANK, LOCAL_RANK (its index on its
    # own machine) and WORLD_SIZE in the environment; each computes on the GPU of its local rank.
    rank, local_rank, world_size, device = distributed.torchrun_rank()
    # Join the process group: each rank waits here until all world_size have joined; from then on
    # the collectives (all_reduce, broadcast, ...) run among them: nccl between GPUs, gloo on CPU.
    if not args.check:  # (--check: one process checks the flags, with no group)
        options = distributed.group_options(args, device)  # backend, store (torchrun's), GPU
        dist.init_process_group(rank=rank, world_size=world_size, **options)
    is_main = rank == 0  # global rank 0 alone prints, writes files and shows the progress bar
    # The grid: pp x dp x tp ranks, v stages per rank. Only the dp pipelines split the batch; its
    # accumulation steps are the m micro-batches the schedule streams through each pipeline.
    settings, pp, v, dp = pipeline.check_flags(parser, args, world_size, device)  # checked
    tp, microbatches = args.tp, settings.accumulation
    if flags.check_only(parser, args):  # --check: every flag passed; nothing is run
        return
    # rank = (pp_rank * dp + dp_rank) * tp + tp_rank: a TP group is tp consecutive ranks (a node),
    # then come a stage's dp replicas; the pipeline, the lightest traffic, spans the rest.
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    dp_rank, dp_group = mesh.get_local_rank("dp"), mesh["dp"].get_group()
    pp_rank, pp_group = mesh.get_local_rank("pp"), mesh["pp"].get_group()  # this rank's pipeline
    resume_path = distributed.from_rank0(sharded_checkpoints.prepare_out_dir, is_main, args)

    # ---- data ----------------------------------------------------------------------------------
    train_ds, val_set, tokenizer = training.build_datasets(args, settings.tokenizer)
    attn_mask = training.attention_masks(args, settings, tokenizer)  # mask(x): None unless asked

    # The samples this rank reads in an epoch: every dp-th of one shared shuffle, so that each
    # global batch is train_dp.py's. set_epoch reseeds it with seed + epoch (a new order each
    # epoch); every rank passes the same epoch, so their shares stay disjoint.
    def order_for_epoch(epoch: int) -> list[int]:
        sampler = DistributedSampler(train_ds, dp, dp_rank, shuffle=True, seed=args.seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    # ---- model, optimizer, resume --------------------------------------------------------------
    # Built on the meta device: shapes, no storage. A sharding lesson shards it there, and each
    # rank gives only its part storage (to_empty) and values (init_weights: each weight drawn
    # whole from a seed of its own and sliced): the same weights in every lesson, every layout.
    model, config = training.build_model(args, settings.model, tokenizer.get_vocab_size())
    training.prepare_layers(model, args, loss=False)  # (the last stage runs PipelineLoss)
    # This rank's stages: its own layers, under the full model's names; the rest goes with model.
    stage_models = pipeline.build_stages(model, pp_rank, pp, v, settings.precision)
    # bf16: weights gathered in bf16 (half the traffic), gradients reduced in fp32 into the fp32
    # shards that AdamW updates. fp32: no casts at all, train_ddp.py's results.
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mp_policy = MixedPrecisionPolicy(**bf16 if settings.precision == "bf16" else {})
    for stage_model in stage_models:
        if tp > 1:  # train_tp.py's split in each stage, whose inputs and outputs stay plain tensors
            for layer in stage_model.layers.values():  # (so its sends are the same as without TP)
                parallelize_module(layer, mesh["tp"], tensor_parallel.layer_plan())
            tensor_parallel.apply_tensor_parallel(stage_model, mesh["tp"], loss_parallel=False)
        if dp > 1:  # FSDP over the dp pipelines, weights kept from forward to backward (ZeRO-2)
            options = dict(mesh=mesh["dp"], mp_policy=mp_policy, reshard_after_forward=False)
            for layer in stage_model.layers.values():
                fully_shard(layer, **options)
            fully_shard(stage_model, **options)
        stage_model.to_empty(device=device)
        training.init_weights(stage_model, config, args, device)
    # `model` is now this rank's part: every parameter of its stages, once, under the full
    # model's names (RankModel), for the optimizer, the gradient norm and the checkpoints.
    model = pipeline.RankModel(stage_models)
    # Built on the shards, AdamW's state is sharded like them.
    optimizer = training.build_optimizer(model, args, device.type)
    scheduler = training.build_scheduler(optimizer, args)
    # What a checkpoint holds (with the step, the RNG and the position in the data), and what a
    # resume restores (lib/checkpoints.py).
    state = TrainingState(model, optimizer, scheduler, None, config, tokenizer)
    # DCP reads, on each rank, just the pieces its shards cover, whatever the number of ranks that
    # wrote them (safe_load_options: no pickle in the directory can run code).
    with load_shards(resume_path, state, args) as (to_load, start):  # (None: start at step 0)
        if resume_path:
            dcp.load(to_load, **safe_load_options(resume_path))  # in place, into the shards
    start_step, data_position = start
    # The runtime: a PipelineStage per stage sends and receives activations and gradients with
    # its neighbours in the pp group; the schedule orders every micro-batch's forwards, backwards
    # and sends. scale_grads=False: the loss is normalised already (not divided by m again).
    stage_ids = pipeline.stage_ids_of_rank(pp_rank, pp, v)
    stages = [
        PipelineStage(stage_model, stage_id, pp * v, device, group=pp_group)
        for stage_model, stage_id in zip(stage_models, stage_ids, strict=True)
    ]
    loss_fn = pipeline.PipelineLoss()  # the summed cross-entropy x loss_fn.scale
    schedule = pipeline.SCHEDULES[args.schedule](  # GPipe, 1F1B or interleaved 1F1B
        stages if args.schedule == "interleaved" else stages[0],
        n_microbatches=microbatches,
        loss_fn=loss_fn,
        scale_grads=False,
    )
    is_first = any(stage.is_first for stage in stages)  # this rank feeds the tokens in
    is_last = any(stage.is_last for stage in stages)  # this rank computes the loss
    rows = settings.micro_batch_size  # sequences per forward pass, on each rank
    val_loader = training.ValidationShard(val_set, dp_rank, dp, rows * microbatches)
    start, shard = (start_step, data_position), (dp_rank, dp)  # shard: --streaming's
    batches = training.step_batches(
        args, settings, train_ds, order_for_epoch, rows, device, start, shard
    )

    def run_pipeline(x, y, scale, train: bool) -> list[torch.Tensor]:
        # One pass of the schedule over a pipeline's batch (m x rows, T): the first stage reads
        # x, the last computes the losses (one per micro-batch: returned), every stage gets the
        # attention mask. step: forwards and backwards; eval: forwards alone.
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss_fn.scale, losses = scale, []  # the last stage multiplies each loss sum by scale
        masks = {} if (mask := attn_mask(x)) is None else {"attn_mask": mask}
        run = schedule.step if train else schedule.eval
        inputs, target = (x,) if is_first else (), y if is_last else None
        run(*inputs, target=target, losses=losses, return_outputs=False, **masks)
        return losses

    def evaluate() -> torch.Tensor:
        # Each pipeline its dp share, forward only: the last stage's sums, added up over the
        # pipeline (the other stages add zeros) and over the dp pipelines, divided once.
        val_sum = torch.zeros((), device=device)
        val_tokens = torch.zeros((), device=device, dtype=torch.long)
        with torch.no_grad():
            for vx, vy in val_loader:
                if losses := run_pipeline(vx, vy, 1.0, train=False):  # (the last stage's)
                    val_sum += torch.stack(losses).sum()
                    val_tokens += (vy != IGNORE_INDEX).sum().to(device)
        for total in (val_sum, val_tokens):
            dist.all_reduce(total, group=pp_group)
            dist.all_reduce(total, group=dp_group)
        return val_sum / val_tokens

    saves = ShardedSaves(args, state)  # the checkpoint in flight (--async-save), its group

    def save(step: int) -> None:
        position = training.data_positions(batches)  # --streaming: where the stream is
        # A collective: every rank writes its own shards, and no rank gathers them. Or, with
        # --async-save, copies them to CPU memory, and a thread writes them as training goes on.
        with saves.checkpoint(step, position) as (to_save, path):
            if args.async_save and not loop.stopping:  # (the run's last one is written at once)
                saves.job = dcp.async_save(to_save, checkpoint_id=path, process_group=saves.group)
            else:
                dcp.save(to_save, checkpoint_id=path)

    # ---- training loop -------------------------------------------------------------------------
    layout = pipeline.describe(args, pp, v, dp, microbatches, rows, config.num_hidden_layers)
    plan = dict(tp=tp, pp=pp, schedule=args.schedule, stages_per_rank=v)  # --plan's layout
    loop = TrainingLoop(args, settings, state, device, start_step, layout, **plan)
    for step in loop:
        micro_batches = training.to_device(next(batches), device)
        # Normalise by the number of targets in the whole global batch, not per micro-batch: then
        # every target token weighs the same however the batch is split (micro-batches, ranks),
        # and padded batches give the same gradient as one big batch would.
        global_tokens = sum((y != IGNORE_INDEX).sum() for _, y in micro_batches)
        dist.all_reduce(global_tokens, group=dp_group)  # every stage counts the same tokens
        # One batch for the whole pipeline: the schedule cuts it back into the m micro-batches.
        x, y = (torch.cat(tensors) for tensors in zip(*micro_batches, strict=True))  # (m * rows, T)
        # FSDP averages gradients over the dp pipelines: the factor dp undoes that, leaving sum of
        # all losses / all tokens.
        losses = run_pipeline(x, y, dp / global_tokens, train=True)
        step_loss = (
            torch.stack(losses).sum().detach() if is_last else torch.zeros((), device=device)
        )
        # The global loss, on every rank (queued, no wait): all ranks take the same decisions. The
        # last stage's, summed over the pipeline (the other stages add zeros) and the dp
        # pipelines: dp x the mean loss.
        dist.all_reduce(step_loss, group=pp_group)
        dist.all_reduce(step_loss, group=dp_group)
        step_loss /= dp
        # Each rank holds its own stages' gradients: their squared norms add up over the pipeline.
        max_norm = settings.max_grad_norm
        grad_norm = pipeline.clip_grad_norm_over_pipeline(model.parameters(), max_norm, pp_group)
        if loop.step_ok(step, step_loss, grad_norm):
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # Log, evaluate, save and stop on a signal, each when it is due (lib/loop.py).
        loop.after_step(step, step_loss, grad_norm, evaluate, save)

    # ---- outputs -------------------------------------------------------------------------------
    # model.pt, written on rank 0 one tensor at a time from the checkpoint of the last step.
    sharded_checkpoints.finish_run(args, saves, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    # A known failure ends in one line (lib/exits.py), and the process with os._exit once main()
    # is over: torch.distributed's C++ teardown can abort a finished run (exits.end_process).
    exits.run(main, os_exit=True)
