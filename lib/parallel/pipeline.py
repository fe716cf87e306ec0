"""The pipeline of train_pp.py: its flags and their checks, the model cut into stages of
consecutive layers, which stages each rank holds, the loss of the last stage, gradient clipping
over the pipeline's ranks, fp16's skipped steps agreed on by every stage, and --micro-batch-size
auto's probes through the pipeline. The PipelineStages and the schedule that runs them
(torch.distributed.pipelining) are in train_pp.py (probe_schedule builds the probes' stages and
schedule the same way).
"""

import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor

from lib import flags, model_config, training
from lib.parallel import fsdp, tensor_parallel
from lib.parallel.layout import Layout
from lib.parallel.tensor_parallel import check_sequence_parallel, check_tensor_parallel
from model import IGNORE_INDEX, LlamaForPretraining, row_scores

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}

# -------------------------------------------------------------------------------------------------
# Flags


def add_flags(parser) -> None:
    """train_pp.py's flags: train_tp.py's (FSDP's, --tp, --sequence-parallel; here --tp defaults
    to 1), and --pp, --schedule, --stages-per-rank."""
    tensor_parallel.add_flags(parser)
    parser.add_argument(
        "--pp",
        type=flags.number_arg(int, 1),
        default=None,
        help="pipeline-parallel size: stages per pipeline; world_size / (pp x tp) pipelines "
        "train data-parallel (FSDP). Default: all ranks (world_size / tp) in one pipeline",
    )
    parser.add_argument(
        "--schedule",
        choices=list(SCHEDULES),
        default="1f1b",
        help="gpipe: all forwards, then all backwards; 1f1b: the same bubble, activations of at "
        "most pp micro-batches alive; interleaved: several smaller stages per rank, a smaller "
        "bubble",
    )
    parser.add_argument(
        "--stages-per-rank",
        type=flags.number_arg(int, 1),
        default=None,
        help="stages each rank holds, for --schedule interleaved (default 2; 1 otherwise)",
    )


def setup(parser, args, world_size: int, device) -> Layout:
    """train_pp.py's grid, pp x dp x tp ranks (HSDP: pp x replicate x shard x tp), v stages per
    rank, its flags checked before any work (ValueError through parser.error); the mesh is built
    unless --check. The micro-batches are checked against the schedule by run_settings."""
    v = args.stages_per_rank or (2 if args.schedule == "interleaved" else 1)
    if args.schedule == "interleaved" and v < 2:
        parser.error("--schedule interleaved needs --stages-per-rank >= 2 (1 is plain 1f1b)")
    if args.schedule != "interleaved" and v != 1:
        parser.error(f"--stages-per-rank applies to --schedule interleaved, not {args.schedule}")
    tp = 1 if args.tp is None else args.tp
    pp = max(1, world_size // tp) if args.pp is None else args.pp  # one pipeline over all ranks
    if world_size % (pp * tp):
        parser.error(
            f"--pp {pp} x --tp {tp} does not divide the number of processes ({world_size}): the "
            f"mesh is pp x dp x tp, so launch a multiple of {pp * tp} processes (--nproc_per_node "
            f"x nodes) or change --pp/--tp"
        )
    dp = world_size // (pp * tp)
    if args.attention == "flex":
        # The schedule cuts every tensor argument into micro-batches, but not a BlockMask: each
        # micro-batch would get the whole batch's mask.
        parser.error("--attention flex is not supported by train_pp.py; use sdpa (or auto)")
    model_config.refuse_experts(parser, args, "train_pp.py")  # MoE: not here (NO_EXPERTS says why)
    config = model_config.model_shape(args)
    try:
        check_tensor_parallel(config, tp)  # whole heads and hidden units per tp rank
        if args.sequence_parallel:
            check_sequence_parallel(tp, args.seq_length)
        split_layers(config.num_hidden_layers, pp * v)  # ValueError if the layers do not go round
        if config.tie_word_embeddings and pp * v > 1:
            raise tied_embeddings_error(pp * v)
    except ValueError as e:
        parser.error(str(e))
    fsdp.check_replicate(parser, args, dp)
    # Each pipeline's batch is m micro-batches of rows sequences (auto: 1 until measured).
    rows = 1 if args.micro_batch_size in (None, "auto") else args.micro_batch_size
    m = max(1, args.batch_size // (rows * dp))
    stage_layers = tuple(len(r) for r in split_layers(config.num_hidden_layers, pp * v))
    sizes = dict(tp=tp, pp=pp, schedule=args.schedule, stages_per_rank=v)
    sizes |= dict(stage_layers=stage_layers, micro_batches=m, micro_batch_size=rows)
    sizes |= dict(sequence_parallel=args.sequence_parallel, **fsdp.options(args))
    if args.check:
        return Layout(world_size, dp, **sizes)
    # rank = (pp_rank * dp + dp_rank) * tp + tp_rank: a TP group is tp consecutive ranks (a node),
    # then come a stage's dp replicas; the pipeline, the lightest traffic, spans the rest.
    mesh, fsdp_mesh, dp_rank, dp_group = fsdp.grid(args, dp, device, [(pp, "pp")], [(tp, "tp")])
    return Layout(
        world_size, dp, **sizes, mesh=mesh, fsdp_mesh=fsdp_mesh, dp_rank=dp_rank, dp_group=dp_group
    )


def run_settings(parser, args, layout: Layout, device) -> flags.RunSettings:
    """flags.run_settings for a pipeline: one sequence per micro-batch unless --micro-batch-size
    says otherwise (many micro-batches, a small bubble: Megatron-LM's and torchtitan's default),
    sdpa attention, and as many micro-batches as the schedule needs (parser.error if not; with
    --micro-batch-size auto, if no micro-batch size gives a count the schedule takes)."""
    run = flags.run_settings(parser, args, layout.dp, device, default_micro_batch_size=1)
    run = dataclasses.replace(run, attention="sdpa")  # --attention auto: never flex here
    counts = [run.accumulation]  # micro-batches per step
    auto, share = args.micro_batch_size == "auto", args.batch_size // layout.dp
    if auto:  # measured later among the divisors of a pipeline's share; 1 sequence each first
        counts = [share // n for n in range(1, share + 1) if share % n == 0]
    problems = [schedule_refusal(args.schedule, m, layout.pp) for m in counts]
    if all(problems):
        remedy = "raise --batch-size" if auto else SCHEDULE_REMEDIES[args.schedule]
        parser.error(f"{problems[0]}; {remedy}")
    return run


# What to change when a schedule cannot run a count of micro-batches (schedule_refusal).
SCHEDULE_REMEDIES = {
    "1f1b": "lower --micro-batch-size or raise --batch-size",
    "interleaved": "a multiple of --pp always works",
}


def schedule_refusal(schedule: str, m: int, pp: int) -> str | None:
    """Why `schedule` cannot stream m micro-batches through a pipeline of pp ranks, as torch's
    schedule would refuse them (None if it can): 1F1B starts one micro-batch on each stage before
    the first backward, and interleaved 1F1B runs the micro-batches in rounds of equal size."""
    if schedule == "1f1b" and m < pp:
        return f"1f1b needs at least as many micro-batches as stages: {m} < {pp}"
    rounds = max(1, m // pp)
    if schedule == "interleaved" and m % rounds:
        return (
            f"interleaved needs the micro-batches ({m}) to be a multiple of {rounds} "
            f"(micro-batches // --pp)"
        )
    return None


def measured(settings, args, layout: Layout, state, attn_mask, device):
    """flags.measured for a pipeline: (settings, layout) with --micro-batch-size auto measured,
    as they are otherwise. A size n is probed with the pipeline itself, as train_pp.py runs a
    step: its stages (state.model.stages) and schedule, streaming a pipeline's share of the
    batch in m = share / n micro-batches of n random sequences (probe_schedule). Only the sizes
    whose m the schedule takes are tried; every rank of every stage probes each size (the
    schedule's sends pair them), and the largest peak of all ranks decides: the stages differ in
    memory. The lesson then builds the schedule it trains with for the m chosen."""
    if args.micro_batch_size != "auto":
        return settings, layout
    from lib.extras import auto_batch

    share = args.batch_size // layout.dp  # the sequences of one pipeline in a step
    pp_rank = layout.mesh.get_local_rank("pp")
    is_first, is_last = pp_rank == 0, pp_rank == layout.pp - 1  # tokens go in; the loss comes out
    tokens = torch.Generator().manual_seed(0)  # its own generator: training's RNG is untouched

    def forward_backward(n: int) -> None:  # a training step's run of the schedule
        schedule = probe_schedule(state.model.stages, layout, args.schedule, share // n, device)
        vocab_size = state.config.vocab_size
        x, y = auto_batch.random_batch(tokens, share, args.seq_length, vocab_size, device)
        mask = attn_mask(x)
        inputs, masks = (x,) if is_first else (), {} if mask is None else {"attn_mask": mask}
        target = y if is_last else None
        schedule.step(*inputs, target=target, losses=[], return_outputs=False, **masks)

    def refusal(n: int) -> str | None:
        return schedule_refusal(args.schedule, share // n, layout.pp)

    # (A probe runs the whole step's m micro-batches, so its peak already holds what FSDP keeps
    # between them, the unsharded gradients: nothing to add for it.)
    model, optimizer = state.model, state.optimizer
    settings = auto_batch.largest_that_fits(
        args, settings, model, optimizer, device, forward_backward, refusal
    )
    m, rows = settings.accumulation, settings.micro_batch_size
    return settings, dataclasses.replace(layout, micro_batches=m, micro_batch_size=rows)


def probe_schedule(stage_models: list, layout: Layout, schedule: str, m: int, device):
    """A schedule of m micro-batches over this rank's stage models, built as train_pp.py builds
    the one it trains with, for a probe of --micro-batch-size auto. Its PipelineStages are new:
    a stage infers the shapes it sends and receives from the micro-batches of its first step, so
    no stage runs two sizes (and the lesson builds its own for the size chosen)."""
    pp_group, num_stages = layout.mesh["pp"].get_group(), layout.pp * layout.stages_per_rank
    stages = [PipelineStage(s, s.index, num_stages, device, group=pp_group) for s in stage_models]
    runs = stages if schedule == "interleaved" else stages[0]
    loss_fn = PipelineLoss()  # (its scale, 1, changes no memory)
    return SCHEDULES[schedule](runs, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)


# -------------------------------------------------------------------------------------------------
# Stages


def bubble_fraction(schedule: str, pp: int, micro_batches: int, stages_per_rank: int) -> float:
    """The share of a step each rank of a pipeline of `pp` stages sits idle.

    GPipe and 1F1B: counted in slots of one micro-batch's forward + backward on one stage, the
    work takes m slots, and filling and draining the pipeline p-1 more: (p-1)/(m+p-1) (Huang et
    al. 2019, GPipe; 1F1B, PipeDream-Flush's schedule, only reorders the same work). Interleaved
    1F1B: each rank runs v stages of 1/v of its layers, so its slots are v times shorter; the
    work takes v*m of them and the fill and drain still p-1: (p-1)/(v*m+p-1). (Narayanan et al.
    2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
    sec. 2.2, give it as (p-1)/(v*m) of the ideal time; as a share of the whole step, this.)
    """
    slots = micro_batches * (stages_per_rank if schedule == "interleaved" else 1)
    return (pp - 1) / (slots + pp - 1)


def describe(layout: Layout) -> str:
    """The pipeline at start-up: schedule, stages, layers per stage, micro-batches, the bubble,
    TP inside each stage and FSDP across the pipelines."""
    pp, v, m, rows = (
        layout.pp,
        layout.stages_per_rank,
        layout.micro_batches,
        layout.micro_batch_size,
    )
    layers = list(layout.stage_layers)
    bubble = bubble_fraction(layout.schedule, pp, m, v)
    formula = "(p-1)/(v*m+p-1)" if layout.schedule == "interleaved" else "(p-1)/(m+p-1)"
    text = (
        f"{layout.schedule} schedule, {pp * v} stages on {pp} ranks ({v} per rank), layers per "
        f"stage {layers}, m = {m} micro-batches of {rows} sequences per pipeline, {layout.dp} "
        f"data-parallel pipelines, bubble {formula} = {bubble:.1%}; "
    )
    return text + tensor_parallel.describe(layout)


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Consecutive layer indices of each stage, as even as possible.

    When the layers do not divide, the first `num_layers % num_stages` stages get one layer more
    (as numpy.array_split does): the last stage never does, because it also runs the final norm,
    lm_head and the loss, the heaviest work outside the layers (the first stage's embedding is a
    lookup, nearly free).
    """
    if num_layers < num_stages:
        raise ValueError(
            f"the model has {num_layers} layers, fewer than the {num_stages} pipeline stages "
            f"(--pp x --stages-per-rank); use a smaller --pp or --stages-per-rank, or a deeper "
            f"--model"
        )
    base, extra = divmod(num_layers, num_stages)
    start = lambda stage: stage * base + min(stage, extra)  # the `extra` stages before it: +1 each
    return [range(start(stage), start(stage + 1)) for stage in range(num_stages)]


class StageModel(nn.Module):
    """One pipeline stage: a run of consecutive decoder layers, plus the embedding on the first
    stage and the final norm and lm_head on the last (None elsewhere, as torchtitan does).

    It holds the full model's own submodules under the full model's names (the layers in a
    ModuleDict keyed by their original index), so its state_dict keys are exactly the full
    model's: `layers.5.attention.wq.weight` is the same name on every layout.

    Input: token ids (B, T) on the first stage, hidden states (B, T, d) elsewhere. Output: hidden
    states, or logits (B, T, vocab) on the last stage; the schedule's loss function takes them.
    """

    def __init__(
        self,
        model: LlamaForPretraining,
        index: int,
        layer_ids: range,
        first: bool,
        last: bool,
        precision: str = "fp32",
        sequence_split: int = 1,
    ):
        super().__init__()
        self.index = index  # its place in the pipeline, 0 to pp x v - 1
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        # Each stage needs the RoPE tables (every layer rotates q and k). They are the model's
        # own buffers, a function of the config: referenced, not recomputed; not persistent,
        # so not in the state_dict, as in the model.
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.precision = precision
        # Sequence parallelism: what a stage receives is this rank's 1/tp of each sequence.
        self.sequence_split = sequence_split

    def forward(self, h: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        # autocast here, inside the stage: the schedule calls the stages itself, and the stage is
        # what FSDP wraps, so there is no outer forward to put it around.
        with training.autocast(h.device, self.precision):
            if self.tok_embeddings is not None:
                h = self.tok_embeddings(h)  # (B, T) ids -> (B, T, d)
            T = h.size(1) * self.sequence_split  # (the whole sequence, for RoPE)
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, head_dim)
            for layer in self.layers.values():  # in the model's order: keys were added ascending
                h = layer(h, cos, sin, attn_mask)
            if self.norm is not None:
                h = self.norm(h)
            if self.lm_head is not None:
                h = self.lm_head(h)  # (B, T, d) -> (B, T, vocab)
        return h


def stage_ids_of_rank(pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    """The stages a rank runs: rank r holds stages r, r + pp, r + 2 pp, ... ("looped" order, the
    one the interleaved schedule expects). With one stage per rank, simply stage r."""
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


def build_stages(model: LlamaForPretraining, layout: Layout, precision: str) -> list[StageModel]:
    """This rank's stage modules (its place in the mesh's "pp" dimension), in stage order: the
    model's own submodules (on the meta device in train_pp.py, which then gives the stages storage
    and values), under its names; the rest of the model goes with it. ValueError if the layers do
    not go round."""
    pp_rank = layout.mesh.get_local_rank("pp") if layout.mesh is not None else 0
    split = layout.tp if layout.sequence_parallel else 1  # (a stage gets 1/tp of each sequence)
    return stages_of_rank(model, pp_rank, layout.pp, layout.stages_per_rank, precision, split)


def stages_of_rank(
    model: LlamaForPretraining,
    pp_rank: int,
    pp_size: int,
    stages_per_rank: int,
    precision: str = "fp32",
    sequence_split: int = 1,
) -> list[StageModel]:
    """build_stages for pipeline rank `pp_rank` of `pp_size`, `stages_per_rank` stages each."""
    num_stages = pp_size * stages_per_rank
    layer_ranges = split_layers(model.config.num_hidden_layers, num_stages)
    if model.config.tie_word_embeddings and num_stages > 1:
        raise tied_embeddings_error(num_stages)
    last = num_stages - 1
    return [
        StageModel(model, s, layer_ranges[s], s == 0, s == last, precision, sequence_split)
        for s in stage_ids_of_rank(pp_rank, pp_size, stages_per_rank)
    ]


def tied_embeddings_error(num_stages: int) -> ValueError:
    return ValueError(
        f"the model ties lm_head to the token embeddings (tie_word_embeddings), but with "
        f"{num_stages} pipeline stages they live on different ranks, and one tensor cannot; "
        f"use --pp 1 (with --schedule gpipe or 1f1b), train_fsdp.py, or an untied --model"
    )


class RankModel(nn.Module):
    """Every parameter this rank holds, once, under the full model's names: what the optimizer,
    the gradient norm and the checkpoints see. The stages run the computation; this module only
    refers to their submodules (with several stages per rank, their layers side by side)."""

    def __init__(self, stages: list[StageModel]):
        super().__init__()
        # A plain list, not registered (its parameters are registered below, by the full
        # model's names): what --micro-batch-size auto probes (measured).
        self.stages = list(stages)
        self.tok_embeddings = next(
            (s.tok_embeddings for s in stages if s.tok_embeddings is not None), None
        )
        self.layers = nn.ModuleDict({k: v for s in stages for k, v in s.layers.items()})
        self.norm = next((s.norm for s in stages if s.norm is not None), None)
        self.lm_head = next((s.lm_head for s in stages if s.lm_head is not None), None)


class PipelineLoss:
    """The last stage's loss for one micro-batch: summed cross-entropy x `self.scale`.

    The schedule calls it as loss_fn(logits, targets) for every micro-batch (and, on torch's
    own terms, when it infers the shapes of a backward: so count nothing here; the losses of a
    run are the list it returns). The lesson sets `scale` before each schedule run: training,
    dp / (targets in the global batch), the same normalisation as every other lesson, so the
    schedule must not rescale (scale_grads=False); evaluation, 1: plain sums. (An attribute
    rather than the schedule's loss_kwargs, which torch 2.13 brought: the same on every torch.)
    With `scores` set (score_rows), each row's log-likelihood and misses, as model.row_scores.
    """

    def __init__(self):
        self.scale: torch.Tensor | float = 1.0
        self.scores = False  # --eval-tasks: each row's model.row_scores instead, (rows, 2)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.scores:
            return row_scores(logits, targets)
        loss_sum = F.cross_entropy(
            logits.float().flatten(0, 1),
            targets.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )  # logits (B*T, vocab) in fp32 (as autocast computes it) against targets
        return loss_sum * self.scale


@contextlib.contextmanager
def scoring(loss_fn: PipelineLoss):
    """--eval-tasks: within it, the schedule's runs give each row's (log-likelihood, misses)
    instead of the loss (loss_fn's `scores`), and `joined` keeps their micro-batches' rows in
    order: (m x rows, 2) on the last stage."""
    loss_fn.scores = True
    try:
        yield
    finally:
        loss_fn.scores = False


def joined(losses: list[torch.Tensor], device) -> torch.Tensor:
    """A schedule run's losses, one per micro-batch, on the last stage: their sum, or under
    `scoring`, the micro-batches' rows in order (m x rows, 2); on the other stages, none: 0."""
    if losses and losses[0].dim() == 2:
        return torch.cat(losses)
    return sum(losses, torch.zeros((), device=device))


@torch.no_grad()
def evaluate(run_schedule, loader, loss_fn: PipelineLoss, is_last: bool) -> torch.Tensor:
    """The validation sums of a pipeline's share (training.batch_totals of each batch, from the
    last stage; zeros on the others), then --eval-tasks' rows, run through the schedule as its
    micro-batches under `scoring` (training.ValidationShard.with_task_scores). run_schedule(x, y,
    scale, train): the lesson's run of its schedule, the last stage's loss sum."""
    totals = torch.zeros(3, device=loader.device, dtype=torch.float64)
    for x, y in loader:
        loss_sum = run_schedule(x, y, 1.0, False)
        totals += training.batch_totals(loss_sum, (y != IGNORE_INDEX).sum(), loader) * is_last

    def score_rows(x, y) -> torch.Tensor:
        with scoring(loss_fn):
            return run_schedule(x, y, 1.0, False)

    return loader.with_task_scores(totals, score_rows)


# -------------------------------------------------------------------------------------------------
# Gradient clipping and fp16's grad scaler over the pipeline


def unscale_(scaler, optimizer, pp_group) -> None:
    """scaler.unscale_(optimizer) for a model split over the pipeline: if any stage's gradients
    hold an inf or NaN, every rank's scaler finds one, skips the step and lowers its scale.

    torch's grad scaler skips a step whose gradients are not finite. For DTensor gradients it
    reduces that check over their mesh (a stage's dp x tp ranks), but a pipeline's stages hold
    other parameters, on no common mesh: alone, the stage that overflowed would skip and the
    others step. And the scale must stay the same on every stage, as the last stage's loss
    carries it into every stage's gradients. So the pp group first agrees (an all-reduce of one
    flag) and, if any stage overflowed, each rank puts an inf into one of its own gradients."""
    if scaler.is_enabled():
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads if g is not None]
        largest = torch.nn.utils.get_total_norm(grads, norm_type=math.inf)  # inf/NaN: not finite
        overflow = (~largest.isfinite()).float()
        dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=pp_group)
        first = next((g for g in grads if g.numel()), None)
        if first is not None:  # (no sync: the flag stays on the device)
            corner = (0,) * first.dim()
            first[corner] = torch.where(overflow > 0, math.inf, first[corner])
    scaler.unscale_(optimizer)


def clip_grad_norm_(parameters, max_norm: float, pp_group) -> torch.Tensor:
    """clip_grad_norm_ for a model split over the pipeline: measure the whole model's norm.

    Each rank holds the gradients of its own stages only, so torch's clip_grad_norm_ would
    measure (and clip by) a different, partial norm on every rank. The squared norms add up over
    disjoint sets of parameters: all-reduce them over the pp group, take the root, then clip
    every stage by the same global norm. (With FSDP the per-rank norm is a DTensor over the dp
    shards: full_tensor() adds those up first, as train_fsdp.py's clipping does.)
    """
    parameters = list(parameters)
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    squared = norm.square()
    dist.all_reduce(squared, group=pp_group)
    total = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total
