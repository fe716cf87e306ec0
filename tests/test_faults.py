"""Specification of fault tolerance: real kills, damaged checkpoints, NaN losses, several nodes.

A week-long run must survive a dead worker, a killed job and a half-written file without losing
work, and end with exactly the weights an uninterrupted run would have: on CPU, bit for bit.
Every test here kills or damages something for real (SIGKILL to a process, a truncated file)
and compares with an uninterrupted run made by `trained` (tests/test_training.py's fixtures and
helpers are reused, so both files speak the same vocabulary).
"""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import (
    DDP,
    DP,
    LAUNCH_TIMEOUT,
    REPO,
    STREAMING,
    assert_state_dicts_close,
    checkpoint_files,
    cmd,
    copy_checkpoint,
    describe,
    file_size_limit,
    free_port,
    load_weights,
    processes_of_run,
    read_metrics,
    run_ddp_sh_env,
    run_script,
    script_command,
    snapshot,
    wait_for_step,
    watch_run,
)

from lib import loop
from lib.checkpoints import files

# Long enough that a kill lands mid-run: ~0.1 s a step, checkpoints every 4 steps.
FAULT_RUN = {"max_steps": 24, "save_interval": 4, "keep_checkpoints": 3, "eval_interval": 12}


def launch(argv: list[str], cwd: Path = REPO, **env) -> subprocess.Popen:
    """Start run_ddp.sh (2 CPU processes under torchrun) in a process group of its own."""
    return subprocess.Popen(
        ["bash", str(REPO / "run_ddp.sh"), *argv], cwd=cwd, env=run_ddp_sh_env(**env),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def finish(launcher: subprocess.Popen) -> tuple[int, str]:
    """Wait for the launcher; on a timeout kill its whole process group, workers included."""
    try:
        out, _ = launcher.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        out, _ = launcher.communicate()
        raise AssertionError(f"the run hung; its output:\n{out[-6000:]}") from None
    return launcher.returncode, out


def descendants(pid: int) -> list[int]:
    """All processes below pid (the launcher's workers), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue  # exited meanwhile
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def worker_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of the training process with global rank `rank` under this launcher."""
    for pid in descendants(launcher.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if DDP.encode() in cmdline and f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no worker with RANK={rank} under pid {launcher.pid}")


def wait_for(path: Path, launcher: subprocess.Popen, timeout: float = LAUNCH_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if launcher.poll() is not None or time.monotonic() > deadline:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
            raise AssertionError(f"{path.name} was never written:\n{launcher.communicate()[0]}")
        time.sleep(0.02)


# -------------------------------------------------------------------------------------------------
# Kills under torchrun


def test_killed_worker_is_restarted_by_torchrun_and_resumes_bit_identically(
    trained, corpus, cache_dir, tmp_path
):
    reference = trained(DDP, world=2, **FAULT_RUN)
    out = tmp_path / "out"
    # Through run_ddp.sh, the product's launcher, as a user would run it.
    launcher = launch(cmd(corpus, cache_dir, out, **FAULT_RUN), MAX_RESTARTS="1")
    wait_for(out / "checkpoints" / "step_0000008.pt", launcher)
    os.kill(worker_pid(launcher, rank=1), signal.SIGKILL)  # mid-run, between checkpoints
    rc, output = finish(launcher)

    assert rc == 0, output[-6000:]
    # torchrun restarted the group, and the new workers found the checkpoint by themselves.
    assert "resumed from" in output, output[-6000:]
    assert_weights_equal(load_weights(out), load_weights(reference))
    train_steps = [r["step"] for r in read_metrics(out)[0]]
    assert train_steps == sorted(set(train_steps)), "metrics.jsonl repeats or misorders steps"


# --streaming: the position in the stream comes back from the checkpoint, not from the step.
@pytest.mark.parametrize("flags", [{}, STREAMING], ids=["cached", "streaming"])
def test_killed_job_rerun_with_the_same_command_resumes_bit_identically(
    trained, corpus, cache_dir, tmp_path, flags
):
    reference = trained(DDP, world=2, **FAULT_RUN, **flags)  # the first: test_killed_worker_...'s
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out, **FAULT_RUN, **flags)
    launcher = launch(argv, MAX_RESTARTS="0")
    wait_for(out / "checkpoints" / "step_0000008.pt", launcher)
    os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and every worker, like a dead node
    launcher.wait(timeout=LAUNCH_TIMEOUT)
    assert not (out / "model.pt").exists(), "the first run finished before it was killed"

    rc, output = finish(launch(argv, MAX_RESTARTS="0"))  # the same command again
    assert rc == 0, output[-6000:]
    assert "resumed from" in output
    assert_weights_equal(load_weights(out), load_weights(reference))


def assert_weights_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    differ = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not differ, f"not bit-identical to the uninterrupted run: {differ}"


# -------------------------------------------------------------------------------------------------
# Damaged checkpoint files


def test_truncated_newest_checkpoint_falls_back_to_the_previous_one(
    trained, corpus, cache_dir, tmp_path
):
    reference = trained(DP)  # 8 steps, checkpoints at 4 and 8
    out = tmp_path / "out"
    copy_checkpoint(reference, 4, out)
    newest = out / "checkpoints" / "step_0000008.pt"
    data = (reference / "checkpoints" / "step_0000008.pt").read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # as if the disk filled up mid-write
    # What a process killed inside atomic_save leaves behind: a temporary file, never renamed.
    stray = out / "checkpoints" / "step_0000012.pt.tmp4242"
    stray.write_bytes(data[:1000])

    proc = run_script(DP, cmd(corpus, cache_dir, out))
    assert "cannot read checkpoint" in proc.stderr and "step_0000008.pt" in proc.stderr
    assert "resumed from" in proc.stdout and "step_0000004.pt" in proc.stdout
    assert not stray.exists(), "the stale temporary file was not cleaned up"
    assert_weights_equal(load_weights(out), load_weights(reference))


@pytest.mark.parametrize("resume", ["auto", "explicit"])
def test_a_flipped_bit_in_a_checkpoint_is_found_by_its_checksum(
    trained, corpus, cache_dir, tmp_path, resume
):
    # Damage that leaves the file whole and loadable: torch.load would read the flipped weight
    # without a word. --resume auto warns and goes back to the checkpoint before; one named
    # explicitly is refused, naming the file, and nothing changes.
    reference = trained(DP)  # 8 steps, checkpoints at 4 and 8
    out = tmp_path / "out"
    copy_checkpoint(reference, 4, out)
    newest = copy_checkpoint(reference, 8, out)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10  # in the middle of the tensors' bytes
    newest.write_bytes(bytes(data))
    if resume == "explicit":
        before = snapshot(out)
        proc = run_script(DP, cmd(corpus, cache_dir, out, resume=str(newest)), expect_rc=2)
        assert f"{newest} is damaged" in proc.stderr and "Traceback" not in proc.stderr
        assert snapshot(out) == before
        return
    proc = run_script(DP, cmd(corpus, cache_dir, out))
    assert f"warning: {newest} is damaged" in proc.stderr, proc.stderr
    assert "resumed from" in proc.stdout and "step_0000004.pt" in proc.stdout
    assert_weights_equal(load_weights(out), load_weights(reference))


def test_a_text_file_that_cannot_be_written_keeps_the_old_one_and_leaves_no_temporary_file(
    tmp_path, monkeypatch
):
    # metrics.jsonl cut back on a resume, args.jsonl, config.json, tokenizer.json: written as
    # a checkpoint is (files.atomic_write_text), in UTF-8 whatever the locale says.
    path = tmp_path / "tokenizer.json"
    files.atomic_write_text(str(path), '{"vocab": {"é": 0, "€": 1}}\n')
    assert path.read_bytes().decode("utf-8") == '{"vocab": {"é": 0, "€": 1}}\n'

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        files.atomic_write_text(str(path), "new\n")
    assert path.read_bytes().decode("utf-8") == '{"vocab": {"é": 0, "€": 1}}\n'
    assert os.listdir(tmp_path) == ["tokenizer.json"]  # the partial file removed


def test_a_torn_last_line_in_metrics_jsonl_does_not_stop_the_resume(
    trained, corpus, cache_dir, tmp_path
):
    reference = trained(DP)  # 8 steps, a checkpoint at 4
    out = tmp_path / "out"
    copy_checkpoint(reference, 4, out)
    lines = (reference / "metrics.jsonl").read_text().splitlines(keepends=True)
    # Killed while appending step 6's line, after the checkpoint of step 4:
    (out / "metrics.jsonl").write_text("".join(lines[:6]) + lines[6][: len(lines[6]) // 2])

    run_script(DP, cmd(corpus, cache_dir, out))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 9))
    assert_weights_equal(load_weights(out), load_weights(reference))


def test_a_usage_error_under_run_ddp_sh_ends_the_job_at_once_without_restarts(
    corpus, cache_dir, tmp_path
):
    # torchrun restarts failed workers whatever their exit code (and then exits 1 itself):
    # run_ddp.sh checks the flags first, for the job's 2 processes (8 does not divide by 3).
    out = tmp_path / "out"
    rc, output = finish(launch(cmd(corpus, cache_dir, out, micro_batch_size=3)))
    expect = "--batch-size 8 must be a multiple of --micro-batch-size (3) x devices (2)"
    assert rc == 2 and output.count("error: ") == 1 and expect in output, output[-6000:]
    assert "--max-restarts" not in output, "torchrun was started"
    assert not out.exists()


def test_run_ddp_sh_reads_relative_paths_from_where_it_is_run(trained, corpus, cache_dir, tmp_path):
    # As any command: --out-dir run means ./run here, not a folder beside run_ddp.sh.
    rc, output = finish(launch(cmd(corpus, cache_dir, "run"), cwd=tmp_path))
    assert rc == 0, output[-6000:]
    assert_weights_equal(load_weights(tmp_path / "run"), load_weights(trained(DDP, world=2)))
    assert not (REPO / "run").exists()


def test_resume_path_to_a_corrupt_file_is_refused_and_nothing_changes(
    trained, corpus, cache_dir, tmp_path
):
    out = tmp_path / "out"
    shutil.copytree(trained(DP), out)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    before = snapshot(out)
    proc = run_script(DP, cmd(corpus, cache_dir, out, resume=bad), expect_rc=2)
    assert "cannot read checkpoint" in proc.stderr and "Traceback" not in proc.stderr
    assert snapshot(out) == before


# -------------------------------------------------------------------------------------------------
# Non-finite losses

# Step 2's loss is made NaN (tests/nonfinite.py): where an absurd learning rate first overflows
# depends on the CPU's kernels, an injected NaN does not. A checkpoint after every step.
NAN_RUN = {"save_interval": 1, "eval_interval": 100}


@pytest.mark.parametrize("script, world", [(DP, 1), (DDP, 2)])
def test_nonfinite_loss_stops_the_run_naming_the_step_and_saves_nothing_bad(
    corpus, cache_dir, tmp_path, script, world
):
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out, **NAN_RUN)
    proc = run_script(script, argv, world, expect_rc=None, nonfinite="2")
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "NaN/infinite at step 2" in output
    assert output.count("error: the loss or the gradient became") == 1, "printed once, by rank 0"
    assert not (out / "model.pt").exists()
    checkpoints = checkpoint_files(out)
    assert checkpoints == ["step_0000001.pt"], "only the last good state may be saved"
    ckpt = torch.load(out / "checkpoints" / checkpoints[0], weights_only=True)
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())


def test_skip_nonfinite_skips_bad_updates_and_finishes_with_finite_weights(
    corpus, cache_dir, tmp_path
):
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out, **NAN_RUN) + ["--skip-nonfinite"]
    proc = run_script(DP, argv, nonfinite="2")
    assert "step 2 has a non-finite loss or gradient; its update is skipped" in proc.stderr
    assert proc.stderr.count("its update is skipped") == 1, "step 2 alone"
    weights = load_weights(out)
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_skip_nonfinite_stops_after_too_many_skipped_steps_in_a_row(corpus, cache_dir, tmp_path):
    # Every step after the first is non-finite here: skipping cannot save this run.
    out, limit = tmp_path / "out", loop.NonFiniteGuard.MAX_SKIPPED_IN_A_ROW
    run = {**NAN_RUN, "max_steps": limit + 4, "save_interval": 4}
    argv = cmd(corpus, cache_dir, out, **run) + ["--skip-nonfinite"]
    proc = run_script(DP, argv, expect_rc=1, nonfinite="2-")
    assert (
        f"error: the loss or the gradient was NaN/infinite at {limit} steps in a row "
        f"(2 to {limit + 1}): the run is not recovering" in proc.stderr
    )
    assert proc.stderr.count("error: ") == 1 and "Traceback" not in proc.stderr
    assert not (out / "model.pt").exists()
    checkpoints = [out / "checkpoints" / name for name in checkpoint_files(out)]
    assert [p.name for p in checkpoints] == ["step_0000004.pt", "step_0000008.pt"]
    for path in checkpoints:  # skipped updates: nothing saved holds NaN/inf
        ckpt = torch.load(path, weights_only=True)
        assert all(torch.isfinite(t).all() for t in ckpt["model"].values())


# -------------------------------------------------------------------------------------------------
# A full disk

# Past this size a write fails (see harness.file_size_limit): metrics.jsonl stays far below, a
# checkpoint (~20 MB for these runs) far above.
FILE_SIZE_LIMIT = 2**20


@pytest.mark.parametrize("script, world", [(DP, 1), (DDP, 2)])
def test_a_checkpoint_that_cannot_be_written_stops_the_run_in_one_line_keeping_the_last(
    trained, corpus, cache_dir, tmp_path, script, world
):
    out = tmp_path / "out"
    copy_checkpoint(trained(script, world=world), 4, out)  # resumes there, saves step 8
    before = snapshot(out)
    proc = run_script(script, cmd(corpus, cache_dir, out), world, expect_rc=None,
                      preexec_fn=file_size_limit(FILE_SIZE_LIMIT))  # fmt: skip
    assert proc.returncode == 1 if world == 1 else proc.returncode != 0, describe(proc, "failure")
    path = out / "checkpoints" / "step_0000008.pt"
    assert f"error: could not save the checkpoint {path}: File too large (" in proc.stderr
    assert proc.stderr.count("error: ") == 1, proc.stderr[-4000:]
    # No traceback from any rank (torchrun's own report of the failed worker comes after).
    assert "Traceback" not in proc.stderr.split("error: ")[0], proc.stderr[-4000:]
    assert f'{script}", line' not in proc.stderr, proc.stderr[-4000:]
    # The previous checkpoint intact, no partial file left behind, no model.pt.
    assert checkpoint_files(out) == ["step_0000004.pt"]
    assert {k: v for k, v in snapshot(out).items() if k.startswith("checkpoints")} == before
    assert not (out / "model.pt").exists()


# -------------------------------------------------------------------------------------------------
# Nothing outlives a run: whatever ends it, its processes end, DataLoader workers included

FSDP = "train_fsdp.py"
# Seconds from the error line to the launcher's exit (the atexit handlers, the workers' shutdown,
# torchrun's report: about 1 s), or from torchrun's death to its ranks' end. A run whose exit
# waited for its DataLoader workers never ended at all.
PROMPT = 30


# DataLoader workers ignore SIGTERM (loader_workers.ignore_stop_signals), which is all that Python's
# exit sends the workers of a loader still open; a run that ends in an error must end them.
@pytest.mark.parametrize("script, world, workers", [(DP, 1, 1), (FSDP, 2, 2)])
def test_a_failed_save_with_dataloader_workers_ends_the_run_and_its_workers_at_once(
    trained, corpus, cache_dir, tmp_path, script, world, workers
):
    out, sharded = tmp_path / "out", script == FSDP  # FSDP's checkpoints: DCP directories
    name = "step_0000004" if sharded else "step_0000004.pt"
    source = trained(script, world=world)
    if sharded:
        shutil.copytree(source / "checkpoints" / name, out / "checkpoints" / name)
    else:
        copy_checkpoint(source, 4, out)  # with its checksums
    before = snapshot(out)
    argv = cmd(corpus, cache_dir, out, num_workers=workers)  # resumes at 4, saves 8: fails
    run = watch_run(script_command(script, argv, world), timeout=180,
                    preexec_fn=file_size_limit(FILE_SIZE_LIMIT))  # fmt: skip
    assert run.returncode == 1 if world == 1 else run.returncode != 0, run.output[-6000:]
    failed = out / "checkpoints" / ("step_0000008" if sharded else "step_0000008.pt")
    error = f"error: could not save the checkpoint {failed}: "
    assert run.output.count(error) == 1, run.output[-6000:]
    assert "Traceback" not in run.output.split("error: ")[0], run.output[-6000:]
    assert run.left == [], f"processes of the run outlived it: {run.left}"
    assert run.seconds_after(error) < PROMPT, run.output[-6000:]
    # The previous checkpoint intact, nothing of the failed one left behind, no model.pt.
    assert checkpoint_files(out) == [name]
    assert {k: v for k, v in snapshot(out).items() if k.startswith("checkpoints")} == before
    assert not (out / "model.pt").exists()


def test_ranks_and_their_workers_stop_with_a_checkpoint_when_torchrun_is_killed(
    corpus, cache_dir, tmp_path
):
    # torchrun SIGKILLed (an OOM killer, a node agent) cannot pass anything on to its ranks:
    # each rank asked the kernel for SIGTERM at its launcher's death (lib/distributed.py), and
    # stops as it would on torchrun's own SIGTERM, its DataLoader worker with it.
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out, **FAULT_RUN, num_workers=1)

    def kill_torchrun(proc, marker, lines) -> None:
        wait_for_step(out, 2, proc)
        alive = processes_of_run(marker)
        assert len(alive) >= 5, alive  # torchrun, 2 ranks, a DataLoader worker each
        proc.kill()

    run = watch_run(script_command(DDP, argv, 2), during=kill_torchrun, grace=PROMPT)
    assert run.left == [], f"processes of the run outlived torchrun: {run.left}"
    stopped = re.findall(r"stopped at step (\d+), checkpoint saved", run.output)
    assert len(stopped) == 1, run.output[-6000:]
    assert (out / "checkpoints" / f"step_{int(stopped[0]):07d}.pt").is_file()
    assert "Traceback" not in run.output, run.output[-6000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
def test_a_dataloader_worker_dies_with_its_training_process_even_one_killed_at_once():
    # A worker ignores SIGTERM; its parent SIGKILLed (no shutdown of its loader) must not leave
    # it running, not even for the DataLoader's own check of its parent (every 5 s, when idle).
    program = (
        "import os, sys, time, torch\n"
        "from torch.utils.data import DataLoader\n"
        "from lib.extras.loader_workers import ignore_stop_signals\n"
        "class Slow(torch.utils.data.Dataset):\n"
        "    def __len__(self): return 10\n"
        "    def __getitem__(self, i): time.sleep(60); return i\n"  # busy in a batch
        "loader = DataLoader(Slow(), num_workers=1, worker_init_fn=ignore_stop_signals)\n"
        "batches = iter(loader)\n"
        "print('worker', batches._workers[0].pid, flush=True)\n"
        "time.sleep(60)\n"
    )

    def kill_parent(proc, marker, lines) -> None:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while not any(line.startswith("worker") for _, line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, lines
            time.sleep(0.05)
        time.sleep(1)  # the worker's init (ignore_stop_signals) has run by now
        proc.kill()

    run = watch_run([sys.executable, "-c", program], during=kill_parent, grace=PROMPT)
    assert run.returncode == -signal.SIGKILL, run.output
    assert run.left == [], f"the worker outlived its parent: {run.left}"
    assert run.gone_after < 5, "the kernel's signal, not the DataLoader's 5 s check, ended it"


# -------------------------------------------------------------------------------------------------
# Several nodes


def test_two_nodes_of_one_process_equal_one_node_of_two(trained, corpus, cache_dir, tmp_path):
    # Two "nodes" on one machine, each its own run_ddp.sh (one torchrun agent, one worker),
    # meeting through the c10d rendezvous on 127.0.0.1, the way cluster nodes meet.
    out, port = tmp_path / "out", str(free_port())
    nodes = [
        launch(cmd(corpus, cache_dir, out), NNODES="2", NODE_RANK=str(node_rank),
               NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, MAX_RESTARTS="0",
               RDZV_ID="two-nodes")
        for node_rank in (0, 1)
    ]  # fmt: skip
    for node in nodes:
        rc, output = finish(node)
        assert rc == 0, output[-6000:]
    assert "--nnodes=2" in output
    # Same ranks, same shards, same collectives as one node with two processes.
    assert_state_dicts_close(load_weights(out), load_weights(trained(DDP, world=2)))


def test_a_muon_run_logs_muons_learning_rate_and_names_muon_lr_when_it_goes_nonfinite(
    corpus, cache_dir, tmp_path
):
    # Once: the summary, metrics.jsonl and the plot had AdamW's lr only, and a NaN said "try a
    # lower --lr" where --muon-lr (the lr of most of the weights) is as likely the culprit.
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out, **{**NAN_RUN, "log_interval": 1}) + [
        "--optimizer", "muon", "--muon-lr", "0.05"]  # fmt: skip
    proc = run_script(DP, argv, expect_rc=1, nonfinite="2")
    assert "Muon lr 0.05 (the same schedule)" in proc.stdout, proc.stdout[-3000:]
    assert "Try a lower --muon-lr or --lr, --grad-clip" in proc.stderr, proc.stderr[-3000:]
    [record] = read_metrics(out)[0]
    assert record["step"] == 1 and record["muon_lr"] > record["lr"] > 0, record
