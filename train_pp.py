"""Pretrain a Llama with torchrun + pipeline parallelism (and, with --tp, 3D parallelism).

    torchrun --standalone --nproc_per_node=4 train_pp.py --pp 4 --schedule 1f1b   # 4 GPUs
    torchrun --standalone --nproc_per_node=8 train_pp.py --pp 2 --tp 4           # 3D: pp x tp
    torchrun --standalone --nproc_per_node=2 train_pp.py --pp 2 --schedule interleaved  # CPU

What this adds to train_tp.py: the decoder is cut into stages of consecutive layers (the
embedding on the first, the norm and lm_head on the last); each rank of a pipeline runs its own
stages, sending activations forward and their gradients back to its neighbours. The grid is (pp,
dp, tp): TP inside each stage, FSDP over the dp pipelines. Gradient accumulation *is* the
pipeline: the schedule (GPipe, 1F1B, interleaved) streams the step's micro-batches through the
stages, each busy with a different one; the loss exists on the last stage, and the gradient norm
is summed over the pipeline. docs/pipeline-parallel.md: the bubble, the layouts, the limits.

Read it top to bottom: the flags, the data, the model, the training loop, the outputs. What
every lesson does alike is in lib/ (around each step, when to log, evaluate, save and stop:
lib/loop.py); what this lesson teaches is here. To run it elsewhere, copy it with model.py,
data.py, masks.py and the lib/ folder.
Read it against the lesson before: `diff train_tp.py train_pp.py`.
"""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.data import DistributedSampler

from lib import distributed, exits, flags, training
from lib.checkpoints.sharded import Checkpoints, TrainingState
from lib.loop import TrainingLoop
from lib.parallel import pipeline, tensor_parallel
from model import IGNORE_INDEX


def main():
    parser = flags.build_parser("Pretrain a Llama with torchrun + PP (+ TP).", sharded=True)
    pipeline.add_flags(parser)  # --pp, --schedule, --stages-per-rank, and TP's and FSDP's
    args = parser.parse_args()
    # torchrun starts N copies of this script, each with its RANK, LOCAL_RANK (its index on its
    # own machine) and WORLD_SIZE in the environment; each computes on the GPU of its local rank.
    rank, local_rank, world_size, device = distributed.torchrun_rank()
    # Join the process group: each rank waits here until all world_size have joined; from then on
    # the collectives (all_reduce, broadcast, ...) run among them: nccl between GPUs, gloo on CPU.
    if not args.check:  # (--check: one process checks the flags, with no group)
        options = distributed.group_options(args, device)  # backend, store (torchrun's), GPU
        dist.init_process_group(rank=rank, world_size=world_size, **options)
    # The grid: pp x dp x tp ranks. Only the dp pipelines split the batch, each in m micro-batches.
    layout = pipeline.setup(parser, args, world_size, device)  # checked; the device mesh
    settings = pipeline.run_settings(parser, args, layout, device)  # checked
    dp, dp_rank = layout.dp, layout.dp_rank  # the data-parallel groups, and which this rank is in
    if flags.check_only(parser, args):  # --check: every flag passed; nothing is run
        return
    checkpoints = Checkpoints(args)  # DCP: every rank writes its own shards
    resume_path = checkpoints.prepare_out_dir()

    # ---- data ----------------------------------------------------------------------------------
    train_ds, val_set, tokenizer = training.build_datasets(args, settings.tokenizer)
    attn_mask = training.attention_masks(args, settings, tokenizer)  # mask(x): None unless asked

    # The samples this rank reads in an epoch: every dp-th of one shuffle seeded with seed + epoch
    # by set_epoch on every rank (disjoint shares): together, the batches train_dp.py reads.
    def epoch_order(epoch: int) -> list[int]:
        sampler = DistributedSampler(train_ds, dp, dp_rank, shuffle=True, seed=args.seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    # ---- model, optimizer, resume --------------------------------------------------------------
    # Built on the meta device (shapes, no storage), sharded there; then each rank gives its part
    # storage and values, each weight drawn from a seed of its own: the same in every layout.
    model, config = training.build_model(args, settings.model, tokenizer.get_vocab_size())
    # torchtitan's order: TP first (it changes each layer's computation), then activation
    # checkpointing and compilation of the tensor-parallel layers, then FSDP around them, over the
    # dp ranks: each TP shard is split again (2-D DTensors) and reduce-scattered among its holders.
    tp_mesh = layout.mesh["tp"]  # Megatron's plan in every layer, then embedding, norms, lm_head
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, tensor_parallel.layer_plan(args.sequence_parallel))
    tensor_parallel.apply_tensor_parallel(model, tp_mesh, args.sequence_parallel, False)
    training.prepare_layers(model, args, loss=False)  # (the last stage runs PipelineLoss)
    # False: lm_head gathers the logits. This rank's stages: its layers, by the full model's names.
    stage_models = pipeline.build_stages(model, layout, settings.precision)
    pp_rank, pp_group = layout.mesh.get_local_rank("pp"), layout.mesh["pp"].get_group()
    # bf16: weights gathered in bf16, gradients reduced in fp32 into fp32 shards (else no casts).
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mp_policy = MixedPrecisionPolicy(**bf16 if settings.precision == "bf16" else {})
    # fsdp_mesh: None, FSDP over all ranks, or HSDP's (--replicate R: R replicas of a shard group).
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if args.cpu_offload else None
    options = dict(mesh=layout.fsdp_mesh, reshard_after_forward=args.zero_stage == 3)
    options |= dict(mp_policy=mp_policy) | ({"offload_policy": offload} if offload else {})
    # Stage by stage: layers first, then the stage's root, which takes what no layer of it owns.
    for stage_model in stage_models:
        for layer in stage_model.layers.values():
            fully_shard(layer, **options)
        fully_shard(stage_model, **options)
        stage_model.to_empty(device="cpu" if offload else device)  # (offload: in CPU memory)
        training.init_weights(stage_model, config, args, device)
    # `model`: this rank's part, its stages' parameters under the full model's names (RankModel).
    model = pipeline.RankModel(stage_models)
    # Built on the shards, AdamW's state is sharded like them (in CPU memory with offload).
    optimizer = training.build_optimizer(model, args, "cpu" if offload else device.type)
    scheduler = training.build_scheduler(optimizer, args)
    scaler = torch.amp.GradScaler(device.type, enabled=settings.precision == "fp16")
    # What a checkpoint holds and a resume restores, with the step, RNG and data position.
    state = TrainingState(model, optimizer, scheduler, scaler, config, tokenizer)
    # dcp.load: each rank reads just its shards' pieces, however many ranks wrote them (lib/).
    start_step, data_position = checkpoints.resume(resume_path, state)
    # --micro-batch-size auto: the largest that fits, measured with the model as it trains.
    settings, layout = pipeline.measured(settings, args, layout, state, attn_mask, device)
    # Each stage sends activations on and gradients back; the schedule orders its m micro-batches.
    num_stages, m = layout.pp * layout.stages_per_rank, settings.accumulation
    stages = [PipelineStage(s, s.index, num_stages, device, group=pp_group) for s in stage_models]
    loss_fn = pipeline.PipelineLoss()  # the summed cross-entropy x loss_fn.scale
    Schedule = pipeline.SCHEDULES[args.schedule]  # GPipe, 1F1B or interleaved 1F1B
    runs = stages if args.schedule == "interleaved" else stages[0]
    schedule = Schedule(runs, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    is_first, is_last = pp_rank == 0, pp_rank == layout.pp - 1  # tokens go in; the loss comes out
    rows = settings.micro_batch_size  # sequences per forward pass, on each rank
    val_loader = training.ValidationShard(val_set, dp_rank, dp, rows * m, device)
    start, shard = (start_step, data_position), (dp_rank, dp)  # (for --streaming)
    batches = training.step_batches(
        args, settings, train_ds, epoch_order, rows, device, start, shard
    )

    def run_schedule(x, y, scale, train: bool) -> torch.Tensor:
        # One run of the schedule over a pipeline's batch (m x rows, T; eval: forwards alone): the
        # first stage reads x, the last sums each micro-batch's loss x scale, every stage gets the
        # mask. The last stage's loss sum (pipeline.scoring: its rows' scores); 0 on the others.
        loss_fn.scale, losses, mask = scale, [], attn_mask(x)
        inputs, masks = (x,) if is_first else (), {} if mask is None else {"attn_mask": mask}
        run = schedule.step if train else schedule.eval
        run(*inputs, target=y if is_last else None, losses=losses, return_outputs=False, **masks)
        return pipeline.joined(losses, device) / scale

    def evaluate() -> torch.Tensor:
        # Each pipeline its dp share, forward only: the last stage's sums, over pp, then over dp.
        totals = pipeline.evaluate(run_schedule, val_loader, loss_fn, is_last)  # (--eval-tasks)
        dist.all_reduce(totals, group=pp_group)
        dist.all_reduce(totals, group=layout.dp_group)  # (loss sum, targets, their bytes)
        return totals

    def save(step: int) -> None:
        # A collective: every rank writes its own shards, and no rank gathers them (--async-save:
        # copies them to CPU memory, and a thread writes them as training goes on).
        with checkpoints.saving(step, state, training.data_positions(batches)) as (to_save, path):
            if args.async_save and not loop.stopping:  # (the run's last one is written at once)
                group = checkpoints.group  # (a gloo group of its own, for the background thread)
                checkpoints.job = dcp.async_save(to_save, checkpoint_id=path, process_group=group)
            else:
                dcp.save(to_save, checkpoint_id=path)

    # ---- training loop -------------------------------------------------------------------------
    describe = pipeline.describe(layout)  # at start-up
    loop = TrainingLoop(args, settings, state, device, start_step, layout, describe)
    for step in loop:
        micro_batches = training.to_device(next(batches), device)
        # Normalise by the number of targets in the whole global batch, not per micro-batch: then
        # every target token weighs the same however the batch is split (micro-batches, ranks),
        # and padded batches give the same gradient as one big batch would.
        global_tokens = sum((y != IGNORE_INDEX).sum() for _, y in micro_batches)
        dist.all_reduce(global_tokens, group=layout.dp_group)
        # One batch for the whole pipeline: the schedule cuts it back into the m micro-batches.
        x, y = (torch.cat(tensors) for tensors in zip(*micro_batches, strict=True))  # (m * rows, T)
        # FSDP divides by dp, as DDP does; the factor dp undoes that (x fp16's loss scale).
        step_loss = run_schedule(x, y, scaler.scale(layout.dp / global_tokens), train=True)
        # The global loss, on every rank (queued, no wait): all ranks take the same decisions.
        dist.all_reduce(step_loss, group=pp_group)  # the last stage's (the others hold zeros)
        dist.all_reduce(step_loss, group=layout.dp_group)
        pipeline.unscale_(scaler, optimizer, pp_group)  # (scaler.unscale_, agreed by every stage)
        if args.sequence_parallel:  # the norms' gradients are Partial sums: add them up first
            tensor_parallel.replicate_partial_grads(model.parameters())
        # Each rank holds its own stages' gradients: their squared norms add up over the pipeline.
        grad_norm = pipeline.clip_grad_norm_(model.parameters(), settings.max_grad_norm, pp_group)
        # Under fp16 an infinite gradient is the grad scaler's business (it skips that step).
        if loop.step_ok(step, step_loss, None if scaler.is_enabled() else grad_norm):
            scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # Log, evaluate, save and stop on a signal, each when it is due (lib/loop.py).
        loop.after_step(step, step_loss / global_tokens, grad_norm, evaluate, save)

    # ---- outputs -------------------------------------------------------------------------------
    # model.pt, written on rank 0 one tensor at a time from the checkpoint of the last step.
    checkpoints.finish(state, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    # A known failure ends in one line (lib/exits.py), and the process with os._exit once main()
    # is over: torch.distributed's C++ teardown can abort a finished run (exits.end_process).
    exits.run(main, os_exit=True)
