"""The memory planner: the per-GPU memory and traffic of one Layout and Workload under every
data-parallel strategy (plan), printed as a table (format_plan); estimate_for_run is a lesson's
--plan, `python -m tools.memory_plan` the command line. The formulas it puts together are in
lib/extras/memory_formulas.py; docs/memory.md, "The formulas", gives where each comes from.

    layout = Layout(world_size=64, dp=2, tp=8, pp=4)  # lib/parallel/layout.py
    workload = Workload(micro_batch_size=1, seq_length=4096, micro_batches=16, gpu_memory_gb=80)
    print(format_plan(plan(LlamaConfig.from_preset("70b"), layout, workload)))
"""

import dataclasses
import functools

from lib.extras.comm_formulas import count_rows, dimension_rows, wire_bytes
from lib.extras.memory_formulas import (
    BYTES_PER_PARAM,
    Workload,
    activation_bytes,
    expert_parameters,
    hidden_matrices,
    largest_parameter,
    model_states_bytes,
    muon_bytes,
    pipeline_in_flight,
    stage_parameters,
    strategy_layout,
)
from lib.parallel.layout import Layout
from lib.parallel.pipeline import bubble_fraction, split_layers
from lib.parallel.tensor_parallel import check_tensor_parallel
from model import LlamaConfig, count_active_parameters, count_parameters

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
GB = 1e9


# -------------------------------------------------------------------------------------------------
# One layout's plan


def plan(
    model: LlamaConfig | int,
    layout: Layout,
    workload: Workload,
    num_params: int | None = None,
    cluster=None,
    recompute: str = "auto",
) -> dict:
    """The per-GPU plan for every data-parallel strategy, in GB (1e9 bytes); the --json output.

    model: the model's config, or a bare parameter count (then there is no shape to estimate
    activations from: the activation and total fields are None, and the parameters are assumed
    evenly split over tp x pp); with a config, num_params scales its shape to that many
    parameters (tools/memory_plan.py's --params with --model).

    The ZeRO strategies shard across the dp x cp = world_size / (tp * pp) ranks that hold the
    same part of the model (context-parallel ranks hold the same weights, as data-parallel ones
    do), and HSDP (layout.replicate > 1) within groups of dp x cp / replicate of them. Where the
    pipeline's first and last stages differ, each row is the heavier stage's.

    A mixture of experts (config.num_local_experts > 0) is planned as train_ep.py trains it:
    ep ranks share out each layer's experts, and the ZeRO stage shards the states of the experts
    over the world_size / ep ranks that hold the same ones (docs/memory.md, section 5).

    cluster: a step_time.Cluster; each row then gains its step time, tokens/s per GPU and MFU on
    it (lib/extras/step_time.py, docs/scale.md), with activation checkpointing as `recompute`
    says ("auto": none where the row fits without it, else full). None without a model shape.
    """
    config = model if isinstance(model, LlamaConfig) else None
    if num_params is None:
        num_params = count_parameters(config) if config is not None else model
    check_plan(config, num_params, layout, workload)
    # --params with --model: that parameter count, split as the model's shape splits.
    scale = num_params / count_parameters(config) if config is not None else 1.0
    stages = stage_loads(config, scale, num_params, layout, workload)
    expert_params = expert_share(config, scale, layout)  # on one GPU; 0 for a dense model
    names = STRATEGIES + (("hsdp",) if layout.replicate > 1 else ())
    strategies = {
        name: strategy_row(name, stages, expert_params, config, layout, workload) for name in names
    }
    add_data_parallel_traffic(strategies, config, scale, num_params, layout, workload)
    sent = sent_by_dimension(config, layout, workload) if config is not None else None
    cluster_field = {}
    if cluster is not None:
        from lib.extras import step_time  # the planner's step times, only when asked for

        shaped = config if config is not None and scale == 1.0 else None
        step_time.add_step_times(strategies, shaped, layout, workload, cluster, recompute)
        cluster_field = {"cluster": step_time.cluster_fields(cluster)}
    return {
        **layout_fields(num_params, layout),
        **expert_fields(config, scale, expert_params, sent),
        **pipeline_fields(layout, workload),
        **traffic_fields(sent, scale, layout, workload, num_params),
        **workload_fields(config, workload),
        **muon_fields(config, layout, workload),
        **cluster_field,
        "strategies": strategies,
    }


def muon_fields(config: LlamaConfig | None, layout: Layout, workload: Workload) -> dict:
    """--optimizer muon's figures (formulas.muon_bytes), in GB; None under AdamW."""
    if workload.optimizer != "muon":
        return {"optimizer": workload.optimizer, "muon": None}
    count, hidden, _ = hidden_matrices(config)
    figures = {k: v / GB for k, v in muon_bytes(config, layout, workload).items()}
    share = hidden / count_parameters(config)
    return {"optimizer": "muon", "muon": {"matrices": count, "share": share, **figures}}


def check_plan(config: LlamaConfig | None, num_params: int, layout: Layout, workload: Workload):
    """Refuse, with the flag to change, a layout that does not divide, and one that the lesson
    that trains it would refuse."""
    check_experts(config, layout)
    if workload.optimizer == "muon" and config is None:
        raise ValueError("--optimizer muon plans the model's hidden matrices: give --model")
    tp, pp, cp, world_size = layout.tp, layout.pp, layout.cp, layout.world_size
    if min(world_size, num_params, tp, pp, cp, layout.replicate, workload.micro_batches) < 1:
        raise ValueError(
            "--world-size, --tp, --pp, --cp, --replicate, --micro-batches and the parameter "
            "count must be positive"
        )
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"--world-size {world_size} is not a multiple of --tp {tp} x --pp {pp} x --cp {cp}: "
            f"every data-parallel replica needs tp x pp x cp GPUs"
        )
    if layout.dp * tp * pp * cp != world_size:
        raise ValueError(f"the layout's dp {layout.dp} x tp x pp x cp is not {world_size} GPUs")
    if config is not None:  # what train_tp.py and train_pp.py refuse, refused here too
        check_tensor_parallel(config, tp)
        chunks = layout.stages_per_rank if layout.schedule == "interleaved" else 1
        split_layers(config.num_hidden_layers, pp * chunks)
    if pp > 1 and layout.schedule == "1f1b" and workload.micro_batches < pp:
        raise ValueError(
            f"1f1b needs at least as many micro-batches as stages: --micro-batches "
            f"{workload.micro_batches} < --pp {pp}"
        )
    if layout.sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel splits a layer's activations over --tp: give --tp 2+")
    if cp > 1 and config is not None and workload.seq_length % (2 * cp):
        raise ValueError(
            f"--seq-length {workload.seq_length} must be divisible by 2 x --cp = {2 * cp} (the "
            f"zigzag split of train_cp.py: two equal chunks of every sequence per rank)"
        )
    if (layout.dp * cp) % layout.replicate:
        raise ValueError(
            f"--replicate {layout.replicate} does not divide the {layout.dp * cp} ranks that hold "
            f"the same part of the model (dp {layout.dp} x cp {cp}): HSDP needs groups of equal "
            f"size"
        )


def check_experts(config: LlamaConfig | None, layout: Layout):
    """Refuse expert parallelism without experts, and experts in a layout no lesson trains."""
    experts = config.num_local_experts if config is not None else 0
    ep, world_size = layout.ep, layout.world_size
    if experts and max(layout.tp, layout.pp, layout.cp) > 1:
        raise ValueError(
            "a mixture of experts trains with data parallelism and --ep (train_ep.py), not "
            "with --tp, --pp or --cp: no lesson combines them"
        )
    if ep > 1 and not experts:
        raise ValueError("--ep shares out the experts of a mixture of experts: give --num-experts")
    if ep < 1 or (experts and (experts % ep or world_size % ep)):
        raise ValueError(
            f"--ep {ep} must divide --num-experts {experts} and --world-size {world_size}: each "
            f"rank of an EP group holds the same number of experts"
        )


def stage_loads(
    config: LlamaConfig | None, scale: float, num_params: int, layout: Layout, workload: Workload
) -> list[tuple]:
    """Per pipeline stage, the first and the last: (parameters on one GPU, layers' worth of one
    micro-batch's activations held, micro-batches of log-probabilities held). Without a config,
    one stage of evenly split parameters, and no activations (None)."""
    tp, pp = layout.tp, layout.pp
    if config is None:
        return [(num_params / (tp * pp), None, None)]
    first_layers, last_logprobs = pipeline_in_flight(
        layout.schedule, pp, workload.micro_batches, layout.stages_per_rank
    )
    first, last = (n * scale for n in stage_parameters(config, tp, pp))
    layers = config.num_hidden_layers
    return [
        (first, first_layers * layers, 1 if pp == 1 else 0),
        (last, last_logprobs * layers / pp, last_logprobs),
    ]


def expert_share(config: LlamaConfig | None, scale: float, layout: Layout) -> float:
    """The expert parameters on one GPU (0 for a dense model): the experts (scaled as the rest of
    the model is, for --params) split ep ways."""
    if config is None or not config.num_local_experts:
        return 0.0
    return expert_parameters(config) * scale / layout.ep


def strategy_row(
    name: str,
    stages: list[tuple],
    expert_params: float,
    config: LlamaConfig | None,
    layout: Layout,
    workload: Workload,
) -> dict:
    """One strategy's row of the plan: the heavier stage's states, activations and totals, and
    whether every stage fits workload.gpu_memory_gb, with and without activation checkpointing."""
    rows = [stage_row(name, stage, expert_params, config, layout, workload) for stage in stages]
    row = max(rows, key=lambda r: r["total_gb"] or r["model_states_gb"])  # the heavier stage
    for suffix in ("", "_checkpointed"):
        if workload.gpu_memory_gb is not None and row[f"total{suffix}_gb"] is not None:
            heaviest = max(r[f"total{suffix}_gb"] for r in rows)
            row[f"fits{suffix}"] = heaviest <= workload.gpu_memory_gb
    return row


def stage_row(
    name: str,
    stage: tuple,
    expert_params: float,
    config: LlamaConfig | None,
    layout: Layout,
    workload: Workload,
) -> dict:
    """One pipeline stage under one strategy: {params, grads, optimizer, model_states,
    activations, total, activations_checkpointed, total_checkpointed}_gb."""
    params, layers, logprob_copies = stage
    states = strategy_states(name, params, expert_params, layout, workload.precision)
    if workload.optimizer == "muon":  # one momentum (4 bytes) for the hidden matrices, not two
        _, hidden, _ = hidden_matrices(config)
        states["optimizer"] *= 1 - hidden / count_parameters(config) / 2
    model_states = sum(states.values())
    row = {f"{part}_gb": value / GB for part, value in states.items()}
    row["model_states_gb"] = model_states / GB
    for suffix, checkpointing in (("", False), ("_checkpointed", True)):
        acts = None
        if config is not None:
            acts = activation_bytes(config, layout, workload, checkpointing, layers, logprob_copies)
        row[f"activations{suffix}_gb"] = acts / GB if acts is not None else None
        row[f"total{suffix}_gb"] = (model_states + acts) / GB if acts is not None else None
    return row


def strategy_states(
    name: str, params: float, expert_params: float, layout: Layout, precision: str
) -> dict[str, float]:
    """{"params", "grads", "optimizer"} bytes on one GPU that holds `params` parameters, of which
    `expert_params` are its share of a mixture of experts: the rest shards over the dp x cp ranks
    (HSDP: within its replica groups), the experts over the dp x cp / ep ranks that hold the same
    ones (HSDP's row: plain ZeRO-3 there, as train_ep.py shards them; --replicate is for the
    rest)."""
    ranks = layout.dp * layout.cp
    others = params - expert_params * layout.ep  # params holds every expert
    rest = model_states_bytes(others, ranks, precision, layout.replicate)[name]
    if not expert_params:
        return rest
    share = model_states_bytes(expert_params, ranks // layout.ep, precision)
    share = share["zero3" if name == "hsdp" else name]
    return {part: rest[part] + share[part] for part in rest}


def sent_by_dimension(config: LlamaConfig, layout: Layout, workload: Workload) -> list[dict]:
    """Per pipeline stage, {dimension: bytes one GPU sends across it per step}: the wire_bytes of
    comm_formulas.dimension_rows (the rows --comm-ledger measures), by the mesh dimension each
    crosses ("dp", "replicate", "tp", "pp", "cp", "ep"), Muon's exchange apart (muon_fields).
    The first, the second and the last stage stand for all: the second has the most layers and
    sends of any middle one (split_layers gives the first stages the extra layers)."""
    adamw = dataclasses.replace(workload, optimizer="adamw")
    per_stage = layout.world_size // layout.pp  # the ranks of one stage: pp rank = rank // this
    stages = []
    for pp_rank in sorted({0, min(1, layout.pp - 1), layout.pp - 1}):
        sent = dict.fromkeys(("dp", "replicate", "tp", "pp", "cp", "ep"), 0.0)
        for r in dimension_rows(config, layout, adamw, rank=pp_rank * per_stage):
            sent[r["dim"]] += wire_bytes([r])
        stages.append(sent)
    return stages


def most(stages: list[dict], *dims: str) -> float:
    """The most any stage sends across these dimensions, in GB."""
    return max(sum(sent[d] for d in dims) for sent in stages) / GB


def add_data_parallel_traffic(
    strategies: dict,
    config: LlamaConfig | None,
    scale: float,
    num_params: float,
    layout: Layout,
    workload: Workload,
):
    """Each row's dp_comm_gb: what its data-parallel collectives send per GPU per step (HSDP's
    between its replica groups too), on the stage that sends the most; scaled as the parameters
    are for --params with --model. A bare parameter count (no config): its share of each tp x pp
    split as one flat parameter (comm_formulas.count_rows), the ZeRO paper's accounting."""
    for name, row in strategies.items():
        strategy = strategy_layout(name, layout)
        if config is None:
            rows = count_rows(num_params / (layout.tp * layout.pp), strategy, workload)
            row["dp_comm_gb"] = wire_bytes(rows) / GB
            continue
        stages = sent_by_dimension(config, strategy, workload)
        row["dp_comm_gb"] = most(stages, "dp", "replicate") * scale


def layout_fields(num_params: int, layout: Layout) -> dict:
    """The plan's sizes: the model's, and the grid's."""
    return {
        "num_params": num_params,
        "world_size": layout.world_size,
        "dp": layout.dp,
        "cp": layout.cp,
        "tp": layout.tp,
        "sequence_parallel": layout.sequence_parallel and layout.tp > 1,
        "pp": layout.pp,
        "replicate": layout.replicate,
        "ep": layout.ep,
    }


def expert_fields(
    config: LlamaConfig | None, scale: float, expert_params: float, sent: list[dict] | None
) -> dict:
    """A mixture of experts: the parameters active per token, the expert parameters on one GPU,
    and the traffic across ep: the all-to-alls and the experts' gradient norms (all None for a
    dense model)."""
    if not expert_params:
        return {"active_params": None, "expert_params_per_gpu": None, "ep_comm_gb": None}
    return {
        "active_params": round(count_active_parameters(config) * scale),
        "expert_params_per_gpu": expert_params,
        "ep_comm_gb": most(sent, "ep"),
    }


def pipeline_fields(layout: Layout, workload: Workload) -> dict:
    """The pipeline's schedule (None without one), the micro-batches and the bubble."""
    pipelined = layout.pp > 1
    interleaved = pipelined and layout.schedule == "interleaved"
    return {
        "schedule": layout.schedule if pipelined else None,
        "stages_per_rank": layout.stages_per_rank if interleaved else None,
        "micro_batches": workload.micro_batches,
        "bubble_fraction": bubble_fraction(
            layout.schedule, layout.pp, workload.micro_batches, layout.stages_per_rank
        ),
    }


def traffic_fields(
    sent: list[dict] | None, scale: float, layout: Layout, workload: Workload, num_params: float
) -> dict:
    """What tensor, pipeline and context parallelism send per GPU per step (None without a
    config), and what HSDP sends between its replica groups (None without replicas), in GB: each
    the most any pipeline stage sends (sent_by_dimension); a bare count's HSDP, that of its flat
    parameter (comm_formulas.count_rows)."""
    across = None
    if layout.replicate > 1 and sent is None:
        local = num_params / (layout.tp * layout.pp)
        rows = count_rows(local, strategy_layout("hsdp", layout), workload)
        across = wire_bytes([r for r in rows if r["dim"] == "replicate"]) / GB
    elif layout.replicate > 1:
        across = most(sent, "replicate") * scale
    shapeless = dict.fromkeys(("tp_comm_gb", "pp_comm_gb", "cp_comm_gb"))  # (no activations)
    if sent is None:  # a bare count
        return shapeless | {"hsdp_across_groups_gb": across}
    return {
        "tp_comm_gb": most(sent, "tp"),
        "pp_comm_gb": most(sent, "pp"),
        "hsdp_across_groups_gb": across,
        "cp_comm_gb": most(sent, "cp"),
    }


def workload_fields(config: LlamaConfig | None, workload: Workload) -> dict:
    """The workload planned (its shape only with a config), and the largest parameter."""
    shaped = config is not None
    return {
        "precision": workload.precision,
        "micro_batch_size": workload.micro_batch_size if shaped else None,
        "seq_length": workload.seq_length if shaped else None,
        "attention": workload.attention if shaped else None,
        "gpu_memory_gb": workload.gpu_memory_gb,
        # At build, a rank draws each parameter whole before keeping its part (init_weights in
        # the lessons): its params column, plus the largest parameter, for an instant.
        "largest_param_gb": largest_parameter(config) * 4 / GB if shaped else None,
    }


def estimate_for_run(args, settings, config: LlamaConfig, layout: Layout) -> str:
    """The plan of a training run, as the lessons print it with --plan: `layout` is what the
    lesson's strategy module set up, `settings` the run's flags.RunSettings (micro-batch,
    accumulation, precision, attention kernel)."""
    # SDPA with a dense mask falls back to kernels that store the (s, s) scores; FlexAttention
    # (--attention flex) is a fused kernel like flash attention.
    flex = settings.attention == "flex"
    attention = "math" if args.document_mask and not flex else "flash"
    workload = Workload(
        micro_batch_size=settings.micro_batch_size,
        seq_length=args.seq_length,
        micro_batches=settings.accumulation,
        precision=settings.precision,
        attention=attention,
        optimizer=args.optimizer,
    )
    return format_plan(plan(config, layout, workload))


# -------------------------------------------------------------------------------------------------
# The plan as a table

UNITS = (("MB", 1e3), ("GB", 1.0), ("TB", 1e-3), ("PB", 1e-6), ("EB", 1e-9))


def format_plan(p: dict) -> str:
    """The plan as a table, and which strategies fit the GPU's memory."""
    scale, unit = table_unit(p)
    gb = functools.partial(figure, scale=scale)  # a figure of the plan (GB) in the table's unit
    # The rows a lesson can run: train_ep.py shards with FSDP alone (--zero-stage 2 or 3).
    shown = {n: r for n, r in p["strategies"].items() if p["ep"] == 1 or n not in ("ddp", "zero1")}
    lines = [plan_title(p), table_header(unit)]
    lines += [strategy_line(name, row, gb) for name, row in shown.items()]
    lines += traffic_notes(p)
    lines += fit_notes(p, shown)
    lines.append("(estimates: leave 1-3 GB for the CUDA context and fragmentation)")
    if p.get("cluster"):  # the step times, where the plan has them
        from lib.extras.step_time import format_step_times

        lines += format_step_times({**p, "strategies": shown})
    return "\n".join(lines)


def plan_title(p: dict) -> str:
    """The table's first line: the model, the GPUs and their layout, the precision and the
    micro-batch."""
    w, g, o = BYTES_PER_PARAM[p["precision"]]
    per_parameter = f"{w}+{g}+{o} bytes per parameter"
    if p.get("muon"):  # one momentum for the hidden matrices: 4 bytes where AdamW keeps 8
        per_parameter += f"; Muon's {p['muon']['share']:.0%} of them {w}+{g}+{o // 2}"
    title = (
        f"memory per GPU: {parameter_count(p['num_params'])} parameters, {p['world_size']} GPUs "
        f"({layout_words(p)}), precision {p['precision']} ({per_parameter})"
    )
    if p["micro_batch_size"]:
        title += (
            f", micro-batch {p['micro_batch_size']} x {p['seq_length']} tokens, "
            f"{p['attention']} attention"
        )
    return title


def layout_words(p: dict) -> str:
    """The layout in words: "dp 2 x tp 8 x pp 4, 1f1b schedule, ..."."""
    words = f"dp {p['dp']} x " + (f"cp {p['cp']} x " if p["cp"] > 1 else "")
    words += f"tp {p['tp']}" + (" with sequence parallel" if p["sequence_parallel"] else "")
    words += f" x pp {p['pp']}"
    if p["replicate"] > 1:
        words += f"; hsdp: {p['replicate']} replicas of {p['dp'] * p['cp'] // p['replicate']}"
    if p["ep"] > 1:  # as train_ep.py says it: every GPU reads its own share, whatever the groups
        groups = p["world_size"] // p["ep"]
        words = (
            f"{groups} EP group{'s' * (groups > 1)} x ep {p['ep']}: each GPU holds "
            f"1/{p['ep']} of the experts and reads its own share of the batch"
        )
    if p["pp"] > 1:
        per_rank = p["stages_per_rank"]
        words += (
            f", {p['schedule']} schedule"
            + (f" with {per_rank} stages per rank" if per_rank else "")
            + f", {p['micro_batches']} micro-batches: bubble {p['bubble_fraction']:.0%} of a step"
            + " (heavier of first and last stage shown)"
        )
    return words


def table_header(unit: str) -> str:
    """The names of the table's columns, and its unit."""
    return (
        f"{'strategy':<9}{'params':>9}{'grads':>9}{'optim':>9}{'states':>9}"
        f"{'acts':>9}{'total':>9}{'acts AC':>9}{'total AC':>10}{'dp comm':>10}   ({unit}; "
        f"AC = activation checkpointing; comm = sent per GPU per step)"
    )


def strategy_line(name: str, r: dict, gb) -> str:
    """One strategy's row of the table."""
    return (
        f"{name:<9}{gb(r['params_gb']):>9}{gb(r['grads_gb']):>9}{gb(r['optimizer_gb']):>9}"
        f"{gb(r['model_states_gb']):>9}{gb(r['activations_gb']):>9}{gb(r['total_gb']):>9}"
        f"{gb(r['activations_checkpointed_gb']):>9}{gb(r['total_checkpointed_gb']):>10}"
        f"{gb(r['dp_comm_gb']):>10}"
    )


def traffic_notes(p: dict) -> list[str]:
    """The lines under the table on traffic: tensor, pipeline and context parallelism's, the
    experts' all-to-alls, what HSDP sends between its replica groups, and Muon's exchange."""
    lines = []
    if muon := p.get("muon"):
        lines.append(
            f"muon: {muon['matrices']} hidden matrices, each orthogonalised on one GPU of those "
            f"holding its pieces: {amount(muon['whole'])} of whole matrices at once on each; "
            f"{amount(muon['sent_sharded'])} sent per GPU per step sharded (FSDP, TP, CP), "
            f"{amount(muon['sent_replicated'])} replicated (DDP)"
        )
    if p["tp"] > 1 or p["pp"] > 1 or p["cp"] > 1:
        lines.append(
            f"model-parallel traffic per GPU per step: tensor parallel "
            f"{amount(p['tp_comm_gb'])}, pipeline {amount(p['pp_comm_gb'])}, context parallel "
            f"{amount(p['cp_comm_gb'])}"
        )
    if p["active_params"] is not None:
        lines.append(
            f"mixture of experts: {parameter_count(p['active_params'])} of the "
            f"{parameter_count(p['num_params'])} parameters active per token; each GPU holds "
            f"{parameter_count(p['expert_params_per_gpu'])} of the experts' (1/{p['ep']} of them,"
            f" then sharded as each row says); expert parallelism's all-to-alls send "
            f"{amount(p['ep_comm_gb'])} per GPU per step"
        )
    if p["replicate"] > 1:
        lines.append(
            f"hsdp: {amount(p['hsdp_across_groups_gb'])} of its dp comm crosses between "
            f"the replica groups (one all-reduce of the gradient shards), the rest stays within "
            f"a group; zero3's rings span every GPU, so all its "
            f"{amount(p['strategies']['zero3']['dp_comm_gb'])} cross nodes"
        )
    return lines


def fit_notes(p: dict, shown: dict) -> list[str]:
    """The lines under the table on memory: which strategies fit the GPU's, and what a GPU holds
    at build."""
    lines = []
    if p["gpu_memory_gb"] is not None:
        budget = f"{p['gpu_memory_gb']:g} GB"
        if p["micro_batch_size"] is None:  # no activations: say which model states fit
            fits = [n for n, r in shown.items() if r["model_states_gb"] <= p["gpu_memory_gb"]]
            lines.append(f"model states fit in {budget}: {', '.join(fits) or 'none'}")
        else:
            fits = ", ".join(n for n, r in shown.items() if r.get("fits")) or "none"
            fits_ac = ", ".join(n for n, r in shown.items() if r.get("fits_checkpointed"))
            lines.append(
                f"fits in {budget}: {fits}; with activation checkpointing: {fits_ac or 'none'}"
            )
    if p["largest_param_gb"] is not None:
        lines.append(
            f"at build (on the meta device, then one parameter at a time): each GPU holds its "
            f"params, and the largest parameter whole for an instant "
            f"({amount(p['largest_param_gb'])})"
        )
    return lines


def figure(gb: float | None, scale: float) -> str:
    """One figure of the table: `gb` in the table's unit (GB times `scale`), 8 characters at
    most; "n/a" where the plan has none."""
    if gb is None:
        return "n/a"
    text = f"{gb * scale:.2f}"  # table_unit keeps it within a column, up to 1e5 EB
    for exponent in (".2e", ".1e"):  # beyond that, as 1.23e+07 (8 characters at most)
        text = text if len(text) <= 8 else f"{gb * scale:{exponent}}"
    return text


def amount(gb: float | None) -> str:
    """One figure of a line under the table, in a unit of its own (the table's suits its
    largest figure, and would show a small one in a line as 0.00): "0.50 GB", "12.3 PB"."""
    if gb is None:
        return "n/a"
    name, scale = next(((n, s) for n, s in reversed(UNITS) if gb * s >= 1), UNITS[0])
    return f"{figure(gb, scale)} {name}"


def table_unit(p: dict) -> tuple[float, str]:
    """(scale from GB, unit) of the table: GB, MB for models whose states are under 1 GB (the
    tiny preset of a CPU run would show only zeros in GB), or the smallest larger unit in which
    every figure stays under 100,000, so that the columns never run into each other."""
    figures = [
        value
        for row in p["strategies"].values()
        for key, value in row.items()
        if key.endswith("_gb") and isinstance(value, float)
    ] + [
        p[k] or 0.0
        for k in ("tp_comm_gb", "pp_comm_gb", "cp_comm_gb", "hsdp_across_groups_gb", "ep_comm_gb")
    ]
    largest = max(figures)
    i = 1 if p["strategies"]["ddp"]["model_states_gb"] >= 1 else 0
    while largest * UNITS[i][1] >= 1e5 and i + 1 < len(UNITS):
        i += 1
    name, scale = UNITS[i]
    return scale, name


def parameter_count(n: float) -> str:
    """6.74B, 1.5T: the parameter count of the table's first line."""
    return f"{n / 1e12:.4g}T" if n >= 1e12 else f"{n / 1e9:.3g}B"
