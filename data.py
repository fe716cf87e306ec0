"""Data pipeline: raw text -> tokens -> (x, y) training examples.

The flow, the first two steps in corpus.py and the rest top to bottom of this file:

    load_corpus(spec)            a `datasets.Dataset` with one "text" column, one row per document:
                                 the Python stdlib's .py files, local .txt/.jsonl/.json/.parquet
                                 files (.txt split into documents by paragraph, line or file),
                                 or a Hugging Face hub dataset.
    split_corpus(ds)             deterministic document-level train/validation split.
    get_tokenizer(train)         byte-level BPE trained on the training split, with [PAD],
                                 [BOT], [EOT] = ids 0, 1, 2; or any given tokenizer.json, its
                                 begin/end-of-document and padding tokens found by convention.
    tokenize(ds, tokenizer)      one "input_ids" row per document: BOT ids... EOT.
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
import json
import os
import time

import datasets
import numpy as np
import pyarrow.compute
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from corpus import TXT_SPLITS, hash_texts, load_corpus, split_corpus, writable_cache_dir
from model import IGNORE_INDEX  # the target value the loss skips: one definition, in model.py

PAD, BOT, EOT = "[PAD]", "[BOT]", "[EOT]"
SPECIAL_TOKENS = [PAD, BOT, EOT]  # trained first, so their ids are 0, 1, 2 in every tokenizer

# How the three tokens the pipeline needs are found in a tokenizer.json made elsewhere, when
# neither the flags (--bot-token, ...) nor a tokenizer_config.json beside it name them: the first
# of these the vocabulary has. This suite's own names come first; then Llama 3, Llama 2/Mistral,
# Gemma, and GPT-2/Qwen (one token, <|endoftext|>, both begins and ends documents). Without a
# padding token, pad mode pads with the end token: padded targets are ignored by the loss, and
# padding sits right of the text, where causal attention never lets a real token see it.
CONVENTIONS = {
    "bot": ("[BOT]", "<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>"),
    "eot": ("[EOT]", "<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"),
    "pad": ("[PAD]", "<pad>", "<|pad|>", "<|finetune_right_pad_id|>", "<|padding|>"),
}
# Hugging Face's names for them, in tokenizer_config.json (which every run's out-dir holds too).
HF_NAMES = {"bot": "bos_token", "eot": "eos_token", "pad": "pad_token"}

# The tokenizer trains on at most this many characters of the training split. The whole stdlib
# (~31M characters) trains in about 4 s on 2 CPU cores, so it fits entirely; the cap only bounds
# time and memory for large hub corpora, where more text barely changes a BPE vocabulary.
TOKENIZER_MAX_CHARS = 50_000_000

# Packing cuts windows inside each map() batch of this many documents (see PretrainingDataset).
PACK_BATCH_DOCS = 1000
# tokenize() encodes this many documents per map() batch: small enough that its progress bar
# (which counts documents, but moves once per batch) moves, large enough for encode_batch to keep
# every core busy. The tokens do not depend on it, nor on --num-proc.
TOKENIZE_BATCH_DOCS = 64


# -----------------------------------------------------------------------------
# Tokenizer


def get_tokenizer(
    train_texts: datasets.Dataset,
    vocab_size: int = 4096,
    cache_dir: str = ".cache",
    path: str | None = None,
    specials: dict[str, str | None] | None = None,
) -> "DocumentTokenizer":
    """Load the tokenizer at `path`, or train a byte-level BPE on train_texts (cached on disk).

    specials: {"bot": ..., "eot": ..., "pad": ...} tokens named by the flags for a loaded
    tokenizer (see load_tokenizer; None or missing keys: found there). The cache key hashes
    vocab_size and the exact training texts, so a changed corpus retrains and a rerun on the same
    corpus loads <cache_dir>/tokenizers/<key>/tokenizer.json instead.
    """
    if path is not None:
        return load_tokenizer(path, specials)
    if any((specials or {}).values()):
        raise ValueError(
            "--bot-token, --eot-token and --pad-token name tokens of a given --tokenizer; a "
            "trained tokenizer has its own: [BOT], [EOT], [PAD]"
        )
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be at least 259 (256 bytes + 3 specials), got {vocab_size}"
        )
    texts = _tokenizer_training_texts(train_texts)
    cached = os.path.join(cache_dir, "tokenizers", _tokenizer_key(vocab_size, texts))
    cached_file = os.path.join(cached, "tokenizer.json")
    if not os.path.exists(cached_file):
        writable_cache_dir(cache_dir, "tokenizers")  # before training, not after: ValueError
        tokenizer = _train_tokenizer(texts, vocab_size)
        os.makedirs(cached, exist_ok=True)
        # Write then rename: os.replace is atomic, so a killed process (or two nodes sharing
        # the cache and training at once) never leaves a half-written tokenizer.json.
        tmp = f"{cached_file}.{os.getpid()}.tmp"
        tokenizer.save(tmp)
        os.replace(tmp, cached_file)
    return load_tokenizer(cached_file)


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
    hash_texts(key, texts)  # each text length-prefixed (as corpus.fingerprint hashes them)
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


class DocumentTokenizer:
    """A tokenizers.Tokenizer and the three tokens the pipeline builds documents with: every
    document is encoded as `bot_id ids... eot_id` (tokenize), pad mode pads with `pad_id`, the
    document mask starts a document at each bot_id, and generation starts with bot_id and stops
    at eot_id. `specials` names them: {"bot": "[BOT]", "eot": "[EOT]", "pad": "[PAD]"} for this
    suite's tokenizers, whatever load_tokenizer found for another one.

    Text is always encoded without the tokenizer's post-processor (add_special_tokens=False):
    a Llama tokenizer.json adds <|begin_of_text|> itself, and it would come twice. And a literal
    special token in a text ("[BOT]", "<|endoftext|>") is tokenized as text, never as the
    special id: only the pipeline marks where documents begin and end.

    corpus_sha256: the fingerprint of the documents a training run encodes with it
    (corpus.fingerprint, set by training.build_datasets; corpus.stream_fingerprint, set by
    streaming.open_stream), None for a tokenizer loaded on its own. It travels with the
    tokenizer because every checkpoint writer and resume check already takes the tokenizer:
    checkpoints save it beside the tokenizer's digest, and a resume compares both.
    """

    corpus_sha256: str | None = None

    def __init__(self, tokenizer: Tokenizer, specials: dict[str, str]):
        self.tokenizer = tokenizer
        self.specials = dict(specials)
        self.bot_id, self.eot_id, self.pad_id = (
            tokenizer.token_to_id(specials[role]) for role in ("bot", "eot", "pad")
        )
        # Not saved in tokenizer.json, so set on every load (and again after pickling).
        tokenizer.encode_special_tokens = True

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)  # without the special tokens: no [BOT], [EOT]

    def get_vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def to_str(self) -> str:
        """The tokenizer.json to write (the roles go to tokenizer_config.json: config())."""
        return self.tokenizer.to_str()

    def config(self) -> dict[str, str]:
        """tokenizer_config.json's entries for the roles, as Hugging Face names them."""
        return {HF_NAMES[role]: token for role, token in self.specials.items()}


def load_tokenizer(path: str, specials: dict[str, str | None] | None = None) -> DocumentTokenizer:
    """A tokenizer.json (this suite's, or any Hugging Face one) and its special tokens; ValueError
    saying why if it cannot be used, before any data is read.

    Each of the three tokens is, in this order: the one `specials` names (the flags
    --bot-token, --eot-token, --pad-token), the one a tokenizer_config.json beside the file names
    (bos_token, eos_token, pad_token: Hugging Face's convention, and what every run's out-dir
    holds), or the first of CONVENTIONS in the vocabulary. Padding falls back to the end token.
    """
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer file {path!r} does not exist")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for unparsable files
        raise ValueError(
            f"could not read {path!r} as a tokenizers tokenizer.json ({e}); pass a file saved "
            f"by Tokenizer.save() or save_pretrained() (every run writes one to its out-dir), "
            f"or leave out --tokenizer to train one"
        ) from e
    beside = _tokenizer_config(os.path.join(os.path.dirname(path), "tokenizer_config.json"))
    found = {}
    for role in ("bot", "eot", "pad"):
        flag = f"--{role}-token"
        named = (specials or {}).get(role)
        if named is not None and tokenizer.token_to_id(named) is None:
            raise ValueError(f"{flag} {named!r} is not a token of {path}")
        if named is None and tokenizer.token_to_id(beside.get(HF_NAMES[role]) or "") is not None:
            named = beside[HF_NAMES[role]]
        if named is None:
            known = (t for t in CONVENTIONS[role] if tokenizer.token_to_id(t) is not None)
            named = next(known, None)
        if named is None and role == "pad":
            named = found["eot"]
        if named is None:
            what = "beginning" if role == "bot" else "end"
            raise ValueError(
                f"{path} has none of the usual {what}-of-document tokens "
                f"({', '.join(CONVENTIONS[role])}): name one with {flag}"
            )
        found[role] = named
    return DocumentTokenizer(tokenizer, found)


def _tokenizer_config(path: str) -> dict[str, str]:
    """The special tokens a Hugging Face tokenizer_config.json names ({} if there is none): each
    a string, or an object whose "content" is the string; null where it names none."""
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    names = {}
    for key in HF_NAMES.values():
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            names[key] = value
    return names


# -----------------------------------------------------------------------------
# Tokenized, cached documents


def tokenize(
    ds: datasets.Dataset, tokenizer: DocumentTokenizer, num_proc: int | None = None
) -> datasets.Dataset:
    """Encode each document as BOT ids... EOT: a Dataset with one int32 "input_ids" column.

    datasets fingerprints the input, the function and the tokenizer, so calling this again with
    the same inputs loads the cached result instead of tokenizing again.
    """
    return ds.map(
        _encode_batch,
        batched=True,
        input_columns="text",
        remove_columns=ds.column_names,
        fn_kwargs={
            "tokenizer": tokenizer.tokenizer,
            "bot_id": tokenizer.bot_id,
            "eot_id": tokenizer.eot_id,
        },
        features=datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))}),
        batch_size=TOKENIZE_BATCH_DOCS,
        num_proc=num_proc,
        desc="tokenizing documents",
    )


def _encode_batch(
    texts: list[str], tokenizer: Tokenizer, bot_id: int, eot_id: int
) -> dict[str, list[list[int]]]:
    # encode_special_tokens is lost when map() pickles the tokenizer to worker processes
    # (num_proc > 1), so set it again where the encoding happens. No post-processor: the
    # document's bot_id and eot_id are added here, once.
    tokenizer.encode_special_tokens = True
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)  # parallel in Rust
    return {"input_ids": [[bot_id, *encoding.ids, eot_id] for encoding in encodings]}


def count_tokens(ds: datasets.Dataset) -> int:
    """The number of tokens in the output of tokenize(), summed in Arrow (no Python loop)."""
    table = ds.with_format("arrow")[:]  # the rows of ds, even if it is a select() of others
    return pyarrow.compute.sum(pyarrow.compute.list_value_length(table["input_ids"])).as_py() or 0


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
    dropped, and a batch's first token is never a target. map() with num_proc > 1 would split
    the data into other batches, hence other windows: training.build_datasets packs in one
    process whatever --num-proc says (cutting windows is cheap next to tokenizing), so the
    windows never depend on it. pad_id is not used.

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

        return pad_example(self.rows[i]["input_ids"], self.seq_length, self.pad_id)


def pad_example(ids: np.ndarray, seq_length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad mode's (x, y) of one document: clipped or right-padded with
    pad_id to seq_length + 1 tokens; targets at padded positions are IGNORE_INDEX."""
    ids = ids[: seq_length + 1]  # clip long documents
    tokens = torch.full((seq_length + 1,), pad_id, dtype=torch.long)
    tokens[: len(ids)] = torch.as_tensor(ids)
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
