"""What one training step asks of the process groups, predicted: the rows --comm-ledger records
(lib/extras/comm_ledger.py), {op, group, group_size, calls, bytes}, for any config, Layout and
Workload, so that tests/test_comm_ledger.py can hold each lesson's measured step to them and the
planner can turn them into bytes on the wire (wire_bytes).

    rows = step_rows(config, layout, workload)          # rank 0's step
    rows = step_rows(config, layout, workload, rank=3)  # a pipeline's other stages differ
    wire_bytes(rows)                                    # what this rank sends, round a ring

The memory planner's traffic figures (lib/extras/memory.py: each strategy's dp comm, and what
crosses tp, pp, cp, ep and HSDP's replica groups) are these rows' wire_bytes, by the mesh
dimension each crosses (dimension_rows), on the pipeline stage that sends the most.

The strategy is the Layout's: tp, pp, cp or ep above 1 are train_tp.py's, train_pp.py's,
train_cp.py's and train_ep.py's grids (with FSDP over their dp ranks; a mixture of experts is
train_ep.py's at any ep); otherwise zero_stage says which data-parallel lesson: 0 train_ddp.py, 1
train_zero1.py, 2 and 3 train_fsdp.py (HSDP with replicate > 1). Zero stages 0 and 1 with tp, pp or
cp, or with experts at ep 1 (no lesson: the planner's ddp and zero1 rows), are DDP over the dp
ranks. A row's group is named as the ledger names it: the mesh dimension it belongs to ("dp",
"replicate", "shard", "tp", "pp", "cp", "ep"; a dimension that spans every rank is the default group
itself and keeps its name), "world" for the default group otherwise, and a group of two dimensions
by both ("replicate+shard": train_tp.py's and train_pp.py's dp group under HSDP). Rows of a group of
one rank are kept (the lessons ask them; nothing crosses a wire).

Every figure is exact, computed from the parameters' shapes (one decoder layer built on the meta
device: lib/extras/comm_shapes.py, with the groups' names) and the lessons' own rules, with one
exception, named in the row's "tolerance" (bytes it may be off by, either way): expert
parallelism's all-to-alls carry the (token, expert) pairs the router sends to each rank, which
depend on the data. The formula assumes an even share (a rank
receives as many pairs as it sends); the pairs every rank sends add up exactly over the ranks
(the test holds the sum), while one rank's bytes may be off by `tolerance`.
"""

import bisect
import dataclasses
import itertools
import math
from collections import defaultdict

import torch

from lib.extras.comm_shapes import (
    GroupNames,
    Shapes,
    padded,
    sharded,
    stage_contents,
    stages_per_rank,
)
from lib.extras.memory_formulas import Workload
from lib.parallel.layout import Layout
from model import LlamaConfig, LlamaForPretraining

FIRST_BUCKET_BYTES = 1024**2  # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
BUCKET_BYTES = 25 * 1024**2  # DDP's bucket_cap_mb default (25 MiB)
# Muon's owners are assigned matrix by matrix (lib/extras/muon.py): the most a plan counts.
MUON_MATRICES = 100_000
# The residual stream's bytes per element, what a pipeline stage sends on: bf16 where FSDP casts
# the weights to bf16 (the embedding's and the layers' outputs are bf16 then); fp32 otherwise, fp16
# included (fp32 weights under autocast: the embedding's output is fp32, and adding a 16-bit
# matmul's output to it keeps it so).
STREAM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 4, "paper": 2}
TOKENS, LOSS, NORM = 8, 4, 4  # bytes: the step's target count (int64), loss sum and norms (fp32)


def row(
    op: str, group: str, size: int, calls: int, nbytes: float, tolerance: float = 0, dim: str = ""
) -> dict:
    """One row of the ledger's schema (tolerance: only where bytes are not exact; dim: the mesh
    dimension it crosses, only before merge)."""
    r = {"op": op, "group": group, "group_size": size, "calls": calls, "bytes": int(nbytes)}
    return r | ({"tolerance": int(tolerance)} if tolerance else {}) | ({"dim": dim} if dim else {})


def across(dim: str, rows: list[dict]) -> list[dict]:
    """The rows, each tagged with the mesh dimension it crosses (where not tagged already)."""
    return [{"dim": dim} | r for r in rows]


def step_rows(
    config: LlamaConfig, layout: Layout, workload: Workload, rank: int = 0, device: str = "cuda"
) -> list:
    """The rows of one training step (past the first two, as --comm-ledger records it) of global
    rank `rank`, each (op, group) once, in the ledger's order. The Workload's micro_batches and
    micro_batch_size are each rank's (the pipeline's m micro-batches of so many sequences).
    device: where Muon's Newton-Schulz runs (bf16 on "cuda", fp32 on "cpu"); nothing else."""
    return merge(dimension_rows(config, layout, workload, rank, device))


def dimension_rows(
    config: LlamaConfig, layout: Layout, workload: Workload, rank: int = 0, device: str = "cuda"
) -> list[dict]:
    """step_rows' rows before they are merged, each tagged with the mesh dimension it crosses,
    its "dim": "dp" (the data-parallel ranks: DDP's and FSDP's collectives, the step's sums),
    "replicate" (HSDP's, between its replica groups), "tp", "pp", "cp", "ep" or "muon" (Muon's
    exchange): the planner adds them up by dimension (lib/extras/memory.py), where a group that
    spans every rank would merge two dimensions' rows into one."""
    names = GroupNames(layout, experts=bool(config.num_local_experts))
    rows = data_parallel_rows(Shapes(config, layout, rank), layout, workload, names)
    rows += across("tp", tensor_parallel_rows(config, layout, workload, names, rank))
    rows += across("pp", pipeline_rows(config, layout, workload, names, rank))
    rows += across("cp", context_parallel_rows(config, layout, workload, names))
    rows += across("ep", expert_parallel_rows(config, layout, workload, names))
    if workload.optimizer == "muon":
        rows += across("muon", muon_rows(config, layout, names, rank, device))
    return rows


def merge(rows: list[dict]) -> list[dict]:
    """One row per (op, group, size), calls and bytes added up; in the ledger's order."""
    from lib.extras.comm_ledger import OPS

    total = defaultdict(lambda: [0, 0, 0])
    for r in rows:
        if r["calls"]:
            t = total[(r["op"], r["group"], r["group_size"])]
            t[0] += r["calls"]
            t[1] += r["bytes"]
            t[2] += r.get("tolerance", 0)
    order = {op: i for i, op in enumerate(OPS)}
    keys = sorted(total, key=lambda k: (order.get(k[0], len(OPS)), k[0], k[1]))
    return [row(*k, *total[k]) for k in keys]


def wire_bytes(rows: list[dict]) -> float:
    """What the rows send from one rank, in a ring of the row's n ranks (the planner's traffic
    figures, lib/extras/memory.py): an all-reduce of B bytes sends
    2 (n - 1) / n B, an all-gather (B its output), a reduce-scatter (B its input), an all-to-all
    (B its input) and a broadcast (pipelined along the ring: every rank but the last passes each
    buffer on, (n - 1) / n of them on average) (n - 1) / n B, a send its B; a receive nothing."""
    share = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "broadcast": 1}
    sent = 0.0
    for r in rows:
        n = r["group_size"]
        if r["op"] in share:
            sent += share[r["op"]] * (n - 1) / n * r["bytes"]
        elif r["op"] == "send":
            sent += r["bytes"]
    return sent


# -------------------------------------------------------------------------------------------------
# The rows of each strategy


def data_parallel_rows(
    shapes: "Shapes", layout: Layout, workload: Workload, names: GroupNames
) -> list[dict]:
    """The step's sums, and the data-parallel ranks' traffic of these parameters: DDP's buckets
    (ZeRO-1: and its broadcasts) or FSDP's gathers and reduce-scatters, and the gradient norm."""
    rows = loss_rows(layout, names)
    if sharded(layout):
        rows += fsdp_rows(shapes, layout, workload, names)
    else:
        rows += across("dp", ddp_rows(shapes, layout, names))
    return rows + norm_rows(shapes, layout, names, workload.precision)


def count_rows(num_params: float, layout: Layout, workload: Workload) -> list[dict]:
    """dimension_rows' data-parallel rows for a bare parameter count (the planner's --params
    without --model), `num_params` on each rank before the data-parallel split: one flat
    parameter, as the ZeRO paper counts (its Figure 1). A model's shapes would add only DDP's
    bucket count and FSDP's padding, a few elements per parameter."""
    shapes = Shapes.flat(round(num_params))
    return data_parallel_rows(shapes, layout, workload, GroupNames(layout))


def loss_rows(layout: Layout, names: GroupNames) -> list[dict]:
    """Every lesson's own sums: the global batch's target count before its forwards, and the
    step's loss sum after them (train_pp.py: the last stage's, summed over the pipeline first)."""
    sums = [row("all_reduce", *names.dp_group(), 2, TOKENS + LOSS, dim="dp")]
    if layout.pp == 1:
        return sums
    return sums + [row("all_reduce", *names.of("pp"), 1, LOSS, dim="pp")]


def ddp_rows(shapes: Shapes, layout: Layout, names: GroupNames) -> list[dict]:
    """DDP's gradient buckets, all-reduced once per step (the last micro-batch's backward), and
    ZeRO-1's broadcast of every parameter by the rank that updated it."""
    name, n = names.fsdp()[0]  # (the dp ranks: every rank without tp or pp)

    def sizes(shapes_: list) -> list[int]:  # fp32 gradients, in bytes, last parameter first
        return [4 * math.prod(s) for s in shapes_][::-1]

    layer = sizes(shapes.router + shapes.layer + shapes.experts)
    root = sizes(shapes.root)
    # The gradients in the order they become ready, the reverse of the model's (DDP rebuilds its
    # buckets in that order after the first step): lm_head's and the norm's, each layer's (the
    # same sizes, `layers` times), the embedding's last.
    runs = [(sizes(shapes.head), 1), (layer, shapes.layers), (sizes(shapes.embedding), 1)]
    buckets = ddp_buckets(runs)
    total = sum(root) + shapes.layers * sum(layer)
    rows = [row("all_reduce", name, n, buckets, total)]
    if layout.zero_stage == 1:
        rows.append(row("broadcast", name, n, len(root) + shapes.layers * len(layer), total))
    return rows


def ddp_buckets(runs: list[tuple[list[int], int]]) -> int:
    """How many buckets DDP fills with gradients of these sizes, given in the order they become
    ready as runs of (sizes, how many times over): the reducer's rule (torch's
    compute_bucket_assignment_by_size, as it rebuilds its buckets after the first step), a
    bucket closing once it holds FIRST_BUCKET_BYTES (the first) or BUCKET_BYTES (the others)."""
    count, current, limit = 0, 0, FIRST_BUCKET_BYTES
    for sizes, repeats in runs:
        closed, current, limit = fill_buckets(sizes, repeats, current, limit)
        count += closed
    return count + (current > 0)


def fill_buckets(sizes: list[int], repeats: int, current: int, limit: int) -> tuple[int, int, int]:
    """(buckets closed, bytes left in the open one, its limit) after `repeats` runs of `sizes`
    into a bucket holding `current` bytes that closes at `limit`. Each bucket jumps to where it
    closes (the first gradient whose running sum reaches its limit); a bucket that closes where an
    earlier one did in the run of sizes repeats it, so whole periods are skipped: a few jumps for
    any `repeats`, 10^30 layers too."""
    n, total = len(sizes), sum(sizes)
    if not repeats or not total:
        return 0, current, limit
    prefix = list(itertools.accumulate(sizes, initial=0))
    cum = lambda i: i // n * total + prefix[i % n]  # noqa: E731  (bytes of the first i gradients)
    end, start, closed, seen = repeats * n, 0, 0, {}
    while True:
        target = cum(start) + limit - current  # the first i with cum(i) >= target closes it
        runs = max(0, -(-(target - total) // total))  # whole runs of sizes before it
        i = runs * n + bisect.bisect_left(prefix, target - runs * total, lo=1)
        if i > end:
            return closed, current + cum(end) - cum(start), limit
        closed, start, current, limit = closed + 1, i, 0, BUCKET_BYTES
        if start % n in seen:  # the same place in the run: the same buckets follow, periodically
            first, closed_then = seen.pop(start % n)
            periods = (end - start) // (start - first)  # (then the rest, bucket by bucket)
            start += periods * (start - first)
            closed += periods * (closed - closed_then)
        else:
            seen[start % n] = start, closed


def fsdp_rows(shapes: Shapes, layout: Layout, workload: Workload, names: GroupNames) -> list:
    """FSDP2's traffic, one unit at a time: an all-gather of the unit's weights before each
    micro-batch's forward (ZeRO-3: and again before its backward), in the matmuls' dtype under
    bf16; a reduce-scatter of its fp32 gradients after the last micro-batch's backward; HSDP
    then all-reduces each gradient shard across the replicas. A group of one rank: nothing."""
    m = workload.micro_batches
    # bf16 gathers the weights in bf16 (MixedPrecisionPolicy); fp16 keeps them fp32 (autocast
    # casts them in each matmul); "paper" is the ZeRO paper's 16-bit weights.
    weight_bytes = 2 if workload.precision in ("bf16", "paper") else 4
    gathers = m * (2 if layout.zero_stage == 3 else 1)
    if layout.pp > 1:
        # The pipeline's schedule keeps the weights gathered from the first backward to the end
        # of the step (torch.distributed.pipelining: no reshard after backward until the last):
        # ZeRO-3 gathers for each forward and once for all the backwards, ZeRO-2 once.
        gathers = m + 1 if layout.zero_stage == 3 else 1
    groups = names.fsdp()
    (name, n), rows = groups[0], []
    parts = [(shapes.units(), name, n)]
    if shapes.experts:  # every layer's experts: over the ranks that hold the same ones ("dp")
        parts.append(([(shapes.experts, shapes.layers)], *names.of("dp")))
    for units, group, size in parts:
        per_unit = [(sum(padded(s, size) for s in unit), k) for unit, k in units]
        elements = sum(e * k for e, k in per_unit)
        count = sum(k for e, k in per_unit if e)
        if size > 1:  # (a shard group of one rank: nothing to gather or scatter)
            rows += [
                row("all_gather", group, size, gathers * count, gathers * weight_bytes * elements),
                row("reduce_scatter", group, size, count, 4 * elements),
            ]
            rows = across("dp", rows)
        if layout.replicate > 1 and group == name:
            replicas, r = groups[1]
            rows.append(
                row("all_reduce", replicas, r, count, 4 * elements // size, dim="replicate")
            )
    return rows


def norm_rows(shapes: Shapes, layout: Layout, names: GroupNames, precision: str) -> list[dict]:
    """The gradient norm of sharded (DTensor) gradients: the norm of each of this rank's
    parameters, one fp32 vector all-reduced over each mesh dimension that splits them (FSDP's
    shard group, tp); the pipeline then adds the stages' squared norms up over pp. A mixture of
    experts (expert_parallel.clip_grad_norm_): the experts' norms apart, over dp and ep."""
    tp = [(*names.of("tp"), "tp")] if layout.tp > 1 else []
    shard = [(*names.fsdp()[0], "dp")] if sharded(layout) else []  # (DDP: whole gradients)
    groups = [g for g in shard + tp if g[1] > 1]  # (group, size, dimension)
    rows = [row("all_reduce", g, n, 1, NORM * shapes.count(), dim=d) for g, n, d in groups]
    if shapes.experts and sharded(layout):
        expert_groups = [g for g in [(*names.of("dp"), "dp"), (*names.of("ep"), "ep")] if g[1] > 1]
        experts = len(shapes.experts) * shapes.layers
        rows += [row("all_reduce", g, n, 1, NORM * experts, dim=d) for g, n, d in expert_groups]
    if layout.pp > 1:
        rows.append(row("all_reduce", *names.of("pp"), 1, NORM, dim="pp"))
    if precision == "fp16" and not shapes.experts:
        # The grad scaler's check for inf and NaN in sharded gradients: one fp32 flag reduced over
        # each mesh dimension that splits them, as the norm is.
        rows += [row("all_reduce", g, n, 1, 4, dim=d) for g, n, d in groups]
        if layout.pp > 1:  # pipeline.unscale_: whether any stage overflowed, one fp32 flag
            rows.append(row("all_reduce", *names.of("pp"), 1, 4, dim="pp"))
    return rows


def activation_sizes(config: LlamaConfig, workload: Workload) -> tuple[int, int]:
    """(elements of one micro-batch's (b, T, d) activations, their bytes per element in the
    layers' collectives: the matmuls' dtype, 16-bit under bf16's or fp16's autocast)."""
    b, T = workload.micro_batch_size, workload.seq_length
    return b * T * config.hidden_size, 2 if workload.precision in ("bf16", "fp16", "paper") else 4


def tensor_parallel_rows(
    config: LlamaConfig, layout: Layout, workload: Workload, names: GroupNames, rank: int
) -> list[dict]:
    """Megatron's tensor parallelism (lib/parallel/tensor_parallel.py) per micro-batch: each
    layer all-reduces the outputs of wo and w2 in forward and the gradients of the attention's
    and the MLP's inputs in backward; the embedding's output in forward, lm_head's input gradient
    in backward; train_tp.py's loss_parallel three fp32 numbers per token (the logits' max, the
    sum of exponentials, the target's logit), train_pp.py's last stage gathers the logits
    instead. Sequence parallelism turns each all-reduce of the residual stream into an all-gather
    one way and a reduce-scatter the other, and sums the norms' gradients over tp."""
    tp, m = layout.tp, workload.micro_batches
    if tp == 1:
        return []
    group = names.of("tp")
    first, last, layers = stage_contents(config, layout, rank)
    act, e = activation_sizes(config, workload)
    # The residual stream's dtype (STREAM_BYTES: the norms' and the embedding's outputs too); the
    # outputs of wo and w2 are the matmuls' (e).
    s = STREAM_BYTES[workload.precision]
    # Per micro-batch, each way (forward's all-gathers are backward's reduce-scatters): the
    # attention's and the MLP's inputs (the stream's dtype) and the outputs of wo and w2 (the
    # matmuls'), each layer; the embedding's output and lm_head's input (the stream's).
    stream = 4 * layers + first + last
    stream_bytes = act * (2 * layers * (s + e) + (first + last) * s)
    tokens = workload.micro_batch_size * workload.seq_length
    rows = []
    if layout.sequence_parallel:
        rows += [
            row("all_gather", *group, m * stream, m * stream_bytes),
            row("reduce_scatter", *group, m * stream, m * stream_bytes),
        ]
        norms = 2 * layers + last
        # Measured (torch 2.13): whole gradients, in bf16 where FSDP computes in bf16 (train_tp.py
        # under bf16), else fp32 (train_pp.py's stages run autocast inside FSDP's root).
        norm_bytes = config.hidden_size * (s if layout.pp == 1 else 4)
        rows.append(row("all_reduce", *group, norms, norms * norm_bytes))
    else:
        rows.append(row("all_reduce", *group, m * stream, m * stream_bytes))
    if last and layout.pp == 1:  # loss_parallel
        rows.append(row("all_reduce", *group, 3 * m, 3 * m * tokens * 4))
    elif last:  # the whole logits, gathered from each rank's slice of the vocabulary
        rows.append(row("all_gather", *group, m, m * tokens * config.vocab_size * e))
    return rows


def pipeline_rows(
    config: LlamaConfig, layout: Layout, workload: Workload, names: GroupNames, rank: int
) -> list[dict]:
    """The pipeline's point-to-point traffic: per micro-batch, each stage but the last sends its
    output activations on, each but the first sends their gradients back, and receives the same;
    a rank counts its own stages' (interleaved: several). One (b, T, d) tensor each (sequence
    parallel: this rank's T / tp positions of it), in the residual stream's dtype (STREAM_BYTES:
    fp32 under fp16's autocast)."""
    if layout.pp == 1:
        return []
    from lib.parallel.pipeline import stage_ids_of_rank

    stages = layout.pp * stages_per_rank(layout)
    pp_rank = rank // (layout.world_size // layout.pp)
    ids = stage_ids_of_rank(pp_rank, layout.pp, stages_per_rank(layout))
    sends = sum((s < stages - 1) + (s > 0) for s in ids) * workload.micro_batches
    act, _ = activation_sizes(config, workload)
    split = layout.tp if layout.sequence_parallel else 1
    nbytes = STREAM_BYTES[workload.precision] * act // split
    group = names.of("pp")
    return [row("send", *group, sends, sends * nbytes), row("recv", *group, sends, sends * nbytes)]


def context_parallel_rows(
    config: LlamaConfig, layout: Layout, workload: Workload, names: GroupNames
) -> list[dict]:
    """Context parallelism (lib/parallel/context_parallel.py): per layer and micro-batch, one
    all-gather of this rank's keys and values into the whole sequence's in forward, and one
    reduce-scatter of their gradients in backward, (2, b, T, kv_dim) in the matmuls' dtype."""
    if layout.cp == 1:
        return []
    m, layers = workload.micro_batches, config.num_hidden_layers
    _, e = activation_sizes(config, workload)
    kv = 2 * workload.micro_batch_size * workload.seq_length * config.num_key_value_heads
    kv *= config.head_dim * e
    group = names.of("cp")
    return [
        row("all_gather", *group, m * layers, m * layers * kv),
        row("reduce_scatter", *group, m * layers, m * layers * kv),
    ]


def expert_parallel_rows(
    config: LlamaConfig, layout: Layout, workload: Workload, names: GroupNames
) -> list[dict]:
    """Expert parallelism (lib/parallel/expert_parallel.py): per MoE layer and micro-batch, one
    all-to-all of the counts (int64, one per expert), then the (token, expert) pairs to their
    experts' ranks and the outputs back, forward and backward: 2 (sent + received) pairs of d
    values. Assumed an even share (received = sent): the tolerance is how far one rank's may be
    from it (from none received to ep times its own)."""
    if layout.ep == 1 or not config.num_local_experts:
        return []
    m, layers = workload.micro_batches, config.num_hidden_layers
    act, e = activation_sizes(config, workload)
    sent = act * config.num_experts_per_tok * e
    counts = 8 * config.num_local_experts
    calls = 5 * m * layers
    nbytes = m * layers * (counts + 4 * sent)
    tolerance = m * layers * 2 * (layout.ep - 1) * sent
    return [row("all_to_all", *names.of("ep"), calls, nbytes, tolerance)]


def muon_rows(
    config: LlamaConfig, layout: Layout, names: GroupNames, rank: int, device: str
) -> list[dict]:
    """--optimizer muon's exchange (lib/extras/muon.py), each hidden matrix orthogonalised by its
    owner (assign_owners, from the matrices' shapes alone), in rounds of one matrix per owner
    (Exchange.rounds, unbatched): DDP's replicas broadcast each result; sharded matrices (FSDP,
    HSDP, TP, CP, a stage's dp ranks, EP's attention) take two all-to-alls a round, the pieces
    (fp32, the gradients' dtype) to their owners (HSDP: from the owner's replica row), and each
    rank's pieces of the results back. ZeRO-1's
    optimizers and whole experts orthogonalise their own: no traffic. The results travel in
    Newton-Schulz's dtype: bf16 on a GPU, fp32 on a CPU (`device`)."""
    from lib.extras.muon import assign_owners, is_hidden_matrix, newton_schulz_flops

    one = dataclasses.replace(config, num_hidden_layers=1)
    with torch.device("meta"):
        model = LlamaForPretraining(one)
    hidden = [p.shape for n, p in model.named_parameters() if is_hidden_matrix(n, p)]
    hidden = [s for s in hidden if len(s) == 2]  # (a stack of experts stays whole on its rank)
    _, _, layers = stage_contents(config, layout, rank)
    b = 2 if device == "cuda" else 4
    split = layout.tp > 1 or layout.pp > 1 or layout.cp > 1 or layout.ep > 1
    if not (split or layout.zero_stage >= 2):  # DDP's replicas, or ZeRO-1's own optimizers
        if layout.zero_stage == 1 or layout.world_size == 1:
            return []
        numel = layers * sum(math.prod(s) for s in hidden)
        return [row("broadcast", *names.of("world"), len(hidden) * layers, numel * b)]
    if len(hidden) * layers > MUON_MATRICES:
        raise ValueError(
            f"--optimizer muon gives each hidden matrix an owner one matrix at a time, and "
            f"{len(hidden) * layers:,} matrices are more than the {MUON_MATRICES:,} the plan "
            f"counts: give at most {MUON_MATRICES // len(hidden):,} layers per stage"
        )
    shapes = hidden * layers
    # The matrices' mesh: FSDP's dimensions (the pipeline's: of one stage) and tp.
    fsdp = names.fsdp()[::-1]  # (in the mesh's order: HSDP's replicas, then its shard groups)
    dims = [d for d in fsdp if d[1] > 1] + ([names.of("tp")] if layout.tp > 1 else [])
    ranks = math.prod(n for _, n in dims)
    if ranks == 1:
        return []
    me = rank % ranks
    replicas = layout.replicate
    owners = assign_owners([newton_schulz_flops(s) for s in shapes], ranks)
    row_of = lambda r: r // (ranks // replicas)  # noqa: E731  (HSDP's replica row of a rank)
    pieces = [piece(s, me % (ranks // replicas), ranks // replicas, len(dims)) for s in shapes]
    to_owners = sum(p for p, o in zip(pieces, owners, strict=True) if row_of(o) == row_of(me))
    results = sum(math.prod(s) * replicas for s, o in zip(shapes, owners, strict=True) if o == me)
    group = dims[0] if len(dims) == 1 else ("+".join(n for n, _ in dims), ranks)
    if len(dims) > 2 or ranks == layout.world_size and len(dims) != 2:
        group = (names.world, ranks)
    rounds = max(owners.count(r) for r in range(ranks))  # (Exchange.rounds: one matrix each)
    return [row("all_to_all", *group, 2 * rounds, 4 * to_owners + b * results)]


def piece(shape: torch.Size, index: int, ranks: int, dims: int) -> int:
    """The elements of a matrix that shard `index` of `ranks` holds: FSDP's dim-0 chunks (the
    last ones short, as torch.chunk cuts), or with tp an even share (exact when it divides)."""
    if dims > 1 or ranks == 1:
        return math.prod(shape) // ranks
    chunk = math.ceil(shape[0] / ranks)
    return max(0, min(chunk, shape[0] - index * chunk)) * math.prod(shape[1:])
