"""Files written whole, checkpoint files found, and their checksums. Every file of a run is written
to a temporary name beside it, flushed to disk, then renamed over it (os.replace is atomic on
POSIX), so a kill leaves the old file or the new, never half."""

import concurrent.futures
import contextlib
import json
import os
import re
import zlib

import torch

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
