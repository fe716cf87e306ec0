"""The matmul efficiency of the planner's step-time model, measured: the model's own matmul
shapes (each layer's wq, wk, wv, wo, w1, w3, w2 and the lm_head, for one micro-batch of tokens),
forward and backward, timed on this device, and the fraction of its dense bf16 peak they reach.

    python -m tools.bench --matmuls --model 1b --seq-length 2048 --micro-batch-size 8
    python -m tools.bench --matmuls --model 70b --seq-length 4096 --micro-batch-size 1 --tp 8

Each shape runs its three matmuls (the forward x W^T, the backward's dY W and dY^T x), --warmup
untimed rounds then --steps timed ones, the device waited for before and after. With --tp T the
shapes are a tensor-parallel rank's (wq, wk, wv, w1, w3 split by output, wo, w2 by input, the
lm_head by vocabulary). On a GPU of known peak (lib/metrics.py) the last line is the fraction to
pass to `python -m tools.memory_plan --matmul-efficiency`; on a CPU there is no peak, only the
FLOP/s. The step-time model applies that fraction to all of the step's FLOPs, attention and the
elementwise kernels between the matmuls included: a whole step (`python -m tools.bench`, its MFU)
reaches less than its matmuls alone, so this is the model's ceiling; docs/scale.md says which one
its default is.
"""

import time

import torch

from lib import metrics
from model import LlamaConfig


def shapes(config: LlamaConfig, tp: int = 1) -> list[tuple[str, int, int, int]]:
    """(name, how many in the model, in_features, out_features) of each matmul, on one tp rank."""
    d, kv, ffn = (
        config.hidden_size,
        config.num_key_value_heads * config.head_dim,
        config.intermediate_size,
    )
    layers = config.num_hidden_layers
    return [
        ("wq", layers, d, d // tp),
        ("wk wv", 2 * layers, d, kv // tp),
        ("wo", layers, d // tp, d),
        ("w1 w3", 2 * layers, d, ffn // tp),
        ("w2", layers, ffn // tp, d),
        ("lm_head", 1, d, config.vocab_size // tp),
    ]


def time_shape(tokens: int, n_in: int, n_out: int, dtype, device, steps: int, warmup: int):
    """Seconds per round of one shape's forward and backward matmuls (3 x 2 tokens n_in n_out
    FLOPs)."""
    x = torch.randn(tokens, n_in, dtype=dtype, device=device)
    w = torch.randn(n_out, n_in, dtype=dtype, device=device)
    dy = torch.randn(tokens, n_out, dtype=dtype, device=device)

    def one_round():
        x @ w.T, dy @ w, dy.T @ x

    for _ in range(warmup):
        one_round()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        one_round()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def synchronize(device: torch.device) -> None:
    """Wait for the device's queue (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(config: LlamaConfig, tokens: int, tp: int, device, steps: int, warmup: int) -> dict:
    """Each shape's TFLOP/s, and the model's matmuls together: {"shapes": [...], "flops",
    "seconds", "flops_per_sec", "peak_flops", "efficiency" (None without a known peak)}."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = metrics.peak_flops(device)
    rows, total_flops, total_seconds = [], 0.0, 0.0
    for name, count, n_in, n_out in shapes(config, tp):
        seconds = time_shape(tokens, n_in, n_out, dtype, device, steps, warmup)
        flops = 3 * 2 * tokens * n_in * n_out
        rows.append(dict(name=name, count=count, shape=(tokens, n_in, n_out), rate=flops / seconds))
        total_flops += count * flops
        total_seconds += count * seconds
    rate = total_flops / total_seconds
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "shapes": rows,
        "flops": total_flops,
        "seconds": total_seconds,
        "flops_per_sec": rate,
        "peak_flops": peak,
        "efficiency": None if peak is None else rate / peak,
    }


def format_measurement(m: dict, device_name: str) -> str:
    """The table of shapes and the efficiency line."""
    lines = [f"matmuls of one micro-batch, forward and backward, {m['dtype']}, on {device_name}:"]
    lines.append(f"{'matmul':<9}{'count':>6}{'tokens x in x out':>24}{'GFLOP/s':>12}")
    for r in m["shapes"]:
        shape = " x ".join(str(n) for n in r["shape"])
        lines.append(f"{r['name']:<9}{r['count']:>6}{shape:>24}{r['rate'] / 1e9:>12,.1f}")
    rate = f"all of them: {m['flops_per_sec'] / 1e9:,.1f} GFLOP/s"
    if m["efficiency"] is None:
        lines.append(f"{rate}; no known bf16 peak for this device: no efficiency")
    else:
        lines.append(
            f"{rate} of {m['peak_flops'] / 1e9:,.0f}: matmul efficiency {m['efficiency']:.3f} "
            f"(python -m tools.memory_plan --matmul-efficiency {m['efficiency']:.2f})"
        )
    return "\n".join(lines)
