"""Specification of a mixture of experts in the lessons (--num-experts, model.MoEFeedForward):
train_dp.py, train_ddp.py, train_zero1.py and train_fsdp.py train one as one process does
(within test_training.py's bounds), log its routing over the whole global batch, and resume it
bit for bit; train_tp.py, train_pp.py and train_cp.py refuse it at flag-check time, and a
resume refuses to turn a dense model into a mixture of experts or back.

The runs use the training tests' settings, corpus and helpers (harness.py, conftest.py), in pad
mode: the ranks' halves of a batch then hold different numbers of targets, so the balance loss
of the global batch is only right if each rank's sums and counts are added (not its means
averaged), and a wrong weighting of the aux loss in the gradient shows. Measured on this corpus
(fp32, under this CPU's kernels and ATEN_CPU_CAPABILITY avx2 and default alike): DDP, ZeRO-1
and FSDP weights within 4.8e-6 of one process (the dense runs' margin: ATOL is 2e-5), logged
aux losses within 6e-8 relative, the same tokens per expert at every step. The model's own
properties (dropless routing, any batch split gives the same loss) are test_moe.py's.
"""

import argparse
import json
import re
import shutil
from dataclasses import dataclass
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
    build_args,
    cmd,
    copy_checkpoint,
    flatten,
    load_checkpoint,
    load_weights,
    read_metrics,
    run_script,
)
from test_bad_input import assert_refused

import data
from lib import metrics, model_config, training
from lib.checkpoints import finished_run, resuming
from lib.extras import memory
from lib.extras.moe import router_stats
from lib.parallel.layout import Layout
from model import (
    LlamaConfig,
    LlamaForPretraining,
    count_active_parameters,
    count_parameters,
)

FSDP = "train_fsdp.py"
E, K = 4, 2
# Seed 1, not harness.BASE's 1234: with the weights each parameter draws from its own seed
# (model.initial_weight), 1234 makes step 6 of this MoE ill-conditioned: one process against itself,
# with micro-batches of 2 instead of 8 (the same sums in another order), differs there by 7.6e-6,
# near LOSS_RTOL (1e-5), and DDP, FSDP and EP with accumulation by 2e-5. With seed 1 (and 2) one
# process against itself differs by 1.6e-6 at most, and every layout by 1.3e-6: the comparison
# then measures the layout, not the trajectory's sensitivity (measured on this CPU, 2026-11-28).
MOE = {"num_experts": E, "experts_per_token": K, "data_mode": "pad", "seed": 1}
TOKENS_PER_STEP = 8 * 32  # harness.BASE: --batch-size 8 x --seq-length 32, padding included
ZERO3 = ("--zero-stage", "3")
ACCUMULATE = ("--micro-batch-size", "2")


@dataclass
class Run:
    out: Path
    stdout: str


@pytest.fixture(scope="module")
def launched(shared_run, corpus, cache_dir):
    """launched(script, world, *flags) -> the Run of that script with MOE and flags, made once
    (shared_run). Callers must not write into its out-dir: copy what they need to change."""

    def get(script: str, world: int, *flags: str) -> Run:
        def argv(out: Path) -> list[str]:
            return cmd(corpus, cache_dir, out, **MOE) + list(flags)

        return Run(*shared_run(script, argv, world))

    return get


LAYOUTS = [(DDP, 2, ()), (ZERO1, 2, ()), (FSDP, 2, ZERO3), (FSDP, 2, ZERO3 + ACCUMULATE),
           (DP, 1, ACCUMULATE)]  # fmt: skip
LAYOUT_IDS = ["ddp", "zero1", "fsdp-zero3", "fsdp-zero3-accum", "dp-accum"]


# -------------------------------------------------------------------------------------------------
# Every data-parallel layout trains the MoE like one process


@pytest.mark.one_process
@pytest.mark.parametrize("script, world, flags", LAYOUTS, ids=LAYOUT_IDS)
def test_strategy_trains_a_mixture_of_experts_like_one_process(launched, script, world, flags):
    run, reference = launched(script, world, *flags), launched(DP, 1)
    assert_state_dicts_close(load_weights(run.out), load_weights(reference.out))
    assert_same_losses(run.out, reference.out)
    # The stacked experts are in model.pt as one model's: every script writes the same names.
    assert load_weights(run.out)["layers.0.feed_forward.w1"].shape == (E, 512, 192)


@pytest.mark.one_process
@pytest.mark.parametrize("script, world, flags", LAYOUTS, ids=LAYOUT_IDS)
def test_the_logged_routing_is_the_global_batchs(launched, script, world, flags):
    train, want = read_metrics(launched(script, world, *flags).out)[0], read_metrics(
        launched(DP, 1).out)[0]  # fmt: skip
    assert [r["step"] for r in train] == list(range(1, 9))
    got_aux, want_aux = [r["aux_loss"] for r in train], [r["aux_loss"] for r in want]
    assert all(aux > 0 for aux in got_aux)
    # Summed over the ranks' sums and target counts: the one process's value, however split.
    assert got_aux == pytest.approx(want_aux, rel=1e-4)
    for r in train:
        counts = r["tokens_per_expert"]
        assert len(counts) == 4 and all(len(layer) == E for layer in counts)  # tiny: 4 layers
        # Every token of the step (log interval 1), padding included, to K experts, per layer.
        assert [sum(layer) for layer in counts] == [TOKENS_PER_STEP * K] * 4


def test_train_dp_says_how_many_experts_and_active_parameters(launched):
    config = finished_run.load_config(launched(DP, 1).out)
    assert (config.num_local_experts, config.num_experts_per_tok) == (E, K)
    line = next(s for s in launched(DP, 1).stdout.splitlines() if s.startswith("model: "))
    total, active = count_parameters(config) / 1e6, count_active_parameters(config) / 1e6
    assert line == (
        f"model: tiny with --num-experts {E} --experts-per-token {K}, {total:.2f}M parameters "
        f"({active:.2f}M active per token), vocab {config.vocab_size}, experts {E}, {K} per token"
    )
    assert active < total


def test_mfu_counts_the_active_parameters():
    config = LlamaConfig.from_preset("tiny", num_local_experts=8, num_experts_per_tok=2)
    n = count_active_parameters(config) - config.vocab_size * config.hidden_size  # no embedding
    attention = 12 * config.num_hidden_layers * config.hidden_size * 256
    assert metrics.flops_per_token(config, 256) == 6 * n + attention
    dense = LlamaConfig.from_preset("tiny")
    assert count_active_parameters(dense) == count_parameters(dense)


def test_router_figures_read_and_reset_router_stats_in_one_process():
    # No process group: nothing to sum, router_stats' own figures; a dense model has none.
    assert metrics.router_figures(LlamaForPretraining(LlamaConfig.from_preset("tiny"))) == {}
    torch.manual_seed(0)
    config = LlamaConfig.from_preset("tiny", vocab_size=300, num_local_experts=E)
    model = LlamaForPretraining(config)
    x = torch.randint(300, (2, 16))
    model(x, x)
    figures = metrics.router_figures(model)
    assert set(figures) == {"aux_loss", "tokens_per_expert"} and figures["aux_loss"] > 0
    assert [sum(layer) for layer in figures["tokens_per_expert"]] == [2 * 16 * K] * 4
    assert router_stats(model)["tokens_per_expert"] == [[0] * E] * 4  # read, and reset


# -------------------------------------------------------------------------------------------------
# Resuming


def test_a_moe_ddp_resume_is_bit_identical(launched, corpus, cache_dir, tmp_path):
    # Pad mode: 3 steps per epoch, so the resume from step 4 starts mid-epoch.
    full, out = launched(DDP, 2).out, tmp_path / "resumed"
    copy_checkpoint(full, 4, out)
    proc = run_script(DDP, cmd(corpus, cache_dir, out, **MOE), world=2)
    assert "at step 4" in proc.stdout
    assert_state_dicts_equal(load_weights(out), load_weights(full))
    got = flatten(load_checkpoint(out, 8)["optimizer"])
    want = flatten(load_checkpoint(full, 8)["optimizer"])
    assert got.keys() == want.keys()
    for key, value in want.items():
        same = torch.equal(got[key], value) if torch.is_tensor(value) else got[key] == value
        assert same, f"optimizer{key} differs after resuming"
    # The routing counts start afresh with the resumed process: its steps 5-8 log exactly
    # what the uninterrupted run logged.
    fields = ("step", "loss", "aux_loss", "tokens_per_expert")
    resumed = [tuple(r[f] for f in fields) for r in read_metrics(out)[0]]
    uninterrupted = [tuple(r[f] for f in fields) for r in read_metrics(full)[0] if r["step"] > 4]
    assert resumed == uninterrupted


def test_a_dense_checkpoint_resumed_as_a_mixture_of_experts_is_refused(
    trained, corpus, cache_dir, tmp_path
):
    out = tmp_path / "resumed"
    shutil.copytree(trained(DP), out)  # the dense tiny model's run
    argv = cmd(corpus, cache_dir, out, num_experts=E)
    proc = assert_refused(DP, argv, "the checkpoint holds a model with config num_local_experts "
                          f"0 (now {E}); resume with", out, cache_dir)  # fmt: skip
    assert "(--num-experts, ...)" in proc.stderr


def test_a_moe_checkpoint_resumed_dense_is_refused_naming_the_field(launched, corpus, cache_dir):
    # In-process, as a lesson resumes: the dense model build_model makes against the MoE one's.
    run = launched(DP, 1).out
    ckpt = load_checkpoint(run, 4)
    tokenizer = data.load_tokenizer(str(run / "tokenizer.json"))
    args, plan = build_args(corpus, cache_dir, data_mode="pad", seed=MOE["seed"])
    _, config = training.build_model(args, plan.model, tokenizer.get_vocab_size())
    with pytest.raises(ValueError, match=re.escape(f"config num_local_experts {E} (now 0); ")):
        resuming.check_resumable(ckpt, config, args, tokenizer)
    # Another number of experts per token, or another coefficient, is another model too.
    args, plan = build_args(corpus, cache_dir, **{**MOE, "experts_per_token": 1})
    _, config = training.build_model(args, plan.model, tokenizer.get_vocab_size())
    with pytest.raises(ValueError, match=re.escape(f"num_experts_per_tok {K} (now 1); ")):
        resuming.check_resumable(ckpt, config, args, tokenizer)
    args, plan = build_args(corpus, cache_dir, **MOE)  # the same flags: resumable
    _, config = training.build_model(args, plan.model, tokenizer.get_vocab_size())
    resuming.check_resumable(ckpt, config, args, tokenizer)


# -------------------------------------------------------------------------------------------------
# Flags


@pytest.mark.parametrize("check", [True, False], ids=["check", "run"])
def test_more_experts_per_token_than_experts_is_refused_before_any_work(
    corpus, cache_dir, tmp_path, check
):
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out, num_experts=2, experts_per_token=3)
    assert_refused(DP, argv + (["--check"] if check else []),
                   "error: --experts-per-token 3 is more than --num-experts 2", out,
                   cache_dir)  # fmt: skip
    assert not out.exists()


@pytest.mark.parametrize(
    "script, why",
    [("train_tp.py", "its plan splits the dense MLP's Linear layers"),
     ("train_pp.py", "its stages do not compute the experts' load-balancing loss"),
     ("train_cp.py", "it splits every sequence over ranks, and a sequence's load-balancing "
                     "loss needs the whole sequence")],
)  # fmt: skip
def test_lessons_that_cannot_train_experts_refuse_them_at_flag_check_time(
    corpus, cache_dir, tmp_path, script, why
):
    out = tmp_path / "out"
    proc = assert_refused(script, cmd(corpus, cache_dir, out, num_experts=2),
                          f"error: {script} cannot train a mixture of experts (--num-experts 2): "
                          f"{why}", out, cache_dir)  # fmt: skip
    assert "expert parallelism" in proc.stderr and "train_fsdp.py" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, message",
    [(dict(num_experts=1), "--experts-per-token 2 (the default) is more than --num-experts 1"),
     (dict(experts_per_token=1), "--experts-per-token shape a mixture of experts, and with no "
                                 "--num-experts (dense) there is none"),
     (dict(num_experts=0, router_aux_loss_coef=0.1), "--router-aux-loss-coef shape a mixture of "
                                                     "experts, and with --num-experts 0")],
)  # fmt: skip
def test_expert_flags_that_do_not_fit_are_refused_naming_them(corpus, cache_dir, flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_args(corpus, cache_dir, **flags)


def test_the_expert_flags_set_the_config_and_zero_experts_is_the_dense_model(corpus, cache_dir):
    args, _ = build_args(corpus, cache_dir, num_experts=8, experts_per_token=1,
                         router_aux_loss_coef=0.0)  # fmt: skip
    config = model_config.model_shape(args)
    assert (config.num_local_experts, config.num_experts_per_tok) == (8, 1)
    assert config.router_aux_loss_coef == 0.0
    args, _ = build_args(corpus, cache_dir, num_experts=0)
    shape = model_config.model_shape
    assert shape(args) == shape(build_args(corpus, cache_dir)[0])


@pytest.mark.parametrize("flag", ["num_experts", "experts_per_token"])
def test_init_from_with_an_expert_flag_is_refused(corpus, cache_dir, tmp_path, flag):
    settings = {"model": None, "vocab_size": None, "init_from": tmp_path, flag: 2}
    with pytest.raises(ValueError, match=f"leave out --{flag.replace('_', '-')} \\(see --help\\)"):
        build_args(corpus, cache_dir, **settings)


@pytest.mark.parametrize("experts", [E, 0])
def test_init_from_takes_a_new_load_balancing_weight_for_its_experts_only(tmp_path, experts):
    # The coefficient weighs a training loss, not the architecture: a run started from a finished
    # mixture of experts may weigh it anew. A dense model has no router to balance: refused.
    config = LlamaConfig.from_preset("tiny", num_local_experts=experts)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    (tmp_path / "model.pt").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    args = argparse.Namespace(init_from=str(tmp_path), router_aux_loss_coef=0.25)
    if experts:
        assert model_config.model_shape(args).router_aux_loss_coef == 0.25
    else:
        with pytest.raises(ValueError, match="is a dense model"):
            model_config.model_shape(args)


def test_the_memory_plan_counts_the_experts_rather_than_plan_them_as_a_dense_model(
    corpus, cache_dir
):
    # tools/memory_plan.py plans a mixture of experts (tests/test_memory_plan.py), and so does the
    # lessons' --plan: train_ep.py's layout, each GPU of an ep group with its share of the experts.
    config = LlamaConfig.from_preset("tiny", num_local_experts=E)
    p = memory.plan(config, Layout(world_size=8, dp=8), memory.Workload())
    assert p["active_params"] == count_active_parameters(config) < p["num_params"]
    args, run = build_args(corpus, cache_dir, num_experts=E, plan=True)  # not refused
    estimate = memory.estimate_for_run(args, run, config, Layout(world_size=2, dp=2, ep=2))
    assert "1 EP group x ep 2: each GPU holds 1/2 of the experts" in estimate
    assert "mixture of experts:" in estimate and "all-to-alls send" in estimate
