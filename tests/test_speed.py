"""Specification of --activation-checkpointing and --compile (lib/extras/speed.py): they change
how each decoder layer (and the loss) runs, and nothing a copy of the model could miss.

nn.DataParallel (train_dp.py on 2+ GPUs) copies each module's instance attributes into its
replicas, so a method bound to the original module and stored on it would run the original's
weights in every replica. Here, on a CPU, replicate() builds the replicas as it does on GPUs
(the broadcast of the weights replaced by copies), and a replica must compute with its own.
"""

import functools
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.parallel.replicate
from harness import cmd, run_script

from lib import training
from model import LlamaConfig, LlamaForPretraining

FLAGS = {
    "checkpointing": dict(activation_checkpointing=True, compile=False),
    "compile": dict(activation_checkpointing=False, compile=True),
    "both": dict(activation_checkpointing=True, compile=True),
}
needs_compiler = pytest.mark.skipif(not shutil.which("g++"), reason="Inductor needs a C++ compiler")


def tiny_model() -> LlamaForPretraining:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    return LlamaForPretraining(config)


def prepared(flags: str) -> LlamaForPretraining:
    model = tiny_model()
    training.prepare_layers(model, SimpleNamespace(**FLAGS[flags]))
    return model


def module_bound_to(value) -> torch.nn.Module | None:
    """The module a stored callable is bound to, through partials (their function and arguments)
    and wrappers (as torch.compile's), or None."""
    if isinstance(getattr(value, "__self__", None), torch.nn.Module):
        return value.__self__
    if isinstance(value, functools.partial):
        found = (module_bound_to(inner) for inner in (value.func, *value.args))
        return next((module for module in found if module is not None), None)
    wrapped = getattr(value, "__wrapped__", None)
    return None if wrapped is None else module_bound_to(wrapped)


def batch():
    torch.manual_seed(1)
    x = torch.randint(0, 97, (2, 8))
    return x, torch.roll(x, -1, 1)


@pytest.mark.parametrize("flags", ["checkpointing", pytest.param("both", marks=needs_compiler)])
def test_no_module_holds_a_method_bound_to_a_module(flags):
    model = prepared(flags)
    for name, module in model.named_modules():
        for attribute, value in vars(module).items():
            assert module_bound_to(value) is None, f"{name or 'model'}.{attribute}"


def test_the_flags_keep_the_parameter_names_and_the_state_dict():
    plain, model = tiny_model(), prepared("checkpointing")
    assert list(model.state_dict()) == list(plain.state_dict())
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True)
    )


def replicas(model, monkeypatch, count=2):
    """replicate() as nn.DataParallel calls it, on a CPU: each replica's weights a copy."""

    def copies(tensors, devices, detach=False):
        return [
            [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors] for _ in devices
        ]

    module = sys.modules["torch.nn.parallel.replicate"]  # (the package names a function so)
    monkeypatch.setattr(module, "_broadcast_coalesced_reshape", copies)
    return module.replicate(model, list(range(count)))


@pytest.mark.parametrize("flags", ["checkpointing", pytest.param("both", marks=needs_compiler)])
def test_a_data_parallel_replica_computes_with_its_own_weights(flags, monkeypatch):
    x, y = batch()
    model = prepared(flags)
    replica = replicas(model, monkeypatch)[1]
    expected = tiny_model()  # the same weights, changed as the replica's are below
    with torch.no_grad():  # the replica's own weights (on another GPU), and now different
        for copy in (replica, expected):
            for layer in copy.layers:
                layer.feed_forward.w2.weight.mul_(3)
            copy.lm_head.weight.mul_(2)
    loss_sum, count = replica(x, y)
    expected_sum, expected_count = expected(x, y)
    assert count == expected_count
    torch.testing.assert_close(loss_sum, expected_sum, rtol=1e-5, atol=1e-5)


@needs_compiler
def test_train_tp_runs_with_both_flags(corpus, cache_dir, tmp_path):
    # TP's hooks hand DTensors to the layers: compiled with the checkpoint inside the graph, the
    # backward failed (torch 2.13); the checkpoint outside the compiled forward runs.
    argv = cmd(corpus, cache_dir, tmp_path / "out", max_steps=2, tp=2, compile=True,
               activation_checkpointing=True)  # fmt: skip
    run_script("train_tp.py", argv, 2)
