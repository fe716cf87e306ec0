"""The checkpoints of train_dp.py, train_ddp.py and train_zero1.py: the whole model in one .pt
file per step (checkpoints/step_NNNNNNN.pt, its checksums beside it), written by rank 0 alone and
holding all a resumed run needs to go on exactly. DCP's, with the same interface (the package's
docstring shows it): sharded.py.
"""

import contextlib
import os

import torch.distributed as dist

from data import corpus_digest, tokenizer_digest
from lib.checkpoints import files
from lib.checkpoints.files import atomic_save, list_checkpoints
from lib.checkpoints.out_dir import (
    TrainingState,
    earlier_run,
    make_out_dir,
    rng_state,
    save_failed,
)
from lib.distributed import from_rank0


class Checkpoints:
    """A whole-file lesson's checkpoints. Under torchrun, rank 0 alone writes, and every rank
    learns what it chose or whether it could (from_rank0); in one process, it simply does it."""

    def __init__(self, args):
        self.args = args

    def prepare_out_dir(self) -> str | None:
        """prepare_out_dir on rank 0: the checkpoint to resume from (None: start fresh)."""
        return on_rank0(prepare_out_dir, self.args)

    def resume(self, path: str | None, state: TrainingState) -> tuple[int, list[dict] | None]:
        """(step, data position) to start from: (0, None) for path None; else the checkpoint's,
        once loaded into `state` on every rank (ValueError, changing nothing, if another run's)."""
        if path is None:
            return 0, None
        from lib.checkpoints.resuming import load_checkpoint, restore_checkpoint  # only then

        start = restore_checkpoint(load_checkpoint(path), state, self.args)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"resumed from {path} at step {start[0]}")
        return start

    def save(self, step: int, state: TrainingState, data_position=None) -> None:
        """save_checkpoint on rank 0; a full disk stops every rank (TrainingError)."""
        on_rank0(save_checkpoint, self.args, step, state, data_position)

    def finish(self, state: TrainingState, device) -> None:
        """The end of a run, on rank 0: model.pt (from `state.model` itself, whose names have no
        wrapper's prefix), config.json, tokenizer.json, the peak GPU memory (--plan) and a sample
        of the trained model (--sample-tokens)."""
        on_rank0(finish_run, self.args, state, device)


def on_rank0(fn, *args):
    """fn(*args) on rank 0 alone, every rank getting its result or its error (from_rank0), under
    torchrun; in one process (train_dp.py), simply fn(*args)."""
    if dist.is_available() and dist.is_initialized():
        return from_rank0(fn, dist.get_rank() == 0, *args)
    return fn(*args)


def prepare_out_dir(args) -> str | None:
    """make_out_dir, then the checkpoint to resume from (None: start fresh), which
    lib/checkpoints/resuming.py chooses where an earlier run left anything (imported only then)."""
    if args.resume not in ("never", "auto"):  # (checked before the out-dir is made)
        if not os.path.isfile(args.resume):
            raise ValueError(f"--resume: no checkpoint file at {args.resume}")
        from lib.checkpoints.resuming import load_checkpoint

        load_checkpoint(args.resume)  # intact and readable? (ValueError: what is wrong)
    make_out_dir(args)
    if args.resume in ("never", "auto") and not earlier_run(args.out_dir):
        return None
    from lib.checkpoints.resuming import choose_checkpoint

    return choose_checkpoint(args)


def save_checkpoint(args, step: int, state: TrainingState, data_position=None) -> str:
    """Write checkpoints/step_NNNNNNN.pt (checkpoint_state) atomically and keep the newest
    --keep-checkpoints; TrainingError in one line if it cannot be written (a full disk)."""
    state = checkpoint_state(state, step, args, data_position)
    out_dir, keep = args.out_dir, args.keep_checkpoints
    path = os.path.join(out_dir, "checkpoints", f"step_{step:07d}.pt")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_save(state, path, sums=True)
    except OSError as e:  # the disk is full, ...: say so in one line, not a traceback
        raise save_failed(path, e) from e
    for old in list_checkpoints(out_dir)[:-keep]:
        os.remove(old)
        with contextlib.suppress(FileNotFoundError):  # (one from before checksums has none)
            os.remove(f"{old}{files.SUMS}")
    return path


def checkpoint_state(state: TrainingState, step: int, args, data_position=None) -> dict:
    """Everything a resumed run needs to continue exactly as if it had never stopped. step: the
    optimizer steps done, also the position in a cached dataset; data_position: a stream's."""
    return {
        "model": state.model.state_dict(),
        "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(),
        "scaler": state.scaler.state_dict(),
        "rng": rng_state(),
        "step": step,
        "config": state.config.to_dict(),
        "tokenizer_sha256": tokenizer_digest(state.tokenizer),
        "corpus_sha256": corpus_digest(state.tokenizer),
        "args": vars(args),
        "data": data_position,
    }


def finish_run(args, state: TrainingState, device) -> None:
    """Checkpoints.finish's work, on the process that writes files."""
    from lib.checkpoints.model_pt import save_final_files  # at the end of a run

    save_final_files(args, state.model, state.config, state.tokenizer, device)
    if args.sample_tokens:
        from lib.extras.sampling import print_sample  # at the end of a run

        print_sample(args, state.model.to(device), state.tokenizer)
