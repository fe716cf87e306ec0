"""The end of a sharded run (lib/checkpoints/sharded.py's Checkpoints.finish, imported only then):
model.pt written on rank 0 one tensor at a time from the run's last DCP checkpoint, reading its
.metadata once, so that no process ever holds the whole model; the final sample where one
process holds it anyway, else the command that makes one. save_tensor_by_tensor serves
tools/export_hf.py too.
"""

import contextlib
import functools
import mmap
import os
import shlex
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lib.checkpoints.files import CHECKPOINT_DIR_RE, list_checkpoints
from lib.checkpoints.out_dir import TrainingState, save_final_files
from model import LlamaForPretraining


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
