"""Data pipeline: raw text -> tokens -> (x, y) training examples, top to bottom of this file.

    load_corpus(spec)         a datasets.Dataset, one "text" row per document (the stdlib's files)
    split_corpus(ds)          deterministic document-level train/validation split
    get_tokenizer(train)      byte-level BPE with [PAD], [BOT], [EOT] = ids 0, 1, 2 (or a given one)
    tokenize(ds, tokenizer)   one "input_ids" row per document: BOT ids... EOT
    PretrainingDataset(...)   (x, y) pairs: packed windows of the token stream, or padded documents

Every step is cached under --cache-dir, so a second run, and every rank but one per node, starts
in seconds. fingerprint() is what a checkpoint records of the documents."""

from __future__ import annotations  # `datasets.Dataset` in signatures, `datasets` not imported

import contextlib
import hashlib
import json
import os
import re
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lib.checkpoints import files
from model import IGNORE_INDEX  # the target value the loss skips: one definition, in model.py

if TYPE_CHECKING:  # `datasets` takes 1.7 s to import: only where documents are read (below)
    import datasets

PAD, BOT, EOT = "[PAD]", "[BOT]", "[EOT]"
SPECIAL_TOKENS = [PAD, BOT, EOT]  # trained first, so their ids are 0, 1, 2 in every tokenizer
# Hugging Face's names for the three roles, in the tokenizer_config.json every out-dir holds.
HF_NAMES = {"bot": "bos_token", "eot": "eos_token", "pad": "pad_token"}

# The tokenizer's training characters at most: the whole stdlib (~31M, ~4 s on 2 CPU cores).
TOKENIZER_MAX_CHARS = 50_000_000
PACK_BATCH_DOCS = 1000  # packing cuts windows within each map() batch of this many documents
TOKENIZE_BATCH_DOCS = 64  # documents per tokenize() batch; the tokens do not depend on it

# A few stdlib files are not UTF-8 (encoding tests): bad bytes become U+FFFD (a user's file with
# bad bytes is refused instead).
STDLIB_OPTIONS = {"sample_by": "document", "encoding_errors": "replace"}


# -------------------------------------------------------------------------------------------------
# Corpus: --data read into documents (datasets' own cache under --cache-dir holds what was read)


def load_corpus(spec="stdlib", text_column="text", cache_dir=".cache", txt_split="auto"):
    """Documents in one "text" column, in a deterministic order, empty ones dropped: the .py files
    of the stdlib, or what lib/extras/corpus.py reads for another --data (imported only then; it
    also refuses --txt-split for the stdlib). ValueError if unusable."""
    cache = writable_cache_dir(cache_dir, "datasets")
    if spec != "stdlib" or txt_split != "auto":
        from lib.extras import corpus

        return corpus.load_corpus(spec, text_column, cache_dir, txt_split, drop_empty)
    try:  # (its cached files checked first: lib/checkpoints/files.py)
        ds = files.load_cached(
            "text", data_files=stdlib_files(), split="train", cache_dir=cache, **STDLIB_OPTIONS
        )
    except Exception as e:  # datasets wraps a full disk, say, in its own errors: one line
        from lib.extras import corpus

        # No file scan ([]): the bad bytes of the stdlib are never the cause.
        raise corpus.load_error(e, cache_dir, [], "text", spec) from e
    ds = drop_empty(ds)
    if len(ds) == 0:
        raise ValueError(f"corpus {spec!r} has no non-empty documents")
    return ds


def drop_empty(ds: datasets.Dataset) -> datasets.Dataset:
    """The documents that is_nonempty keeps (cached, and checked: lib/checkpoints/files.py)."""

    def kept(fingerprint: str) -> datasets.Dataset:
        desc = "dropping empty docs"
        return ds.filter(
            is_nonempty, input_columns="text", batched=True, desc=desc, new_fingerprint=fingerprint
        )

    name = files.cache_key("kept", ds._fingerprint, is_nonempty)
    return files.cached_step(ds, name, "the documents kept", kept)


def stdlib_files() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    # Third-party packages installed next to the stdlib are not part of it (and vary by machine).
    third_party = {"site-packages", "dist-packages"}
    paths = [p for p in root.rglob("*.py") if not third_party & set(p.relative_to(root).parts)]
    return [str(p) for p in sorted(paths, key=lambda p: p.relative_to(root).as_posix())]


def writable_cache_dir(cache_dir: str, sub: str) -> str:
    """cache_dir/sub, created and probed with a file: ValueError naming --cache-dir if it fails."""
    path = os.path.join(cache_dir, sub)
    try:
        os.makedirs(path, exist_ok=True)
        # A name of its own (mkstemp), as the ranks of other nodes may probe a shared cache too.
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        from lib.extras import corpus  # the error's message

        raise corpus.cache_dir_error(cache_dir, e) from e
    return path


def is_nonempty(texts: list[str | None]) -> list[bool]:
    return [text is not None and text.strip() != "" for text in texts]


def split_corpus(ds: datasets.Dataset, val_fraction: float = 0.01, seed: int = 0):
    """(train, validation) documents, the same in every process and run: whole documents to one
    side, each in corpus order, round(val_fraction x n) (at least 1) to validation."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    n = len(ds)
    n_val = max(1, round(val_fraction * n))
    if n - n_val < 1:
        cannot = f"cannot split {n} document(s) into train and validation"
        need = "need at least 2 documents and 1 left for training"
        raise ValueError(f"{cannot} with val_fraction={val_fraction}: {need}")
    order = np.random.default_rng(seed).permutation(n)
    val_indices, train_indices = np.sort(order[:n_val]), np.sort(order[n_val:])
    return ds.select(train_indices), ds.select(val_indices)


def hash_texts(hasher, texts) -> None:
    """Add texts to a hashlib hash, each length-prefixed (["ab", "c"] and ["a", "bc"] differ)."""
    for text in texts:
        encoded = text.encode()
        hasher.update(len(encoded).to_bytes(8, "little"))
        hasher.update(encoded)


def fingerprint(ds: datasets.Dataset, cache_dir: str) -> str:
    """The sha256 of a corpus's documents in order (the same however --data names them), kept in
    cache_dir/fingerprints/ under datasets' fingerprint of `ds`: a cached start reads one file."""
    memo = os.path.join(cache_dir, "fingerprints", f"{ds._fingerprint}.sha256")
    # Checked by its checksums (files.py's, beside it): one without them, or damaged, is hashed
    # again (an edited digest would be recorded in every checkpoint, and refuse their resume).
    with contextlib.suppress(OSError, ValueError):
        files.verify_sums(f"{memo}{files.SUMS}")
        with open(memo) as f:
            return f.read().strip()
    hasher = hashlib.sha256()
    for batch in ds.iter(batch_size=1000):
        hash_texts(hasher, batch["text"])
    digest = hasher.hexdigest()
    with contextlib.suppress(OSError):  # written then renamed, its checksums first
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        files.atomic_save(digest.encode(), memo, lambda data, f: f.write(data), sums=True)
    return digest


# -------------------------------------------------------------------------------------------------
# Tokenizer


def get_tokenizer(train_texts, vocab_size=4096, cache_dir=".cache", path=None, specials=None):
    """The tokenizer.json at `path` (load_tokenizer), or a byte-level BPE trained on train_texts
    and cached under the hash of vocab_size and the texts: a changed corpus retrains."""
    if path is not None:
        return load_tokenizer(path, specials)
    if any((specials or {}).values()):
        raise ValueError(
            "--bot-token, --eot-token and --pad-token name tokens of a given --tokenizer; a "
            "trained one has its own: [BOT], [EOT], [PAD]"
        )
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least 259 (256 bytes + 3 specials): {vocab_size}")
    texts = _tokenizer_training_texts(train_texts)
    key = hashlib.sha256(f"vocab_size={vocab_size}\n".encode())
    hash_texts(key, texts)
    cached = os.path.join(cache_dir, "tokenizers", key.hexdigest(), "tokenizer.json")
    found = read_cached_tokenizer(cached) if os.path.exists(cached) else None
    if found is None:
        writable_cache_dir(cache_dir, "tokenizers")  # before training, not after: ValueError
        tokenizer = _train_tokenizer(texts, vocab_size)
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        # Written then renamed: a kill, or two nodes training at once, leave no half a file;
        # its checksums beside it (files.py's), written first, prove it whole when read.
        tmp = f"{cached}.{os.getpid()}.tmp"
        tokenizer.save(tmp)
        files.write_sums({"tokenizer.json": files.checksums(tmp)}, f"{cached}{files.SUMS}")
        os.replace(tmp, cached)
        found = Tokenizer.from_file(cached)
    return DocumentTokenizer(found, {"bot": BOT, "eot": EOT, "pad": PAD})


def read_cached_tokenizer(cached: str) -> Tokenizer | None:
    """The trained tokenizer cached at `cached`, or None, with a one-line warning, if it cannot
    be verified (its bytes are not those its checksums record, or it has none: a cache from
    before them) or does not parse: a cache entry, trained again."""
    sums = f"{cached}{files.SUMS}"
    why = "has no checksums (a cache from before them), so cannot be verified"
    try:
        if os.path.isfile(sums):
            files.verify_sums(sums)
            return Tokenizer.from_file(cached)
    except Exception as e:  # noqa: BLE001 - unreadable in any way: trained again
        why = f"is damaged ({(str(e).strip() or type(e).__name__).splitlines()[0]})"
    print(f"warning: the cached tokenizer {cached} {why}: training it again", file=sys.stderr)
    return None


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


def _train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # Byte-level: no unknown token; no prefix space, so decode(encode(text)) == text (for code).
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
    """A tokenizers.Tokenizer and the tokens documents are built with (`bot_id ids... eot_id`,
    padded with `pad_id`), which `specials` names. Text is encoded without the post-processor (a
    Llama tokenizer.json would add <|begin_of_text|> again), special tokens in it as text."""

    corpus_sha256: str | None = None  # the fingerprint of the run's documents (for checkpoints)

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

    def token_bytes(self) -> torch.Tensor:
        """Bytes of UTF-8 text per token id (special tokens 0), what bits per byte divides by. A
        byte-level BPE (this suite's, GPT-2's, Llama 3's) spells each byte as one character;
        SentencePiece a space "▁" and a lone byte "<0x0A>" (a prepended space counts too)."""
        spec = json.loads(self.to_str())
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
        sizes = torch.zeros(self.get_vocab_size(), dtype=torch.long)
        for piece, i in self.tokenizer.get_vocab(with_added_tokens=False).items():
            lone_byte = re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece)
            spelled = piece.replace("\u2581", " ")  # SentencePiece's "▁" is a space
            sizes[i] = len(piece) if byte_level else 1 if lone_byte else len(spelled.encode())
        specials = [t["id"] for t in spec.get("added_tokens", []) if t.get("special")]
        sizes[[i for i in specials if i < len(sizes)]] = 0  # [BOT], [EOT], [PAD]: no text
        return sizes


def tokenizer_digest(tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def corpus_digest(tokenizer) -> str | None:
    """The fingerprint of the documents the run reads; None for a tokenizer loaded alone."""
    return getattr(tokenizer, "corpus_sha256", None)


def load_tokenizer(path: str, specials: dict[str, str | None] | None = None) -> DocumentTokenizer:
    """A tokenizer.json made elsewhere (--tokenizer, or the one in an out-dir), with the special
    tokens that `specials` names (--bot-token, ...) or that lib/extras/hf_tokenizer.py finds;
    ValueError if it is unusable."""
    from lib.extras import hf_tokenizer  # only for a tokenizer.json the run did not train

    return DocumentTokenizer(*hf_tokenizer.read_tokenizer(path, specials, HF_NAMES))


# -------------------------------------------------------------------------------------------------
# Tokenized, cached documents


def tokenize(ds: datasets.Dataset, tokenizer: DocumentTokenizer, num_proc: int | None = None):
    """Each document as BOT ids... EOT, one int32 "input_ids" column (cached by datasets)."""
    import datasets

    ids = {"tokenizer": tokenizer.tokenizer, "bot_id": tokenizer.bot_id, "eot_id": tokenizer.eot_id}

    def tokens(fingerprint: str) -> datasets.Dataset:
        return ds.map(
            _encode_batch,
            batched=True,
            input_columns="text",
            remove_columns=ds.column_names,
            fn_kwargs=ids,
            features=datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))}),
            batch_size=TOKENIZE_BATCH_DOCS,
            num_proc=num_proc,
            desc="tokenizing documents",
            new_fingerprint=fingerprint,
        )

    # Named by the documents, the tokenizer and the code that encodes (files.cached_step).
    special = (tokenizer.bot_id, tokenizer.eot_id)
    name = files.cache_key(
        "tokens", ds._fingerprint, tokenizer_digest(tokenizer), special, _encode_batch
    )
    return files.cached_step(ds, name, "the tokens", tokens)


def _encode_batch(texts, tokenizer: Tokenizer, bot_id: int, eot_id: int) -> dict:
    # encode_special_tokens, lost when map() pickles the tokenizer to --num-proc workers, is set
    # here only if off: a set borrows it exclusively (a thread's encode fails: tokenizers 0.22).
    if not tokenizer.encode_special_tokens:
        tokenizer.encode_special_tokens = True
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)  # no post-processor
    return {"input_ids": [[bot_id, *encoding.ids, eot_id] for encoding in encodings]}


def count_tokens(ds: datasets.Dataset) -> int:
    """The number of tokens in the output of tokenize(), summed in Arrow (no Python loop)."""
    import pyarrow.compute

    table = ds.with_format("arrow")[:]  # the rows of ds, even if it is a select() of others
    return pyarrow.compute.sum(pyarrow.compute.list_value_length(table["input_ids"])).as_py() or 0


# -------------------------------------------------------------------------------------------------
# (x, y) training examples


class PretrainingDataset(torch.utils.data.Dataset):
    """(x, y) int64 pairs of shape (seq_length,) from tokenize()'s output; y is x shifted by 1.
    pack: one token stream cut into windows of seq_length + 1 at a stride of seq_length (each
    token after the first a target once); pad: a document per row, clipped or right-padded."""

    def __init__(self, dataset, seq_length: int, mode="pack", pad_id=0, num_proc=None, what=None):
        """what: (what the dataset is, what else would give it more tokens), for the error of
        one too small: default ("the tokenized dataset", "use more data")."""
        what, more = what or ("the tokenized dataset", "use more data")
        if mode not in ("pack", "pad"):
            raise ValueError(f"unknown mode {mode!r}; expected 'pack' or 'pad'")
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        if "input_ids" not in dataset.column_names:
            raise ValueError(f"expected tokenize()'s output, got columns {dataset.column_names}")
        self.seq_length, self.mode, self.pad_id = seq_length, mode, pad_id
        if mode == "pad":
            if len(dataset) == 0:
                raise ValueError(f"{what} has no documents; {more}")
            # The numpy format turns each row into an int64 array, with no Python lists between.
            self.rows = dataset.with_format("numpy", columns=["input_ids"])
            return
        import datasets

        window = seq_length + 1

        def windows(fingerprint: str) -> datasets.Dataset:
            return dataset.with_format("numpy").map(
                _cut_windows,
                batched=True,
                batch_size=PACK_BATCH_DOCS,
                input_columns="input_ids",
                remove_columns=dataset.column_names,
                fn_kwargs={"seq_length": seq_length},
                features=datasets.Features(
                    {"window": datasets.List(datasets.Value("int32"), window)}
                ),
                num_proc=num_proc,
                desc=f"packing windows of {window} tokens",
                new_fingerprint=fingerprint,
            )

        name = files.cache_key(
            "windows", dataset._fingerprint, seq_length, PACK_BATCH_DOCS, _cut_windows
        )
        windows = files.cached_step(dataset, name, "the packed windows", windows)
        if len(windows) == 0:
            n_tokens = sum(len(ids) for ids in dataset["input_ids"])
            raise ValueError(
                f"{what} has {n_tokens} tokens, too few for one window: pack mode "
                f"needs at least {window} (seq_length + 1) tokens within one batch of "
                f"{PACK_BATCH_DOCS} documents; {more}, a smaller --seq-length or "
                "--data-mode pad"
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
    """Pad mode's (x, y) of one document, clipped or right-padded to seq_length + 1 tokens."""
    ids = ids[: seq_length + 1]  # clip long documents
    tokens = torch.full((seq_length + 1,), pad_id, dtype=torch.long)
    tokens[: len(ids)] = torch.as_tensor(ids)
    x, y = tokens[:-1], tokens[1:].clone()
    y[len(ids) - 1 :] = IGNORE_INDEX  # y[j] is tokens[j + 1]: padding from j = len(ids) - 1 on
    return x, y


def _cut_windows(input_ids: list[np.ndarray], seq_length: int) -> dict[str, np.ndarray]:
    stream = np.concatenate(input_ids)  # all documents of this map() batch, back to back
    n_windows = max(0, (len(stream) - 1) // seq_length)
    # Row k holds stream[k * seq_length : k * seq_length + seq_length + 1].
    index = np.arange(n_windows)[:, None] * seq_length + np.arange(seq_length + 1)
    return {"window": stream[index]}  # (n_windows, seq_length + 1)
