"""Plumbing shared by every train_*.py script; nothing in here is distributed (but for one
all-reduce that makes the ranks agree on a measured micro-batch size).

Each training script keeps its own visible loop (setup -> data -> model -> wrap -> loop ->
teardown) and calls these helpers for the parts that do not change between parallel strategies:
the command line, data, optimizer and LR schedule, mixed precision, evaluation, metrics,
checkpoints and the final outputs. That is what keeps `diff train_dp.py train_ddp.py` down to the
distributed changes alone.
"""

import argparse
import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader
from tqdm import tqdm

import data
from generate import OUT_DIR_FILES, generate_text, load_config, load_model
from model import LlamaConfig, LlamaForPretraining, count_parameters

# -------------------------------------------------------------------------------------------------
# Command line (the contract in DESIGN.md: other tools and tests drive the scripts by these names)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag raises ValueError instead of printing and exiting at once.

    `run` then prints it once (on global rank 0) and exits with 2, like argparse would: under
    torchrun that is one message instead of one usage message per process. Flags are never
    abbreviated: argparse would otherwise read a mistyped --mode as --model.
    """

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def error(self, message: str):
        raise ValueError(f"{message} (see --help)")


def build_parser(description: str) -> argparse.ArgumentParser:
    p = ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        default="stdlib",
        help="corpus: 'stdlib' (the .py files of this Python's standard library), a "
        "file, glob or directory of .txt/.jsonl/.json/.parquet, or a hub dataset",
    )
    g.add_argument("--text-column", default="text", help="column holding the text (json/parquet)")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="an existing tokenizer.json; default: train a byte-level BPE and cache it",
    )
    g.add_argument("--vocab-size", type=int, default=4096, help="vocabulary of a trained tokenizer")
    g.add_argument(
        "--data-mode",
        choices=["pack", "pad"],
        default="pack",
        help="pack: documents concatenated into full windows; pad: one document per "
        "row, clipped or right-padded (the classic recipe)",
    )
    g.add_argument(
        "--document-mask",
        action="store_true",
        help="pack mode: tokens attend only within their own document (slower on CPU)",
    )
    g.add_argument(
        "--attention",
        choices=["auto", "sdpa", "flex"],
        default="auto",
        help="kernel of --document-mask: sdpa (a dense (T, T) mask; any device) or flex "
        "(FlexAttention's block-sparse mask, compiled; CUDA only). auto: flex on CUDA, else sdpa",
    )
    g.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        help="fraction of documents held out for validation",
    )
    g.add_argument("--cache-dir", default=".cache", help="tokenizer and tokenized-data cache")
    g.add_argument("--num-workers", type=int, default=1, help="DataLoader worker processes")

    g = p.add_argument_group("model and batch")
    g.add_argument(
        "--model",
        default=None,
        help="preset: tiny, small, medium, 1b, 7b, 13b, 70b (default: tiny, or --init-from's)",
    )
    g.add_argument(
        "--init-from",
        default=None,
        metavar="DIR",
        help="start from the weights of a finished run: an --out-dir holding model.pt, "
        "config.json and tokenizer.json (any train script's, or export_hf.py --from-hf's); the "
        "architecture and the tokenizer come from there",
    )
    g.add_argument("--seq-length", type=int, default=256, help="tokens per training sequence")
    g.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="global batch: sequences per optimizer step, over all devices",
    )
    g.add_argument(
        "--micro-batch-size",
        type=micro_batch_size_arg,
        default=None,
        help="sequences per device per forward pass; gradient accumulation makes up the rest of "
        "--batch-size (default: no accumulation). auto (CUDA): the largest that fits, measured",
    )

    g = p.add_argument_group("optimization")
    g.add_argument("--max-steps", type=int, default=200, help="optimizer steps to train for")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument(
        "--min-lr-ratio", type=float, default=0.1, help="the cosine schedule decays to lr * this"
    )
    g.add_argument(
        "--warmup-steps",
        type=int,
        default=20,
        help="linear warmup from lr/warmup to --lr. More than --max-steps is only warned about "
        "(a short test run with the default warmup is fine), but the lr then never reaches --lr",
    )
    g.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0: off)")
    g.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip the update of a step whose loss or gradient is NaN/inf, instead of stopping; "
        f"{NonFiniteGuard.MAX_SKIPPED_IN_A_ROW} such steps in a row still stop the run",
    )
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay of matrices")
    g.add_argument("--seed", type=int, default=1337, help="seed of weights and data order")
    g.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16", "fp16"],
        default="auto",
        help="auto: bf16 autocast on GPUs that support it, else fp32",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="torch.compile each decoder layer",
    )

    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--log-interval", type=int, default=10, help="steps between logged losses")
    g.add_argument("--eval-interval", type=int, default=50, help="steps between evaluations")
    g.add_argument(
        "--eval-batches",
        type=int,
        default=10,
        help="evaluate on the first N global batches of the validation split",
    )
    g.add_argument("--save-interval", type=int, default=100, help="steps between checkpoints")
    g.add_argument("--keep-checkpoints", type=int, default=3, help="how many checkpoints to keep")
    g.add_argument("--out-dir", default="out", help="metrics, checkpoints and the final model")
    g.add_argument(
        "--resume",
        default="auto",
        help="auto: continue from the latest checkpoint in --out-dir if there is "
        "one; never: start fresh; or the path of a checkpoint file",
    )
    g.add_argument(
        "--sample-tokens",
        type=int,
        default=64,
        help="tokens to generate from the trained model at the end (0: none)",
    )
    g.add_argument("--sample-prompt", default="def ", help="prompt of the final sample")

    g = p.add_argument_group("memory")
    g.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="keep only each decoder layer's input and recompute the rest in backward: less "
        "activation memory for ~1/3 more compute; the same results",
    )
    g.add_argument(
        "--plan",
        action="store_true",
        help="print memory_plan.py's per-GPU memory estimate for this run at start-up",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="check the flags and exit without running (as WORLD_SIZE processes would): "
        "run_ddp.sh does this first, because torchrun would restart a run that fails on them",
    )
    return p


def micro_batch_size_arg(value: str) -> int | str:
    """--micro-batch-size: a number, or 'auto'."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {value!r}") from None


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, devices: int) -> int:
    """Validate the flags against each other; return the gradient accumulation steps.

    `devices` is how many devices share one global batch (GPUs under DataParallel, ranks under
    DDP). Raises ValueError (through parser.error) on any inconsistency. With
    --micro-batch-size auto, args.micro_batch_size stays "auto" and the 1 returned holds only
    until auto_micro_batch_size has measured the size, and so the accumulation, on the GPU.
    """
    for name in (
        "seq_length",
        "batch_size",
        "max_steps",
        "log_interval",
        "eval_interval",
        "eval_batches",
        "save_interval",
        "vocab_size",
    ):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.lr <= 0 or args.warmup_steps < 0 or args.num_workers < 0 or args.sample_tokens < 0:
        parser.error("--lr must be positive; --warmup-steps, --num-workers, --sample-tokens >= 0")
    if args.warmup_steps > args.max_steps and int(os.environ.get("RANK", "0")) == 0:
        # Not refused: `--max-steps 10` for a quick try should not need --warmup-steps as well.
        print(
            f"warning: --warmup-steps {args.warmup_steps} is more than --max-steps "
            f"{args.max_steps}: the learning rate rises for the whole run and never reaches "
            f"--lr {args.lr}",
            file=sys.stderr,
        )
    if not 0 < args.val_fraction < 1:
        parser.error(f"--val-fraction must be between 0 and 1, got {args.val_fraction}")
    auto = args.micro_batch_size == "auto"
    if auto and not torch.cuda.is_available():
        # Nothing to measure: torch counts peak memory on GPUs only, and a CPU that runs out of
        # memory swaps or has the process killed instead of raising an error one could catch.
        parser.error(
            "--micro-batch-size auto measures GPU memory and needs a CUDA GPU; on CPU give a "
            "number, or leave the flag out (no accumulation: --batch-size / devices per forward)"
        )
    if not auto and args.micro_batch_size is not None and args.micro_batch_size <= 0:
        parser.error(f"--micro-batch-size must be positive, got {args.micro_batch_size}")
    micro = args.micro_batch_size
    if auto or micro is None:
        micro = args.batch_size // devices  # each device's share (auto: the largest candidate)
    per_step = micro * devices
    if micro == 0 or args.batch_size % per_step:
        parser.error(
            f"--batch-size {args.batch_size} must be a multiple of --micro-batch-size "
            f"({micro}) x devices ({devices}) = {per_step}, so that every optimizer step sees "
            f"exactly the global batch"
        )
    if args.keep_checkpoints < 2:
        parser.error(
            "--keep-checkpoints must be at least 2: if the newest checkpoint is damaged, resuming "
            "falls back to the one before"
        )
    # The model and the sequence length are known now: refuse them before minutes of data
    # preparation, not after.
    if args.init_from is not None:
        if args.model is not None or args.tokenizer is not None:
            parser.error(
                f"--init-from {args.init_from} brings its own architecture (config.json) and "
                f"tokenizer (tokenizer.json): leave out --model and --tokenizer"
            )
        # The weights only mean something with the tokenizer they were trained with.
        args.tokenizer = os.path.join(args.init_from, "tokenizer.json")
    else:
        args.model = args.model or "tiny"
    try:
        config = model_shape(args)
    except ValueError as e:
        parser.error(f"--model: {e}" if args.init_from is None else str(e))
    if args.seq_length > config.max_position_embeddings:
        parser.error(
            f"--seq-length {args.seq_length} exceeds the {args.model or args.init_from} model's "
            f"max_position_embeddings ({config.max_position_embeddings})"
        )
    if not auto:
        args.micro_batch_size = micro
    return args.batch_size // per_step


class TrainingError(Exception):
    """The run cannot go on (a non-finite loss, ...); nothing bad was saved."""


class Stopped(Exception):
    """A training loop stopped on a signal (StopRequest), with a checkpoint at `step`."""

    def __init__(self, step: int, signum: int):
        super().__init__(step, signum)
        self.step, self.signum = step, signum


def run(main: Callable[[], None]) -> None:
    """Call a script's main(); a known failure ends in one line on stderr, not a traceback.

    The checks in this suite raise ValueError for bad input (no data at that path, a checkpoint
    of another model, ...), exit code 2, and TrainingError when training itself fails, exit code
    1; a traceback would only bury the message. Under torchrun every rank meets the same
    failure, so only global rank 0 prints it.

    A run stopped by a signal (Stopped) ends in one line too, and exits with 128 + the signal's
    number: 130 after Ctrl-C (SIGINT), 143 after SIGTERM, what a shell reports for a process
    that signal killed. Whatever watches the run (a script, torchrun, Slurm) then sees "cut
    short, not finished": 0 would say the run is complete (model.pt written, nothing to resume)
    and 1 that it failed. A Ctrl-C that interrupts at once (before training, or a second one)
    exits with 130 as well.
    """
    is_main = int(os.environ.get("RANK", "0")) == 0
    code = 0
    try:
        stopped = None
        try:
            main()
        except Stopped as e:
            stopped = e.step, e.signum  # not e: its traceback would keep main's frames alive
        if stopped is not None:
            if dist.is_initialized():
                # Here, not in the loop: main's frames (DDP's reducer, the DataLoader workers)
                # are gone. The barrier keeps every rank until rank 0 has written its files:
                # torchrun stops the other workers when one exits with an error.
                dist.barrier()
                dist.destroy_process_group()
            if is_main:
                print(f"stopped at step {stopped[0]}, checkpoint saved; run the same command to "
                      f"resume")  # fmt: skip
            code = 128 + stopped[1]
    except (ValueError, TrainingError) as e:
        if is_main:
            print(f"error: {e}", file=sys.stderr)
        code = 2 if isinstance(e, ValueError) else 1
    except KeyboardInterrupt:
        if is_main:
            print("interrupted: stopped at once, without saving; any checkpoints in --out-dir are "
                  "intact: run the same command to resume", file=sys.stderr)  # fmt: skip
        code = 128 + signal.SIGINT
    finally:
        release_out_dir()
    if code:
        sys.exit(code)


# -------------------------------------------------------------------------------------------------
# Interruptions: Ctrl-C (SIGINT), SIGTERM (kill, a scheduler's preemption) and SIGUSR1 (the early
# warning that slurm_ddp.sbatch asks Slurm for, before the time limit)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# torchrun passes the signals it receives on to its workers, which a Ctrl-C in the terminal (or
# Slurm, which signals every process of a job step) has reached already: each worker gets the
# same signal twice, milliseconds apart. A repeat within this many seconds is that echo.
ECHO_SECONDS = 2.0


class StopRequest:
    """A STOP_SIGNALS signal stops the run cleanly: after the step in flight, with a checkpoint
    there, on every rank at the same step.

    The signal handler only notes the signal; the training loop asks agreed() after each step.
    Ranks receive a signal at slightly different moments (or only some of them do), and a rank
    that left the loop alone would leave the others waiting forever in their next collective.
    So every rank all-reduces (MAX) the signal it has received, every step, and reads the
    result one step later: all ranks see the same value after the same step, and stop there
    together. Read a step late, the result costs no wait for the GPU: its all-reduce was queued
    behind the previous step, which has finished by then.

    A second signal (other than the echo above) raises KeyboardInterrupt at once, saving or
    not: every file is written under a temporary name and renamed once complete, so what is cut
    short is never visible (the next start removes it), and the newest checkpoint is the one
    before. One process alone (train_dp.py) stops right after the step in flight.
    """

    def __init__(self, device: torch.device):
        self.signal = 0  # the signal all ranks agreed to stop on (0: none)
        self._received, self._received_at = 0, 0.0  # this process's first signal, and when
        self._distributed = dist.is_initialized() and dist.get_world_size() > 1
        self._flag = torch.zeros((), dtype=torch.int64, device=device)
        # On a GPU the result is copied to pinned host memory behind the all-reduce, and an
        # event marks that point of the stream; on CPU, gloo runs the all-reduce in its own
        # threads while the next step computes.
        self._cuda = self._flag.is_cuda
        self._result = torch.zeros((), dtype=torch.int64, pin_memory=True) if self._cuda else None
        self._event = torch.cuda.Event() if self._cuda else None
        self._wait = None  # waits for the all-reduce in flight (None: none yet)
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self._received:
            if now - self._received_at > ECHO_SECONDS:
                raise KeyboardInterrupt  # asked again: stop at once (common.run says so)
            return
        self._received, self._received_at = signum, now
        if int(os.environ.get("RANK", "0")) == 0:
            note = (
                f"\n{signal.Signals(signum).name}: stopping after this step, with a "
                f"checkpoint (the same signal again stops at once, without saving)\n"
            )
            # os.write, not print: a handler may run in the middle of a print to stderr.
            os.write(sys.stderr.fileno(), note.encode())

    def agreed(self) -> int:
        """Every rank, after every step: the signal to stop on after this step, the same on all
        ranks; 0: go on."""
        if not self._distributed:
            self.signal = self._received
            return self.signal
        if self._wait is not None:
            self._wait()  # the all-reduce issued after the previous step
            self.signal = int(self._result if self._cuda else self._flag)
            if self.signal:
                return self.signal
        self._flag.fill_(self._received)
        if self._cuda:
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)  # queued on the stream
            self._result.copy_(self._flag, non_blocking=True)
            self._event.record()
            self._wait = self._event.synchronize  # waits for the stream up to here, no further
        else:
            work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)
            self._wait = work.wait
        return 0


def ignore_stop_signals(worker_id: int) -> None:
    """A DataLoader worker ignores STOP_SIGNALS, which a terminal's Ctrl-C and Slurm (its
    warning, scancel, a preemption) send to every process of a job, workers included: the
    training process still reads batches until it stops, then ends its workers itself, through
    the DataLoader (they leave when told, or when their parent is gone). A worker killed by the
    signal instead would fail the step in flight, and the run would lose everything since its
    last checkpoint.
    """
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


# -------------------------------------------------------------------------------------------------
# Data


def build_datasets(args) -> tuple[data.PretrainingDataset, data.PretrainingDataset, object]:
    """Corpus -> tokenizer -> tokenized, cached datasets: (train, val, tokenizer).

    Under torchrun, `main_process_first` lets one process per node do the work while the others
    wait, then read what it cached: nobody tokenizes twice.
    """
    with data.main_process_first():
        corpus = data.load_corpus(args.data, args.text_column, args.cache_dir)
        train_docs, val_docs = data.split_corpus(corpus, args.val_fraction, seed=0)
        tokenizer = data.get_tokenizer(train_docs, args.vocab_size, args.cache_dir, args.tokenizer)
        pad_id = tokenizer.token_to_id(data.PAD)
        train, val = (
            data.PretrainingDataset(
                data.tokenize(docs, tokenizer), args.seq_length, args.data_mode, pad_id
            )
            for docs in (train_docs, val_docs)
        )
    return train, val, tokenizer


def steps_per_epoch(train_ds, args) -> int:
    """Optimizer steps in one pass over the training split; ValueError if not even one."""
    steps = len(train_ds) // args.batch_size
    if steps == 0:
        raise ValueError(
            f"the training split has {len(train_ds)} sequences, fewer than one --batch-size "
            f"({args.batch_size}); use more data or a smaller batch"
        )
    return steps


def step_batches(
    dataset,
    order_for_epoch: Callable[[int], list[int]],
    micro_batch_size: int,
    accumulation: int,
    steps_per_epoch: int,
    start_step: int,
    num_workers: int,
    pin_memory: bool,
) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Yield, for each optimizer step from `start_step` on, its `accumulation` micro-batches.

    `order_for_epoch(epoch)` gives the sample indices this process reads in that epoch: that is
    where single-process and distributed training differ. The position in the data is a pure
    function of the step (epoch = step // steps_per_epoch), so resuming at step s reads exactly
    what an uninterrupted run would have read, without storing anything but s.
    """
    epoch, step_in_epoch = divmod(start_step, steps_per_epoch)
    per_step = micro_batch_size * accumulation
    while True:
        order = order_for_epoch(epoch)[step_in_epoch * per_step : steps_per_epoch * per_step]
        loader = DataLoader(
            dataset,
            batch_size=micro_batch_size,
            sampler=order,
            num_workers=num_workers,
            pin_memory=pin_memory,
            drop_last=True,
            worker_init_fn=ignore_stop_signals,
        )
        batches = iter(loader)
        for _ in range(step_in_epoch, steps_per_epoch):
            yield [next(batches) for _ in range(accumulation)]
        epoch, step_in_epoch = epoch + 1, 0


# -------------------------------------------------------------------------------------------------
# Model, optimizer, schedule, precision


def model_shape(args) -> LlamaConfig:
    """The architecture this run will train, known before any data is read: --init-from's
    config.json, or the --model preset (its vocab_size is the tokenizer's later, which changes
    no check made with this). ValueError saying why if there is none."""
    if args.init_from is None:
        return LlamaConfig.from_preset(args.model)
    missing = [n for n in OUT_DIR_FILES if not os.path.isfile(os.path.join(args.init_from, n))]
    if missing:
        raise ValueError(
            f"--init-from {args.init_from}: no {', '.join(missing)} there; point it at the "
            f"--out-dir of a finished run (or of `python export_hf.py --from-hf HF_DIR OUT_DIR`)"
        )
    return load_config(args.init_from)


def build_model(args, vocab_size: int) -> tuple[LlamaForPretraining, LlamaConfig]:
    """The model to train: fresh weights from --seed, or --init-from's (in fp32, on the CPU)."""
    if args.init_from is not None:
        # generate.py's loader, so a model.pt that generates also trains (and fails the same
        # way, with the same messages, if its files do not belong together).
        model, _ = load_model(args.init_from, "cpu", torch.float32)
        return model.train(), model.config
    config = LlamaConfig.from_preset(args.model, vocab_size=vocab_size)
    torch.manual_seed(args.seed)  # the same initial weights in every process
    return LlamaForPretraining(config), config


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a model, or of a pipeline stage of train_pp.py (which keeps them in
    an nn.ModuleDict keyed by their index in the whole model)."""
    layers = model.layers
    return list(layers.values()) if isinstance(layers, torch.nn.ModuleDict) else list(layers)


def compile_layers(model: LlamaForPretraining, loss: bool = True) -> None:
    """Compile each decoder layer in place: a short compile (one layer's graph, reused), and the
    parameter names stay unchanged (no `_orig_mod.`), so checkpoints and wrappers are unaffected.

    loss: also compile model.loss (final norm, lm_head, cross-entropy), which fuses the upcast
    and log-softmax of the (B, T, vocab) logits instead of writing them out three times. Off
    under tensor parallelism, whose loss runs on vocabulary shards inside loss_parallel(), and
    in pipeline stages, whose last stage computes pipeline_loss instead.
    """
    for layer in decoder_layers(model):
        layer.compile()
    if loss:
        model.loss = torch.compile(model.loss)


def apply_activation_checkpointing(model: LlamaForPretraining) -> None:
    """Recompute each decoder layer's activations in backward instead of storing them.

    Each layer's forward runs under torch.utils.checkpoint, which keeps only the layer's inputs
    and runs the forward again when backward reaches the layer. Non-reentrant (use_reentrant=
    False) is the recommended variant: it works with DDP, FSDP and torch.compile, and it replays
    the RNG state. The forward is replaced on each instance from here, outside model.py, and
    the parameter names stay unchanged, so checkpoints and model.pt are unaffected.
    """
    for layer in decoder_layers(model):
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def build_optimizer(model, args, device_type: str) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only: decaying norm gains toward 0 only hurts."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # One fused kernel for the whole update on GPU; the multi-tensor (foreach) path elsewhere.
    fused = device_type == "cuda"
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def build_scheduler(optimizer, args) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup to --lr, then cosine decay to lr * --min-lr-ratio at --max-steps."""
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer,
        T_max=max(1, args.max_steps - args.warmup_steps),
        eta_min=args.lr * args.min_lr_ratio,
    )
    if args.warmup_steps == 0:
        return cosine
    warmup = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=1 / args.warmup_steps, total_iters=args.warmup_steps
    )
    return torch.optim.lr_scheduler.SequentialLR(
        optimizer, [warmup, cosine], milestones=[args.warmup_steps]
    )


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return "bf16" if cuda_bf16 else "fp32"
    return precision


def resolve_attention(args, device: torch.device, replicas: int = 1) -> str:
    """The kernel that runs --document-mask: "flex" or "sdpa" (--attention auto chooses).

    replicas: how many GPUs nn.DataParallel splits each batch over (train_dp.py). It splits
    every tensor argument along the batch, but a BlockMask is no tensor: each GPU would get the
    whole batch's mask, on GPU 0.
    """
    if args.attention == "auto":
        flex = args.document_mask and device.type == "cuda" and replicas == 1
        return "flex" if flex else "sdpa"
    if args.attention == "flex":
        if not args.document_mask:
            raise ValueError(
                "--attention flex runs the --document-mask; without that mask attention is plain "
                "causal and SDPA's flash kernel is already the fast path (drop --attention)"
            )
        if device.type != "cuda":
            raise ValueError(
                f"--attention flex needs a CUDA GPU: in torch {torch.__version__}, FlexAttention "
                f"has no backward pass on CPU; use --attention sdpa (or auto)"
            )
        if replicas > 1:
            raise ValueError(
                f"--attention flex cannot run under DataParallel over {replicas} GPUs (it splits "
                f"tensors over the GPUs, not a BlockMask); use train_ddp.py or --attention sdpa"
            )
    return args.attention


def autocast(device: torch.device, precision: str):
    """Mixed precision for the forward pass: matmuls in bf16/fp16, weights stay fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def build_attn_mask(x: torch.Tensor, args, tokenizer) -> torch.Tensor | None:
    """None (plain causal attention, the fast path) unless --document-mask asks for one: then a
    FlexAttention BlockMask with --attention flex, else a dense (B, 1, T, T) additive mask.

    Pad mode needs no padding mask: padding is on the right, so under causal attention a real
    token never sees a pad, and what pad positions compute is ignored by the loss
    (tests/test_model.py proves real-token logits unchanged by right padding).
    """
    if not args.document_mask:
        return None
    from masks import (
        create_causal_mask,
        create_document_block_mask,
        create_document_mask,
        document_ids,
    )

    doc_ids = document_ids(x, tokenizer.token_to_id(data.BOT))  # (B, T)
    if args.attention == "flex":  # block-sparse: the model runs flex_attention
        return create_document_block_mask(doc_ids)
    return create_causal_mask(x.size(1), x.device) + create_document_mask(doc_ids)


# -------------------------------------------------------------------------------------------------
# --micro-batch-size auto: the largest micro-batch that fits, measured on the GPU

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


def auto_micro_batch_size(
    args, model, tokenizer, optimizer, device, precision: str, devices: int, replicas: int = 1
) -> int:
    """--micro-batch-size auto: set args.micro_batch_size to the largest that fits on this GPU,
    and return the gradient accumulation steps that keep the global batch --batch-size.

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

    per_device = args.batch_size // devices
    budget = AUTO_MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory
    state = optimizer_state_to_come(optimizer)
    # train_fsdp.py keeps the full (unsharded) fp32 gradient of every sharded parameter between
    # the micro-steps of an accumulation (set_requires_gradient_sync(False)); a probe does not.
    params = [p for group in optimizer.param_groups for p in group["params"]]
    unsharded_grads = sum(4 * p.numel() for p in params if isinstance(p, DTensor))
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)  # DDP's; the others have none
    tokens = torch.Generator().manual_seed(0)  # its own generator: training's RNG is untouched

    def forward_backward(n: int) -> None:
        ids = torch.randint(tokenizer.get_vocab_size(), (n * replicas, args.seq_length + 1),
                            generator=tokens)  # fmt: skip
        x, y = ids[:, :-1].to(device), ids[:, 1:].to(device)  # (n * replicas, T) each
        with no_sync():
            with autocast(device, precision):
                loss_sum, _ = model(x, y, build_attn_mask(x, args, tokenizer))
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
    if args.compile or args.attention == "flex":
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
    args.micro_batch_size = best
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"micro-batch size auto: {best} (peak memory by size, with the optimizer state to "
            f"come: {tried}; budget {budget / 1e9:.1f} GB)"
        )
    return per_device // best


# -------------------------------------------------------------------------------------------------
# Evaluation and generation


@torch.no_grad()
def evaluate(
    model, loader, device, precision, args, tokenizer
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, number of targets) over `loader`, as tensors on `device`.

    Sums rather than a mean, so that a distributed caller can add them up over ranks and divide
    once: the validation loss is then exactly that of a single process on the same data.
    """
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=device)
    num_tokens = torch.zeros((), device=device, dtype=torch.long)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device, precision):
            batch_loss, batch_tokens = model(x, y, build_attn_mask(x, args, tokenizer))
        loss_sum += batch_loss.float().sum()  # .sum(): DataParallel returns one per replica
        num_tokens += batch_tokens.sum()
    model.train(was_training)
    return loss_sum, num_tokens


def sample_text(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """`prompt` and a short continuation of it, decoded; the same every time (seed 0).

    This is generate.py's own function with its default sampling settings, so on CPU
    `python generate.py --seed 0 --prompt ... --max-new-tokens ...` prints the same text.
    """
    return generate_text(model, tokenizer, prompt, max_new_tokens, seed=0)


# -------------------------------------------------------------------------------------------------
# Metrics


class Metrics:
    """Appends one JSON object per line to metrics.jsonl (only where `enabled`: global rank 0)."""

    def __init__(self, out_dir: str, enabled: bool, resume_step: int):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.enabled = enabled
        if enabled and os.path.exists(self.path):
            # A run killed after its last checkpoint logged steps that this run will log again
            # (one killed before its first: see start_fresh), and a kill in the middle of a
            # write can leave half a line. Keep the whole lines up to the step this run starts
            # from.
            kept = []
            with open(self.path) as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # the torn last line of a killed run
                    if record["step"] <= resume_step:
                        kept.append(json.dumps(record) + "\n")
            atomic_write_text(self.path, "".join(kept))

    def log(self, **record) -> None:
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                  for k, v in record.items()}  # fmt: skip
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def log_validation(self, step: int, val_loss: float) -> None:
        """An evaluation's record, also printed above the progress bar (where enabled)."""
        ppl = perplexity(val_loss)
        self.log(step=step, val_loss=val_loss, val_ppl=ppl)
        if self.enabled:
            tqdm.write(f"step {step}: val loss {val_loss:.4f}, perplexity {ppl:.1f}")


class NonFiniteGuard:
    """Notices the first step whose loss (or gradient norm) is NaN or infinite.

    By default the run stops at the next check, which the loop makes before it logs, evaluates
    or saves anything: the error names the step, and the last checkpoint stays the last good
    state. Between checks this costs no wait for the GPU: the step is recorded on the device.
    With --skip-nonfinite, such a step's update is skipped instead (its data counts as used);
    deciding that needs the value at every step, so each step then waits for the GPU once.
    MAX_SKIPPED_IN_A_ROW skipped steps in a row still stop the run: a run that stays broken
    (weights already damaged, a bad learning rate) would otherwise "train" on to --max-steps.
    """

    MAX_SKIPPED_IN_A_ROW = 10

    def __init__(self, device: torch.device, skip: bool):
        self.skip = skip
        self.first_bad_step = torch.zeros((), dtype=torch.long, device=device)  # 0: none yet
        self.skipped_in_a_row = 0

    def step_ok(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
        """Record step's loss and gradient norm (None: not checked); False: skip its update."""
        finite = torch.isfinite(loss)
        if grad_norm is not None:
            finite &= torch.isfinite(grad_norm)
        if self.skip:
            if bool(finite):
                self.skipped_in_a_row = 0
                return True
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row == self.MAX_SKIPPED_IN_A_ROW:
                raise TrainingError(
                    f"the loss or the gradient was NaN/infinite at {self.skipped_in_a_row} steps "
                    f"in a row ({step - self.skipped_in_a_row + 1} to {step}): the run is not "
                    f"recovering, so it stopped (--skip-nonfinite skipped their updates, so "
                    f"nothing saved holds NaN/inf). Try a lower --lr or --grad-clip."
                )
            print(f"warning: step {step} has a non-finite loss or gradient; its update is skipped",
                  file=sys.stderr)  # fmt: skip
            return False
        first = (self.first_bad_step == 0) & ~finite
        self.first_bad_step = torch.where(first, step, self.first_bad_step)
        return True

    def check(self, out_dir: str) -> None:
        if step := int(self.first_bad_step):
            raise TrainingError(
                f"the loss or the gradient became NaN/infinite at step {step}; stopped before "
                f"saving anything from that state (the checkpoints in {out_dir} are the last good "
                f"ones). Try a lower --lr, --grad-clip, or --skip-nonfinite to skip such steps."
            )


class Throughput:
    """How fast training goes: tokens/s, step time, MFU and peak GPU memory, of training steps
    alone (evaluation and saving restart the clock)."""

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
        """The figures since the last figures() or restart(), as metrics.jsonl logs them; starts
        a new interval. Only host time is measured: the caller has just waited for the GPU (its
        .item() of the loss), so the steps counted are the steps done."""
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


def bar_postfix(loss: float, lr: float, figures: dict) -> dict:
    """The progress bar's figures at a log step: loss, learning rate, tokens/s, the mean step
    time since the last log, and MFU where the GPU's peak is known (None: left out)."""
    postfix = {
        "loss": f"{loss:.3f}",
        "lr": f"{lr:.2e}",
        "tok_s": f"{figures['tokens_per_sec']:,.0f}",
        "step_ms": f"{figures['step_ms']:,.1f}",
    }
    if figures["mfu"] is not None:
        postfix["mfu"] = f"{100 * figures['mfu']:.1f}%"
    return postfix


# -------------------------------------------------------------------------------------------------
# Checkpoints and outputs. Every file is written atomically: to a temporary name in the same
# directory, flushed to disk, then renamed over the target (os.replace is atomic on POSIX), so a
# kill at any moment leaves either the old file or the new one, never half of one.

CHECKPOINT_RE = re.compile(r"step_(\d+)\.pt")  # a whole file name: step_0000100.pt
# train_fsdp.py's (and train_tp.py's, train_pp.py's): a DCP directory per step, step_0000100/
CHECKPOINT_DIR_RE = re.compile(r"step_(\d+)")
TEMP_RE = re.compile(r"\.tmp\d+$")  # what atomic_save/atomic_write_text write before renaming


def atomic_save(obj, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:
        # A full disk, say: remove the partial file (whose space is needed back); `path` is
        # untouched, so a previous file of that name stays as it was.
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, RuntimeError) and isinstance(e.__context__, OSError):
            # torch.save's zip writer reports a write that failed midway as a RuntimeError
            # ("unexpected pos") raised while closing the file: the OSError is the news.
            raise e.__context__ from e
        raise


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def list_checkpoints(out_dir: str, pattern: re.Pattern = CHECKPOINT_RE) -> list[str]:
    """Checkpoints in --out-dir, oldest first: the names in checkpoints/ that `pattern` matches
    whole, its first group being the step (train_fsdp.py's checkpoints are directories)."""
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    if not os.path.isdir(ckpt_dir):
        return []
    found = [
        (int(m.group(1)), name) for name in os.listdir(ckpt_dir) if (m := pattern.fullmatch(name))
    ]
    return [os.path.join(ckpt_dir, name) for _, name in sorted(found)]


def save_checkpoint(out_dir: str, step: int, state: dict, keep: int) -> str:
    path = os.path.join(out_dir, "checkpoints", f"step_{step:07d}.pt")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_save(state, path)
    except OSError as e:  # the disk is full, ...: say so in one line, not a traceback
        raise save_failed(path, e) from e
    for old in list_checkpoints(out_dir)[:-keep]:
        os.remove(old)
    return path


def save_failed(path: str, error: BaseException) -> TrainingError:
    """The error for a checkpoint that could not be written (its partial files are removed)."""
    reason = getattr(error, "strerror", None) or str(error).strip().splitlines()[0]
    with contextlib.suppress(OSError):  # how full the disk is (DCP's errors do not say)
        reason += f" ({shutil.disk_usage(os.path.dirname(path)).free / 1e9:.2f} GB free there)"
    return TrainingError(
        f"could not save the checkpoint {path}: {reason}. The checkpoints before it are intact: "
        f"if the disk is full, make room, then run the same command again to resume"
    )


def load_checkpoint(path: str) -> dict:
    """Load a checkpoint file; ValueError (with the reason) if it cannot be read."""
    try:
        # weights_only=True: unpickling may only rebuild tensors and plain containers, never run
        # code, so a checkpoint from someone else cannot execute anything on this machine.
        # mmap=True: tensors are paged in from the file as they are used, not read up front.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated, not a checkpoint, unsafe content: all mean "unusable"
        raise ValueError(f"cannot read checkpoint {path}: {e}") from e


# One run per --out-dir: two runs in one would mix their metrics.jsonl and overwrite each other's
# checkpoints. The process that writes files holds a lock on this file for its whole life, and
# writes into it who it is, for the message of a run it keeps out.
LOCK_FILE = ".lock"
_held_locks: dict[str, object] = {}  # out-dir -> its open lock file, in the process holding it


def lock_out_dir(out_dir: str) -> None:
    """Take --out-dir for this process, or raise ValueError naming the live run that holds it.

    A POSIX record lock (fcntl.lockf): the kernel releases it when its process ends, however it
    ends (kill -9, a crash), so a dead run never blocks the rerun. Not flock(): a forked child
    shares its parent's flock, and a DataLoader worker outliving a killed training process by
    a few seconds would keep out torchrun's restart of it; a record lock is one process's own.
    """
    path = os.path.join(out_dir, LOCK_FILE)
    if path in _held_locks:
        return
    f = open(path, "a+")  # never truncated before the lock is ours: it names the holder
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.seek(0)
        holder = f.read()
        f.close()
        if e.errno not in (errno.EACCES, errno.EAGAIN):  # a filesystem without locks
            print(f"warning: cannot lock {path} ({e.strerror}): nothing keeps a second run out "
                  f"of this --out-dir", file=sys.stderr)  # fmt: skip
            return
        try:
            h = json.loads(holder)
            who = f"pid {h['pid']} on {h['host']}, started {h['started']}: {h['command']}"
        except (ValueError, KeyError, TypeError):
            who = "it is starting"
        raise ValueError(
            f"--out-dir {out_dir} is in use by another run ({who}); wait for it to end or stop "
            f"it, or choose another --out-dir"
        ) from None
    f.seek(0)
    f.truncate()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": started,
          "command": shlex.join(sys.argv)}  # fmt: skip
    f.write(json.dumps(me) + "\n")
    f.flush()
    _held_locks[path] = f


def release_out_dir() -> None:
    """At the end of the process: empty the lock file (nobody holds it), then release it.

    An empty file rather than none: deleting it could let two runs lock two different files of
    the same name. And a refused or finished run leaves the out-dir byte-identical."""
    for f in _held_locks.values():
        f.truncate(0)
        f.close()
    _held_locks.clear()


def make_out_dir(args) -> None:
    """Create --out-dir (ValueError if it cannot be written), take its lock (ValueError if a
    live run holds it) and clear a killed run's debris.

    Called by the one process that writes files. The temporary files of a process killed while
    writing never replaced a real file, so removing them loses nothing; and with the lock held,
    they cannot be a live run's.
    """
    try:
        os.makedirs(args.out_dir, exist_ok=True)
        probe = os.path.join(args.out_dir, f".write-test-{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--out-dir {args.out_dir} cannot be created or written: {e}") from e
    lock_out_dir(args.out_dir)
    for folder in (args.out_dir, os.path.join(args.out_dir, "checkpoints")):
        if os.path.isdir(folder):
            for name in os.listdir(folder):
                if TEMP_RE.search(name):
                    os.remove(os.path.join(folder, name))


def resume_never_error(out_dir: str) -> ValueError:
    return ValueError(
        f"--resume never, but {out_dir} already has checkpoints; pass --resume auto to continue "
        f"that run, or choose another --out-dir (nothing was overwritten)"
    )


def newest_readable(paths: list[str], state_file=lambda path: path) -> str | None:
    """The newest of `paths` (oldest first, as list_checkpoints gives them) whose state file
    loads. An unreadable newest one (a disk error, a crash mid-write on a filesystem without
    atomic rename) must not cost the whole run: fall back to the one before, saying so."""
    for path in reversed(paths):
        try:
            load_checkpoint(state_file(path))
            return path
        except ValueError as e:
            print(f"warning: {e}; trying an older checkpoint", file=sys.stderr)
    return None


def refuse_other_checkpoints(out_dir: str, sharded: bool) -> None:
    """ValueError if --out-dir holds the other kind of checkpoint than this script's: .pt files
    (train_dp.py, train_ddp.py) or DCP directories (train_fsdp.py, train_tp.py, train_pp.py).

    Neither kind resumes in the other's scripts, and a run that started at step 0 beside them
    would replace that run's model.pt and metrics, whatever --resume says.
    """
    if sharded:
        pattern, writers = CHECKPOINT_RE, "train_dp.py/train_ddp.py (.pt files)"
    else:
        pattern, writers = CHECKPOINT_DIR_RE, "train_fsdp.py/train_tp.py/train_pp.py (directories)"
    if list_checkpoints(out_dir, pattern):
        raise ValueError(
            f"{out_dir} holds checkpoints of {writers}, which {os.path.basename(sys.argv[0])} can "
            f"neither resume nor write beside; choose another --out-dir (a finished run's out-dir "
            f"starts any script with --init-from)"
        )


def start_fresh(out_dir: str) -> None:
    """Before a run starts at step 0 in --out-dir: a previous run's metrics.jsonl moves aside, to
    metrics.jsonl.1 (.2, ...), and one printed line says what there was.

    That is a run killed before its first checkpoint (run again, or restarted by torchrun), or
    an out-dir whose checkpoints are gone: the steps it logged are not this run's, and neither
    appending to them nor dropping them silently would be what anyone wants.
    """
    found = [n for n in ("metrics.jsonl", "model.pt") if os.path.isfile(os.path.join(out_dir, n))]
    if not found:
        return
    note = f"note: {out_dir} has {' and '.join(found)} but no checkpoint: starting at step 0"
    if "metrics.jsonl" in found:
        metrics = os.path.join(out_dir, "metrics.jsonl")
        n = 1
        while os.path.exists(f"{metrics}.{n}"):
            n += 1
        os.replace(metrics, f"{metrics}.{n}")
        note += f"; its metrics.jsonl is now metrics.jsonl.{n}"
    if "model.pt" in found:
        note += "; model.pt will be replaced when this run ends"
    print(note)


def prepare_out_dir(args) -> str | None:
    """make_out_dir, then choose the checkpoint to resume from (None: start fresh)."""
    make_out_dir(args)
    if args.resume == "never":
        if list_checkpoints(args.out_dir):
            raise resume_never_error(args.out_dir)
        resume = None
    elif args.resume != "auto":
        if not os.path.isfile(args.resume):
            raise ValueError(f"--resume: no checkpoint file at {args.resume}")
        load_checkpoint(args.resume)  # readable? (ValueError with the reason if not)
        resume = args.resume
    else:
        resume = newest_readable(list_checkpoints(args.out_dir))
    refuse_other_checkpoints(args.out_dir, sharded=False)
    if resume is None:
        start_fresh(args.out_dir)
    return resume


def rng_state() -> dict:
    """Every random generator training uses: torch's CPU generator and each CUDA device's.

    (The data order needs none: it is derived from --seed and the epoch. Python's and NumPy's
    generators are never used.)"""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# The flags that fix the data order and the learning-rate schedule: a resumed run must use the
# same, or it would not continue the run it resumes. Everything else (micro-batch size,
# precision, intervals, workers, ...) may change between restarts.
RESUME_MUST_MATCH = (
    "data", "text_column", "data_mode", "val_fraction", "seq_length", "batch_size", "seed",
    "max_steps", "lr", "min_lr_ratio", "warmup_steps",
)  # fmt: skip


def tokenizer_digest(tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def checkpoint_state(model, optimizer, scheduler, scaler, step, config, args, tokenizer) -> dict:
    """Everything a resumed run needs to continue exactly as if it had never stopped."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": rng_state(),
        "step": step,  # optimizer steps completed; also fixes the position in the data
        "config": config.to_dict(),
        "tokenizer_sha256": tokenizer_digest(tokenizer),
        "args": vars(args),
    }


def check_resumable(ckpt: dict, config, args, tokenizer) -> None:
    """ValueError if the checkpoint belongs to another run: a different model, tokenizer, data
    order or schedule (its "config", "tokenizer_sha256" and "args" against this run's)."""
    changed = [
        f"--{name.replace('_', '-')} {ckpt['args'][name]!r} (now {getattr(args, name)!r})"
        for name in RESUME_MUST_MATCH
        if ckpt["args"].get(name) != getattr(args, name)
    ]
    if changed:
        raise ValueError(
            f"the checkpoint was made with {', '.join(changed)}; resume with the same values, or "
            f"start a new run in another --out-dir"
        )
    if ckpt["config"] != config.to_dict():
        raise ValueError(
            f"the checkpoint holds a model with config {ckpt['config']}, but this run builds "
            f"{config.to_dict()}; use the same --model and tokenizer, or another --out-dir"
        )
    if ckpt["tokenizer_sha256"] != tokenizer_digest(tokenizer):
        raise ValueError(
            "the checkpoint was trained with a different tokenizer than this run's; use the "
            "same --data, --vocab-size and --tokenizer as that run, or another --out-dir"
        )


def restore_checkpoint(ckpt, model, optimizer, scheduler, scaler, config, args, tokenizer) -> int:
    """Load a checkpoint's state into fresh objects; returns the step to continue from.

    Refuses (ValueError, before changing anything) a checkpoint of another run.
    """
    check_resumable(ckpt, config, args, tokenizer)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    scaler.load_state_dict(ckpt["scaler"])
    set_rng_state(ckpt["rng"])
    return ckpt["step"]


def save_final(out_dir: str, model: LlamaForPretraining, config: LlamaConfig, tokenizer) -> None:
    """model.pt (a plain state_dict), config.json and tokenizer.json: all generate.py needs."""
    atomic_save(model.state_dict(), os.path.join(out_dir, "model.pt"))
    atomic_write_text(os.path.join(out_dir, "config.json"), json.dumps(config.to_dict(), indent=2))
    atomic_write_text(os.path.join(out_dir, "tokenizer.json"), tokenizer.to_str())


def finish_run(args, model: LlamaForPretraining, config: LlamaConfig, tokenizer, device) -> None:
    """The end of a run, on the process that writes files: model.pt, config.json and
    tokenizer.json; with --plan on a GPU, the measured peak to hold against the plan printed at
    start-up; and the sample of the trained model (--sample-tokens)."""
    save_final(args.out_dir, model, config, tokenizer)
    print(f"saved model.pt, config.json and tokenizer.json to {args.out_dir}")
    if args.plan and device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 1e9
        print(f"measured peak GPU memory on rank 0: {peak:.2f} GB (allocated by tensors)")
    if args.sample_tokens:
        text = sample_text(model.to(device), tokenizer, args.sample_prompt, args.sample_tokens)
        print(f"sample:\n{text}")


# -------------------------------------------------------------------------------------------------
# Start-up report


def describe_run(args, config, accumulation: int, devices: int, device, precision) -> str:
    tokens_per_step = args.batch_size * args.seq_length
    return "\n".join(
        [
            f"model: {args.model or 'from ' + args.init_from}, "
            f"{count_parameters(config) / 1e6:.2f}M parameters, "
            f"vocab {config.vocab_size}",
            f"device: {device} x {devices}, precision {precision}, compile {args.compile}"
            + (f", document mask by {args.attention}" if args.document_mask else ""),
            f"batch: {args.batch_size} sequences x {args.seq_length} tokens = {tokens_per_step:,} "
            f"tokens per step = micro-batch {args.micro_batch_size} x {devices} devices x "
            f"{accumulation} accumulation steps",
            f"schedule: {args.max_steps} steps = {args.max_steps * tokens_per_step / 1e6:.1f}M "
            f"tokens, lr {args.lr} (warmup {args.warmup_steps}, cosine to "
            f"{args.lr * args.min_lr_ratio:g})",
        ]
    )


# Dense bf16 peak FLOP/s (datasheet, no sparsity), by a piece of torch.cuda.get_device_name();
# the first match wins, so the specific names come before "H100".
PEAK_BF16_FLOPS = (
    ("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12),
    ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10", 125e12),
)  # fmt: skip


def flops_per_token(config: LlamaConfig, seq_length: int) -> float:
    """Training FLOPs per token, PaLM's appendix B: 6 N + 12 L H Q T.

    N counts the parameters of every matrix multiply: lm_head is in it, the input embedding
    (a table lookup, no multiply) is not; with tied embeddings the one shared matrix is counted
    once, as lm_head. 12 L H Q T is attention's QK^T and AV (H heads of width Q, context T),
    counted in full as PaLM does, although causal attention needs only half of it.
    """
    n = count_parameters(config)
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
    """Model FLOPs utilisation: the fraction of `devices` GPUs' peak that training turned into
    model FLOPs (recomputation, e.g. activation checkpointing, does not count); None without a
    known peak."""
    return None if peak is None else tokens_per_sec * flops_per_token / (peak * devices)


def peak_memory_gb(device: torch.device) -> float | None:
    """The most GPU memory tensors have held so far (GB = 1e9 bytes); None on CPU."""
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # capped: exp of an early, huge loss is just noise
