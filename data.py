"""Data pipeline: raw text -> tokens -> (x, y) training examples.

The flow, the first two steps in corpus.py and the rest top to bottom of this file:

    load_corpus(spec)            a `datasets.Dataset` with one "text" column, one row per document:
                                 the Python stdlib's .py files, local .txt/.jsonl/.json/.parquet
                                 files (.txt split into documents by paragraph, line or file),
                                 or a Hugging Face hub dataset.
    split_corpus(ds)             deterministic document-level train/validation split.
    get_tokenizer(train)         byte-level BPE trained on the training split (or a given
                                 tokenizer.json); [PAD], [BOT], [EOT] always have ids 0, 1, 2.
    tokenize(ds, tokenizer)      one "input_ids" row per document: [BOT] ids... [EOT].
    PretrainingDataset(...)      a torch Dataset of (x, y) pairs of seq_length tokens, either
                                 packed windows over the token stream or one padded document each.

Every expensive step is cached on disk under --cache-dir, so the second run (and every rank but
the first under torchrun, see `distributed.main_process_first`) starts in seconds:
  - datasets' own cache (keyed on the input files, the function and its arguments) holds the
    loaded corpus, the tokenized documents and the packed windows;
  - trained tokenizers live in <cache_dir>/tokenizers/<sha256 of vocab size and texts>/.

Measure how fast the DataLoader delivers tokens (no training code lives here):

    python data.py --bench
    python data.py --bench --data 'corpus/*.jsonl' --data-mode pad --num-workers 2
"""

import argparse
import hashlib
import itertools
import os
import time

import datasets
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from corpus import TXT_SPLITS, load_corpus, split_corpus
from model import IGNORE_INDEX  # the target value the loss skips: one definition, in model.py

PAD, BOT, EOT = "[PAD]", "[BOT]", "[EOT]"
SPECIAL_TOKENS = [PAD, BOT, EOT]  # trained first, so their ids are 0, 1, 2 in every tokenizer

# The tokenizer trains on at most this many characters of the training split. The whole stdlib
# (~31M characters) trains in about 4 s on 2 CPU cores, so it fits entirely; the cap only bounds
# time and memory for large hub corpora, where more text barely changes a BPE vocabulary.
TOKENIZER_MAX_CHARS = 50_000_000

# Packing cuts windows inside each map() batch of this many documents (see PretrainingDataset).
PACK_BATCH_DOCS = 1000


# -----------------------------------------------------------------------------
# Tokenizer


def get_tokenizer(
    train_texts: datasets.Dataset,
    vocab_size: int = 4096,
    cache_dir: str = ".cache",
    path: str | None = None,
) -> Tokenizer:
    """Load the tokenizer at `path`, or train a byte-level BPE on train_texts (cached on disk).

    The cache key hashes vocab_size and the exact training texts, so a changed corpus retrains
    and a rerun on the same corpus loads <cache_dir>/tokenizers/<key>/tokenizer.json instead.
    """
    if path is not None:
        tokenizer = load_tokenizer(path)
    else:
        if vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"vocab_size must be at least 259 (256 bytes + 3 specials), got {vocab_size}"
            )
        texts = _tokenizer_training_texts(train_texts)
        cached = os.path.join(cache_dir, "tokenizers", _tokenizer_key(vocab_size, texts))
        cached_file = os.path.join(cached, "tokenizer.json")
        if os.path.exists(cached_file):
            tokenizer = load_tokenizer(cached_file)
        else:
            tokenizer = _train_tokenizer(texts, vocab_size)
            os.makedirs(cached, exist_ok=True)
            # Write then rename: os.replace is atomic, so a killed process (or two nodes sharing
            # the cache and training at once) never leaves a half-written tokenizer.json.
            tmp = f"{cached_file}.{os.getpid()}.tmp"
            tokenizer.save(tmp)
            os.replace(tmp, cached_file)
    # A literal "[BOT]" in a document is text, not a document boundary: tokenize it as text.
    # (This flag is not saved in tokenizer.json, so it is set after every load.)
    tokenizer.encode_special_tokens = True
    return tokenizer


def _tokenizer_training_texts(ds: datasets.Dataset) -> list[str]:
    """The documents in corpus order, cut off after TOKENIZER_MAX_CHARS characters in all."""
    texts, n_chars = [], 0
    for batch in ds.iter(batch_size=1000):
        for text in batch["text"]:
            texts.append(text[: TOKENIZER_MAX_CHARS - n_chars])
            n_chars += len(texts[-1])
            if n_chars >= TOKENIZER_MAX_CHARS:
                return texts
    return texts


def _tokenizer_key(vocab_size: int, texts: list[str]) -> str:
    key = hashlib.sha256(f"vocab_size={vocab_size}\n".encode())
    for text in texts:
        encoded = text.encode()
        # Length-prefix each text so ["ab", "c"] and ["a", "bc"] hash differently.
        key.update(len(encoded).to_bytes(8, "little"))
        key.update(encoded)
    return key.hexdigest()


def _train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # Byte-level: any string is encodable (no unknown token). No prefix space, so that
    # decode(encode(text)) == text exactly, which matters for code.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # added first, in order: ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, even unseen ones
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def load_tokenizer(path: str) -> Tokenizer:
    """Load a tokenizer.json of this suite; ValueError saying why if it is not one.

    Checks that [PAD], [BOT], [EOT] have ids 0, 1, 2, which the data pipeline and the model's
    outputs rely on, and makes a literal "[BOT]" in a text tokenize as text, never as the
    special id (this flag is not saved in tokenizer.json, so it is set after every load).
    """
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer file {path!r} does not exist")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for unparsable files
        raise ValueError(
            f"could not read {path!r} as a tokenizers tokenizer.json ({e}); pass a file saved "
            f"by Tokenizer.save() (every run writes one to its out-dir), or leave out "
            f"--tokenizer to train one"
        ) from e
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise ValueError(
                f"tokenizer {path!r} maps {token} to id {tokenizer.token_to_id(token)}, but "
                f"this suite needs {', '.join(f'{t}={i}' for i, t in enumerate(SPECIAL_TOKENS))}"
                f"; leave out --tokenizer to train a compatible one"
            )
    tokenizer.encode_special_tokens = True
    return tokenizer


# -----------------------------------------------------------------------------
# Tokenized, cached documents


def tokenize(
    ds: datasets.Dataset, tokenizer: Tokenizer, num_proc: int | None = None
) -> datasets.Dataset:
    """Encode each document as [BOT] ids... [EOT]: a Dataset with one int32 "input_ids" column.

    datasets fingerprints the input, the function and the tokenizer, so calling this again with
    the same inputs loads the cached result instead of tokenizing again.
    """
    return ds.map(
        _encode_batch,
        batched=True,
        input_columns="text",
        remove_columns=ds.column_names,
        fn_kwargs={"tokenizer": tokenizer},
        features=datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))}),
        num_proc=num_proc,
        desc="tokenizing",
    )


def _encode_batch(texts: list[str], tokenizer: Tokenizer) -> dict[str, list[list[int]]]:
    # encode_special_tokens is lost when map() pickles the tokenizer to worker processes
    # (num_proc > 1), so set it again where the encoding happens.
    tokenizer.encode_special_tokens = True
    bot_id, eot_id = tokenizer.token_to_id(BOT), tokenizer.token_to_id(EOT)
    encodings = tokenizer.encode_batch(texts)  # parallel across CPU cores inside tokenizers
    return {"input_ids": [[bot_id, *encoding.ids, eot_id] for encoding in encodings]}


# -----------------------------------------------------------------------------
# (x, y) training examples


class PretrainingDataset(torch.utils.data.Dataset):
    """(x, y) int64 pairs of shape (seq_length,) from the output of tokenize(); y is x shifted by 1.

    mode="pack" (default): the documents are concatenated into one token stream and cut into
    windows of seq_length + 1 tokens at a stride of seq_length, so consecutive windows share a
    boundary token and every token after the first is a target exactly once. No padding: a
    window spans several documents, whose boundaries are the [BOT] tokens in x. The cutting
    happens once, in a cached map() over batches of PACK_BATCH_DOCS documents, each cut on its
    own: the tail of a batch that does not fill a window (fewer than seq_length tokens) is
    dropped, and a batch's first token is never a target. map() with num_proc > 1 splits the
    data into different batches, so use the same num_proc on every rank. pad_id is not used.

    mode="pad" (the classic recipe): one document per example, clipped or right-padded with
    pad_id to seq_length + 1 tokens. Targets at padded positions are IGNORE_INDEX, so the loss
    skips them; x keeps pad_id there.
    """

    def __init__(
        self,
        dataset: datasets.Dataset,
        seq_length: int,
        mode: str = "pack",
        pad_id: int = 0,
        num_proc: int | None = None,
    ):
        if mode not in ("pack", "pad"):
            raise ValueError(f"unknown mode {mode!r}; expected 'pack' or 'pad'")
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        if "input_ids" not in dataset.column_names:
            raise ValueError(
                f"expected the output of tokenize(), got columns {dataset.column_names}"
            )
        self.seq_length, self.mode, self.pad_id = seq_length, mode, pad_id
        if mode == "pad":
            if len(dataset) == 0:
                raise ValueError("the tokenized dataset has no documents")
            # The numpy format turns each row into an int64 array, with no Python lists between.
            self.rows = dataset.with_format("numpy", columns=["input_ids"])
            return

        window = seq_length + 1
        windows = dataset.with_format("numpy").map(
            _cut_windows,
            batched=True,
            batch_size=PACK_BATCH_DOCS,
            input_columns="input_ids",
            remove_columns=dataset.column_names,
            fn_kwargs={"seq_length": seq_length},
            features=datasets.Features(
                {"window": datasets.List(datasets.Value("int32"), length=window)}
            ),
            num_proc=num_proc,
            desc=f"packing windows of {window} tokens",
        )
        if len(windows) == 0:
            n_tokens = sum(len(ids) for ids in dataset["input_ids"])
            raise ValueError(
                f"the tokenized dataset has {n_tokens} tokens, too few for one window: "
                f"pack mode needs at least {window} (seq_length + 1) tokens within one batch of "
                f"{PACK_BATCH_DOCS} documents; use more data, a smaller --seq-length or "
                f"--data-mode pad"
            )
        self.rows = windows.with_format("numpy")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mode == "pack":
            tokens = torch.from_numpy(self.rows[i]["window"]).long()  # (seq_length + 1,)
            return tokens[:-1], tokens[1:]

        ids = self.rows[i]["input_ids"][: self.seq_length + 1]  # clip long documents
        tokens = torch.full((self.seq_length + 1,), self.pad_id, dtype=torch.long)
        tokens[: len(ids)] = torch.from_numpy(ids)
        x, y = tokens[:-1], tokens[1:].clone()
        # y[j] is tokens[j + 1], which is padding from j = len(ids) - 1 on.
        y[len(ids) - 1 :] = IGNORE_INDEX
        return x, y


def _cut_windows(input_ids: list[np.ndarray], seq_length: int) -> dict[str, np.ndarray]:
    stream = np.concatenate(input_ids)  # all documents of this map() batch, back to back
    n_windows = max(0, (len(stream) - 1) // seq_length)
    # Row k holds stream[k * seq_length : k * seq_length + seq_length + 1].
    index = np.arange(n_windows)[:, None] * seq_length + np.arange(seq_length + 1)
    return {"window": stream[index]}  # (n_windows, seq_length + 1)


# -----------------------------------------------------------------------------
# Loader benchmark


def benchmark_loader(
    dataset: PretrainingDataset,
    batch_size: int,
    num_workers: int = 0,
    num_batches: int = 50,
    pin_memory: bool = False,
) -> float:
    """Tokens per second (of x) that a shuffling DataLoader delivers from `dataset`."""
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,  # random access, as in training
        num_workers=num_workers,
        pin_memory=pin_memory,  # as the training scripts on GPU: page-locked, for async copies
        persistent_workers=num_workers > 0,
    )
    batches = itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch
    next(batches)  # not timed: the first batch pays for starting the workers
    n_tokens, start = 0, time.perf_counter()
    for x, _ in itertools.islice(batches, num_batches):
        n_tokens += x.numel()
    return n_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--bench", action="store_true", help="measure DataLoader tokens/s")
    parser.add_argument(
        "--data", default="stdlib", help="corpus: stdlib, file, glob, dir, hub name"
    )
    parser.add_argument(
        "--text-column", default="text", help="text column of json/parquet/hub data"
    )
    parser.add_argument(
        "--txt-split", choices=TXT_SPLITS, default="auto", help=".txt documents: see docs/data.md"
    )
    parser.add_argument("--seq-length", type=int, default=256, help="tokens per example")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per batch")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument(
        "--data-mode", choices=["pack", "pad"], default="pack", help="example layout"
    )
    parser.add_argument("--cache-dir", default=".cache", help="where datasets and tokenizers cache")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    args = parser.parse_args()
    if not args.bench:
        parser.error("nothing to do: pass --bench")

    start = time.perf_counter()
    corpus = load_corpus(args.data, args.text_column, args.cache_dir, args.txt_split)
    train, val = split_corpus(corpus)
    print(f"corpus: {len(train)} train + {len(val)} val docs in {time.perf_counter() - start:.1f}s")
    start = time.perf_counter()
    tokenizer = get_tokenizer(train, args.vocab_size, args.cache_dir)
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens in {time.perf_counter() - start:.1f}s")
    start = time.perf_counter()
    tokens = tokenize(train, tokenizer)
    print(f"tokenize: {len(tokens)} docs in {time.perf_counter() - start:.1f}s")
    start = time.perf_counter()
    dataset = PretrainingDataset(tokens, args.seq_length, args.data_mode)
    print(f"{args.data_mode}: {len(dataset)} examples in {time.perf_counter() - start:.1f}s")
    speed = benchmark_loader(dataset, args.batch_size, args.num_workers)
    print(f"DataLoader: {speed:,.0f} tokens/s")


if __name__ == "__main__":
    main()
