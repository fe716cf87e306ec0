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
import functools
import io
import mmap
import os
import pickle
import shlex
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
from lib.checkpoints import TrainingState, files, make_out_dir, rng_state, save_failed
from lib.checkpoints.files import CHECKPOINT_DIR_RE, atomic_save, list_checkpoints
from lib.checkpoints.resuming import (
    load_checkpoint,
    newest_readable,
    refuse_other_checkpoints,
    resume_never_error,
    start_from,
    verify_sums,
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
    # (checked before the out-dir is made: a refused run leaves none behind)
    if args.resume not in ("never", "auto") and os.path.basename(args.resume) == TRAIN_STATE:
        raise ValueError(f"--resume names a checkpoint by its directory: --resume "
                         f"{os.path.dirname(args.resume) or '.'}")  # fmt: skip
    if args.resume not in ("never", "auto") and not os.path.isfile(
        os.path.join(args.resume, TRAIN_STATE)
    ):
        raise ValueError(
            f"--resume: {args.resume} is not a {script} checkpoint directory (the .pt "
            f"checkpoints of train_dp.py/train_ddp.py/train_zero1.py do not resume here)"
        )
    if args.resume not in ("never", "auto"):
        check_directory(args.resume)  # intact? (ValueError naming the damaged file if not)
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
        resume = args.resume  # (checked above)
    else:
        found = list_checkpoints(args.out_dir, CHECKPOINT_DIR_RE)
        resume = newest_readable(found, check_directory)  # the newest intact one
    refuse_other_checkpoints(args.out_dir, sharded=True)  # .pt files: train_dp/ddp's
    return start_from(args.out_dir, resume)


def check_directory(path: str) -> None:
    """ValueError unless the checkpoint directory is intact: every file as its checksums say
    (where it has them: files.SUMS), and its train state loads."""
    if os.path.isfile(sums := os.path.join(path, files.SUMS)):
        verify_sums(sums)
    load_checkpoint(os.path.join(path, TRAIN_STATE))


class ShardedSaves:
    """The sharded lessons' checkpoints, around their dcp.save (or, with --async-save,
    dcp.async_save) into checkpoints/step_NNNNNNN/: each rank writes only its own shards, with no
    gather. A directory of that name is always complete: the shards go to step_NNNNNNN.tmp, and
    once every rank has written, rank 0 adds the train state and renames it into place.

    --async-save: dcp.async_save copies this rank's shards to CPU memory (its staging copy: the
    rank's weights and AdamW state, 12 bytes per parameter of its shards, in host memory until
    written) and returns; a thread writes them while training goes on, with its collectives on a
    gloo group of its own (`group`), never mixed with training's. The checkpoint is renamed into
    place only once written: before the next one starts (`finish`), and before the run's end.
    A kill meanwhile leaves step_NNNNNNN.tmp, removed at the next start, and the checkpoint before
    it complete: resuming from it is bit for bit the same."""

    def __init__(self, args, state: TrainingState):
        self.args, self.state = args, state
        self.is_main = dist.get_rank() == 0
        # A group of its own for the background save (a collective: every rank creates it).
        self.group = dist.new_group(backend="gloo") if args.async_save else None
        self.job = None  # dcp.async_save's future: the save in flight, set by the lesson
        self._pending = None  # (path, tmp, train state) of the checkpoint written now

    @contextlib.contextmanager
    def checkpoint(self, step: int, data_position=None) -> Iterator[tuple[dict, str]]:
        """Around the lesson's dcp.save(to_save, checkpoint_id=path): yields (to_save, path), the
        model's and AdamW's state as sharded DTensors keyed by parameter name, and the directory
        to write them to. A collective: every rank enters it. The checkpoint in flight, if any,
        is finished first. data_position: training.data_positions() (rank 0's is saved). A
        failed write (a full disk) on any rank removes the directory, keeps the previous
        checkpoints as they were, and raises one TrainingError on every rank."""
        self.finish()
        args, state = self.args, self.state
        path = os.path.join(args.out_dir, "checkpoints", f"step_{step:07d}")
        tmp = f"{path}.tmp"

        def start() -> None:  # rank 0's part
            shutil.rmtree(tmp, ignore_errors=True)  # the leftovers of a run killed mid-save
            try:
                os.makedirs(tmp)
            except OSError as e:  # a full disk
                raise save_failed(path, e) from e

        # from_rank0's broadcast: the directory exists before anyone writes into it (or all stop).
        from_rank0(start, self.is_main)
        # The train state of this step, taken now: the run goes on before an async save is done.
        train_state = {
            "scheduler": state.scheduler.state_dict(), "rng": rng_state(), "step": step,
            "config": state.config.to_dict(), "tokenizer_sha256": tokenizer_digest(state.tokenizer),
            "corpus_sha256": state.tokenizer.corpus_sha256,  # what the data is (check_same_data)
            "args": vars(args), "data": data_position,
        }  # fmt: skip
        # get_state_dict: the model's and AdamW's state keyed by parameter name, sharded DTensors.
        model_state, optim_state = get_state_dict(
            state.model, state.optimizer, options=STATE_DICT_OPTIONS
        )
        self._pending = (path, tmp, train_state)
        try:
            yield {"model": model_state, "optimizer": optim_state}, tmp  # the lesson's dcp.save
        except dcp.api.CheckpointException as e:  # raised on every rank if any rank's failed
            self._failed(e)
        if self.job is None:
            self.finish()  # written: complete it now

    def finish(self) -> None:
        """Complete the checkpoint being written, if any: wait for the async save in flight (a
        failure raises on every rank), then rank 0 adds the train state and renames the
        directory into place, and every rank learns whether it could (from_rank0)."""
        if self._pending is None:
            return
        if self.job is not None:
            future, self.job = self.job, None
            try:
                future.result()
            except dcp.api.CheckpointException as e:
                self._failed(e)
        (path, tmp, train_state), self._pending = self._pending, None
        # The checksums of the files each rank wrote (DCP names them __RANK_N.distcp; rank 0's
        # .metadata too), gathered on rank 0, which writes them all beside them (files.SUMS).
        rank, sums = dist.get_rank(), [None] * dist.get_world_size()
        own = (f"__{rank}_", ".metadata") if rank == 0 else (f"__{rank}_",)
        written = [n for n in os.listdir(tmp) if n.startswith(own)]
        mine = {n: files.checksums(os.path.join(tmp, n)) for n in written}
        dist.all_gather_object(sums, mine)

        def complete() -> None:  # rank 0's part: the train state, the checksums, the rename
            try:
                atomic_save(train_state, os.path.join(tmp, TRAIN_STATE))
                every = {name: crcs for part in sums for name, crcs in part.items()}
                every[TRAIN_STATE] = files.checksums(os.path.join(tmp, TRAIN_STATE))
                files.write_sums(every, os.path.join(tmp, files.SUMS))
            except OSError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise save_failed(path, e) from e
            # Atomic as checkpoints.save_checkpoint's files: a directory is complete once renamed.
            shutil.rmtree(path, ignore_errors=True)
            os.rename(tmp, path)
            keep = self.args.keep_checkpoints
            for old in list_checkpoints(self.args.out_dir, CHECKPOINT_DIR_RE)[:-keep]:
                shutil.rmtree(old)

        # Once it returns, the checkpoint is complete for every rank; if rank 0's part failed,
        # every rank raises its error, instead of the others waiting for rank 0.
        from_rank0(complete, self.is_main)

    def _failed(self, e) -> None:
        """A write failed on some rank (a full disk): the partial directory goes, the previous
        checkpoints stay as they were, and every rank raises one TrainingError."""
        (path, tmp, _), self._pending = self._pending, None
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        # failures: {rank: (error, traceback)}. Sent between ranks without its context, a full
        # disk shows as torch.save's RuntimeError ("unexpected pos"), not as the OSError.
        cause = next(iter(e.failures.values()))[0]
        raise save_failed(path, cause) from e


@contextlib.contextmanager
def load_shards(
    path: str | None, state: TrainingState, args
) -> Iterator[tuple[dict | None, tuple[int, list[dict] | None]]]:
    """Around the lesson's dcp.load(to_load, **safe_load_options(path)): yields (to_load,
    start), the sharded model's and AdamW's state to load into, in place, and the checkpoint's
    (step, data position) to go on from (checkpoints.resume's); (None, (0, None)) without a
    checkpoint to resume (path None). Its train state is checked against this run before
    anything changes; after the load, the model and optimizer get the state, and the schedule
    and RNG theirs.

    DCP reads, on each rank, just the pieces of the tensors that rank's shards cover, whatever the
    number of ranks that wrote them: a run can resume on a different number of ranks.
    """
    if path is None:
        yield None, (0, None)
        return
    model, optimizer = state.model, state.optimizer
    train_state = load_checkpoint(os.path.join(path, TRAIN_STATE))
    from lib.checkpoints.resuming import check_resumable  # (before changing anything)

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
    from lib.checkpoints.resuming import resume_schedule, set_rng_state

    resume_schedule(state.scheduler, optimizer, fresh_lrs, train_state["step"])
    set_rng_state(train_state["rng"])
    if dist.get_rank() == 0:
        print(f"resumed from {path} at step {train_state['step']}")


def resume(path: str | None, state: TrainingState, args) -> tuple[int, list[dict] | None]:
    """train_fsdp.py's resume, for the lessons after it: dcp.load into load_shards' tensors;
    returns the (step, data position) to go on from ((0, None) without a checkpoint)."""
    with load_shards(path, state, args) as (to_load, start):
        if path:
            dcp.load(to_load, **safe_load_options(path))
    return start


# -------------------------------------------------------------------------------------------------
# The end of a run: model.pt from the last checkpoint


def finish_run(args, saves: ShardedSaves, device) -> None:
    """The end of a sharded lesson's run, on rank 0, with no collective: model.pt written one
    tensor at a time from the checkpoint of the last step (which the loop always writes; every
    tensor is there under its full name, whatever layout wrote it), then config.json and
    tokenizer.json: no process ever holds the whole model. The sample needs the whole model in
    one process: made where it was anyway (one process), else skipped with a word on how to get
    one. Every rank learns whether rank 0 could write (from_rank0). Like resuming, it needs
    --out-dir on a filesystem rank 0 can read."""
    saves.finish()  # the last checkpoint, complete
    state = saves.state
    last = list_checkpoints(args.out_dir, CHECKPOINT_DIR_RE)[-1]

    def read(name: str, meta: torch.Tensor) -> torch.Tensor:
        value = torch.empty(meta.shape, dtype=meta.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            safe_load({"model": {name: value}}, last, no_dist=True)
        return value

    def write() -> None:
        write = functools.partial(save_tensor_by_tensor, state.config, read)
        training.save_final_files(args, write, state.config, state.tokenizer, device)
        if not args.sample_tokens:
            return
        if dist.get_world_size() > 1:
            print(f"sample: none (the model is sharded over {dist.get_world_size()} processes "
                  f"and none holds it whole): python -m tools.generate --out-dir {args.out_dir} "
                  f"--prompt {shlex.quote(args.sample_prompt)}")  # fmt: skip
            return
        from lib.checkpoints.finished_run import load_model  # the whole model, in this one process
        from lib.extras.sampling import print_sample

        print_sample(args, load_model(args.out_dir, device, torch.float32)[0], state.tokenizer)

    from_rank0(write, dist.get_rank() == 0)


def save_tensor_by_tensor(config, read, path: str) -> None:
    """A model.pt of the config's model, that torch.load reads as any other, written without
    ever holding the whole model: read(name, meta_tensor) returns one tensor at a time (a
    sharded lesson reads it from its last checkpoint). torch.save first writes the file with
    room for every tensor but no data (torch.serialization.skip_data; the tensors handed to it
    are allocated but never touched, so they take no memory); then each tensor is copied into
    its place through the file mapped shared (torch.load's mmap), mapped and unmapped again for
    each, so that only one tensor's pages are held at a time."""
    tmp = f"{path}.tmp{os.getpid()}"
    with torch.device("meta"):
        shapes = LlamaForPretraining(config).state_dict()
    try:
        with torch.serialization.skip_data():
            torch.save({k: torch.empty(v.shape, dtype=v.dtype) for k, v in shapes.items()}, tmp)
        for name, meta in shapes.items():
            with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
                mapped = torch.load(tmp, mmap=True, weights_only=True)
            mapped[name].copy_(read(name, meta))
            del mapped  # unmapped: its pages go to the file
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


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


class Checkpoints:
    """TEMPORARY adapter (replaced by the checkpoint package's own)."""

    def __init__(self, args):
        self.args, self.saves, self.job = args, None, None
        self.group = dist.new_group(backend="gloo") if args.async_save else None

    def prepare_out_dir(self):
        return from_rank0(prepare_out_dir, dist.get_rank() == 0, self.args)

    def resume(self, path, state):
        self.saves = ShardedSaves(self.args, state)
        self.saves.group = self.group
        return resume(path, state, self.args)

    @contextlib.contextmanager
    def saving(self, step, state, position):
        with self.saves.checkpoint(step, position) as got:
            yield got
            self.saves.job, self.job = self.job, None

    def finish(self, state, device):
        finish_run(self.args, self.saves, device)
