"""Specification of the memory-scaling strategies: ZeRO-1, FSDP (ZeRO-2/3), CPU offload and
activation checkpointing all train exactly like DDP, resume bit for bit, and write the same
model.pt.

Every run is launched as a user would (torchrun, 2 gloo ranks on CPU) with the training tests'
settings and helpers (harness.py), corpus and reference runs (conftest.py), and compared with
the DDP run on the same global batch, with test_training.py's tolerances (see its docstring):
these strategies change where tensors live and which collective moves them, not the arithmetic.
Measured on this corpus (fp32): ZeRO-1 and activation checkpointing are bit-identical to DDP;
FSDP differs by at most ~1e-7 (its reduce-scatter adds the two ranks' gradients in another
order), far inside ATOL. HSDP on 2 ranks (--replicate 2: 2 replicas of a shard group of 1) is
bit-identical to DDP: its reduce-scatter over one rank is a copy, its all-reduce DDP's. The 2 x 2
grid (4 ranks: a real reduce-scatter within each pair, then the all-reduce across the pairs) was
checked by hand against train_dp.py: weights within 2.0e-6, logged losses 1.2e-7 (relative),
gradient norms 1.3e-6 (relative), validation losses 1.0e-7; with ZeRO-2 and 2 micro-batches
3.1e-6, with CPU offload and activation checkpointing 2.0e-6, 4 x 1 2.0e-6. Its resume was
bit-identical, and its step-4 checkpoint resumed under plain FSDP on 2 ranks and on 1 (weights
within 2.0e-6 of train_dp.py). 4 processes are too slow for CI on 2 cores.
"""

import dataclasses
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from harness import (
    DDP,
    DP,
    ZERO1,
    assert_same_losses,
    assert_state_dicts_close,
    assert_state_dicts_equal,
    cmd,
    copy_checkpoint,
    file_size_limit,
    flatten,
    load_checkpoint,
    load_weights,
    read_metrics,
    run_script,
    snapshot,
)
from test_bad_input import assert_refused
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from lib.checkpoints import files
from model import LlamaConfig, LlamaForPretraining

FSDP = "train_fsdp.py"


def reseal(checkpoint: Path) -> None:
    """Rewrite a checkpoint directory's checksums for what its files hold now, as whoever
    crafted them would: the checksums catch damage, not an attacker."""
    listed = json.loads((checkpoint / files.SUMS).read_text())["crc32"]
    sums = {name: files.checksums(str(checkpoint / name)) for name in listed}
    files.write_sums(sums, str(checkpoint / files.SUMS))


def copy_sharded_checkpoint(src_dir: Path, step: int, dst_dir: Path) -> Path:
    """Copy one train_fsdp.py checkpoint directory into dst_dir/checkpoints/."""
    name = f"step_{step:07d}"
    return Path(shutil.copytree(src_dir / "checkpoints" / name, dst_dir / "checkpoints" / name))


def sharded_checkpoint_state(out_dir: Path, step: int, tmp_path: Path) -> dict:
    """A DCP checkpoint's model and optimizer tensors, gathered into one plain dict."""
    path = tmp_path / f"{out_dir.name}_{step}.pt"
    dcp_to_torch_save(out_dir / "checkpoints" / f"step_{step:07d}", path)
    return flatten(torch.load(path, weights_only=True))


def assert_same_sharded_checkpoint(out_dir: Path, reference: Path, step: int, tmp_path) -> None:
    """Two runs' DCP checkpoints at `step` hold the same tensors and values, optimizer included,
    bit for bit."""
    got = sharded_checkpoint_state(out_dir, step, tmp_path)
    want = sharded_checkpoint_state(reference, step, tmp_path)
    assert got.keys() == want.keys() and any("optimizer" in key for key in want)
    for key, value in want.items():
        same = torch.equal(got[key], value) if torch.is_tensor(value) else got[key] == value
        assert same, f"{key} differs after resuming"


def assert_resumes_bit_identically(script: str, full: Path, out: Path, argv: list[str],
                                   world: int, tmp_path: Path):  # fmt: skip
    """Run `script` with `argv` (whose --out-dir is `out`) from `full`'s step-4 checkpoint, copied
    into `out`, and assert it ends as `full` did, bit for bit: the weights, the step-8 checkpoint
    (AdamW's state included) and the losses logged for steps 5-8. Returns the run's process."""
    copy_sharded_checkpoint(full, 4, out)
    proc = run_script(script, argv, world=world)
    assert "at step 4" in proc.stdout
    assert_state_dicts_equal(load_weights(out), load_weights(full))
    assert_same_sharded_checkpoint(out, full, 8, tmp_path)
    assert_same_logged_losses_after_step_4(out, full)
    return proc


def assert_same_logged_losses_after_step_4(resumed: Path, full: Path) -> None:
    """The resumed run (started from step 4 in an empty out-dir) logged steps 5-8 exactly."""
    got = [(r["step"], r["loss"]) for r in read_metrics(resumed)[0]]
    want = [(r["step"], r["loss"]) for r in read_metrics(full)[0] if r["step"] > 4]
    assert got == want


# -------------------------------------------------------------------------------------------------
# The same weights as DDP on the same global batch

ZERO3 = ("--zero-stage", "3")
# HSDP on 2 ranks: 2 replicas of a shard group of 1 rank. The reduce-scatter is then a copy and
# the all-reduce over the replicas does all the work; 2 micro-batches per rank accumulate first.
HSDP = ("--replicate", "2", "--micro-batch-size", "2")


@pytest.fixture(scope="module")
def launched(shared_run, corpus, cache_dir):
    """launched(script, world, *flags) -> the out-dir of that run, made once (shared_run).

    Callers must not write into the returned directory: copy what they need to change.
    """

    def get(script: str, world: int, *flags: str) -> Path:
        return shared_run(script, lambda out: cmd(corpus, cache_dir, out) + list(flags), world)[0]

    return get


@pytest.mark.one_process
@pytest.mark.parametrize(
    "script, world, flags",
    [
        (ZERO1, 2, ()),
        (DP, 1, ("--activation-checkpointing",)),
        (FSDP, 2, ZERO3),
        # Stage 2, checkpointed, and 4 micro-batches per rank: also proves that
        # set_requires_gradient_sync(False) accumulates exactly like one big batch.
        (FSDP, 2, ("--zero-stage", "2", "--activation-checkpointing", "--micro-batch-size", "1")),
        (FSDP, 2, ("--zero-stage", "3", "--activation-checkpointing", "--cpu-offload")),
        (FSDP, 2, HSDP),
    ],
    ids=["zero1", "dp-checkpointing", "fsdp-zero3", "fsdp-zero2-checkpointing-accum",
         "fsdp-zero3-checkpointing-offload", "hsdp-2x1-accum"],
)  # fmt: skip
def test_strategy_trains_like_ddp(trained, launched, script, world, flags):
    out = launched(script, world, *flags)
    reference = trained(DDP, world=2)
    assert_state_dicts_close(load_weights(out), load_weights(reference))
    # The losses and the pre-clip gradient norm too: a gradient off by a constant factor (say,
    # a missing world_size in the loss normalisation) would not show in the weights.
    assert_same_losses(out, reference)


# -------------------------------------------------------------------------------------------------
# Resuming


@pytest.fixture(scope="module")
def fsdp_run(launched) -> Path:
    return launched(FSDP, 2, *ZERO3)


def test_zero1_resume_is_bit_identical(launched, corpus, cache_dir, tmp_path):
    full = launched(ZERO1, 2)
    out = tmp_path / "resumed"
    copy_checkpoint(full, 4, out)
    proc = run_script(ZERO1, cmd(corpus, cache_dir, out), world=2)
    assert "at step 4" in proc.stdout
    assert_state_dicts_equal(load_weights(out), load_weights(full))
    # The consolidated optimizer state: the full AdamW state, in the plain optimizer's format.
    got, want = load_checkpoint(out, 8)["optimizer"], load_checkpoint(full, 8)["optimizer"]
    assert len(want["state"]) == len(load_weights(full)), "not the full (consolidated) state"
    got, want = flatten(got), flatten(want)
    assert got.keys() == want.keys()
    for key, value in want.items():
        same = torch.equal(got[key], value) if torch.is_tensor(value) else got[key] == value
        assert same, f"optimizer{key} differs after resuming"
    assert_same_logged_losses_after_step_4(out, full)


def test_a_ddp_checkpoint_resumes_in_train_zero1(trained, corpus, cache_dir, tmp_path):
    # The other way round: train_zero1.py shards a plain AdamW state when it loads it.
    out = tmp_path / "resumed"
    copy_checkpoint(trained(DDP, world=2), 4, out)
    proc = run_script(ZERO1, cmd(corpus, cache_dir, out), world=2)
    assert "at step 4" in proc.stdout
    assert_state_dicts_close(load_weights(out), load_weights(trained(DDP, world=2)))


def test_zero1_checkpoint_resumes_in_train_dp(launched, trained, corpus, cache_dir, tmp_path):
    # The consolidated checkpoint is a plain one: any script, any world size reads it.
    out = tmp_path / "resumed"
    checkpoint = copy_checkpoint(launched(ZERO1, 2), 4, out)
    run_script(DP, cmd(corpus, cache_dir, out, resume=str(checkpoint)))
    assert_state_dicts_close(load_weights(out), load_weights(trained(DP)))


@pytest.mark.resume
@pytest.mark.parametrize("flags", [ZERO3, HSDP], ids=["fsdp", "hsdp"])
def test_fsdp_resume_is_bit_identical(launched, corpus, cache_dir, tmp_path, flags):
    full, out = launched(FSDP, 2, *flags), tmp_path / "resumed"
    argv = cmd(corpus, cache_dir, out) + list(flags)
    proc = assert_resumes_bit_identically(FSDP, full, out, argv, 2, tmp_path)
    hsdp = "parallelism: HSDP 2 x 1 (replicas x shard group)" in proc.stdout
    assert hsdp == (flags == HSDP), proc.stdout


def test_hsdp_writes_each_replicated_shard_once(launched, fsdp_run):
    # Both replicas hold the same shards: DCP's planner has one of them write each, so the
    # checkpoint is no bigger than FSDP's (where every rank holds different shards).
    def size(run: Path) -> int:
        files = (run / "checkpoints" / "step_0000004").glob("*.distcp")
        return sum(f.stat().st_size for f in files)

    assert size(launched(FSDP, 2, *HSDP)) < 1.1 * size(fsdp_run)


def test_fsdp_checkpoint_resumes_on_a_different_number_of_ranks(
    fsdp_run,
    corpus,
    cache_dir,
    tmp_path,
):
    # Written by 2 ranks, resumed by 1: DCP reshards on load. Steps 5-8 then add the batch up in
    # one process: the DDP == one process tolerance, not equality.
    out = tmp_path / "resumed"
    copy_sharded_checkpoint(fsdp_run, 4, out)
    shutil.copy(fsdp_run / "metrics.jsonl", out)  # the resumed run keeps steps 1-4 of it
    proc = run_script(FSDP, cmd(corpus, cache_dir, out), world=1)
    assert "at step 4" in proc.stdout
    assert_state_dicts_close(load_weights(out), load_weights(fsdp_run))
    assert_same_losses(out, fsdp_run)


def test_a_sharded_checkpoint_that_cannot_be_written_stops_the_run_keeping_the_last(
    fsdp_run, corpus, cache_dir, tmp_path
):
    out = tmp_path / "out"
    copy_sharded_checkpoint(fsdp_run, 4, out)  # resumes there, saves step 8
    before = snapshot(out)
    # No file may grow past 1 MB (a full disk, as test_faults.py's .pt checkpoints meet it): the
    # ~10 MB shards of step 8 cannot be written.
    proc = run_script(FSDP, cmd(corpus, cache_dir, out), world=2, expect_rc=None,
                      preexec_fn=file_size_limit(2**20))  # fmt: skip
    assert proc.returncode != 0
    path = out / "checkpoints" / "step_0000008"
    assert f"error: could not save the checkpoint {path}: " in proc.stderr  # DCP's own words
    assert proc.stderr.count("error: ") == 1, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr.split("error: ")[0], proc.stderr[-4000:]
    assert f'{FSDP}", line' not in proc.stderr, "a worker's traceback"
    # The previous checkpoint intact, the partial directory (step_0000008.tmp) removed.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000004"]
    assert {k: v for k, v in snapshot(out).items() if k.startswith("checkpoints")} == before


# -------------------------------------------------------------------------------------------------
# Outputs


def test_model_pt_is_the_same_plain_state_dict_from_every_script(trained, fsdp_run):
    # DESIGN.md: what any script writes loads in every other and in generate. model.pt is the
    # contract: the same names, shapes and dtypes, plain tensors, loadable strictly.
    outputs = {"dp": trained(DP), "ddp": trained(DDP, world=2), "fsdp": fsdp_run}
    reference = load_weights(outputs["dp"])
    for name, out_dir in outputs.items():
        weights = load_weights(out_dir)
        assert weights.keys() == reference.keys(), name
        for key, tensor in weights.items():
            assert type(tensor) is torch.Tensor, f"{name}: {key} is a {type(tensor)}"
            assert (tensor.shape, tensor.dtype) == (reference[key].shape, reference[key].dtype)
        config = LlamaConfig(**json.loads((out_dir / "config.json").read_text()))
        LlamaForPretraining(config).load_state_dict(weights, strict=True)


def test_fsdp_refuses_a_ddp_checkpoint_clearly(trained, corpus, cache_dir, tmp_path):
    # Resumable state does not cross between the .pt and DCP formats (docs/memory.md): say so,
    # not crash.
    out = tmp_path / "out"
    checkpoint = copy_checkpoint(trained(DDP, world=2), 4, out)
    argv = cmd(corpus, cache_dir, out, resume=str(checkpoint))
    proc = run_script(FSDP, argv, world=1, expect_rc=2)
    assert "not a train_fsdp.py checkpoint" in proc.stderr, proc.stderr


def test_fsdp_refuses_a_damaged_shard_clearly(launched, corpus, cache_dir, tmp_path):
    # The train state reads fine, but a shard file is cut short (a disk error, a copy that
    # stopped): one message naming the checkpoint, exit code 2, no traceback.
    out = tmp_path / "out"
    checkpoint = copy_sharded_checkpoint(launched(FSDP, 2, *ZERO3), 4, out)
    shard = sorted(checkpoint.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    proc = run_script(FSDP, cmd(corpus, cache_dir, out, resume=str(checkpoint)), expect_rc=2)
    assert f"{shard} is damaged" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    # From before checksums (none beside the files): DCP's own read fails, and says so.
    (checkpoint / files.SUMS).unlink()
    proc = run_script(FSDP, cmd(corpus, cache_dir, out, resume=str(checkpoint)), expect_rc=2)
    assert f"could not load the sharded checkpoint {checkpoint}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("resume", ["auto", "explicit"])
def test_a_flipped_bit_in_a_shard_is_found_by_its_checksum(
    launched, trained, corpus, cache_dir, tmp_path, resume
):
    # Damage that leaves the file whole: DCP itself would read it without a word. --resume auto
    # warns and goes back to the checkpoint before (the same weights in the end); a checkpoint
    # named explicitly is refused, naming the file, and nothing changes.
    run = launched(FSDP, 2, *ZERO3)
    out = tmp_path / "out"
    copy_sharded_checkpoint(run, 4, out)
    checkpoint = copy_sharded_checkpoint(run, 8, out)
    shard = sorted(checkpoint.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10  # in the middle of a tensor's bytes
    shard.write_bytes(bytes(data))
    if resume == "explicit":
        argv = cmd(corpus, cache_dir, out, resume=str(checkpoint)) + list(ZERO3)
        assert_refused(FSDP, argv, f"{shard} is damaged", out, cache_dir, world=2)
        return
    proc = run_script(FSDP, cmd(corpus, cache_dir, out) + list(ZERO3), world=2)
    assert f"warning: {shard} is damaged" in proc.stderr, proc.stderr
    assert "resumed from" in proc.stdout and "step_0000004 at step 4" in proc.stdout
    a, b = load_weights(out), load_weights(run)
    assert all(torch.equal(a[k], b[k]) for k in b)


class Touch:
    """Unpickled, it creates `marker`: what a crafted checkpoint could do (or anything worse)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def code_running_pickle(marker: Path) -> bytes:
    """A pickle of Touch(marker), proven live: unpickling it creates the marker. DCP's plain
    pickle.load and torch.load(weights_only=False) both run it."""
    payload = pickle.dumps(Touch(marker))
    pickle.loads(payload)
    assert marker.exists(), "precondition: the payload runs code when unpickled"
    marker.unlink()
    return payload


def assert_refused_without_running_code(proc, marker: Path, names: str) -> None:
    assert not marker.exists(), "resuming ran code from the checkpoint"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and names in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_fsdp_resume_runs_no_code_from_a_crafted_metadata_file(
    launched, corpus, cache_dir, tmp_path
):
    # DCP reads .metadata with plain pickle.load, which calls whatever the file names. The run
    # resumes (--resume auto) into the checkpoint and must refuse it, not run it or skip it.
    out = tmp_path / "out"
    checkpoint = copy_sharded_checkpoint(launched(FSDP, 2, *ZERO3), 4, out)
    marker = tmp_path / "code_ran"
    (checkpoint / ".metadata").write_bytes(code_running_pickle(marker))
    reseal(checkpoint)
    proc = run_script(FSDP, cmd(corpus, cache_dir, out), expect_rc=2)
    assert_refused_without_running_code(proc, marker, f"cannot read {checkpoint}/.metadata")


def test_fsdp_resume_runs_no_code_from_a_crafted_optimizer_value(
    launched, corpus, cache_dir, tmp_path
):
    # A .metadata of DCP's own types only, but one value that is not a tensor (AdamW's weight
    # decay of one parameter) points at a pickle that runs code: DCP's default planner reads
    # such values with torch.load(weights_only=False).
    out = tmp_path / "out"
    checkpoint = copy_sharded_checkpoint(launched(FSDP, 2, *ZERO3), 4, out)
    marker = tmp_path / "code_ran"
    payload = code_running_pickle(marker)
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())  # written by this suite
    fqn = next(
        name for name, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, BytesStorageMetadata)
    )  # fmt: skip
    where = metadata.storage_data[MetadataIndex(fqn)]
    shard = checkpoint / where.relative_path
    offset = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(payload)
    metadata.storage_data[MetadataIndex(fqn)] = dataclasses.replace(
        where, offset=offset, length=len(payload)
    )
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(checkpoint)
    proc = run_script(FSDP, cmd(corpus, cache_dir, out), expect_rc=2)
    assert_refused_without_running_code(proc, marker, f"the value of {fqn}")


def test_plan_flag_prints_the_memory_plan(corpus, cache_dir, tmp_path):
    proc = run_script(FSDP, cmd(corpus, cache_dir, tmp_path / "out", max_steps=1) + ["--plan"])
    assert "zero3" in proc.stdout and "memory per GPU" in proc.stdout


@pytest.mark.parametrize(
    "flags, expect",
    [
        (["--replicate", "2"], "--replicate 2 must divide the number of ranks (1)"),
        (["--replicate", "0", "--check"], "argument --replicate: expected an integer >= 1"),
    ],
)
def test_fsdp_refuses_a_replicate_that_does_not_divide_the_ranks(
    corpus, cache_dir, tmp_path, flags, expect
):
    # One process: a grid of 2 (or 0) replicas cannot be made of 1 rank. --check sees it too.
    out = tmp_path / "out"
    assert_refused(FSDP, cmd(corpus, cache_dir, out) + flags, expect, out, cache_dir)
    assert not out.exists(), "nothing is written before the flags are checked"
