"""The formulas of memory_plan.py: the bytes per GPU of model states, activations and
communication under DDP, each ZeRO stage, HSDP, and tensor (+ sequence), pipeline, context and
expert parallelism, with their sources and assumptions.

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

**A mixture of experts** (`--num-experts E --experts-per-token k`, moe.py; train_ep.py --ep X
for expert parallelism) has E SwiGLU experts in every layer's MLP, and a router (h x E):

  parameters      the experts are E x 3*h*ffn per layer; a token uses k of them, so the active
                  parameters per token (what the FLOPs count, and MFU with them) are the dense
                  model's plus the router: model.count_active_parameters.
  model states    the non-expert weights as any dense weights, over all N ranks; the experts
                  split X ways first (each rank of an EP group holds E/X of them), and the ZeRO
                  stage then shards that share over the N/X ranks that hold the same experts
                  (train_ep.py's FSDP over dp): experts' states / X / (N/X) = / N under ZeRO-3,
                  but / X only under DDP.
  activations     the MLP's 19 s*b*h of Korthikanti's 34 once per expert a token goes to (k
                  times), plus the copies of the tokens the dispatch keeps for backward: the
                  (token, expert) pairs sorted by expert, the experts' outputs until they are
                  weighted, and under EP the pairs received from the other ranks: 2k s*b*h
                  each (2 bytes per value in these units). The router's probabilities (s*b*E)
                  are left out.
  all-to-all      (EP) each MoE layer sends every pair to its expert's rank and the output back,
                  in forward, and the gradients both ways in backward: 4 all-to-alls of the
                  k*s*b*h values of a micro-batch, of which the share (X-1)/X leaves the rank
                  when the router is balanced (the load-balancing loss's aim): 4 (X-1)/X
                  k*s*b*h values per layer and micro-batch. The counts exchanged before each
                  dispatch (E integers) are left out, and so are the recomputation's two more
                  under activation checkpointing.
  Like tensor parallelism's all-reduces, the all-to-alls grow with the tokens, not the model:
  EP groups stay inside a node when they can (X <= GPUs per node).

Not counted anywhere: the CUDA context and allocator fragmentation (budget 1-3 GB), temporary
buffers of collectives, and ZeRO-3's gathered layers (the weights of about two decoder layers at
a time). GB means 1e9 bytes throughout.
"""

import math

from model import LlamaConfig

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
