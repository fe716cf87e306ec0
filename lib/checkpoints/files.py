"""Files written whole, checkpoint files found, and their checksums; the datasets caches under
--cache-dir checked by the same checksums (at the end). Every file of a run is written to a
temporary name beside it, flushed to disk, then renamed over it (os.replace is atomic on POSIX),
so a kill leaves the old file or the new, never half."""

from __future__ import annotations  # `datasets.Dataset` in signatures, `datasets` not imported

import concurrent.futures
import contextlib
import errno
import fcntl
import glob
import hashlib
import inspect
import json
import os
import re
import shutil
import sys
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # `datasets` takes 1.7 s to import: only where documents are read
    import datasets

CHECKPOINT_RE = re.compile(r"step_(\d+)\.pt")  # a whole file name: step_0000100.pt
CHECKPOINT_DIR_RE = re.compile(r"step_(\d+)")  # train_fsdp.py and later: a DCP directory per step
TEMP_RE = re.compile(r"\.tmp\d+$")  # what atomic_save/atomic_write_text write before renaming


def atomic_save(
    obj, path: str, write=torch.save, sums: bool = False, beside: bool = True
) -> list[int] | None:
    """write(obj, f) into a temporary file beside `path`, flushed to disk, renamed over `path`.
    sums: return its checksums (else None), and, if `beside` (a checkpoint's), write them beside
    it too (PATH.sums, before the rename). They are summed while the disk syncs the file: the
    pages the write just filled are read back from memory, in time the sync waits anyway."""
    tmp = f"{path}.tmp{os.getpid()}"
    crcs = None
    try:
        with open(tmp, "wb") as f:
            write(obj, f)
            f.flush()
            if sums:
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    synced = pool.submit(os.fsync, f.fileno())
                    crcs = checksums(tmp)
                    synced.result()
                if beside:
                    write_sums({os.path.basename(path): crcs}, f"{path}{SUMS}")
            else:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:  # (a second Ctrl-C too: KeyboardInterrupt)
        # A full disk, say: remove the partial file (its space is needed); `path` is untouched.
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, RuntimeError) and isinstance(e.__context__, OSError):
            raise e.__context__ from e  # torch.save's zip writer wraps it in a RuntimeError
        raise
    return crcs


def atomic_write_text(path: str, text: str) -> None:
    atomic_save(text.encode(), path, lambda data, f: f.write(data))


# The saves still being written when a step ends (an --async-save in flight: sharded.py's
# Checkpoints registers the function that completes it). A run that stops on a failure every
# rank meets alike (the non-finite guard) completes them first: they were started from a good
# state, and are often the only checkpoint of it.
in_flight: list = []


def finish_in_flight() -> None:
    """Complete every save still being written (a collective where the save's is: every rank
    calls it, at the same point)."""
    while in_flight:
        in_flight.pop(0)()


def list_checkpoints(out_dir: str, pattern: re.Pattern = CHECKPOINT_RE) -> list[str]:
    """Checkpoints in --out-dir, oldest first: the names in checkpoints/ that `pattern` matches
    whole, its first group the step."""
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    found = [(int(m.group(1)), name) for name in names if (m := pattern.fullmatch(name))]
    return [os.path.join(ckpt_dir, name) for _, name in sorted(found)]


# -------------------------------------------------------------------------------------------------
# Checksums: a checkpoint proves itself. Each file's CRC-32 per CHUNK bytes, written beside it
# when saved and checked before it is read: a flipped bit (a disk, a copy) is found and named,
# never trained on. Summed on threads (zlib frees the GIL), from the page cache the write filled.

SUMS = ".sums"  # step_0000100.pt.sums; a DCP checkpoint's directory holds one for all its files
CHUNK = 64 * 2**20


PIECE = 2**20  # read (and summed) a MiB at a time, into one buffer that stays in the CPU's cache


def checksums(path: str, chunk: int = CHUNK) -> list[int]:
    """The CRC-32 of each `chunk` bytes of the file: each chunk on a thread of its own, read a
    PIECE at a time into a buffer used again and again (a 64 MiB bytes object per read, freshly
    allocated and faulted in, took 4x as long as the CRC itself)."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)

    def chunk_crc(start: int) -> int:
        buffer = memoryview(bytearray(min(PIECE, chunk)))
        crc, at, end = 0, start, min(start + chunk, size)
        while at < end:
            n = os.preadv(fd, [buffer[: min(len(buffer), end - at)]], at)
            if n == 0:  # (the file shrank meanwhile: what is there is summed)
                break
            crc = zlib.crc32(buffer[:n], crc)
            at += n
        return crc

    try:
        with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            return list(pool.map(chunk_crc, range(0, size, chunk)))
    finally:
        os.close(fd)


def verify_sums(path: str, share=None) -> None:
    """ValueError naming the first file (of those `path` lists, beside it; share: of those for
    which share(name) is true) whose bytes are not the ones written, or that is missing."""
    folder = os.path.dirname(path)
    try:
        with open(path) as f:
            record = json.load(f)
        chunk, sums = record["chunk"], dict(record["crc32"])
        if type(chunk) is not int or chunk < 1:  # (an edited file: never a traceback)
            raise ValueError(f"chunk {chunk!r} is not a size")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read the checksums {path}: {e}") from e
    for name, expected in sorted(sums.items()):
        if share is not None and not share(name):
            continue
        where = os.path.join(folder, name)
        if not os.path.isfile(where) or checksums(where, chunk) != expected:
            raise ValueError(
                f"{where} is damaged: its bytes are not those written (checksums {path})"
            )


def write_sums(sums: dict[str, list[int]], path: str) -> None:
    """`sums` ({file name: its checksums}) into `path`, a JSON file beside those files."""
    atomic_write_text(path, json.dumps({"chunk": CHUNK, "crc32": sums}))


FINAL_SUMS = "final.sums"  # the checksums of a run's final files, beside them in its --out-dir


def write_sums_of(folder: str, names: list[str], sums_name: str = FINAL_SUMS) -> None:
    """The checksums of the files `names` in `folder`, into folder/sums_name."""
    sums = {name: checksums(os.path.join(folder, name)) for name in names}
    write_sums(sums, os.path.join(folder, sums_name))


# -------------------------------------------------------------------------------------------------
# The datasets caches under --cache-dir, proven whole by the same checksums: every Arrow file that
# datasets writes there (the corpus as read, the documents kept, the tokens, the packed windows)
# is summed when it is made (FILE.sums beside it) and checked when a later run finds it, before
# datasets reads it. A damaged file, or one found without checksums (a cache from before them, or
# one whose writing was cut short), is made again with a one-line warning: a cache can always be
# made again, while a flipped byte in it would be trained on without a word (and a truncated one
# ended in pyarrow's traceback). data.py's steps go through these:
#
#     ds = load_cached("json", split="train", cache_dir=..., data_files=[...])  # datasets'
#     tokens = cached_step(docs, cache_key("tokens", ...), "the tokens", lambda name: docs.map(
#         ..., new_fingerprint=name))   # a map or a filter, named by what decides its result
#
# A step is named by a key of our own (datasets' new_fingerprint), so that the files it will read
# are known, and checked, before datasets opens them.

# The cache files verified (or summed) in this process, as they were: each is checked once.
_cached_ok: set[tuple] = set()


def cache_key(*parts) -> str:
    """A step's name (16 hex digits, as datasets' own) from what decides its result: the input's
    fingerprint, the settings, and the source code of the functions (a change retokenizes)."""
    hasher = hashlib.sha256()
    for part in parts:
        text = inspect.getsource(part) if callable(part) else repr(part)
        hasher.update(len(text).to_bytes(8, "little") + text.encode())
    return hasher.hexdigest()[:16]


def cached_step(ds: datasets.Dataset, name: str, what: str, make: Callable) -> datasets.Dataset:
    """make(name): ds.map or ds.filter with new_fingerprint=name, whose result datasets caches
    beside ds's files as cache-NAME*.arrow. Those already there are checked first (a bad one
    removed, with a warning, and made again); those made now are summed."""
    if not ds.cache_files:  # a dataset in memory: so is its result
        return make(name)
    folder = os.path.dirname(ds.cache_files[0]["filename"])
    pattern = os.path.join(glob.escape(folder), f"cache-{name}*.arrow")
    try:
        with one_at_a_time(os.path.join(folder, f"cache-{name}.lock")):
            for path in sorted(glob.glob(pattern)):
                check_cached(path, what, [path])
            result = make(name)
            sum_cached(result, lambda path: os.path.basename(path).startswith(f"cache-{name}"))
    except OSError as e:  # a full disk, a quota, a file size limit: one line naming the cache
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        raise ValueError(
            f"--cache-dir: {what} cannot be written into {folder} ({e.strerror}); free space "
            f"there, or choose another --cache-dir"
        ) from e
    return result


def load_cached(path: str, name=None, *, split: str, cache_dir: str, streaming=False, **kwargs):
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
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    # The lock order, so that runs sharing a cache never wait on each other in a circle: a
    # process holds one of ours at a time (this one while it checks, prepares and reads the
    # corpus; cached_step's while it makes a step), datasets' own only under it. None is held
    # across a collective (main_process_first waits outside them) or while training: the ranks
    # of a node wait at most for the steps that other runs are making now.
    with one_at_a_time(f"{folder}_sums.lock"):
        return _load_checked(builder, folder, split)


def _load_checked(builder, folder: str, split: str):
    """load_cached's split, its builder's folder checked, prepared, read and summed."""
    info = os.path.join(folder, "dataset_info.json")  # datasets' sign of a prepared folder
    whole = os.path.isfile(info) and all(
        check_cached(found, "the corpus as read", [])
        for found in sorted(glob.glob(os.path.join(glob.escape(folder), "*.arrow")))
        if not os.path.basename(found).startswith("cache-")  # (a map's: cached_step checks it)
    )
    if not whole and os.path.isdir(folder):
        _remake_beside(builder, folder)
    builder.download_and_prepare()  # (a folder prepared: only its info read)
    try:
        ds = builder.as_dataset(split=split)
    except FileNotFoundError as e:  # a file of the prepared folder deleted (by hand, a cleanup)
        lacks = f"lacks a file ({str(e).strip().splitlines()[0]})"
        warning = f"warning: {folder} (the corpus as read, cached) {lacks}: making it again"
        print(warning, file=sys.stderr)
        _remake_beside(builder, folder)
        builder.download_and_prepare()
        ds = builder.as_dataset(split=split)
    sum_cached(ds, lambda file: os.path.dirname(file) == folder)
    return ds


def _remake_beside(builder, folder: str) -> None:
    """The corpus as read prepared anew beside `folder`, its files then renamed into it, each
    over the old one (atomic). Not datasets' own re-prepare, which deletes the folder and renames
    the new one into its place: with it went the files that other runs were making or reading
    there (their tokens, their windows; one then crashed at its map's rename). Here a run reading
    an old file keeps it (mapped: an unlinked file lives on while mapped), one that opens it anew
    finds the new one, the same documents, and every cache made from them stays."""
    beside = f"{folder}.remade"
    for cut_short in (beside, f"{beside}.incomplete"):  # (load_cached's lock: no other makes it)
        shutil.rmtree(cut_short, ignore_errors=True)
    builder.download_and_prepare(output_dir=beside)
    for name in sorted(os.listdir(beside)):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, f"{name}{SUMS}"))  # (summed anew once read)
        os.replace(os.path.join(beside, name), os.path.join(folder, name))
    os.rmdir(beside)
    for lock in (f"{beside}_builder.lock", f"{beside}.incomplete_info.lock"):  # (datasets' own)
        with contextlib.suppress(FileNotFoundError):
            os.remove(lock)


@contextlib.contextmanager
def one_at_a_time(lock: str):
    """Held by one process at a time (a POSIX lock on the file `lock`, which works on network
    file systems too): a run that shares --cache-dir with another waits while the other makes a
    step's files and sums them, then finds them whole, never a file between datasets' rename
    and its checksums (which it would take for one cut short, and make again)."""
    try:
        f = open(lock, "a")  # noqa: SIM115 - closed below, after the lock is released
    except OSError as e:  # a cache folder shared with another user, read-only to this one
        raise ValueError(
            f"--cache-dir: cannot write {lock} ({e.strerror or e}); choose another --cache-dir, "
            f"or make that one a directory this user can write to"
        ) from e
    with f:
        fcntl.lockf(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(f, fcntl.LOCK_UN)


def check_cached(path: str, what: str, remove: list[str]) -> bool:
    """True if the cache file `path` is whole (by its checksums); else False, a one-line warning,
    and the files `remove` (and their checksums) removed, for datasets to make them again."""
    stat = os.stat(path)
    seen = (path, stat.st_ino, stat.st_mtime_ns, stat.st_size)
    if seen in _cached_ok:
        return True
    sums = f"{path}{SUMS}"
    why = "has no checksums (a cache from before them, or one whose writing was cut short)"
    if os.path.isfile(sums):
        try:
            verify_sums(sums)
            _cached_ok.add(seen)
            return True
        except ValueError as e:  # (verify_sums names the file it found damaged)
            damaged = str(e).startswith(f"{path} is damaged")
            why = (
                "is damaged: its bytes are not those written"
                if damaged
                else f"has checksums that cannot be read ({e})"
            )
    try:
        for name in remove:
            for gone in (name, f"{name}{SUMS}"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(gone)
        print(f"warning: {path} ({what}, cached) {why}: making it again", file=sys.stderr)
        return False
    except OSError as e:  # a cache shared with another user, read-only to this one
        raise ValueError(
            f"{path} ({what}, cached) {why}, and cannot be removed ({e.strerror or e}): remove "
            f"it by hand, or choose another --cache-dir"
        ) from e


def sum_cached(ds: datasets.Dataset, made: Callable[[str], bool]) -> None:
    """The checksums, beside each, of ds's cache files that made(path) says this step wrote
    (those not verified yet: datasets just made them, whole, renamed into place)."""
    for path in dict.fromkeys(f["filename"] for f in ds.cache_files):
        stat = os.stat(path)
        seen = (path, stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if seen not in _cached_ok and made(path):
            write_sums({os.path.basename(path): checksums(path)}, f"{path}{SUMS}")
            _cached_ok.add(seen)
