"""Sharded checkpoints of train_fsdp.py, train_tp.py, train_pp.py and train_cp.py, written and
read with torch.distributed.checkpoint (DCP): checkpoints/step_NNNNNNN/ holds DCP's files (one
per rank, plus the .metadata that maps every tensor's pieces) and train_state.pt (schedule, RNG,
step, config). Every rank writes only its own shards; DCP reads back, on each rank, just the
pieces its shards cover, whatever the number of ranks that wrote them.
"""

import os
import shutil

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

import safe_dcp
from checkpoints import (
    CHECKPOINT_DIR_RE,
    atomic_save,
    check_resumable,
    list_checkpoints,
    load_checkpoint,
    resume_schedule,
    rng_state,
    save_failed,
    set_rng_state,
    tokenizer_digest,
)
from distributed import from_rank0
from out_dir import (
    make_out_dir,
    newest_readable,
    refuse_other_checkpoints,
    resume_never_error,
    start_fresh,
)

TRAIN_STATE = "train_state.pt"
# AdamW's state keyed per parameter ("state.layers.3.attention.wq.weight.exp_avg",
# "param_groups.layers.3.attention.wq.weight.lr"), not as one list of param_groups: a checkpoint
# then holds nothing that depends on how parameters are spread over ranks, so train_pp.py, whose
# pipeline ranks each own different parameters (and would each write another param_groups list
# under the same key), writes the same directories, and either script resumes the other's.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def prepare_out_dir(args, script: str) -> str | None:
    """Create --out-dir and choose the checkpoint directory to resume from (None: start fresh).

    As out_dir.prepare_out_dir, for checkpoint directories: called on rank 0 alone. `script`
    names the script in the messages (train_fsdp.py, train_tp.py and train_pp.py write the same
    directories).
    """
    make_out_dir(args)
    ckpt_dir = os.path.join(args.out_dir, "checkpoints")
    if os.path.isdir(ckpt_dir):  # directories of a run killed mid-save (never renamed)
        for name in os.listdir(ckpt_dir):
            if name.endswith(".tmp"):
                shutil.rmtree(os.path.join(ckpt_dir, name))
    if args.resume == "never":
        if list_checkpoints(args.out_dir, CHECKPOINT_DIR_RE):
            raise resume_never_error(args.out_dir)
        resume = None
    elif args.resume != "auto":
        if not os.path.isfile(os.path.join(args.resume, TRAIN_STATE)):
            raise ValueError(
                f"--resume: {args.resume} is not a {script} checkpoint directory (the .pt "
                f"checkpoints of train_dp.py/train_ddp.py/train_zero1.py do not resume here)"
            )
        resume = args.resume
    else:
        found = list_checkpoints(args.out_dir, CHECKPOINT_DIR_RE)
        # A directory is checked through its train state, the file this script loads first.
        resume = newest_readable(found, lambda path: os.path.join(path, TRAIN_STATE))
    refuse_other_checkpoints(args.out_dir, sharded=True)  # .pt files: train_dp/ddp's
    if resume is None:
        start_fresh(args.out_dir)
    return resume


def save_sharded_checkpoint(
    args, step, model, optimizer, scheduler, config, tokenizer, is_main, data_position=None
):
    """A collective: every rank calls it and writes only its own shards (no gather).
    data_position: training.data_positions() (rank 0's is saved), or None."""
    path = os.path.join(args.out_dir, "checkpoints", f"step_{step:07d}")
    tmp = f"{path}.tmp"

    def start() -> None:  # rank 0's part
        shutil.rmtree(tmp, ignore_errors=True)  # the leftovers of a run killed mid-save
        try:
            os.makedirs(tmp)
        except OSError as e:  # a full disk
            raise save_failed(path, e) from e

    # from_rank0's broadcast: the directory exists before anyone writes into it (or all stop).
    from_rank0(start, is_main)
    # get_state_dict: the model's and AdamW's state keyed by parameter name, as sharded DTensors.
    model_state, optim_state = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    try:
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
    except dcp.api.CheckpointException as e:  # raised on every rank if any rank's write failed
        # (a full disk): the partial directory goes, the previous checkpoints stay as they were.
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        # failures: {rank: (error, traceback)}. Sent between ranks without its context, a full
        # disk shows as torch.save's RuntimeError ("unexpected pos"), not as the OSError.
        cause = next(iter(e.failures.values()))[0]
        raise save_failed(path, cause) from e

    def finish() -> None:  # rank 0's part: the train state, then the rename that completes it
        train_state = {
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
            "step": step,
            "config": config.to_dict(),
            "tokenizer_sha256": tokenizer_digest(tokenizer),
            "corpus_sha256": tokenizer.corpus_sha256,  # what the data is (check_same_data)
            "args": vars(args),
            "data": data_position,
        }
        try:
            atomic_save(train_state, os.path.join(tmp, TRAIN_STATE))
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise save_failed(path, e) from e
        # Atomic as checkpoints.save_checkpoint's files: a directory is complete once renamed.
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)
        for old in list_checkpoints(args.out_dir, CHECKPOINT_DIR_RE)[: -args.keep_checkpoints]:
            shutil.rmtree(old)

    # On return, the checkpoint is complete for every rank; if rank 0's part failed, every rank
    # raises its error (from_rank0's broadcast), instead of the others waiting for rank 0.
    from_rank0(finish, is_main)


def load_sharded_checkpoint(
    path, model, optimizer, scheduler, config, args, tokenizer
) -> tuple[int, list[dict] | None]:
    """Load a checkpoint into the sharded model and optimizer; returns the step to continue from
    and the position in the data (as checkpoints.restore_checkpoint).

    DCP reads, on each rank, just the pieces of the tensors that rank's shards cover, whatever the
    number of ranks that wrote them: a run can resume on a different number of ranks.
    """
    train_state = load_checkpoint(os.path.join(path, TRAIN_STATE))
    check_resumable(train_state, config, args, tokenizer)  # before changing anything
    fresh_lrs = [group["lr"] for group in optimizer.param_groups]
    model_state, optim_state = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    state = {"model": model_state, "optimizer": optim_state}
    try:
        # dcp.load, minus the pickles that could run code (a crafted checkpoint): see safe_dcp.py.
        safe_dcp.load(state, path)  # in place, into the tensors of `state`
    except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - every rank fails alike
        # CheckpointException derives from BaseException, so it is named. The train state was
        # fine, so the shards are damaged (a disk error), hold what safe_dcp refuses to unpickle,
        # or are of a train_fsdp.py from before optimizer state was keyed per parameter: say
        # which directory, and what to do (rather than resume silently from an older one).
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (error, trace)}
        cause = next(iter(failures.values()))[0] if failures else e
        reason = (str(cause).strip() or type(cause).__name__).splitlines()[0].split(". ")[0]
        raise ValueError(
            f"could not load the sharded checkpoint {path}: {reason}; it "
            f"is damaged, unsafe or from an older version of this script. Resume from another one "
            f"(--resume {os.path.dirname(path)}/step_...), or start fresh in another --out-dir"
        ) from e
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
        options=STATE_DICT_OPTIONS,
    )  # fmt: skip
    # The schedule of this run's --max-steps, at the checkpoint's step (see resume_schedule).
    resume_schedule(scheduler, optimizer, fresh_lrs, train_state["step"])
    set_rng_state(train_state["rng"])
    return train_state["step"], train_state.get("data")
