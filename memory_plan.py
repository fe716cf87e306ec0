"""How much GPU memory does training need per GPU, under DDP and each ZeRO stage?

    python memory_plan.py --model 7b --world-size 8                 # Llama 2 7B on 8 GPUs
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
    ZeRO-1 (P_os)    P * w          P * g          P * o / N         train_ddp.py --zero1
    ZeRO-2 (P_os+g)  P * w          P * g / N      P * o / N         train_fsdp.py --zero-stage 2
    ZeRO-3 (+P_p)    P * w / N      P * g / N      P * o / N         train_fsdp.py --zero-stage 3

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

Not counted anywhere: the CUDA context and allocator fragmentation (budget 1-3 GB), temporary
buffers of collectives, and ZeRO-3's gathered layers (the weights of about two decoder layers at
a time). GB means 1e9 bytes throughout.
"""

import argparse
import json

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


def model_states_bytes(num_params: int, world_size: int, precision: str) -> dict[str, dict]:
    """{strategy: {"params", "grads", "optimizer"}}: bytes per GPU, as in the docstring's table."""
    w, g, o = (num_params * b for b in BYTES_PER_PARAM[precision])
    n = world_size
    return {
        "ddp": {"params": w, "grads": g, "optimizer": o},
        "zero1": {"params": w, "grads": g, "optimizer": o / n},
        "zero2": {"params": w, "grads": g / n, "optimizer": o / n},
        "zero3": {"params": w / n, "grads": g / n, "optimizer": o / n},
    }


def layer_activation_bytes(
    config: LlamaConfig, micro_batch_size: int, seq_length: int, precision: str, attention: str
) -> float:
    """One decoder layer's stored activations (Korthikanti et al. 2022, see the docstring)."""
    s, b, h, a = seq_length, micro_batch_size, config.hidden_size, config.num_attention_heads
    per_token = 34 + (5 * a * s / h if attention == "math" else 0)
    return s * b * h * per_token * ACTIVATION_BYTES[precision] / 2


def activation_bytes(
    config: LlamaConfig,
    micro_batch_size: int,
    seq_length: int,
    precision: str,
    attention: str = "flash",
    checkpointing: bool = False,
) -> float:
    """Activations of one micro-batch on one GPU, with or without activation checkpointing."""
    s, b, h = seq_length, micro_batch_size, config.hidden_size
    layers = config.num_hidden_layers
    layer = layer_activation_bytes(config, b, s, precision, attention)
    logprobs = 4 * s * b * config.vocab_size  # fp32, kept by cross-entropy for backward
    if not checkpointing:
        return layers * layer + logprobs
    inputs = layers * s * b * h * ACTIVATION_BYTES[precision]  # what each checkpoint keeps
    return inputs + layer + logprobs  # + one layer recomputed at a time in backward


def plan(
    num_params: int,
    world_size: int,
    precision: str,
    config: LlamaConfig | None = None,
    micro_batch_size: int = 1,
    seq_length: int = 2048,
    attention: str = "flash",
    gpu_memory_gb: float | None = None,
) -> dict:
    """The per-GPU plan for every strategy, in GB (1e9 bytes); the --json output.

    Without a `config` (a bare parameter count) there is no shape to estimate activations from:
    the activation and total fields are then None.
    """
    if world_size < 1 or num_params < 1:
        raise ValueError("--world-size and the parameter count must be positive")
    acts = {}
    if config is not None:
        for ckpt in (False, True):
            acts[ckpt] = activation_bytes(
                config, micro_batch_size, seq_length, precision, attention, ckpt
            )
    strategies = {}
    for name, states in model_states_bytes(num_params, world_size, precision).items():
        model_states = sum(states.values())
        row = {f"{part}_gb": value / GB for part, value in states.items()}
        row["model_states_gb"] = model_states / GB
        for suffix, ckpt in (("", False), ("_checkpointed", True)):
            total = (model_states + acts[ckpt]) / GB if acts else None
            row[f"activations{suffix}_gb"] = acts[ckpt] / GB if acts else None
            row[f"total{suffix}_gb"] = total
            if gpu_memory_gb is not None and total is not None:
                row[f"fits{suffix}"] = total <= gpu_memory_gb
        strategies[name] = row
    return {
        "num_params": num_params,
        "world_size": world_size,
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

    lines = [
        f"memory per GPU: {p['num_params'] / 1e9:.3g}B parameters, {p['world_size']} GPUs, "
        f"precision {p['precision']} ({w}+{g}+{o} bytes per parameter)"
        + (
            f", micro-batch {p['micro_batch_size']} x {p['seq_length']} tokens, "
            f"{p['attention']} attention"
            if p["micro_batch_size"]
            else ""
        ),
        f"{'strategy':<9}{'params':>9}{'grads':>9}{'optim':>9}{'states':>9}"
        f"{'acts':>9}{'total':>9}{'acts AC':>9}{'total AC':>10}   ({unit}; AC = activation "
        f"checkpointing)",
    ]

    def gb(x):
        return "n/a" if x is None else f"{x * scale:.2f}"

    for name, r in p["strategies"].items():
        lines.append(
            f"{name:<9}{gb(r['params_gb']):>9}{gb(r['grads_gb']):>9}{gb(r['optimizer_gb']):>9}"
            f"{gb(r['model_states_gb']):>9}{gb(r['activations_gb']):>9}{gb(r['total_gb']):>9}"
            f"{gb(r['activations_checkpointed_gb']):>9}{gb(r['total_checkpointed_gb']):>10}"
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


def plan_for_run(args, config: LlamaConfig, world_size: int, precision: str) -> str:
    """The plan of a training run, as the train scripts print it with --plan."""
    p = plan(
        count_parameters(config),
        world_size,
        precision,
        config,
        args.micro_batch_size,
        args.seq_length,
        # SDPA with a dense mask falls back to kernels that store the (s, s) scores; FlexAttention
        # (--attention flex) is a fused kernel like flash attention.
        attention="math" if args.document_mask and args.attention != "flex" else "flash",
    )
    return format_plan(p)


def main() -> None:
    p = argparse.ArgumentParser(
        description="Per-GPU memory of DDP and ZeRO-1/2/3 (parameters, gradients, optimizer "
        "states, activations), and which strategies fit. The formulas and their assumptions "
        "are in this file's docstring.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
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
    p.add_argument("--world-size", type=int, default=8, help="data-parallel GPUs (N)")
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
    if args.world_size < 1 or args.micro_batch_size < 1 or args.seq_length < 1:
        p.error("--world-size, --micro-batch-size and --seq-length must be positive")
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
    result = plan(
        num_params,
        args.world_size,
        args.precision,
        config,
        args.micro_batch_size,
        args.seq_length,
        args.attention,
        args.gpu_memory,
    )
    print(json.dumps(result, indent=2) if args.json else format_plan(result))


if __name__ == "__main__":
    main()
