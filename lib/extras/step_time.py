"""The step-time model of the planner: how long one optimizer step of a Layout and Workload takes
on a named cluster, the tokens per second per GPU and the MFU that gives, and where the time goes
(compute, communication left exposed, the pipeline's bubble, the optimizer step).

    cluster = Cluster(GPUS["h100"], gpus_per_node=8)
    rows = step_rows(config, layout, workload)  # what one rank sends in a step (lib/extras/)
    step = step_time(config, layout, workload, cluster, rows, recompute="full")
    step["step_time_s"], step["tokens_per_sec_per_gpu"], step["mfu"]

The inputs are the rows of communication of one step of one rank ({op, group, group_size, calls,
bytes}: the schema of --comm-ledger's comm_ledger.json), the model's FLOPs per token (PaLM's
count, lib/metrics.py: the same as the MFU the lessons log) and the cluster's datasheet figures.
Every assumption is named in docs/scale.md, "The step-time model", with the published tables it
is held against (tests/data/published_step_times.json).
"""

import math
from dataclasses import dataclass

from lib.extras.comm_formulas import step_rows
from lib.extras.memory_formulas import (
    Workload,
    hidden_matrices,
    stage_parameters,
    strategy_layout,
)
from lib.extras.muon import newton_schulz_flops
from lib.metrics import flops_per_token
from lib.parallel.layout import Layout
from lib.parallel.pipeline import bubble_fraction
from model import LlamaConfig


@dataclass(frozen=True)
class GPU:
    """One GPU's datasheet figures (docs/scale.md gives the sources): dense bf16 tensor-core peak
    (FLOP/s, no sparsity), HBM bandwidth, NVLink and network bandwidth per GPU and direction
    (bytes/s), and the fraction of the peak this suite's compiled bf16 step reaches on it."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    nvlink_bandwidth: float
    network_bandwidth: float
    matmul_efficiency: float


# The default matmul efficiency, 0.56: one H200 ran this suite's 1b step (seq 2048, micro-batch
# 8, bf16, --compile) in 213.1 ms, 54.7% MFU (BENCHMARKS.md); AdamW's 28 bytes per parameter over
# 4.8 TB/s took 6.1 ms of it, so the forward and backward ran at 0.563 of the peak. The H100 has
# the same tensor cores and clocks at 700 W; the A100's and B200's are not measured here
# (tools/bench.py --matmuls times any GPU's matmuls: pass a figure as --matmul-efficiency).
MEASURED_EFFICIENCY = 0.56
GPUS = {
    "h100": GPU("H100 SXM", 989e12, 3.35e12, 450e9, 50e9, MEASURED_EFFICIENCY),
    "h200": GPU("H200 SXM", 989e12, 4.8e12, 450e9, 50e9, MEASURED_EFFICIENCY),
    "a100": GPU("A100 SXM 80GB", 312e12, 2.039e12, 300e9, 25e9, MEASURED_EFFICIENCY),
    "b200": GPU("B200 (HGX, 1000 W)", 2.25e15, 8e12, 900e9, 50e9, MEASURED_EFFICIENCY),
}

# A collective's fixed cost per call, whatever its size: NCCL's launch and its first hop.
LATENCY_NVLINK, LATENCY_NETWORK = 10e-6, 25e-6
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default
# AdamW's bytes per parameter: it reads the fp32 weight, gradient and two moments and writes
# back the weight and the moments; Muon's momentum step reads three and writes two.
ADAMW_BYTES, MUON_BYTES = 28, 20
# The mesh's dimensions, outermost first (lib/parallel/*.py): consecutive ranks share a node, so
# tp is innermost, then cp or ep, then FSDP's shard group, then its replicas and the pipeline.
MESH_ORDER = ("pp", "replicate", "shard", "dp", "cp", "ep", "tp")
MODEL_PARALLEL = {"tp", "cp", "ep"}
RECOMPUTE = ("none", "full", "selective")


@dataclass(frozen=True)
class Cluster:
    """The GPUs a layout runs on: nodes of gpus_per_node, NVLink inside a node, the network
    between nodes (bytes/s per GPU and direction), matmuls at matmul_efficiency of the peak."""

    gpu: GPU
    gpus_per_node: int = 8
    nvlink_bandwidth: float | None = None  # None: the GPU's
    network_bandwidth: float | None = None
    matmul_efficiency: float | None = None

    def figure(self, name: str) -> float:
        """The cluster's own figure, or else its GPU's datasheet one."""
        value = getattr(self, name)
        return getattr(self.gpu, name) if value is None else value


# -------------------------------------------------------------------------------------------------
# What one rank sends in a step, from the planner's formulas


def muon_flops(config: LlamaConfig) -> float:
    """lib/extras/muon.newton_schulz_flops over every hidden matrix of the model: each layer's
    wq, wo (d x d), wk, wv (kv x d) and the MLP's w1, w3, w2 (ffn x d; each expert's)."""
    d, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    layers, mlps = config.num_hidden_layers, max(config.num_local_experts, 1)
    shapes = (
        (2 * layers, d, d),
        (2 * layers, kv, d),
        (3 * layers * mlps, config.intermediate_size, d),
    )
    return sum(count * newton_schulz_flops((r, c)) for count, r, c in shapes)


# -------------------------------------------------------------------------------------------------
# Where each collective runs, and how long it takes


def mesh_sizes(layout: Layout) -> dict[str, int]:
    """The size of each dimension of the layout's mesh, in MESH_ORDER (1 where it has none)."""
    dp = layout.dp // layout.ep  # expert parallelism: dp counts every rank, the ep ones too
    return {
        "pp": layout.pp,
        "replicate": layout.replicate,
        "shard": dp // layout.replicate,
        "dp": dp,
        "cp": layout.cp,
        "ep": layout.ep,
        "tp": layout.tp,
    }


HSDP_DIMS = ("replicate", "shard")


def group_span(group: str, size: int, layout: Layout) -> int:
    """How many consecutive ranks a group of `size` spans: its size times the stride of its
    innermost dimension (the product of the dimensions inside it). A group named by dimensions
    the mesh does not have spans `size` consecutive ranks."""
    dims = group.split("+")
    if not all(d in MESH_ORDER for d in dims):  # "world", the default group: every rank
        return size
    sizes = mesh_sizes(layout)
    innermost = max(MESH_ORDER.index(d) for d in dims)
    # HSDP's replicate x shard is the dp dimension: count one or the other.
    hsdp = {"shard", "replicate"} & set(dims)
    inside = [d for d in MESH_ORDER[innermost + 1 :] if d not in (("dp",) if hsdp else HSDP_DIMS)]
    return size * math.prod(sizes[d] for d in inside)


# What share of a call's buffer crosses each rank's link: ring algorithms (all_to_all: the parts
# for the other ranks). Sends and receives share a full-duplex link: the send carries the time.
def wire_factor(op: str, n: int) -> float:
    """Bytes on the slowest link per byte of the call's buffer, for n ranks."""
    ring = (n - 1) / n
    return {
        "all_reduce": 2 * ring,
        "all_gather": ring,
        "reduce_scatter": ring,
        "all_to_all": ring,
        "broadcast": ring,  # a round of broadcasts, one per owner: all but one's own arrive
        "send": 1.0,
        "recv": 0.0,
    }[op]


def row_seconds(r: dict, layout: Layout, cluster: Cluster) -> float:
    """One row's time: its bytes on the wire over the link's bandwidth, and a fixed latency per
    call. A group inside a node runs on NVLink. A group across nodes runs its rings through the
    network, but only one hop of each ring in k crosses it when k of its ranks share a node, and
    NCCL runs one ring per NIC: k GPUs' network bandwidth, at most NVLink's (nccl-tests' bus
    bandwidth across 8-GPU nodes is close to 8 NICs', not one)."""
    span = group_span(r["group"], r["group_size"], layout)
    nodes = cluster.gpus_per_node
    if span <= nodes:
        bandwidth, latency = cluster.figure("nvlink_bandwidth"), LATENCY_NVLINK
    else:
        per_node = max(1, nodes * r["group_size"] // span)  # the group's ranks in one node
        network = per_node * cluster.figure("network_bandwidth")
        bandwidth, latency = min(network, cluster.figure("nvlink_bandwidth")), LATENCY_NETWORK
    wire = wire_factor(r["op"], r["group_size"]) * r["bytes"]
    return wire / bandwidth + (r["calls"] * latency if r["op"] != "recv" else 0.0)


def overlap_class(r: dict, zero_stage: int) -> str:
    """How a row's time adds to the step: "layer" (inside the layers' forward and backward,
    waited for: tensor, context and expert parallelism; the pipeline's sends), "fsdp" (prefetched
    behind the compute), "ddp" (bucketed behind the backward) or "optimizer" (after the backward:
    ZeRO-1's broadcasts, Muon's exchange)."""
    dims = set(r["group"].split("+"))
    if r["op"] in ("send", "recv"):
        return "layer"
    if r["op"] == "broadcast" or (r["op"] == "all_to_all" and "ep" not in dims):
        return "optimizer"
    if dims & MODEL_PARALLEL and not ({"dp", "shard", "replicate"} & dims):
        return "layer"
    return "ddp" if zero_stage <= 1 else "fsdp"


def exposed_data_parallel(
    timed: list[tuple[dict, float]], hide_under: float, kind: str, micro_batches: int
) -> float:
    """What of the data-parallel rows (row, seconds) the compute (`hide_under` seconds of it)
    cannot hide. FSDP prefetches each layer's all-gather during the layer before and
    reduce-scatters during the layer after: hidden, except the first all-gather of each forward
    (nothing runs before it) and the last reduce-scatter. DDP all-reduces each bucket as the
    backward fills it: hidden, except the last bucket."""
    total = sum(seconds for _, seconds in timed)
    unhidden = 0.0
    for r, seconds in timed:
        per_call = seconds / r["calls"]
        firsts = micro_batches if r["op"] == "all_gather" and kind == "fsdp" else 1
        unhidden += per_call * min(firsts, r["calls"])
    return unhidden + max(0.0, total - unhidden - hide_under)


# -------------------------------------------------------------------------------------------------
# The step


def step_time(
    config: LlamaConfig,
    layout: Layout,
    workload: Workload,
    cluster: Cluster,
    rows: list[dict],
    recompute: str = "none",
    overlap_tp: bool = False,
) -> dict:
    """One optimizer step on `cluster`: {step_time_s, tokens_per_sec_per_gpu, mfu, and where the
    time goes: compute_s, exposed_comm_s, bubble_s, optimizer_s}. `rows`: what one rank sends in the
    step (comm_formulas.step_rows, or a --comm-ledger's); recompute: "none", "full" (activation
    checkpointing: one more forward) or "selective" (torchtitan's policy: every second matmul of a
    layer). overlap_tp: tensor parallelism's collectives run under the matmuls beside them
    (torchtitan's AsyncTP, Megatron-LM's --tp-comm-overlap; not this suite's lessons), exposed only
    beyond the compute. The pipeline's stages are taken as equal, each 1/pp of the FLOPs."""
    gpu, world = cluster.gpu, layout.world_size
    rate = gpu.peak_flops * cluster.figure("matmul_efficiency")
    tokens = workload.micro_batch_size * workload.seq_length * workload.micro_batches
    replicas = world // (layout.tp * layout.pp * layout.cp)  # expert parallel: every rank
    tokens_per_gpu = tokens * replicas / world
    per_token = flops_per_token(config, workload.seq_length)
    forward = tokens_per_gpu * per_token / 3 / rate  # the backward costs twice the forward
    compute = 3 * forward + recomputed_flops(config, tokens_per_gpu, recompute, per_token) / rate
    last_backward = (compute - forward) / workload.micro_batches

    timed = {"layer": [], "fsdp": [], "ddp": [], "optimizer": [], "tp": []}
    for r in (r for r in rows if r["group_size"] > 1):  # a group of one sends nothing
        kind, seconds = overlap_class(r, layout.zero_stage), row_seconds(r, layout, cluster)
        if kind == "layer" and recompute == "full" and r["op"] not in ("send", "recv"):
            seconds *= 1.5  # the recomputed forward runs its half of the collectives again
        kind = "tp" if overlap_tp and kind == "layer" and r["group"] == "tp" else kind
        timed[kind].append((r, seconds))
    hidden_tp = sum(seconds for _, seconds in timed["tp"])
    busy = compute + sum(seconds for _, seconds in timed["layer"]) + max(0.0, hidden_tp - compute)
    bubble = 0.0
    if layout.pp > 1:  # the bubble's share of the step, in slots of a micro-batch's work
        share = bubble_fraction(
            layout.schedule, layout.pp, workload.micro_batches, layout.stages_per_rank
        )
        bubble = busy * share / (1 - share)
    m = workload.micro_batches
    exposed = busy - compute
    # FSDP's traffic shares one link behind the whole compute; of it, the gradients are reduced
    # in the last micro-batch's backward only (the lessons accumulate the others unsynchronised),
    # as DDP's are: whichever of the two leaves more exposed.
    gathers = [(r, t) for r, t in timed["fsdp"] if r["op"] == "all_gather"]
    reductions = [(r, t) for r, t in timed["fsdp"] if r["op"] != "all_gather"]
    first_gathers = exposed_data_parallel(gathers, math.inf, "fsdp", m)
    exposed += max(
        exposed_data_parallel(timed["fsdp"], compute, "fsdp", m),
        exposed_data_parallel(reductions, last_backward, "fsdp", m) + first_gathers,
    )
    exposed += exposed_data_parallel(timed["ddp"], last_backward, "ddp", m)
    exposed += sum(seconds for _, seconds in timed["optimizer"])
    optimizer = optimizer_seconds(config, layout, workload, cluster)
    step = compute + exposed + bubble + optimizer
    tokens_per_sec = tokens_per_gpu / step
    return {
        "step_time_s": step,
        "tokens_per_sec_per_gpu": tokens_per_sec,
        "mfu": tokens_per_sec * per_token / gpu.peak_flops,
        "compute_s": compute,
        "exposed_comm_s": exposed,
        "bubble_s": bubble,
        "optimizer_s": optimizer,
        "recompute": recompute,
    }


def recomputed_flops(config: LlamaConfig, tokens: float, recompute: str, per_token: float) -> float:
    """The FLOPs activation checkpointing adds for `tokens` tokens: none; full, one more forward
    (a third of the 6 N + attention); selective, torchtitan's "op" policy, which recomputes every
    second matmul of a layer (wk, wo, w3 of wq wk wv wo w1 w3 w2) and keeps attention's output."""
    if recompute == "full":
        return tokens * per_token / 3
    if recompute == "selective":
        d, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
        per_layer = d * kv + d * d + d * config.intermediate_size
        return tokens * 2 * per_layer * config.num_hidden_layers
    if recompute != "none":
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, not {recompute!r}")
    return 0.0


def optimizer_seconds(
    config: LlamaConfig, layout: Layout, workload: Workload, cluster: Cluster
) -> float:
    """The optimizer step on one GPU: AdamW reads and writes its fp32 states (memory-bound:
    ADAMW_BYTES per parameter over the HBM bandwidth) for the parameters this GPU updates (its
    shard under ZeRO); Muon's hidden matrices take MUON_BYTES each and their Newton-Schulz
    iterations, each matrix on one of the dp x cp x tp ranks that share it, at the matmul rate."""
    params = max(stage_parameters(config, layout.tp, layout.pp))
    if layout.zero_stage >= 1:  # the states are sharded over the ranks that hold alike
        ranks = layout.dp * layout.cp
        params /= ranks // layout.replicate if layout.zero_stage >= 2 else ranks
    hbm = cluster.gpu.hbm_bandwidth
    if workload.optimizer != "muon":
        return ADAMW_BYTES * params / hbm
    share = hidden_matrices(config)[1] / max(stage_parameters(config, 1, 1))
    n = layout.dp * layout.cp * layout.tp
    newton_schulz = muon_flops(config) / layout.pp / n
    rate = cluster.gpu.peak_flops * cluster.figure("matmul_efficiency")
    memory = (MUON_BYTES * share + ADAMW_BYTES * (1 - share)) * params / hbm
    return memory + newton_schulz / rate


# -------------------------------------------------------------------------------------------------
# The planner's rows


STEP_FIELDS = ("step_time_s", "tokens_per_sec_per_gpu", "mfu", "compute_s", "exposed_comm_s")
STEP_FIELDS += ("bubble_s", "optimizer_s", "recompute")


def add_step_times(
    strategies: dict,
    config: LlamaConfig | None,
    layout: Layout,
    workload: Workload,
    cluster: Cluster,
    recompute: str,
) -> None:
    """Each strategy row of memory.plan gains step_time's fields (None without a model shape, as
    a bare parameter count has no FLOPs per token). recompute "auto":
    activation checkpointing only where the row does not fit the GPU without it."""
    for name, plan_row in strategies.items():
        if config is None:
            plan_row.update(dict.fromkeys(STEP_FIELDS))
            continue
        strategy = strategy_layout(name, layout)  # (its ZeRO stage; HSDP's replicas or none)
        chosen = recompute
        if recompute == "auto":
            chosen = "none" if plan_row.get("fits", True) else "full"
        rows = step_rows(config, strategy, workload)  # (lib/extras/comm_formulas.py)
        plan_row.update(step_time(config, strategy, workload, cluster, rows, chosen))


def cluster_fields(cluster: Cluster) -> dict:
    """The cluster a plan's step times are for: the plan's "cluster" field."""
    return {
        "gpu": cluster.gpu.name,
        "gpus_per_node": cluster.gpus_per_node,
        "peak_tflops": cluster.gpu.peak_flops / 1e12,
        "nvlink_gbps": cluster.figure("nvlink_bandwidth") / 1e9,
        "network_gbps": cluster.figure("network_bandwidth") / 1e9,
        "matmul_efficiency": cluster.figure("matmul_efficiency"),
    }


def format_step_times(p: dict) -> list[str]:
    """The lines under the memory table: each strategy's step time, tokens/s per GPU and MFU,
    and where the time goes (none without a model shape)."""
    c = p["cluster"]
    lines = [
        f"step time on {p['world_size']} x {c['gpu']} (nodes of {c['gpus_per_node']}; NVLink "
        f"{c['nvlink_gbps']:g} GB/s, network {c['network_gbps']:g} GB/s per GPU; matmuls at "
        f"{c['matmul_efficiency']:.0%} of {c['peak_tflops']:g} TFLOP/s; docs/scale.md):",
        f"{'strategy':<9}{'AC':>10}{'step s':>9}{'tok/s/GPU':>11}{'MFU':>7}{'compute':>9}"
        f"{'comm':>9}{'bubble':>9}{'optim':>9}   (seconds; comm: what compute does not hide)",
    ]
    for name, r in p["strategies"].items():
        if r.get("step_time_s") is None:
            continue
        times = [r[k] for k in ("compute_s", "exposed_comm_s", "bubble_s", "optimizer_s")]
        lines.append(
            f"{name:<9}{r['recompute']:>10}{seconds(r['step_time_s']):>9}"
            f"{r['tokens_per_sec_per_gpu']:>11,.0f}{r['mfu']:>7.1%}"
            + "".join(f"{seconds(t):>9}" for t in times)
            + ("   (does not fit)" if r.get("fits_checkpointed") is False else "")
        )
    return lines if len(lines) > 2 else []


def seconds(s: float) -> str:
    """A time of the table, 8 characters at most: 0.123, or 1.23e+25 (a model of 10^30 layers)."""
    text = f"{s:.3f}"
    return text if len(text) <= 8 else f"{s:.2e}"
