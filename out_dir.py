"""The out-dir of a run: one live run per directory, a killed run's debris cleared, and the
checkpoint to resume from chosen (the .pt checkpoints of train_dp.py/ddp/zero1; the sharded
ones of train_fsdp.py/tp/pp choose theirs in sharded_checkpoints.py, with the same pieces).
"""

import atexit
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time

from checkpoints import (
    CHECKPOINT_DIR_RE,
    CHECKPOINT_RE,
    TEMP_RE,
    list_checkpoints,
    load_checkpoint,
)

# One run per --out-dir: two runs in one would mix their metrics.jsonl and overwrite each other's
# checkpoints. The process that writes files holds a lock on this file for its whole life, and
# writes into it who it is, for the message of a run it keeps out.
LOCK_FILE = ".lock"
_held_locks: dict[str, object] = {}  # out-dir -> its open lock file, in the process holding it


def lock_out_dir(out_dir: str) -> None:
    """Take --out-dir for this process, or raise ValueError naming the live run that holds it.

    A POSIX record lock (fcntl.lockf): the kernel releases it when its process ends, however it
    ends (kill -9, a crash), so a dead run never blocks the rerun. Not flock(): a forked child
    shares its parent's flock, and a DataLoader worker outliving a killed training process by
    a few seconds would keep out torchrun's restart of it; a record lock is one process's own.
    """
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
            print(f"warning: cannot lock {path} ({e.strerror}): nothing keeps a second run out "
                  f"of this --out-dir", file=sys.stderr)  # fmt: skip
            return
        try:
            h = json.loads(holder)
            who = f"pid {h['pid']} on {h['host']}, started {h['started']}: {h['command']}"
        except (ValueError, KeyError, TypeError):
            who = "it is starting"
        raise ValueError(
            f"--out-dir {out_dir} is in use by another run ({who}); wait for it to end or stop "
            f"it, or choose another --out-dir"
        ) from None
    f.seek(0)
    f.truncate()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": started,
          "command": shlex.join(sys.argv)}  # fmt: skip
    f.write(json.dumps(me) + "\n")
    f.flush()
    if not _held_locks:
        atexit.register(release_out_dir)  # however the process exits (but for a kill)
    _held_locks[path] = f


def release_out_dir() -> None:
    """At the end of the process: empty the lock file (nobody holds it), then release it.

    An empty file rather than none: deleting it could let two runs lock two different files of
    the same name. And a refused or finished run leaves the out-dir byte-identical."""
    for f in _held_locks.values():
        f.truncate(0)
        f.close()
    _held_locks.clear()


def make_out_dir(args) -> None:
    """Create --out-dir (ValueError if it cannot be written), take its lock (ValueError if a
    live run holds it) and clear a killed run's debris.

    Called by the one process that writes files. The temporary files of a process killed while
    writing never replaced a real file, so removing them loses nothing; and with the lock held,
    they cannot be a live run's.
    """
    try:
        os.makedirs(args.out_dir, exist_ok=True)
        probe = os.path.join(args.out_dir, f".write-test-{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--out-dir {args.out_dir} cannot be created or written: {e}") from e
    lock_out_dir(args.out_dir)
    for folder in (args.out_dir, os.path.join(args.out_dir, "checkpoints")):
        if os.path.isdir(folder):
            for name in os.listdir(folder):
                if TEMP_RE.search(name):
                    os.remove(os.path.join(folder, name))


def resume_never_error(out_dir: str) -> ValueError:
    return ValueError(
        f"--resume never, but {out_dir} already has checkpoints; pass --resume auto to continue "
        f"that run, or choose another --out-dir (nothing was overwritten)"
    )


def newest_readable(paths: list[str], state_file=lambda path: path) -> str | None:
    """The newest of `paths` (oldest first, as list_checkpoints gives them) whose state file
    loads. An unreadable newest one (a disk error, a crash mid-write on a filesystem without
    atomic rename) must not cost the whole run: fall back to the one before, saying so."""
    for path in reversed(paths):
        try:
            load_checkpoint(state_file(path))
            return path
        except ValueError as e:
            print(f"warning: {e}; trying an older checkpoint", file=sys.stderr)
    return None


def refuse_other_checkpoints(out_dir: str, sharded: bool) -> None:
    """ValueError if --out-dir holds the other kind of checkpoint than this script's: .pt files
    (train_dp.py, train_ddp.py, train_zero1.py) or DCP directories (train_fsdp.py, train_tp.py,
    train_pp.py).

    Neither kind resumes in the other's scripts, and a run that started at step 0 beside them
    would replace that run's model.pt and metrics, whatever --resume says.
    """
    if sharded:
        pattern, writers = CHECKPOINT_RE, "train_dp.py/train_ddp.py/train_zero1.py (.pt files)"
    else:
        pattern, writers = (
            CHECKPOINT_DIR_RE,
            "train_fsdp.py/train_tp.py/train_pp.py/train_cp.py (directories)",
        )
    if list_checkpoints(out_dir, pattern):
        raise ValueError(
            f"{out_dir} holds checkpoints of {writers}, which {os.path.basename(sys.argv[0])} can "
            f"neither resume nor write beside; choose another --out-dir (a finished run's out-dir "
            f"starts any script with --init-from)"
        )


def start_fresh(out_dir: str) -> None:
    """Before a run starts at step 0 in --out-dir: a previous run's metrics.jsonl moves aside, to
    metrics.jsonl.1 (.2, ...), and one printed line says what there was.

    That is a run killed before its first checkpoint (run again, or restarted by torchrun), or
    an out-dir whose checkpoints are gone: the steps it logged are not this run's, and neither
    appending to them nor dropping them silently would be what anyone wants.
    """
    found = [n for n in ("metrics.jsonl", "model.pt") if os.path.isfile(os.path.join(out_dir, n))]
    if not found:
        return
    note = f"note: {out_dir} has {' and '.join(found)} but no checkpoint: starting at step 0"
    if "metrics.jsonl" in found:
        metrics = os.path.join(out_dir, "metrics.jsonl")
        n = 1
        while os.path.exists(f"{metrics}.{n}"):
            n += 1
        os.replace(metrics, f"{metrics}.{n}")
        note += f"; its metrics.jsonl is now metrics.jsonl.{n}"
    if "model.pt" in found:
        note += "; model.pt will be replaced when this run ends"
    print(note)


def prepare_out_dir(args) -> str | None:
    """make_out_dir, then choose the checkpoint to resume from (None: start fresh)."""
    make_out_dir(args)
    if args.resume == "never":
        if list_checkpoints(args.out_dir):
            raise resume_never_error(args.out_dir)
        resume = None
    elif args.resume != "auto":
        if not os.path.isfile(args.resume):
            raise ValueError(f"--resume: no checkpoint file at {args.resume}")
        load_checkpoint(args.resume)  # readable? (ValueError with the reason if not)
        resume = args.resume
    else:
        resume = newest_readable(list_checkpoints(args.out_dir))
    refuse_other_checkpoints(args.out_dir, sharded=False)
    if resume is None:
        start_fresh(args.out_dir)
    return resume
