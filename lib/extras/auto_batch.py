"""--micro-batch-size auto: the largest micro-batch that fits on the GPU, measured.

    plan = auto_batch.auto_micro_batch_size(args, plan, wrapped_model, attn_mask, optimizer, ...)

Called by a script after it has wrapped its model (DataParallel, DDP, FSDP), with the same
forward it trains with; the returned plan has the measured micro-batch and the accumulation
that keeps the global batch. train_pp.py probes its pipeline schedule instead, through
largest_that_fits, which takes any probe (lib/parallel/pipeline.py's measured).
"""

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from lib.exits import TrainingError
from lib.training import autocast

# The share of the GPU's memory a micro-batch may fill, with the optimizer state still to come:
# the rest is headroom for fragmentation, NCCL buffers and evaluation.
AUTO_MEMORY_FRACTION = 0.9
# Under torchrun, what each rank allocates before a probe, over the peak the earlier probes
# predict: the probe's own fragmentation, which a prediction cannot see.
RESERVE_MARGIN = 0.1


def search_micro_batch_size(
    per_device: int,
    peak_bytes: Callable[[int], float],
    budget: float,
    reserve: Callable[[int, float], bool] | None = None,
    baseline: float = 0.0,
    allowed: Callable[[int], bool] | None = None,
) -> tuple[int | None, dict[int, float | None]]:
    """The largest divisor n of per_device (that `allowed` allows) with peak_bytes(n) <= budget
    (None: not even the smallest), and the peaks measured, {n: bytes} (None: a size not every
    rank could reserve).

    Divisors, so that accumulation then makes up the batch exactly. They are tried from small to
    large, stopping at the first that does not fit: memory grows with n, and small probes are
    cheap. A size that the last two measurements (activations grow linearly with n) predict to
    be over budget is not tried at all: running out of memory is slow and fragments the
    allocator's cache.

    reserve(n, predicted), under torchrun: whether every rank could set aside the peak predicted
    for size n (from the last two probes; the first from one probe and `baseline`, the peak of
    none) before any rank runs it. A size some rank cannot reserve is not run, by any rank: a
    rank that ran out of memory alone inside a probe would leave the others waiting in a
    collective of the forward or backward pass (FSDP's all-gathers, CP's and EP's exchanges).

    allowed(n): whether the run can take n sequences per micro-batch at all (train_pp.py: whether
    its schedule takes per_device / n micro-batches); a divisor it refuses is passed over, neither
    probed nor predicted. It is asked of each divisor in turn as the search reaches it.
    """
    best, peaks = None, {}
    divisors = (d for d in range(1, per_device + 1) if per_device % d == 0)
    for n in (d for d in divisors if allowed is None or allowed(d)):
        measured = list(peaks.items())[-2:]
        if len(measured) == 2:
            (n1, p1), (n2, p2) = measured
            predicted = p2 + (p2 - p1) / (n2 - n1) * (n - n2)
            if predicted > budget:
                break
        elif measured:  # one probe: the line through it and the peak of no sequence at all
            ((n1, p1),) = measured
            predicted = baseline + (p1 - baseline) * n / n1
        else:  # the first size: one sequence, without which nothing trains (nothing reserved)
            predicted = None
        if reserve is not None and predicted is not None and not reserve(n, predicted):
            peaks[n] = None
            break
        peak = peak_bytes(n)
        if peak > budget:
            peaks[n] = peak
            break
        best, peaks[n] = n, peak
    return best, peaks


def every_rank(ok: bool, device) -> bool:
    """Whether ok holds on every rank: an all-reduce of the minimum, which every rank calls at
    the same point of the search, outside any forward."""
    flag = torch.tensor(int(ok), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def largest_of_every_rank(value: float, device) -> float:
    """The largest of every rank's value: all choose the same size."""
    value = torch.tensor(float(value), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


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
    the gradient accumulation steps that keep the global batch. model: the wrapped model, as the
    loop calls it. Each probe runs its forward (with the run's attention mask and precision) and
    backward on random tokens of --seq-length (largest_that_fits says how a size is judged).
    replicas: the GPUs nn.DataParallel splits each forward over (n sequences for each)."""
    from torch.distributed.tensor import DTensor

    # train_fsdp.py keeps the full (unsharded) fp32 gradient of every sharded parameter between
    # the micro-steps of an accumulation (set_requires_gradient_sync(False)); a probe does not.
    params = [p for group in optimizer.param_groups for p in group["params"]]
    unsharded_grads = sum(4 * p.numel() for p in params if isinstance(p, DTensor))
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)  # only DDP has one
    tokens = torch.Generator().manual_seed(0)  # its own generator: training's RNG is untouched

    def forward_backward(n: int) -> None:
        x, y = random_batch(tokens, n * replicas, args.seq_length, vocab_size, device)
        with no_sync():
            with autocast(device, plan.precision):
                loss_sum, _ = model(x, y, attn_mask(x))
            loss_sum.sum().backward()  # .sum(): DataParallel returns one per replica

    return largest_that_fits(
        args, plan, model, optimizer, device, forward_backward, unsharded_grads=unsharded_grads
    )


def random_batch(generator, rows: int, seq_length: int, vocab_size: int, device):
    """A probe's inputs and targets: random tokens from `generator` (not training's RNG), (rows,
    seq_length) each, on the device; contiguous, as a step's batches are (torch 2.11's pipeline
    stages refuse inputs of other strides than those they inferred)."""
    ids = torch.randint(vocab_size, (rows, seq_length + 1), generator=generator)
    return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)  # (rows, T)


def largest_that_fits(
    args,
    plan,
    model,
    optimizer,
    device,
    forward_backward: Callable[[int], None],
    refusal: Callable[[int], str | None] | None = None,
    unsharded_grads: int = 0,
):
    """The plan with the largest micro-batch n for which forward_backward(n), one forward and
    backward of n sequences per device as the run trains them, fits; and the accumulation that
    keeps the global batch. A size fits if the peak memory the caching allocator reserved, plus
    the optimizer state still to come, stays within AUTO_MEMORY_FRACTION of the GPU. refusal(n):
    why the run cannot take n sequences per micro-batch (None if it can; train_pp.py: the
    schedule's count of micro-batches), so n is not tried. unsharded_grads: bytes a step holds
    between its micro-steps that a probe of one does not (train_fsdp.py's unsharded gradients).
    Under torchrun every rank probes the same sizes, takes the largest peak of all, and runs a
    size only once every rank could reserve its predicted peak (reserve, below; docs/speed.md):
    out of memory inside a probe all the same ends the run in one line on that rank (its peers
    wait in the probe's collectives: no other collective may be issued), where one process just
    stops the search."""
    per_device = args.batch_size // plan.devices
    budget = AUTO_MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory
    state = optimizer_state_to_come(optimizer)
    ranks = dist.is_initialized() and dist.get_world_size() > 1

    def not_on_the_gpu(n: int) -> float:  # what a peak counts but no probe allocates
        return state + (unsharded_grads if n < per_device else 0)

    def peak_bytes(n: int) -> float:
        torch.cuda.empty_cache()  # release what earlier probes cached, then measure from here
        torch.cuda.reset_peak_memory_stats(device)
        try:
            forward_backward(n)  # its tensors are freed when it returns (or raises)
            peak = torch.cuda.max_memory_reserved(device) + not_on_the_gpu(n)
        except torch.OutOfMemoryError:
            if ranks:  # its peers wait inside the probe's collectives: not one more collective
                fits = max((m for m, p in peaks_so_far.items() if p is not None), default=None)
                raise TrainingError(
                    f"--micro-batch-size auto: rank {dist.get_rank()} ran out of memory probing "
                    f"{n} sequences, although every rank had reserved its predicted peak first; "
                    f"give --micro-batch-size {fits or 1} (or less)"
                ) from None
            peak = math.inf
        optimizer.zero_grad(set_to_none=True)  # the probe's gradients; no weight has changed
        torch.cuda.empty_cache()
        peaks_so_far[n] = peak
        return largest_of_every_rank(peak, device) if ranks else peak

    def reserve(n: int, predicted: float) -> bool:
        """Whether every rank could allocate the peak predicted for n (and the margin)."""
        torch.cuda.empty_cache()
        need = (predicted - not_on_the_gpu(n)) * (1 + RESERVE_MARGIN)
        try:
            size = max(0, int(need - torch.cuda.memory_reserved(device)))
            block = torch.empty(size, dtype=torch.uint8, device=device)
            del block
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        torch.cuda.empty_cache()  # given back before the probe, which measures from here
        return every_rank(ok, device)

    def allowed(n: int) -> bool:  # asked only of the sizes the search reaches
        reason = refusal(n) if refusal is not None else None
        if reason is not None:
            skipped[n] = reason  # for the summary line: a size that might have fitted
        return reason is None

    peaks_so_far, skipped = {}, {}
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_reserved(device) + state if ranks else 0.0  # peak of nothing
    best, peaks = search_micro_batch_size(
        per_device, peak_bytes, budget, reserve if ranks else None, baseline, allowed
    )
    return chosen(args, plan, model, best, peaks, budget, per_device, skipped)


def chosen(args, plan, model, best, peaks: dict, budget: float, per_device: int, skipped=None):
    """The plan with the size the search chose (ValueError if not even the smallest fits), said
    on rank 0 with the sizes the run refused (skipped: {size: why}), and what the probes left
    behind undone: a mixture of experts' routing counts, the kernels compiled for several
    sizes."""
    from lib.extras.moe import router_stats

    router_stats(model)  # a mixture of experts counted the probes' routing: not training
    if args.compile or (args.document_mask and plan.attention == "flex"):
        # The probes compiled the layers for several batch sizes, so the kernels kept are
        # dynamic-shape ones; recompiling once for the chosen size gives static, faster ones.
        torch.compiler.reset()
    tried = ", ".join(f"{n}: {described(p)}" for n, p in peaks.items())
    if best is None:
        first = next(iter(peaks), 1)  # the smallest size tried: 1, unless the run refuses it
        raise ValueError(
            f"--micro-batch-size auto: not even {first} sequence{'s' * (first > 1)} of "
            f"{args.seq_length} tokens fits in "
            f"{budget / 1e9:.1f} GB ({tried}, optimizer state included); try "
            f"--activation-checkpointing, train_fsdp.py, or a shorter --seq-length"
        )
    refused = "; ".join(f"{n}: {why}" for n, why in (skipped or {}).items())
    refused = f"; not tried, as the run cannot take them: {refused}" if refused else ""
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"micro-batch size auto: {best} (peak memory by size, with the optimizer state to "
            f"come: {tried}; budget {budget / 1e9:.1f} GB{refused})"
        )
    return replace(plan, micro_batch_size=best, accumulation=per_device // best)


def described(peak: float | None) -> str:
    """A probe's peak as the summary line gives it."""
    if peak is None:
        return "not reserved on every rank"
    return "out of memory" if math.isinf(peak) else f"{peak / 1e9:.1f} GB"
