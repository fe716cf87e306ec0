"""How much GPU memory (and communication) does training need per GPU, under DDP, each ZeRO stage,
HSDP, and tensor (+ sequence), pipeline, context and expert parallelism?

    python memory_plan.py --model 7b --world-size 8                 # Llama 2 7B on 8 GPUs
    python memory_plan.py --model 70b --world-size 64 --tp 8 --pp 4 --micro-batches 16   # 3D
    python memory_plan.py --model 7b --world-size 16 --cp 4 --seq-length 131072       # long context
    python memory_plan.py --model 7b --world-size 32 --replicate 4   # HSDP: 4 nodes of 8
    python memory_plan.py --model 1b --num-experts 8 --world-size 16 --ep 8   # experts: EP 8
    python memory_plan.py --model 70b --world-size 64 --gpu-memory 80 --micro-batch-size 1
    python memory_plan.py --model 1b --num-layers 24 --world-size 8  # a preset, reshaped
    python memory_plan.py --params 7.5e9 --world-size 64 --precision paper   # the ZeRO paper
    python memory_plan.py --model 7b --json                          # machine-readable
    torchrun ... train_fsdp.py --plan ...                            # the plan of the run itself

The formulas, where they come from and what they leave out, are memory_formulas.py's; this
file puts them together for one layout (plan), prints the table (format_plan) and the plan of
a training run (estimate_for_run, the train scripts' --plan), and is the command line.
"""

import json
import math

import cli
import model_flags
import stopping
from memory_formulas import (
    BYTES_PER_PARAM,
    GB,
    STRATEGIES,
    activation_bytes,
    all_to_all_bytes,
    communication_bytes,
    expert_parameters,
    model_states_bytes,
    pipeline_in_flight,
    stage_parameters,
)
from model import PRESETS, LlamaConfig, count_active_parameters, count_parameters
from pipeline import bubble_fraction, split_layers
from tensor_parallel import check_tensor_parallel

MAX_PARAMS = 1e15  # --params: a quadrillion, 500 times the largest models trained today


def plan(
    num_params: int,
    world_size: int,
    precision: str,
    config: LlamaConfig | None = None,
    micro_batch_size: int = 1,
    seq_length: int = 2048,
    attention: str = "flash",
    gpu_memory_gb: float | None = None,
    tp: int = 1,
    pp: int = 1,
    micro_batches: int = 1,
    schedule: str = "1f1b",
    stages_per_rank: int = 2,
    sequence_parallel: bool = False,
    cp: int = 1,
    replicate: int = 1,
    ep: int = 1,
) -> dict:
    """The per-GPU plan for every data-parallel strategy, in GB (1e9 bytes); the --json output.

    world_size = dp x cp x tp x pp GPUs; the ZeRO strategies shard across the dp x cp =
    world_size / (tp * pp) ranks that hold the same part of the model (context-parallel ranks
    hold the same weights, as data-parallel ones do), and HSDP (replicate > 1) within groups of
    dp x cp / replicate of them. Where the pipeline's first and last stages differ, each row is
    the heavier stage's. Without a `config` (a bare parameter count) there is no shape to
    estimate activations from: the activation and total fields are then None, and the
    parameters are assumed evenly split over tp x pp.

    A mixture of experts (config.num_local_experts > 0) is planned as train_ep.py trains it:
    ep ranks share out each layer's experts, and the ZeRO stage shards the experts' states over
    the world_size / ep ranks that hold the same ones (memory_formulas' docstring).
    """
    experts = config.num_local_experts if config is not None else 0
    if experts and max(tp, pp, cp) > 1:
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
    if min(world_size, num_params, tp, pp, cp, replicate, micro_batches) < 1:
        raise ValueError(
            "--world-size, --tp, --pp, --cp, --replicate, --micro-batches and the parameter "
            "count must be positive"
        )
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"--world-size {world_size} is not a multiple of --tp {tp} x --pp {pp} x --cp {cp}: "
            f"every data-parallel replica needs tp x pp x cp GPUs"
        )
    dp = world_size // (tp * pp * cp)
    if config is not None:  # what train_tp.py and train_pp.py refuse, refused here too
        check_tensor_parallel(config, tp)
        split_layers(
            config.num_hidden_layers, pp * (stages_per_rank if schedule == "interleaved" else 1)
        )
    if pp > 1 and schedule == "1f1b" and micro_batches < pp:
        raise ValueError(f"1f1b needs at least as many micro-batches as stages: --micro-batches "
                         f"{micro_batches} < --pp {pp}")  # fmt: skip
    if sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel splits a layer's activations over --tp: give --tp 2+")
    if cp > 1 and config is not None and seq_length % (2 * cp):
        raise ValueError(
            f"--seq-length {seq_length} must be divisible by 2 x --cp = {2 * cp} (the zigzag "
            f"split of train_cp.py: two equal chunks of every sequence per rank)"
        )
    if (dp * cp) % replicate:
        raise ValueError(
            f"--replicate {replicate} does not divide the {dp * cp} ranks that hold the same "
            f"part of the model (dp {dp} x cp {cp}): HSDP needs groups of equal size"
        )
    first_layers, last_logprobs = pipeline_in_flight(schedule, pp, micro_batches, stages_per_rank)
    # Per stage: (parameters on one GPU, layers' worth of one micro-batch's activations held,
    # micro-batches of log-probabilities held).
    if config is not None:
        # --params with --model: that parameter count, split as the model's shape splits.
        scale = num_params / count_parameters(config)
        first, last = (n * scale for n in stage_parameters(config, tp, pp))
        layers = config.num_hidden_layers
        stages = {
            "first": (first, first_layers * layers, 1 if pp == 1 else 0),
            "last": (last, last_logprobs * layers / pp, last_logprobs),
        }
    else:
        stages = {"first": (num_params / (tp * pp), None, None)}
    # A mixture of experts: its experts (scaled as the rest, for --params) split ep ways first,
    # then their states shard over the dp * cp / ep ranks holding the same ones (HSDP's row:
    # plain ZeRO-3 there, as train_ep.py shards them; --replicate is for the rest).
    expert_share = expert_parameters(config) * scale / ep if experts else 0.0
    strategies = {}
    for name in STRATEGIES + (("hsdp",) if replicate > 1 else ()):
        rows = []
        for params, layers, logprob_copies in stages.values():
            states = model_states_bytes(params - expert_share * ep, dp * cp, precision, replicate)
            states = states[name]
            if experts:
                share = model_states_bytes(expert_share, dp * cp // ep, precision)
                share = share["zero3" if name == "hsdp" else name]
                states = {part: states[part] + share[part] for part in states}
            model_states = sum(states.values())
            row = {f"{part}_gb": value / GB for part, value in states.items()}
            row["model_states_gb"] = model_states / GB
            for suffix, ckpt in (("", False), ("_checkpointed", True)):
                acts = None
                if config is not None:
                    acts = activation_bytes(
                        config, micro_batch_size, seq_length, precision, attention, ckpt, tp,
                        layers, logprob_copies, sequence_parallel, cp, ep,
                    )  # fmt: skip
                row[f"activations{suffix}_gb"] = acts / GB if acts is not None else None
                row[f"total{suffix}_gb"] = (model_states + acts) / GB if acts is not None else None
            rows.append(row)
        row = max(rows, key=lambda r: r["total_gb"] or r["model_states_gb"])  # the heavier stage
        for suffix in ("", "_checkpointed"):
            if gpu_memory_gb is not None and row[f"total{suffix}_gb"] is not None:
                row[f"fits{suffix}"] = max(r[f"total{suffix}_gb"] for r in rows) <= gpu_memory_gb
        strategies[name] = row
    heaviest = max(params for params, *_ in stages.values())
    comm = communication_bytes(
        config, heaviest - expert_share * ep, dp * cp, tp, pp, precision, micro_batch_size,
        seq_length, micro_batches, stages_per_rank, schedule, cp, replicate,
    )  # fmt: skip
    expert_comm = communication_bytes(
        None, expert_share, max(dp * cp // ep, 1), tp, pp, precision, micro_batch_size,
        seq_length, micro_batches, stages_per_rank, schedule,
    )["data_parallel"]  # fmt: skip
    for name, row in strategies.items():
        row["dp_comm_gb"] = (
            comm["data_parallel"][name] + expert_comm["zero3" if name == "hsdp" else name]
        ) / GB
    pipelined = pp > 1
    return {
        "num_params": num_params,
        "world_size": world_size,
        "dp": dp,
        "cp": cp,
        "tp": tp,
        "sequence_parallel": sequence_parallel and tp > 1,
        "pp": pp,
        "replicate": replicate,
        "ep": ep,
        "active_params": round(count_active_parameters(config) * scale) if experts else None,
        "expert_params_per_gpu": expert_share if experts else None,
        "ep_comm_gb": (
            all_to_all_bytes(config, micro_batch_size, seq_length, micro_batches, precision, ep)
            / GB
            if experts
            else None
        ),
        "schedule": schedule if pipelined else None,
        "stages_per_rank": stages_per_rank if pipelined and schedule == "interleaved" else None,
        "micro_batches": micro_batches,
        "bubble_fraction": bubble_fraction(schedule, pp, micro_batches, stages_per_rank),
        "tp_comm_gb": comm["tensor_parallel"] / GB if comm["tensor_parallel"] is not None else None,
        "pp_comm_gb": comm["pipeline"] / GB if comm["pipeline"] is not None else None,
        "hsdp_across_groups_gb": (
            comm["hsdp_across_groups"] / GB if comm["hsdp_across_groups"] is not None else None
        ),
        "cp_comm_gb": (
            comm["context_parallel"] / GB if comm["context_parallel"] is not None else None
        ),
        "precision": precision,
        "micro_batch_size": micro_batch_size if config else None,
        "seq_length": seq_length if config else None,
        "attention": attention if config else None,
        "gpu_memory_gb": gpu_memory_gb,
        "strategies": strategies,
    }


def format_plan(p: dict) -> str:
    """The plan as a table, and which strategies fit --gpu-memory."""
    w, g, o = BYTES_PER_PARAM[p["precision"]]
    scale, unit = table_unit(p)

    layout = f"dp {p['dp']} x " + (f"cp {p['cp']} x " if p["cp"] > 1 else "")
    layout += f"tp {p['tp']}" + (" with sequence parallel" if p["sequence_parallel"] else "")
    layout += f" x pp {p['pp']}"
    if p["replicate"] > 1:
        layout += f"; hsdp: {p['replicate']} replicas of {p['dp'] * p['cp'] // p['replicate']}"
    if p["ep"] > 1:
        layout += (
            f"; ep {p['ep']}: each GPU of a group of {p['ep']} holds 1/{p['ep']} of the experts"
        )
    if p["pp"] > 1:
        layout += (
            f", {p['schedule']} schedule"
            + (f" with {p['stages_per_rank']} stages per rank" if p["stages_per_rank"] else "")
            + f", {p['micro_batches']} micro-batches: bubble {p['bubble_fraction']:.0%} of a step"
            + " (heavier of first and last stage shown)"
        )
    lines = [
        f"memory per GPU: {parameter_count(p['num_params'])} parameters, {p['world_size']} GPUs "
        f"({layout}), "
        f"precision {p['precision']} ({w}+{g}+{o} bytes per parameter)"
        + (
            f", micro-batch {p['micro_batch_size']} x {p['seq_length']} tokens, "
            f"{p['attention']} attention"
            if p["micro_batch_size"]
            else ""
        ),
        f"{'strategy':<9}{'params':>9}{'grads':>9}{'optim':>9}{'states':>9}"
        f"{'acts':>9}{'total':>9}{'acts AC':>9}{'total AC':>10}{'dp comm':>10}   ({unit}; "
        f"AC = activation checkpointing; comm = sent per GPU per step)",
    ]

    def gb(x):
        if x is None:
            return "n/a"
        text = f"{x * scale:.2f}"  # table_unit keeps it within a column, up to 1e5 EB
        for exponent in (".2e", ".1e"):  # beyond that, as 1.23e+07 (8 characters at most)
            text = text if len(text) <= 8 else f"{x * scale:{exponent}}"
        return text

    for name, r in p["strategies"].items():
        lines.append(
            f"{name:<9}{gb(r['params_gb']):>9}{gb(r['grads_gb']):>9}{gb(r['optimizer_gb']):>9}"
            f"{gb(r['model_states_gb']):>9}{gb(r['activations_gb']):>9}{gb(r['total_gb']):>9}"
            f"{gb(r['activations_checkpointed_gb']):>9}{gb(r['total_checkpointed_gb']):>10}"
            f"{gb(r['dp_comm_gb']):>10}"
        )
    if p["tp"] > 1 or p["pp"] > 1 or p["cp"] > 1:
        lines.append(
            f"model-parallel traffic per GPU per step: tensor parallel {gb(p['tp_comm_gb'])} "
            f"{unit}, pipeline {gb(p['pp_comm_gb'])} {unit}, context parallel "
            f"{gb(p['cp_comm_gb'])} {unit}"
        )
    if p["active_params"] is not None:
        lines.append(
            f"mixture of experts: {parameter_count(p['active_params'])} of the "
            f"{parameter_count(p['num_params'])} parameters active per token; each GPU holds "
            f"{parameter_count(p['expert_params_per_gpu'])} of the experts' (1/{p['ep']} of them,"
            f" then sharded as each row says); expert parallelism's all-to-alls send "
            f"{gb(p['ep_comm_gb'])} {unit} per GPU per step"
        )
    if p["replicate"] > 1:
        lines.append(
            f"hsdp: {gb(p['hsdp_across_groups_gb'])} {unit} of its dp comm crosses between "
            f"the replica groups (one all-reduce of the gradient shards), the rest stays within "
            f"a group; zero3's rings span every GPU, so all its "
            f"{gb(p['strategies']['zero3']['dp_comm_gb'])} {unit} cross nodes"
        )
    if p["gpu_memory_gb"] is not None:
        fits = [n for n, r in p["strategies"].items() if r.get("fits")]
        fits_ac = [n for n, r in p["strategies"].items() if r.get("fits_checkpointed")]
        budget = f"{p['gpu_memory_gb']:g} GB"
        if p["micro_batch_size"] is None:  # no activations: say which model states fit
            limit = p["gpu_memory_gb"]
            fits = [n for n, r in p["strategies"].items() if r["model_states_gb"] <= limit]
            lines.append(f"model states fit in {budget}: {', '.join(fits) or 'none'}")
        else:
            lines.append(f"fits in {budget}: {', '.join(fits) or 'none'}; with activation "
                         f"checkpointing: {', '.join(fits_ac) or 'none'}")  # fmt: skip
    lines.append("(estimates: leave 1-3 GB for the CUDA context and fragmentation)")
    return "\n".join(lines)


# The table's units, smallest first: (its name, how many of them make a GB).
UNITS = (("MB", 1e3), ("GB", 1.0), ("TB", 1e-3), ("PB", 1e-6), ("EB", 1e-9))


def table_unit(p: dict) -> tuple[float, str]:
    """(scale from GB, unit) of the table: GB, MB for models whose states are under 1 GB (the
    tiny preset of a CPU run would show only zeros in GB), or the smallest larger unit in which
    every figure stays under 100,000, so that the columns never run into each other."""
    figures = [
        value
        for row in p["strategies"].values()
        for value in row.values()
        if isinstance(value, float)
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


def estimate_for_run(
    args,
    run_plan,
    config: LlamaConfig,
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    replicate: int = 1,
    ep: int = 1,
) -> str:
    """The plan of a training run, as the train scripts print it with --plan; run_plan is the
    run's cli.RunSettings (micro-batch, accumulation, precision, attention kernel)."""
    p = plan(
        count_parameters(config),
        world_size,
        run_plan.precision,
        config,
        run_plan.micro_batch_size,
        args.seq_length,
        # SDPA with a dense mask falls back to kernels that store the (s, s) scores; FlexAttention
        # (--attention flex) is a fused kernel like flash attention.
        attention="math" if args.document_mask and run_plan.attention != "flex" else "flash",
        tp=tp,
        pp=pp,
        micro_batches=run_plan.accumulation,
        schedule=schedule,
        stages_per_rank=stages_per_rank,
        sequence_parallel=sequence_parallel,
        cp=cp,
        replicate=replicate,
        ep=ep,
    )
    return format_plan(p)


def main() -> None:
    p = cli.ArgumentParser(
        description="Per-GPU memory of DDP, ZeRO-1/2/3 and HSDP (parameters, gradients, "
        "optimizer states, activations), with tensor (+ sequence), pipeline and context "
        "parallelism, the traffic, and which strategies fit. The formulas and their assumptions "
        "are in memory_formulas.py's docstring.",
        formatter_class=cli.HelpFormatter,
    )  # never abbreviates a flag; a bad one ends in one line (stopping.run)
    positive = cli.number_arg(int, 1)
    p.add_argument("--model", default=None, help=f"preset: {', '.join(PRESETS)} (default: 7b)")
    # The train scripts' own shape flags: plan the shape a run would train.
    model_flags.add_shape_flags(p, cli.number_arg)
    p.add_argument(
        "--params",
        type=cli.number_arg(float, 1, MAX_PARAMS),
        default=None,
        help="a bare parameter count (e.g. 7.5e9) instead of a preset: model states only, since "
        "activations need the model's shape (with --model or a shape flag too, that shape is used "
        f"for them); at most {MAX_PARAMS:g}, 500 times today's largest models",
    )
    p.add_argument(
        "--vocab-size", type=positive, default=None, help="override the preset's vocabulary"
    )
    p.add_argument(
        "--world-size", type=positive, default=8, help="GPUs in all: N = dp x cp x tp x pp"
    )
    p.add_argument("--tp", type=positive, default=1, help="tensor-parallel degree T (train_tp.py)")
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: the norms' and residuals' activations split T ways too "
        "(train_tp.py --sequence-parallel)",
    )
    p.add_argument(
        "--cp",
        type=positive,
        default=1,
        help="context-parallel degree C: each sequence split C ways (train_cp.py)",
    )
    p.add_argument(
        "--replicate",
        type=positive,
        default=1,
        help="HSDP: R replicas, ZeRO-3 within each group of dp x cp / R GPUs, an hsdp row "
        "(train_fsdp.py --replicate)",
    )
    p.add_argument(
        "--ep",
        type=positive,
        default=1,
        help="expert-parallel degree X: each GPU holds 1/X of every layer's experts, with "
        "--num-experts (train_ep.py --ep)",
    )
    p.add_argument("--pp", type=positive, default=1, help="pipeline stages P (train_pp.py)")
    p.add_argument(
        "--schedule",
        choices=["gpipe", "1f1b", "interleaved"],
        default="1f1b",
        help="pipeline schedule: what the first stage holds, and the bubble",
    )
    p.add_argument(
        "--stages-per-rank", type=positive, default=2, help="v: model chunks per GPU, interleaved"
    )
    p.add_argument(
        "--micro-batches",
        type=positive,
        default=1,
        help="micro-batches per optimizer step on each data-parallel replica (gradient "
        "accumulation; the pipeline's m)",
    )
    p.add_argument(
        "--precision",
        choices=list(BYTES_PER_PARAM),
        default="bf16",
        help="fp32/bf16/fp16: what our scripts keep (fp32 master weights, 16-bit compute); "
        "paper: the ZeRO paper's 2+2+12 bytes per parameter",
    )
    p.add_argument(
        "--micro-batch-size", type=positive, default=1, help="sequences per GPU per forward"
    )
    p.add_argument("--seq-length", type=positive, default=2048, help="tokens per sequence")
    p.add_argument(
        "--attention",
        choices=["flash", "math"],
        default="flash",
        help="flash: fused attention stores no (s, s) scores; math: it does (e.g. with masks "
        "on kernels without mask support)",
    )
    p.add_argument(
        "--gpu-memory",
        type=cli.number_arg(float, 0, low_open=True),
        default=80.0,
        help="GB per GPU, to say what fits",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON (GB = 1e9 bytes)")
    args = p.parse_args()  # every number finite and in range: see the types above

    config = None
    shaped = any(getattr(args, name) is not None for name in model_flags.MODEL_FLAGS)
    if args.model or shaped or args.params is None:
        try:
            config = model_flags.preset_config(args, args.model or "7b")  # and --vocab-size
        except ValueError as e:
            p.error(str(e))
    num_params = int(args.params) if args.params is not None else count_parameters(config)
    try:
        result = plan(
            num_params,
            args.world_size,
            args.precision,
            config,
            args.micro_batch_size,
            args.seq_length,
            args.attention,
            args.gpu_memory,
            args.tp,
            args.pp,
            args.micro_batches,
            args.schedule,
            args.stages_per_rank,
            args.sequence_parallel,
            args.cp,
            args.replicate,
            args.ep,
        )
        figures = [v for row in result["strategies"].values() for v in row.values()]
        if not all(math.isfinite(v) for v in figures if isinstance(v, float)):
            raise OverflowError
        text = json.dumps(result, indent=2) if args.json else format_plan(result)
    except ValueError as e:
        p.error(str(e))
    except OverflowError:  # a figure beyond a float's 1e308: a shape flag of hundreds of digits
        p.error("these sizes give figures too large to compute: give realistic sizes")
    print(text)


if __name__ == "__main__":
    stopping.run(main)
