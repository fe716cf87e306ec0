"""Specification of memory_plan.py: its formulas against numbers worked out by hand.

The model-state formulas must reproduce the ZeRO paper's own figures; the activation formula is
Korthikanti et al.'s, checked on a small shape where every term can be computed on paper.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import memory_plan
from model import LlamaConfig, count_parameters

REPO = Path(__file__).resolve().parents[1]

# A shape small enough to work out by hand: s*b*h = 128 * 2 * 64 = 16384 activations per layer
# of hidden states.
SHAPE = LlamaConfig(
    vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
)  # fmt: skip
B, S = 2, 128


@pytest.mark.parametrize(
    "strategy, published_gb",
    [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)],
)
def test_paper_precision_reproduces_the_zero_papers_figure_1(strategy, published_gb):
    # Rajbhandari et al. 2019, Figure 1: Psi = 7.5B parameters, N_d = 64 GPUs, K = 12.
    p = memory_plan.plan(int(7.5e9), 64, "paper")
    assert round(p["strategies"][strategy]["model_states_gb"], 1) == published_gb


def test_model_states_follow_the_zero_stages_in_fp32():
    # fp32: 4 bytes of weights, 4 of gradients, 8 of AdamW moments per parameter; 4 ranks.
    n, world = 1_000_000, 4
    s = memory_plan.plan(n, world, "fp32")["strategies"]
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
    fp32 = memory_plan.plan(10**6, 2, "fp32", SHAPE, B, S)["strategies"]["zero2"]
    bf16 = memory_plan.plan(10**6, 2, "bf16", SHAPE, B, S)["strategies"]["zero2"]
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
    f = memory_plan.activation_bytes
    assert f(SHAPE, B, S, "bf16", "flash") == 3 * 557_056 + 1_024_000
    assert f(SHAPE, B, S, "bf16", "math") == 3 * (557_056 + 655_360) + 1_024_000
    assert f(SHAPE, B, S, "fp32", "flash") == 3 * 2 * 557_056 + 1_024_000
    # Checkpointing: 3 layer inputs of s*b*h*2 bytes, one layer recomputed, the log-probs.
    assert f(SHAPE, B, S, "bf16", "flash", checkpointing=True) == 3 * 32_768 + 557_056 + 1_024_000


def test_totals_and_fits_add_model_states_and_activations():
    p = memory_plan.plan(count_parameters(SHAPE), 2, "bf16", SHAPE, B, S, gpu_memory_gb=0.005)
    for row in p["strategies"].values():
        assert row["total_gb"] == pytest.approx(row["model_states_gb"] + row["activations_gb"])
        assert row["total_checkpointed_gb"] < row["total_gb"]
    # 5 MB: totals are ddp 6.7, zero1 5.7, zero2 5.2, zero3 4.7 MB: only ZeRO-3 fits.
    fits = {name for name, row in p["strategies"].items() if row["fits"]}
    assert fits == {"zero3"}, p


def test_cli_json_output_has_the_documented_fields():
    proc = subprocess.run(
        [sys.executable, str(REPO / "memory_plan.py"), "--model", "7b", "--world-size", "8",
         "--json"],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    strategies = json.loads(proc.stdout)["strategies"]
    assert set(strategies) == {"ddp", "zero1", "zero2", "zero3"}
    for row in strategies.values():
        assert {"params_gb", "grads_gb", "optimizer_gb", "model_states_gb"} <= row.keys()
    # Llama 2 7B (6.74B parameters) in bf16 with fp32 states: 16 bytes each under DDP.
    assert strategies["ddp"]["model_states_gb"] == pytest.approx(16 * 6_738_415_616 / 1e9)


def test_cli_table_says_what_fits():
    proc = subprocess.run(
        [sys.executable, str(REPO / "memory_plan.py"), "--model", "7b", "--world-size", "8",
         "--gpu-memory", "40"],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    assert "fits in 40 GB: zero3" in proc.stdout, proc.stdout
