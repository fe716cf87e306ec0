"""How much GPU memory (and communication) does training need per GPU, under DDP, each ZeRO stage,
HSDP, and tensor (+ sequence), pipeline and context parallelism?

    python memory_plan.py --model 7b --world-size 8                 # Llama 2 7B on 8 GPUs
    python memory_plan.py --model 70b --world-size 64 --tp 8 --pp 4 --micro-batches 16   # 3D
    python memory_plan.py --model 7b --world-size 16 --cp 4 --seq-length 131072       # long context
    python memory_plan.py --model 7b --world-size 32 --replicate 4   # HSDP: 4 nodes of 8
    python memory_plan.py --model 70b --world-size 64 --gpu-memory 80 --micro-batch-size 1
    python memory_plan.py --params 7.5e9 --world-size 64 --precision paper   # the ZeRO paper
    python memory_plan.py --model 7b --json                          # machine-readable
    torchrun ... train_fsdp.py --plan ...                            # the plan of the run itself

Training memory has two parts:

**Model states**, per parameter: the weights, their gradients and the optimizer's state.
ZeRO (Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models") removes their redundancy across the N data-parallel ranks in three stages:

    strategy         weights        gradients      optimizer state   script
    DDP              P * w          P * g          P * o             train_ddp.py
    ZeRO-1 (P_os)    P * w          P * g          P * o / N         train_zero1.py
    ZeRO-2 (P_os+g)  P * w          P * g / N      P * o / N         train_fsdp.py --zero-stage 2
    ZeRO-3 (+P_p)    P * w / N      P * g / N      P * o / N         train_fsdp.py --zero-stage 3
    HSDP             P * w / S      P * g / S      P * o / S         train_fsdp.py --replicate R

HSDP (hybrid sharding) is ZeRO-3 within groups of S = N / R ranks (a node, typically), its R
groups replicas of each other: more memory than ZeRO-3 over all N, far less traffic between
groups (see communication below).

The bytes per parameter (w, g, o) depend on what is kept, which `--precision` selects:
  fp32   4, 4, 8: fp32 weights and gradients, AdamW's two fp32 moments (exp_avg, exp_avg_sq).
  bf16   4, 4, 8 as well: our scripts keep fp32 master weights and fp32 gradients and only
  fp16   *compute* in 16 bits (autocast, or FSDP's MixedPrecisionPolicy), so the model states are
         those of fp32; only the activations shrink to 2 bytes. Not counted: the 16-bit copies of
         the weights that autocast keeps from forward to backward (2 bytes per parameter under
         DDP/ZeRO-1/2; under ZeRO-3 only the layers being computed are gathered).
  paper  2, 2, 12: the ZeRO paper's mixed-precision Adam (fp16 weights and gradients; fp32
         master weights, momentum and variance: K = 12). This reproduces the paper's Figure 1:
         7.5B parameters on 64 GPUs need 120, 31.4, 16.6 and 1.9 GB per GPU.
(Note: train_fsdp.py's stage 2 keeps the *gathered* weights between forward and backward, as
the table says; its gradients are reduce-scattered to shards. With --precision bf16 those
gathered weights are bf16 copies, 2 bytes, next to the 4/N bytes of the fp32 shards: the ZeRO-2
row then overestimates the weights by up to 2 bytes per parameter.)

**Activations**, per GPU, for one micro-batch of b sequences of s tokens (hidden size h,
a heads, L layers, vocabulary V), after Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models"), whose per-layer count for 16-bit activations is

    s * b * h * (34 + 5 * a * s / h)  bytes.

The 5as/h term is the (b, a, s, s) attention scores, softmax and dropout; fused attention
(flash / memory-efficient, what F.scaled_dot_product_attention uses for causal attention on
GPUs) never stores them, so `--attention flash` (the default) drops it and `--attention math`
keeps it. The 34 is for a GPT layer (4h MLP, dropout masks); Llama's SwiGLU MLP, grouped-query
attention and lack of dropout change it by some tens of per cent either way: this is an
estimate, good for choosing a strategy, not for filling the last gigabyte. fp32 activations
(4 bytes) count twice the 16-bit figure. On top of the layers: the fp32 log-probabilities
that cross-entropy keeps for backward, 4 * s * b * V bytes.

With activation checkpointing (`--activation-checkpointing` in every train script), each
layer keeps only its input, s * b * h * (2 or 4) bytes, and recomputes the rest during
backward, where one layer's full activations exist at a time:

    L * s * b * h * e  +  one layer's full activations  +  4 * s * b * V   (e = 2 or 4 bytes)

**Model parallelism** (`--tp T --pp P`; train_tp.py, train_pp.py) splits the model itself, and
the ZeRO strategies then apply across the remaining D = N / (T * P) data-parallel ranks:

  tensor parallel (Megatron)  every matrix of a layer split T ways (embedding and lm_head too);
                              the RMSNorm gains are replicated. Without sequence parallelism
                              (train_tp.py's default), Korthikanti's per-layer count becomes
                              s*b*h * (10 + 24/T + 5*a*s/(h*T)): the 24 sbh of matmul inputs and
                              the scores shrink T ways, the norms' and residuals' 10 sbh do not.
                              The loss is vocabulary-parallel: log-probabilities / T (as in
                              train_tp.py; train_pp.py --tp gathers the logits on its last
                              stage, whose log-probabilities are then T times this count).
  pipeline parallel           consecutive layers per stage (embedding on the first, lm_head on
                              the last). The first stage holds the most activations: as many
                              micro-batches as are in flight there, of its L/P layers each:
                              GPipe m, 1F1B min(m, P) (so L layers' worth, whatever P), and
                              interleaved 1F1B with v stages per rank (v-1)*P + 2*(P-1) + 1
                              chunks of L/(P*v) layers (Megatron-LM's warm-up count). The last
                              stage adds the log-probabilities, of all m micro-batches under GPipe
                              (every loss waits for the backward phase). The plan reports the
                              heavier of the two. The idle fraction of a step, the bubble, is
                              (P-1)/(m+P-1), and (P-1)/(v*m+P-1) interleaved.
  sequence parallel           (`--sequence-parallel`, with --tp) the norms and residuals work on
                              1/T of the sequence each. Korthikanti's Table 2 splits all 10 s*b*h
                              (34/T per layer), because Megatron-LM keeps only its piece of the
                              all-gathered inputs of wq/wk/wv and w1/w3 and gathers them again in
                              backward; PyTorch's ColwiseParallel, which train_tp.py uses, stores
                              them whole (4 s*b*h): s*b*h * (4 + 30/T + 5*a*s/(h*T)) here. With
                              activation checkpointing, the kept layer inputs split T ways.
  context parallel            (`--cp C`, train_cp.py) every sequence split C ways: each rank holds
                              1/C of every activation (s -> s/C; the scores are (s/C) x s) and of
                              the log-probabilities, plus the other ranks' keys and values it
                              gathered, kept for backward: 2*s*b*kv_dim*(C-1)/C values a layer
                              (small under grouped-query attention). The weights are those of C
                              data-parallel ranks: ZeRO/FSDP shards them over dp x C.

Communication per GPU and optimizer step (bytes sent, ring algorithms: an all-reduce of n bytes
over k ranks sends 2n(k-1)/k, an all-gather or reduce-scatter n(k-1)/k), for m micro-batches:

  DDP             all-reduce the fp32 gradients once
  ZeRO-1          the same, then each rank broadcasts its updated fp32 weights to the others (an
                  all-gather's bytes): train_zero1.py's ZeroRedundancyOptimizer keeps DDP's
                  all-reduce, where the ZeRO paper reduce-scatters (DDP's bytes in all)
  ZeRO-2 (FSDP)   all-gather the weights for every micro-batch's forward (in the compute dtype),
                  reduce-scatter fp32 gradients once
  ZeRO-3 (FSDP)   all-gather them for every forward and again for every backward
  tensor parallel 4 all-reduces of a micro-batch's s*b*h activations per layer (2 forward, 2
                  backward), m times: the one cost that grows with the tokens, not the model
  pipeline        each stage sends its s*b*h output forward and its input gradient backward, once
                  per micro-batch (and per chunk, interleaved)
  HSDP            ZeRO-3's all-gathers and reduce-scatters within a group of S, then one
                  all-reduce of a 1/S gradient shard across the R groups: 2(R-1)/R * 4P/S bytes,
                  the only traffic between groups (nodes)
  sequence par.   each all-reduce becomes a reduce-scatter + an all-gather: the same bytes
  context par.    all-gather each layer's keys and values (forward) and reduce-scatter their
                  gradients (backward): 4(C-1)/C * s*b*kv_dim values per layer and
                  micro-batch; kv_dim is 1/4 of h or less under grouped-query attention

That is why tensor parallelism stays inside a node (NVLink), and pipeline and data parallelism
cross nodes. Not counted: the embedding's and loss's small extra collectives, and the
recomputation's extra all-reduces under activation checkpointing.

Not counted anywhere: the CUDA context and allocator fragmentation (budget 1-3 GB), temporary
buffers of collectives, and ZeRO-3's gathered layers (the weights of about two decoder layers at
a time). GB means 1e9 bytes throughout.
"""

import argparse
import json
import math

from model import PRESETS, LlamaConfig, count_parameters

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
) -> float:
    """One decoder layer's stored activations on one GPU (Korthikanti et al. 2022, see the
    docstring): 34 s*b*h at tp 1, of which 24 s*b*h (and the scores) are split by tp, and 6 of
    the other 10 under sequence parallelism. Context parallelism splits every token's share cp
    ways and adds the keys and values gathered from the other cp ranks."""
    s, b, h, a = seq_length, micro_batch_size, config.hidden_size, config.num_attention_heads
    # Sequence parallel: the norms' and residuals' 6 s*b*h split; the 4 of the all-gathered
    # inputs of wq/wk/wv and w1/w3 do not (ColwiseParallel stores them whole; see docstring).
    norms = 6 / tp + 4 if sequence_parallel else 10
    per_token = (norms + 24 / tp + (5 * a * s / (h * tp) if attention == "math" else 0)) / cp
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
) -> float:
    """Activations held at once on one GPU, with or without activation checkpointing.

    `layers`: how many layers' activations of one micro-batch are held at once (default: all
    of them, one micro-batch: no pipeline); `logprob_copies`: how many micro-batches'
    log-probabilities this GPU holds (0 on a pipeline stage without the loss).
    """
    s, b, h = seq_length, micro_batch_size, config.hidden_size
    layers = config.num_hidden_layers if layers is None else layers
    layer = layer_activation_bytes(config, b, s, precision, attention, tp, sequence_parallel, cp)
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
    matrices = 2 * d * d + 2 * d * kv_dim + 3 * d * config.intermediate_size
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
) -> dict:
    """The per-GPU plan for every data-parallel strategy, in GB (1e9 bytes); the --json output.

    world_size = dp x cp x tp x pp GPUs; the ZeRO strategies shard across the dp x cp =
    world_size / (tp * pp) ranks that hold the same part of the model (context-parallel ranks
    hold the same weights, as data-parallel ones do), and HSDP (replicate > 1) within groups of
    dp x cp / replicate of them. Where the pipeline's first and last stages differ, each row is
    the heavier stage's. Without a `config` (a bare parameter count) there is no shape to
    estimate activations from: the activation and total fields are then None, and the
    parameters are assumed evenly split over tp x pp.
    """
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
    strategies = {}
    for name in STRATEGIES + (("hsdp",) if replicate > 1 else ()):
        rows = []
        for params, layers, logprob_copies in stages.values():
            states = model_states_bytes(params, dp * cp, precision, replicate)[name]
            model_states = sum(states.values())
            row = {f"{part}_gb": value / GB for part, value in states.items()}
            row["model_states_gb"] = model_states / GB
            for suffix, ckpt in (("", False), ("_checkpointed", True)):
                acts = None
                if config is not None:
                    acts = activation_bytes(
                        config, micro_batch_size, seq_length, precision, attention, ckpt, tp,
                        layers, logprob_copies, sequence_parallel, cp,
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
        config, heaviest, dp * cp, tp, pp, precision, micro_batch_size, seq_length,
        micro_batches, stages_per_rank, schedule, cp, replicate,
    )  # fmt: skip
    for name, row in strategies.items():
        row["dp_comm_gb"] = comm["data_parallel"][name] / GB
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
    # Small models (the tiny preset of a CPU run) would show only zeros in GB: use MB there.
    scale, unit = (1, "GB") if p["strategies"]["ddp"]["model_states_gb"] >= 1 else (1e3, "MB")

    layout = f"dp {p['dp']} x " + (f"cp {p['cp']} x " if p["cp"] > 1 else "")
    layout += f"tp {p['tp']}" + (" with sequence parallel" if p["sequence_parallel"] else "")
    layout += f" x pp {p['pp']}"
    if p["replicate"] > 1:
        layout += f"; hsdp: {p['replicate']} replicas of {p['dp'] * p['cp'] // p['replicate']}"
    if p["pp"] > 1:
        layout += (
            f", {p['schedule']} schedule"
            + (f" with {p['stages_per_rank']} stages per rank" if p["stages_per_rank"] else "")
            + f", {p['micro_batches']} micro-batches: bubble {p['bubble_fraction']:.0%} of a step"
            + " (heavier of first and last stage shown)"
        )
    lines = [
        f"memory per GPU: {p['num_params'] / 1e9:.3g}B parameters, {p['world_size']} GPUs "
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
        return "n/a" if x is None else f"{x * scale:.2f}"

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


def plan_for_run(
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
) -> str:
    """The plan of a training run, as the train scripts print it with --plan; run_plan is the
    run's cli.RunPlan (micro-batch, accumulation, precision, attention kernel)."""
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
    )
    return format_plan(p)


def main() -> None:
    p = argparse.ArgumentParser(
        description="Per-GPU memory of DDP and ZeRO-1/2/3 (parameters, gradients, optimizer "
        "states, activations), and which strategies fit. The formulas and their assumptions "
        "are in this file's docstring.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # a mistyped flag is an error, never read as a longer one
    )
    p.add_argument("--model", default=None, help=f"preset: {', '.join(PRESETS)} (default: 7b)")
    p.add_argument(
        "--params",
        type=float,
        default=None,
        help="a bare parameter count (e.g. 7.5e9) instead of a preset: model states only, since "
        "activations need the model's shape (with --model too, its shape is used for them)",
    )
    p.add_argument("--vocab-size", type=int, default=None, help="override the preset's vocabulary")
    p.add_argument("--world-size", type=int, default=8, help="GPUs in all: N = dp x cp x tp x pp")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree T (train_tp.py)")
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: the norms' and residuals' activations split T ways too "
        "(train_tp.py --sequence-parallel)",
    )
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree C: each sequence split C ways (train_cp.py)",
    )
    p.add_argument(
        "--replicate",
        type=int,
        default=1,
        help="HSDP: R replicas, ZeRO-3 within each group of dp x cp / R GPUs, an hsdp row "
        "(train_fsdp.py --replicate)",
    )
    p.add_argument("--pp", type=int, default=1, help="pipeline stages P (train_pp.py)")
    p.add_argument(
        "--schedule",
        choices=["gpipe", "1f1b", "interleaved"],
        default="1f1b",
        help="pipeline schedule: what the first stage holds, and the bubble",
    )
    p.add_argument(
        "--stages-per-rank", type=int, default=2, help="v: model chunks per GPU, interleaved"
    )
    p.add_argument(
        "--micro-batches",
        type=int,
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
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per GPU per forward")
    p.add_argument("--seq-length", type=int, default=2048, help="tokens per sequence")
    p.add_argument(
        "--attention",
        choices=["flash", "math"],
        default="flash",
        help="flash: fused attention stores no (s, s) scores; math: it does (e.g. with masks "
        "on kernels without mask support)",
    )
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GB per GPU, to say what fits")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (GB = 1e9 bytes)")
    args = p.parse_args()
    for name in ("world_size", "micro_batch_size", "seq_length", "tp", "pp", "cp", "replicate",
                 "micro_batches", "stages_per_rank"):  # fmt: skip
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.params is not None and args.params < 1:
        p.error(f"--params must be positive, got {args.params:g}")

    config = None
    if args.model or args.params is None:
        overrides = {"vocab_size": args.vocab_size} if args.vocab_size else {}
        try:
            config = LlamaConfig.from_preset(args.model or "7b", **overrides)
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
        )
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(result, indent=2) if args.json else format_plan(result))


if __name__ == "__main__":
    main()
