"""Per-GPU memory and traffic of a training layout: the bytes of model states, activations and
communication under DDP, each ZeRO stage, HSDP, and tensor (+ sequence), pipeline, context and
expert parallelism (the formulas), put together for one layout (plan) and printed as a table
(format_plan); estimate_for_run is a lesson's --plan. docs/memory.md, "The formulas", gives
where each comes from and what it leaves out. `python -m tools.memory_plan` is the command line.
"""

import dataclasses
import math

import torch

from lib.parallel.pipeline import bubble_fraction, split_layers
from lib.parallel.tensor_parallel import check_tensor_parallel
from model import LlamaConfig, LlamaForPretraining, count_active_parameters, count_parameters

# Bytes per parameter of (weights, gradients, optimizer state) for each --precision.
BYTES_PER_PARAM = {
    "fp32": (4, 4, 8),
    "bf16": (4, 4, 8),
    "fp16": (4, 4, 8),
    "paper": (2, 2, 12),
}
# Bytes per stored activation element.
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "paper": 2}
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
GB = 1e9


def model_states_bytes(
    num_params: int, world_size: int, precision: str, replicate: int = 1
) -> dict[str, dict]:
    """{strategy: {"params", "grads", "optimizer"}}: bytes per GPU, as in the docstring's table;
    with replicate R > 1, an "hsdp" row too: ZeRO-3 within groups of world_size / R ranks."""
    w, g, o = (num_params * b for b in BYTES_PER_PARAM[precision])
    n = world_size
    states = {
        "ddp": {"params": w, "grads": g, "optimizer": o},
        "zero1": {"params": w, "grads": g, "optimizer": o / n},
        "zero2": {"params": w, "grads": g / n, "optimizer": o / n},
        "zero3": {"params": w / n, "grads": g / n, "optimizer": o / n},
    }
    if replicate > 1:
        shard = n // replicate
        states["hsdp"] = {"params": w / shard, "grads": g / shard, "optimizer": o / shard}
    return states


def layer_activation_bytes(
    config: LlamaConfig,
    micro_batch_size: int,
    seq_length: int,
    precision: str,
    attention: str,
    tp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    ep: int = 1,
) -> float:
    """One decoder layer's stored activations on one GPU (Korthikanti et al. 2022, see the
    docstring): 34 s*b*h at tp 1, of which 24 s*b*h (and the scores) are split by tp, and 6 of
    the other 10 under sequence parallelism. Context parallelism splits every token's share cp
    ways and adds the keys and values gathered from the other cp ranks. A mixture of experts
    runs the MLP's 19 s*b*h k times and keeps copies of the dispatched tokens (ep > 1: one more
    for the pairs received)."""
    s, b, h, a = seq_length, micro_batch_size, config.hidden_size, config.num_attention_heads
    # Sequence parallel: the norms' and residuals' 6 s*b*h split; the 4 of the all-gathered
    # inputs of wq/wk/wv and w1/w3 do not (ColwiseParallel stores them whole; see docstring).
    norms = 6 / tp + 4 if sequence_parallel else 10
    per_token = (norms + 24 / tp + (5 * a * s / (h * tp) if attention == "math" else 0)) / cp
    if config.num_local_experts:  # k experts per token, and the dispatch's copies (docstring)
        k = config.num_experts_per_tok
        per_token += 19 * (k - 1) / tp + 2 * k * (3 if ep > 1 else 2)
    # The other ranks' keys and values, kept for backward (this rank's own are in the 24): two
    # tensors of s*b*kv_dim values, 2 bytes each in Korthikanti's units of 16-bit bytes.
    kv_dim = config.num_key_value_heads * config.head_dim / tp
    gathered_kv = 2 * 2 * kv_dim / h * (cp - 1) / cp
    return s * b * h * (per_token + gathered_kv) * ACTIVATION_BYTES[precision] / 2


def activation_bytes(
    config: LlamaConfig,
    micro_batch_size: int,
    seq_length: int,
    precision: str,
    attention: str = "flash",
    checkpointing: bool = False,
    tp: int = 1,
    layers: float | None = None,
    logprob_copies: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    ep: int = 1,
) -> float:
    """Activations held at once on one GPU, with or without activation checkpointing.

    `layers`: how many layers' activations of one micro-batch are held at once (default: all
    of them, one micro-batch: no pipeline); `logprob_copies`: how many micro-batches'
    log-probabilities this GPU holds (0 on a pipeline stage without the loss).
    """
    s, b, h = seq_length, micro_batch_size, config.hidden_size
    layers = config.num_hidden_layers if layers is None else layers
    layer = layer_activation_bytes(
        config, b, s, precision, attention, tp, sequence_parallel, cp, ep
    )
    # fp32, kept by cross-entropy for backward; split over the vocabulary under tensor parallel,
    # over the sequence under context parallel.
    logprobs = logprob_copies * 4 * s * b * config.vocab_size / (tp * cp)
    if not checkpointing:
        return layers * layer + logprobs
    # What each checkpoint keeps: the layer's input, whole on every tp rank unless sequence
    # parallelism splits the residual stream too.
    inputs = (
        layers * s * b * h * ACTIVATION_BYTES[precision] / (cp * (tp if sequence_parallel else 1))
    )
    return inputs + layer + logprobs  # + one layer recomputed at a time in backward


def stage_parameters(config: LlamaConfig, tp: int, pp: int) -> tuple[float, float]:
    """Parameters on one GPU of the first and of the last pipeline stage (equal when pp is 1).

    Tensor parallelism splits every matrix tp ways, the norms' gains stay whole; the stages get
    ceil(L / pp) layers (the most any stage has), the first the embedding, the last the final
    norm and lm_head.
    """
    d, kv_dim = config.hidden_size, config.num_key_value_heads * config.head_dim
    experts = config.num_local_experts  # 0: the dense MLP; else that many, and their router
    mlp = 3 * d * config.intermediate_size * max(experts, 1) + d * experts
    matrices = 2 * d * d + 2 * d * kv_dim + mlp
    layer = matrices / tp + 2 * d
    table = config.vocab_size * d / tp
    lm_head = 0 if config.tie_word_embeddings else table
    if pp == 1:
        whole = config.num_hidden_layers * layer + table + lm_head + d
        return whole, whole
    layers = math.ceil(config.num_hidden_layers / pp) * layer
    # Tied embeddings on two stages would be one tensor in two places: each stage holds a copy.
    return layers + table, layers + d + (lm_head or table)


def pipeline_in_flight(schedule: str, pp: int, micro_batches: int, stages_per_rank: int):
    """(layers' worth of one micro-batch's activations the first stage holds at its peak, as a
    fraction of all L layers; micro-batches the last stage holds, with their log-probabilities)."""
    m, v = micro_batches, stages_per_rank
    if pp == 1:
        return 1.0, 1
    if schedule == "gpipe":
        return m / pp, m
    if schedule == "1f1b":
        return min(m, pp) / pp, 1
    chunks = min(m * v, (v - 1) * pp + 2 * (pp - 1) + 1)  # interleaved 1F1B
    return chunks / (pp * v), 1


def communication_bytes(
    config: LlamaConfig | None,
    local_params: float,
    dp: int,
    tp: int,
    pp: int,
    precision: str,
    micro_batch_size: int,
    seq_length: int,
    micro_batches: int,
    stages_per_rank: int,
    schedule: str,
    cp: int = 1,
    replicate: int = 1,
) -> dict:
    """Bytes one GPU sends per optimizer step: {strategy: dp bytes} and the tp, pp and cp bytes.

    dp here is the number of ranks that hold the same part of the model (data x context
    parallel ranks): the ZeRO strategies shard across all of them.
    """
    ring = (dp - 1) / dp  # an all-gather's or reduce-scatter's share; an all-reduce sends twice
    weights = local_params * (2 if precision in ("bf16", "fp16", "paper") else 4)
    grads = local_params * 4  # gradients are reduced in fp32
    m = micro_batches
    data_parallel = {
        "ddp": 2 * ring * grads,
        "zero1": 2 * ring * grads + ring * local_params * 4,  # + the fp32 weights broadcast
        "zero2": ring * (m * weights + grads),
        "zero3": ring * (2 * m * weights + grads),
    }
    across = None  # HSDP: the part that crosses between replica groups (nodes)
    if replicate > 1:  # ZeRO-3 within a group of `shard`, then one all-reduce of a gradient shard
        shard = dp // replicate
        across = 2 * (replicate - 1) / replicate * grads / shard
        data_parallel["hsdp"] = (shard - 1) / shard * (2 * m * weights + grads) + across
    tp_bytes = pp_bytes = cp_bytes = None
    if config is not None:
        e = ACTIVATION_BYTES[precision]
        tokens = seq_length * micro_batch_size / cp  # this rank's share of a micro-batch
        activation = tokens * config.hidden_size * e  # one s*b*h tensor
        layers = math.ceil(config.num_hidden_layers / pp)
        # Sequence parallelism turns each all-reduce into a reduce-scatter and an all-gather:
        # the same bytes.
        tp_bytes = 4 * 2 * (tp - 1) / tp * activation * layers * m
        chunks = stages_per_rank if schedule == "interleaved" else 1
        pp_bytes = 2 * activation * m * chunks if pp > 1 else 0.0
        # Context parallel: all-gather the keys and values of every layer (forward), and
        # reduce-scatter their gradients (backward); the whole sequence's K and V, tp-split.
        kv = seq_length * micro_batch_size * config.num_key_value_heads * config.head_dim / tp
        cp_bytes = 2 * 2 * (cp - 1) / cp * kv * e * layers * m
    return {
        "data_parallel": data_parallel,
        "tensor_parallel": tp_bytes,
        "pipeline": pp_bytes,
        "context_parallel": cp_bytes,
        "hsdp_across_groups": across,
    }


def expert_parameters(config: LlamaConfig) -> int:
    """The parameters of all the experts of every MoE layer (0 for a dense model): what expert
    parallelism splits; the rest of the model (router included) is replicated or FSDP-sharded
    as a dense model's."""
    if not config.num_local_experts:
        return 0
    per_expert = 3 * config.hidden_size * config.intermediate_size  # w1, w2, w3 of one expert
    return config.num_hidden_layers * config.num_local_experts * per_expert


def all_to_all_bytes(
    config: LlamaConfig, micro_batch_size: int, seq_length: int, micro_batches: int,
    precision: str, ep: int,
) -> float:  # fmt: skip
    """Bytes one GPU sends per optimizer step in expert parallelism's all-to-alls (docstring):
    4 all-to-alls per MoE layer and micro-batch (dispatch and combine, forward and backward) of
    the micro-batch's k*s*b*h values, the share (ep-1)/ep of them to other ranks."""
    if not config.num_local_experts or ep == 1:
        return 0.0
    pairs = micro_batch_size * seq_length * config.num_experts_per_tok  # (token, expert) pairs
    values = pairs * config.hidden_size * (ep - 1) / ep
    return 4 * values * ACTIVATION_BYTES[precision] * config.num_hidden_layers * micro_batches


# -------------------------------------------------------------------------------------------------
# One layout's plan, and its table

UNITS = (("MB", 1e3), ("GB", 1.0), ("TB", 1e-3), ("PB", 1e-6), ("EB", 1e-9))


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
        # At build, a rank draws each parameter whole before keeping its part (the lessons'
        # init_weights): its params column, plus the largest parameter, for an instant.
        "largest_param_gb": largest_parameter(config) * 4 / GB if config else None,
        "strategies": strategies,
    }


def largest_parameter(config: LlamaConfig) -> int:
    """The element count of the model's largest parameter: one layer of it built on the meta
    device (no memory; every layer is alike, and a plan may ask for 10^30 of them)."""
    with torch.device("meta"):
        one_layer = LlamaForPretraining(dataclasses.replace(config, num_hidden_layers=1))
        return max(p.numel() for p in one_layer.parameters())


def format_plan(p: dict) -> str:
    """The plan as a table, and which strategies fit --gpu-memory."""
    w, g, o = BYTES_PER_PARAM[p["precision"]]
    scale, unit = table_unit(p)

    layout = f"dp {p['dp']} x " + (f"cp {p['cp']} x " if p["cp"] > 1 else "")
    layout += f"tp {p['tp']}" + (" with sequence parallel" if p["sequence_parallel"] else "")
    layout += f" x pp {p['pp']}"
    if p["replicate"] > 1:
        layout += f"; hsdp: {p['replicate']} replicas of {p['dp'] * p['cp'] // p['replicate']}"
    if p["ep"] > 1:  # train_ep.py's words: every GPU reads its own share, whatever the groups
        groups = p["world_size"] // p["ep"]
        layout = (f"{groups} EP group{'s' * (groups > 1)} x ep {p['ep']}: each GPU holds "
                  f"1/{p['ep']} of the experts and reads its own share of the batch")  # fmt: skip
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

    # The rows a lesson can run: train_ep.py shards with FSDP alone (--zero-stage 2 or 3).
    shown = {n: r for n, r in p["strategies"].items() if p["ep"] == 1 or n not in ("ddp", "zero1")}
    for name, r in shown.items():
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
        fits = [n for n, r in shown.items() if r.get("fits")]
        fits_ac = [n for n, r in shown.items() if r.get("fits_checkpointed")]
        budget = f"{p['gpu_memory_gb']:g} GB"
        if p["micro_batch_size"] is None:  # no activations: say which model states fit
            limit = p["gpu_memory_gb"]
            fits = [n for n, r in shown.items() if r["model_states_gb"] <= limit]
            lines.append(f"model states fit in {budget}: {', '.join(fits) or 'none'}")
        else:
            lines.append(f"fits in {budget}: {', '.join(fits) or 'none'}; with activation "
                         f"checkpointing: {', '.join(fits_ac) or 'none'}")  # fmt: skip
    if p["largest_param_gb"] is not None:
        lines.append(f"at build (on the meta device, then one parameter at a time): each GPU holds "
                     f"its params, and the largest parameter whole for an instant "
                     f"({gb(p['largest_param_gb'])} {unit})")  # fmt: skip
    lines.append("(estimates: leave 1-3 GB for the CUDA context and fragmentation)")
    return "\n".join(lines)


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
    run's flags.RunSettings (micro-batch, accumulation, precision, attention kernel)."""
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
