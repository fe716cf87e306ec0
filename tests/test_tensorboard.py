"""Specification of --tensorboard: every value metrics.jsonl logs also reaches TensorBoard's
event files, read back here with TensorBoard's own reader; without the package, the flag is
refused in one line before any work."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import DP, cmd, read_metrics, run_script

from lib import flags

REPO = Path(__file__).resolve().parents[1]


def scalars(out_dir, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out_dir / "tensorboard"))
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def test_tensorboard_gets_every_logged_value(corpus, cache_dir, tmp_path):
    pytest.importorskip("tensorboard", reason="--tensorboard needs requirements-tensorboard.txt")
    out = tmp_path / "out"
    run_script(DP, cmd(corpus, cache_dir, out, max_steps=4) + ["--tensorboard"])
    train, val = read_metrics(out)
    assert [r["step"] for r in train] == [1, 2, 3, 4] and val
    for name in ("loss", "lr", "grad_norm", "tokens_per_sec"):
        logged = {r["step"]: r[name] for r in train}
        assert scalars(out, f"train/{name}") == pytest.approx(logged, rel=1e-6), name
    assert scalars(out, "val/loss") == pytest.approx({r["step"]: r["val_loss"] for r in val})
    assert scalars(out, "val/bpb") == pytest.approx({r["step"]: r["val_bpb"] for r in val})


def test_tensorboard_without_the_package_is_refused_in_one_line(corpus, cache_dir, monkeypatch):
    # flags.run_settings's errors are ValueErrors that exits.run prints in one line (exit code 2)
    # (tests/test_bad_input.py holds that for every such error).
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name)
    )
    parser = flags.build_parser("test")
    args = parser.parse_args(cmd(corpus, cache_dir, "unused") + ["--tensorboard"])
    with pytest.raises(ValueError, match="--tensorboard needs the tensorboard package: pip"):
        flags.run_settings(parser, args, 1, torch.device("cpu"))
    args = parser.parse_args(cmd(corpus, cache_dir, "unused"))
    # without the flag: no import, no error
    flags.run_settings(parser, args, 1, torch.device("cpu"))


OPTIONAL = ("tensorboard", "matplotlib", "transformers", "lm_eval")  # requirements-dev.txt's extras


def test_the_tests_of_optional_packages_skip_where_the_packages_are_absent(tmp_path):
    # The quick tier needs requirements.txt and pytest only: once, without tensorboard, it stopped
    # at a collection error. Each optional package is hidden here by a module that fails to import.
    for name in OPTIONAL:
        (tmp_path / f"{name}.py").write_text("raise ImportError('absent for this test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "no:xdist", "tests"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "error" not in proc.stdout.splitlines()[-1], proc.stdout[-3000:]
