"""Specification of parity.py: it runs strategies as a user would, measures each one's distance
from single-process training, and fails when a run drifts outside the tests' bounds.

Every strategy's own parity is proven by its own test module; here one strategy (DDP, the
cheapest launch) stands for all, and the comparison is checked on runs doctored to drift.
"""

import json
import shutil
import subprocess
import sys

import torch
from harness import BASE, DP, REPO, launch_env

import parity


def parity_command(corpus, cache_dir, tmp_path, *flags) -> list[str]:
    settings = ("seq_length", "batch_size", "vocab_size", "val_fraction", "seed")
    argv = [f"--{name.replace('_', '-')}={BASE[name]}" for name in settings]
    return [sys.executable, str(REPO / "parity.py"), "--data", str(corpus), "--cache-dir",
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
