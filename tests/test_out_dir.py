"""Specification of --out-dir ownership: one run at a time, one kind of checkpoint, and nothing
of an earlier run silently lost.

A second run into the out-dir of a live one is refused at once, naming the live one; the lock of
a killed run does not block the rerun. A script refuses an out-dir holding the other family's
checkpoints (.pt files of train_dp.py/train_ddp.py, DCP directories of train_fsdp.py,
train_tp.py and train_pp.py). A fresh start in an out-dir with outputs but no checkpoint says
so, and keeps the old metrics.jsonl as metrics.jsonl.1.
"""

import argparse
import os
import shutil
import signal
import socket
from pathlib import Path

import pytest
from harness import (
    DDP,
    DP,
    cmd,
    read_metrics,
    run_script,
    snapshot,
    start,
    stop_group,
    wait_for_step,
)
from test_bad_input import assert_refused

from lib.checkpoints import one_file, sharded
from lib.checkpoints.out_dir import release_out_dir

FSDP = "train_fsdp.py"


def test_a_live_runs_out_dir_is_refused_naming_it_and_a_killed_runs_is_not(
    corpus, cache_dir, tmp_path
):
    out = tmp_path / "out"
    # A run that goes on until killed, with a DataLoader worker (a child process of its own).
    forever = {"max_steps": 10**6, "save_interval": 10**6, "eval_interval": 10**6}
    holder = start(DP, cmd(corpus, cache_dir, out, **forever, num_workers=1))
    try:
        wait_for_step(out, 1, holder)
        expect = f"is in use by another run (pid {holder.pid} on {socket.gethostname()}, started "
        for script, world in [(DP, 1), (DDP, 2)]:  # under torchrun: every rank stops, one says so
            proc = run_script(script, cmd(corpus, cache_dir, out), world, expect_rc=None)
            output = proc.stdout + proc.stderr
            assert proc.returncode == 2 if world == 1 else proc.returncode != 0, output[-4000:]
            assert expect in proc.stderr and "train_dp.py --data" in proc.stderr, output[-4000:]
            assert proc.stderr.count("error: ") == 1, proc.stderr[-4000:]
            assert "Traceback" not in proc.stderr.split("error: ")[0], output[-4000:]
            assert "model:" not in proc.stdout, "it prepared the run before refusing"

        # kill -9 of the training process alone: its DataLoader worker outlives it for a while
        # (a lock that children share, like flock's, would still be held by it).
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        killed_metrics = (out / "metrics.jsonl").read_text()
        proc = run_script(DP, cmd(corpus, cache_dir, out))  # the default 8 steps
    finally:
        stop_group(holder)
    assert "has metrics.jsonl but no checkpoint: starting at step 0" in proc.stdout, proc.stdout
    assert (out / "metrics.jsonl.1").read_text() == killed_metrics
    assert [r["step"] for r in read_metrics(out)[0]] == list(range(1, 9))


def test_a_fresh_start_over_old_outputs_says_so_and_keeps_the_old_metrics(
    trained, corpus, cache_dir, tmp_path
):
    out = tmp_path / "out"
    shutil.copytree(trained(DP), out)
    shutil.rmtree(out / "checkpoints")  # outputs, but nothing to resume from
    old_metrics = (out / "metrics.jsonl").read_text()
    (out / "metrics.jsonl.1").write_text("an older run's\n")  # taken: the next number is used

    proc = run_script(DP, cmd(corpus, cache_dir, out, max_steps=2))
    note = [line for line in proc.stdout.splitlines() if line.startswith("note: ")]
    assert note == [
        f"note: {out} has metrics.jsonl and model.pt but no checkpoint: starting at step 0; its "
        f"metrics.jsonl is now metrics.jsonl.2; model.pt will be replaced when this run ends"
    ], proc.stdout
    assert (out / "metrics.jsonl.2").read_text() == old_metrics
    assert (out / "metrics.jsonl.1").read_text() == "an older run's\n"
    assert [r["step"] for r in read_metrics(out)[0]] == [1, 2]


@pytest.fixture
def fsdp_out_dir(trained, tmp_path):
    """What train_fsdp.py leaves in an out-dir: model.pt, metrics.jsonl, config.json,
    tokenizer.json and checkpoints/step_NNNNNNN/ directories (whose content no refusal reads)."""
    out = tmp_path / "fsdp_out"
    shutil.copytree(trained(DP), out)
    for checkpoint in (out / "checkpoints").glob("*.pt"):
        checkpoint.unlink()
        Path(f"{checkpoint}.sums").unlink()
        checkpoint.with_suffix("").mkdir()
        (checkpoint.with_suffix("") / "train_state.pt").write_bytes(b"...")
    return out


@pytest.mark.parametrize("script, world, resume", [(DP, 1, "auto"), (DDP, 2, "never")])
def test_train_dp_and_ddp_refuse_an_out_dir_of_sharded_checkpoints(
    fsdp_out_dir, corpus, cache_dir, script, world, resume
):
    # Before: they started at step 0 beside those checkpoints and replaced that run's model.pt.
    argv = cmd(corpus, cache_dir, fsdp_out_dir, resume=resume)
    expect = ("holds checkpoints of train_fsdp.py/train_tp.py/train_pp.py/train_cp.py/train_ep.py "
              "(directories)")  # fmt: skip
    assert_refused(script, argv, expect, fsdp_out_dir, cache_dir, world)


def test_train_fsdp_refuses_an_out_dir_of_pt_checkpoints_even_with_resume_never(
    trained, corpus, cache_dir, tmp_path
):
    out = tmp_path / "out"
    shutil.copytree(trained(DP), out)
    argv = cmd(corpus, cache_dir, out, resume="never")
    expect = f"holds checkpoints of {DP}/{DDP}/train_zero1.py (.pt files), which {FSDP} can"
    assert_refused(FSDP, argv, expect, out, cache_dir)


def refused_at_resume(out: Path, expect: str, script: str = DP) -> None:
    """A resume into `out` (the out-dir step of `script`, in this process): ValueError holding
    `expect`, and `out` unchanged. (The train scripts say a ValueError in one line, exit 2.)"""
    before = snapshot(out)
    args = argparse.Namespace(out_dir=str(out), resume="auto")
    try:
        with pytest.raises(ValueError) as refusal:
            if script == DP:
                one_file.prepare_out_dir(args)
            else:
                sharded.prepare_out_dir(args, script)
    finally:
        release_out_dir()  # (a run's lock, held by this process)
    assert expect in str(refusal.value) and "\n" not in str(refusal.value), str(refusal.value)
    assert snapshot(out) == before


@pytest.mark.parametrize("script", [DP, FSDP])
def test_checkpoints_none_of_which_can_be_read_are_refused_not_replaced(
    trained, fsdp_out_dir, tmp_path, script
):
    # Before: a warning per checkpoint, then "no checkpoint: starting at step 0", and the new run
    # pruned and overwrote them (a disk or a mount that comes back would have found them gone).
    out = fsdp_out_dir  # its train_state.pt files hold b"...": none loads
    if script == DP:
        out = tmp_path / "out"
        shutil.copytree(trained(DP), out)
        for checkpoint in (out / "checkpoints").glob("*.pt"):
            checkpoint.write_bytes(checkpoint.read_bytes()[:50])
    count = len([p for p in (out / "checkpoints").iterdir() if p.suffix != ".sums"])
    expect = f"none of the {count} checkpoints in {out / 'checkpoints'} can be read; move them"
    refused_at_resume(out, expect, script)


@pytest.mark.parametrize(
    "line, expect",
    [(b'{"note": "mine"}\n', "line {n} is not a step's record ({{\"note\": \"mine\"}}): correct"),
     (b'{"step": "x"}\n', "line {n} is not a step's record"),
     (b"\xff\xfe\n", "cannot read {metrics}: 'utf-8' codec can't decode byte 0xff")],
)  # fmt: skip
def test_a_resume_over_a_metrics_file_it_cannot_read_is_refused_before_anything_is_written(
    trained, tmp_path, line, expect
):
    # Before: a KeyError or TypeError traceback, or a line that did not name the file, after
    # args.jsonl had recorded a start. (Under torchrun: the next test.)
    out = tmp_path / "out"
    shutil.copytree(trained(DP), out)
    metrics = out / "metrics.jsonl"
    n = len(metrics.read_bytes().splitlines()) + 1  # the line added
    metrics.write_bytes(metrics.read_bytes() + line)
    refused_at_resume(out, expect.format(metrics=metrics, n=n))


def test_under_torchrun_a_metrics_file_it_cannot_read_is_said_once(
    trained, corpus, cache_dir, tmp_path
):
    # Before: rank 0 failed alone after the ranks had parted, and rank 1 printed a traceback
    # ("Connection closed by peer"); now rank 0 reads the file while it chooses the checkpoint.
    out = tmp_path / "out"
    shutil.copytree(trained(DP), out)
    metrics = out / "metrics.jsonl"
    n = len(metrics.read_bytes().splitlines()) + 1
    metrics.write_bytes(metrics.read_bytes() + b"42\n")
    expect = f"{metrics} line {n} is not a step's record (42): correct or delete that line"
    argv = cmd(corpus, cache_dir, out, max_steps=12)
    proc = assert_refused(DDP, argv, expect, out, cache_dir, world=2)
    # Only torchrun's own report follows the line.
    assert proc.stderr.count("Traceback") == 1, proc.stderr
    assert "RuntimeError" not in proc.stderr and "Connection" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", ["checkpoints", ".lock", "metrics.jsonl"])
def test_a_file_or_folder_in_the_place_of_the_other_is_refused_in_one_line(trained, tmp_path, name):
    # Before: a checkpoints file meant "no checkpoint" (metrics.jsonl moved aside), a step
    # trained, then "could not save ... if the disk is full"; a .lock or metrics.jsonl folder
    # gave an IsADirectoryError traceback.
    out = tmp_path / "out"
    shutil.copytree(trained(DP), out)
    path = out / name
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    path.write_text("") if name == "checkpoints" else path.mkdir()
    expect = {"checkpoints": f"--out-dir {out} cannot be created or written: [Errno 20] Not a "
                             f"directory: '{path}'",
              ".lock": f"--out-dir {out} cannot be created or written: [Errno 21] Is a directory",
              "metrics.jsonl": f"cannot read {path}: [Errno 21] Is a directory"}[name]  # fmt: skip
    refused_at_resume(out, expect)  # (metrics.jsonl: a resume; at step 0 it would move aside)


@pytest.mark.parametrize("script", [DP, FSDP])
def test_a_resume_path_that_holds_no_checkpoint_leaves_no_out_dir_behind(tmp_path, script):
    # Before: the refusal came after the out-dir had been made, which then held a .lock alone.
    out = tmp_path / "new"
    args = argparse.Namespace(out_dir=str(out), resume=str(tmp_path / "nope"))
    expect = "no checkpoint file at" if script == DP else f"is not a {FSDP} checkpoint directory"
    with pytest.raises(ValueError, match=expect):
        if script == DP:
            one_file.prepare_out_dir(args)
        else:
            sharded.prepare_out_dir(args, script)
    assert not out.exists()


def test_a_write_past_a_file_size_limit_names_the_limit_not_a_full_disk(monkeypatch):
    # `ulimit -f`: writes fail with EFBIG (Python ignores SIGXFSZ), or, from DCP's writer on
    # another rank, as a RuntimeError with no errno ("unexpected pos ..."): the disk is not full.
    import errno
    import resource

    from lib.checkpoints.out_dir import save_failed

    monkeypatch.setattr(resource, "getrlimit", lambda which: (4096, resource.RLIM_INFINITY))
    efbig = OSError(errno.EFBIG, "File too large")
    said = str(save_failed("out/checkpoints/step_0000001.pt", efbig))
    assert "at most 4096 bytes" in said and "ulimit -f" in said and "disk is full" not in said
    said = str(save_failed("out/checkpoints/step_0000001", RuntimeError("unexpected pos 704")))
    assert "ulimit -f" in said, said
