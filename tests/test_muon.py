"""Specification of --optimizer muon (lib/extras/muon.py): Muon for the decoder layers' matrices,
AdamW for the rest, the same update in every lesson however the matrices are sharded.

Muon's update is torch.optim.Muon's, operation for operation (its Newton-Schulz in bf16 gives
the same bits); a stack of experts is orthogonalised matrix by matrix. Every strategy trains with
Muon like one process with Muon, within the AdamW parity tests' bounds (tests/test_training.py:
Muon's update has a fixed size, lr x ~1 per element, so a gradient off in any direction moves the
weights by far more than ATOL). Each matrix is orthogonalised on one rank of those that share
it, ceil(M / N) +- 1 matrices a rank, with the one-process update's bits (on 2 spawned ranks:
DDP, FSDP, TP's split columns, HSDP), while the exchange's traffic is in flight; ZeRO-1 shares
the matrices out evenly. Checkpoints hold both states and resume bit for bit (one written with
Muon's group last too), and on another number of ranks within the parity bounds; a resume with
another optimizer is refused.
"""

import argparse
import functools
import math
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
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
    free_port,
    load_checkpoint,
    load_weights,
    run_script,
)
from test_bad_input import assert_refused
from test_fsdp import copy_sharded_checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from lib import exits, training
from lib.checkpoints import resuming
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
# Each matrix orthogonalised on one rank of those that share it


@pytest.mark.quick
def test_owners_split_the_matrices_evenly_by_count_and_by_cost():
    # Llama 2 7B's 224 matrices over 8 GPUs: 28 each, and each rank ~1/8 of the FLOPs.
    layer = [(4096, 4096)] * 4 + [(11008, 4096), (4096, 11008), (11008, 4096)]
    costs = [muon.newton_schulz_flops(torch.Size(s)) for s in layer * 32]
    assert costs[0] == 5 * 6 * 4096**3 and round(costs[4] / 1e12, 1) == 4.4
    owners = muon.assign_owners(costs, 8)
    assert owners == muon.assign_owners(costs, 8)  # (the same on every rank: costs alone)
    counts = [owners.count(r) for r in range(8)]
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(8)]
    assert counts == [28] * 8
    assert max(loads) - min(loads) <= max(costs) and max(loads) < 1.01 * sum(costs) / 8
    # Fewer matrices than ranks: one each, the rest idle.
    assert sorted(muon.assign_owners(costs[:3], 8)) == [0, 1, 2]


# Matrices like a decoder layer's (one with an odd number of rows, split unevenly), 2 layers.
SHAPES = [(24, 16), (8, 16), (8, 16), (16, 24), (40, 16), (16, 40), (25, 16)] * 2
LAYOUTS = {  # name: (mesh shape, placements); "ddp": plain tensors, replicas on every rank
    "ddp": None,
    "fsdp": ((2,), [Shard(0)]),
    "tp-rows": ((2,), [Shard(1)]),
    "hsdp": ((2, 1), [Replicate(), Shard(0)]),  # 2 replicas of a 1-rank shard group
}


IN_FLIGHT = [0]  # this rank's asynchronous collectives started and not yet waited for


class Tracked:
    """A collective's work, that counts itself out of IN_FLIGHT when waited for."""

    def __init__(self, work):
        self.work, IN_FLIGHT[0] = work, IN_FLIGHT[0] + 1

    def wait(self):
        IN_FLIGHT[0] -= 1
        return self.work.wait()


def track_in_flight(name: str) -> None:
    """From now on, dist.<name>(..., async_op=True) counts its work in IN_FLIGHT."""
    collective = getattr(dist, name)

    def started(*args, **kwargs):
        work = collective(*args, **kwargs)
        return Tracked(work) if kwargs.get("async_op") else work

    setattr(dist, name, started)


def layout_worker(rank: int, world: int, port: int) -> None:
    """One rank of check_layout, for each layout; ends as test_ep.py's workers do."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for name in ("broadcast", "all_to_all_single"):  # (the exchanges' collectives)
        track_in_flight(name)
    try:
        for name in LAYOUTS:
            check_layout(rank, world, name)
    finally:
        dist.destroy_process_group()
    exits.end_process(0)  # only after every check passed: a failure raises above


def muon_optimizer(params: list, **options) -> muon.MuonWithAdamW:
    group = {"params": params, "muon": True, "lr": 0.02, "weight_decay": 0.1}
    return muon.MuonWithAdamW([group], lr=1e-3, **options)


def check_layout(rank: int, world: int, name: str) -> None:
    """Two Muon steps on SHAPES laid out as `name`, against one process: the same weights and
    momenta, bit for bit; each matrix orthogonalised on exactly one rank, ceil(M / N) +- 1 on
    each, as assign_owners says; and every Newton-Schulz call but a rank's first overlaps the
    exchange's traffic (a collective in flight)."""
    torch.manual_seed(0)
    starts = [torch.randn(s) for s in SHAPES]
    grads = [[torch.randn(s) for s in SHAPES] for _ in range(2)]
    reference = [torch.nn.Parameter(w.clone()) for w in starts]
    one_process = muon_optimizer(reference)
    if LAYOUTS[name] is None:
        params = [torch.nn.Parameter(w.clone()) for w in starts]
        optimizer = muon_optimizer(params, replicated_over=muon.replica_group(params))
        place = torch.Tensor.clone
    else:
        mesh = init_device_mesh("cpu", LAYOUTS[name][0])
        place = functools.partial(distribute_tensor, device_mesh=mesh,
                                  placements=LAYOUTS[name][1])  # fmt: skip
        params = [torch.nn.Parameter(place(w)) for w in starts]
        optimizer = muon_optimizer(params)
    calls = []
    counted = muon.newton_schulz
    muon.newton_schulz = lambda g, **kw: calls.append(IN_FLIGHT[0]) or counted(g, **kw)
    try:
        step_both(grads, params, reference, place, one_process, optimizer, calls)
    finally:
        muon.newton_schulz = counted
    every = [None] * world
    dist.all_gather_object(every, len(calls))
    m = len(SHAPES)
    assert sum(every) == m, f"{name}: {every} Newton-Schulz calls for {m} matrices"
    assert all(abs(n - math.ceil(m / world)) <= 1 for n in every), (name, every)
    assert len(calls) == optimizer.newton_schulz_matrices
    assert all(calls[1:]), f"{name}: collectives in flight at each Newton-Schulz call: {calls}"
    for p, q in zip(params, reference, strict=True):
        whole = p.full_tensor() if LAYOUTS[name] else p
        assert torch.equal(whole, q), f"{name}: a weight differs from one process's"
        momentum = optimizer.state[p]["momentum_buffer"]
        momentum = momentum.full_tensor() if LAYOUTS[name] else momentum
        assert torch.equal(momentum, one_process.state[q]["momentum_buffer"])
    if rank == 0 and name == "fsdp":
        summary = optimizer.describe_newton_schulz()
        assert summary.startswith("Newton-Schulz: 14 matrices over 2 ranks, 7 each, "), summary


@pytest.mark.one_process
def test_each_matrix_is_orthogonalised_on_one_rank_with_one_process_update():
    # DDP (replicas), FSDP (rows, one of them unevenly), TP's row-parallel columns, HSDP's
    # replicas of a shard: the same bits as one process, and Newton-Schulz run once a matrix.
    mp.spawn(layout_worker, args=(2, free_port()), nprocs=2, join=True)


STACKS = [(4, 24, 16), (4, 16, 40), (3, 25, 16)]  # experts' (E, out, in), two split unevenly


def stacks_worker(rank: int, world: int, port: int) -> None:
    """Two Muon steps on STACKS split along E over one mesh dimension and along their rows over
    the other, against one process: the same bits, each stack orthogonalised on one rank."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        starts = [torch.randn(s) for s in STACKS]
        grads = [[torch.randn(s) for s in STACKS] for _ in range(2)]
        reference = [torch.nn.Parameter(w.clone()) for w in starts]
        one_process = muon_optimizer(reference)
        mesh = init_device_mesh("cpu", (2, 2))
        place = functools.partial(distribute_tensor, device_mesh=mesh,
                                  placements=[Shard(0), Shard(1)])  # fmt: skip
        params = [torch.nn.Parameter(place(w)) for w in starts]
        optimizer = muon_optimizer(params)
        calls, counted = [], muon.newton_schulz
        muon.newton_schulz = lambda g, **kw: calls.append(len(g)) or counted(g, **kw)
        step_both(grads, params, reference, place, one_process, optimizer, calls)
        every = [None] * world
        dist.all_gather_object(every, (calls, optimizer.newton_schulz_matrices))
        assert sorted(sum((c for c, _ in every), [])) == [3, 4, 4], every  # each stack once
        assert all(sum(c) == n for c, n in every), every
        for p, q in zip(params, reference, strict=True):
            assert torch.equal(p.full_tensor(), q)
    finally:
        dist.destroy_process_group()
    exits.end_process(0)


def test_a_stack_of_experts_split_both_ways_is_orthogonalised_on_one_rank():
    # None of the lessons splits a stack of experts both along E and across its matrices; were
    # one to, its owner would gather it whole, not every rank (as once, with full_tensor).
    mp.spawn(stacks_worker, args=(4, free_port()), nprocs=4, join=True)


def zero1_worker(rank: int, world: int, port: int) -> None:
    """One rank of the ZeRO-1 test: train_zero1.py's optimizer over `tiny` (its embedding and
    lm_head as large as 14 of its 28 hidden matrices); checks how Muon's matrices are shared."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = LlamaForPretraining(LlamaConfig.from_preset("tiny", vocab_size=4096))
        args = argparse.Namespace(optimizer="muon", muon_lr=0.02, lr=1e-3, weight_decay=0.1)
        optimizer = training.build_optimizer(model, args, "cpu")
        optimizer = ZeroRedundancyOptimizer(optimizer.param_groups, optimizer_class=type(optimizer))
        mine = [p for g in optimizer.optim.param_groups if g["muon"] for p in g["params"]]
        flops = sum(muon.newton_schulz_flops(p.shape) for p in mine)
        every = [None] * world
        dist.all_gather_object(every, (len(mine), flops))
        counts, loads = zip(*every, strict=True)
        m = sum(counts)
        assert m == 28 and all(abs(n - math.ceil(m / world)) <= 1 for n in counts), counts
        assert max(loads) < 1.01 * sum(loads) / world, loads
    finally:
        dist.destroy_process_group()
    exits.end_process(0)


def test_zero1_shares_muons_matrices_out_evenly_by_count_and_by_cost():
    # ZeroRedundancyOptimizer gives each parameter, group after group, to the rank with the
    # fewest elements: Muon's group first, 7 matrices a rank. Last, after the embedding and
    # lm_head, two of the four ranks had none of them, and the others 14 each.
    mp.spawn(zero1_worker, args=(4, free_port()), nprocs=4, join=True)


@pytest.mark.quick
def test_a_checkpoint_from_when_muons_group_came_last_resumes():
    # training.build_optimizer puts Muon's group first (for ZeRO-1, above); a .pt written when it
    # came last has its groups, and its parameters' numbers, put in the new order.
    model = LlamaForPretraining(LlamaConfig.from_preset("tiny", vocab_size=320))
    args = argparse.Namespace(optimizer="muon", muon_lr=0.02, lr=1e-3, weight_decay=0.1)
    optimizer = training.build_optimizer(model, args, "cpu")
    assert [g["muon"] for g in optimizer.param_groups] == [True, False, False]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    saved = optimizer.state_dict()
    assert resuming.muon_group_first(saved) is saved
    groups = saved["param_groups"]
    old = [*groups[1:], groups[0]]  # as written before: AdamW's groups, then Muon's
    renumbered = {o: n for n, o in enumerate(i for g in old for i in g["params"])}
    written = {
        "state": {renumbered[i]: v for i, v in saved["state"].items()},
        "param_groups": [{**g, "params": [renumbered[i] for i in g["params"]]} for g in old],
    }
    fresh = training.build_optimizer(model, args, "cpu")
    fresh.load_state_dict(resuming.muon_group_first(written))
    again = fresh.state_dict()
    assert again["param_groups"] == saved["param_groups"]
    assert again["state"].keys() == saved["state"].keys()
    for i, state in saved["state"].items():
        assert all(torch.equal(again["state"][i][k], v) for k, v in state.items()), i


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
@pytest.mark.parametrize("script, world", [(DP, 1), (ZERO1, 2)], ids=["dp", "zero1"])
def test_a_muon_run_resumes_bit_for_bit(trained, corpus, cache_dir, tmp_path, script, world):
    # (ZeRO-1: its gathered .pt, each rank's momenta and moments loaded by their owner.)
    full = trained(script, world=world, **MUON)
    assert "momentum_buffer" in str(load_checkpoint(full, 4)["optimizer"]["state"])
    out = tmp_path / "resumed"
    copy_checkpoint(full, 4, out)
    proc = run_script(script, cmd(corpus, cache_dir, out, **MUON), world=world)
    assert_state_dicts_equal(load_weights(out), load_weights(full))
    split = "28 matrices shared out by ZeRO-1 over 2 ranks, 14 on this rank" if world > 1 else ""
    assert f"Newton-Schulz: {split}" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.resume
def test_a_sharded_muon_run_resumes_bit_for_bit(trained, corpus, cache_dir, tmp_path):
    full = trained(FSDP, world=2, **MUON)
    out = tmp_path / "resumed"
    copy_sharded_checkpoint(full, 4, out)
    run_script(FSDP, cmd(corpus, cache_dir, out, **MUON), world=2)
    assert_state_dicts_equal(load_weights(out), load_weights(full))


@pytest.mark.resume
def test_a_sharded_muon_run_resumes_on_another_number_of_ranks(trained, corpus, cache_dir,
                                                                tmp_path):  # fmt: skip
    # Written by 2 ranks, resumed by 1: DCP reshards the momentum like its weight, and the one
    # rank now owns every matrix. Steps 5-8 add the batch up in one process: the parity
    # tolerance, as test_fsdp.py's resume on a different number of ranks.
    full = trained(FSDP, world=2, **MUON)
    out = tmp_path / "resumed"
    copy_sharded_checkpoint(full, 4, out)
    shutil.copy(full / "metrics.jsonl", out)  # the resumed run keeps steps 1-4 of it
    proc = run_script(FSDP, cmd(corpus, cache_dir, out, **MUON), world=1)
    assert "at step 4" in proc.stdout and "Newton-Schulz: " in proc.stdout
    assert_state_dicts_close(load_weights(out), load_weights(full))
    assert_same_losses(out, full)


def test_resuming_with_another_optimizer_is_refused_naming_it(trained, corpus, cache_dir, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trained(DP, **MUON), out)  # the finished run, resumed with more steps
    argv = cmd(corpus, cache_dir, out, max_steps=12)  # (AdamW, the default)
    assert_refused(DP, argv, "--optimizer 'muon' (now 'adamw')", out, cache_dir)


def step_both(grads, params, reference, place, one_process, optimizer, calls: list) -> None:
    """Each step's gradients (`place`d on `params`, whole on `reference`), then a step of the
    one-process optimizer and of ours, `calls` cleared before ours."""
    for step_grads in grads:
        for p, q, g in zip(params, reference, step_grads, strict=True):
            p.grad, q.grad = place(g), g.clone()
        one_process.step()
        calls.clear()
        optimizer.step()
