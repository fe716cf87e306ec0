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
import os
import re
import shutil
import sys
from collections.abc import Iterator

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
)
from lib.distributed import from_rank0, waiting_group
from lib.exits import interrupted

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
        fresh), which every rank learns, once each rank has checked the checksums of its own
        share of its files (check_directory): a damaged one is refused, or with --resume auto
        the one before is chosen. A collective: every rank calls it."""
        if self.args.async_save:  # a group of its own for the background save (a collective)
            self.group = dist.new_group(backend="gloo")
        rank = dist.get_rank()
        resume = from_rank0(prepare_out_dir, rank == 0, self.args)
        # Rank 0 checked its share of the files; every other rank checks its own now, at once.
        while resume is not None and (damage := damage_found(resume)) is not None:
            if self.args.resume != "auto":  # a checkpoint named on the command line: refused
                raise ValueError(damage)
            if rank == 0:  # --resume auto: as newest_readable does, the one before
                print(f"warning: {damage}; trying an older checkpoint", file=sys.stderr)
            resume = from_rank0(older_intact, rank == 0, self.args, resume)
        return resume

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
        then, on rank 0, model.pt written one tensor at a time from it (lib/checkpoints/model_pt.py,
        imported only now). Every rank learns whether rank 0 could write."""
        self._complete()
        from lib.checkpoints.model_pt import finish_run

        from_rank0(finish_run, dist.get_rank() == 0, self.args, state, device)


# -------------------------------------------------------------------------------------------------
# What the methods call: rank 0's part of each (the out-dir, a checkpoint completed), and the
# error of a load that failed


def prepare_out_dir(args, script: str | None = None) -> str | None:
    """Create --out-dir and choose the checkpoint directory to resume from (None: start fresh),
    as one_file.prepare_out_dir does among .pt files: called on rank 0 alone. `script` names the
    script in the messages (default: this one; train_fsdp.py, train_tp.py, ... write the same
    directories). lib/checkpoints/resuming.py chooses, where an earlier run left anything."""
    script = script or os.path.basename(sys.argv[0])
    # (checked before the out-dir is made: a refused run leaves none behind)
    if args.resume not in ("never", "auto") and os.path.basename(args.resume) == TRAIN_STATE:
        raise ValueError(
            f"--resume names a checkpoint by its directory: --resume "
            f"{os.path.dirname(args.resume) or '.'}"
        )
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


def check_directory(path: str, rank: int = 0, world_size: int | None = None) -> None:
    """ValueError unless the checkpoint directory is intact: every file of this rank's share as
    its checksums say (where it has them: files.SUMS; rank_share), and, on rank 0, its train
    state loads. world_size: the run's number of ranks (default: the process group's)."""
    from lib.checkpoints.resuming import load_checkpoint, verify_sums

    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    if os.path.isfile(sums := os.path.join(path, files.SUMS)):
        verify_sums(sums, functools.partial(rank_share, rank=rank, world_size=world_size))
    if rank == 0:
        load_checkpoint(os.path.join(path, TRAIN_STATE))


def rank_share(name: str, rank: int, world_size: int) -> bool:
    """Whether the rank checks the checkpoint file `name` at resume: the shards that rank N of
    the run that wrote them saved (__N_0.distcp) go to rank N mod world_size, the rest
    (.metadata, the train state) to rank 0. So each rank reads about its 1/world_size of the
    checkpoint, at the same time, where rank 0 alone would read it all while the others wait."""
    writer = CHECKPOINT_SHARD_RE.fullmatch(name)
    return (int(writer.group(1)) if writer else 0) % world_size == rank


CHECKPOINT_SHARD_RE = re.compile(r"__(\d+)_\d+\.distcp")  # DCP's name for rank N's file


def damage_found(path: str) -> str | None:
    """The damage that the ranks other than 0 find in their shares of the checkpoint
    (check_directory), the same on every rank: the first rank's message, or None if intact. A
    collective, on the waiting group: a rank's share may take long to read."""
    if dist.get_world_size() == 1:
        return None
    rank, found = dist.get_rank(), [None] * dist.get_world_size()
    damage = None
    if rank != 0:  # (rank 0's share was checked as it chose)
        try:
            check_directory(path, rank)
        except ValueError as e:
            damage = str(e)
    dist.all_gather_object(found, damage, group=waiting_group())
    return next((d for d in found if d is not None), None)


def older_intact(args, damaged: str) -> str:
    """The newest checkpoint older than `damaged` whose rank-0 share is intact (--resume auto,
    once another rank found `damaged` damaged), on rank 0; ValueError if there is none."""
    from lib.checkpoints.resuming import newest_readable

    found = list_checkpoints(args.out_dir, CHECKPOINT_DIR_RE)
    older = found[: found.index(damaged)]
    if not older:
        raise ValueError(
            f"none of the {len(found)} checkpoints in {os.path.dirname(damaged)} "
            f"can be read; move them aside to start at step 0"
        )
    return newest_readable(older, check_directory)


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
