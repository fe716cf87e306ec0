"""Specification of the throughput metrics: model FLOPs per token (PaLM's count), the peak of
the device in use, and MFU, which is never reported where the peak is unknown."""

import pytest
import torch
from harness import DP, read_metrics

from lib import metrics
from model import LlamaConfig, count_parameters


def test_flops_per_token_is_palms_count_without_the_input_embedding():
    # Llama-2-7B: 6,738,415,616 parameters, of which the 32000 x 4096 input embedding does no
    # matrix multiply; attention adds 12 * layers * hidden * context.
    config = LlamaConfig.from_preset("7b")
    n = 6_738_415_616 - 32000 * 4096
    assert metrics.flops_per_token(config, 2048) == 6 * n + 12 * 32 * 4096 * 2048


def test_flops_per_token_counts_a_tied_embedding_once_as_lm_head():
    config = LlamaConfig.from_preset("1b")  # tie_word_embeddings=True
    n = count_parameters(config)  # the shared matrix is in it once
    attention = 12 * config.num_hidden_layers * config.hidden_size * 1024
    assert metrics.flops_per_token(config, 1024) == 6 * n + attention


@pytest.mark.parametrize(
    "name, peak",
    [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
     ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
     ("NVIDIA GeForce GTX 1080", None)],
)  # fmt: skip
def test_peak_flops_is_the_bf16_dense_peak_of_the_gpu_in_use(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert metrics.peak_flops(torch.device("cuda", 0)) == peak


def test_cpu_has_no_peak_and_so_no_mfu():
    assert metrics.peak_flops(torch.device("cpu")) is None
    assert metrics.mfu(1e6, 1e9, None, 1) is None


def test_mfu_divides_achieved_model_flops_by_the_peak_of_all_devices():
    assert metrics.mfu(2e4, 5e9, 1e14, 4) == pytest.approx(2e4 * 5e9 / 4e14)


def test_a_cpu_run_logs_mfu_and_peak_memory_as_null(trained):
    train, _ = read_metrics(trained(DP))
    assert train and all("mfu" in r and r["mfu"] is None for r in train)
    assert all("peak_memory_gb" in r and r["peak_memory_gb"] is None for r in train)


def test_progress_bar_shows_step_time_and_mfu_next_to_loss_lr_and_tokens_per_sec():
    figures = {"tokens_per_sec": 8000.0, "step_ms": 512.0, "mfu": 0.4123, "peak_memory_gb": 3.0}
    assert metrics.bar_postfix(2.5, 3e-4, figures) == {
        "loss": "2.500", "lr": "3.00e-04", "tok_s": "8,000", "step_ms": "512.0", "mfu": "41.2%"
    }  # fmt: skip


def test_progress_bar_leaves_mfu_out_where_the_peak_is_unknown():
    figures = {"tokens_per_sec": 8000.0, "step_ms": 512.0, "mfu": None, "peak_memory_gb": None}
    assert list(metrics.bar_postfix(2.5, 3e-4, figures)) == ["loss", "lr", "tok_s", "step_ms"]


def test_throughput_figures_agree_with_each_other(trained):
    # Every logged step: step time x tokens/s = the tokens of one step (8 x 32), whatever the
    # machine's speed.
    train, _ = read_metrics(trained(DP))
    for r in train:
        assert r["step_ms"] * r["tokens_per_sec"] / 1000 == pytest.approx(8 * 32, rel=1e-6)
