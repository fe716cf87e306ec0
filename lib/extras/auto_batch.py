"""--micro-batch-size auto: the largest micro-batch that fits on the GPU, measured.

    plan = auto_batch.auto_micro_batch_size(args, plan, wrapped_model, attn_mask, optimizer, ...)

Called by a script after it has wrapped its model (DataParallel, DDP, FSDP), with the same
forward it trains with; the returned plan has the measured micro-batch and the accumulation
that keeps the global batch.
"""

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from lib.training import autocast

# The share of the GPU's memory a micro-batch may fill, with the optimizer state still to come:
# the rest is headroom for fragmentation, NCCL buffers and evaluation.
AUTO_MEMORY_FRACTION = 0.9


def search_micro_batch_size(
    per_device: int, peak_bytes: Callable[[int], float], budget: float
) -> tuple[int | None, dict[int, float]]:
    """The largest divisor n of per_device with peak_bytes(n) <= budget (None: not even 1), and
    the peaks measured, {n: bytes}.

    Divisors, so that accumulation then makes up the batch exactly. They are tried from small to
    large, stopping at the first that does not fit: memory grows with n, and small probes are
    cheap. A size that the last two measurements (activations grow linearly with n) predict to
    be over budget is not tried at all: running out of memory is slow, fragments the allocator's
    cache and, under torchrun, a rank that runs out alone leaves the others waiting in a
    collective of the forward or backward pass.
    """
    best, peaks = None, {}
    for n in (d for d in range(1, per_device + 1) if per_device % d == 0):
        if len(peaks) >= 2:
            (n1, p1), (n2, p2) = list(peaks.items())[-2:]
            if p2 + (p2 - p1) / (n2 - n1) * (n - n2) > budget:
                break
        peak = peak_bytes(n)
        if peak > budget:
            peaks[n] = peak
            break
        best, peaks[n] = n, peak
    return best, peaks


def optimizer_state_to_come(optimizer) -> int:
    """Bytes of AdamW state (two moments of each parameter's size) not allocated yet on the GPU.

    AdamW allocates its state at the first step, so a probe before it does not see it; from the
    second step on it is there during every forward and backward. A resumed optimizer already
    has it. Counted: the parameters this rank updates (the local shard of an FSDP DTensor; the
    AdamW of this rank's part under ZeroRedundancyOptimizer), and only those on the GPU.
    """
    from torch.distributed.tensor import DTensor  # here: a second of start-up for every script

    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's AdamW
    total = 0
    for group in local.param_groups:
        for p in group["params"]:
            shard = p.to_local() if isinstance(p, DTensor) else p
            if shard.is_cuda and not local.state.get(p):
                total += 2 * shard.numel() * shard.element_size()
    return total


def check_device(parser) -> None:
    """parser.error on a machine without a CUDA GPU: there is nothing to measure. torch counts
    peak memory on GPUs only, and a CPU that runs out of memory swaps or has the process killed
    instead of raising an error one could catch."""
    if not torch.cuda.is_available():
        parser.error(
            "--micro-batch-size auto measures GPU memory and needs a CUDA GPU; on CPU give a "
            "number, or leave the flag out (no accumulation: --batch-size / devices per forward)"
        )


def auto_micro_batch_size(
    args, plan, model, attn_mask, optimizer, vocab_size: int, device, replicas: int = 1
):
    """--micro-batch-size auto: the plan with the largest micro-batch that fits on this GPU, and
    the gradient accumulation steps that keep the global batch --batch-size.

    model: the wrapped model, as the training loop calls it. Each probe runs its forward (with
    the run's attention mask and precision) and backward on random tokens of --seq-length, and
    measures the peak memory the caching allocator reserved; a size fits if that peak plus the
    optimizer state still to come stays within AUTO_MEMORY_FRACTION of the GPU. replicas: the
    GPUs nn.DataParallel splits each forward over (n sequences for each). Under torchrun every
    rank probes the same sizes and takes the largest peak of all, so all choose the same size.
    DDP probes under no_sync(): no collective, so a rank that runs out of memory alone cannot
    leave the others waiting. FSDP's forward and backward are collectives themselves; the
    search's prediction avoids most out-of-memory probes (see search_micro_batch_size).
    """
    from torch.distributed.tensor import DTensor

    per_device = args.batch_size // plan.devices
    budget = AUTO_MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory
    state = optimizer_state_to_come(optimizer)
    # train_fsdp.py keeps the full (unsharded) fp32 gradient of every sharded parameter between
    # the micro-steps of an accumulation (set_requires_gradient_sync(False)); a probe does not.
    params = [p for group in optimizer.param_groups for p in group["params"]]
    unsharded_grads = sum(4 * p.numel() for p in params if isinstance(p, DTensor))
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)  # only DDP has one
    tokens = torch.Generator().manual_seed(0)  # its own generator: training's RNG is untouched

    def forward_backward(n: int) -> None:
        ids = torch.randint(vocab_size, (n * replicas, args.seq_length + 1), generator=tokens)
        x, y = ids[:, :-1].to(device), ids[:, 1:].to(device)  # (n * replicas, T) each
        with no_sync():
            with autocast(device, plan.precision):
                loss_sum, _ = model(x, y, attn_mask(x))
            loss_sum.sum().backward()  # .sum(): DataParallel returns one per replica

    def peak_bytes(n: int) -> float:
        torch.cuda.empty_cache()  # release what earlier probes cached, then measure from here
        torch.cuda.reset_peak_memory_stats(device)
        try:
            forward_backward(n)  # its tensors are freed when it returns (or raises)
            peak = torch.cuda.max_memory_reserved(device) + state
            peak += unsharded_grads if n < per_device else 0
        except torch.OutOfMemoryError:
            peak = math.inf
        optimizer.zero_grad(set_to_none=True)  # the probe's gradients; no weight has changed
        torch.cuda.empty_cache()
        peak = torch.tensor(float(peak), device=device)
        if dist.is_initialized():  # the same decision on every rank: the largest peak of all
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return peak.item()

    best, peaks = search_micro_batch_size(per_device, peak_bytes, budget)
    from lib.extras.moe import router_stats

    router_stats(model)  # a mixture of experts counted the probes' routing: not training's
    if args.compile or (args.document_mask and plan.attention == "flex"):
        # The probes compiled the layers for several batch sizes, so the kernels kept are
        # dynamic-shape ones; recompiling once for the chosen size gives static, faster ones.
        torch.compiler.reset()
    tried = ", ".join(
        f"{n}: " + ("out of memory" if math.isinf(p) else f"{p / 1e9:.1f} GB")
        for n, p in peaks.items()
    )
    if best is None:
        raise ValueError(
            f"--micro-batch-size auto: not even 1 sequence of {args.seq_length} tokens fits in "
            f"{budget / 1e9:.1f} GB ({tried}, optimizer state included); try "
            f"--activation-checkpointing, train_fsdp.py, or a shorter --seq-length"
        )
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"micro-batch size auto: {best} (peak memory by size, with the optimizer state to "
            f"come: {tried}; budget {budget / 1e9:.1f} GB)"
        )
    return replace(plan, micro_batch_size=best, accumulation=per_device // best)
