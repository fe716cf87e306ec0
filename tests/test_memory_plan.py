"""Specification of tools/memory_plan.py: its formulas against numbers worked out by hand.

The model-state formulas must reproduce the ZeRO paper's own figures; the activation formula is
Korthikanti et al.'s, checked on a small shape where every term can be computed on paper.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lib import exits
from lib.extras import memory
from lib.extras import memory_formulas as formulas
from lib.extras.memory import Workload
from lib.parallel import pipeline
from lib.parallel.layout import Layout
from model import LlamaConfig, LlamaForPretraining, count_parameters
from tools import memory_plan

REPO = Path(__file__).resolve().parents[1]

# A shape small enough to work out by hand: s*b*h = 128 * 2 * 64 = 16384 activations per layer
# of hidden states.
SHAPE = LlamaConfig(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
)
B, S = 2, 128


def grid(world_size: int, **sizes) -> Layout:
    """A Layout of world_size GPUs: tp x pp x cp model-parallel ranks, the rest data parallel."""
    model_parallel = sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("cp", 1)
    return Layout(world_size=world_size, dp=world_size // model_parallel, **sizes)


def work(precision: str = "bf16", **settings) -> Workload:
    """A workload of micro-batches of B sequences of S tokens in `precision`."""
    return Workload(micro_batch_size=B, seq_length=S, precision=precision, **settings)


@pytest.mark.parametrize(
    "strategy, published_gb",
    [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)],
)
def test_paper_precision_reproduces_the_zero_papers_figure_1(strategy, published_gb):
    # Rajbhandari et al. 2019, Figure 1: Psi = 7.5B parameters, N_d = 64 GPUs, K = 12.
    p = memory.plan(int(7.5e9), grid(64), Workload(precision="paper"))
    assert round(p["strategies"][strategy]["model_states_gb"], 1) == published_gb


def test_model_states_follow_the_zero_stages_in_fp32():
    # fp32: 4 bytes of weights, 4 of gradients, 8 of AdamW moments per parameter; 4 ranks.
    n, world = 1_000_000, 4
    s = memory.plan(n, grid(world), Workload(precision="fp32"))["strategies"]
    gb = 1e9
    assert s["ddp"]["model_states_gb"] == pytest.approx(16 * n / gb)
    assert s["zero1"]["optimizer_gb"] == pytest.approx(8 * n / world / gb)
    assert s["zero1"]["model_states_gb"] == pytest.approx((4 + 4 + 2) * n / gb)
    assert s["zero2"]["model_states_gb"] == pytest.approx((4 + 1 + 2) * n / gb)
    assert s["zero3"]["model_states_gb"] == pytest.approx(4 * n / gb)
    assert s["zero3"]["params_gb"] == pytest.approx(n / gb)
    # With no model shape there is nothing to estimate activations from.
    assert s["ddp"]["activations_gb"] is None and s["ddp"]["total_gb"] is None


def test_bf16_autocast_keeps_fp32_model_states_and_halves_activations():
    fp32 = memory.plan(SHAPE, grid(2), work("fp32"), num_params=10**6)["strategies"]["zero2"]
    bf16 = memory.plan(SHAPE, grid(2), work("bf16"), num_params=10**6)["strategies"]["zero2"]
    assert bf16["model_states_gb"] == fp32["model_states_gb"]
    # The layers halve; cross-entropy's fp32 log-probabilities (4 * s * b * V) do not.
    logprobs = 4 * S * B * 1000 / 1e9
    assert bf16["activations_gb"] - logprobs == pytest.approx(
        (fp32["activations_gb"] - logprobs) / 2
    )


def test_activations_match_korthikanti_by_hand():
    # Per layer, 16-bit: s*b*h*34 = 16384 * 34 = 557,056 bytes with fused attention; math
    # attention adds s*b*h * 5*a*s/h = 16384 * 40 = 655,360 bytes of (s, s) scores. Cross-entropy
    # keeps 4*s*b*V = 1,024,000 bytes.
    f = formulas.activation_bytes
    assert f(SHAPE, Layout(), work("bf16")) == 3 * 557_056 + 1_024_000
    assert f(SHAPE, Layout(), work("bf16", attention="math")) == 3 * (557_056 + 655_360) + 1_024_000
    assert f(SHAPE, Layout(), work("fp32")) == 3 * 2 * 557_056 + 1_024_000
    # Checkpointing: 3 layer inputs of s*b*h*2 bytes, one layer recomputed, the log-probs.
    checkpointed = f(SHAPE, Layout(), work("bf16"), checkpointing=True)
    assert checkpointed == 3 * 32_768 + 557_056 + 1_024_000


def test_totals_and_fits_add_model_states_and_activations():
    p = memory.plan(SHAPE, grid(2), work(gpu_memory_gb=0.005))
    for row in p["strategies"].values():
        assert row["total_gb"] == pytest.approx(row["model_states_gb"] + row["activations_gb"])
        assert row["total_checkpointed_gb"] < row["total_gb"]
    # 5 MB: totals are ddp 6.7, zero1 5.7, zero2 5.2, zero3 4.7 MB: only ZeRO-3 fits.
    fits = {name for name, row in p["strategies"].items() if row["fits"]}
    assert fits == {"zero3"}, p


def test_cli_json_output_has_the_documented_fields():
    argv = ["--model", "7b", "--world-size", "8", "--json"]
    command = [sys.executable, "-m", "tools.memory_plan", *argv]
    proc = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO)
    strategies = json.loads(proc.stdout)["strategies"]
    assert set(strategies) == {"ddp", "zero1", "zero2", "zero3"}
    for row in strategies.values():
        assert {"params_gb", "grads_gb", "optimizer_gb", "model_states_gb"} <= row.keys()
    # Llama 2 7B (6.74B parameters) in bf16 with fp32 states: 16 bytes each under DDP.
    assert strategies["ddp"]["model_states_gb"] == pytest.approx(16 * 6_738_415_616 / 1e9)


def test_cli_plans_the_shape_the_training_flags_give(monkeypatch, capsys):
    # The train scripts' own shape flags (model_config.add_shape_flags), in-process.
    argv = ["--model", "1b", "--num-layers", "8", "--ffn-size", "4096", "--vocab-size", "4096"]
    monkeypatch.setattr(sys, "argv", ["tools/memory_plan.py", *argv, "--json"])
    memory_plan.main()
    shape = dict(num_hidden_layers=8, intermediate_size=4096, vocab_size=4096)
    expected = count_parameters(LlamaConfig.from_preset("1b", **shape))
    assert json.loads(capsys.readouterr().out)["num_params"] == expected
    monkeypatch.setattr(sys, "argv", ["tools/memory_plan.py", "--num-heads", "7"])
    with pytest.raises(SystemExit) as exit:  # exit code 2, after one line naming the flags
        exits.run(memory_plan.main)  # as `python -m tools.memory_plan` runs it
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1, err
    assert "--hidden-size 4096 (the 7b preset's) is not divisible by --num-heads 7" in err


def test_cli_table_says_what_fits(monkeypatch, capsys):
    argv = ["--model", "7b", "--world-size", "8", "--gpu-memory", "40"]
    code, out, _ = run_main(monkeypatch, capsys, *argv)
    assert code == 0 and "fits in 40 GB: zero3" in out, out


# -------------------------------------------------------------------------------------------------
# Tensor and pipeline parallelism


def test_stage_parameters_split_matrices_by_tp_and_layers_by_pp():
    # SHAPE by hand: per layer 40,960 matrix weights + 128 norm gains; embedding and lm_head
    # 64,000 each; final norm 64. count_parameters = 3 * 41,088 + 128,064 = 251,328.
    assert formulas.stage_parameters(SHAPE, tp=1, pp=1) == (251_328, 251_328)
    # tp 2: matrices and tables halve, the norm gains stay whole.
    assert formulas.stage_parameters(SHAPE, tp=2, pp=1) == (125_888, 125_888)
    # pp 3: one layer per stage; the embedding on the first, final norm + lm_head on the last.
    assert formulas.stage_parameters(SHAPE, tp=1, pp=3) == (105_088, 105_152)


def test_tensor_parallel_splits_matmul_activations_but_not_norms():
    # Korthikanti: s*b*h * (10 + 24/t): 16384 * 22 bytes per layer at t = 2 (bf16), and the
    # vocabulary-parallel loss keeps half of the 1,024,000 bytes of log-probabilities.
    got = formulas.activation_bytes(SHAPE, Layout(tp=2), work())
    assert got == 3 * 16384 * 22 + 512_000


@pytest.mark.parametrize(
    "schedule, micro_batches, first_layers, last_micro_batches",
    [("1f1b", 6, 3, 1), ("gpipe", 6, 6, 6), ("1f1b", 2, 2, 1)],
)
def test_pipeline_first_stage_holds_the_micro_batches_in_flight(
    schedule, micro_batches, first_layers, last_micro_batches
):
    # pp 3, one layer per stage. 1F1B: min(m, p) micro-batches in flight on the first stage,
    # i.e. all L layers' worth when m >= p; GPipe: all m before the first backward.
    got = formulas.pipeline_in_flight(schedule, 3, micro_batches, 2)
    assert got == (first_layers / 3, last_micro_batches)


def test_bubble_fraction_is_p_minus_1_over_m_plus_p_minus_1():
    assert pipeline.bubble_fraction("1f1b", 4, 12, 2) == 3 / 15
    assert pipeline.bubble_fraction("gpipe", 1, 8, 2) == 0
    # Interleaving v = 2 chunks per rank halves each slot: v*m slots share the same p - 1.
    assert pipeline.bubble_fraction("interleaved", 4, 12, 2) == 3 / 27


def test_communication_per_step_follows_the_ring_formulas():
    # SHAPE's 251,328 parameters (30 tensors, none padded over 4 ranks) on 4 data-parallel ranks
    # in bf16, 2 micro-batches. Every row also adds up the step's target count and loss (12
    # bytes, all-reduced: 2 * 3/4 * 12 = 18 bytes sent).
    P, sums = 251_328, 18
    p = memory.plan(SHAPE, grid(4), work(micro_batches=2))
    sent = {name: row["dp_comm_gb"] * 1e9 for name, row in p["strategies"].items()}
    # DDP all-reduces the 4-byte gradients once (2 * 3/4 * 4P bytes); ZeRO-1
    # (ZeroRedundancyOptimizer) then broadcasts the fp32 weights (3/4 * 4P).
    assert sent["ddp"] == pytest.approx(2 * 0.75 * 4 * P + sums, rel=1e-12)
    assert sent["zero1"] == pytest.approx(2 * 0.75 * 4 * P + 0.75 * 4 * P + sums, rel=1e-12)
    # ZeRO-3 gathers the 2-byte weights twice per micro-batch and reduce-scatters the 4-byte
    # gradients once, and all-reduces the 30 sharded gradients' norms (4 bytes each).
    norms = 2 * 0.75 * 4 * 30
    assert sent["zero3"] == pytest.approx(0.75 * (2 * 2 * 2 * P + 4 * P) + norms + sums, rel=1e-12)
    # tp 2: per micro-batch, 4 all-reduces of s*b*h bf16 activations (32,768 bytes) per layer,
    # and 2 more (the embedding's output, lm_head's input gradient); loss_parallel's 3 fp32 numbers
    # per token; the gradients' norms (30 tensors). An all-reduce over 2 ranks sends its bytes.
    c = memory.plan(SHAPE, grid(8, tp=2), work(micro_batches=2))
    loss_parallel = 3 * 256 * 4 * 2
    assert c["tp_comm_gb"] * 1e9 == pytest.approx(
        (4 * 3 + 2) * 32_768 * 2 + loss_parallel + 4 * 30, rel=1e-12
    )
    assert c["pp_comm_gb"] == 0 and c["hsdp_across_groups_gb"] is None
    # A bare parameter count (the ZeRO paper's Figure 1: 7.5B on 64 GPUs) is one flat parameter:
    # the same ring formulas, one norm; no shapes, so no activations and no tp traffic.
    P, ring = 7_500_000_000, 63 / 64
    bare = memory.plan(P, grid(64), work(micro_batches=2))
    sent = {name: row["dp_comm_gb"] * 1e9 for name, row in bare["strategies"].items()}
    sums = 2 * ring * 12
    assert sent["ddp"] == pytest.approx(2 * ring * 4 * P + sums, rel=1e-12)
    assert sent["zero3"] == pytest.approx(ring * (2 * 2 * 2 * P + 4 * P) + 2 * ring * 4 + sums)
    assert bare["tp_comm_gb"] is None and " n/a" in memory.format_plan(bare).splitlines()[2]


def test_world_size_must_be_a_multiple_of_tp_times_pp(monkeypatch, capsys):
    code, _, err = run_main(monkeypatch, capsys, "--model", "7b", "--world-size", "6", "--tp", "4")
    assert code == 2 and "not a multiple of --tp 4" in err, err


def test_3d_layout_fits_70b_where_data_parallelism_alone_cannot():
    # Llama 2 70B on 64 80-GB GPUs at 4096 tokens: ZeRO-3 alone shards the states but every GPU
    # still holds all 80 layers' activations (~90 GB); tp 8 x pp 4 (dp 2) divides those too.
    config = LlamaConfig.from_preset("70b")
    flat = memory.plan(config, grid(64), Workload(seq_length=4096, gpu_memory_gb=80))
    workload = Workload(seq_length=4096, micro_batches=16, gpu_memory_gb=80)
    three_d = memory.plan(config, grid(64, tp=8, pp=4), workload)
    assert three_d["dp"] == 2 and three_d["bubble_fraction"] == pytest.approx(3 / 19)
    assert not flat["strategies"]["zero3"]["fits"]
    assert three_d["strategies"]["zero3"]["fits"]
    assert three_d["tp_comm_gb"] > 10 * three_d["pp_comm_gb"]  # why TP stays inside a node


# -------------------------------------------------------------------------------------------------
# Sequence and context parallelism, HSDP


def test_sequence_parallel_splits_the_norms_and_residuals_too():
    # With sequence parallelism, 6 of the 10 s*b*h that TP alone keeps whole split t ways; the
    # 4 of the all-gathered matmul inputs, which ColwiseParallel stores whole, do not:
    # s*b*h * (4 + 6/2 + 24/2) = 16384 * 19 bytes per layer at t = 2 (TP alone: 22). With
    # checkpointing, each kept layer input (s*b*h*2 bytes) is split t ways too.
    f = formulas.activation_bytes
    layout = Layout(tp=2, sequence_parallel=True)
    assert f(SHAPE, layout, work()) == 3 * 16384 * 19 + 512_000
    assert f(SHAPE, layout, work(), checkpointing=True) == 3 * 32_768 / 2 + 16384 * 19 + 512_000


def test_context_parallel_splits_every_activation_and_keeps_the_gathered_keys_and_values():
    # cp 2: 34/2 s*b*h bytes per layer, plus the other rank's half of K and V (two bf16 tensors
    # of s*b*kv_dim values, kv_dim = h here: 4 s*b*h bytes, half of them gathered); the
    # log-probabilities of half the tokens.
    got = formulas.activation_bytes(SHAPE, Layout(cp=2), work())
    assert got == 3 * 16384 * (17 + 2) + 512_000
    # The (s, s) scores: each rank's queries (s/2) against all s keys, half of the 5as/h term.
    math_attention = formulas.activation_bytes(SHAPE, Layout(cp=2), work(attention="math"))
    assert math_attention - got == 3 * 655_360 / 2


def test_context_parallel_traffic_is_the_keys_and_values_gathered_and_reduced():
    # cp 2 on 4 ranks (dp 2): K and V of the whole sequence (s*b*kv_dim = 16384 bf16 values each)
    # all-gathered forward and reduce-scattered backward, half of them sent, per layer and
    # micro-batch (2). The ZeRO strategies shard over all 4 ranks that hold the same weights.
    c = memory.plan(SHAPE, grid(4, cp=2), work(micro_batches=2))
    assert c["cp_comm_gb"] * 1e9 == pytest.approx(4 * 0.5 * 16384 * 2 * 3 * 2, rel=1e-12)
    p = memory.plan(SHAPE, grid(4, cp=2), work("fp32"), num_params=1_000_000)
    assert p["dp"] == 2 and p["strategies"]["zero3"]["params_gb"] == 4e6 / 4 / 1e9


def test_hsdp_shards_within_a_group_and_all_reduces_a_shard_across_groups():
    # 8 ranks as 2 replicas of 4: ZeRO-3's states over 4, not 8.
    p = memory.plan(1_000_000, grid(8, replicate=2), Workload(precision="fp32"))
    assert p["strategies"]["hsdp"]["params_gb"] == 4e6 / 4 / 1e9
    assert p["strategies"]["zero3"]["params_gb"] == 4e6 / 8 / 1e9
    # Traffic: ZeRO-3 within a group of 4, then one all-reduce of the 1/4 fp32 gradient shard
    # across the 2 groups, the only bytes between groups. SHAPE in fp32, 1 micro-batch.
    P = 251_328
    p = memory.plan(SHAPE, grid(8, replicate=2), work("fp32"))
    across = 2 * 0.5 * 4 * P / 4
    assert p["hsdp_across_groups_gb"] * 1e9 == pytest.approx(across, rel=1e-12)
    # (and the step's sums over all 8 ranks, the norms of 30 gradient shards within the group)
    small = 2 * 7 / 8 * 12 + 2 * 0.75 * 4 * 30
    within = 0.75 * (2 * 4 * P + 4 * P)
    hsdp = p["strategies"]["hsdp"]["dp_comm_gb"] * 1e9
    assert hsdp == pytest.approx(within + across + small, rel=1e-12)
    assert "hsdp" not in memory.plan(1_000_000, grid(8), Workload(precision="fp32"))["strategies"]
    # A bare count's HSDP: the same all-reduce of its flat parameter's fp32 gradient shard.
    bare = memory.plan(P, grid(8, replicate=2), work("fp32"))
    assert bare["hsdp_across_groups_gb"] * 1e9 == pytest.approx(across, rel=1e-12)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--world-size", "8", "--replicate", "3"], "--replicate 3 does not divide"),
        (["--world-size", "8", "--tp", "2", "--cp", "3"], "not a multiple of --tp 2 x --pp 1 x"),
        (["--world-size", "8", "--cp", "2", "--seq-length", "2047"], "divisible by 2 x --cp = 4"),
        (["--world-size", "8", "--sequence-parallel"], "--sequence-parallel splits a layer's"),
    ],
)
def test_layouts_that_do_not_divide_are_refused(monkeypatch, capsys, flags, message):
    code, _, err = run_main(monkeypatch, capsys, "--model", "7b", *flags)
    assert code == 2 and message in err and err.count("\n") == 1, err


INTERLEAVED = dict(schedule="interleaved", stages_per_rank=1000)


@pytest.mark.parametrize(
    "layout, micro_batches, message",
    [
        (grid(64, tp=64), 1, "--tp 64 does not divide the model's num_attention_heads (32)"),
        (grid(64, pp=64), 64, "the model has 32 layers, fewer than the 64 pipeline"),
        (grid(2, pp=2, **INTERLEAVED), 4, "fewer than the 2000 pipeline stages"),
        (grid(8, pp=4), 1, "1f1b needs at least as many micro-batches as stages: --micro-batches"),
    ],
)
def test_a_layout_train_tp_or_train_pp_refuses_is_refused(layout, micro_batches, message):
    # Before: "fits in 80 GB" for --tp 64, a 98% bubble for --pp 64, 0% for 1000 stages a rank.
    config = LlamaConfig.from_preset("7b")
    with pytest.raises(ValueError, match=re.escape(message)):
        memory.plan(config, layout, Workload(micro_batches=micro_batches))


def test_a_layout_whose_grid_does_not_multiply_to_its_world_size_is_refused():
    # 8 GPUs of tp 2 are 4 data-parallel ranks, not the dp 1 that Layout's default says.
    with pytest.raises(ValueError, match="the layout's dp 1 x tp x pp x cp is not 8 GPUs"):
        memory.plan(SHAPE, Layout(world_size=8, tp=2), work())


def test_context_parallel_fits_a_long_context_that_one_gpu_cannot_hold():
    # Llama 2 7B at 131,072 tokens (one sequence) on 8 GPUs with ZeRO-3 and checkpointing: the
    # log-probabilities alone (4 * s * V = 17 GB) and the layer inputs do not fit at cp 1.
    config = LlamaConfig.from_preset("7b")
    workload = Workload(seq_length=131_072, gpu_memory_gb=80)
    alone = memory.plan(config, grid(8), workload)
    split = memory.plan(config, grid(8, cp=8), workload)
    assert not alone["strategies"]["zero3"]["fits_checkpointed"]
    assert split["strategies"]["zero3"]["fits_checkpointed"]


# -------------------------------------------------------------------------------------------------
# Bad input, and figures of any size


def run_main(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """tools/memory_plan.py's main() with argv, as `python -m tools.memory_plan` runs it
    (exits.run): (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["tools/memory_plan.py", *argv])
    code = 0
    try:
        exits.run(memory_plan.main)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_refuses_a_nan_parameter_count_in_one_line(monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, "--params", "nan")
    assert code == 2 and out == ""
    assert err == (
        "error: argument --params: expected a number in [1, 1e+15], got 'nan' (see --help)\n"
    )


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--params", "inf", "expected a number in [1, 1e+15]"),
        ("--params", "1e30", "expected a number in [1, 1e+15]"),  # not a model: refused
        ("--params", "0.5", "expected a number in [1, 1e+15]"),
        ("--gpu-memory", "0", "expected a number > 0"),  # was: "fits in 0 GB: none"
        ("--gpu-memory", "-80", "expected a number > 0"),
        ("--gpu-memory", "nan", "expected a number > 0"),
        ("--gpu-memory", "inf", "expected a number > 0"),
        ("--world-size", "0", "expected an integer >= 1"),
        ("--tp", "-2", "expected an integer >= 1"),
        ("--pp", "1.5", "expected an integer >= 1"),
        ("--cp", "nan", "expected an integer >= 1"),
        ("--replicate", "0", "expected an integer >= 1"),
        ("--micro-batches", "0", "expected an integer >= 1"),
        ("--stages-per-rank", "0", "expected an integer >= 1"),
        ("--micro-batch-size", "0", "expected an integer >= 1"),
        ("--seq-length", "abc", "expected an integer >= 1"),
        ("--vocab-size", "0", "expected an integer >= 1"),
    ],
)
def test_cli_refuses_non_finite_and_out_of_range_numbers(
    monkeypatch, capsys, flag, value, expected
):
    code, out, err = run_main(monkeypatch, capsys, flag, value)
    assert code == 2 and out == ""
    assert err.startswith(f"error: argument {flag}: {expected}, got {value!r}"), err
    assert err.count("\n") == 1


def test_figures_too_large_for_a_float_are_refused_in_one_line(monkeypatch, capsys):
    argv = ["--hidden-size", "1" + "0" * 400, "--num-heads", "1", "--num-kv-heads", "1"]
    code, out, err = run_main(monkeypatch, capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("error: these sizes give figures too large to compute"), err


@pytest.mark.parametrize(
    "argv, unit",
    [
        (["--model", "7b"], "GB"),
        (["--params", "1e15", "--world-size", "1"], "TB"),  # 16,000 TB under DDP
        (["--model", "70b", "--seq-length", "1000000000", "--attention", "math"], "EB"),
        (["--model", "7b", "--num-layers", "1" + "0" * 30], None),  # past EB: 1.23e+25
    ],
)
def test_the_table_keeps_its_columns_apart_at_any_size(monkeypatch, capsys, argv, unit):
    code, out, err = run_main(monkeypatch, capsys, *argv, "--world-size", "1")
    assert code == 0, err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("strategy"))
    if unit is not None:
        assert f"({unit};" in lines[header]
    for line in lines[header + 1 : header + 5]:  # ddp ... zero3: a name and 9 figures
        fields = line.split()
        assert len(fields) == 10, line
        assert all(len(f) <= 8 for f in fields[1:]), line
    # The step times too (a model of 10^30 layers has one: 1.23e+25 seconds and the like): a
    # name, the recomputation, 7 figures, and whether it fits. (A bare count has none.)
    titles = [i for i, line in enumerate(lines) if line.startswith("step time on")]
    if "--params" in argv:
        assert titles == [], out
        return
    times = titles[0] + 2
    assert len(lines) == times + 4, out
    for line in lines[times:]:
        fields = line.split("   (")[0].split()
        assert len(fields) == 9 and all(len(f) <= 8 for f in fields[2:]), line


# -------------------------------------------------------------------------------------------------
# A mixture of experts and expert parallelism

# SHAPE with 4 experts per layer, 2 per token. By hand: the experts are 3 layers x 4 x 3 * 64 *
# 128 = 294,912 weights; the router 3 x 64 * 4 = 768; the rest is SHAPE's 251,328 minus its
# dense MLPs' 3 x 24,576 = 177,600. 473,280 in all; active per token: 2 experts a layer,
# 177,600 + 768 + 147,456 = 325,824.
MOE_SHAPE = LlamaConfig(**{**SHAPE.to_dict(), "num_local_experts": 4, "num_experts_per_tok": 2})
EXPERTS, REST = 294_912, 178_368


def test_a_mixture_of_experts_counts_its_experts_router_and_active_parameters():
    assert formulas.expert_parameters(MOE_SHAPE) == EXPERTS
    assert count_parameters(MOE_SHAPE) == EXPERTS + REST == 473_280
    assert formulas.stage_parameters(MOE_SHAPE, tp=1, pp=1) == (473_280, 473_280)
    p = memory.plan(MOE_SHAPE, grid(8, ep=4), work("fp32"))
    assert (p["num_params"], p["active_params"]) == (473_280, 325_824)
    assert p["expert_params_per_gpu"] == EXPERTS / 4
    assert formulas.expert_parameters(SHAPE) == 0


def test_expert_parallelism_splits_the_experts_then_the_zero_stage_shards_them():
    # 8 GPUs, ep 4: each holds 1/4 of the experts, and the 2 GPUs holding the same quarter
    # shard it as the stage says; the rest shards over all 8. fp32: 4 bytes per weight.
    s = memory.plan(MOE_SHAPE, grid(8, ep=4), work("fp32"))["strategies"]
    assert s["ddp"]["params_gb"] == pytest.approx(4 * (REST + EXPERTS / 4) / 1e9)
    assert s["zero3"]["params_gb"] == pytest.approx(4 * (REST / 8 + EXPERTS / 4 / 2) / 1e9)
    assert s["zero1"]["optimizer_gb"] == pytest.approx(8 * (REST / 8 + EXPERTS / 4 / 2) / 1e9)
    # ep 1: every GPU holds every expert, and the stage shards them over all 8, as a dense
    # model of the same size.
    one = memory.plan(MOE_SHAPE, grid(8), work("fp32"))
    dense = memory.plan(count_parameters(MOE_SHAPE), grid(8), work("fp32"))
    for name in ("ddp", "zero3"):
        got, want = one["strategies"][name], dense["strategies"][name]
        assert got["model_states_gb"] == pytest.approx(want["model_states_gb"])


def test_a_mixture_of_experts_stores_k_experts_activations_and_the_dispatched_copies():
    # Per layer, in Korthikanti's 16-bit units (bytes = s*b*h * count): the MLP's 19 once more
    # for the second expert of each token, and 2k = 4 for each copy of the pairs: sorted and
    # outputs (ep 1), and received too (ep > 1).
    sbh = S * B * 64
    dense = formulas.layer_activation_bytes(SHAPE, Layout(), work())
    moe = formulas.layer_activation_bytes(MOE_SHAPE, Layout(), work())
    ep = formulas.layer_activation_bytes(MOE_SHAPE, grid(2, ep=2), work())
    assert moe - dense == sbh * (19 + 2 * 4)
    assert ep - moe == sbh * 4


def test_the_all_to_all_traffic_is_four_exchanges_of_the_pairs_that_leave_the_rank():
    # 2 x 128 tokens, 2 experts each: 512 pairs of 64 values; 3 of 4 leave the rank at ep 4;
    # dispatch and combine, forward and backward, in bf16 (2 bytes), 3 layers, 2 micro-batches.
    # Before them, each layer's counts (4 int64, one per expert); after the backward, the
    # experts' gradient norms (3 tensors a layer, 4 bytes each) are all-reduced over ep.
    pairs = 4 * 512 * 64 * 3 / 4 * 2 * 3 * 2
    counts = 3 / 4 * 8 * 4 * 3 * 2
    norms = 2 * 3 / 4 * 4 * 3 * 3
    p = memory.plan(MOE_SHAPE, grid(8, ep=4), work(micro_batches=2))
    assert p["ep_comm_gb"] * 1e9 == pytest.approx(pairs + counts + norms, rel=1e-12)
    assert p["micro_batches"] == 2
    assert memory.plan(MOE_SHAPE, grid(8), work(micro_batches=2))["ep_comm_gb"] == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-experts", "8", "--ep", "3", "--world-size", "6"], "--ep 3 must divide"),
        (["--num-experts", "8", "--ep", "4", "--world-size", "6"], "--ep 4 must divide"),
        (["--ep", "2"], "--ep shares out the experts of a mixture of experts"),
        (["--num-experts", "8", "--tp", "2"], "not with --tp, --pp or --cp"),
    ],
    ids=["ep-not-dividing-the-experts", "ep-not-dividing-the-gpus", "dense", "tensor-parallel"],
)
def test_expert_layouts_that_cannot_be_trained_are_refused(monkeypatch, capsys, flags, message):
    code, _, err = run_main(monkeypatch, capsys, "--model", "1b", *flags)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_cli_plans_a_mixture_of_experts_over_expert_parallel_gpus(monkeypatch, capsys):
    argv = ["--model", "1b", "--num-experts", "8", "--world-size", "16", "--ep", "8"]
    monkeypatch.setattr(sys, "argv", ["tools/memory_plan.py", *argv])
    memory_plan.main()
    out = capsys.readouterr().out
    config = LlamaConfig.from_preset("1b", num_local_experts=8)
    assert f"{count_parameters(config) / 1e9:.3g}B parameters" in out
    assert "2 EP groups x ep 8: each GPU holds 1/8 of the experts" in out
    assert "parameters active per token; each GPU holds" in out and "all-to-alls send" in out


def test_a_figure_under_the_table_has_a_unit_of_its_own(monkeypatch, capsys):
    # A billion layers put the table in PB; the largest parameter (the embedding) is a GB or
    # so, and was said as "(0.00 PB)".
    code, out, _ = run_main(monkeypatch, capsys, "--model", "70b", "--num-layers", "1000000000")
    assert code == 0 and "PB" in out
    assert "the largest parameter whole for an instant (1.05 GB)" in out, out
    assert memory.amount(0.5) == "500.00 MB" and memory.amount(2.5e6) == "2.50 PB"


@pytest.mark.quick
@pytest.mark.parametrize("preset, experts", [("7b", 0), ("tiny", 4)])
def test_muon_plans_one_momentum_for_the_hidden_matrices_muon_updates(preset, experts):
    # The planner's count of the hidden matrices against the model's own parameters that
    # lib/extras/muon.py updates (its is_hidden_matrix), on the meta device: the same number of
    # elements, and the matrices (a stack of experts counts each expert's).
    from lib.extras import muon

    config = LlamaConfig.from_preset(preset, num_local_experts=experts)
    with torch.device("meta"):
        model = LlamaForPretraining(config)
    hidden = [p for n, p in model.named_parameters() if muon.is_hidden_matrix(n, p)]
    count, elements, _ = formulas.hidden_matrices(config)
    assert elements == sum(p.numel() for p in hidden)
    assert count == sum(p.shape[0] if p.dim() == 3 else 1 for p in hidden)
    # AdamW keeps 8 bytes of state per parameter, Muon 4 for the hidden ones: the optimizer
    # column shrinks by half of their share, and nothing else changes.
    layout = Layout(world_size=8, dp=8, ep=1)
    adamw = memory.plan(config, layout, memory.Workload(precision="fp32"))
    with_muon = memory.plan(config, layout, memory.Workload(precision="fp32", optimizer="muon"))
    share = elements / count_parameters(config)
    for name, row in adamw["strategies"].items():
        got = with_muon["strategies"][name]
        assert got["optimizer_gb"] == pytest.approx(row["optimizer_gb"] * (1 - share / 2))
        assert got["params_gb"] == row["params_gb"] and got["grads_gb"] == row["grads_gb"]
    # The exchange under FSDP: every rank sends its pieces of the others' matrices in fp32 and
    # gets its pieces of the results back, (4 + 4) H (N - 1) / N^2 bytes in fp32.
    assert with_muon["muon"]["sent_sharded"] == pytest.approx(8 * elements * 7 / 64 / 1e9)
    assert adamw["muon"] is None and "muon:" in memory.format_plan(with_muon)


# -------------------------------------------------------------------------------------------------
# The step time of each row (lib/extras/step_time.py; its model: tests/test_step_time.py)


def test_cli_rows_gain_step_time_tokens_per_second_and_mfu(monkeypatch, capsys):
    argv = ["--model", "7b", "--world-size", "16", "--gpu", "h200", "--json"]
    monkeypatch.setattr(sys, "argv", ["tools/memory_plan.py", *argv])
    exits.run(memory_plan.main)
    p = json.loads(capsys.readouterr().out)
    assert p["cluster"]["gpu"] == "H200 SXM" and p["cluster"]["gpus_per_node"] == 8
    for row in p["strategies"].values():
        assert row["step_time_s"] > 0 and 0 < row["mfu"] < 1
        tokens = 2048 / row["step_time_s"]  # one sequence per GPU per step
        assert row["tokens_per_sec_per_gpu"] == pytest.approx(tokens)


def test_cli_slower_network_gives_a_slower_step(monkeypatch, capsys):
    def step(*flags):
        argv = ["--model", "7b", "--world-size", "64", "--json", *flags]
        monkeypatch.setattr(sys, "argv", ["tools/memory_plan.py", *argv])
        exits.run(memory_plan.main)
        return json.loads(capsys.readouterr().out)["strategies"]["ddp"]["step_time_s"]

    assert step("--network-gbps", "5", "--gpus-per-node", "1") > step()


def test_cli_refuses_a_bad_matmul_efficiency_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["tools/memory_plan.py", "--matmul-efficiency", "1.5"])
    with pytest.raises(SystemExit) as exit:
        exits.run(memory_plan.main)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and "--matmul-efficiency" in err


def test_the_table_gives_each_strategys_step_time_under_the_memory(monkeypatch, capsys):
    argv = ["--model", "7b", "--world-size", "8", "--gpu-memory", "40", "--gpu", "a100"]
    code, out, _ = run_main(monkeypatch, capsys, *argv)
    lines = out.splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("step time on 8 x A100"))
    rows = {line.split()[0]: line for line in lines[title + 2 : title + 6]}
    assert code == 0 and set(rows) == {"ddp", "zero1", "zero2", "zero3"}, out
    # 40 GB: ZeRO-3 fits without recomputing (test_cli_table_says_what_fits), DDP not even with
    assert rows["ddp"].endswith("(does not fit)") and not rows["zero3"].endswith("fit)")
    assert rows["zero3"].split()[1] == "none" and rows["ddp"].split()[1] == "full"


def test_a_plan_without_a_cluster_has_no_step_time():
    # A lesson's --plan (estimate_for_run) names no cluster: memory alone, as before.
    p = memory.plan(SHAPE, grid(2), work())
    assert "cluster" not in p
    assert all("step_time_s" not in row for row in p["strategies"].values())
