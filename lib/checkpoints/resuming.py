"""Resuming a run (imported only then): whether a checkpoint belongs to this run, checked before
anything changes (the same model, tokenizer and data, by their fingerprints; the same flags where
they decide the data order and the schedule; a --max-steps that does not cut the run short), and
its state restored: the model, the optimizer, the schedule, the grad scaler and the RNG.
"""

import json
import os
import sys
import warnings

import torch

from data import corpus_digest, tokenizer_digest
from lib.checkpoints.files import (
    CHECKPOINT_DIR_RE,
    CHECKPOINT_RE,
    SUMS,
    list_checkpoints,
    verify_sums,
)
from model import MOE_FIELDS, LlamaConfig

# The flags that fix the data order, what the model attends to (--document-mask) and the schedule:
# a resumed run must use the same, or it is not the run an uninterrupted one gives. The others
# (micro-batch size, precision, intervals, workers, kernel, ...) may change, and so may --max-steps
# (a larger one extends even a finished run: resume_schedule; one below the checkpoint's is
# refused). Not listed: the model's flags and --data: check_resumable compares what they make
# (the config; the documents, corpus_sha256), not how they were spelled.
RESUME_MUST_MATCH = tuple(
    "text_column txt_split data_mode val_fraction seq_length batch_size seed lr min_lr_ratio "
    "warmup_steps bot_token eot_token pad_token streaming document_mask optimizer".split()
)
# Flags newer than some checkpoints, and the value those checkpoints were made with.
ADDED_SINCE = {
    "txt_split": "auto",
    "bot_token": None,
    "eot_token": None,
    "pad_token": None,
    "streaming": False,
    "document_mask": False,
    "optimizer": "adamw",
    "muon_lr": 0.02,
}


def check_resumable(ckpt: dict, config, args, tokenizer) -> None:
    """ValueError if the checkpoint belongs to another run (model, tokenizer, data, data order,
    schedule) or is past --max-steps; on every rank, before anything is loaded."""
    if ckpt["step"] > args.max_steps:
        raise ValueError(
            f"the checkpoint is at step {ckpt['step']}, past --max-steps "
            f"{args.max_steps}: a run cannot be shortened below what it has trained; "
            f"give --max-steps {ckpt['step']} or more, or start a new run in another "
            f"--out-dir"
        )
    recorded = {**ADDED_SINCE, **ckpt["args"]}
    # A stream's validation is its first documents, as many as --eval-batches x --batch-size
    # sequences need: another --eval-batches holds out others (say which flag changed them).
    must_match = RESUME_MUST_MATCH + (("eval_batches",) if recorded["streaming"] else ())
    must_match += ("muon_lr",) if recorded["optimizer"] == "muon" else ()  # (Muon's schedule)
    changed = [
        f"--{name.replace('_', '-')} {recorded.get(name)!r} (now {getattr(args, name)!r})"
        for name in must_match
        if recorded.get(name) != getattr(args, name)
    ]
    if changed:
        raise ValueError(
            f"the checkpoint was made with {', '.join(changed)}; resume with the "
            f"same values, or start a new run in another --out-dir"
        )
    # Fields newer than some checkpoints, or that a dense model leaves out: missing, the default.
    absent = {"rope_scaling": None, "tokenizer_sha256": None} | {
        name: getattr(LlamaConfig, name) for name in MOE_FIELDS
    }
    saved, now = ckpt["config"], config.to_dict()
    changed = [
        f"{name} {saved.get(name, absent.get(name))} (now {now.get(name, absent.get(name))})"
        for name in {**saved, **now}  # the union of both sides' fields, in order
        if saved.get(name, absent.get(name)) != now.get(name, absent.get(name))
    ]
    if changed:
        raise ValueError(
            f"the checkpoint holds a model with config {', '.join(changed)}; resume "
            f"with that run's --model, shape flags (--num-layers, ...), expert flags "
            f"(--num-experts, ...) and --vocab-size or --tokenizer, or start a new "
            f"run in another --out-dir"
        )
    # The data before the tokenizer, which changes with it when trained: the data is the news.
    check_same_data(ckpt, args, tokenizer)
    if ckpt["tokenizer_sha256"] != tokenizer_digest(tokenizer):
        raise ValueError(
            "the checkpoint was trained with a different tokenizer than this run's; "
            "use the same --data, --vocab-size and --tokenizer as that run, or "
            "another --out-dir"
        )
    if args.init_from is not None and int(os.environ.get("RANK", "0")) == 0:
        # Not refused: a run started with --init-from and restarted with the same command must
        # resume, not start over.
        print(
            f"note: --init-from {args.init_from} is not used: the run resumes from its own "
            f"checkpoint (at step {ckpt['step']}), which holds its weights"
        )


def check_same_data(ckpt: dict, args, tokenizer) -> None:
    """ValueError if this run reads other documents than the checkpoint's run did (their digest,
    not how --data spells them: an edit would change the split and the order). A checkpoint
    from before the digest has only --data to go by: compared as a normalised path."""
    saved, now = ckpt.get("corpus_sha256"), corpus_digest(tokenizer)
    if saved is not None and now is not None:
        if saved != now:
            what = "its documents"
            if args.streaming:
                what = "its first documents (held out for validation) or its files' sizes"
            raise ValueError(
                f"--data {args.data} is not the data the checkpoint was trained on: "
                f"{what} differ (fingerprint {saved[:12]}, now {now[:12]}); resume "
                f"with that data as it was, or start a new run in another "
                f"--out-dir"
            )
        return
    recorded = ckpt["args"].get("data")
    if recorded is not None and _normalised_spec(recorded) != _normalised_spec(args.data):
        raise ValueError(
            f"the checkpoint was made with --data {recorded!r} (now {args.data!r}); "
            f"resume with the same data, or start a new run in another "
            f"--out-dir"
        )


def _normalised_spec(spec: str) -> str:
    """--data as one absolute path: dir//file, ./dir/file and /abs/dir/file compare equal."""
    return os.path.abspath(os.path.expanduser(spec))


def restore_checkpoint(ckpt, state, args) -> tuple[int, list[dict] | None]:
    """Load a checkpoint's state into fresh objects (ValueError, changing nothing, for another
    run's); returns the step to go on from, and a stream's position in the data."""
    check_resumable(ckpt, state.config, args, state.tokenizer)
    fresh_lrs = [group["lr"] for group in state.optimizer.param_groups]
    state.model.load_state_dict(ckpt["model"])
    state.optimizer.load_state_dict(muon_group_first(ckpt["optimizer"]))
    resume_schedule(state.scheduler, state.optimizer, fresh_lrs, ckpt["step"])
    state.scaler.load_state_dict(ckpt["scaler"])
    set_rng_state(ckpt["rng"])
    return ckpt["step"], ckpt.get("data")


def muon_group_first(saved: dict) -> dict:
    """An optimizer's state_dict with the group Muon steps first, where training.build_optimizer
    puts it now: a checkpoint of --optimizer muon written when it came last resumes. Its groups
    move, and its parameters' numbers (the keys of its state, in the groups' order) with them;
    any other state_dict is returned as it is."""
    groups = sorted(saved["param_groups"], key=lambda group: not group.get("muon", False))
    if all(a is b for a, b in zip(groups, saved["param_groups"], strict=True)):
        return saved
    renumbered = {old: new for new, old in enumerate(i for g in groups for i in g["params"])}
    return {
        **saved,
        "state": {renumbered[i]: value for i, value in saved["state"].items()},
        "param_groups": [{**g, "params": [renumbered[i] for i in g["params"]]} for g in groups],
    }


def resume_schedule(scheduler, optimizer, fresh_lrs: list[float], step: int) -> None:
    """Bring the fresh scheduler of this run's flags (a larger --max-steps extends the run) to
    `step`: from fresh_lrs, the learning rates it set before optimizer.load_state_dict, stepped
    `step` times as an uninterrupted run did: the same floats, bit for bit (unlike a formula)."""
    for group, lr in zip(optimizer.param_groups, fresh_lrs, strict=True):
        group["lr"] = lr
    with warnings.catch_warnings():
        # Stepping the schedule before any optimizer.step() is the point here, not a mistake.
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step\\(\\)` before")
        for _ in range(step):
            scheduler.step()


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -------------------------------------------------------------------------------------------------
# Which checkpoint a run resumes from (an out-dir where an earlier run left anything)


def resume_never_error(out_dir: str) -> ValueError:
    return ValueError(
        f"--resume never, but {out_dir} has checkpoints (nothing was overwritten): "
        f"--resume auto goes on, or choose another --out-dir"
    )


def newest_readable(paths: list[str], check=None) -> str | None:
    """The newest of `paths` (oldest first) that check(path) finds intact (its checksums, and
    that it loads): a damaged newest one (a disk error, say) must not cost the run: say so, and
    fall back to the one before."""
    for path in reversed(paths):
        try:
            (check or load_checkpoint)(path)
            return path
        except ValueError as e:
            print(f"warning: {e}; trying an older checkpoint", file=sys.stderr)
    if paths:  # starting over would prune them: they may be readable again (a disk, a mount)
        raise ValueError(
            f"none of the {len(paths)} checkpoints in {os.path.dirname(paths[0])} "
            f"can be read; move them aside to start at step 0"
        )
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
        raise ValueError(
            f"{out_dir} holds checkpoints of {writers}, which "
            f"{os.path.basename(sys.argv[0])} can neither resume nor write beside; "
            f"choose another --out-dir (a finished run's out-dir starts any script "
            f"with --init-from)"
        )


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


def choose_checkpoint(args) -> str | None:
    """one_file.prepare_out_dir's choice, in an out-dir where an earlier run left anything:
    the .pt checkpoint to resume from (None: start fresh)."""
    if args.resume == "never":
        if list_checkpoints(args.out_dir):
            raise resume_never_error(args.out_dir)
        resume = None
    elif args.resume != "auto":
        resume = args.resume  # (checked by one_file.prepare_out_dir)
    else:
        resume = newest_readable(list_checkpoints(args.out_dir))
    refuse_other_checkpoints(args.out_dir, sharded=False)
    return start_from(args.out_dir, resume)


# -------------------------------------------------------------------------------------------------
# Reading what an earlier run wrote: a checkpoint (checked against its checksums), metrics.jsonl


def load_checkpoint(path: str) -> dict:
    """Load a checkpoint file, checked against its checksums where it has them (PATH.sums);
    ValueError (with the reason) if it cannot be read."""
    if os.path.isfile(f"{path}{SUMS}"):
        verify_sums(f"{path}{SUMS}")
    try:
        # weights_only=True: unpickling may only rebuild tensors and plain containers, never run
        # code, so a checkpoint from someone else cannot execute anything on this machine.
        # mmap=True: tensors are paged in from the file as they are used, not read up front.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated, not a checkpoint, unsafe content: all mean "unusable"
        raise ValueError(f"cannot read checkpoint {path}: {e}") from e


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
                    raise ValueError(
                        f"{path} line {n} is not a step's record ({line.strip()[:40]}"
                        f"): correct or delete that line"
                    )
                records.append(record)
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    return records
