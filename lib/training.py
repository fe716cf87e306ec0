"""The parts of a training run that no parallel strategy changes: the datasets and the batches of
each step, the model, AdamW and its schedule, mixed precision, attention masks and evaluation
(the end of a run is in lib/checkpoints/). Each train_*.py keeps its own visible loop and calls
these, so neighbouring lessons differ by the concept each adds. A module that only a flag needs
is imported where that flag is handled: lib/extras/streaming.py (--streaming),
lib/extras/loader_workers.py (--num-workers), lib/extras/speed.py (--compile,
--activation-checkpointing), masks.py (--document-mask), lib/checkpoints/finished_run.py
(--init-from), lib/extras/training_tasks.py (--eval-tasks)."""

import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR
from torch.utils.data import DataLoader, Subset

import data
from lib import model_config
from lib.distributed import main_process_first, waiting_group
from model import IGNORE_INDEX, LlamaForPretraining, initial_weight, reset_buffers

# -------------------------------------------------------------------------------------------------
# Data


def build_datasets(args, tokenizer_path: str | None):
    """Corpus -> tokenizer (the one at tokenizer_path, or trained) -> tokenized datasets: (train,
    val, tokenizer), made by one process per node; val: the first --eval-batches x --batch-size
    sequences of the validation split. With --streaming, train is a streaming.Stream."""
    if args.streaming:
        from lib.extras import streaming  # only for --streaming

        stream = streaming.open_stream(args, tokenizer_path)
        train, val, tokenizer = stream, stream.val_set, stream.tokenizer
    else:
        train, val, tokenizer = _cached_datasets(args, tokenizer_path)
    steps_per_epoch(train, args)  # ValueError now if not even one batch
    same_data_on_every_rank(tokenizer)
    held_out = range(min(len(val), args.eval_batches * args.batch_size))
    task_rows = None
    if getattr(args, "eval_tasks", None):  # (the tools have no --eval-tasks)
        from lib.extras import training_tasks  # only for --eval-tasks

        task_rows = training_tasks.prepare(args, tokenizer)  # ValueError now if one does not fit
    return train, ValidationSet(val, held_out, tokenizer.token_bytes(), task_rows), tokenizer


def same_data_on_every_rank(tokenizer) -> None:
    """ValueError, on every rank, unless every rank has the tokenizer and the corpus that rank 0
    has: each node made or read its own from --data and --cache-dir, and a node that sees other
    files (another version on its disk, a cache half-copied) would train on other tokens
    without a word. Gathered on the waiting group: a node's first rank may end its tokenizing
    long after another node's."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    digests = [None] * dist.get_world_size()
    mine = (data.tokenizer_digest(tokenizer), data.corpus_digest(tokenizer))
    dist.all_gather_object(digests, mine, group=waiting_group())
    if (error := data_mismatch(digests)) is not None:
        raise ValueError(error)


def data_mismatch(digests: list[tuple[str, str | None]]) -> str | None:
    """The one-line error for the first rank whose (tokenizer, corpus) digests differ from rank
    0's; None if every rank's are the same."""
    names = ("tokenizer", "corpus")
    for rank, mine in enumerate(digests):
        differ = [f"{name} (sha256 {str(mine[i])[:12]}, rank 0's {str(digests[0][i])[:12]})"
                  for i, name in enumerate(names) if mine[i] != digests[0][i]]  # fmt: skip
        if differ:
            same = "every node must read the same --data and --tokenizer"
            where = "one shared --cache-dir, or the same files on each node's disk"
            return f"rank {rank} has another {' and '.join(differ)} than rank 0: {same} ({where})"
    return None


def _cached_datasets(args, tokenizer_path: str | None):
    with main_process_first():
        docs = data.load_corpus(args.data, args.text_column, args.cache_dir, args.txt_split)
        train_docs, val_docs = data.split_corpus(docs, args.val_fraction, seed=0)
        specials = model_config.special_tokens(args)
        vocab = model_config.vocab_size(args)
        tokenizer = data.get_tokenizer(train_docs, vocab, args.cache_dir, tokenizer_path, specials)
        tokenizer.corpus_sha256 = data.fingerprint(docs, args.cache_dir)  # for checkpoints
        # --num-proc tokenizes in parallel; packing stays in one process (data.PretrainingDataset)
        num_proc = args.num_proc or tokenizing_processes(len(docs))
        train_ids = data.tokenize(train_docs, tokenizer, num_proc)
        val_ids = data.tokenize(val_docs, tokenizer, num_proc)
        window = (args.seq_length, args.data_mode, tokenizer.pad_id)
        # An error names the split too small, and what gives it more (not "more data" for a
        # validation split that only --val-fraction made small).
        val_fraction = f"raise --val-fraction ({args.val_fraction}: its share of the documents)"
        what = ("the training split", "use more data"), ("the validation split", val_fraction)
        train, val = (
            data.PretrainingDataset(ids, *window, what=named)
            for ids, named in zip((train_ids, val_ids), what, strict=True)
        )
    if int(os.environ.get("RANK", "0")) == 0:
        train_size = (len(train_docs), data.count_tokens(train_ids), len(train))
        val_size = (len(val_docs), data.count_tokens(val_ids), len(val))
        print(describe_data(args, train_size, val_size))
    return train, val, tokenizer


# A corpus of at least this many documents is tokenized by as many processes as the node runs.
NODE_TOKENIZING_DOCS = 100_000


def tokenizing_processes(num_docs: int) -> int | None:
    """The default of --num-proc: under torchrun, each node's local rank 0 tokenizes while the
    node's other ranks wait (main_process_first), their cores idle; so a big corpus is tokenized
    by LOCAL_WORLD_SIZE processes (at most one per core), the same tokens as one process makes
    (datasets.map's num_proc). A small one, in one process: starting processes costs more."""
    node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    processes = min(node, os.cpu_count() or 1)
    return processes if processes > 1 and num_docs >= NODE_TOKENIZING_DOCS else None


def describe_data(args, train: tuple[int, int, int], val: tuple[int, int, int]) -> str:
    """The start-up summary of the data: train and val as (documents, tokens, sequences), and
    the share of an epoch (the whole batches of the split) that --max-steps covers."""

    def size(n: int) -> str:
        return f"{n:,}" if n < 1e6 else f"{n / 1e6:,.1f}M" if n < 1e9 else f"{n / 1e9:,.2f}B"

    docs, tokens, sequences = train
    epoch_steps = sequences // args.batch_size
    epochs = "more than the split has (fewer sequences than one batch)"
    if epoch_steps:
        epochs = f"{args.max_steps / epoch_steps:,.2f} epochs of {epoch_steps:,} steps"
    split = f"{sequences:,} sequences of {args.seq_length} ({args.data_mode})"
    held_out = f"{val[0]:,} validation documents = {size(val[1])} tokens -> {val[2]:,} sequences"
    run = f"{args.max_steps:,} steps x {args.batch_size} sequences"
    return (
        f"data: {docs:,} train documents = {size(tokens)} tokens -> {split}; {held_out}\n"
        f"this run: {run} = {args.max_steps * args.batch_size:,} sequences = {epochs}"
    )


def is_stream(dataset) -> bool:
    """Whether `dataset` is a streaming.Stream (--streaming); lib/extras/streaming.py is never
    imported to find out."""
    streaming = sys.modules.get("lib.extras.streaming")
    return streaming is not None and isinstance(dataset, streaming.Stream)


def steps_per_epoch(train_ds, args) -> int | None:
    """Optimizer steps in one pass over the training split (ValueError if none); a stream: None."""
    if is_stream(train_ds):
        return None
    steps = len(train_ds) // args.batch_size
    if steps == 0:
        message = f"--batch-size {args.batch_size} is more than the {len(train_ds)} sequences"
        raise ValueError(f"{message} of the training split: add data or lower --batch-size")
    return steps


def step_batches(args, settings, dataset, epoch_order, rows, device, start, shard=(0, 1)):
    """The batches of each step from start = (step, data position) on: `settings.accumulation`
    micro-batches of `rows` sequences, in the order epoch_order(epoch) gives (a resumed run reads
    what a run never stopped would). With --streaming: the streaming.StreamingBatches of `shard`
    = (dp rank, dp size). `device` decides whether the batches are pinned for the GPU."""
    start_step, data_position = start
    pin = device.type == "cuda"  # copies to the GPU from pinned memory run asynchronously
    workers = args.num_workers
    if workers is None:  # the default of --num-workers: none on a CPU, one on a GPU
        workers = 1 if pin else 0
    if is_stream(dataset):
        from lib.extras import streaming

        state = streaming.own_position(data_position, *shard) if start_step > 0 else None
        return streaming.StreamingBatches(
            dataset, rows, settings.accumulation, *shard, state=state, read_ahead=workers
        )
    steps = steps_per_epoch(dataset, args)
    return batches_from(
        dataset, epoch_order, rows, settings.accumulation, steps, start_step, workers, pin
    )


def to_device(micro_batches: list, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """A step's micro-batches on the device, copied asynchronously (from pinned memory)."""
    return [tuple(t.to(device, non_blocking=True) for t in batch) for batch in micro_batches]


def batches_from(
    dataset, epoch_order, rows, accumulation, steps_per_epoch, start_step, workers=0, pin=False
) -> Iterator[list]:
    """step_batches over a cached dataset: each step's `accumulation` micro-batches of `rows`
    sequences, in order, read by `workers` processes (0: by this one), pinned if `pin`."""
    worker_init, start = None, iter
    if workers > 0:  # processes that read ahead: lib/extras/loader_workers.py starts and ends them
        from lib.extras import loader_workers

        worker_init, start = loader_workers.ignore_stop_signals, loader_workers.start
    epoch, step_in_epoch = divmod(start_step, steps_per_epoch)
    per_step = rows * accumulation
    while True:
        order = epoch_order(epoch)[step_in_epoch * per_step : steps_per_epoch * per_step]
        loader = DataLoader(
            dataset,
            batch_size=rows,
            sampler=order,
            num_workers=workers,
            pin_memory=pin,
            drop_last=True,
            worker_init_fn=worker_init,
        )
        batches = start(loader)
        for _ in range(step_in_epoch, steps_per_epoch):
            yield [next(batches) for _ in range(accumulation)]
        epoch, step_in_epoch = epoch + 1, 0


def data_positions(batches) -> list[dict] | None:
    """What a checkpoint saves of the position in the data: None for a cached dataset (the step
    is its position); for a stream, streaming.data_positions, a collective under torchrun."""
    streaming = sys.modules.get("lib.extras.streaming")  # loaded for --streaming alone
    if streaming is None or not isinstance(batches, streaming.StreamingBatches):
        return None
    return streaming.data_positions(batches)


# -------------------------------------------------------------------------------------------------
# Model, optimizer, schedule, precision, attention masks


def build_model(args, preset: str | None, vocab_size: int):
    """(model, config) to train, on the meta device: the preset shaped by the flags, or the model
    of --init-from. A lesson then gives it storage (to_empty; its part only) and values
    (init_weights)."""
    if getattr(args, "init_from", None) is not None:  # (the tools have no --init-from)
        config = model_config.model_shape(args)  # its config.json (checked with the flags)
    else:
        config = model_config.preset_config(args, preset, vocab_size)
    with torch.device("meta"):
        model = LlamaForPretraining(config)
    return model, config


def is_dtensor(t) -> bool:
    """isinstance(t, DTensor), without importing torch.distributed.tensor (1.3 s) where none is."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


@torch.no_grad()
def init_weights(model: torch.nn.Module, config, args, device) -> None:
    """The initial values (and buffers) of a model built on the meta device and given storage
    (whole, sharded or a stage): each parameter drawn whole (--seed and its name) or read from
    the model.pt of --init-from (memory-mapped: each rank reads and moves to its device only its
    own slice). This rank keeps its slice: the weights are those of one process, however the
    model is split."""
    reset_buffers(model, config)
    source = None
    if getattr(args, "init_from", None) is not None:
        from lib.checkpoints.finished_run import open_weights  # only for --init-from

        source, *_ = open_weights(args.init_from)
    for name, param in model.named_parameters():
        if source is not None:
            local = param.to_local() if is_dtensor(param) else param
            local.copy_(own_slice(source[name], param).to(device))
            continue
        full = initial_weight(config, name, param.shape, args.seed, device)
        if is_dtensor(param):  # this rank's slice: as the DTensor holds it, no traffic
            from torch.distributed.tensor import distribute_tensor  # (see is_dtensor)

            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(full.to_local())
        else:
            param.copy_(full)


def own_slice(full: torch.Tensor, param) -> torch.Tensor:
    """The part of `full` (a whole tensor, memory-mapped on the CPU) that `param` holds on this
    rank: all of it for a plain tensor; for a DTensor, the block at the offsets of its local
    shard, as DCP reads it (DTensor.__create_chunk_list__; FSDP's shards of TP's shards are one
    block too). A view: nothing is read until it is copied, and then only its own pages.
    (distribute_tensor would first move the whole tensor to the mesh's device.)"""
    if not is_dtensor(param):
        return full
    [chunk] = param.__create_chunk_list__()  # one local shard per rank
    return full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))]


def prepare_layers(model: LlamaForPretraining, args, loss: bool = True) -> None:
    """--activation-checkpointing and --compile, applied to each decoder layer in place (the
    parameter names unchanged) by lib/extras/speed.py, which only these flags import; with loss,
    --compile compiles model.loss too."""
    if args.activation_checkpointing or args.compile:
        from lib.extras import speed

        if args.compile:  # first: the checkpoint then recomputes the compiled forward
            speed.compile_layers(model, loss)
        if args.activation_checkpointing:
            speed.apply_activation_checkpointing(model)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a model (an nn.ModuleList), or of a pipeline stage (an nn.ModuleDict
    keyed by the layer's index in the whole model): children() reads both in order."""
    return list(model.layers.children())


def build_optimizer(model, args, device_type: str) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only: decaying norm gains toward 0 only hurts. With
    --optimizer muon, the decoder's matrices take Muon's step instead (lib/extras/muon.py)."""
    optimizer, named, hidden, extra = torch.optim.AdamW, list(model.named_parameters()), [], {}
    if getattr(args, "optimizer", "adamw") == "muon":  # (the tools have no --optimizer)
        from lib.extras import muon

        optimizer, hidden = muon.MuonWithAdamW, [p for n, p in named if muon.is_hidden_matrix(n, p)]
        extra = {"replicated_over": muon.replica_group(hidden)}  # DDP's ranks split the work
    rest = [p for _, p in named if not any(p is h for h in hidden)]
    matrices = [p for p in rest if p.dim() >= 2]  # decayed
    vectors = [p for p in rest if p.dim() < 2]  # the norm gains: never decayed
    decay = args.weight_decay
    groups = [{"params": matrices, "weight_decay": decay}, {"params": vectors, "weight_decay": 0.0}]
    if hidden:  # the group of Muon: its own lr, and the decay of the matrices
        # First: ZeRO-1's ZeroRedundancyOptimizer shares the groups out in order, each parameter
        # to the rank with the fewest elements so far. Shared out before the embedding and
        # lm_head, the hidden matrices spread their Newton-Schulz work evenly over the ranks
        # (docs/optimizers.md); after them, a rank given lm_head got none.
        orthogonalised = {"params": hidden, "muon": True, "lr": args.muon_lr}
        groups = [{**orthogonalised, "weight_decay": decay}, *groups]
    # One fused kernel per parameter, on a GPU and a CPU alike (a CPU has no multi-tensor path:
    # unfused, ~10 operations per parameter in Python, ~3 ms of a 35 ms step at nanoGPT's shape).
    fused = device_type in ("cuda", "cpu")
    return optimizer(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused, **extra)


def build_scheduler(optimizer, args) -> LRScheduler:
    """Linear warmup to --lr, then cosine decay to lr * --min-lr-ratio at --max-steps."""
    decay_steps = max(1, args.max_steps - args.warmup_steps)
    cosine = CosineAnnealingLR(optimizer, T_max=decay_steps, eta_min=args.lr * args.min_lr_ratio)
    if args.warmup_steps == 0:
        return cosine
    warmup = LinearLR(optimizer, start_factor=1 / args.warmup_steps, total_iters=args.warmup_steps)
    return SequentialLR(optimizer, [warmup, cosine], milestones=[args.warmup_steps])


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return "bf16" if cuda_bf16 else "fp32"
    return precision


def autocast(device: torch.device, precision: str):
    """Mixed precision for the forward pass: matmuls in bf16/fp16, weights stay fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]  # (KeyError: a bug)
    return torch.autocast(device.type, dtype=dtype)


def attention_masks(args, settings, tokenizer) -> Callable[[torch.Tensor], object]:
    """mask(x) for a batch of tokens x (B, T): None (plain causal attention, the fast path)
    unless --document-mask asks for the document mask of masks.py, imported only then. Pad mode
    needs no padding mask: padding is on the right, so under causal attention no real token
    sees it."""
    if not args.document_mask:
        return lambda x: None
    import masks

    return masks.document_masks(tokenizer.bot_id, settings.attention)


# -------------------------------------------------------------------------------------------------
# Evaluation and the end of a run


class ValidationSet(Subset):
    """The validation sequences, and the bytes of text each token id stands for
    (DocumentTokenizer.token_bytes in data.py): what bits per byte divides by; with
    --eval-tasks, the rows of its tasks too (lib/extras/training_tasks.py's TaskRows)."""

    def __init__(self, dataset, indices, token_bytes: torch.Tensor, task_rows=None):
        super().__init__(dataset, indices)
        self.token_bytes, self.task_rows = token_bytes, task_rows


class ValidationShard:
    """This rank's share of the validation set (every `ranks`-th sample from `rank` on) on
    `device`, in batches of `rows`, as many on every rank (a sharded forward needs them all): a
    short one topped up with padding rows (IGNORE_INDEX: nothing to the sums), one shape."""

    def __init__(self, val_set, rank: int, ranks: int, rows: int, device=None):
        self.shard = Subset(val_set, range(rank, len(val_set), ranks))
        self.rows, self.device = rows, device or torch.device("cpu")
        self.num_batches = math.ceil(math.ceil(len(val_set) / ranks) / rows)  # rank 0's count
        self.seq_len = val_set[0][0].size(0) if len(val_set) else 1
        # Every evaluation reads the whole set once: its targets stand for this much text.
        targets = torch.cat([val_set[i][1] for i in range(len(val_set))] or [torch.zeros(0)])
        counted = targets[targets != IGNORE_INDEX].long()
        text_bytes = val_set.token_bytes[counted].sum().item()
        self.bytes_per_target = text_bytes / max(1, len(counted))
        self.tasks = None  # --eval-tasks: this share of the tasks' rows, in batches of `rows`
        if getattr(val_set, "task_rows", None) is not None:
            from lib.extras.training_tasks import TaskShard

            self.tasks = TaskShard(val_set.task_rows, rank, ranks, rows, self.device)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        batches, empty = iter(DataLoader(self.shard, batch_size=self.rows)), torch.zeros(0, 0)
        for _ in range(self.num_batches):  # (a rank whose shard is shorter: batches of padding)
            x, y = next(batches, (empty.long(), empty.long()))
            shape = (self.rows - len(x), self.seq_len)  # the rows missing
            x = torch.cat([x.view(-1, self.seq_len), torch.zeros(shape, dtype=torch.long)])
            y = torch.cat([y.view(-1, self.seq_len), torch.full(shape, IGNORE_INDEX)])
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def with_task_scores(self, totals: torch.Tensor, forward) -> torch.Tensor:
        """The validation sums, then (--eval-tasks) each task row's (log-likelihood, misses) as
        forward(x, y) scores this share of them (TaskShard.score), flattened: one all_reduce
        adds up both."""
        if self.tasks is None:
            return totals
        return torch.cat([totals, self.tasks.score(forward).flatten().to(totals.dtype)])


@torch.no_grad()
def evaluate(model, loader, device, settings, attn_mask) -> torch.Tensor:
    """batch_totals over `loader`, summed on `device` in the precision of the run: one all_reduce
    then adds the shares of the ranks, divided once, for the loss of one process. attn_mask(x) is
    the third argument of the model (attention_masks, or the document ids of train_cp.py).
    With --eval-tasks, each task row's (log-likelihood, misses) after the three sums."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:  # (on the device)
        with autocast(device, settings.precision):
            loss_sum, targets = model(x, y, attn_mask(x))  # (under CP, this rank's slice)
        # .sum(): under DataParallel, the model returns one sum per GPU.
        totals += batch_totals(loss_sum.sum(), targets.sum(), loader)

    def score_rows(x, y):  # --eval-tasks: the same forward, each row's sums (model.row_scores)
        with autocast(device, settings.precision):
            return model(x, y, attn_mask(x), scores=True)

    totals = loader.with_task_scores(totals, score_rows)
    model.train(was_training)
    return totals


def batch_totals(loss_sum: torch.Tensor, targets: torch.Tensor, loader) -> torch.Tensor:
    """(summed loss, targets, bytes of text they stand for) of a validation batch in float64; the
    bytes at the average of the whole set, so that one evaluation sums to the text of the set."""
    targets = targets.double()
    return torch.stack([loss_sum.double(), targets, targets * loader.bytes_per_target])
