"""What a run measures and logs: metrics.jsonl, tokens/s, MFU, a mixture of experts' routing."""

import json
import math
import os
import resource
import sys
import time

import torch
from tqdm import tqdm

from lib.checkpoints.files import atomic_write_text
from model import LlamaConfig, count_active_parameters


class Metrics:
    """Appends one JSON object per line to metrics.jsonl (where `enabled`: global rank 0); with
    --tensorboard, each number also to TensorBoard (lib/extras/tensorboard.py)."""

    def __init__(self, out_dir: str, enabled: bool, resume_step: int, tensorboard: bool = False):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.enabled = enabled
        self.writer = None
        if enabled and tensorboard:
            from lib.extras.tensorboard import TensorBoard

            self.writer = TensorBoard(out_dir, resume_step)
        if enabled and os.path.exists(self.path):
            # A run killed after its last checkpoint logged steps that this run logs again, and
            # maybe half a line: keep the whole lines up to the step this run starts from.
            from lib.checkpoints.resuming import read_metrics  # (an earlier run wrote it)

            kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def log(self, **record) -> None:
        finite = lambda v: not isinstance(v, float) or math.isfinite(v)
        record = {k: v if finite(v) else None for k, v in record.items()}  # JSON has no NaN
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            self.writer.log(record)

    def log_validation(self, step: int, val_loss: float, val_bpb: float, tasks=None) -> None:
        """An evaluation's record, also printed above the progress bar (where enabled): the
        loss per token, and bits per byte of text (which compares across tokenizers); with
        --eval-tasks, each task's accuracies too (`tasks`: lib/extras/training_tasks.py's
        results), as TASK_acc, TASK_acc_norm and, for a last-word task, TASK_perplexity."""
        ppl = math.exp(min(val_loss, 50.0))  # capped: exp of an early, huge loss is just noise
        figures, line = {}, ""
        if tasks:
            from lib.extras import training_tasks

            figures, line = training_tasks.figures(tasks), f"; {training_tasks.describe(tasks)}"
        self.log(step=step, val_loss=val_loss, val_bpb=val_bpb, val_ppl=ppl, **figures)
        if self.enabled:
            bits = f"{val_bpb:.4f} bits per byte"
            tqdm.write(f"step {step}: val loss {val_loss:.4f}, {bits}, perplexity {ppl:.1f}{line}")


class Throughput:
    """Tokens/s, step time, MFU and peak GPU memory of training steps alone."""

    def __init__(self, config: LlamaConfig, args, device: torch.device, devices: int):
        self.tokens_per_step = args.batch_size * args.seq_length
        self.flops_per_token = flops_per_token(config, args.seq_length)
        self.peak_flops = peak_flops(device)  # None on CPU and unknown GPUs: no MFU then
        self.device, self.devices = device, devices
        self.restart()

    def restart(self) -> None:
        self.start, self.steps = time.perf_counter(), 0

    def step(self) -> None:
        self.steps += 1

    def figures(self) -> dict:
        """Figures since the last call or restart(), in host time (each step is synchronised by
        the .item() of its loss)."""
        seconds = max(time.perf_counter() - self.start, 1e-9)
        rate = self.steps * self.tokens_per_step / seconds
        figures = {
            "tokens_per_sec": rate,
            "step_ms": 1000 * seconds / max(self.steps, 1),
            "mfu": mfu(rate, self.flops_per_token, self.peak_flops, self.devices),
            "peak_memory_gb": peak_memory_gb(self.device),
        }
        self.restart()
        return figures


def router_figures(model: torch.nn.Module, group=None) -> dict:
    """The routing of a mixture of experts since the last call, over the global batch (a
    collective over `group`, default all ranks: moe.router_figures); {} for a dense model,
    which never imports lib/extras/moe.py."""
    moe = sys.modules.get("lib.extras.moe")
    return {} if moe is None else moe.router_figures(model, group)


def bar_postfix(loss: float, lr: float, figures: dict) -> dict:
    """The progress bar's figures at a log step (MFU where the GPU's peak is known)."""
    rate, step_ms = figures["tokens_per_sec"], figures["step_ms"]
    postfix = {"loss": f"{loss:.3f}", "lr": f"{lr:.2e}", "tok_s": f"{rate:,.0f}"}
    postfix["step_ms"] = f"{step_ms:,.1f}"
    if figures["mfu"] is not None:
        postfix["mfu"] = f"{100 * figures['mfu']:.1f}%"
    return postfix


# -------------------------------------------------------------------------------------------------
# Model FLOPs utilisation (MFU)

# Dense bf16 peak FLOP/s (datasheet, no sparsity), by a piece of torch.cuda.get_device_name();
# the first match wins, so the specific names come before "H100".
PEAK_BF16_FLOPS = (
    ("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12),
    ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10", 125e12),
)  # fmt: skip


def flops_per_token(config: LlamaConfig, seq_length: int) -> float:
    """Training FLOPs per token, PaLM's appendix B: 6 N + 12 L H Q T. N: the parameters of the
    matrix multiplies a token uses (lm_head, not the embedding; of a mixture of experts, the
    router and k experts). 12 L H Q T: attention's QK^T and AV (H heads of width Q, context T)."""
    n = count_active_parameters(config)
    if not config.tie_word_embeddings:
        n -= config.vocab_size * config.hidden_size
    attention = 12 * config.num_hidden_layers * config.hidden_size * seq_length  # H*Q = hidden
    return 6 * n + attention


def peak_flops(device: torch.device) -> float | None:
    """This GPU's dense bf16 peak, or None (CPU, unknown GPU): no MFU rather than a wrong one."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def mfu(tokens_per_sec: float, flops_per_token: float, peak: float | None, devices: int):
    """The fraction of `devices` GPUs' peak turned into model FLOPs; None without a peak."""
    return None if peak is None else tokens_per_sec * flops_per_token / (peak * devices)


def build_memory(model: torch.nn.Module, device: torch.device) -> str:
    """The model's weights on this rank once built and placed (DTensors' local parts) and the
    process's peak so far (host RSS, the GPU's allocated peak): the line to plan bigger runs by."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    weights = sum(t.numel() * t.element_size() for t in local) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB (bytes on macOS)
    peak = rss / (1e9 if sys.platform == "darwin" else 1e9 / 1024)
    line = f"memory: weights {weights:.3f} GB on this rank; peak so far {peak:.3f} GB host memory"
    if device.type == "cuda":
        line += f", {torch.cuda.max_memory_allocated(device) / 1e9:.3f} GB of GPU memory"
    return line


def peak_memory_gb(device: torch.device) -> float | None:
    """The most GPU memory tensors have held so far (GB = 1e9 bytes); None on CPU."""
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
