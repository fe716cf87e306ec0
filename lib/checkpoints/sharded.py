"""The checkpoints of train_fsdp.py, train_tp.py, train_pp.py, train_cp.py and train_ep.py, written
and read with torch.distributed.checkpoint (DCP): checkpoints/step_NNNNNNN/ holds DCP's files (one
per rank, plus the .metadata that maps every tensor's pieces) and train_state.pt (schedule, RNG,
step, config). Every rank writes only its own shards; DCP reads back, on each rank, just the
pieces its shards cover, whatever the number of ranks that wrote them. Loading runs no code from
the directory (safe_load.py, imported only to load). The interface is one_file.py's, but for
`saving` around the lesson's dcp.save: the package's docstring shows both.
"""

import contextlib
import functools
import mmap
import os
import shlex
import shutil
import sys
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from data import tokenizer_digest
from lib.checkpoints import files
from lib.checkpoints.files import CHECKPOINT_DIR_RE, atomic_save, list_checkpoints
from lib.checkpoints.out_dir import (
    TrainingState,
    earlier_run,
    make_out_dir,
    rng_state,
    save_failed,
    save_final_files,
)
from lib.distributed import from_rank0
from lib.exits import interrupted
from model import LlamaForPretraining

TRAIN_STATE = "train_state.pt"
# AdamW's state keyed per parameter ("state.layers.3.attention.wq.weight.exp_avg",
# "param_groups.layers.3.attention.wq.weight.lr"), not as one list of param_groups: a checkpoint
# then holds nothing that depends on how parameters are spread over ranks, so train_pp.py, whose
# pipeline ranks each own different parameters (and would each write another param_groups list
# under the same key), writes the same directories, and either script resumes the other's.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class Checkpoints:
    """A sharded lesson's checkpoints, around its dcp.save (or, with --async-save,
    dcp.async_save) into checkpoints/step_NNNNNNN/: each rank writes only its own shards, with no
    gather. A directory of that name is always complete: the shards go to step_NNNNNNN.tmp, and
    once every rank has written, rank 0 adds the train state and renames it into place.

    --async-save: dcp.async_save copies this rank's shards to CPU memory (its staging copy: the
    rank's weights and AdamW state, 12 bytes per parameter of its shards, in host memory until
    written) and returns; a thread writes them while training goes on, with its collectives on a
    gloo group of its own (`group`), never mixed with training's. The checkpoint is renamed into
    place only once written: before the next one starts, before the run's end, and before a
    non-finite stop (files.finish_in_flight: it holds the last good state). A kill
    meanwhile leaves step_NNNNNNN.tmp, removed at the next start, and the checkpoint before it
    complete: resuming from it is bit for bit the same."""

    def __init__(self, args):
        self.args = args
        self.group = None  # --async-save's gloo group (prepare_out_dir makes it)
        self.job = None  # dcp.async_save's future: the save in flight, set by the lesson
        self._pending = None  # (path, tmp, train state) of the checkpoint written now

    def prepare_out_dir(self) -> str | None:
        """prepare_out_dir on rank 0: the checkpoint directory to resume from (None: start
        fresh), which every rank learns. A collective: every rank calls it."""
        if self.args.async_save:  # a group of its own for the background save (a collective)
            self.group = dist.new_group(backend="gloo")
        return from_rank0(prepare_out_dir, dist.get_rank() == 0, self.args)

    def resume(self, path: str | None, state: TrainingState) -> tuple[int, list[dict] | None]:
        """(step, data position) to go on from: (0, None) for path None; else the checkpoint's,
        loaded in place into `state` by dcp.load (each rank reads just the pieces its shards
        cover, whatever the number of ranks that wrote them), the schedule and RNG restored.
        Its train state is checked against this run first (ValueError, changing nothing)."""
        if path is None:
            return 0, None
        from lib.checkpoints.resuming import (  # only when resuming
            check_resumable,
            load_checkpoint,
            resume_schedule,
            set_rng_state,
        )
        from lib.checkpoints.safe_load import safe_load_options

        model, optimizer = state.model, state.optimizer
        train_state = load_checkpoint(os.path.join(path, TRAIN_STATE))
        # Another run's checkpoint is refused before anything changes.
        check_resumable(train_state, state.config, self.args, state.tokenizer)
        fresh_lrs = [group["lr"] for group in optimizer.param_groups]
        model_state, optim_state = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
        shards = {"model": model_state, "optimizer": optim_state}
        try:
            dcp.load(shards, **safe_load_options(path))  # in place, into the tensors of `shards`
        except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - every rank alike
            raise load_failed(path, e) from e
        loaded = {"model_state_dict": shards["model"], "optim_state_dict": shards["optimizer"]}
        set_state_dict(model, optimizer, **loaded, options=STATE_DICT_OPTIONS)
        # The schedule of this run's --max-steps, at the checkpoint's step (see resume_schedule).
        resume_schedule(state.scheduler, optimizer, fresh_lrs, train_state["step"])
        if state.scaler is not None and train_state.get("scaler"):  # fp16's loss scale, its step
            state.scaler.load_state_dict(train_state["scaler"])
        set_rng_state(train_state["rng"])
        if dist.get_rank() == 0:
            print(f"resumed from {path} at step {train_state['step']}")
        return train_state["step"], train_state.get("data")

    @contextlib.contextmanager
    def saving(
        self, step: int, state: TrainingState, data_position=None
    ) -> Iterator[tuple[dict, str]]:
        """Around the lesson's dcp.save(to_save, checkpoint_id=path): yields (to_save, path), the
        model's and AdamW's state as sharded DTensors keyed by parameter name, and the directory
        to write them to. A collective: every rank enters it. The checkpoint in flight, if any,
        is completed first. data_position: training.data_positions() (rank 0's is saved). A
        failed write (a full disk) on any rank removes the directory, keeps the previous
        checkpoints as they were, and raises one TrainingError on every rank."""
        self._complete()
        args = self.args
        path = os.path.join(args.out_dir, "checkpoints", f"step_{step:07d}")
        tmp = f"{path}.tmp"

        def start() -> None:  # rank 0's part
            shutil.rmtree(tmp, ignore_errors=True)  # the leftovers of a run killed mid-save
            try:
                os.makedirs(tmp)
            except OSError as e:  # a full disk
                raise save_failed(path, e) from e

        # from_rank0's broadcast: the directory exists before anyone writes into it (or all stop).
        from_rank0(start, dist.get_rank() == 0)
        # The train state of this step, taken now: the run goes on before an async save is done.
        scaler = state.scaler.state_dict() if state.scaler is not None else None  # (fp16's)
        train_state = {
            "scheduler": state.scheduler.state_dict(),
            "scaler": scaler,
            "rng": rng_state(),
            "step": step,
            "config": state.config.to_dict(),
            "tokenizer_sha256": tokenizer_digest(state.tokenizer),
            "corpus_sha256": state.tokenizer.corpus_sha256,  # what the data is (check_same_data)
            "args": vars(args),
            "data": data_position,
        }
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
            self._complete()  # written: complete it now
        elif self._complete not in files.in_flight:  # completed by whatever stops the run
            files.in_flight.append(self._complete)

    def _complete(self) -> None:
        """Complete the checkpoint being written, if any: wait for the async save in flight (a
        failure raises on every rank), then rank 0 adds the train state and renames the
        directory into place, and every rank learns whether it could (from_rank0)."""
        with contextlib.suppress(ValueError):  # (no longer the run's to complete)
            files.in_flight.remove(self._complete)
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
        # Once it returns, the checkpoint is complete for every rank; if rank 0's part failed,
        # every rank raises its error, instead of the others waiting for rank 0.
        from_rank0(complete, rank == 0, self.args, path, tmp, train_state, sums)

    def _failed(self, e) -> None:
        """A write failed on some rank (a full disk): the partial directory goes, the previous
        checkpoints stay as they were, and every rank raises one TrainingError."""
        (path, tmp, _), self._pending = self._pending, None
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        # failures: {rank: (error, traceback)}. Sent between ranks without its context, a full
        # disk shows as torch.save's RuntimeError ("unexpected pos"), not as the OSError.
        cause = next(iter(e.failures.values()))[0]
        if interrupted(e):  # a second Ctrl-C during the write: stop at once (exits.run)
            raise KeyboardInterrupt from e
        raise save_failed(path, cause) from e

    def finish(self, state: TrainingState, device) -> None:
        """The end of a run, with no collective but from_rank0's: the last checkpoint completed,
        then, on rank 0, model.pt written one tensor at a time from it (finish_run). Every rank
        learns whether rank 0 could write."""
        self._complete()
        from_rank0(finish_run, dist.get_rank() == 0, self.args, state, device)


# -------------------------------------------------------------------------------------------------
# What the methods call: rank 0's part of each (the out-dir, a checkpoint completed, the end of
# a run), and the error of a load that failed


def prepare_out_dir(args, script: str | None = None) -> str | None:
    """Create --out-dir and choose the checkpoint directory to resume from (None: start fresh),
    as one_file.prepare_out_dir does among .pt files: called on rank 0 alone. `script` names the
    script in the messages (default: this one; train_fsdp.py, train_tp.py, ... write the same
    directories). lib/checkpoints/resuming.py chooses, where an earlier run left anything."""
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
    if args.resume in ("never", "auto") and not earlier_run(args.out_dir):
        return None
    from lib.checkpoints import resuming

    if args.resume == "never":
        if list_checkpoints(args.out_dir, CHECKPOINT_DIR_RE):
            raise resuming.resume_never_error(args.out_dir)
        resume = None
    elif args.resume != "auto":
        resume = args.resume  # (checked above)
    else:
        found = list_checkpoints(args.out_dir, CHECKPOINT_DIR_RE)
        resume = resuming.newest_readable(found, check_directory)  # the newest intact one
    resuming.refuse_other_checkpoints(args.out_dir, sharded=True)  # .pt files: train_dp/ddp's
    return resuming.start_from(args.out_dir, resume)


def check_directory(path: str) -> None:
    """ValueError unless the checkpoint directory is intact: every file as its checksums say
    (where it has them: files.SUMS), and its train state loads."""
    from lib.checkpoints.resuming import load_checkpoint, verify_sums

    if os.path.isfile(sums := os.path.join(path, files.SUMS)):
        verify_sums(sums)
    load_checkpoint(os.path.join(path, TRAIN_STATE))


def complete(args, path: str, tmp: str, train_state: dict, sums: list[dict]) -> None:
    """A checkpoint's last part, on rank 0: the train state, every rank's checksums, the rename
    into place (atomic as one_file.save_checkpoint's files: a directory is complete once
    renamed), and the oldest beyond --keep-checkpoints removed."""
    try:
        atomic_save(train_state, os.path.join(tmp, TRAIN_STATE))
        every = {name: crcs for part in sums for name, crcs in part.items()}
        every[TRAIN_STATE] = files.checksums(os.path.join(tmp, TRAIN_STATE))
        files.write_sums(every, os.path.join(tmp, files.SUMS))
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise save_failed(path, e) from e
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)
    for old in list_checkpoints(args.out_dir, CHECKPOINT_DIR_RE)[: -args.keep_checkpoints]:
        shutil.rmtree(old)


def load_failed(path: str, e: BaseException) -> ValueError:
    """The error for shards that dcp.load could not read, though the train state was fine: they
    are damaged (a disk error), hold what safe_load refuses to unpickle, or are of a
    train_fsdp.py from before optimizer state was keyed per parameter. It says which directory,
    and what to do (rather than resume silently from an older one). CheckpointException derives
    from BaseException; its failures are {rank: (error, traceback)}."""
    failures = getattr(e, "failures", None)
    cause = next(iter(failures.values()))[0] if failures else e
    reason = (str(cause).strip() or type(cause).__name__).splitlines()[0].split(". ")[0]
    return ValueError(
        f"could not load the sharded checkpoint {path}: {reason}; it "
        f"is damaged, unsafe or from an older version of this script. Resume from another one "
        f"(--resume {os.path.dirname(path)}/step_...), or start fresh in another --out-dir"
    )


def finish_run(args, state: TrainingState, device) -> None:
    """The end of a sharded lesson's run, on rank 0: model.pt written one tensor at a time from
    the checkpoint of the last step (which the loop always writes; every tensor is there under
    its full name, whatever layout wrote it), then config.json and tokenizer.json: no process
    ever holds the whole model. The sample needs the whole model in one process: made where it
    was anyway (one process), else skipped with a word on how to get one. Like resuming, it
    needs --out-dir on a filesystem rank 0 can read."""
    from lib.checkpoints.safe_load import safe_load  # (only to load)

    last = list_checkpoints(args.out_dir, CHECKPOINT_DIR_RE)[-1]

    def read(name: str, meta: torch.Tensor) -> torch.Tensor:
        value = torch.empty(meta.shape, dtype=meta.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            safe_load({"model": {name: value}}, last, no_dist=True)
        return value

    write = functools.partial(save_tensor_by_tensor, state.config, read)
    save_final_files(args, write, state.config, state.tokenizer, device)
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
