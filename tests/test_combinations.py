"""Specification of the lessons' combined features: each lesson keeps every feature of the lesson
it extends (TP, PP, CP and EP keep FSDP's ZeRO stages, CPU offload and HSDP; PP keeps sequence
parallelism), and each combination trains like one process on the same global batch, held to
test_training.py's tolerances (harness.ATOL, RTOL, LOSS_RTOL, GRAD_NORM_RTOL): the layouts
change which rank adds which partial sum, not the arithmetic.

Four CPU ranks each (gloo), so that every dimension of the grid is more than one rank wide where
the combination needs it: TP with HSDP is tp 2 x 2 replicas (the 70b layout: TP inside a node,
HSDP across nodes); TP with ZeRO-2 is tp 2 x a shard group of 2; PP with sequence parallelism is
pp 2 x tp 2; CP with HSDP is cp 2 x 2 replicas of shard groups of 2 (FSDP spans the cp ranks).
EP with HSDP is in test_ep.py's layouts (its reference is a mixture of experts). Measured here
(fp32, against train_dp.py): weights within 8.7e-6, logged losses within 9.6e-7.
"""

import re

import pytest
from harness import (
    DP,
    REPO,
    assert_same_losses,
    assert_state_dicts_close,
    cmd,
    load_weights,
    read_metrics,
    run_script,
)

COMBINATIONS = {
    "tp-hsdp": ("train_tp.py", ["--tp", "2", "--replicate", "2"], "HSDP 2 x 1", {}),
    "tp-zero2-offload": (
        "train_tp.py",
        ["--tp", "2", "--zero-stage", "2", "--cpu-offload"],
        "FSDP ZeRO-2 over 2 ranks, cpu offload True",
        {},
    ),
    "pp-tp-sequence-parallel": (
        "train_pp.py",
        ["--pp", "2", "--tp", "2", "--sequence-parallel"],
        "dp 1 x tp 2 (sequence parallel True)",
        {"data_mode": "pad"},
    ),
    "cp-hsdp": ("train_cp.py", ["--cp", "2", "--replicate", "2"], "HSDP 2 x 2", {}),
}


@pytest.mark.one_process
@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_a_combination_on_4_ranks_trains_like_one_process(
    name, trained, corpus, cache_dir, tmp_path
):
    script, flags, described, overrides = COMBINATIONS[name]
    out = tmp_path / "out"
    proc = run_script(script, cmd(corpus, cache_dir, out, **overrides) + flags, world=4)
    assert described in proc.stdout, proc.stdout  # the layout asked for is the layout trained
    reference = trained(DP, **overrides)
    assert_state_dicts_close(load_weights(out), load_weights(reference))
    # The losses and the pre-clip gradient norm too: a gradient off by a constant factor (say,
    # divided by the replicas twice) would not show in the weights.
    assert_same_losses(out, reference)


# fp16 trains under every sharding lesson (for DTensor gradients torch's grad scaler reduces its
# inf/NaN check over their mesh, so every rank agrees to skip a step; a pipeline's stages agree
# through pipeline.unscale_, tests/scaler_agrees.py); against
# train_dp.py in fp16, with fp16's bounds: activations are rounded to 11 bits (unit roundoff
# 4.9e-4), so the ranks' partial sums round apart, and AdamW turns such a difference in a near-zero
# gradient into a step of --lr (1e-3). Measured (FSDP, TP and CP on 2 ranks against train_dp.py, 8
# steps): weights within 1.04e-3, logged losses within 1.1e-4 relative and gradient norms 1.4e-3,
# as train_ddp.py's fp16 run; the bounds below are about twice the unit roundoff for the losses,
# ten times for the norms (a sum over every gradient). A scaler that left the gradients scaled
# would be off by 2^16, one whose ranks disagreed by whole steps.
FP16 = {
    "fsdp": ("train_fsdp.py", []),
    "tp": ("train_tp.py", ["--tp", "2"]),
    "cp": ("train_cp.py", ["--cp", "2"]),
    "pp": ("train_pp.py", ["--pp", "2"]),
}


@pytest.mark.one_process
@pytest.mark.parametrize("name", list(FP16))
def test_fp16_trains_like_one_process_in_fp16(name, trained, corpus, cache_dir, tmp_path):
    script, flags = FP16[name]
    out = tmp_path / "out"
    run_script(script, cmd(corpus, cache_dir, out, precision="fp16") + flags, world=2)
    reference = trained(DP, precision="fp16")
    assert_state_dicts_close(load_weights(out), load_weights(reference), atol=5e-3, rtol=5e-3)
    (train, evals), (want, want_evals) = read_metrics(out), read_metrics(reference)
    # The grad scaler unscaled the gradients before they were measured (a norm 2^16 times too
    # large would show here, not in the clipped, AdamW-normalised weights).
    checks = [("loss", train, want, 1e-3), ("grad_norm", train, want, 5e-3)]
    for key, got, expected, rtol in [*checks, ("val_loss", evals, want_evals, 1e-3)]:
        assert [r[key] for r in got] == pytest.approx([r[key] for r in expected], rel=rtol), key


@pytest.mark.parametrize("layout", ["fsdp", "tp", "pp"])
def test_the_grad_scaler_skips_a_step_on_every_rank_when_one_shard_holds_an_inf(layout):
    # What fp16 under sharding rests on: an overflow in one rank's shard of a gradient makes every
    # rank skip the step and halve its scale (else the ranks' weights would part ways, silently;
    # and a pipeline's stages must keep one scale, which the last stage's loss carries to all).
    proc = run_script("tests/scaler_agrees.py", [layout], world=2, env={"PYTHONPATH": str(REPO)})
    assert sorted(re.findall(r"rank \d: skipped \w+, scale [\d.]+", proc.stdout)) == [
        "rank 0: skipped True, scale 32768.0",
        "rank 1: skipped True, scale 32768.0",
    ], proc.stdout


def test_a_pipeline_stage_alone_would_step_past_another_stages_inf():
    # Why train_pp.py calls pipeline.unscale_: torch's scaler checks only this rank's gradients,
    # and a pipeline's stages share no mesh, so the stage without the inf steps and keeps its scale.
    env = {"PYTHONPATH": str(REPO)}
    proc = run_script("tests/scaler_agrees.py", ["pp-alone"], world=2, env=env)
    assert sorted(re.findall(r"rank \d: skipped \w+, scale [\d.]+", proc.stdout)) == [
        "rank 0: skipped False, scale 65536.0",
        "rank 1: skipped True, scale 32768.0",
    ], proc.stdout


def test_init_from_moves_only_each_ranks_own_slices_of_model_pt(tmp_path):
    # tests/init_from_slices.py: train_tp.py's 2-D layout on 4 ranks (FSDP's shards of TP's
    # shards). Before: every rank moved every whole tensor to its device, then sliced it.
    env = {"PYTHONPATH": str(REPO)}
    proc = run_script("tests/init_from_slices.py", [str(tmp_path)], world=4, env=env)
    lines = re.findall(
        r"rank \d: moved (\d+), holds (\d+), whole (\d+), same (True|False)", proc.stdout
    )
    assert len(lines) == 4, proc.stdout
    for moved, holds, whole, same in lines:
        assert same == "True" and moved == holds and int(holds) < int(whole) / 2, lines
