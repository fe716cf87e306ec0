"""Specification of pipeline parallelism (train_pp.py): every schedule trains exactly like one
process on the same global batch, resumes bit for bit, and writes the same model.pt.

Runs are launched as a user would (torchrun, gloo ranks on CPU) with the training tests' settings
(harness.BASE: the tiny preset's 4 layers, batch 8, 8 steps) and compared with train_dp.py on one
process, with test_training.py's tolerances: a pipeline changes where layers run and how the
batch is cut into micro-batches (4 of 2 sequences here), not the arithmetic. Measured on this
corpus (fp32), against train_dp.py: losses within 2.4e-7 (relative), gradient norms 1.9e-6,
validation losses 1.2e-7, weights 3.6e-6 (absolute) for the pipeline layouts below (tensor
parallelism inside the stage is held to the same tolerances); a resumed run is bit-identical to
the uninterrupted one.
By hand, not in CI (4 processes on 2 cores): pp 2 x tp 2 interleaved matches train_dp.py's
weights within 1.9e-6.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from harness import (
    DP,
    assert_same_losses,
    assert_state_dicts_close,
    assert_train_dp_starts_from,
    cmd,
    load_weights,
    run_script,
)
from test_fsdp import (
    assert_resumes_bit_identically,
    sharded_checkpoint_state,
)

from lib import flags
from lib.checkpoints.finished_run import load_model
from lib.extras.sampling import generate_text
from lib.parallel import pipeline
from model import LlamaConfig, LlamaForPretraining

PP = "train_pp.py"
FSDP = "train_fsdp.py"
MICRO = ("--micro-batch-size", "2")  # per pipeline: 8 sequences = 4 micro-batches of 2

# (world size, flags) of each layout, one launch each.
LAYOUTS = {
    "gpipe": (2, ("--pp", "2", "--schedule", "gpipe", *MICRO)),
    # Activation checkpointing rides along: recomputation inside a stage changes nothing either.
    "1f1b-checkpointing": (
        2, ("--pp", "2", "--schedule", "1f1b", "--activation-checkpointing", *MICRO)
    ),
    # 4 stages of one layer on 2 ranks (rank 0: stages 0 and 2), and 2 pipelines: each stage is
    # also sharded with FSDP over the 2 data-parallel ranks (a 2 x 2 mesh; 2 micro-batches each).
    "interleaved-dp2": (4, ("--pp", "2", "--schedule", "interleaved", "--plan", *MICRO)),
    # The third dimension: train_tp.py's tensor parallelism inside the (single) stage, so that
    # with the two layouts above each 2-way split of pp x dp x tp runs through this script.
    "tp2-in-stage": (2, ("--pp", "1", "--tp", "2", "--schedule", "gpipe", *MICRO)),
}  # fmt: skip


@pytest.fixture(scope="module")
def launched(shared_run, corpus, cache_dir):
    """launched(layout) -> (out-dir, stdout) of that LAYOUTS run, made once (shared_run).

    Callers must not write into the returned directory: copy what they need to change.
    """

    def get(layout: str) -> tuple[Path, str]:
        world, flags = LAYOUTS[layout]
        return shared_run(PP, lambda out: cmd(corpus, cache_dir, out) + list(flags), world)

    return get


@pytest.fixture(scope="module")
def pp_run(launched):
    """pp_run(layout) -> the out-dir of that LAYOUTS run (do not write into it)."""
    return lambda layout: launched(layout)[0]


# -------------------------------------------------------------------------------------------------
# The same training as one process


@pytest.mark.one_process
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_trains_like_one_process(pp_run, trained, layout):
    out, reference = pp_run(layout), trained(DP)
    assert_state_dicts_close(load_weights(out), load_weights(reference))
    # Losses (summed over micro-batches and pipelines), the gradient norm (combined over the
    # stages: a norm of one stage's gradients only would be smaller) and the validation loss
    # (forward-only through the pipeline).
    assert_same_losses(out, reference)


def test_start_up_reports_the_schedule_and_its_bubble(launched):
    stdout = launched("interleaved-dp2")[1]
    assert "interleaved schedule, 4 stages on 2 ranks (2 per rank)" in stdout, stdout
    assert "m = 2 micro-batches of 2 sequences per pipeline, 2 data-parallel pipelines" in stdout
    # p = 2 ranks, v = 2 stages per rank, m = 2: (p-1)/(v*m+p-1) = 1/5.
    assert "bubble (p-1)/(v*m+p-1) = 20.0%" in stdout, stdout
    # --plan: tools/memory_plan.py's estimate for this very layout, the same bubble included.
    assert "memory per GPU" in stdout and "(dp 2 x tp 1 x pp 2, interleaved schedule" in stdout
    assert "2 micro-batches: bubble 20% of a step" in stdout, stdout


# -------------------------------------------------------------------------------------------------
# Stages


def test_uneven_layers_go_to_the_first_stages():
    assert pipeline.split_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]


def test_stages_together_hold_exactly_the_full_model():
    config = LlamaConfig.from_preset("tiny", vocab_size=64)
    model = LlamaForPretraining(config)
    full = model.state_dict()
    pieces = {}
    for pp_rank in range(2):  # interleaved: 4 stages, rank r holds stages r and r + 2
        stages = pipeline.stages_of_rank(model, pp_rank, 2, 2)
        local = pipeline.RankModel(stages).state_dict()
        assert pieces.keys().isdisjoint(local.keys()), "a parameter on two ranks"
        pieces.update(local)
        assert sum(len(s.state_dict()) for s in stages) == len(local)
    assert pieces.keys() == full.keys()
    shared = all(pieces[name].data_ptr() == full[name].data_ptr() for name in full)
    assert shared, "the stages hold copies instead of the model's own tensors"
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():  # the four stages in order compute the whole model's logits
        h = x
        for s in range(4):
            h = pipeline.stages_of_rank(model, s % 2, 2, 2)[s // 2](h)
        torch.testing.assert_close(h, model(x), rtol=0, atol=0)


# -------------------------------------------------------------------------------------------------
# Checkpoints and outputs


@pytest.mark.resume
def test_resume_is_bit_identical(pp_run, corpus, cache_dir, tmp_path):
    full, out = pp_run("1f1b-checkpointing"), tmp_path / "resumed"
    world, flags = LAYOUTS["1f1b-checkpointing"]
    argv = cmd(corpus, cache_dir, out) + list(flags)
    assert_resumes_bit_identically(PP, full, out, argv, world, tmp_path)


def test_checkpoint_holds_the_whole_model_under_its_own_names(pp_run, tmp_path):
    # Each pipeline rank wrote only its own stages; together they are the whole model, with
    # AdamW's state of every parameter.
    out = pp_run("gpipe")
    tensors = sharded_checkpoint_state(out, 8, tmp_path)
    names = set(load_weights(out))
    assert {k.removeprefix("/model/") for k in tensors if k.startswith("/model/")} == names
    for name in names:
        assert f"/optimizer/state.{name}.exp_avg" in tensors, name


def test_pipeline_checkpoint_resumes_in_train_fsdp(pp_run, trained, corpus, cache_dir, tmp_path):
    # The same DCP layout as train_fsdp.py: written by 2 pipeline stages, read by one process.
    out = tmp_path / "resumed"
    full = pp_run("gpipe")
    shutil.copytree(full / "checkpoints" / "step_0000004", out / "checkpoints" / "step_0000004")
    proc = run_script(FSDP, cmd(corpus, cache_dir, out))
    assert "at step 4" in proc.stdout
    assert_state_dicts_close(load_weights(out), load_weights(trained(DP)))


def test_model_pt_is_a_plain_state_dict_that_generate_loads(pp_run, trained):
    out = pp_run("interleaved-dp2")
    weights = load_weights(out)
    reference = load_weights(trained(DP))
    assert weights.keys() == reference.keys()
    for name, tensor in weights.items():
        assert type(tensor) is torch.Tensor, f"{name} is a {type(tensor)}"
        assert (tensor.shape, tensor.dtype) == (reference[name].shape, reference[name].dtype)
    config = LlamaConfig(**json.loads((out / "config.json").read_text()))
    LlamaForPretraining(config).load_state_dict(weights, strict=True)
    model, tokenizer = load_model(str(out), "cpu", torch.float32)
    assert generate_text(model, tokenizer, "def ", 8, seed=0).startswith("def ")


def test_model_pt_starts_a_train_dp_run(corpus, cache_dir, tmp_path, pp_run):
    assert_train_dp_starts_from(
        pp_run("interleaved-dp2"), corpus, cache_dir, tmp_path / "continued"
    )


# -------------------------------------------------------------------------------------------------
# Bad input


def pipeline_args(corpus, cache_dir, *extra):
    parser = flags.build_parser("test", sharded=True)
    pipeline.add_flags(parser)  # train_pp.py's parser
    return parser, parser.parse_args(cmd(corpus, cache_dir, "unused") + list(extra))


@pytest.mark.parametrize(
    "world, flags, message",
    [
        (2, ("--pp", "3"), "--pp 3 x --tp 1 does not divide the number of processes (2)"),
        (4, ("--pp", "2", "--schedule", "interleaved", "--stages-per-rank", "3"),
         "the model has 4 layers, fewer than the 6 pipeline stages"),
        (2, ("--pp", "2", "--model", "1b"), "ties lm_head to the token embeddings"),
        (2, ("--pp", "2", "--micro-batch-size", "8"), "1f1b needs at least as many micro-batches"),
    ],
    ids=["pp-does-not-divide-world", "more-stages-than-layers", "tied-embeddings",
         "too-few-micro-batches"],
)  # fmt: skip
def test_bad_pipeline_flags_are_refused(corpus, cache_dir, world, flags, message):
    parser, args = pipeline_args(corpus, cache_dir, *flags)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        args.check = True  # the flags alone: no process group, no mesh
        layout = pipeline.setup(parser, args, world, torch.device("cpu"))
        pipeline.run_settings(parser, args, layout, torch.device("cpu"))


def auto_settings(corpus, cache_dir, batch_size: int) -> flags.RunSettings:
    """pipeline.run_settings of --pp 2 (1f1b), --micro-batch-size auto on 2 ranks."""
    argv = ["--pp", "2", "--batch-size", str(batch_size), "--micro-batch-size", "auto"]
    parser, args = pipeline_args(corpus, cache_dir, *argv)
    args.check = True  # the flags alone: no process group, no mesh
    layout = pipeline.setup(parser, args, 2, torch.device("cpu"))
    return pipeline.run_settings(parser, args, layout, torch.device("cpu"))


def test_auto_is_refused_when_not_even_one_sequence_per_micro_batch_fills_1f1b(
    corpus, cache_dir, monkeypatch
):
    # --micro-batch-size auto tries down to 1 sequence per micro-batch, the most micro-batches:
    # a pipeline's batch of 1 sequence is 1 micro-batch, fewer than 1f1b's 2 stages; 2 will do.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    message = "1f1b needs at least as many micro-batches as stages: 1 < 2; raise --batch-size"
    with pytest.raises(ValueError, match=message):
        auto_settings(corpus, cache_dir, batch_size=1)
    assert auto_settings(corpus, cache_dir, batch_size=2).micro_batch_size is None  # measured later


def test_refusal_is_one_message_before_anything_is_written(corpus, cache_dir, tmp_path):
    out = tmp_path / "out"
    proc = run_script(PP, cmd(corpus, cache_dir, out) + ["--pp", "2"], expect_rc=2)
    assert proc.stderr.count("error: ") == 1 and "does not divide" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()
