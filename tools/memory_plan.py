"""How much GPU memory (and communication) does training need per GPU, under DDP, each ZeRO stage,
HSDP, and tensor (+ sequence), pipeline, context and expert parallelism?

    python -m tools.memory_plan --model 7b --world-size 8            # Llama 2 7B on 8 GPUs
    python -m tools.memory_plan --model 70b --world-size 64 --tp 8 --pp 4 --micro-batches 16
    python -m tools.memory_plan --model 7b --world-size 16 --cp 4 --seq-length 131072
    python -m tools.memory_plan --model 7b --world-size 32 --replicate 4    # HSDP: 4 nodes of 8
    python -m tools.memory_plan --model 1b --num-experts 8 --world-size 16 --ep 8   # EP 8
    python -m tools.memory_plan --model 70b --world-size 64 --gpu-memory 80 --micro-batch-size 1
    python -m tools.memory_plan --model 1b --num-layers 24 --world-size 8   # a preset, reshaped
    python -m tools.memory_plan --params 7.5e9 --world-size 64 --precision paper   # ZeRO's paper
    python -m tools.memory_plan --model 7b --json                            # machine-readable
    python -m tools.memory_plan --model 70b --world-size 256 --tp 8 --gpu h200   # step time too
    torchrun ... train_fsdp.py --plan ...                        # the plan of the run itself

The command line over lib/extras/memory.py, which holds the formulas, puts them together for the
Layout and Workload the flags give (plan) and prints its table (format_plan); docs/memory.md says
where each formula comes from. Under the table, each strategy's step time, tokens/s per GPU and
MFU on the cluster of --gpu (lib/extras/step_time.py; docs/scale.md says what it assumes).
"""

import json
import math

from lib import exits, flags, model_config
from lib.extras.memory import BYTES_PER_PARAM, Workload, format_plan, plan
from lib.extras.step_time import GPUS, RECOMPUTE, Cluster
from lib.parallel.layout import Layout
from model import PRESETS

MAX_PARAMS = 1e15  # --params: a quadrillion, 500 times the largest models trained today


def main() -> None:
    p = build_parser()
    args = p.parse_args()  # every number finite and in range: see the types in build_parser

    config = None
    shaped = any(getattr(args, name) is not None for name in model_config.MODEL_FLAGS)
    if args.model or shaped or args.params is None:
        try:
            config = model_config.preset_config(args, args.model or "7b")  # and --vocab-size
        except ValueError as e:
            p.error(str(e))
    num_params = int(args.params) if args.params is not None else None  # --params: that count
    model = config if config is not None else num_params  # a shape to plan, or a bare count
    try:
        result = plan(
            model, layout_of(args), workload_of(args), num_params, cluster_of(args), args.recompute
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


def build_parser() -> flags.ArgumentParser:
    """The flags: the model (a preset, its shape flags, or a bare count), the layout and the
    workload."""
    p = flags.ArgumentParser(
        description="Per-GPU memory of DDP, ZeRO-1/2/3 and HSDP (parameters, gradients, "
        "optimizer states, activations), with tensor (+ sequence), pipeline and context "
        "parallelism, the traffic, and which strategies fit. The formulas and their assumptions "
        "are in docs/memory.md, section 5.",
        formatter_class=flags.HelpFormatter,
    )  # never abbreviates a flag; a bad one ends in one line (exits.run)
    positive = flags.number_arg(int, 1)
    p.add_argument("--model", default=None, help=f"preset: {', '.join(PRESETS)} (default: 7b)")
    # The train scripts' own shape flags: plan the shape a run would train.
    model_config.add_shape_flags(p, flags.number_arg)
    p.add_argument(
        "--params",
        type=flags.number_arg(float, 1, MAX_PARAMS),
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
        type=flags.number_arg(float, 0, low_open=True),
        default=80.0,
        help="GB per GPU, to say what fits",
    )
    p.add_argument(
        "--optimizer",
        choices=["adamw", "muon"],
        default="adamw",
        help="muon: one momentum (4 bytes) for the hidden matrices instead of AdamW's two, and "
        "what orthogonalising them on their owners holds and sends (needs --model)",
    )
    add_cluster_flags(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (GB = 1e9 bytes)")
    return p


def add_cluster_flags(p: flags.ArgumentParser) -> None:
    """The cluster the step times are for (docs/scale.md: the datasheets, and what each means)."""
    g = p.add_argument_group("step time (docs/scale.md)")
    g.add_argument(
        "--gpu",
        choices=list(GPUS),
        default="h100",
        help="the GPU: its dense bf16 peak, HBM, NVLink and network bandwidth (SXM datasheets)",
    )
    g.add_argument(
        "--gpus-per-node", type=flags.number_arg(int, 1), default=8, help="GPUs that share NVLink"
    )
    bandwidth = flags.number_arg(float, 0, low_open=True)
    g.add_argument(
        "--nvlink-gbps",
        type=bandwidth,
        default=None,
        help="NVLink GB/s (gigabytes) per GPU and direction (default: the GPU's: h100/h200 450, "
        "a100 300, b200 900)",
    )
    g.add_argument(
        "--network-gbps",
        type=bandwidth,
        default=None,
        help="network GB/s (gigabytes: a 400 Gb/s NIC is 50) per GPU and direction, between "
        "nodes (default: the GPU's: 50, a100 25)",
    )
    g.add_argument(
        "--matmul-efficiency",
        type=flags.number_arg(float, 0, 1, low_open=True),
        default=None,
        help="the fraction of the dense bf16 peak the forward and backward reach (default 0.56, "
        "measured on an H200; python -m tools.bench --matmuls measures yours)",
    )
    g.add_argument(
        "--recompute",
        choices=["auto", *RECOMPUTE],
        default="auto",
        help="activation checkpointing for the step time: full (one more forward), selective "
        "(torchtitan's: every second matmul), none; auto: full only where a row needs it to fit",
    )


def cluster_of(args) -> Cluster:
    """The cluster the flags give (bandwidths in bytes/s; None: the GPU's own)."""
    nvlink, network = (
        None if v is None else v * 1e9 for v in (args.nvlink_gbps, args.network_gbps)
    )
    return Cluster(
        GPUS[args.gpu],
        gpus_per_node=args.gpus_per_node,
        nvlink_bandwidth=nvlink,
        network_bandwidth=network,
        matmul_efficiency=args.matmul_efficiency,
    )


def layout_of(args) -> Layout:
    """The layout the flags give: dp x cp x tp x pp = --world-size GPUs (plan() refuses a world
    size that tp x pp x cp does not divide)."""
    return Layout(
        world_size=args.world_size,
        dp=args.world_size // (args.tp * args.pp * args.cp),
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        ep=args.ep,
        replicate=args.replicate,
        sequence_parallel=args.sequence_parallel,
        schedule=args.schedule,
        stages_per_rank=args.stages_per_rank,
    )


def workload_of(args) -> Workload:
    """What one optimizer step asks of every GPU, as the flags give it."""
    return Workload(
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        micro_batches=args.micro_batches,
        precision=args.precision,
        attention=args.attention,
        gpu_memory_gb=args.gpu_memory,
        optimizer=args.optimizer,
    )


if __name__ == "__main__":
    exits.run(main)
