"""The corpus: what --data names, read into a `datasets.Dataset` with one "text" column, one row
per document, and split into training and validation documents.

    corpus = load_corpus(spec, text_column, cache_dir, txt_split)   # stdlib, files, or hub
    train, val = split_corpus(corpus, val_fraction)                  # by document, seeded
    digest = fingerprint(corpus, cache_dir)                          # what the documents are

The forms of --data: "stdlib" (every .py file of this Python's standard library), a file, a glob
or a directory of .txt/.jsonl/.json/.parquet files (.txt split into documents by paragraph, line
or file: --txt-split), or a Hugging Face hub dataset, NAME or NAME:CONFIG. datasets' own cache
under --cache-dir holds what was read. A corpus that cannot be read stops with one line naming the
file and why. data.py takes it from here: tokenizer, tokens, training examples. resolve_source
and open_source are the steps of load_corpus that streaming.py (--streaming) shares.
fingerprint (stream_fingerprint for a stream) is what a checkpoint records of the data, so that a
resume can tell that the documents changed, however --data names them.
"""

import contextlib
import hashlib
import json
import os
import sysconfig
import tempfile
from dataclasses import dataclass, field
from glob import glob
from pathlib import Path

import datasets
import numpy as np
import pyarrow.parquet

# Local files: suffix -> the datasets builder that reads it.
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}

# How .txt files become documents (--txt-split) -> the text builder's sample_by. "paragraph" and
# "line" read each file in chunks (10 MB), never whole; "file" reads each file whole, as one
# document. "auto" is resolved by txt_split_mode().
TXT_SPLITS = ("auto", "paragraph", "line", "file")
SAMPLE_BY = {"paragraph": "paragraph", "line": "line", "file": "document"}


def load_corpus(
    spec: str = "stdlib",
    text_column: str = "text",
    cache_dir: str = ".cache",
    txt_split: str = "auto",
) -> datasets.Dataset:
    """Load documents as a Dataset with exactly one column, "text", in a deterministic order.

    spec is "stdlib" (every .py file of this Python's standard library), a file, a glob or a
    directory of .txt, .jsonl/.json or .parquet files, or else a hub dataset NAME or NAME:CONFIG.
    text_column names the text column of .jsonl/.json/.parquet/hub data. txt_split says how .txt
    files become documents (see txt_split_mode); any value but "auto" is refused for other data.
    Empty and whitespace-only documents are dropped. Raises ValueError on unusable input.
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
        why, fix = {
            "file": ("each .txt file is one", "pass --txt-split paragraph or line, or more files"),
            "paragraph": ("one paragraph", "separate documents by blank lines or --txt-split line"),
            "line": ("one non-empty line", "add documents"),
        }[source.txt_mode]
        raise ValueError(
            f"--data {spec!r} is 1 document ({why}, with --txt-split {txt_split}), and training "
            f"needs at least 2 (validation takes whole documents): {fix}"
        )
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
    if spec == "stdlib":
        _check_txt_split_unused(txt_split, spec, "the standard library's .py files")
        # A few stdlib files are deliberately not UTF-8 (encoding tests): their undecodable
        # bytes become U+FFFD. A user's file that is not UTF-8 is refused instead (read_error).
        options = {"sample_by": "document", "encoding_errors": "replace"}
        return Source("text", data_files=_stdlib_files(), options=options)
    if os.path.exists(spec) or _is_glob(spec) or _looks_like_path(spec):
        files, builder = _find_files(spec)
        if builder == "text":
            # sample_by is part of the builder's config, hence of its cache directory, and so of
            # the fingerprints of everything derived from it (filter, tokenize, pack): switching
            # --txt-split never reuses tokens made with another split.
            mode = txt_split_mode(spec, txt_split)
            return Source(
                "text", data_files=files, options={"sample_by": SAMPLE_BY[mode]}, txt_mode=mode
            )
        kinds = "/".join(sorted({Path(f).suffix.lower() for f in files}))
        _check_txt_split_unused(txt_split, spec, f"{kinds} files")
        return Source(builder, data_files=files)
    _check_txt_split_unused(txt_split, spec, "a hub dataset name")
    # Not a local path: a dataset on the Hugging Face hub, NAME or NAME:CONFIG (wikitext needs
    # a config: wikitext:wikitext-103-raw-v1). Hub names and config names have no ":".
    name, _, config = spec.partition(":")
    return Source(name, config=config or None)


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
    else:
        ds = _load_hub(source, spec, **kwargs)
    return _select_text_column(ds, text_column, spec)


def txt_split_mode(spec: str, txt_split: str = "auto") -> str:
    """How the .txt files of `spec` become documents: "paragraph", "line" or "file".

    "auto" is "paragraph" when spec names one .txt file (nanoGPT's input.txt: one document
    would leave none for validation), and "file" for a directory or a glob (a folder of
    documents, one per file), however many files it matches.
    """
    if txt_split != "auto":
        return txt_split
    return "paragraph" if os.path.isfile(os.path.expanduser(spec)) else "file"


def _check_txt_split_unused(txt_split: str, spec: str, what: str) -> None:
    # An explicit --txt-split that cannot apply is a mistake to say, not a flag to ignore.
    if txt_split != "auto":
        raise ValueError(
            f"--txt-split {txt_split} applies to .txt files only, and --data {spec!r} is {what}; "
            f"leave --txt-split out"
        )


def _stdlib_files() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    # Third-party packages installed next to the stdlib are not part of it (and vary by machine).
    files = [
        p
        for p in root.rglob("*.py")
        if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
    ]
    return [str(p) for p in sorted(files, key=lambda p: p.relative_to(root).as_posix())]


def _is_glob(spec: str) -> bool:
    return any(char in spec for char in "*?[")


def _looks_like_path(spec: str) -> bool:
    # A missing "data/train.txt" should fail here with a clear message, not as a hub lookup.
    return spec.startswith((".", "/", "~")) or Path(spec).suffix.lower() in BUILDERS


def _find_files(spec: str) -> tuple[list[str], str]:
    """Resolve a file, glob or directory to a sorted list of files and the builder to read them."""
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        root = Path(path)
        # Skip hidden paths so a corpus directory's own .cache/ (full of .json/.arrow) is ignored.
        found = [
            p
            for p in root.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
        ]
    else:
        found = [Path(p) for p in glob(path, recursive=True)]
        found = [p for p in found if p.is_file()]
    files = sorted(os.path.abspath(p) for p in found if p.suffix.lower() in BUILDERS)
    if not files:
        raise ValueError(
            f"--data {spec!r}: no {'/'.join(BUILDERS)} files found "
            f"({len(found)} other files matched). Check the path or glob (quote it in the shell)."
        )
    suffixes = sorted({Path(f).suffix.lower() for f in files})
    builders = {BUILDERS[s] for s in suffixes}
    if len(builders) > 1:  # .json and .jsonl may mix: the same json builder reads both
        raise ValueError(
            f"--data {spec!r} mixes file types {suffixes}; use a glob that matches one type, "
            f"e.g. '{spec.rstrip('/')}/**/*{suffixes[0]}'"
        )
    # An empty file holds no document (and datasets' json reader cannot even start on one).
    nonempty = [f for f in files if os.path.getsize(f) > 0]
    if not nonempty:
        what = "the file is" if len(files) == 1 else f"all {len(files)} files are"
        raise ValueError(f"--data {spec!r}: {what} empty")
    return nonempty, builders.pop()


def _load_files(source: Source, spec: str, **kwargs) -> datasets.Dataset | datasets.IterableDataset:
    # Blank lines and whitespace-only paragraphs are dropped later with the other empty
    # documents. A user's file that is not UTF-8 (a binary file, or another encoding) is refused
    # below, naming it, rather than trained on as garbage. (A stream reads nothing here: its
    # errors come as it is read, and streaming.py passes them through read_error too.)
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own error log: see below
    try:
        return datasets.load_dataset(
            source.path, data_files=source.data_files, **source.options, **kwargs
        )
    except Exception as e:  # datasets wraps a bad file in many exception types
        # kwargs' cache_dir is --cache-dir's datasets/: the message names --cache-dir itself.
        if (cache_error := _cache_dir_error(e, os.path.dirname(kwargs["cache_dir"]))) is not None:
            raise cache_error from e
        raise read_error(source, spec, e) from e
    finally:
        datasets.logging.set_verbosity(verbosity)


def read_error(source: Source, spec: str, error: Exception) -> ValueError:
    """The one-line error for a corpus that failed to read: for local files, which file and line.

    datasets says what failed deep inside pyarrow or json, but rarely in which file: find the
    file and line ourselves (this reads the files again, but only after a failure).
    """
    where = _find_unreadable(source.data_files, source.path) if source.data_files else None
    return ValueError(f"--data {spec!r}: {where or 'cannot be read: ' + _first_line(error)}")


def _load_hub(source: Source, spec: str, **kwargs) -> datasets.Dataset | datasets.IterableDataset:
    try:  # needs the network the first time (and every time, streaming)
        return datasets.load_dataset(source.path, source.config, **kwargs)
    except OSError as e:  # offline and not cached (ConnectionError), or no such dataset
        if (cache_error := _cache_dir_error(e, os.path.dirname(kwargs["cache_dir"]))) is not None:
            raise cache_error from e
        raise ValueError(
            f"--data {spec!r} is not a local path, and no hub dataset of that name could be "
            f"reached or found ({_first_line(e)}); --data takes stdlib, a "
            f"{'/'.join(BUILDERS)} file, glob or directory, or a hub dataset NAME[:CONFIG]"
        ) from e
    except ValueError as e:  # datasets' own message is several lines, with a usage example
        message = str(e)
        if "Config name is missing" in message:
            # "...\nPlease pick one among the available configs: ['a', 'b']\nExample of usage..."
            configs = message.partition("available configs:")[2].strip().split("\n")[0]
            raise ValueError(
                f"--data {spec!r}: this hub dataset has several configs: name one as "
                f"--data {source.path}:CONFIG, CONFIG one of {configs or 'those on its hub page'}"
            ) from e
        raise ValueError(f"--data {spec!r}: {_first_line(e)}") from e


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
        raise cache_dir_error(cache_dir, e) from e
    return path


def cache_dir_error(cache_dir: str, error: OSError) -> ValueError:
    where = f": {error.filename}" if error.filename else ""
    return ValueError(
        f"--cache-dir {cache_dir} cannot be created or written ({error.strerror or error}"
        f"{where}); choose another --cache-dir, or make that one a directory this user can "
        f"write to"
    )


def _cache_dir_error(error: BaseException, cache_dir: str) -> ValueError | None:
    """cache_dir_error if `error` (or an error it comes from) is an OSError about a path inside
    cache_dir: one that datasets could not write, e.g. in a cache shared with another user."""
    root, seen = os.path.abspath(cache_dir), set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        name = getattr(error, "filename", None)
        if isinstance(error, OSError) and isinstance(name, str):
            path = os.path.abspath(name)
            if path == root or path.startswith(root + os.sep):
                return cache_dir_error(cache_dir, error)
        error = error.__cause__ or error.__context__
    return None


def _find_unreadable(files: list[str], builder: str) -> str | None:
    """Where the first unreadable file goes wrong ("FILE line 3: why"), or None if none does."""
    any_document = False
    for path in files:
        if builder == "parquet":
            try:
                pyarrow.parquet.read_schema(path)
            except Exception as e:  # ArrowInvalid, OSError, ...
                return f"{path} is not a Parquet file ({_first_line(e)})"
            continue
        if path.endswith(".json") and _is_one_json_document(path):
            any_document = True  # a .json file may also be one document, e.g. a list of objects
            continue
        with open(path, "rb") as f:
            offset = 0
            for number, line in enumerate(f, start=1):
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    return (
                        f"{path} line {number} (byte {offset + e.start}) is not UTF-8 text: a "
                        f"binary file, or another encoding (convert it to UTF-8, e.g. with iconv)"
                    )
                offset += len(line)
                if builder == "json" and text.strip():
                    any_document = True
                    if error := _json_line_error(text):
                        return f"{path} line {number}: {error}"
    if builder == "json" and not any_document:
        return "its files hold no JSON documents, only blank lines"
    return None


def _is_one_json_document(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            json.load(f)
        return True
    except ValueError:  # JSONDecodeError, UnicodeDecodeError: the line by line check says where
        return False


def _json_line_error(text: str) -> str | None:
    """Why one line of a JSON-lines file is not a document (None: it is one)."""
    try:
        row = json.loads(text.strip())
    except json.JSONDecodeError as e:
        return f"invalid JSON at column {e.colno} ({e.msg})"
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object (one document per line: {{...}})"
    return None


def _first_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type if it has none."""
    message = str(error).strip()
    return message.splitlines()[0] if message else type(error).__name__


def _select_text_column(ds, text_column: str, spec: str):
    """ds (a Dataset, or an IterableDataset) with only its text column, named "text". A stream
    may not know its columns before it is read (features None): then a missing column is an
    error as it is read, which streaming.py reports in one line."""
    if ds.features is None:
        ds = ds.select_columns([text_column])
        return ds if text_column == "text" else ds.rename_column(text_column, "text")
    if text_column not in ds.column_names:
        raise ValueError(
            f"--data {spec!r} has no column {text_column!r}; its columns are {ds.column_names}. "
            f"Pass --text-column with one of them."
        )
    feature = ds.features[text_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise ValueError(f"--data {spec!r}: column {text_column!r} holds {feature}, not text")
    ds = ds.select_columns([text_column])
    return ds if text_column == "text" else ds.rename_column(text_column, "text")


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


# -------------------------------------------------------------------------------------------------
# Fingerprints: what the data is, for a checkpoint to record and a resume to compare


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
    named by datasets' own fingerprint of `ds` (which changes whenever datasets reads the files
    again: their paths, sizes or modification times changed), so a start-up with the corpus
    cached reads one small file instead of every document. A cache that cannot be written only
    costs hashing again next time.
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


def stream_fingerprint(source: Source, first_texts: list[str]) -> str:
    """A stream's fingerprint (--streaming), from what it knows without reading the whole
    corpus: its first documents (the ones held out for validation, read first anyway) and, for
    local files, how many there are and each one's size, in order. It catches a reordered,
    edited-at-the-start, grown or shrunk corpus; an edit further in that keeps every file's size
    goes unseen (hashing it would mean reading the whole stream at every start)."""
    hasher = hashlib.sha256(b"stream\n")
    hash_texts(hasher, first_texts)
    for path in source.data_files or []:
        with contextlib.suppress(OSError):
            hasher.update(os.path.getsize(path).to_bytes(8, "little"))
    return hasher.hexdigest()
