"""Sharded checkpoints of train_fsdp.py, train_tp.py, train_pp.py and train_cp.py, written and
read with torch.distributed.checkpoint (DCP): checkpoints/step_NNNNNNN/ holds DCP's files (one
per rank, plus the .metadata that maps every tensor's pieces) and train_state.pt (schedule, RNG,
step, config). Every rank writes only its own shards; DCP reads back, on each rank, just the
pieces its shards cover, whatever the number of ranks that wrote them.

Loading runs no code from the directory. dcp.load unpickles two things that a crafted checkpoint
could turn into code run on resume:
  - the `.metadata` file (which file holds which piece of which tensor): DCP's FileSystemReader
    reads it with plain pickle.load, which calls whatever function the file names;
  - every value that is not a tensor (here AdamW's per-parameter lr, betas, weight decay, ...):
    DCP's DefaultLoadPlanner reads it with torch.load(weights_only=False), the same.
safe_load_options(path) gives dcp.load the reader and planner that close both (safe_load calls
it so). `.metadata` goes through an Unpickler that resolves only the classes DCP's metadata is
built from (METADATA_GLOBALS: every global that the .metadata files of these scripts name) and
refuses any other; values go through torch.load(weights_only=True), plain data only. Tensors DCP
already reads that way.
"""

import contextlib
import io
import os
import pickle
import shutil
import sys
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from data import tokenizer_digest
from lib import training
from lib.checkpoints import (
    CHECKPOINT_DIR_RE,
    TrainingState,
    atomic_save,
    list_checkpoints,
    load_checkpoint,
    make_out_dir,
    newest_readable,
    refuse_other_checkpoints,
    resume_never_error,
    resume_schedule,
    rng_state,
    save_failed,
    set_rng_state,
    start_from,
)
from lib.distributed import from_rank0
from model import LlamaForPretraining

TRAIN_STATE = "train_state.pt"
# AdamW's state keyed per parameter ("state.layers.3.attention.wq.weight.exp_avg",
# "param_groups.layers.3.attention.wq.weight.lr"), not as one list of param_groups: a checkpoint
# then holds nothing that depends on how parameters are spread over ranks, so train_pp.py, whose
# pipeline ranks each own different parameters (and would each write another param_groups list
# under the same key), writes the same directories, and either script resumes the other's.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def prepare_out_dir(args, script: str | None = None) -> str | None:
    """Create --out-dir and choose the checkpoint directory to resume from (None: start fresh).

    As checkpoints.prepare_out_dir, for checkpoint directories: called on rank 0 alone. `script`
    names the script in the messages (default: this one; train_fsdp.py, train_tp.py, ... write
    the same directories).
    """
    script = script or os.path.basename(sys.argv[0])
    if args.resume not in ("never", "auto") and not os.path.isfile(
        os.path.join(args.resume, TRAIN_STATE)
    ):  # (checked before the out-dir is made: a refused run leaves none behind)
        raise ValueError(
            f"--resume: {args.resume} is not a {script} checkpoint directory (the .pt "
            f"checkpoints of train_dp.py/train_ddp.py/train_zero1.py do not resume here)"
        )
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
        resume = args.resume
    else:
        found = list_checkpoints(args.out_dir, CHECKPOINT_DIR_RE)
        # A directory is checked through its train state, the file this script loads first.
        resume = newest_readable(found, lambda path: os.path.join(path, TRAIN_STATE))
    refuse_other_checkpoints(args.out_dir, sharded=True)  # .pt files: train_dp/ddp's
    return start_from(args.out_dir, resume)


@contextlib.contextmanager
def save_shards(
    args, step: int, state: TrainingState, data_position=None
) -> Iterator[tuple[dict, str]]:
    """Around the lesson's dcp.save(shards, checkpoint_id=path): yields (shards, path), the
    model's and AdamW's state as sharded DTensors keyed by parameter name, and the directory to
    write them to. A collective: every rank enters it and writes only its own shards (no
    gather). data_position: training.data_positions() (rank 0's is saved), or None.

    path is a temporary directory, made by rank 0 before anyone writes into it; once every rank
    has written, rank 0 adds the train state and renames it into place, so that a directory
    named step_NNNNNNN is always complete. A failed write (a full disk) on any rank removes it,
    keeps the previous checkpoints as they were, and raises one TrainingError on every rank."""
    path = os.path.join(args.out_dir, "checkpoints", f"step_{step:07d}")
    tmp = f"{path}.tmp"
    is_main = dist.get_rank() == 0
    model, optimizer, scheduler = state.model, state.optimizer, state.scheduler
    config, tokenizer = state.config, state.tokenizer

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
        yield {"model": model_state, "optimizer": optim_state}, tmp  # the lesson's dcp.save
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


@contextlib.contextmanager
def load_shards(
    path: str, state: TrainingState, args
) -> Iterator[tuple[dict, tuple[int, list[dict] | None]]]:
    """Around the lesson's dcp.load(shards, **safe_load_options(path)): yields (shards, start),
    the sharded model's and AdamW's state to load into, in place, and the checkpoint's (step,
    data position) to go on from (checkpoints.resume's). Its train state is checked against this
    run before anything changes; after the load, the model and optimizer get the state, and the
    schedule and RNG theirs.

    DCP reads, on each rank, just the pieces of the tensors that rank's shards cover, whatever the
    number of ranks that wrote them: a run can resume on a different number of ranks.
    """
    model, optimizer = state.model, state.optimizer
    train_state = load_checkpoint(os.path.join(path, TRAIN_STATE))
    from lib.resume_checks import check_resumable  # (before changing anything)

    check_resumable(train_state, state.config, args, state.tokenizer)
    fresh_lrs = [group["lr"] for group in optimizer.param_groups]
    model_state, optim_state = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    shards = {"model": model_state, "optimizer": optim_state}
    try:
        # The lesson's dcp.load, in place, into the tensors of `shards`.
        yield shards, (train_state["step"], train_state.get("data"))
    except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - every rank fails alike
        # CheckpointException derives from BaseException, so it is named. The train state was
        # fine, so the shards are damaged (a disk error), hold what safe_load_options refuses to
        # unpickle, or are of a train_fsdp.py from before optimizer state was keyed per
        # parameter: say which directory, and what to do (not resume silently from an older one).
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (error, trace)}
        cause = next(iter(failures.values()))[0] if failures else e
        reason = (str(cause).strip() or type(cause).__name__).splitlines()[0].split(". ")[0]
        raise ValueError(
            f"could not load the sharded checkpoint {path}: {reason}; it "
            f"is damaged, unsafe or from an older version of this script. Resume from another one "
            f"(--resume {os.path.dirname(path)}/step_...), or start fresh in another --out-dir"
        ) from e
    set_state_dict(
        model, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"],
        options=STATE_DICT_OPTIONS,
    )  # fmt: skip
    # The schedule of this run's --max-steps, at the checkpoint's step (see resume_schedule).
    resume_schedule(state.scheduler, optimizer, fresh_lrs, train_state["step"])
    set_rng_state(train_state["rng"])
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {train_state['step']}")


# -------------------------------------------------------------------------------------------------
# The end of a run: model.pt from the last checkpoint


def finish_run(args, state: TrainingState, device) -> None:
    """The end of a sharded lesson's run: model.pt, config.json, tokenizer.json and the sample
    (training.finish_run), on rank 0, from the last checkpoint, which the loop always writes at
    the last step. Every tensor is there under its full name, whatever layout wrote it (FSDP,
    TP, pipeline stages): rank 0 reads it back alone, with no collective, and every rank learns
    whether it could (from_rank0). Like resuming, it needs --out-dir on a filesystem rank 0 can
    read."""

    def write() -> None:
        plain = LlamaForPretraining(state.config)
        load_checkpoint_weights(plain, list_checkpoints(args.out_dir, CHECKPOINT_DIR_RE)[-1])
        training.finish_run(args, plain, state.config, state.tokenizer, device)

    from_rank0(write, dist.get_rank() == 0)


def load_checkpoint_weights(model, path: str) -> None:
    """Load the model weights of the DCP checkpoint `path` into a whole (plain) `model`, in this
    process alone: no collective, so rank 0 can do it by itself; safe_load: no pickle in the
    directory can run code."""
    weights = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        safe_load(weights, path, no_dist=True)
    model.load_state_dict(weights["model"])


# -------------------------------------------------------------------------------------------------
# Loading without running code from the directory

METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
            "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *((module, name) for module in ("pathlib", "pathlib._local")
      for name in ("PosixPath", "WindowsPath")),
}  # fmt: skip


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves METADATA_GLOBALS and torch dtypes, and nothing else.

    A pickle can only run code through the globals it names (a function or class to call), so
    refusing every other name, before its module is even imported, leaves it nothing to run.
    """

    def find_class(self, module: str, name: str):
        # vars(), not getattr(): torch's module __getattr__ would import whatever it is asked for.
        is_dtype = module == "torch" and isinstance(vars(torch).get(name), torch.dtype)
        if (module, name) in METADATA_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refused to unpickle {module}.{name}: it is not one of DCP's metadata types"
        )


class SafeFileSystemReader(dcp.FileSystemReader):
    """dcp.FileSystemReader whose read_metadata unpickles only DCP's metadata types.

    The rest (reading the tensors, storage_data, resharding) is FileSystemReader's. Unlike its
    read_metadata, this one takes no rank: DCP then never falls back to per-rank
    `__<rank>.metadata` files, which these scripts do not write.
    """

    def read_metadata(self) -> Metadata:
        path = os.path.join(self.path, ".metadata")  # DCP's file name for it
        try:
            with open(path, "rb") as f:
                metadata = MetadataUnpickler(f).load()
        except Exception as e:  # refused, truncated, missing: all mean "cannot load this"
            raise ValueError(f"cannot read {path}: {e}") from e
        if not isinstance(metadata, Metadata):
            raise ValueError(f"cannot read {path}: it holds a {type(metadata).__name__}")
        # What FileSystemReader.read_metadata does after unpickling, kept as it is.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads the values that are not tensors with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)  # numbers, strings, tuples, tensors
        except Exception as e:
            raise ValueError(f"refused to unpickle the value of {fqn}: not plain data") from e
        # DefaultLoadPlanner.load_bytes puts the value where it belongs in the nested state
        # dict, but unpickles it with weights_only=False: hand it a copy written from the plain
        # object just read, which holds nothing but what weights_only=True allowed.
        safe = io.BytesIO()
        torch.save(obj, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


def safe_load_options(path: str) -> dict:
    """dcp.load's keyword arguments that make it run no code from `path`:
    dcp.load(state_dict, **safe_load_options(path)). ValueError (naming the file) for a .metadata it
    refuses, here and now; a refused value fails dcp.load itself."""
    reader = SafeFileSystemReader(path)
    # Read once here first: a refused .metadata then ends in the ValueError above. Inside
    # dcp.load the same failure is logged with a traceback, then reported as "metadata is None".
    reader.read_metadata()
    return {"storage_reader": reader, "planner": SafeLoadPlanner()}


def safe_load(state_dict: dict, path: str, no_dist: bool = False) -> None:
    """dcp.load(state_dict, checkpoint_id=path, no_dist=no_dist) that runs no code from path."""
    dcp.load(state_dict, **safe_load_options(path), no_dist=no_dist)
