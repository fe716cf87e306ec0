"""Specification of --optimizer muon (lib/extras/muon.py): Muon for the decoder layers' matrices, AdamW for
the rest, the same update in every lesson however the matrices are sharded.

Muon's update is torch.optim.Muon's, operation for operation (its Newton-Schulz in bf16 gives
the same bits); a stack of experts is orthogonalised matrix by matrix. Every strategy trains with
Muon like one process with Muon, within the AdamW parity tests' bounds (tests/test_training.py:
Muon's update has a fixed size, lr x ~1 per element, so a gradient off in any direction moves the
weights by far more than ATOL). Checkpoints hold both states and resume bit for bit; a resume
with another optimizer is refused.
"""

import functools
import shutil

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
    load_checkpoint,
    load_weights,
    run_script,
)
from test_bad_input import assert_refused
from test_fsdp import copy_sharded_checkpoint

from lib import training
from lib.extras import muon
from model import LlamaConfig, LlamaForPretraining

FSDP, TP, PP, CP, EP = (f"train_{n}.py" for n in ("fsdp", "tp", "pp", "cp", "ep"))
MUON = {"optimizer": "muon"}
MOE = {"num_experts": 4, "experts_per_token": 2, "data_mode": "pad", "seed": 1}  # (test_moe_...)


# -------------------------------------------------------------------------------------------------
# The update


@pytest.mark.quick
@pytest.mark.parametrize("shape", [(48, 32), (32, 48)], ids=["tall", "wide"])
def test_muons_step_is_torch_optim_muons(shape, monkeypatch):
    torch.manual_seed(0)
    start, grads = torch.randn(shape), [torch.randn(shape) for _ in range(3)]
    theirs, ours = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    reference = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1)
    group = {"params": [ours], "muon": True, "lr": 0.02, "weight_decay": 0.1}
    optimizer = muon.MuonWithAdamW([group], lr=1e-3)
    # Newton-Schulz in bf16, as torch.optim.Muon computes it (this suite uses fp32 on a CPU).
    monkeypatch.setattr(muon, "newton_schulz", functools.partial(muon.newton_schulz,
                                                                 dtype=torch.bfloat16))  # fmt: skip
    for grad in grads:
        theirs.grad, ours.grad = grad.clone(), grad.clone()
        reference.step()
        optimizer.step()
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, start)


@pytest.mark.quick
def test_a_stack_of_experts_is_orthogonalised_matrix_by_matrix():
    stack = torch.randn(3, 40, 24)
    whole = muon.newton_schulz(stack)
    assert all(torch.equal(whole[e], muon.newton_schulz(stack[e])) for e in range(3))
    # Orthogonalised: singular values near 1 (Muon's quintic lands them in about [0.7, 1.2]).
    singular = torch.linalg.svdvals(whole)
    assert 0.5 < singular.min() and singular.max() < 1.3


@pytest.mark.quick
@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_muon_takes_the_decoder_matrices_and_adamw_the_rest(corpus, cache_dir, experts):
    overrides = {**MUON, "num_experts": experts} if experts else MUON
    args, plan = build_args(corpus, cache_dir, **overrides)
    model = LlamaForPretraining(LlamaConfig.from_preset("tiny", vocab_size=320,
                                                        num_local_experts=experts))  # fmt: skip
    optimizer = training.build_optimizer(model, args, "cpu")
    names = {p: n for n, p in model.named_parameters()}
    by_muon = {names[p] for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    by_adamw = {names[p] for g in optimizer.param_groups if not g["muon"] for p in g["params"]}
    assert by_muon | by_adamw == set(names.values()) and not by_muon & by_adamw
    suffixes = ("wq.weight", "wk.weight", "wv.weight", "wo.weight")
    suffixes += ("w1", "w2", "w3") if experts else ("w1.weight", "w2.weight", "w3.weight")
    hidden = {n for n in names.values() if n.startswith("layers.") and n.endswith(suffixes)}
    assert by_muon == hidden
    assert {"tok_embeddings.weight", "lm_head.weight", "norm.weight"} <= by_adamw
    assert all(g["lr"] == (args.muon_lr if g["muon"] else args.lr) for g in optimizer.param_groups)


# -------------------------------------------------------------------------------------------------
# Every strategy with Muon trains like one process with Muon


@pytest.mark.one_process
@pytest.mark.parametrize(
    "script, world, flags",
    [
        (DDP, 2, {}), (ZERO1, 2, {}), (FSDP, 2, {}), (TP, 2, {"tp": 2}),
        (PP, 2, {"pp": 2}), (CP, 2, {"cp": 2}),
    ],
    ids=["ddp", "zero1", "fsdp", "tp-columns-and-rows", "pp", "cp"],
)  # fmt: skip
def test_a_strategy_with_muon_trains_like_one_process(trained, script, world, flags):
    out = trained(script, world=world, **MUON, **flags)
    reference = trained(DP, **MUON)
    assert_state_dicts_close(load_weights(out), load_weights(reference))
    assert_same_losses(out, reference)


@pytest.mark.one_process
def test_expert_parallel_with_muon_trains_like_one_process(trained):
    # Each rank's experts are whole matrices: orthogonalised where they are, with no traffic.
    out = trained(EP, world=2, ep=2, **MUON, **MOE)
    reference = trained(DP, **MUON, **MOE)
    assert_state_dicts_close(load_weights(out), load_weights(reference))
    assert_same_losses(out, reference)


# -------------------------------------------------------------------------------------------------
# Checkpoints


@pytest.mark.resume
def test_a_muon_run_resumes_bit_for_bit(trained, corpus, cache_dir, tmp_path):
    full = trained(DP, **MUON)
    assert "momentum_buffer" in str(load_checkpoint(full, 4)["optimizer"]["state"])
    out = tmp_path / "resumed"
    copy_checkpoint(full, 4, out)
    run_script(DP, cmd(corpus, cache_dir, out, **MUON))
    assert_state_dicts_equal(load_weights(out), load_weights(full))


@pytest.mark.resume
def test_a_sharded_muon_run_resumes_bit_for_bit(trained, corpus, cache_dir, tmp_path):
    full = trained(FSDP, world=2, **MUON)
    out = tmp_path / "resumed"
    copy_sharded_checkpoint(full, 4, out)
    run_script(FSDP, cmd(corpus, cache_dir, out, **MUON), world=2)
    assert_state_dicts_equal(load_weights(out), load_weights(full))


def test_resuming_with_another_optimizer_is_refused_naming_it(trained, corpus, cache_dir, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained(DP, **MUON), out)  # the finished run, resumed with more steps
    argv = cmd(corpus, cache_dir, out, max_steps=12)  # (AdamW, the default)
    assert_refused(DP, argv, "--optimizer 'muon' (now 'adamw')", out, cache_dir)
