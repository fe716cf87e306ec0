"""Resuming a run (imported only then): whether a checkpoint belongs to this run, checked before
anything changes (the same model, tokenizer and data, by their fingerprints; the same flags where
they decide the data order and the schedule; a --max-steps that does not cut the run short), and
its state restored: the model, the optimizer, the schedule, the grad scaler and the RNG.
"""

import os
import warnings

import torch

from data import corpus_digest, tokenizer_digest
from model import MOE_FIELDS, LlamaConfig

# The flags that fix the data order, what the model attends to (--document-mask) and the schedule:
# a resumed run must use the same, or it is not the run an uninterrupted one gives. The others
# (micro-batch size, precision, intervals, workers, kernel, ...) may change, and so may --max-steps
# (a larger one extends even a finished run: resume_schedule; one below the checkpoint's is
# refused). Not listed: the model's flags and --data: check_resumable compares what they make
# (the config; the documents, corpus_sha256), not how they were spelled.
RESUME_MUST_MATCH = (
    "text_column", "txt_split", "data_mode", "val_fraction", "seq_length", "batch_size", "seed",
    "lr", "min_lr_ratio", "warmup_steps", "bot_token", "eot_token", "pad_token", "streaming",
    "document_mask",
)  # fmt: skip
# Flags newer than some checkpoints, and the value those checkpoints were made with.
ADDED_SINCE = {
    "txt_split": "auto", "bot_token": None, "eot_token": None, "pad_token": None,
    "streaming": False, "document_mask": False,
}  # fmt: skip


def check_resumable(ckpt: dict, config, args, tokenizer) -> None:
    """ValueError if the checkpoint belongs to another run (model, tokenizer, data, data order,
    schedule) or is past --max-steps; on every rank, before anything is loaded."""
    if ckpt["step"] > args.max_steps:
        raise ValueError(f"the checkpoint is at step {ckpt['step']}, past --max-steps "
                         f"{args.max_steps}: a run cannot be shortened below what it has trained; "
                         f"give --max-steps {ckpt['step']} or more, or start a new run in another "
                         f"--out-dir")  # fmt: skip
    recorded = {**ADDED_SINCE, **ckpt["args"]}
    # A stream's validation is its first documents, as many as --eval-batches x --batch-size
    # sequences need: another --eval-batches holds out others (say which flag changed them).
    must_match = RESUME_MUST_MATCH + (("eval_batches",) if recorded["streaming"] else ())
    changed = [
        f"--{name.replace('_', '-')} {recorded.get(name)!r} (now {getattr(args, name)!r})"
        for name in must_match
        if recorded.get(name) != getattr(args, name)
    ]
    if changed:
        raise ValueError(f"the checkpoint was made with {', '.join(changed)}; resume with the "
                         f"same values, or start a new run in another --out-dir")  # fmt: skip
    # Fields newer than some checkpoints, or that a dense model leaves out: missing, the default.
    absent = {"rope_scaling": None} | {name: getattr(LlamaConfig, name) for name in MOE_FIELDS}
    saved, now = ckpt["config"], config.to_dict()
    changed = [
        f"{name} {saved.get(name, absent.get(name))} (now {now.get(name, absent.get(name))})"
        for name in {**saved, **now}  # the union of both sides' fields, in order
        if saved.get(name, absent.get(name)) != now.get(name, absent.get(name))
    ]
    if changed:
        raise ValueError(f"the checkpoint holds a model with config {', '.join(changed)}; resume "
                         f"with that run's --model, shape flags (--num-layers, ...), expert flags "
                         f"(--num-experts, ...) and --vocab-size or --tokenizer, or start a new "
                         f"run in another --out-dir")  # fmt: skip
    # The data before the tokenizer, which changes with it when trained: the data is the news.
    check_same_data(ckpt, args, tokenizer)
    if ckpt["tokenizer_sha256"] != tokenizer_digest(tokenizer):
        raise ValueError("the checkpoint was trained with a different tokenizer than this run's; "
                         "use the same --data, --vocab-size and --tokenizer as that run, or "
                         "another --out-dir")  # fmt: skip
    if args.init_from is not None and int(os.environ.get("RANK", "0")) == 0:
        # Not refused: a run started with --init-from and restarted with the same command must
        # resume, not start over.
        print(f"note: --init-from {args.init_from} is not used: the run resumes from its own "
              f"checkpoint (at step {ckpt['step']}), which holds its weights")  # fmt: skip


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
            raise ValueError(f"--data {args.data} is not the data the checkpoint was trained on: "
                             f"{what} differ (fingerprint {saved[:12]}, now {now[:12]}); resume "
                             f"with that data as it was, or start a new run in another "
                             f"--out-dir")  # fmt: skip
        return
    recorded = ckpt["args"].get("data")
    if recorded is not None and _normalised_spec(recorded) != _normalised_spec(args.data):
        raise ValueError(f"the checkpoint was made with --data {recorded!r} (now {args.data!r}); "
                         f"resume with the same data, or start a new run in another "
                         f"--out-dir")  # fmt: skip


def _normalised_spec(spec: str) -> str:
    """--data as one absolute path: dir//file, ./dir/file and /abs/dir/file compare equal."""
    return os.path.abspath(os.path.expanduser(spec))


def restore_checkpoint(ckpt, state, args) -> tuple[int, list[dict] | None]:
    """Load a checkpoint's state into fresh objects (ValueError, changing nothing, for another
    run's); returns the step to go on from, and a stream's position in the data."""
    check_resumable(ckpt, state.config, args, state.tokenizer)
    fresh_lrs = [group["lr"] for group in state.optimizer.param_groups]
    state.model.load_state_dict(ckpt["model"])
    state.optimizer.load_state_dict(ckpt["optimizer"])
    resume_schedule(state.scheduler, state.optimizer, fresh_lrs, ckpt["step"])
    state.scaler.load_state_dict(ckpt["scaler"])
    set_rng_state(ckpt["rng"])
    return ckpt["step"], ckpt.get("data")


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
