"""Specification of tensor parallelism (train_tp.py): splitting every matrix over 2 ranks trains
exactly like one process on the same global batch, resumes bit for bit, and writes the same plain
model.pt as every other script; so does --sequence-parallel, whose checkpoints are the same.

The runs are launched as a user would (torchrun, 2 gloo ranks on CPU) with the training tests'
settings and helpers (harness.py, conftest.py), and compared with train_dp.py on one process with
test_training.py's tolerances: TP changes which rank multiplies which slice, and adds partial sums
in another order, not the arithmetic. Measured on this corpus (fp32, --tp 2 against train_dp.py):
weights differ by at most 1.2e-5, logged losses by 2.1e-7 (relative), gradient norms by 3.7e-6
(relative), validation losses by 1.1e-7. The 2-D layout (--tp 2 on 4 ranks: TP x FSDP) was
checked by hand (weights within 1.1e-5 of train_dp.py); 4 processes are too slow for CI on 2 cores.

--sequence-parallel (pad mode, against train_dp.py in pad mode): weights within 4.4e-6, logged
losses 5.1e-7, gradient norms 4.9e-6, validation losses equal. Resumed under --sequence-parallel
from a checkpoint of a run without it, steps 5-8 differ from that run's own by 1.2e-7 in the
weights and 6.0e-8 in the losses: the same computation, its sums split into other pieces. By
hand, weights against train_dp.py: 2-D with sequence parallelism (4 ranks) 1.1e-5,
--activation-checkpointing 1.2e-5, --compile 4.6e-6, --document-mask 1.2e-5 (against train_dp.py
with the mask); and a --sequence-parallel checkpoint resumed without the flag, 6.0e-8 from the
weights of its own run.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import (
    DP,
    REPO,
    assert_same_losses,
    assert_state_dicts_close,
    assert_train_dp_starts_from,
    cmd,
    load_weights,
    read_metrics,
    run_script,
)
from test_bad_input import assert_refused
from test_fsdp import (
    FSDP,
    assert_resumes_bit_identically,
    copy_sharded_checkpoint,
)

from lib.checkpoints.finished_run import load_model
from lib.extras.sampling import generate_text
from lib.parallel.tensor_parallel import (
    check_sequence_parallel,
    check_tensor_parallel,
    data_parallel_size,
)
from model import LlamaConfig, LlamaForPretraining

TP = "train_tp.py"


@pytest.fixture(scope="module")
def tp_run(shared_run, corpus, cache_dir) -> Path:
    """--tp 2 on 2 ranks: one tensor-parallel group (dp 1). Tests must not write into it."""
    out, stdout = shared_run(TP, lambda o: cmd(corpus, cache_dir, o) + ["--tp", "2", "--plan"], 2)
    # --plan: tools/memory_plan.py's estimate for this layout, with its tensor-parallel traffic.
    assert "(dp 1 x tp 2 x pp 1)" in stdout and "tensor parallel" in stdout, stdout
    return out


# -------------------------------------------------------------------------------------------------
# The same training as one process


@pytest.mark.one_process
def test_tp2_trains_like_one_process(tp_run, trained):
    reference = trained(DP)
    assert_state_dicts_close(load_weights(tp_run), load_weights(reference))
    # The losses and the pre-clip gradient norm too: a gradient off by a constant factor (say, the
    # targets counted once per tp rank) would not show in the weights.
    assert_same_losses(tp_run, reference)


@pytest.mark.one_process
def test_dp2_tp1_splits_the_batch_over_dp_groups_like_fsdp(trained, corpus, cache_dir, tmp_path):
    # --tp 1 on 2 ranks is train_fsdp.py's layout through this script: 2 dp groups of one rank,
    # each reading half of every global batch, in 2 micro-batches (gradient accumulation).
    out = tmp_path / "out"
    flags = ["--tp", "1", "--micro-batch-size", "2"]
    proc = run_script(TP, cmd(corpus, cache_dir, out) + flags, world=2)
    assert "dp 2 x tp 1" in proc.stdout
    reference = trained(DP)
    assert_state_dicts_close(load_weights(out), load_weights(reference))
    assert_same_losses(out, reference)


@pytest.mark.one_process
def test_sequence_parallel_trains_like_one_process(trained, corpus, cache_dir, tmp_path):
    # Pad mode: rows of padding, whose targets do not count, fall into either rank's piece of the
    # sequence; the loss and the target count must still be those of the whole batch.
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out, data_mode="pad") + ["--tp", "2", "--sequence-parallel"]
    proc = run_script(TP, argv, world=2)
    assert "dp 1 x tp 2 (sequence parallel True)" in proc.stdout
    reference = trained(DP, data_mode="pad")
    assert_state_dicts_close(load_weights(out), load_weights(reference))
    assert_same_losses(out, reference)
    # Clipping acted (the default --grad-clip 1.0): the norms' Partial gradients must be clipped
    # like every other (torch 2.11 left them unscaled: tensor_parallel.replicate_partial_grads).
    assert max(r["grad_norm"] for r in read_metrics(out)[0]) > 1.0


# -------------------------------------------------------------------------------------------------
# Resuming


@pytest.mark.resume
def test_tp_resume_is_bit_identical(tp_run, corpus, cache_dir, tmp_path):
    out = tmp_path / "resumed"
    argv = cmd(corpus, cache_dir, out) + ["--tp", "2"]
    assert_resumes_bit_identically(TP, tp_run, out, argv, 2, tmp_path)


def test_checkpoint_without_sequence_parallel_resumes_with_it(tp_run, corpus, cache_dir, tmp_path):
    # Sequence parallelism moves activations, not parameters: the norms' weights are replicated
    # either way, so the checkpoint's layout is the same (and the other way round too).
    out = tmp_path / "resumed"
    copy_sharded_checkpoint(tp_run, 4, out)
    (out / "metrics.jsonl").write_text((tp_run / "metrics.jsonl").read_text())  # steps 1-4
    argv = cmd(corpus, cache_dir, out) + ["--tp", "2", "--sequence-parallel"]
    proc = run_script(TP, argv, world=2)
    assert "at step 4" in proc.stdout
    assert_state_dicts_close(load_weights(out), load_weights(tp_run))
    assert_same_losses(out, tp_run)


def test_tp_checkpoint_resumes_in_train_fsdp_on_one_rank(tp_run, corpus, cache_dir, tmp_path):
    # The same DCP directories as train_fsdp.py's: DCP reassembles the TP shards into whatever
    # layout the loading run has. Steps 5-8 then run unsplit: the tolerance, not equality.
    out = tmp_path / "resumed"
    copy_sharded_checkpoint(tp_run, 4, out)
    (out / "metrics.jsonl").write_text((tp_run / "metrics.jsonl").read_text())  # steps 1-4
    proc = run_script(FSDP, cmd(corpus, cache_dir, out), world=1)
    assert "at step 4" in proc.stdout
    assert_state_dicts_close(load_weights(out), load_weights(tp_run))
    assert_same_losses(out, tp_run)


# -------------------------------------------------------------------------------------------------
# Outputs


def test_model_pt_loads_in_a_plain_model_and_generate_runs_on_the_out_dir(tp_run):
    weights = load_weights(tp_run)
    assert all(type(tensor) is torch.Tensor for tensor in weights.values()), "not plain tensors"
    config = LlamaConfig(**json.loads((tp_run / "config.json").read_text()))
    LlamaForPretraining(config).load_state_dict(weights, strict=True)
    proc = subprocess.run(
        [sys.executable, "-m", "tools.generate", "--out-dir", str(tp_run), "--prompt", "def ",
         "--max-new-tokens", "8", "--temperature", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    model, tokenizer = load_model(str(tp_run))
    assert proc.stdout == generate_text(model, tokenizer, "def ", 8, temperature=0) + "\n"


# -------------------------------------------------------------------------------------------------
# Bad input


def test_model_pt_starts_a_train_dp_run(corpus, cache_dir, tmp_path, tp_run):
    assert_train_dp_starts_from(tp_run, corpus, cache_dir, tmp_path / "continued")


@pytest.mark.parametrize(
    "world_size, tp, dp", [(2, 2, 1), (4, 2, 2), (8, 4, 2), (2, 1, 2), (1, 1, 1)]
)
def test_dp_is_world_size_over_tp(world_size, tp, dp):
    assert data_parallel_size(world_size, tp) == dp


@pytest.mark.parametrize("world_size, tp", [(2, 3), (3, 2), (6, 4), (1, 2), (2, 0)])
def test_tp_that_does_not_divide_the_ranks_is_refused(world_size, tp):
    with pytest.raises(ValueError, match=f"--tp {tp} must"):
        data_parallel_size(world_size, tp)


@pytest.mark.parametrize(
    "field, tp, overrides",
    [
        ("num_attention_heads", 4, {}),  # tiny: 6 query heads
        ("num_key_value_heads", 3, {}),  # tiny: 6 query heads, but 2 key/value heads
        ("intermediate_size", 2, {"intermediate_size": 513}),
    ],
)
def test_tp_must_split_heads_and_hidden_units_whole(field, tp, overrides):
    config = LlamaConfig.from_preset("tiny", **overrides)
    with pytest.raises(ValueError, match=rf"--tp {tp} does not divide the model's {field} \("):
        check_tensor_parallel(config, tp)
    check_tensor_parallel(config, 1)  # no split: anything goes


@pytest.mark.parametrize(
    "tp, seq_length, expect",
    [
        (2, 33, "--sequence-parallel needs a --seq-length divisible by --tp 2, got 33"),
        (4, 34, "--sequence-parallel needs a --seq-length divisible by --tp 4, got 34"),
        (1, 32, "but tp is 1 (--tp, default: the processes of one node)"),
    ],
)
def test_sequence_parallel_needs_equal_pieces_of_every_sequence(tp, seq_length, expect):
    with pytest.raises(ValueError, match=re.escape(expect)) as refusal:
        check_sequence_parallel(tp, seq_length)
    assert "\n" not in str(refusal.value), "one line"
    check_sequence_parallel(2, 32)
    check_sequence_parallel(4, 256)


def test_tp_divides_the_tiny_model_in_two():
    check_tensor_parallel(LlamaConfig.from_preset("tiny", vocab_size=321), 2)  # odd vocab: fine


@pytest.mark.parametrize(
    "flags, expect",
    [
        (["--tp", "2"], "--tp 2 must divide the number of ranks (1)"),
        (["--tp", "1", "--sequence-parallel"], "pass --tp 2 or more, or drop --sequence-parallel"),
    ],
    ids=["tp-above-world-size", "sequence-parallel-without-tp"],
)
def test_cli_refuses_bad_flags_in_one_line(corpus, cache_dir, tmp_path, flags, expect):
    out = tmp_path / "out"
    assert_refused(TP, cmd(corpus, cache_dir, out) + flags, expect, out, cache_dir)
    assert not out.exists(), "nothing is written before the flags are checked"
