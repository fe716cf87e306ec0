"""The end of a run, imported only then: the final files (save_final: model.pt, config.json,
tokenizer.json and their checksums), for one_file.py's runs and sharded.py's. A sharded run's
model.pt is written on rank 0 one tensor at a time from the run's last DCP checkpoint, reading its
.metadata once, so that no process ever holds the whole model; the final sample where one
process holds it anyway, else the command that makes one. save_tensor_by_tensor serves
tools/export_hf.py too.
"""

import contextlib
import dataclasses
import functools
import json
import mmap
import os
import shlex
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from data import tokenizer_digest
from lib.checkpoints import files
from lib.checkpoints.files import (
    CHECKPOINT_DIR_RE,
    TEMP_RE,
    atomic_save,
    atomic_write_text,
    list_checkpoints,
)
from lib.checkpoints.out_dir import TrainingState, save_failed
from model import LlamaConfig, LlamaForPretraining


def finish_run(args, state: TrainingState, device) -> None:
    """The end of a sharded lesson's run, on rank 0: model.pt written one tensor at a time from
    the checkpoint of the last step (which the loop always writes; every tensor is there under
    its full name, whatever layout wrote it), then config.json and tokenizer.json: no process
    ever holds the whole model. The sample needs the whole model in one process: made where it
    was anyway (one process), else skipped with a word on how to get one. Like resuming, it
    needs --out-dir on a filesystem rank 0 can read."""
    last = list_checkpoints(args.out_dir, CHECKPOINT_DIR_RE)[-1]
    write = functools.partial(save_tensor_by_tensor, state.config, tensor_reader(last))
    save_final_files(args, write, state.config, state.tokenizer, device)
    if not args.sample_tokens:
        return
    if dist.get_world_size() > 1:
        sharded = f"the model is sharded over {dist.get_world_size()} processes"
        print(
            f"sample: none ({sharded} and none holds it whole): "
            f"{generate_command(args, state.config, gpu_memory(device))}"
        )
        return
    from lib.checkpoints.finished_run import load_model  # the whole model, in this one process
    from lib.extras.sampling import print_sample

    print_sample(args, load_model(args.out_dir, device, torch.float32)[0], state.tokenizer)


def tensor_reader(path: str):
    """read(name, meta_tensor): the model's tensor `name` from the DCP checkpoint at `path`, read
    whole into this process alone (dcp.load with no_dist), one at a time. Its `.metadata` (the
    map of every piece of every tensor, large on many ranks) is read once for them all, by one
    reader (safe_load's), not once per tensor."""
    from lib.checkpoints.safe_load import safe_load_options  # (only to load)

    options = safe_load_options(path)  # one reader and planner for every tensor

    def read(name: str, meta: torch.Tensor) -> torch.Tensor:
        value = torch.empty(meta.shape, dtype=meta.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": {name: value}}, **options, no_dist=True)
        return value

    return read


def generate_command(args, config, gpu_memory: int) -> str:
    """The command that samples from the finished run, and what it needs: tools.generate builds
    the whole model on one device, in fp32 as model.pt holds it. gpu_memory: the bytes of this
    run's GPU (0 on a CPU); where the model would not fit there, the command says --device cpu,
    on a machine with that much memory."""
    with torch.device("meta"):
        size = sum(t.numel() * 4 for t in LlamaForPretraining(config).state_dict().values())
    command = f"python -m tools.generate --out-dir {args.out_dir} "
    command += f"--prompt {shlex.quote(args.sample_prompt)}"
    whole = f"it builds the whole model in fp32 ({size / 2**30:,.1f} GiB) on one device"
    if gpu_memory and size > 0.8 * gpu_memory:
        too_big = "too big for one GPU: on the CPU of a machine with that much memory"
        return f"{command} --device cpu; {whole}, {too_big}"
    return f"{command}; {whole}"


def gpu_memory(device: torch.device) -> int:
    """The bytes of the GPU `device`; 0 for a CPU."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0


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
# The end of a run: the final files


def save_final(out_dir: str, model, config: LlamaConfig, tokenizer) -> None:
    """model.pt (`model`'s state_dict, or written by `model`, a function of its path: a sharded
    lesson's, one tensor at a time), config.json, tokenizer.json (all tools/generate.py needs) and
    tokenizer_config.json, naming the special tokens as Hugging Face does; then final.sums, their
    checksums, which whatever reads them checks first (finished_run.verify_final)."""
    path = os.path.join(out_dir, "model.pt")
    config = dataclasses.replace(config, tokenizer_sha256=tokenizer_digest(tokenizer))
    # The checksums of the files below go last (files.FINAL_SUMS): those of an earlier end of
    # this run go first, so that a kill in between leaves files unverifiable, never "damaged".
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out_dir, files.FINAL_SUMS))
    sums = {}
    if isinstance(model, torch.nn.Module):  # (summed while the disk syncs it: no time)
        sums["model.pt"] = atomic_save(model.state_dict(), path, sums=True, beside=False)
    else:
        model(path)
    atomic_write_text(os.path.join(out_dir, "config.json"), json.dumps(config.to_dict(), indent=2))
    atomic_write_text(os.path.join(out_dir, "tokenizer.json"), tokenizer.to_str())
    special = json.dumps(tokenizer.config(), indent=2)
    atomic_write_text(os.path.join(out_dir, "tokenizer_config.json"), special)
    for name in FINAL_FILES:  # (the rest read back from the memory the writes filled)
        sums[name] = sums.get(name) or files.checksums(os.path.join(out_dir, name))
    files.write_sums(sums, os.path.join(out_dir, files.FINAL_SUMS))


FINAL_FILES = ("model.pt", "config.json", "tokenizer.json", "tokenizer_config.json")


def save_final_files(args, model, config: LlamaConfig, tokenizer, device) -> None:
    """save_final (model: the model, or a function writing it one tensor at a time), an error in
    one line (a full disk), and the peak GPU memory (--plan)."""
    try:
        save_final(args.out_dir, model, config, tokenizer)
    except OSError as e:  # a full disk: one line, as for a checkpoint (the last is at this step)
        # A write's error names no file; model.pt is the large one (a temporary name: its own).
        path = TEMP_RE.sub("", e.filename) if e.filename else os.path.join(args.out_dir, "model.pt")
        raise save_failed(path, e, "the run's final file") from e
    print(f"saved model.pt, config.json and tokenizer.json to {args.out_dir}")
    if args.plan and device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 1e9
        print(f"measured peak GPU memory on rank 0: {peak:.2f} GB (allocated by tensors)")
