"""Big models: every sharding lesson builds on the meta device and gives each rank only its part;
a rank's peak memory at build, and at the end of a run, stays near its part; --async-save saves
without stopping, and a kill in the middle of one loses nothing.

The weights a lesson starts from are read from model.pt after one step at --lr 1e-30: AdamW's
update is then ~1e-30 (and weight decay multiplies by 1 - 1e-32, which is 1 in float), below
the last bit of every weight (initial weights are ~0.02, norms 1), so model.pt holds the
initial weights bit for bit. They must equal train_dp.py's, whatever the layout and the number
of ranks, 1, 2 or 4 (each weight is drawn whole from a seed of its own, then sliced).
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import (
    DP,
    LAUNCH_TIMEOUT,
    REPO,
    cmd,
    launch_env,
    load_weights,
    read_metrics,
    run_script,
    stop_group,
    wait_for_step,
)
from test_faults import descendants

from model import LlamaConfig, LlamaForPretraining

FSDP, TP, PP, CP, EP = (f"train_{n}.py" for n in ("fsdp", "tp", "pp", "cp", "ep"))
AT_BUILD = {"max_steps": 1, "lr": 1e-30}
MOE = {"num_experts": 2, "experts_per_token": 1}


@pytest.fixture(scope="module")
def dp_start(tmp_path_factory, corpus, cache_dir):
    """train_dp.py's initial weights: dense, and with experts (train_ep.py's model)."""

    def run(**overrides) -> dict:
        out = tmp_path_factory.mktemp("dp")
        run_script(DP, cmd(corpus, cache_dir, out, **AT_BUILD, **overrides))
        return load_weights(out)

    return {"dense": run(), "moe": run(**MOE)}


@pytest.mark.parametrize(
    "script, world, flags",
    [
        (FSDP, 1, {}), (FSDP, 2, {}), (FSDP, 4, {"replicate": 2}),
        (TP, 1, {"tp": 1}), (TP, 2, {"tp": 2}), (TP, 4, {"tp": 2}),
        (PP, 1, {"pp": 1}), (PP, 2, {"pp": 2}), (PP, 4, {"pp": 2, "tp": 2}),
        (CP, 1, {"cp": 1}), (CP, 2, {"cp": 2}), (CP, 4, {"cp": 2}),
        (EP, 1, {"ep": 1, **MOE}), (EP, 2, {"ep": 2, **MOE}), (EP, 4, {"ep": 2, **MOE}),
    ],
    ids=["fsdp-1", "fsdp-2", "hsdp-4", "tp-1", "tp-2", "tp2-dp2", "pp-1", "pp-2", "pp2-tp2",
         "cp-1", "cp-2", "cp2-dp2", "ep-1", "ep-2", "ep2-dp2"],
)  # fmt: skip
def test_a_sharded_build_starts_from_one_process_weights(
    dp_start, corpus, cache_dir, tmp_path, script, world, flags
):
    run_script(script, cmd(corpus, cache_dir, tmp_path, **AT_BUILD, **flags), world, torchrun=True)
    expected = dp_start["moe" if "num_experts" in flags else "dense"]
    actual = load_weights(tmp_path)
    assert actual.keys() == expected.keys()
    differ = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not differ, f"initial weights differ from train_dp.py's: {differ}"


def test_init_from_reads_into_the_shards(dp_start, corpus, cache_dir, tmp_path):
    # A finished run's model.pt, read mapped: each rank copies only its slice of each tensor.
    source = tmp_path / "source"
    run_script(DP, cmd(corpus, cache_dir, source, max_steps=2))
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out, **AT_BUILD, model=None, vocab_size=None)
    run_script(FSDP, argv + ["--init-from", str(source)], world=2)
    expected, actual = load_weights(source), load_weights(out)
    assert all(torch.equal(actual[k], expected[k]) for k in expected)
    assert not torch.equal(actual["norm.weight"], dp_start["dense"]["norm.weight"])


def state(pid: int) -> str:
    """A process's state letter (Z: a zombie, dead), "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def torchrun(world: int, script: str, *argv: str) -> subprocess.Popen:
    """torchrun of `script` over `world` ranks, started (harness.start's way) and not waited for."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={world}", str(REPO / script), *argv]  # fmt: skip
    return subprocess.Popen(
        command, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip


# -------------------------------------------------------------------------------------------------
# Memory: a rank's part, not the whole model


def memory_lines(output: str) -> list[float]:
    """The host-memory peaks (GB) of the "memory:" lines rank 0 printed."""
    return [float(m) for m in re.findall(r"peak so far ([\d.]+) GB host memory", output)]


def build_peak(corpus, cache_dir, out, world: int) -> float:
    """Rank 0's peak resident memory once `medium` is built over `world` FSDP ranks: the run
    is stopped as soon as it has said so (its first step would add AdamW's state)."""
    proc = torchrun(world, FSDP, *cmd(corpus, cache_dir, out, model="medium", max_steps=2))
    output, deadline = "", time.monotonic() + LAUNCH_TIMEOUT
    try:
        for line in proc.stdout:
            output += line
            if memory_lines(line) or time.monotonic() > deadline:
                break
    finally:
        stop_group(proc)
        proc.wait(timeout=LAUNCH_TIMEOUT)
    peaks = memory_lines(output)
    assert peaks, output[-4000:]
    return peaks[0]


def test_medium_over_fsdp_ranks_peaks_near_its_shard_at_build(corpus, cache_dir, tmp_path):
    # medium here: 24 layers of width 1024 and a 320-token vocabulary, 1.21 GB of fp32 weights,
    # 0.30 GB of which are a rank's shard at 4 ranks. The bound is the issue's: at most 1.2 GB
    # (torch itself takes ~0.4 GB of a process); it was 1.9 GB when each rank built it whole.
    two = build_peak(corpus, cache_dir, tmp_path / "two", 2)
    four = build_peak(corpus, cache_dir, tmp_path / "four", 4)
    assert four <= 1.2, f"rank 0 peaked at {four:.2f} GB building medium over 4 ranks"
    assert four < two, f"the peak did not fall with more ranks: {two:.2f} GB -> {four:.2f} GB"


def test_model_pt_of_a_big_model_is_written_one_tensor_at_a_time(tmp_path):
    # The end of a sharded run: model.pt written from the checkpoint tensor by tensor. Here the
    # reader hands out medium's tensors (1.21 GB of them); the writer's process must grow by
    # about one tensor (the largest: 11.5 MB), not by the model.
    probe = """
import os, resource, sys, torch
from lib.checkpoints.model_pt import save_tensor_by_tensor
from model import LlamaConfig

config = LlamaConfig.from_preset("medium", vocab_size=320)
def read(name, meta):
    return torch.full(meta.shape, 0.5, dtype=meta.dtype)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
save_tensor_by_tensor(config, read, sys.argv[1])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) / 2**20, os.path.getsize(sys.argv[1]) / 1e9)
"""
    path = tmp_path / "model.pt"
    proc = subprocess.run([sys.executable, "-c", probe, str(path)], cwd=REPO, env=launch_env(),
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    growth_gb, size_gb = map(float, proc.stdout.split())
    assert size_gb > 1.2, size_gb  # the whole model is in the file
    assert growth_gb < 0.15, f"writing model.pt grew the process by {growth_gb:.2f} GB"
    state = torch.load(path, mmap=True, weights_only=True)
    with torch.device("meta"):
        expected = LlamaForPretraining(LlamaConfig.from_preset("medium", vocab_size=320))
    assert {k: v.shape for k, v in state.items()} == {
        k: v.shape for k, v in expected.state_dict().items()
    }
    assert all(bool((t == 0.5).all()) for t in state.values())


# -------------------------------------------------------------------------------------------------
# --async-save

ASYNC = {"max_steps": 6, "save_interval": 1, "eval_interval": 3, "async_save": True}


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, corpus, cache_dir):
    """The runs below, saved synchronously: what --async-save must write, and a resume reach."""
    out = tmp_path_factory.mktemp("sync")
    run_script(FSDP, cmd(corpus, cache_dir, out, **{**ASYNC, "async_save": None}), world=2)
    return out


def test_async_save_trains_like_a_synchronous_save(sync_run, corpus, cache_dir, tmp_path):
    runs = {"sync": sync_run, "async": tmp_path / "async"}
    run_script(FSDP, cmd(corpus, cache_dir, runs["async"], **ASYNC), world=2)
    a, b = load_weights(runs["async"]), load_weights(runs["sync"])
    assert all(torch.equal(a[k], b[k]) for k in b)
    records = {name: sum(read_metrics(out), []) for name, out in runs.items()}
    losses = {name: [(r["step"], r.get("loss"), r.get("val_loss")) for r in found]
              for name, found in records.items()}  # fmt: skip
    assert losses["async"] == losses["sync"]
    kept = sorted(os.listdir(runs["async"] / "checkpoints"))
    assert kept == sorted(os.listdir(runs["sync"] / "checkpoints")) and kept


def test_a_nonfinite_step_while_an_async_save_is_written_keeps_that_checkpoint(
    corpus, cache_dir, tmp_path
):
    # Step 1's save is in flight when step 2 goes NaN: the guard stops the run, but the save was
    # started from the good state of step 1 (once: abandoned as .tmp, "no checkpoint had been
    # saved yet").
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out, **{**ASYNC, "max_steps": 4})
    proc = run_script(FSDP, argv, world=2, expect_rc=None, nonfinite="2")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "NaN/infinite at step 2" in output, output[-4000:]
    assert "are the last good ones" in output, output[-4000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_0000001"]
    assert (out / "checkpoints" / "step_0000001" / ".sums").is_file()


def test_a_run_killed_while_an_async_save_is_written_resumes_bit_for_bit(
    sync_run, corpus, cache_dir, tmp_path
):
    # tests/hold_save.py holds the background write of step 3's checkpoint (as a slow disk
    # would); training goes on meanwhile (step 4 is logged) until the next save must wait for
    # it. A kill then leaves step_0000003.tmp, half-written, and step 2 complete. The resumed run
    # ends where an uninterrupted one does (saved synchronously: the test above equals the two).
    reference = sync_run
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out, **ASYNC)
    proc = torchrun(2, "tests/hold_save.py", "step_0000003", str(REPO / FSDP), *argv)
    try:
        wait_for_step(out, 4, proc)  # step 3's save is being written: training went on
        assert (out / "checkpoints" / "step_0000003.tmp").is_dir()
    finally:  # every process of the run, as a dead node: torchrun and its workers
        run = [proc.pid, *descendants(proc.pid)]
        for pid in run:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=LAUNCH_TIMEOUT)
        while any(os.path.exists(f"/proc/{pid}") and "Z" not in state(pid) for pid in run):
            time.sleep(0.05)  # (a worker's lock on the out-dir goes with it)
    assert sorted(os.listdir(out / "checkpoints")) == ["step_0000001", "step_0000002",
                                                       "step_0000003.tmp"]  # fmt: skip
    resumed = run_script(FSDP, argv, world=2)  # the same command again
    assert "resumed from" in resumed.stdout and "step_0000002 at step 2" in resumed.stdout
    a, b = load_weights(out), load_weights(reference)
    assert all(torch.equal(a[k], b[k]) for k in b), "not bit-identical to the uninterrupted run"
    assert not (out / "checkpoints" / "step_0000003.tmp").exists()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps)
