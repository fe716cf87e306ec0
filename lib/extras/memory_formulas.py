"""The formulas of the memory planner (lib/extras/memory.py): the bytes one GPU holds in model
states and activations under DDP, each ZeRO stage, HSDP, and tensor (+ sequence), pipeline,
context and expert parallelism, for a model's config, a Layout and a Workload. docs/memory.md,
"The formulas", gives where each comes from and what it leaves out. What a GPU sends per step is
lib/extras/comm_formulas.py's step_rows, the rows --comm-ledger measures.
"""

import dataclasses
import math
from dataclasses import dataclass

import torch

from lib.parallel.layout import Layout
from model import LlamaConfig, LlamaForPretraining

# Bytes per parameter of (weights, gradients, optimizer state) for each --precision.
BYTES_PER_PARAM = {
    "fp32": (4, 4, 8),
    "bf16": (4, 4, 8),
    "fp16": (4, 4, 8),
    "paper": (2, 2, 12),
}
# Bytes per stored activation element.
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "paper": 2}


@dataclass(frozen=True)
class Workload:
    """What one optimizer step asks of every GPU: `micro_batches` forwards (gradient
    accumulation; the pipeline's m) of `micro_batch_size` sequences of `seq_length` tokens, in a
    --precision of BYTES_PER_PARAM. attention "flash" is a fused kernel that stores no (s, s)
    scores, "math" one that does. gpu_memory_gb: the memory of one GPU, to say what fits (None:
    the plan does not say). optimizer: --optimizer's, "adamw" or "muon" (muon_fields)."""

    micro_batch_size: int = 1
    seq_length: int = 2048
    micro_batches: int = 1
    precision: str = "bf16"
    attention: str = "flash"
    gpu_memory_gb: float | None = None
    optimizer: str = "adamw"


def hidden_matrices(config: LlamaConfig) -> tuple[int, int, int]:
    """What --optimizer muon orthogonalises (lib/extras/muon.py's hidden matrices): (how many,
    their parameters, the largest one's parameters) over the whole model: each layer's wq, wk,
    wv, wo and the MLP's w1, w2, w3 (each expert's, in a mixture of experts)."""
    d, kv, ffn = (
        config.hidden_size,
        config.num_key_value_heads * config.head_dim,
        config.intermediate_size,
    )
    mlps = max(config.num_local_experts, 1)
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * ffn * mlps
    count = config.num_hidden_layers * (4 + 3 * mlps)
    return count, config.num_hidden_layers * per_layer, max(d * d, d * ffn)


def muon_bytes(config: LlamaConfig, layout: Layout, workload: Workload) -> dict[str, float]:
    """Muon's figures per GPU (bytes), for the hidden matrices of the heaviest pipeline stage,
    shared by the N = dp x cp x tp ranks that hold pieces of them, each matrix orthogonalised by
    one of them (its owner, lib/extras/muon.py): "whole", the owner's whole matrices in fp32 at
    once (their updates, ~H/N) and the largest one's Newton-Schulz working set; "sent", what the
    exchange brings each rank per step, sharded (FSDP, TP, CP: its pieces to the owners in fp32,
    the results back in the matmuls' dtype, (4 + b) H (N - 1) / N^2) or replicated (DDP, ZeRO-1's
    DDP: each rank receives every result, b H (N - 1) / N). b: 2 bytes in bf16, else 4."""
    _, hidden, largest = hidden_matrices(config)
    hidden /= layout.pp
    n = layout.dp * layout.cp * layout.tp
    b = 2 if workload.precision == "bf16" else 4
    newton_schulz = b * 4 * largest  # x, its Gram matrix and two products of a square side
    return {
        "whole": 4 * hidden / n + newton_schulz,
        "sent_sharded": (4 + b) * hidden * (n - 1) / n**2,
        "sent_replicated": b * hidden * (n - 1) / n,
    }


def model_states_bytes(
    num_params: int, world_size: int, precision: str, replicate: int = 1
) -> dict[str, dict]:
    """{strategy: {"params", "grads", "optimizer"}}: bytes per GPU, as in docs/memory.md's table;
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


def layer_activation_bytes(config: LlamaConfig, layout: Layout, workload: Workload) -> float:
    """One decoder layer's stored activations on one GPU (Korthikanti et al. 2022; docs/memory.md,
    section 5): 34 s*b*h at tp 1, of which 24 s*b*h (and the scores) are split by tp, and 6 of
    the other 10 under sequence parallelism. Context parallelism splits every token's share cp
    ways and adds the keys and values gathered from the other cp ranks. A mixture of experts
    runs the MLP's 19 s*b*h k times and keeps copies of the dispatched tokens (ep > 1: one more
    for the pairs received)."""
    s, b = workload.seq_length, workload.micro_batch_size
    h, a = config.hidden_size, config.num_attention_heads
    tp, cp = layout.tp, layout.cp
    # Sequence parallel: the norms' and residuals' 6 s*b*h split; the 4 of the all-gathered
    # inputs of wq/wk/wv and w1/w3 do not (ColwiseParallel stores them whole; see docs/memory.md).
    norms = 6 / tp + 4 if layout.sequence_parallel else 10
    scores = 5 * a * s / (h * tp) if workload.attention == "math" else 0
    per_token = (norms + 24 / tp + scores) / cp
    if config.num_local_experts:  # k experts per token, and the copies the dispatch keeps
        k = config.num_experts_per_tok
        per_token += 19 * (k - 1) / tp + 2 * k * (3 if layout.ep > 1 else 2)
    # The other ranks' keys and values, kept for backward (this rank's own are in the 24): two
    # tensors of s*b*kv_dim values, 2 bytes each in Korthikanti's units of 16-bit bytes.
    kv_dim = config.num_key_value_heads * config.head_dim / tp
    gathered_kv = 2 * 2 * kv_dim / h * (cp - 1) / cp
    return s * b * h * (per_token + gathered_kv) * ACTIVATION_BYTES[workload.precision] / 2


def activation_bytes(
    config: LlamaConfig,
    layout: Layout,
    workload: Workload,
    checkpointing: bool = False,
    layers: float | None = None,
    logprob_copies: int = 1,
) -> float:
    """Activations held at once on one GPU, with or without activation checkpointing.

    `layers`: how many layers' activations of one micro-batch are held at once (default: all
    of them, one micro-batch: no pipeline); `logprob_copies`: how many micro-batches'
    log-probabilities this GPU holds (0 on a pipeline stage without the loss).
    """
    s, b, h = workload.seq_length, workload.micro_batch_size, config.hidden_size
    tp, cp = layout.tp, layout.cp
    layers = config.num_hidden_layers if layers is None else layers
    layer = layer_activation_bytes(config, layout, workload)
    # fp32, kept by cross-entropy for backward; split over the vocabulary under tensor parallel,
    # over the sequence under context parallel.
    logprobs = logprob_copies * 4 * s * b * config.vocab_size / (tp * cp)
    if not checkpointing:
        return layers * layer + logprobs
    # What each checkpoint keeps: the layer's input, whole on every tp rank unless sequence
    # parallelism splits the residual stream too.
    split = cp * (tp if layout.sequence_parallel else 1)
    inputs = layers * s * b * h * ACTIVATION_BYTES[workload.precision] / split
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


def expert_parameters(config: LlamaConfig) -> int:
    """The parameters of all the experts of every MoE layer (0 for a dense model): what expert
    parallelism splits; the rest of the model (router included) is replicated or FSDP-sharded
    as a dense model's are."""
    if not config.num_local_experts:
        return 0
    per_expert = 3 * config.hidden_size * config.intermediate_size  # w1, w2, w3 of one expert
    return config.num_hidden_layers * config.num_local_experts * per_expert


def largest_parameter(config: LlamaConfig) -> int:
    """The element count of the model's largest parameter: one layer of it built on the meta
    device (no memory; every layer is alike, and a plan may ask for 10^30 of them)."""
    with torch.device("meta"):
        one_layer = LlamaForPretraining(dataclasses.replace(config, num_hidden_layers=1))
        return max(p.numel() for p in one_layer.parameters())


STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "hsdp": 3}  # each row's ZeRO stage


def strategy_layout(name: str, layout: Layout) -> Layout:
    """The layout of one strategy's row: its ZeRO stage, and HSDP's replica groups in the hsdp
    row alone (the ZeRO rows shard over every rank that holds the same part of the model)."""
    replicate = layout.replicate if name == "hsdp" else 1
    return dataclasses.replace(layout, zero_stage=STAGES[name], replicate=replicate)
