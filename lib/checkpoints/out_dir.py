"""What both kinds of checkpoint share (one_file.py's .pt files, sharded.py's DCP directories):
what a checkpoint holds (TrainingState) and the RNG state; the run's --out-dir, one live run per
directory (a lock) and a killed run's debris cleared; each start's settings (args.jsonl); the final
files (model.pt, config.json, tokenizer.json); a write that failed, said in one line.
"""

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import shlex
import shutil
import socket
import sys
import time
from pathlib import Path

import torch

from lib.checkpoints import files
from lib.checkpoints.files import atomic_write_text
from lib.distributed import world_size_from_env
from lib.exits import TrainingError
from model import LlamaConfig


@dataclasses.dataclass
class TrainingState:
    """What a checkpoint holds besides the step, RNG and data position. scaler: fp16's grad scaler
    (None where a caller has none); config and tokenizer: what a resume checks is the same run's."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: torch.amp.GradScaler | None
    config: LlamaConfig
    tokenizer: object


def save_failed(path: str, error: BaseException, what: str = "the checkpoint") -> TrainingError:
    """The error for a checkpoint (or `what` else) that could not be written."""
    # (an error may have no message at all: DCP's, wrapping another, has none of its own)
    reason = getattr(error, "strerror", None) or first_line(error)
    with contextlib.suppress(OSError):  # how full the disk is (DCP's errors do not say)
        reason += f" ({shutil.disk_usage(os.path.dirname(path)).free / 1e9:.2f} GB free there)"
    remedy = {
        errno.EACCES: "give this user permission to write there",
        errno.EPERM: "give this user permission to write there",
        errno.EROFS: "the filesystem is read-only: choose another --out-dir",
        errno.EDQUOT: "raise the disk quota or make room",
        errno.EFBIG: file_size_limit() or "the file is too large for this filesystem",
    }.get(getattr(error, "errno", None), None)
    if remedy is None:  # no errno (DCP's errors, sent between ranks, lose it): what it may be
        remedy = "if the disk is full, make room"
        if limit := file_size_limit():
            remedy = f"{limit}; or, {remedy}"
    return TrainingError(
        f"could not save {what} {path}: {reason}. The checkpoints before it "
        f"are intact: {remedy}, then run the same command again to "
        f"resume"
    )


def first_line(error: BaseException) -> str:
    """The first line of an error's message, or its type's name where it has none."""
    return (str(error).strip() or type(error).__name__).splitlines()[0]


def file_size_limit() -> str | None:
    """What to say of this process's file-size limit (`ulimit -f`; EFBIG past it), if one is set."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return None
    if limit == resource.RLIM_INFINITY:
        return None
    return (
        f"this process may write files of at most {limit} bytes (a file-size limit: "
        f"`ulimit -f`): raise it"
    )


# -------------------------------------------------------------------------------------------------
# Resumable state


def rng_state() -> dict:
    """Every random generator training uses: torch's CPU generator and each CUDA device's (the
    data order is derived from --seed and the epoch; Python's and NumPy's are never used)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


# -------------------------------------------------------------------------------------------------
# The out-dir itself: one live run per directory, a killed run's debris cleared (the checkpoint
# to resume from: each kind's prepare_out_dir, one_file.py's and sharded.py's)

# One run per --out-dir (two would mix files): its writer locks this file for life, named in it.
LOCK_FILE = ".lock"
_held_locks: dict[str, object] = {}  # out-dir -> its open lock file, in the process holding it


def lock_out_dir(out_dir: str) -> None:
    """Take --out-dir for this process (ValueError naming a live run that holds it): a record
    lock, which the kernel releases however the process ends (not flock(), which children share)."""
    path = os.path.join(out_dir, LOCK_FILE)
    if path in _held_locks:
        return
    f = open(path, "a+")  # never truncated before the lock is ours: it names the holder
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.seek(0)
        holder = f.read()
        f.close()
        if e.errno not in (errno.EACCES, errno.EAGAIN):  # a filesystem without locks
            print(
                f"warning: cannot lock {path} ({e.strerror}): nothing keeps a second run out "
                f"of this --out-dir",
                file=sys.stderr,
            )
            return
        try:
            h = json.loads(holder)
            who = f"pid {h['pid']} on {h['host']}, started {h['started']}: {h['command']}"
        except (ValueError, KeyError, TypeError):
            who = "it is starting"
        raise ValueError(
            f"--out-dir {out_dir} is in use by another run ({who}); wait for it to "
            f"end or stop it, or choose another --out-dir"
        ) from None
    f.seek(0)
    f.truncate()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": started,
        "command": shlex.join(sys.argv),
    }
    f.write(json.dumps(me) + "\n")
    f.flush()
    if not _held_locks:
        atexit.register(release_out_dir)  # however the process exits (but for a kill)
    _held_locks[path] = f


def release_out_dir() -> None:
    """At exit: empty, then release the lock file (if deleted, two runs could lock two files)."""
    for f in _held_locks.values():
        f.truncate(0)
        f.close()
    _held_locks.clear()


def make_out_dir(args) -> None:
    """Create --out-dir, take its lock (ValueError if either fails) and clear a killed run's
    temporary files, which never replaced a real file. Called by the process that writes."""
    try:
        os.makedirs(args.out_dir, exist_ok=True)
        probe = os.path.join(args.out_dir, f".write-test-{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
        lock_out_dir(args.out_dir)  # (ValueError if another run holds it)
        if os.path.lexists(folder := os.path.join(args.out_dir, "checkpoints")):
            os.listdir(folder)  # NotADirectoryError if a file took its name
    except OSError as e:
        raise ValueError(f"--out-dir {args.out_dir} cannot be created or written: {e}") from e
    for folder in (args.out_dir, os.path.join(args.out_dir, "checkpoints")):
        if os.path.isdir(folder):
            names = os.listdir(folder)
            for name in names:  # and checksums whose checkpoint was never renamed into place
                orphan = name.endswith(f".pt{files.SUMS}") and name[: -len(files.SUMS)] not in names
                if files.TEMP_RE.search(name) or orphan:
                    os.remove(os.path.join(folder, name))


def earlier_run(out_dir: str) -> bool:
    """Whether an earlier run left checkpoints, metrics.jsonl or model.pt in --out-dir."""
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    return any(os.path.exists(os.path.join(out_dir, n)) for n in ("metrics.jsonl", "model.pt")) or (
        os.path.isdir(ckpt_dir) and bool(os.listdir(ckpt_dir))
    )


def record_run(args, settings, start_step: int) -> None:
    """A line in OUT_DIR/args.jsonl for this start (a resume may change --max-steps, ...): the
    flags, flags.RunSettings, the command and start step; written atomically once checks pass."""
    path = os.path.join(args.out_dir, "args.jsonl")
    record = {
        "script": os.path.basename(sys.argv[0]),
        "command": shlex.join(sys.argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "world_size": world_size_from_env(),
        "start_step": start_step,
        "args": vars(args),
        "plan": dataclasses.asdict(settings),  # flags.RunSettings
    }
    try:
        previous = Path(path).read_text() if os.path.exists(path) else ""
        if previous and not previous.endswith("\n"):
            previous += "\n"
        atomic_write_text(path, previous + json.dumps(record) + "\n")
    except OSError as e:
        raise TrainingError(f"could not write {path}: {e.strerror or e}") from e
