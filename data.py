"""Data pipeline: raw text -> tokens -> (x, y) training examples, top to bottom of this file.

    load_corpus(spec)            a `datasets.Dataset` with one "text" column, one row per document:
                                 the stdlib's .py files; other --data (files, a hub dataset) is
                                 corpus.py's, imported only for them.
    split_corpus(ds)             deterministic document-level train/validation split.
    get_tokenizer(train)         byte-level BPE trained on the training split, with [PAD],
                                 [BOT], [EOT] = ids 0, 1, 2; or any given tokenizer.json, its
                                 begin/end-of-document and padding tokens found by convention.
    tokenize(ds, tokenizer)      one "input_ids" row per document: BOT ids... EOT.
    PretrainingDataset(...)      a torch Dataset of (x, y) pairs of seq_length tokens, either
                                 packed windows over the token stream or one padded document each.

Every expensive step is cached on disk under --cache-dir, so the second run (and every rank but
the first under torchrun, see `distributed.main_process_first`) starts in seconds: datasets' own
cache holds the loaded corpus, the tokenized documents and the packed windows; trained
tokenizers live in <cache_dir>/tokenizers/<sha256 of vocab size and texts>/.

fingerprint is what a checkpoint records of the data, so that a resume can tell that the
documents changed, however --data names them. No training code lives here.
"""

import contextlib
import hashlib
import json
import os
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model import IGNORE_INDEX  # the target value the loss skips: one definition, in model.py

PAD, BOT, EOT = "[PAD]", "[BOT]", "[EOT]"
SPECIAL_TOKENS = [PAD, BOT, EOT]  # trained first, so their ids are 0, 1, 2 in every tokenizer

# How the three tokens the pipeline needs are found in a tokenizer.json made elsewhere, when
# neither the flags (--bot-token, ...) nor a tokenizer_config.json beside it name them: the first
# of these the vocabulary has (this suite's; Llama 3, Llama 2/Mistral, Gemma, GPT-2/Qwen). Without
# a padding token, pad mode pads with the end token (the loss ignores padded targets).
CONVENTIONS = {
    "bot": ("[BOT]", "<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>"),
    "eot": ("[EOT]", "<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"),
    "pad": ("[PAD]", "<pad>", "<|pad|>", "<|finetune_right_pad_id|>", "<|padding|>"),
}
# Hugging Face's names for them, in tokenizer_config.json (which every run's out-dir holds too).
HF_NAMES = {"bot": "bos_token", "eot": "eos_token", "pad": "pad_token"}

# The tokenizer trains on at most this many characters of the training split: the whole stdlib
# (~31M, about 4 s on 2 CPU cores); the cap bounds time and memory for large hub corpora.
TOKENIZER_MAX_CHARS = 50_000_000

# Packing cuts windows inside each map() batch of this many documents (see PretrainingDataset).
PACK_BATCH_DOCS = 1000
# tokenize() encodes this many documents per map() batch: its progress bar moves, and
# encode_batch keeps every core busy. The tokens do not depend on it, nor on --num-proc.
TOKENIZE_BATCH_DOCS = 64


# -------------------------------------------------------------------------------------------------
# Corpus: --data read into documents (datasets' own cache under --cache-dir holds what was read)

# How .txt files become documents (--txt-split; corpus.py resolves "auto").
TXT_SPLITS = ("auto", "paragraph", "line", "file")


def load_corpus(
    spec: str = "stdlib",
    text_column: str = "text",
    cache_dir: str = ".cache",
    txt_split: str = "auto",
) -> datasets.Dataset:
    """Load documents as a Dataset with exactly one column, "text", in a deterministic order.

    spec is "stdlib" (every .py file of this Python's standard library), or what corpus.py reads:
    a file, glob or directory of .txt/.jsonl/.json/.parquet, a hub dataset NAME[:CONFIG];
    text_column and txt_split are theirs. Empty and whitespace-only documents are dropped.
    Raises ValueError on unusable input.
    """
    source = resolve_source(spec, txt_split)
    ds = open_source(source, spec, text_column, cache_dir)
    try:
        ds = ds.filter(_is_nonempty, input_columns="text", batched=True, desc="dropping empty docs")
    except UnicodeDecodeError as e:
        # datasets' json reader keeps text that is not UTF-8 as it is; reading it fails here.
        raise read_error(source, spec, e) from e
    if len(ds) == 0:
        raise ValueError(f"corpus {spec!r} has no non-empty documents")
    if source.txt_mode is not None and len(ds) == 1:  # say why: split_corpus needs 2 documents
        import corpus

        raise corpus.one_document_error(source.txt_mode, spec, txt_split)
    return ds


@dataclass(frozen=True)
class Source:
    """What --data names, resolved into the arguments of datasets.load_dataset (resolve_source),
    before anything is read (open_source)."""

    path: str  # a datasets builder ("text", "json", "parquet"), or a hub dataset's name
    config: str | None = None  # the hub dataset's config: --data NAME:CONFIG
    data_files: list[str] | None = None  # local files, sorted; None for a hub dataset
    options: dict = field(default_factory=dict)  # builder options: the text builder's sample_by
    txt_mode: str | None = None  # how .txt files became documents (see txt_split_mode)


def resolve_source(spec: str, txt_split: str = "auto") -> Source:
    """What `spec` names, checked without reading any document; ValueError saying why not."""
    if txt_split not in TXT_SPLITS:
        raise ValueError(f"--txt-split must be one of {', '.join(TXT_SPLITS)}, got {txt_split!r}")
    if spec != "stdlib" or txt_split != "auto":
        import corpus  # only for --data other than stdlib (or to refuse --txt-split for it)

        return Source(**corpus.resolve(spec, txt_split))
    # A few stdlib files are deliberately not UTF-8 (encoding tests): their undecodable bytes
    # become U+FFFD. A user's file that is not UTF-8 is refused instead (read_error).
    options = {"sample_by": "document", "encoding_errors": "replace"}
    return Source("text", data_files=_stdlib_files(), options=options)


def open_source(
    source: Source, spec: str, text_column: str, cache_dir: str, streaming: bool = False
) -> datasets.Dataset | datasets.IterableDataset:
    """datasets.load_dataset on a resolved --data: its "train" split with the text in one column,
    "text" (an IterableDataset, read as iterated, if streaming). Raises ValueError in one line."""
    kwargs = {"split": "train", "cache_dir": os.path.join(cache_dir, "datasets")}
    kwargs["streaming"] = streaming
    if not streaming:  # (a stream caches nothing of the corpus)
        writable_cache_dir(cache_dir, "datasets")
    if source.data_files is not None:
        ds = _load_files(source, spec, **kwargs)
        if source.path == "text":  # the text builder's one column is already "text"
            return ds
    import corpus  # json, parquet or a hub dataset: not the stdlib

    if source.data_files is None:
        ds = corpus.load_hub(source.path, source.config, spec, **kwargs)
    return corpus.select_text_column(ds, text_column, spec)


def _load_files(source: Source, spec: str, **kwargs) -> datasets.Dataset | datasets.IterableDataset:
    # A user's file that is not UTF-8 (a binary file, another encoding) is refused below, naming
    # it, not trained on as garbage. (A stream's errors come as it is read: streaming.py.)
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own error log: see below
    try:
        return datasets.load_dataset(
            source.path, data_files=source.data_files, **source.options, **kwargs
        )
    except Exception as e:  # datasets wraps a bad file in many exception types
        import corpus  # --cache-dir's datasets/ not writable, or which file and line is bad

        cache_error = corpus.in_cache_dir(e, os.path.dirname(kwargs["cache_dir"]))
        raise cache_error or read_error(source, spec, e) from e
    finally:
        datasets.logging.set_verbosity(verbosity)


def read_error(source: Source, spec: str, error: Exception) -> ValueError:
    """The one-line error for a corpus that failed to read: for local files, which file and line
    (corpus.read_error)."""
    import corpus

    return corpus.read_error(source.data_files, source.path, spec, error)


def _stdlib_files() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    # Third-party packages installed next to the stdlib are not part of it (and vary by machine).
    files = [
        p
        for p in root.rglob("*.py")
        if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
    ]
    return [str(p) for p in sorted(files, key=lambda p: p.relative_to(root).as_posix())]


def writable_cache_dir(cache_dir: str, sub: str) -> str:
    """cache_dir/sub, created if need be and checked by writing a file into it; ValueError
    naming --cache-dir if that cannot be done (a file in the way, no permission, a read-only
    filesystem), rather than a failure deep inside datasets that looks like one of --data."""
    path = os.path.join(cache_dir, sub)
    try:
        os.makedirs(path, exist_ok=True)
        # A name of its own (mkstemp), as the ranks of other nodes may probe a shared cache too.
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        import corpus  # the error's message

        raise corpus.cache_dir_error(cache_dir, e) from e
    return path


def _is_nonempty(texts: list[str | None]) -> list[bool]:
    return [text is not None and text.strip() != "" for text in texts]


def split_corpus(
    ds: datasets.Dataset, val_fraction: float = 0.01, seed: int = 0
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Split documents into (train, validation), the same way in every process and every run.

    Whole documents go to one side, so no validation text is ever trained on. Each side keeps
    the corpus order. The validation side has round(val_fraction * n) documents, at least 1.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    n = len(ds)
    n_val = max(1, round(val_fraction * n))
    if n - n_val < 1:
        raise ValueError(
            f"cannot split {n} document(s) into train and validation with "
            f"val_fraction={val_fraction}: need at least 2 documents and 1 left for training"
        )
    # A seeded numpy generator gives the same permutation on every machine and process.
    order = np.random.default_rng(seed).permutation(n)
    val_indices, train_indices = np.sort(order[:n_val]), np.sort(order[n_val:])
    return ds.select(train_indices), ds.select(val_indices)


def hash_texts(hasher, texts) -> None:
    """Add texts to a hashlib hash, each length-prefixed so that ["ab", "c"] and ["a", "bc"]
    differ: the one way this suite hashes documents (data.py's tokenizer cache key too)."""
    for text in texts:
        encoded = text.encode()
        hasher.update(len(encoded).to_bytes(8, "little"))
        hasher.update(encoded)


def fingerprint(ds: datasets.Dataset, cache_dir: str) -> str:
    """The sha256 of a loaded corpus's documents, in order (load_corpus's output): the same for
    the same documents however --data names them, different if any is edited, added, removed
    or moved. Checkpoints record it (checkpoints.check_same_data).

    Hashed once per version of the corpus: the digest is kept under cache_dir/fingerprints/,
    named by datasets' own fingerprint of `ds` (new whenever datasets reads the files again), so
    a start-up with the corpus cached reads one small file instead of every document.
    """
    memo = os.path.join(cache_dir, "fingerprints", f"{ds._fingerprint}.sha256")
    with contextlib.suppress(OSError):
        with open(memo) as f:
            digest = f.read().strip()
        if len(digest) == 64:
            return digest
    hasher = hashlib.sha256()
    for batch in ds.iter(batch_size=1000):
        hash_texts(hasher, batch["text"])
    digest = hasher.hexdigest()
    with contextlib.suppress(OSError):  # written then renamed: never half a digest
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        tmp = f"{memo}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(digest + "\n")
        os.replace(tmp, memo)
    return digest


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

    specials: the tokens the flags name for a loaded tokenizer (see load_tokenizer). The cache key
    hashes vocab_size and the exact training texts: a changed corpus retrains, a rerun loads
    <cache_dir>/tokenizers/<key>/tokenizer.json.
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
    hash_texts(key, texts)  # each text length-prefixed (as fingerprint hashes them)
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

    corpus_sha256: the fingerprint of the documents a training run encodes with it (fingerprint,
    or streaming.stream_fingerprint), None for a tokenizer loaded on its own: it travels with
    the tokenizer, which every checkpoint writer and resume check already takes.
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

    Each of the three tokens is, in this order: the one `specials` names (--bot-token, ...), the
    one a tokenizer_config.json beside the file names (Hugging Face's bos_token, eos_token,
    pad_token; every run's out-dir holds one), or the first of CONVENTIONS in the vocabulary.
    Padding falls back to the end token.
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
    datasets fingerprints the input, the function and the tokenizer: the same inputs again load
    the cached result instead of tokenizing again."""
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
    # encode_special_tokens is lost when map() pickles the tokenizer to --num-proc workers: set
    # it again here. No post-processor: the document's bot_id and eot_id are added here, once.
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
    own (a batch's tail that fills no window is dropped). training.build_datasets packs in one
    process whatever --num-proc says, so the windows never depend on it. pad_id is not used.

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

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A batch's samples in one read (the DataLoader calls it), ~4x faster than one each."""
        if self.mode != "pack":
            return [self[i] for i in indices]
        windows = torch.from_numpy(self.rows[indices]["window"]).long()  # (n, seq_length + 1)
        return [(tokens[:-1], tokens[1:]) for tokens in windows]

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
