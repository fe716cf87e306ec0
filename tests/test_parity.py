"""Specification of tools/parity.py: it runs strategies as a user would, measures each one's
distance from single-process training, and fails when a run drifts outside the tests' bounds.

Every strategy's own parity is proven by its own test module; here one strategy (DDP, the
cheapest launch) stands for all, and the comparison is checked on runs doctored to drift.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from harness import ATOL, BASE, DP, LOSS_RTOL, REPO, RTOL, launch_env

from tools import parity


def parity_command(corpus, cache_dir, tmp_path, *flags) -> list[str]:
    settings = ("seq_length", "batch_size", "vocab_size", "val_fraction", "seed")
    argv = [f"--{name.replace('_', '-')}={BASE[name]}" for name in settings]
    return [sys.executable, "-m", "tools.parity", "--data", str(corpus), "--cache-dir",
            str(cache_dir), "--work-dir", str(tmp_path / "runs"), *argv, *flags]  # fmt: skip


def test_parity_compares_a_strategy_with_one_process_and_draws_it(corpus, cache_dir, tmp_path):
    png, table = tmp_path / "parity.png", tmp_path / "parity.json"
    command = parity_command(corpus, cache_dir, tmp_path, "--only", "ddp", "--steps", "3",
                             "--png", str(png), "--json", str(table))  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, env=launch_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(table.read_text())["results"]["ddp"]
    assert len(result["losses"]) == 3 and result["within_tolerance"], result
    assert 0 <= result["max_loss_rel_diff"] <= parity.LOSS_RTOL
    assert 0 < result["max_weight_abs_diff"] < 1e-4  # fp32 sums in another order: not bit-equal
    assert png.read_bytes().startswith(b"\x89PNG")
    assert "ddp" in proc.stdout and "yes" in proc.stdout, proc.stdout


def test_a_run_that_drifts_is_outside_the_tolerance(trained, tmp_path):
    reference = trained(DP)
    assert parity.compare(reference, reference)["within_tolerance"]
    # A weight off by 1e-3: inside any loss bound, outside the weights'.
    drifted = tmp_path / "weights"
    shutil.copytree(reference, drifted)
    weights = torch.load(drifted / "model.pt", weights_only=True)
    weights["norm.weight"][0] += 1e-3
    torch.save(weights, drifted / "model.pt")
    result = parity.compare(drifted, reference)
    assert not result["within_tolerance"]
    assert abs(result["max_weight_abs_diff"] - 1e-3) < 1e-5
    # One logged loss off by 1e-4 relative: the weights are the reference's.
    drifted = tmp_path / "losses"
    shutil.copytree(reference, drifted)
    lines = (drifted / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    first = next(r for r in records if "loss" in r)
    first["loss"] *= 1 + 1e-4
    (drifted / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = parity.compare(drifted, reference)
    assert not result["within_tolerance"] and result["max_weight_abs_diff"] == 0


def test_an_unknown_strategy_is_refused_before_any_run(corpus, cache_dir, tmp_path):
    command = parity_command(corpus, cache_dir, tmp_path, "--only", "ddp,warp-drive")
    proc = subprocess.run(command, cwd=REPO, env=launch_env(), capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown strategy warp-drive" in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()


def test_a_strategy_that_refuses_its_flags_is_reported_with_its_own_line(
    corpus, cache_dir, tmp_path
):
    # Before: torchrun's 30-line report of the failed worker, which hid the lesson's one line.
    command = parity_command(corpus, cache_dir, tmp_path, "--only", "ddp", "--steps", "1",
                             "--batch-size", "3", "--png", "")  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, env=launch_env(), capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == "tools/parity.py: ddp failed (exit code 1):", proc.stderr
    assert len(lines) == 3, proc.stderr  # that line, the command, the lesson's error line
    assert lines[2].startswith("error: --batch-size 3 must be a multiple"), proc.stderr


def test_an_output_path_that_cannot_be_written_is_refused_before_any_run(
    corpus, cache_dir, tmp_path
):
    # Before: an IsADirectoryError or NotADirectoryError traceback after every run had finished.
    (tmp_path / "a-file").write_text("")
    for flag, path, said in [
        ("--json", tmp_path, f"--json {tmp_path} is a folder; name the file to write"),
        ("--png", tmp_path / "a-file" / "x.png", f"--png {tmp_path / 'a-file' / 'x.png'}: there is "
                                                 f"no folder {tmp_path / 'a-file'}"),
    ]:  # fmt: skip
        command = parity_command(corpus, cache_dir, tmp_path, "--only", "ddp", flag, str(path))
        proc = subprocess.run(command, cwd=REPO, env=launch_env(), capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr
        assert f"error: {said}" in proc.stderr, proc.stderr
        assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("under", ["", "runs"], ids=["the_file", "a_folder_in_it"])
def test_a_work_dir_that_is_a_file_is_refused_before_any_run_and_left_as_it_was(
    corpus, cache_dir, tmp_path, under
):
    # Before: a FileExistsError (or NotADirectoryError) traceback.
    (tmp_path / "notes.txt").write_text("mine\n")
    work_dir = tmp_path / "notes.txt" / under if under else tmp_path / "notes.txt"
    command = parity_command(corpus, cache_dir, tmp_path, "--only", "ddp", "--png", "")
    command += ["--work-dir", str(work_dir)]  # the last one given counts
    proc = subprocess.run(command, cwd=REPO, env=launch_env(), capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"error: --work-dir {work_dir}: {tmp_path / 'notes.txt'} is a file, "
                           f"not a folder; name a folder for the runs (one that does not exist "
                           f"is created)\n")  # fmt: skip
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
    assert not (tmp_path / "runs").exists() and proc.stdout == ""


def test_an_interrupted_launch_stops_its_run_with_a_sigterm_not_a_kill(monkeypatch, tmp_path):
    # torchrun passes a SIGTERM on to its ranks; a SIGKILL (what subprocess.run sends on an
    # exception) leaves them training with no parent. Here a stand-in for torchrun notes the
    # signal, and Ctrl-C arrives while launch() waits for it.
    said, ready = tmp_path / "said", tmp_path / "ready"
    stand_in = tmp_path / "torchrun.py"
    stand_in.write_text(
        "import pathlib, signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path({str(said)!r}).write_text("
        "'SIGTERM'), sys.exit(143)))\n"
        f"pathlib.Path({str(ready)!r}).write_text('')\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setitem(parity.STRATEGIES, "stand-in", (str(stand_in), 1, [], "a stand-in"))
    args = argparse.Namespace(data="d", cache_dir="c", vocab_size=320, seq_length=32, batch_size=8,
                              steps=1, seed=0, val_fraction=0.1, optimizer="adamw")  # fmt: skip

    def interrupt_when_ready():
        while not ready.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_ready, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        parity.launch("stand-in", args, tmp_path)
    assert said.read_text() == "SIGTERM"


def test_the_expert_parallel_rows_are_compared_with_the_mixture_of_experts_in_one_process():
    # Another model than the dense reference: compared with a dense run, any ep row would fail.
    for name, (script, _, flags, _) in parity.STRATEGIES.items():
        experts = "--num-experts" in flags
        assert experts == (script == "train_ep.py" or name == parity.MOE_REFERENCE), name
        if name not in parity.REFERENCES:
            assert parity.reference_of(name) == (parity.MOE_REFERENCE if experts else "single")
    assert parity.STRATEGIES[parity.MOE_REFERENCE][:2] == ("train_dp.py", 1)


def with_routing(run: Path, out: Path, moved: dict[int, int], loss_factor: dict[int, float]):
    """A copy of `run` whose metrics log a mixture of experts' routing (2 layers of 4 experts,
    100 assignments each): `moved[step]` assignments of the first layer moved from expert 0 to
    1 at that step and after, and each logged loss multiplied by loss_factor.get(step, 1)."""
    shutil.copytree(run, out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        if "loss" in r:
            shift = max((n for step, n in moved.items() if r["step"] >= step), default=0)
            r["tokens_per_expert"] = [[25 - shift, 25 + shift, 25, 25], [25, 25, 25, 25]]
            r["loss"] *= loss_factor.get(r["step"], 1.0)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


def test_a_mixture_of_experts_is_held_to_the_bounds_until_its_routing_differs(trained, tmp_path):
    reference = with_routing(trained(DP), tmp_path / "reference", {}, {})
    weights = torch.load(reference / "model.pt", weights_only=True)
    weights["norm.weight"][0] += 1e-3  # final weights outside the bound
    # One token's choice flips at step 6 (a rounding difference on a near-tie): from there the
    # runs differ, as any two layouts' would; the steps before it still agree.
    flipped = with_routing(reference, tmp_path / "flipped", {6: 1}, {6: 1.01, 7: 1.1, 8: 1.2})
    torch.save(weights, flipped / "model.pt")
    result = parity.compare(flipped, reference)
    assert result["routing_differs_from_step"] == 6 and result["within_tolerance"], result
    assert result["max_loss_rel_diff"] > 0.1  # reported, not held against it
    # A loss off before the routing differs is outside the bounds.
    early = with_routing(reference, tmp_path / "early", {6: 1}, {5: 1 + 1e-4})
    assert not parity.compare(early, reference)["within_tolerance"]
    # So is routing that moves many tokens at once (a wrong gradient, not a rounding).
    many = with_routing(reference, tmp_path / "many", {6: 10}, {})
    assert not parity.compare(many, reference)["within_tolerance"]
    # The same routing throughout: the final weights are held to their bound as ever.
    same = with_routing(reference, tmp_path / "same", {}, {})
    torch.save(weights, same / "model.pt")
    result = parity.compare(same, reference)
    assert result["routing_differs_from_step"] is None and not result["within_tolerance"]


def test_the_picture_holds_the_strategies_to_the_test_suites_bounds():
    assert (parity.ATOL, parity.RTOL, parity.LOSS_RTOL) == (ATOL, RTOL, LOSS_RTOL)
