"""Time the training step of every parallel strategy: tokens/s, step time, MFU, peak memory.

    python -m tools.bench                                          # every strategy, on this machine
    python -m tools.bench --model 1b --seq-length 2048 --micro-batch-size 4 --precision bf16 \
        --compile
    python -m tools.bench --strategies single,ddp --json bench.json  # a subset; results for tools
    torchrun --standalone --nproc_per_node=8 -m tools.bench --model 1b --seq-length 2048 --compile
    torchrun --standalone --nproc_per_node=2 -m tools.bench          # no GPU: 2 CPU ranks, gloo

Each strategy trains a fresh model (the same initial weights every time) on random tokens of
the shape --micro-batch-size x --seq-length: --warmup untimed steps first (compilation, the
allocator's first requests), then --steps timed ones. A step is the training scripts' own: their
model and wrapping, training.build_optimizer, training.autocast, loss = loss_sum / tokens, clipping,
optimizer step, zero_grad, and the distributed scripts' two small all-reduces (the token count
and the logged loss). Only the bookkeeping of a few scalars (NaN guard, LR schedule) is left
out. The GPU is waited for (cuda synchronize, then a barrier) before and after the timed steps,
never between them: in between, the queue stays as full as in training.

  single  a plain model, no wrapper: the reference. Under torchrun every rank trains its own,
          with no communication at all.
  dp      nn.DataParallel over every local GPU (train_dp.py): without torchrun, >1 GPU only.
  ddp     DistributedDataParallel (train_ddp.py).
  zero1   DDP + ZeroRedundancyOptimizer (train_zero1.py).
  fsdp    FSDP2: fully_shard on each decoder layer, then the root (train_fsdp.py, ZeRO-3).

"vs single" is a strategy's tokens/s per device over single's. Started with `python`, ddp, zero1
and fsdp run in a process group of one: the ratio is what the wrapper costs when there is nothing
to communicate (the target: no more than 3%). Under torchrun it is the scaling efficiency: 1.0
means N devices train N times as fast as one.

The last line times the real data pipeline (training.build_datasets, cached after its first run)
through a DataLoader of the same batch shape, against the tokens/s the fastest step consumes: a
loader less than 10x ahead of the step would leave the GPU waiting for data.
"""

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from lib import distributed, exits, flags, metrics, model_config, training
from lib.checkpoints import files
from lib.extras import speed
from lib.parallel.replica import Replica
from model import IGNORE_INDEX, count_parameters
from tools import bench_loader
from tools.plot_metrics import check_output_file, output_failed

STRATEGIES = ("single", "dp", "ddp", "zero1", "fsdp")
# What each measured strategy reports (per device; see the module docstring).
RESULT_FIELDS = (
    "devices_per_process",
    "tokens_per_sec",
    "step_ms",
    "mfu",
    "peak_memory_gb",
    "vs_single",
)
AHEAD = 10  # the data loader should deliver at least this many times what the step consumes


# -------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = flags.ArgumentParser(
        description="Time the training step of every parallel strategy.",
        formatter_class=flags.HelpFormatter,
    )
    g = p.add_argument_group("what to time")
    g.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help=f"comma-separated subset of {', '.join(STRATEGIES)}; single, the reference of "
        "every ratio, always runs",
    )
    g.add_argument(
        "--steps",
        type=flags.number_arg(int, 1),
        default=20,
        help="timed optimizer steps per strategy",
    )
    g.add_argument(
        "--warmup",
        type=flags.number_arg(int, 0),
        default=5,
        help="untimed steps before them (compilation, ...)",
    )
    g.add_argument(
        "--json", default=None, help="also write the results (per device, as printed) to this file"
    )
    g.add_argument(
        "--matmuls",
        action="store_true",
        help="instead: time the model's matmul shapes alone and print the fraction of the GPU's "
        "bf16 peak they reach, the planner's --matmul-efficiency (tools/bench_matmuls.py)",
    )
    g.add_argument(
        "--tp", type=flags.number_arg(int, 1), default=1, help="--matmuls: a TP rank's shapes"
    )

    g = p.add_argument_group("model and step (the training scripts' flags)")
    g.add_argument("--model", default="tiny", help="preset: tiny, small, medium, 1b, 7b, 13b, 70b")
    model_config.add_shape_flags(g, flags.number_arg)
    g.add_argument(
        "--seq-length", type=flags.number_arg(int, 1), default=256, help="tokens per sequence"
    )
    g.add_argument(
        "--micro-batch-size",
        type=flags.number_arg(int, 1),
        default=16,
        help="sequences per device per step",
    )
    g.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="auto: bf16 autocast on GPUs that support it, else fp32",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="torch.compile each decoder layer",
    )
    g.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each decoder layer in backward (MFU does not count the recomputation)",
    )

    g = p.add_argument_group("data pipeline (the training scripts' flags)")
    g.add_argument("--data", default="stdlib", help="corpus: stdlib, a file, glob, dir, hub name")
    g.add_argument("--text-column", default="text", help="column holding the text (json/parquet)")
    g.add_argument("--tokenizer", default=None, help="an existing tokenizer.json")
    g.add_argument(
        "--vocab-size",
        type=flags.number_arg(int, flags.MIN_VOCAB_SIZE, flags.MAX_VOCAB_SIZE),
        default=None,
        help="vocabulary of a trained tokenizer (default: the preset's); the model's is the "
        "tokenizer's, as in training",
    )
    g.add_argument("--data-mode", choices=["pack", "pad"], default="pack", help="example layout")
    g.add_argument("--cache-dir", default=".cache", help="tokenizer and tokenized-data cache")
    g.add_argument(
        "--num-workers",
        type=flags.number_arg(int, 0),
        default=1,
        help="DataLoader worker processes",
    )
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """ValueError (through parser.error) on a bad flag; returns the strategies, single first."""
    chosen = [name.strip() for name in args.strategies.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in STRATEGIES]
    if unknown or not chosen:
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "no strategy given"
        parser.error(f"--strategies: {what}; choose from {', '.join(STRATEGIES)}")
    try:
        config = model_config.preset_config(args, args.model)  # shape flags, --vocab-size checked
    except ValueError as e:
        parser.error(str(e))
    if args.seq_length > config.max_position_embeddings:
        parser.error(
            f"--seq-length {args.seq_length} exceeds the {args.model} model's "
            f"max_position_embeddings ({config.max_position_embeddings})"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # as torchrun_rank
    if args.compile and (missing := speed.compiler_missing(device)):
        parser.error(missing)
    try:
        if args.json:  # found now, not after the timing
            check_output_file("--json", args.json)
    except ValueError as e:
        parser.error(str(e))
    return ["single"] + [name for name in STRATEGIES[1:] if name in chosen]


def check_precision(precision: str, device: torch.device) -> str:
    """'auto' resolved as the scripts resolve it; ValueError if the device cannot do bf16."""
    precision = training.resolve_precision(precision, device)
    if precision != "bf16":
        return precision
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ValueError(
            f"--precision bf16: {torch.cuda.get_device_name(device)} has no bf16 support; "
            f"use --precision fp32"
        )
    if device.type == "cpu":
        try:  # the question is whether the CPU kernels exist: ask them
            with torch.autocast("cpu", dtype=torch.bfloat16):
                torch.ones(2, 2, requires_grad=True).matmul(torch.ones(2, 2)).sum().backward()
        except RuntimeError as e:
            raise ValueError(f"--precision bf16: this CPU cannot run bf16 ({e}); use fp32") from e
    return precision


# -------------------------------------------------------------------------------------------------
# One strategy: build, step, time


def build(strategy: str, args, vocab_size: int, device, precision: str):
    """A fresh model set up as `strategy`'s training script sets it up; (module, optimizer)."""
    model, config = training.build_model(args, args.model, vocab_size)  # on the meta device
    training.prepare_layers(model, args)  # --activation-checkpointing, --compile
    if strategy == "fsdp":
        # train_fsdp.py's sharding: under bf16, weights gathered in bf16 and gradients reduced
        # in fp32; each layer a unit, then the root; the optimizer built on the shards.
        bf16 = precision == "bf16"
        mp_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        )
        for layer in model.layers:
            fully_shard(layer, mp_policy=mp_policy)
        fully_shard(model, mp_policy=mp_policy)
    model.to_empty(device=device)
    training.init_weights(model, config, args, device)  # seeded: the same weights every time
    if strategy == "fsdp":
        return model, training.build_optimizer(model, args, device.type)
    optimizer = training.build_optimizer(model, args, device.type)
    if strategy == "single":
        return model, optimizer
    if strategy == "dp":
        return nn.DataParallel(Replica(model, device, precision)), optimizer
    ddp_model = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        **distributed.NO_FORWARD_BUFFER_SYNC,  # the lessons' setting: no buffer sync per forward
    )
    if strategy == "zero1":
        optimizer = ZeroRedundancyOptimizer(
            optimizer.param_groups, optimizer_class=torch.optim.AdamW, lr=args.lr
        )
    return ddp_model, optimizer


def train_step(model, optimizer, x, y, device, precision, grad_clip, distributed: bool) -> None:
    """One optimizer step, as the training scripts take it (no gradient accumulation)."""
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    global_tokens = (y != IGNORE_INDEX).sum()  # all of them here: random tokens, no padding
    world_size = 1
    if distributed:
        dist.all_reduce(global_tokens)
        world_size = dist.get_world_size()
    with training.autocast(device, precision):
        loss_sum, _ = model(x, y)
    loss_sum = loss_sum.sum()  # a no-op, except under DataParallel: one sum per GPU
    # DDP and FSDP average gradients over ranks; the factor world_size undoes that, as in the
    # scripts, leaving sum of all losses / all tokens.
    (loss_sum * world_size / global_tokens).backward()
    if distributed:
        dist.all_reduce(loss_sum.detach())  # the scripts' logged loss, summed over ranks
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def random_batch(rows: int, seq_length: int, vocab_size: int, pin: bool):
    """Inputs and targets of random tokens: (rows, seq_length) each, on the CPU as the loader's."""
    tokens = torch.randint(vocab_size, (rows, seq_length + 1), generator=torch.Generator())
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (B, T) each; y = x shifted
    return (x.pin_memory(), y.pin_memory()) if pin else (x, y)


def wait_for_all(device: torch.device) -> None:
    """Until this GPU's queue is empty and every rank got here: the edge of a timed region."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def over_ranks(value: float | None, op, device: torch.device) -> float | None:
    """`value` reduced over all ranks (MAX, MIN): a job is as fast as its slowest rank."""
    if value is None:
        return None
    tensor = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.item()


def time_strategy(strategy, args, vocab_size, device, precision, rows) -> tuple[float, float]:
    """(seconds that --steps steps took the slowest rank, peak GB of GPU memory or None)."""
    if device.type == "cuda":  # the peak of this strategy alone: nothing left from the last one
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model, optimizer = build(strategy, args, vocab_size, device, precision)
    x, y = random_batch(rows, args.seq_length, vocab_size, pin=device.type == "cuda")
    distributed = strategy in ("ddp", "zero1", "fsdp")

    step = (model, optimizer, x, y, device, precision, args.grad_clip, distributed)
    for _ in range(args.warmup):
        train_step(*step)
    wait_for_all(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        train_step(*step)
    wait_for_all(device)
    seconds = over_ranks(time.perf_counter() - start, dist.ReduceOp.MAX, device)
    # This process's GPU: under dp, GPU 0, which holds the model and gathers the outputs.
    peak = over_ranks(metrics.peak_memory_gb(device), dist.ReduceOp.MAX, device)
    del model, optimizer, step  # DDP's reducer goes before the process group does
    gc.collect()
    return seconds, peak


def skip_reason(strategy: str, under_torchrun: bool) -> str | None:
    if strategy != "dp":
        return None
    if under_torchrun:
        return "skipped: needs one process, not torchrun"
    if torch.cuda.device_count() < 2:
        return "skipped: needs >1 GPU"
    return None


# -------------------------------------------------------------------------------------------------
# The report


def command_line() -> str:
    """The command that started this run. Under torchrun the script sees its own arguments only:
    the launcher's are rebuilt from its environment (rendezvous details left out)."""
    script = ["-m", "tools.bench", *sys.argv[1:]]  # run from the repository root
    if "LOCAL_WORLD_SIZE" not in os.environ:
        # A thread count set by hand changes CPU results (torchrun sets its own: 1).
        threads = os.environ.get("OMP_NUM_THREADS")
        return shlex.join([*([f"OMP_NUM_THREADS={threads}"] if threads else []), "python", *script])
    nproc = int(os.environ["LOCAL_WORLD_SIZE"])
    nnodes = int(os.environ["WORLD_SIZE"]) // nproc
    nodes = [f"--nnodes={nnodes}"] if nnodes > 1 else ["--standalone"]
    return shlex.join(["torchrun", *nodes, f"--nproc_per_node={nproc}", *script])


def starving(report: dict) -> str:
    """What waits for data when the DataLoader lags: the GPU, or on a CPU run the steps (whose
    compute shares the cores with the loader's workers)."""
    return "GPU" if report.get("device_type", "cuda") == "cuda" else "CPU's training steps"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):  # Linux names the CPU model here; platform does not
        with open("/proc/cpuinfo") as f:
            models = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        name = models[0] if models else name
    return f"{name} CPU (torch threads per process: {torch.get_num_threads()})"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell: readable in a terminal, pasteable as markdown.
    The first column is aligned left, the figures right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [cells[0].ljust(widths[0])] + list(map(str.rjust, cells[1:], widths[1:]))
        return "| " + " | ".join(padded) + " |"

    rule = [":" + "-" * (widths[0] - 1)] + ["-" * (w - 1) + ":" for w in widths[1:]]
    return "\n".join([line(header), line(rule), *(line(row) for row in rows)])


def table_row(r: dict) -> list[str]:
    """One strategy's figures, formatted; or why it was skipped."""
    if r["skipped"]:
        return [r["strategy"], r["skipped"], "", "", "", ""]
    mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    memory = "-" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.2f}"
    tokens_per_sec, step_ms = f"{r['tokens_per_sec']:,.0f}", f"{r['step_ms']:,.1f}"
    return [r["strategy"], tokens_per_sec, step_ms, mfu, memory, f"{r['vs_single']:.3f}"]


def format_report(report: dict) -> str:
    s, d = report["settings"], report["data"]
    if report["world_size"] == 1:
        ratio = "vs single: tokens/s over single's (one process: the wrapper's own cost)"
    else:
        ratio = "vs single: scaling efficiency, tokens/s per rank over single's (every rank alone)"
    lines = [
        f"tools/bench.py, {report['date']}",
        f"command: {report['command']}",
        f"torch {report['torch']}; device: {report['device']}; processes: {report['world_size']}",
        f"model {s['model']} ({s['parameters'] / 1e6:.2f}M parameters, vocab {s['vocab_size']}, "
        f"{report['flops_per_token'] / 1e6:,.1f} MFLOP/token); micro-batch "
        f"{s['micro_batch_size']} x {s['seq_length']} tokens per device; precision "
        f"{s['precision']}, compile {s['compile']}, activation checkpointing "
        f"{s['activation_checkpointing']}; {s['warmup']} warmup + {s['steps']} timed steps",
        f"tokens/s, step ms, MFU and peak memory are per device; {ratio}",
        "",
        markdown_table(
            ["strategy", "tokens/s", "step ms", "MFU", "peak mem GB", "vs single"],
            [table_row(r) for r in report["results"]],
        ),
        "",
        f"data pipeline: DataLoader (num_workers {d['num_workers']}, pin_memory "
        f"{d['pin_memory']}) delivers {d['tokens_per_sec']:,.0f} tokens/s per process; the "
        f"fastest step ({d['consumed_by']}) consumes {d['consumed_tokens_per_sec']:,.0f}: "
        f"{d['ratio']:,.1f}x",
    ]
    if d["ratio"] < AHEAD:
        lines.append(
            f"warning: the DataLoader is only {d['ratio']:.1f}x ahead of the step (< {AHEAD}x): "
            f"the {starving(report)} would starve; raise --num-workers"
        )
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------


def main():
    parser = build_parser()
    args = parser.parse_args()
    if args.matmuls:
        return bench_matmuls_main(parser, args)
    strategies = check_args(parser, args)
    # Everything the bench does not vary (weight decay, grad clip, seed, validation split, ...)
    # takes the training scripts' defaults: it builds exactly their model, optimizer and data.
    args = argparse.Namespace(**{**vars(flags.build_parser("").parse_args([])), **vars(args)})
    under_torchrun = "RANK" in os.environ
    # The lessons' process-group setup: a group of one without torchrun.
    rank, _, world_size, device = distributed.torchrun_rank()
    dist.init_process_group(
        distributed.backend_for(None, device),
        store=distributed.rendezvous_store(),
        rank=rank,
        world_size=world_size,
        device_id=device if device.type == "cuda" else None,
    )
    is_main = rank == 0
    precision = check_precision(args.precision, device)

    # ---- data pipeline: the real one, timed alone ----------------------------------------------
    train_ds, _, tokenizer = training.build_datasets(args, args.tokenizer)
    if len(train_ds) < args.micro_batch_size:
        raise ValueError(
            f"the training split has {len(train_ds)} sequences of {args.seq_length} tokens, "
            f"fewer than one --micro-batch-size ({args.micro_batch_size}); use more --data"
        )
    pin = device.type == "cuda"
    loader_rate = bench_loader.benchmark_loader(
        train_ds, args.micro_batch_size, args.num_workers, pin_memory=pin
    )
    loader_rate = over_ranks(loader_rate, dist.ReduceOp.MIN, device)

    # ---- every strategy -------------------------------------------------------------------------
    vocab_size = tokenizer.get_vocab_size()
    config = model_config.preset_config(args, args.model, vocab_size)
    flops_per_token = metrics.flops_per_token(config, args.seq_length)
    peak_flops = metrics.peak_flops(device)  # None on CPU and unknown GPUs: no MFU then
    tokens_per_device = args.steps * args.micro_batch_size * args.seq_length
    results = []
    for strategy in strategies:
        result = dict(strategy=strategy, skipped=skip_reason(strategy, under_torchrun))
        results.append(result)
        if result["skipped"]:
            result.update(dict.fromkeys(RESULT_FIELDS))  # the same fields, all null
            continue
        if is_main:
            print(f"bench: {strategy}, {args.warmup} + {args.steps} steps", file=sys.stderr)
        # DataParallel splits one process's batch over every GPU: micro-batch per GPU as ever.
        devices = torch.cuda.device_count() if strategy == "dp" else 1
        seconds, peak = time_strategy(
            strategy, args, vocab_size, device, precision, args.micro_batch_size * devices
        )
        rate = tokens_per_device / seconds
        if strategy == "single":
            single_rate = rate  # single runs first: the reference of every ratio
        result.update(
            devices_per_process=devices,
            tokens_per_sec=rate,
            step_ms=1000 * seconds / args.steps,
            mfu=metrics.mfu(rate, flops_per_token, peak_flops, 1),
            peak_memory_gb=peak,
            vs_single=rate / single_rate,
        )

    # ---- report ---------------------------------------------------------------------------------
    # The loader feeds one process; DataParallel's process feeds all of its GPUs.
    measured = [r for r in results if not r["skipped"]]
    fastest = max(measured, key=lambda r: r["tokens_per_sec"] * r["devices_per_process"])
    consumed = fastest["tokens_per_sec"] * fastest["devices_per_process"]
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command_line(),
        "torch": torch.__version__,
        "device": device_name(device),
        "device_type": device.type,
        "world_size": world_size,
        "settings": dict(
            model=model_config.model_name(args, args.model),
            parameters=count_parameters(config),
            vocab_size=vocab_size,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            precision=precision,
            compile=args.compile,
            activation_checkpointing=args.activation_checkpointing,
            steps=args.steps,
            warmup=args.warmup,
        ),
        "flops_per_token": flops_per_token,
        "peak_flops": peak_flops,
        "results": results,
        "data": dict(
            tokens_per_sec=loader_rate,
            num_workers=args.num_workers,
            pin_memory=pin,
            consumed_by=fastest["strategy"],
            consumed_tokens_per_sec=consumed,
            ratio=loader_rate / consumed,
        ),
    }
    if is_main:
        print(format_report(report))
        if args.json:
            try:
                files.atomic_write_text(args.json, json.dumps(report, indent=2) + "\n")
            except OSError as e:  # the table above is out already
                raise output_failed("--json", args.json, e) from e
    dist.barrier()
    dist.destroy_process_group()


def bench_matmuls_main(parser, args) -> None:
    """--matmuls: the model's matmul shapes timed on this process's device, no process group."""
    from tools import bench_matmuls

    _, _, _, device = distributed.torchrun_rank()
    try:
        config = model_config.preset_config(args, args.model)  # shape flags, --vocab-size
    except ValueError as e:
        parser.error(str(e))
    if config.hidden_size % args.tp or config.intermediate_size % args.tp:
        parser.error(f"--tp {args.tp} must divide the hidden size and the MLP's width")
    tokens = args.micro_batch_size * args.seq_length
    m = bench_matmuls.measure(config, tokens, args.tp, device, args.steps, args.warmup)
    print(f"command: {command_line()}; torch {torch.__version__}")
    print(bench_matmuls.format_measurement(m, device_name(device)))
    if args.json:
        try:
            files.atomic_write_text(args.json, json.dumps(m, indent=2) + "\n")
        except OSError as e:
            raise output_failed("--json", args.json, e) from e


if __name__ == "__main__":
    exits.run(main, os_exit=True)  # it joins a process group, as the lessons: see exits.run
