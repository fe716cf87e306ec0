"""The corpora other than the default (the stdlib's .py files, read by data.py): a file, a glob
or a directory of .txt/.jsonl/.json/.parquet files (.txt split into documents by paragraph, line
or file: --txt-split), or a Hugging Face hub dataset, NAME or NAME:CONFIG. data.py imports this
only for such a --data (and lib/extras/streaming.py, which reads any --data as a stream).

    source = resolve_source(spec, txt_split)      # which builder, files, options: nothing read
    ds = open_source(source, spec, text_column, cache_dir, streaming=False)  # one "text" column
"""

import errno
import json
import os
from dataclasses import dataclass, field
from glob import glob
from pathlib import Path

import datasets
import pyarrow.parquet

from lib.checkpoints import files

# Local files: suffix -> the datasets builder that reads it.
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}

# How .txt files become documents (--txt-split) -> the text builder's sample_by. "paragraph" and
# "line" read each file in chunks (10 MB), never whole; "file" reads each file whole, as one
# document. "auto" is resolved by txt_split_mode().
SAMPLE_BY = {"paragraph": "paragraph", "line": "line", "file": "document"}


TXT_SPLITS = ("auto", "paragraph", "line", "file")  # the choices of --txt-split


@dataclass(frozen=True)
class Source:
    """What --data names, resolved into datasets.load_dataset's arguments (resolve_source),
    before anything is read (open_source)."""

    path: str  # a datasets builder ("text", "json", "parquet"), or a hub dataset's name
    config: str | None = None  # the hub dataset's config: --data NAME:CONFIG
    data_files: list[str] | None = None  # local files, sorted; None for a hub dataset
    options: dict = field(default_factory=dict)  # builder options: the text builder's sample_by
    txt_mode: str | None = None  # how .txt files became documents (see txt_split_mode)


def load_corpus(spec: str, text_column: str, cache_dir: str, txt_split: str, drop_empty):
    """data.load_corpus for a --data other than the stdlib: its documents in one "text" column,
    in a deterministic order, the empty ones left out by drop_empty (passed in by data.py);
    ValueError if unusable."""
    source = resolve_source(spec, txt_split)
    ds = open_source(source, spec, text_column, cache_dir)
    try:
        ds = drop_empty(ds)
    except UnicodeDecodeError as e:  # a json file's non-UTF-8 text
        raise read_error(source.data_files, source.path, spec, e) from e
    if len(ds) == 0:
        raise ValueError(f"corpus {spec!r} has no non-empty documents")
    if source.txt_mode is not None and len(ds) == 1:
        raise one_document_error(source.txt_mode, spec, txt_split)  # split_corpus needs 2
    return ds


def resolve_source(spec: str, txt_split: str = "auto") -> Source:
    """What `spec` (not the stdlib: data.py's own) names, checked without reading any document;
    ValueError saying why not."""
    if txt_split not in TXT_SPLITS:
        raise ValueError(f"--txt-split must be one of {', '.join(TXT_SPLITS)}, got {txt_split!r}")
    return Source(**resolve(spec, txt_split))


def open_source(source: Source, spec: str, text_column: str, cache_dir: str, streaming=False):
    """datasets.load_dataset on a resolved --data: its "train" split with the text in one column,
    "text" (an IterableDataset, read as iterated, if streaming); ValueError in one line. Cached
    under cache_dir/datasets (data.writable_cache_dir checks it first); a stream caches nothing."""
    kwargs = {"split": "train", "cache_dir": os.path.join(cache_dir, "datasets")}
    kwargs["streaming"] = streaming
    if source.data_files is None:
        ds = load_hub(source.path, source.config, spec, **kwargs)
        return select_text_column(ds, text_column, spec)
    # A user's file that is not UTF-8 (a binary file, another encoding) is refused below, naming
    # it, not trained on as garbage. (A stream meets its errors as it is read: see
    # lib/extras/streaming.py.)
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own error log: see below
    try:  # (a cache's files checked first: lib/checkpoints/files.py)
        ds = files.load_cached(
            source.path, data_files=source.data_files, **source.options, **kwargs
        )
    except Exception as e:  # datasets wraps a bad file in many exception types
        raise load_error(e, cache_dir, source.data_files, source.path, spec) from e
    finally:
        datasets.logging.set_verbosity(verbosity)
    # The text builder's one column is already "text".
    return ds if source.path == "text" else select_text_column(ds, text_column, spec)


def resolve(spec: str, txt_split: str = "auto") -> dict:
    """Source's fields for a --data other than the stdlib, checked without reading any document;
    ValueError saying why not (the stdlib: only an explicit --txt-split)."""
    if spec == "stdlib":
        _check_txt_split_unused(txt_split, spec, "the standard library's .py files")
    if os.path.exists(spec) or _is_glob(spec) or _looks_like_path(spec):
        files, builder = _find_files(spec)
        if builder == "text":
            # sample_by is part of the builder's config, hence of its cache directory, and so of
            # the fingerprints of everything derived from it (filter, tokenize, pack): switching
            # --txt-split never reuses tokens made with another split.
            mode = txt_split_mode(spec, txt_split)
            return dict(
                path="text", data_files=files, options={"sample_by": SAMPLE_BY[mode]}, txt_mode=mode
            )
        kinds = "/".join(sorted({Path(f).suffix.lower() for f in files}))
        _check_txt_split_unused(txt_split, spec, f"{kinds} files")
        return dict(path=builder, data_files=files)
    _check_txt_split_unused(txt_split, spec, "a hub dataset name")
    # Not a local path: a dataset on the Hugging Face hub, NAME or NAME:CONFIG (wikitext needs
    # a config: wikitext:wikitext-103-raw-v1). Hub names and config names have no ":".
    name, _, config = spec.partition(":")
    return dict(path=name, config=config or None)


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


def one_document_error(txt_mode: str, spec: str, txt_split: str) -> ValueError:
    """Why a .txt corpus of one document cannot train: data.split_corpus needs 2."""
    why, fix = {
        "file": ("each .txt file is one", "pass --txt-split paragraph or line, or more files"),
        "paragraph": ("one paragraph", "separate documents by blank lines or --txt-split line"),
        "line": ("one non-empty line", "add documents"),
    }[txt_mode]
    return ValueError(
        f"--data {spec!r} is 1 document ({why}, with --txt-split {txt_split}), and training "
        f"needs at least 2 (validation takes whole documents): {fix}"
    )


def read_error(files: list[str] | None, builder: str, spec: str, error: Exception) -> ValueError:
    """The one-line error for a corpus that failed to read: for local files, which file and line.

    datasets says what failed deep inside pyarrow or json, but rarely in which file: find the
    file and line ourselves (this reads the files again, but only after a failure).
    """
    where = _find_unreadable(files, builder) if files else None
    return ValueError(f"--data {spec!r}: {where or 'cannot be read: ' + _first_line(error)}")


def load_error(error: Exception, cache_dir: str, files: list[str], builder: str, spec: str):
    """The one-line ValueError of a load_dataset of local files that failed: the cache's if it
    could not be written (in_cache_dir), else which file could not be read (read_error)."""
    return in_cache_dir(error, cache_dir) or read_error(files, builder, spec, error)


def load_hub(name: str, config: str | None, spec: str, **kwargs):
    """datasets.load_dataset of a hub dataset (open_source's); ValueError in one line."""
    try:  # needs the network the first time (and every time, streaming)
        return files.load_cached(name, config, **kwargs)
    except (OSError, ValueError) as e:  # offline and not cached, no such dataset, no config, ...
        cache_error = in_cache_dir(e, os.path.dirname(kwargs["cache_dir"]))
        raise cache_error or hub_error(e, name, spec) from e


def cache_dir_error(cache_dir: str, error: OSError) -> ValueError:
    where = f": {error.filename}" if error.filename else ""
    return ValueError(
        f"--cache-dir {cache_dir} cannot be created or written ({error.strerror or error}"
        f"{where}); choose another --cache-dir, or make that one a directory this user can "
        f"write to"
    )


def in_cache_dir(error: BaseException, cache_dir: str) -> ValueError | None:
    """cache_dir_error if `error` (or an error it comes from) is an OSError about a path inside
    cache_dir (one that datasets could not write, e.g. in a cache shared with another user), or a
    write that found no room (a full disk, a quota, a file size limit), which names no file."""
    root, seen = os.path.abspath(cache_dir), set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return cache_dir_error(cache_dir, error)
        name = getattr(error, "filename", None)
        if isinstance(error, OSError) and isinstance(name, str):
            path = os.path.abspath(name)
            if path == root or path.startswith(root + os.sep):
                return cache_dir_error(cache_dir, error)
        error = error.__cause__ or error.__context__
    return None


def hub_error(error: Exception, name: str, spec: str) -> ValueError:
    """The one-line error for a hub dataset that could not be loaded."""
    if isinstance(error, OSError):  # offline and not cached (ConnectionError), or no such dataset
        return ValueError(
            f"--data {spec!r} is not a local path, and no hub dataset of that name could be "
            f"reached or found ({_first_line(error)}); --data takes stdlib, a "
            f"{'/'.join(BUILDERS)} file, glob or directory, or a hub dataset NAME[:CONFIG]"
        )
    message = str(error)  # datasets' own message is several lines, with a usage example
    if "Config name is missing" in message:
        # "...\nPlease pick one among the available configs: ['a', 'b']\nExample of usage..."
        configs = message.partition("available configs:")[2].strip().split("\n")[0]
        return ValueError(
            f"--data {spec!r}: this hub dataset has several configs: name one as "
            f"--data {name}:CONFIG, CONFIG one of {configs or 'those on its hub page'}"
        )
    return ValueError(f"--data {spec!r}: {_first_line(error)}")


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


def select_text_column(ds, text_column: str, spec: str):
    """ds (a Dataset, or an IterableDataset) with only its text column, named "text". A stream
    may not know its columns before it is read (features None): then a missing column is an
    error as it is read, which lib/extras/streaming.py reports in one line."""
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
