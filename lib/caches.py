"""The datasets caches under --cache-dir, proven whole before they are used: every Arrow file that
datasets writes there (the corpus as read, the documents kept, the tokens, the packed windows)
gets the checksums a checkpoint has (lib/checkpoints/files.py's CRC-32s, FILE.sums beside it)
when it is made, and is checked against them when a later run finds it, before datasets reads
it. A damaged file, or one found without checksums (a cache from before them, or one whose
writing was cut short), is made again, with a one-line warning: a cache can always be made
again, while a flipped byte in it would be trained on without a word and a truncated one ended
in pyarrow's traceback.

    ds = caches.load_dataset("json", cache_dir=..., data_files=[...])  # datasets.load_dataset's
    tokens = caches.step(docs, caches.key("tokens", ...), "the tokens", lambda fp: docs.map(
        ..., new_fingerprint=fp))   # a map or filter, named by what decides its result

A step is named by a key of our own (datasets' new_fingerprint), made of what decides its
result, so that the files it will read are known, and checked, before datasets opens them.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from lib.checkpoints import files

if TYPE_CHECKING:  # `datasets` takes 1.7 s to import: only where documents are read
    import datasets

# The cache files verified (or summed) in this process, as they were: each is checked once.
_verified: set[tuple] = set()


def key(*parts) -> str:
    """A step's name (16 hex digits, as datasets' own) from what decides its result: the input's
    fingerprint, the settings, and the source code of the functions (a change retokenizes)."""
    hasher = hashlib.sha256()
    for part in parts:
        text = inspect.getsource(part) if callable(part) else repr(part)
        hasher.update(len(text).to_bytes(8, "little") + text.encode())
    return hasher.hexdigest()[:16]


def step(ds: datasets.Dataset, name: str, what: str, make: Callable) -> datasets.Dataset:
    """make(name): ds.map or ds.filter with new_fingerprint=name, whose result datasets caches
    beside ds's files as cache-NAME*.arrow. Those already there are checked first (a bad one
    removed, with a warning, and made again); those made now are summed."""
    if not ds.cache_files:  # a dataset in memory: so is its result
        return make(name)
    folder = os.path.dirname(ds.cache_files[0]["filename"])
    pattern = os.path.join(glob.escape(folder), f"cache-{name}*.arrow")
    for path in sorted(glob.glob(pattern)):
        check(path, what, [path])
    result = make(name)
    summed(result, lambda path: os.path.basename(path).startswith(f"cache-{name}"))
    return result


def load_dataset(path: str, name=None, *, split: str, cache_dir: str, streaming=False, **kwargs):
    """datasets.load_dataset(path, name, split=, cache_dir=, streaming=, **kwargs), done as it
    does it (load_dataset_builder, download_and_prepare, as_dataset), with the builder's files
    checked before they are read, or summed once made (a stream caches nothing)."""
    import datasets

    if streaming:
        return datasets.load_dataset(
            path, name, split=split, cache_dir=cache_dir, streaming=True, **kwargs
        )
    builder = datasets.load_dataset_builder(path, name, cache_dir=cache_dir, **kwargs)
    folder = builder.cache_dir
    info = os.path.join(folder, "dataset_info.json")  # datasets' sign of a prepared folder
    if os.path.isfile(info):
        for found in sorted(glob.glob(os.path.join(glob.escape(folder), "*.arrow"))):
            if not os.path.basename(found).startswith("cache-"):  # (a map's: step checks it)
                check(found, "the corpus as read", [found, info])  # (datasets prepares anew)
    builder.download_and_prepare()
    ds = builder.as_dataset(split=split)
    summed(ds, lambda file: os.path.dirname(file) == folder)
    return ds


def check(path: str, what: str, remove: list[str]) -> None:
    """Nothing if the cache file `path` is whole (by its checksums); else a one-line warning,
    and the files `remove` (and their checksums) removed, for datasets to make them again."""
    stat = os.stat(path)
    seen = (path, stat.st_ino, stat.st_mtime_ns, stat.st_size)
    if seen in _verified:
        return
    sums = f"{path}{files.SUMS}"
    why = "has no checksums (a cache from before them, or one whose writing was cut short)"
    if os.path.isfile(sums):
        try:
            files.verify_sums(sums)
            _verified.add(seen)
            return
        except ValueError as e:  # (verify_sums names the file it found damaged)
            damaged = str(e).startswith(f"{path} is damaged")
            why = (
                "is damaged: its bytes are not those written"
                if damaged
                else f"has checksums that cannot be read ({e})"
            )
    print(f"warning: {path} ({what}, cached) {why}: making it again", file=sys.stderr)
    try:
        for name in remove:
            for gone in (name, f"{name}{files.SUMS}"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(gone)
    except OSError as e:  # a cache shared with another user, read-only to this one
        raise ValueError(
            f"{path} ({what}, cached) {why}, and cannot be removed ({e.strerror or e}): remove "
            f"it by hand, or choose another --cache-dir"
        ) from e


def summed(ds: datasets.Dataset, made: Callable[[str], bool]) -> None:
    """The checksums, beside each, of ds's cache files that made(path) says this step wrote
    (those not verified yet: datasets just made them, whole, renamed into place)."""
    for path in dict.fromkeys(f["filename"] for f in ds.cache_files):
        stat = os.stat(path)
        seen = (path, stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if seen not in _verified and made(path):
            files.write_sums({os.path.basename(path): files.checksums(path)}, f"{path}{files.SUMS}")
            _verified.add(seen)
