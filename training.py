"""The parts of a training run that are the same under every parallel strategy.

Each train_*.py keeps its own visible loop (setup -> data -> model -> wrap -> loop -> outputs)
and calls these for what no strategy changes: the datasets and each step's batches, the model,
AdamW and its schedule, mixed precision, attention masks, evaluation and the end of a run. That
keeps the diff between neighbouring lessons to the concept each one adds. An optional feature's
module is imported where it is used: streaming.py (--streaming), masks.py (--document-mask),
generation.py (--init-from).
"""

import atexit
import contextlib
import functools
import math
import os
import sys
import weakref
from collections.abc import Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Subset

import data
import model_flags
from checkpoints import TEMP_RE, save_failed, save_final
from distributed import main_process_first
from model import IGNORE_INDEX, LlamaConfig, LlamaForPretraining, generate_text
from stopping import ignore_stop_signals

# -------------------------------------------------------------------------------------------------
# Data


def build_datasets(args, tokenizer_path: str | None):
    """Corpus -> tokenizer -> tokenized, cached datasets: (train, val, tokenizer).

    tokenizer_path: the settings' tokenizer.json (--tokenizer, --init-from's); None: one is
    trained on the training split and cached. Under torchrun, main_process_first lets one
    process per node do the work while the others wait, then read what it cached. With
    --streaming, train is a streaming.Stream: the corpus not yet read, which step_batches reads
    as it goes, each data-parallel rank its own shard.
    """
    if args.streaming:
        import streaming  # only for --streaming

        stream = streaming.open_stream(args, tokenizer_path)
        return stream, stream.val_set, stream.tokenizer
    with main_process_first():
        docs = data.load_corpus(args.data, args.text_column, args.cache_dir, args.txt_split)
        train_docs, val_docs = data.split_corpus(docs, args.val_fraction, seed=0)
        tokenizer = data.get_tokenizer(
            train_docs, model_flags.vocab_size(args), args.cache_dir, tokenizer_path,
            model_flags.special_tokens(args),
        )  # fmt: skip
        tokenizer.corpus_sha256 = data.fingerprint(docs, args.cache_dir)  # for checkpoints
        # --num-proc tokenizes in parallel; packing stays in one process, so that the windows
        # never depend on it (see data.PretrainingDataset).
        train_ids, val_ids = (
            data.tokenize(d, tokenizer, args.num_proc) for d in (train_docs, val_docs)
        )
        train, val = (
            data.PretrainingDataset(ids, args.seq_length, args.data_mode, tokenizer.pad_id)
            for ids in (train_ids, val_ids)
        )
    if int(os.environ.get("RANK", "0")) == 0:
        train_size = (len(train_docs), data.count_tokens(train_ids), len(train))
        val_size = (len(val_docs), data.count_tokens(val_ids), len(val))
        print(describe_data(args, train_size, val_size))
    return train, val, tokenizer


def describe_data(args, train: tuple[int, int, int], val: tuple[int, int, int]) -> str:
    """The start-up summary of the data: train and val as (documents, tokens, sequences), and
    the share of an epoch that --max-steps covers (an epoch: the whole batches of the split)."""

    def size(n: int) -> str:
        return f"{n:,}" if n < 1e6 else f"{n / 1e6:,.1f}M" if n < 1e9 else f"{n / 1e9:,.2f}B"

    docs, tokens, sequences = train
    epoch_steps = sequences // args.batch_size
    epochs = (
        f"{args.max_steps / epoch_steps:,.2f} epochs of {epoch_steps:,} steps"
        if epoch_steps
        else "more than the split has (fewer sequences than one batch)"
    )
    return (
        f"data: {docs:,} train documents = {size(tokens)} tokens -> {sequences:,} sequences of "
        f"{args.seq_length} ({args.data_mode}); {val[0]:,} validation documents = "
        f"{size(val[1])} tokens -> {val[2]:,} sequences\n"
        f"this run: {args.max_steps:,} steps x {args.batch_size} sequences = "
        f"{args.max_steps * args.batch_size:,} sequences = {epochs}"
    )


def is_stream(dataset) -> bool:
    """Whether `dataset` is a streaming.Stream (--streaming). One exists only once streaming.py
    was imported (for --streaming alone), so no import here."""
    streaming = sys.modules.get("streaming")
    return streaming is not None and isinstance(dataset, streaming.Stream)


def steps_per_epoch(train_ds, args) -> int | None:
    """Optimizer steps in one pass over the training split; ValueError if not even one. None
    for a stream (--streaming), whose length is not known before it is read."""
    if is_stream(train_ds):
        return None
    steps = len(train_ds) // args.batch_size
    if steps == 0:
        raise ValueError(
            f"the training split has {len(train_ds)} sequences, fewer than one --batch-size "
            f"({args.batch_size}); use more data or a smaller batch"
        )
    return steps


def step_batches(
    dataset, order_for_epoch: Callable[[int], list[int]], micro_batch_size: int, accumulation: int,
    steps_per_epoch: int, start_step: int, num_workers: int, pin_memory: bool,
    shard: tuple[int, int] = (0, 1), data_position: list[dict] | None = None,
) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:  # fmt: skip
    """An iterator over the optimizer steps from `start_step` on: each step's `accumulation`
    micro-batches.

    `order_for_epoch(epoch)` gives the sample indices this process reads in that epoch: that is
    where single-process and distributed training differ. The position in the data is a pure
    function of the step (epoch = step // steps_per_epoch), so resuming at step s reads exactly
    what an uninterrupted run would have read, without storing anything but s.

    A stream (--streaming) is read by a streaming.StreamingBatches instead: `shard` is this
    process's (data-parallel rank, number of them), `data_position` the checkpoint's
    data_positions() (None: the stream's start); the other arguments but the sizes are unused.
    """
    if num_workers is None:  # --num-workers' default (cli.py): none on a CPU, one on a GPU
        num_workers = 1 if pin_memory else 0  # pin_memory: training on a GPU
    if is_stream(dataset):
        import streaming

        state = streaming.own_position(data_position, *shard) if start_step > 0 else None
        return streaming.StreamingBatches(
            dataset, micro_batch_size, accumulation, *shard, state=state, read_ahead=num_workers
        )
    return _cached_step_batches(
        dataset, order_for_epoch, micro_batch_size, accumulation, steps_per_epoch, start_step,
        num_workers, pin_memory,
    )  # fmt: skip


def _cached_step_batches(dataset, order_for_epoch, micro_batch_size, accumulation,
                         steps_per_epoch, start_step, num_workers, pin_memory):  # fmt: skip
    epoch, step_in_epoch = divmod(start_step, steps_per_epoch)
    per_step = micro_batch_size * accumulation
    while True:
        order = order_for_epoch(epoch)[step_in_epoch * per_step : steps_per_epoch * per_step]
        loader = DataLoader(
            dataset, batch_size=micro_batch_size, sampler=order, num_workers=num_workers,
            pin_memory=pin_memory, drop_last=True, worker_init_fn=ignore_stop_signals,
        )  # fmt: skip
        batches = _start_loader(loader)
        for _ in range(step_in_epoch, steps_per_epoch):
            yield [next(batches) for _ in range(accumulation)]
        epoch, step_in_epoch = epoch + 1, 0


# The loader iterators of _start_loader whose workers may still run (a finished one drops out).
_open_loaders: weakref.WeakSet = weakref.WeakSet()
_exit_hook_registered = False


def _start_loader(loader: DataLoader) -> Iterator:
    """iter(loader); its worker processes, if any, end when this process does, however it ends.

    Its workers ignore SIGINT, SIGTERM and SIGUSR1 (stopping.ignore_stop_signals). A run that
    finishes or stops drops its loader, and the DataLoader tells its workers to leave. But a run
    that ends in an error still holds it at exit (the traceback holds main()'s frames), the
    DataLoader's own shutdown is then off (torch's exit hook), and multiprocessing's exit hook
    sends the workers SIGTERM, which they ignore, and waits for them forever (under torchrun, on
    every rank). So the first loader with workers registers _end_open_loaders to run at exit
    before those hooks (atexit runs the last registered first), to end every loader still open.
    """
    global _exit_hook_registered
    batches = iter(loader)
    if loader.num_workers > 0:
        if not _exit_hook_registered:
            atexit.register(_end_open_loaders)
            _exit_hook_registered = True
        _open_loaders.add(batches)
    return batches


def _end_open_loaders() -> None:
    for batches in list(_open_loaders):
        # The DataLoader's own shutdown (what it does once its iterator is dropped): the
        # workers are told to leave and are waited for, a few milliseconds.
        batches._shutdown_workers()
        for worker in batches._workers:
            if worker.is_alive():  # deaf even to that (stuck in a batch): no reason to wait
                worker.kill()


def data_positions(batches) -> list[dict] | None:
    """What a checkpoint saves of the position in the data: None for a cached dataset (the step
    is its position); for a stream, streaming.data_positions: a collective under torchrun."""
    streaming = sys.modules.get("streaming")  # imported for --streaming alone (is_stream)
    if streaming is None or not isinstance(batches, streaming.StreamingBatches):
        return None
    return streaming.data_positions(batches)


# -------------------------------------------------------------------------------------------------
# Model, optimizer, schedule, precision, attention masks


def build_model(args, preset: str | None, vocab_size: int):
    """(model, config) to train: the settings' preset (shaped by the flags) with fresh weights
    from --seed, or --init-from's (in fp32, on the CPU)."""
    if args.init_from is not None:
        # generate.py's loader: a model.pt that generates also trains (and fails the same way,
        # with the same messages, if its files do not belong together).
        from generation import load_model

        model, _ = load_model(args.init_from, "cpu", torch.float32)
        return model.train(), model.config
    config = model_flags.preset_config(args, preset, vocab_size)
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
    and log-softmax of the (B, T, vocab) logits; off under tensor parallelism (its loss runs on
    vocabulary shards in loss_parallel()) and in pipeline stages (pipeline.PipelineLoss)."""
    for layer in decoder_layers(model):
        layer.compile()
    if loss:
        model.loss = torch.compile(model.loss)


def apply_activation_checkpointing(model: LlamaForPretraining) -> None:
    """Recompute each decoder layer's activations in backward instead of storing them: its
    forward runs under torch.utils.checkpoint, which keeps only the layer's inputs. Non-reentrant
    (use_reentrant=False): it works with DDP, FSDP and torch.compile and replays the RNG state.
    Set on each instance from here; the parameter names, hence the checkpoints, are unchanged."""
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
    # One fused kernel per parameter for the whole update, on a GPU and a CPU alike. Not fused, a
    # CPU gets no multi-tensor path either: AdamW loops over the parameters in Python, about ten
    # operations each (~3 ms of a ~35 ms step at bench_nanogpt.py's shape).
    fused = device_type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def build_scheduler(optimizer, args) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup to --lr, then cosine decay to lr * --min-lr-ratio at --max-steps."""
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=max(1, args.max_steps - args.warmup_steps),
        eta_min=args.lr * args.min_lr_ratio,
    )  # fmt: skip
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


def resolve_attention(args, device, replicas: int = 1, context_parallel: bool = False) -> str:
    """The kernel that runs --document-mask, "flex" or "sdpa" (masks.resolve_attention, which
    refuses flex where it cannot run); "sdpa" when neither it nor --attention is given."""
    if not args.document_mask and args.attention == "auto":
        return "sdpa"
    import masks  # only for --document-mask or --attention

    return masks.resolve_attention(args, device, replicas, context_parallel)


def autocast(device: torch.device, precision: str):
    """Mixed precision for the forward pass: matmuls in bf16/fp16, weights stay fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def attention_masks(args, settings, tokenizer) -> Callable[[torch.Tensor], object]:
    """The attention mask of a batch of tokens x (B, T), as a function: mask(x) is None (plain
    causal attention, the fast path) unless --document-mask asks for masks.document_masks'.

    Pad mode needs no padding mask: padding is on the right, so under causal attention a real
    token never sees a pad, and the loss ignores what pad positions compute (tests/test_model.py
    proves real-token logits unchanged by right padding).
    """
    if not args.document_mask:
        return lambda x: None
    import masks  # only for --document-mask

    return masks.document_masks(tokenizer.bot_id, settings.attention)


# -------------------------------------------------------------------------------------------------
# Evaluation and the end of a run


class ValidationShard:
    """This rank's share of the validation set, in batches of `rows`, the same number of batches
    on every rank: iterate it (once per evaluation) like a DataLoader.

    Every `ranks`-th sample from `rank` on, so that over the ranks each sample counts once.
    Where the ranks do not divide the set, shards differ by a sample, hence by a batch; but
    every forward of a sharded model (FSDP's all-gathers, TP's all-reduces, CP's gathers, a
    pipeline's sends) needs every rank, and one that stopped early would leave the others
    waiting forever. So the last batch is topped up to `rows` rows and a shorter shard gets
    batches of padding: token 0 as input and all targets IGNORE_INDEX, which add nothing to the
    loss sum or the token count. Full rows also keep one shape for a pipeline.
    """

    def __init__(self, val_set, rank: int, ranks: int, rows: int):
        self.shard = Subset(val_set, range(rank, len(val_set), ranks))
        self.rows = rows
        self.num_batches = math.ceil(math.ceil(len(val_set) / ranks) / rows)  # rank 0's count
        self.seq_len = val_set[0][0].size(0) if len(val_set) else 1

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        done = 0
        for x, y in DataLoader(self.shard, batch_size=self.rows):
            missing = self.rows - x.size(0)
            yield (
                torch.cat([x, x.new_zeros((missing, x.size(1)))]),  # (rows, T)
                torch.cat([y, y.new_full((missing, y.size(1)), IGNORE_INDEX)]),
            )
            done += 1
        for _ in range(self.num_batches - done):  # a rank whose shard is shorter: all padding
            shape = (self.rows, self.seq_len)
            yield torch.zeros(shape, dtype=torch.long), torch.full(shape, IGNORE_INDEX)


@torch.no_grad()
def evaluate(model, loader, device, precision, attn_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, number of targets) over `loader`, as tensors on `device`; attn_mask: the
    run's attention_masks, or whatever function of x gives the model's third argument
    (train_cp.py: the document ids that context_parallel.ContextParallel takes).

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
            batch_loss, batch_tokens = model(x, y, attn_mask(x))
        loss_sum += batch_loss.float().sum()  # .sum(): DataParallel returns one per replica
        num_tokens += batch_tokens.sum()
    model.train(was_training)
    return loss_sum, num_tokens


def finish_run(args, model: LlamaForPretraining, config: LlamaConfig, tokenizer, device) -> None:
    """The end of a run, on the process that writes files: model.pt, config.json and
    tokenizer.json; with --plan on a GPU, the measured peak to hold against the plan printed at
    start-up; and a sample of the trained model (--sample-tokens)."""
    try:
        save_final(args.out_dir, model, config, tokenizer)
    except OSError as e:  # a full disk: one line, as for a checkpoint (the last is at this step)
        # A write's error names no file; model.pt is the large one (a temporary name: its own).
        path = TEMP_RE.sub("", e.filename) if e.filename else os.path.join(args.out_dir, "model.pt")
        raise save_failed(path, e, "the run's final file") from e
    print(f"saved model.pt, config.json and tokenizer.json to {args.out_dir}")
    if args.plan and device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 1e9
        print(f"measured peak GPU memory on rank 0: {peak:.2f} GB (allocated by tensors)")
    if args.sample_tokens:
        text = sample_text(model.to(device), tokenizer, args.sample_prompt, args.sample_tokens)
        print(f"sample:\n{text}")


def sample_text(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """`prompt` and a continuation, the same every time: generate.py's generate_text with seed 0,
    so `python generate.py --seed 0 --prompt ... --max-new-tokens ...` prints it on CPU too."""
    return generate_text(model, tokenizer, prompt, max_new_tokens, seed=0)
