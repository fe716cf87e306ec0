"""--streaming: the corpus read as a stream, never cached whole; each rank reads its own shard.

    stream = streaming.open_stream(args, tokenizer_path)    # .tokenizer, .val_set (held out)
    batches = streaming.StreamingBatches(stream, micro_batch_size, accumulation,
                                         dp_rank, dp_size, state=None, read_ahead=0)
    next(batches)           # one optimizer step: `accumulation` micro-batches (x, y)
    batches.state_dict()    # this rank's data position after the steps taken: save it per rank

The train scripts reach it through lib/training.py: build_datasets returns the Stream in place of
the training set, step_batches the StreamingBatches of the script's data-parallel rank, and
data_positions gathers every rank's state_dict() for the checkpoint.

--data is resolved as for the cached path (corpus.resolve_source, open_source) and read by
datasets' streaming mode, in the corpus order:
  - validation: the first documents, on every rank, enough for --eval-batches x --batch-size
    sequences (pad mode: that many documents; pack mode: counted in characters, as the tokenizer
    comes after them). Held out by content: no document with the same text is trained on.
  - the tokenizer: trained on the documents after them, up to data.TOKENIZER_MAX_CHARS.
  - training: every other document, split between the data-parallel ranks by datasets'
    split_dataset_by_node (whole files where the ranks divide their number, else every
    world_size-th document), tokenized as read and packed as data.PretrainingDataset packs: one
    token stream cut into windows of seq_length + 1 at a stride of seq_length (pad mode: a
    document per row). After its shard, a rank goes on with its next epoch: set_epoch, for
    which datasets reorders the files (the documents of a file keep their order).
The data position is exact: datasets' own state_dict after a read of READ_DOCS documents, the
tokens read but not yet trained on, and the epoch. No shuffle buffer: datasets cannot restore
one (its state_dict leaves the buffer's contents out).
"""

import contextlib
import copy
import hashlib
import os
import queue
import threading
from dataclasses import dataclass

import datasets
import torch
import torch.distributed as dist
from datasets.distributed import split_dataset_by_node
from huggingface_hub import HfFileSystem

import data
from lib import model_config
from lib.distributed import main_process_first
from lib.extras import corpus

READ_DOCS = 64  # documents per read; the saved states count in these, so keep it fixed
# Validation holds out this many characters per token it needs: BPE tokens average 2 to 5
# characters, so this is 2 to 4 times what --eval-batches uses (the rest is never trained on).
VAL_CHARS_PER_TOKEN = 8


@dataclass
class Stream:
    """What open_stream read once, the same on every rank, for StreamingBatches to go on from."""

    source: corpus.Source
    spec: str  # --data, for error messages
    documents: datasets.IterableDataset  # the whole corpus, one "text" column, not yet read
    held_out: frozenset[bytes]  # digests of the validation documents' texts
    val_documents: int  # how many there are: saved in every state, checked on resume
    val_set: data.PretrainingDataset  # (x, y) of the validation documents, for ValidationShard
    tokenizer: data.DocumentTokenizer
    seq_length: int
    mode: str  # --data-mode: "pack" or "pad"


def check_flags(parser, args) -> None:
    """parser.error for the flags that --streaming cannot go with (flags.run_settings asks)."""
    if args.num_proc is not None:
        parser.error(
            "--num-proc tokenizes a corpus cached whole; --streaming tokenizes as it reads (the "
            "tokenizer uses every core): leave out --num-proc"
        )
    if args.val_fraction != parser.get_default("val_fraction"):
        parser.error(
            "--val-fraction does not apply to --streaming, whose length is not known: validation "
            "is the stream's first documents, enough for --eval-batches x --batch-size sequences"
        )


def open_stream(args, tokenizer_path: str | None) -> Stream:
    """The validation documents (held out), the tokenizer, and the stream of the rest: the
    streaming counterpart of training.build_datasets. ValueError in one line if unusable."""
    if args.data == "stdlib" and args.txt_split == "auto":  # data.load_corpus's default corpus
        source = corpus.Source("text", data_files=data.stdlib_files(), options=data.STDLIB_OPTIONS)
    else:
        source = corpus.resolve_source(args.data, args.txt_split)
    with main_process_first():  # one process per node trains the tokenizer, the others load it
        documents = corpus.open_source(
            source, args.data, args.text_column, args.cache_dir, streaming=True
        )
        texts = (text for batch in _read(documents, source, args.data) for text in batch)
        # Validation: pad mode's rows are documents; pack mode's windows are counted in
        # characters, because the tokenizer is trained after (and without) these documents.
        need = args.eval_batches * args.batch_size
        if args.data_mode == "pack":
            need *= (args.seq_length + 1) * VAL_CHARS_PER_TOKEN
        val_texts, size = [], 0
        for text in texts:
            val_texts.append(text)
            size += 1 if args.data_mode == "pad" else len(text)
            if size >= need:
                break
        if not val_texts:
            raise ValueError(f"corpus {args.data!r} has no non-empty documents")
        held_out = frozenset(map(_digest, val_texts))
        train_texts, size = [], 0  # to train the tokenizer: the documents after, up to its budget
        for text in texts:
            if _digest(text) in held_out:
                continue
            train_texts.append(text)
            size += len(text)
            if tokenizer_path is not None or size >= data.TOKENIZER_MAX_CHARS:
                break  # (with --tokenizer, one document: there is something to train on)
        if not train_texts:
            raise ValueError(
                f"--data {args.data!r} --streaming: validation holds out its first "
                f"{len(val_texts)} documents (enough for --eval-batches {args.eval_batches} x "
                f"--batch-size {args.batch_size} sequences) and leaves none to train on; use "
                f"more data or fewer --eval-batches, or leave out --streaming"
            )
        tokenizer = data.get_tokenizer(
            _in_memory("text", train_texts),
            model_config.vocab_size(args),
            args.cache_dir,
            tokenizer_path,
            model_config.special_tokens(args),
        )
    tokenizer.corpus_sha256 = stream_fingerprint(source, val_texts)  # for checkpoints
    val_ids = _in_memory("input_ids", _encode(val_texts, tokenizer))
    val_set = data.PretrainingDataset(val_ids, args.seq_length, args.data_mode, tokenizer.pad_id)
    if int(os.environ.get("RANK", "0")) == 0:  # as training.describe_data, what is known
        sequences = args.max_steps * args.batch_size
        print(
            f"data: streaming {args.data}: {len(val_texts):,} validation documents = "
            f"{data.count_tokens(val_ids):,} tokens -> {len(val_set):,} sequences of "
            f"{args.seq_length} ({args.data_mode}), held out; training on the rest, as read\n"
            f"this run: {args.max_steps:,} steps x {args.batch_size} sequences = {sequences:,} "
            f"sequences (the stream's length, hence its epochs, is not known in advance)"
        )
    return Stream(
        source,
        args.data,
        documents,
        held_out,
        len(val_texts),
        val_set,
        tokenizer,
        args.seq_length,
        args.data_mode,
    )


def stream_fingerprint(source: corpus.Source, first_texts: list[str]) -> str:
    """A stream's fingerprint (--streaming), from what it knows without reading the whole
    corpus: its first documents (the ones held out for validation, read first anyway) and, for
    local files, how many there are and each one's size, in order. It catches a reordered,
    edited-at-the-start, grown or shrunk corpus; an edit further in that keeps every file's size
    goes unseen (hashing it would mean reading the whole stream at every start)."""
    hasher = hashlib.sha256(b"stream\n")
    data.hash_texts(hasher, first_texts)
    for path in source.data_files or []:
        with contextlib.suppress(OSError):
            hasher.update(os.path.getsize(path).to_bytes(8, "little"))
    return hasher.hexdigest()


def _read(documents: datasets.IterableDataset, source: corpus.Source, spec: str):
    """The non-empty texts of `documents`, READ_DOCS documents at a time (fewer once empty ones
    are dropped). Between two reads, documents.state_dict() is exactly after the last one."""
    batches = documents.iter(batch_size=READ_DOCS)
    while True:
        verbosity = datasets.logging.get_verbosity()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its error log: see below
        try:
            texts = next(batches)["text"]
        except StopIteration:
            return
        except Exception as e:  # a file that cannot be read: say which, and where, in one line
            raise corpus.read_error(source.data_files, source.path, spec, e) from e
        finally:
            datasets.logging.set_verbosity(verbosity)
        yield [text for text in texts if text is not None and text.strip()]


def _reader(documents: datasets.IterableDataset) -> datasets.IterableDataset:
    """A reader of `documents` with its own position: a deep copy, as datasets shares iteration
    state between shallow copies (two readers in one process, as in the tests, would mix up their
    positions). Not copied: the global cache of Hugging Face file systems that an IterableDataset
    refers to. huggingface_hub keys it by thread, so a copy made in the read-ahead thread would add
    to the dict being copied (RuntimeError: dictionary changed size during iteration)."""
    cache = HfFileSystem._cache
    return copy.deepcopy(documents, memo={id(cache): cache})


def _in_memory(column: str, values: list) -> datasets.Dataset:
    """Dataset.from_dict({column: values}), named (fingerprinted) by a sha256 of the values.
    from_dict names it by pickling the whole table with dill instead, which fails where pyarrow
    is installed outside a folder named site-packages (`pip install --target`: PicklingError,
    MonthDayNano), dill then taking pyarrow for the user's own code."""
    hasher = hashlib.sha256(f"{column}\n".encode())
    data.hash_texts(hasher, (v if isinstance(v, str) else ",".join(map(str, v)) for v in values))
    table = datasets.table.InMemoryTable.from_pydict({column: values})
    return datasets.Dataset(table, fingerprint=hasher.hexdigest())


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _encode(texts: list[str], tokenizer: data.DocumentTokenizer) -> list[list[int]]:
    """BOT ids... EOT per text: data.tokenize's own per-batch function, so both paths agree."""
    ids = data._encode_batch(texts, tokenizer.tokenizer, tokenizer.bot_id, tokenizer.eot_id)
    return ids["input_ids"]


class StreamingBatches:
    """This rank's training batches from a Stream, one optimizer step per next() (as
    training.step_batches): a list of `accumulation` micro-batches (x, y), each of shape
    (micro_batch_size, seq_length) int64. Infinite: epoch after epoch.

    rank, world_size: the DATA-parallel rank and count (ranks that share a data shard under
    TP/PP/CP pass the same rank). state: a state_dict() of this rank, to go on exactly where it
    was taken. read_ahead: 0 reads in the caller's thread; N > 0 prepares up to N steps ahead in
    one background thread (the positions stay those of the steps returned).
    """

    def __init__(
        self,
        stream: Stream,
        micro_batch_size: int,
        accumulation: int,
        rank: int,
        world_size: int,
        state: dict | None = None,
        read_ahead: int = 0,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not one of {world_size} data-parallel ranks")
        self.stream, self.rank, self.world_size = stream, rank, world_size
        self.micro_batch_size, self.accumulation = micro_batch_size, accumulation
        state = state or {"epoch": 0, "dataset": None, "pending": []}
        if state.get("world_size", world_size) != world_size or state.get("rank", rank) != rank:
            raise ValueError(
                f"this data position is rank {state['rank']} of {state['world_size']} "
                f"data-parallel ranks, not {rank} of {world_size}: resume with as many ranks"
            )
        if state.get("val_documents", stream.val_documents) != stream.val_documents:
            raise ValueError(
                f"the checkpoint's stream held out {state['val_documents']} validation "
                f"documents, this run {stream.val_documents}: resume with the same "
                f"--eval-batches and --batch-size"
            )
        self.epoch = state["epoch"]
        pending, pack = [t.long() for t in state["pending"]], stream.mode == "pack"
        # Pack mode: the token stream not yet in a window, from `offset` on. Pad: documents.
        self.tokens = torch.cat([torch.zeros(0, dtype=torch.long), *(pending if pack else [])])
        self.offset, self.rows = 0, [] if pack else pending
        self._open(state["dataset"])
        self.position = self._position()
        self.queue = None
        if read_ahead > 0:
            self.queue = queue.Queue(maxsize=read_ahead)
            threading.Thread(target=self._read_ahead, daemon=True).start()

    def _open(self, dataset_state: dict | None) -> None:
        """Start reading this rank's shard of the epoch, at dataset_state (None: its start)."""
        shard = split_dataset_by_node(_reader(self.stream.documents), self.rank, self.world_size)
        shard.set_epoch(self.epoch)
        if dataset_state is not None:
            shard.load_state_dict(dataset_state)
        self.shard, self.dataset_state = shard, dataset_state
        self.whole_epoch, self.read_any = dataset_state is None, False
        self.texts = _read(shard, self.stream.source, self.stream.spec)

    def _read_more(self) -> None:
        """Read and tokenize this rank's next documents, in the next epoch if this one ends."""
        while True:
            for texts in self.texts:
                self.dataset_state = self.shard.state_dict()  # just after the documents read
                texts = [t for t in texts if _digest(t) not in self.stream.held_out]
                if not texts:
                    continue
                self.read_any = True
                ids = [torch.tensor(i) for i in _encode(texts, self.stream.tokenizer)]
                if self.stream.mode == "pack":
                    self.tokens, self.offset = torch.cat([self.tokens[self.offset :], *ids]), 0
                else:  # clipped now: the state saves what is pending
                    self.rows += [i[: self.stream.seq_length + 1] for i in ids]
                return
            if self.whole_epoch and not self.read_any:  # or it would look for one forever
                raise ValueError(
                    f"--data {self.stream.spec!r} --streaming: data-parallel rank {self.rank} of "
                    f"{self.world_size} has no training documents; use more documents or files"
                )
            self.epoch += 1
            self._open(None)

    def _example(self) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.stream.seq_length
        if self.stream.mode == "pad":
            while not self.rows:
                self._read_more()
            return data.pad_example(self.rows.pop(0), length, self.stream.tokenizer.pad_id)
        while len(self.tokens) - self.offset < length + 1:
            self._read_more()
        # Window k is the stream's tokens k * length ... k * length + length: consecutive
        # windows share one token, and every token after the first is a target exactly once.
        window = self.tokens[self.offset : self.offset + length + 1]
        self.offset += length
        return window[:-1], window[1:]

    def _step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        step = []
        for _ in range(self.accumulation):
            pairs = [self._example() for _ in range(self.micro_batch_size)]
            step.append((torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])))
        return step

    def _position(self) -> tuple:
        # Cheap, as it is taken at every step: self.tokens is never changed in place (reads
        # make a new tensor) and self.dataset_state is a new dict each read; only rows is copied.
        return self.epoch, self.dataset_state, self.tokens, self.offset, list(self.rows)

    def _read_ahead(self) -> None:
        try:
            while True:
                self.queue.put((self._step(), self._position()))
        except Exception as e:  # handed to the training loop, which raises it
            self.queue.put((e, None))

    def __iter__(self):
        return self

    def __next__(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.queue is None:
            step, self.position = self._step(), self._position()
            return step
        step, position = self.queue.get()
        if position is None:  # the reading thread failed: this is its exception
            raise step
        self.position = position
        return step

    def state_dict(self) -> dict:
        """This rank's data position after the steps returned so far: save it for every rank,
        and pass it back as `state` to go on with exactly the batches that would have come.
        Plain data and tensors only, as a checkpoint is loaded with weights_only=True."""
        epoch, dataset_state, tokens, offset, rows = self.position
        pending = [tokens[offset:]] if self.stream.mode == "pack" else rows
        return {
            "epoch": epoch,
            "dataset": dataset_state,  # datasets' IterableDataset.state_dict() after a read
            "pending": [t.to(torch.int32, copy=True) for t in pending],  # read, not yet trained
            "rank": self.rank,
            "world_size": self.world_size,
            "val_documents": self.stream.val_documents,
        }


def data_positions(batches: StreamingBatches) -> list[dict] | None:
    """What a checkpoint saves of the position in the stream (training.data_positions): every
    data-parallel rank's StreamingBatches.state_dict(), in data-parallel rank order, on global
    rank 0 (None elsewhere). A collective under torchrun: every rank calls it."""
    state = batches.state_dict()
    if not dist.is_initialized():
        return [state]
    states = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(state, states, dst=0)  # to rank 0 alone: the rank that saves it
    if states is None:
        return None
    # Ranks that share a data shard (the tp, cp or pp ranks of one data-parallel rank) read the
    # same documents: one state per data-parallel rank.
    by_rank = {state["rank"]: state for state in states}
    return [by_rank[rank] for rank in sorted(by_rank)]


def own_position(positions: list[dict] | None, rank: int, ranks: int) -> dict:
    """This data-parallel rank's entry of a checkpoint's data_positions(); ValueError if none."""
    if positions is None:
        raise ValueError(
            "the checkpoint holds no position in the stream (it was not made with --streaming)"
        )
    if len(positions) != ranks:
        raise ValueError(
            f"the checkpoint's stream was read by {len(positions)} data-parallel ranks, this run "
            f"has {ranks}: resume --streaming with as many data-parallel ranks"
        )
    return positions[rank]
