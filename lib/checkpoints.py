"""A run's --out-dir: checkpoints and final files, written so that a kill at any moment loses
nothing; one live run per directory (a lock); the checkpoint to resume from, checked to be this
run's; the record of each start's settings (args.jsonl). A `.pt` checkpoint (train_dp.py,
train_ddp.py, train_zero1.py) holds all a resumed run needs to go on exactly; the DCP
checkpoints of train_fsdp.py and its successors are lib/sharded_checkpoints.py's.
"""

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import re
import shlex
import shutil
import socket
import sys
import time
from pathlib import Path

import torch

from data import corpus_digest, tokenizer_digest
from lib.distributed import world_size_from_env
from lib.exits import TrainingError
from model import LlamaConfig

# -------------------------------------------------------------------------------------------------
# Every file is written atomically: to a temporary name beside it, flushed to disk, then renamed
# over it (os.replace is atomic on POSIX): a kill leaves the old file or the new, never half.

CHECKPOINT_RE = re.compile(r"step_(\d+)\.pt")  # a whole file name: step_0000100.pt
# train_fsdp.py's (and train_tp.py's, train_pp.py's): a DCP directory per step, step_0000100/
CHECKPOINT_DIR_RE = re.compile(r"step_(\d+)")
TEMP_RE = re.compile(r"\.tmp\d+$")  # what atomic_save/atomic_write_text write before renaming


def atomic_save(obj, path: str, write=torch.save) -> None:
    """write(obj, f) into a temporary file beside `path`, flushed to disk, renamed over `path`."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:
        # A full disk, say: remove the partial file (its space is needed); `path` is untouched.
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, RuntimeError) and isinstance(e.__context__, OSError):
            # torch.save's zip writer wraps a failed write in a RuntimeError: raise the OSError
            raise e.__context__ from e
        raise


def atomic_write_text(path: str, text: str) -> None:
    atomic_save(text.encode(), path, lambda data, f: f.write(data))


def list_checkpoints(out_dir: str, pattern: re.Pattern = CHECKPOINT_RE) -> list[str]:
    """Checkpoints in --out-dir, oldest first: the names in checkpoints/ that `pattern` matches
    whole, its first group the step."""
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    found = [(int(m.group(1)), name) for name in names if (m := pattern.fullmatch(name))]
    return [os.path.join(ckpt_dir, name) for _, name in sorted(found)]


@dataclasses.dataclass
class TrainingState:
    """What a checkpoint holds, besides the step, the RNG and the position in the data: the
    objects a lesson trains with. scaler: the grad scaler (None in the sharded lessons, which
    refuse fp16); config and tokenizer: what a resume checks it is the same run's."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: torch.amp.GradScaler | None
    config: LlamaConfig
    tokenizer: object


def save_checkpoint(args, step: int, state: TrainingState, data_position=None) -> str:
    """Write checkpoints/step_NNNNNNN.pt (checkpoint_state) atomically and keep the newest
    --keep-checkpoints; TrainingError in one line if it cannot be written (a full disk)."""
    state = checkpoint_state(state, step, args, data_position)
    out_dir, keep = args.out_dir, args.keep_checkpoints
    path = os.path.join(out_dir, "checkpoints", f"step_{step:07d}.pt")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_save(state, path)
    except OSError as e:  # the disk is full, ...: say so in one line, not a traceback
        raise save_failed(path, e) from e
    for old in list_checkpoints(out_dir)[:-keep]:
        os.remove(old)
    return path


def save_failed(path: str, error: BaseException, what: str = "the checkpoint") -> TrainingError:
    """The error for a checkpoint (or `what` else) that could not be written."""
    reason = getattr(error, "strerror", None) or str(error).strip().splitlines()[0]
    with contextlib.suppress(OSError):  # how full the disk is (DCP's errors do not say)
        reason += f" ({shutil.disk_usage(os.path.dirname(path)).free / 1e9:.2f} GB free there)"
    return TrainingError(f"could not save {what} {path}: {reason}. The checkpoints before it are "
                         f"intact: if the disk is full, make room, then run the same command "
                         f"again to resume")  # fmt: skip


def load_checkpoint(path: str) -> dict:
    """Load a checkpoint file; ValueError (with the reason) if it cannot be read."""
    try:
        # weights_only=True: unpickling may only rebuild tensors and plain containers, never run
        # code, so a checkpoint from someone else cannot execute anything on this machine.
        # mmap=True: tensors are paged in from the file as they are used, not read up front.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated, not a checkpoint, unsafe content: all mean "unusable"
        raise ValueError(f"cannot read checkpoint {path}: {e}") from e


# -------------------------------------------------------------------------------------------------
# Resumable state


def rng_state() -> dict:
    """Every random generator training uses: torch's CPU generator and each CUDA device's (the
    data order is derived from --seed and the epoch; Python's and NumPy's are never used)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def checkpoint_state(state: TrainingState, step: int, args, data_position=None) -> dict:
    """Everything a resumed run needs to continue exactly as if it had never stopped. step: the
    optimizer steps done, also the position in a cached dataset; data_position: a stream's."""
    return {
        "model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(), "scaler": state.scaler.state_dict(),
        "rng": rng_state(), "step": step, "config": state.config.to_dict(),
        "tokenizer_sha256": tokenizer_digest(state.tokenizer),
        "corpus_sha256": corpus_digest(state.tokenizer), "args": vars(args), "data": data_position,
    }  # fmt: skip


def resume(path: str | None, state: TrainingState, args) -> tuple[int, list[dict] | None]:
    """(step, data position) to start from: (0, None) without a checkpoint to resume (path None);
    else the checkpoint's, once loaded into the fresh model, optimizer, scheduler and scaler
    (ValueError, changing nothing, if it is another run's: restore_checkpoint)."""
    if path is None:
        return 0, None
    from lib.resuming import restore_checkpoint  # only when resuming

    start = restore_checkpoint(load_checkpoint(path), state, args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"resumed from {path} at step {start[0]}")
    return start


def save_final(out_dir: str, model, config: LlamaConfig, tokenizer) -> None:
    """model.pt (a plain state_dict of `model`; or written by `model`, a function of its path:
    a sharded lesson's, one tensor at a time), config.json and tokenizer.json: all
    tools/generate.py needs; and tokenizer_config.json, naming the special tokens as Hugging Face
    does (lib/hf_tokenizer.py)."""
    path = os.path.join(out_dir, "model.pt")
    if isinstance(model, torch.nn.Module):
        atomic_save(model.state_dict(), path)
    else:
        model(path)
    atomic_write_text(os.path.join(out_dir, "config.json"), json.dumps(config.to_dict(), indent=2))
    atomic_write_text(os.path.join(out_dir, "tokenizer.json"), tokenizer.to_str())
    special = json.dumps(tokenizer.config(), indent=2)
    atomic_write_text(os.path.join(out_dir, "tokenizer_config.json"), special)


# -------------------------------------------------------------------------------------------------
# The out-dir itself: one live run per directory, a killed run's debris cleared, and the
# checkpoint to resume from chosen (lib/sharded_checkpoints.py chooses among DCP directories
# likewise)

# One run per --out-dir (two would mix their files): the process that writes files holds a lock
# on this file for its whole life, and writes who it is into it, for a run it keeps out.
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
            print(f"warning: cannot lock {path} ({e.strerror}): nothing keeps a second run out "
                  f"of this --out-dir", file=sys.stderr)  # fmt: skip
            return
        try:
            h = json.loads(holder)
            who = f"pid {h['pid']} on {h['host']}, started {h['started']}: {h['command']}"
        except (ValueError, KeyError, TypeError):
            who = "it is starting"
        raise ValueError(f"--out-dir {out_dir} is in use by another run ({who}); wait for it to "
                         f"end or stop it, or choose another --out-dir") from None  # fmt: skip
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
    """At exit: empty the lock file, then release it (not deleted: two runs could then lock two
    files of that name)."""
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
            for name in os.listdir(folder):
                if TEMP_RE.search(name):
                    os.remove(os.path.join(folder, name))


def resume_never_error(out_dir: str) -> ValueError:
    return ValueError(f"--resume never, but {out_dir} has checkpoints (nothing was overwritten): "
                      f"--resume auto goes on, or choose another --out-dir")  # fmt: skip


def newest_readable(paths: list[str], state_file=lambda path: path) -> str | None:
    """The newest of `paths` (oldest first) whose state file loads: an unreadable newest one (a
    disk error, say) must not cost the run: say so, and fall back to the one before."""
    for path in reversed(paths):
        try:
            load_checkpoint(state_file(path))
            return path
        except ValueError as e:
            print(f"warning: {e}; trying an older checkpoint", file=sys.stderr)
    if paths:  # starting over would prune them: they may be readable again (a disk, a mount)
        raise ValueError(f"none of the {len(paths)} checkpoints in {os.path.dirname(paths[0])} "
                         f"can be read; move them aside to start at step 0")  # fmt: skip
    return None


def refuse_other_checkpoints(out_dir: str, sharded: bool) -> None:
    """ValueError if --out-dir holds the other kind of checkpoint than this script's (.pt files
    or DCP directories), which it could neither resume nor start beside without replacing."""
    if sharded:
        pattern, writers = CHECKPOINT_RE, "train_dp.py/train_ddp.py/train_zero1.py (.pt files)"
    else:
        pattern = CHECKPOINT_DIR_RE
        writers = "train_fsdp.py/train_tp.py/train_pp.py/train_cp.py/train_ep.py (directories)"
    if list_checkpoints(out_dir, pattern):
        raise ValueError(f"{out_dir} holds checkpoints of {writers}, which "
                         f"{os.path.basename(sys.argv[0])} can neither resume nor write beside; "
                         f"choose another --out-dir (a finished run's out-dir starts any script "
                         f"with --init-from)")  # fmt: skip


def start_from(out_dir: str, resume: str | None) -> str | None:
    """resume, once its metrics.jsonl is read (ValueError now if it cannot be). At step 0 instead,
    a previous run's (killed before its first checkpoint) moves aside to metrics.jsonl.1 (.2...)."""
    if resume is not None:
        read_metrics(os.path.join(out_dir, "metrics.jsonl"))
        return resume
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
    return None


def prepare_out_dir(args) -> str | None:
    """make_out_dir, then choose the checkpoint to resume from (None: start fresh)."""
    if args.resume not in ("never", "auto") and not os.path.isfile(args.resume):
        raise ValueError(f"--resume: no checkpoint file at {args.resume}")
    make_out_dir(args)
    if args.resume == "never":
        if list_checkpoints(args.out_dir):
            raise resume_never_error(args.out_dir)
        resume = None
    elif args.resume != "auto":
        load_checkpoint(args.resume)  # readable? (ValueError with the reason if not)
        resume = args.resume
    else:
        resume = newest_readable(list_checkpoints(args.out_dir))
    refuse_other_checkpoints(args.out_dir, sharded=False)
    return start_from(args.out_dir, resume)


def read_metrics(path: str) -> list[dict]:
    """metrics.jsonl's records ([] if none); ValueError for a line of JSON that is not a step's
    record, or a file that cannot be read."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the torn last line of a killed run
                if not isinstance(record, dict) or type(record.get("step")) is not int:
                    raise ValueError(f"{path} line {n} is not a step's record ({line.strip()[:40]}"
                                     f"): correct or delete that line")  # fmt: skip
                records.append(record)
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    return records


def record_run(args, settings, start_step: int) -> None:
    """Add a line to OUT_DIR/args.jsonl for this start (a resume may change --max-steps, ...):
    every flag's final value, the settings derived (flags.RunSettings), the command and the step
    it starts from; rewritten whole and atomically, once every check has passed."""
    path = os.path.join(args.out_dir, "args.jsonl")
    record = {
        "script": os.path.basename(sys.argv[0]), "command": shlex.join(sys.argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "world_size": world_size_from_env(),
        "start_step": start_step, "args": vars(args),
        "plan": dataclasses.asdict(settings),  # flags.RunSettings
    }  # fmt: skip
    try:
        previous = Path(path).read_text() if os.path.exists(path) else ""
        if previous and not previous.endswith("\n"):
            previous += "\n"
        atomic_write_text(path, previous + json.dumps(record) + "\n")
    except OSError as e:
        raise TrainingError(f"could not write {path}: {e.strerror or e}") from e
