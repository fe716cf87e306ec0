"""Files written whole, and checkpoint files found and read: every file of a run is written to a
temporary name beside it, flushed to disk, then renamed over it (os.replace is atomic on POSIX),
so a kill leaves the old file or the new, never half.
"""

import contextlib
import os
import re

import torch

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


def load_checkpoint(path: str) -> dict:
    """Load a checkpoint file; ValueError (with the reason) if it cannot be read."""
    try:
        # weights_only=True: unpickling may only rebuild tensors and plain containers, never run
        # code, so a checkpoint from someone else cannot execute anything on this machine.
        # mmap=True: tensors are paged in from the file as they are used, not read up front.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated, not a checkpoint, unsafe content: all mean "unusable"
        raise ValueError(f"cannot read checkpoint {path}: {e}") from e
