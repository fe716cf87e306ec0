"""Specification of expert parallelism (train_ep.py, lib/parallel/expert_parallel.py): the experts
of every MoE layer split over the ep ranks of a group, the tokens sent to them and back with
all-to-alls, train exactly like one process on the same global batch, resume bit for bit, and
write the sharded checkpoints of train_fsdp.py.

The dispatch is checked alone first, on 2 gloo ranks spawned by the test (float64: the ranks'
outputs and every gradient equal MoEFeedForward's on the whole batch), then the script is
launched as a user would (torchrun, gloo on CPU) with the training tests' settings and corpus
(harness.py, conftest.py) in pad mode, as test_moe_training.py runs the other lessons, and
compared with train_dp.py: EP changes which rank runs which expert, and the order in which an
expert's gradient adds up the ranks' tokens, not the arithmetic. The gradient's scale is what
the divide factor of the experts' FSDP unit gets right or wrong (an expert's gradient arrives
summed over the EP group); the weights cannot show a constant factor (clipping and AdamW cancel
it), the logged pre-clip gradient norm does (harness.assert_same_losses). Measured on this
corpus (fp32) against train_dp.py, under this CPU's kernels / ATEN_CPU_CAPABILITY=default: --ep 2
on 2 ranks with 2 micro-batches each, weights within 1.5e-6 / 3.0e-6, losses 2.1e-7 / 1.0e-7
(relative), gradient norms 1.4e-6 / 6.4e-7, aux losses 5.6e-8 / 4.4e-8; --ep 2 on 4 ranks (dp 2 x
ep 2: the experts also FSDP-sharded over dp, with their own divide factor), weights within
2.5e-6 / 1.6e-6, losses 5.2e-7 / 3.0e-7, gradient norms 1.8e-6 / 1.3e-6; the same tokens per
expert at every step (harness.ATOL is 2e-5). With 1 sequence per micro-batch on 4 ranks, an
embedding weight lands at 2.1e-5, as train_fsdp.py's does on the same layout (1.9e-5): AdamW on a
rare token's row, not EP; the layouts here keep the margin the other lessons' tests keep.
"""

import pytest
import test_moe_training
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import (
    DP,
    assert_same_losses,
    assert_state_dicts_close,
    cmd,
    free_port,
    load_weights,
    read_metrics,
    run_script,
)
from test_bad_input import assert_refused
from test_fsdp import assert_resumes_bit_identically, copy_sharded_checkpoint
from test_moe_training import MOE

from lib import exits
from lib.extras.moe import MoEFeedForward
from lib.parallel import expert_parallel
from model import LlamaConfig

EP, FSDP = "train_ep.py", "train_fsdp.py"
E, K = 4, 2
# The runs, made once per module and shared by its tests: test_moe_training.py's fixture.
launched = test_moe_training.launched
TOKENS_PER_STEP = 8 * 32  # harness.BASE: --batch-size 8 x --seq-length 32, padding included

# -------------------------------------------------------------------------------------------------
# The dispatch alone, on 2 gloo ranks


def moe_layer(seed: int = 0) -> MoEFeedForward:
    """A small MoE layer (4 experts, 2 per token) in float64, with large random weights."""
    config = LlamaConfig.from_preset(
        "tiny",
        hidden_size=16,
        intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=E,
        num_experts_per_tok=K,
    )
    torch.manual_seed(seed)
    layer = MoEFeedForward(config).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.5)
    return layer


def dispatch_worker(rank: int, world: int, port: int) -> None:
    """One rank, for both routings: see check_dispatch. A rank that passed ends as the lessons
    do (exits.end_process: os._exit), not through the interpreter's teardown, which the gloo
    group that DTensor keeps alive can abort (SIGABRT, seen about once in ten runs)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for skewed in (False, True):
            check_dispatch(rank, world, skewed)
    finally:
        dist.destroy_process_group()
    exits.end_process(0)  # only after every check passed: a failure raises above


def check_dispatch(rank: int, world: int, skewed: bool) -> None:
    """The layer with its experts sharded over the ranks, on this rank's share of the batch,
    against the whole layer on the whole batch (which every rank computes too)."""
    reference = moe_layer()
    x = torch.randn(2 * world, 5, 16, dtype=torch.float64, generator=torch.Generator())
    if skewed:  # every token to experts 0 and 1, both on rank 0: rank 1 receives nothing
        with torch.no_grad():
            reference.gate.weight.zero_()
            reference.gate.weight[:2, 0] = torch.tensor([2.0, 1.0])
        x[..., 0] = 5 + x[..., 0].abs()
    x.requires_grad_()
    (reference(x) ** 2).sum().backward()
    _, _, chosen = reference.route(x.detach().view(-1, 16))
    assert set(chosen.unique().tolist()) == ({0, 1} if skewed else set(range(E)))

    layer = moe_layer()
    layer.load_state_dict(reference.state_dict())
    mesh = dist.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    expert_parallel.shard_experts(layer, mesh["ep"])
    assert layer.w1.to_local().shape == (E // world, 24, 16)  # this rank's experts only
    mine = slice(2 * rank, 2 * rank + 2)
    x_mine = x.detach()[mine].clone().requires_grad_()
    y = layer(x_mine)
    (y**2).sum().backward()

    close = dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(y, reference(x.detach())[mine], **close)
    torch.testing.assert_close(x_mine.grad, x.grad[mine], **close)
    for name in expert_parallel.EXPERT_WEIGHTS:  # each expert's, from every rank's tokens
        got = getattr(layer, name).grad.full_tensor()
        torch.testing.assert_close(got, getattr(reference, name).grad, **close)
    gate = layer.gate.weight.grad.clone()  # the replicated router: its ranks' grads add up
    dist.all_reduce(gate)
    torch.testing.assert_close(gate, reference.gate.weight.grad, **close)


def test_the_dispatch_over_2_ranks_equals_the_layer_on_the_whole_batch():
    # Outputs, the gradients of the inputs, the experts and the router, in float64; for random
    # routing, and for a router that sends every token to rank 0's experts (rank 1 then sends
    # everything and receives nothing: empty messages, experts with no tokens).
    mp.spawn(dispatch_worker, args=(2, free_port()), nprocs=2, join=True)


# -------------------------------------------------------------------------------------------------
# train_ep.py trains like one process


# 2 ranks, ep 2: each rank holds 2 of the 4 experts; 2 micro-batches per rank accumulate first
# (--micro-batch-size 2 of 4 sequences per rank).
EP2 = ("--ep", "2", "--micro-batch-size", "2")
# 4 ranks as dp 2 x ep 2: the experts also FSDP-sharded over dp, with their own divide factor.
EP2_DP2 = ("--ep", "2")
# 4 ranks as 2 EP groups, the dense part under HSDP (2 replicas of 2): the 70b-style layout.
EP2_HSDP = ("--ep", "2", "--replicate", "2")
LAYOUTS = [(2, EP2), (4, EP2_DP2), (4, EP2_HSDP)]
LAYOUT_IDS = ["ep2-accum", "dp2-ep2", "hsdp-ep2"]


@pytest.mark.one_process
@pytest.mark.parametrize("world, flags", LAYOUTS, ids=LAYOUT_IDS)
def test_expert_parallelism_trains_like_one_process(launched, world, flags):
    out, reference = launched(EP, world, *flags).out, launched(DP, 1).out
    assert_state_dicts_close(load_weights(out), load_weights(reference))
    # Losses, validation losses and the pre-clip gradient norm: an expert gradient off by the
    # factor ep (the wrong divide factor) shows here, not in the weights.
    assert_same_losses(out, reference)
    # model.pt holds the whole experts, as every script writes them.
    assert load_weights(out)["layers.0.feed_forward.w1"].shape == (E, 512, 192)


@pytest.mark.one_process
@pytest.mark.parametrize("world, flags", LAYOUTS, ids=LAYOUT_IDS)
def test_the_logged_routing_and_aux_loss_are_the_one_process_ones(launched, world, flags):
    train = read_metrics(launched(EP, world, *flags).out)[0]
    want = read_metrics(launched(DP, 1).out)[0]
    assert [r["step"] for r in train] == list(range(1, 9))
    got_aux, want_aux = [r["aux_loss"] for r in train], [r["aux_loss"] for r in want]
    assert all(aux > 0 for aux in got_aux)
    assert got_aux == pytest.approx(want_aux, rel=1e-4)
    # Dropless: every token of the step, padding included, reached K experts in every layer,
    # the same ones as in one process.
    assert [r["tokens_per_expert"] for r in train] == [r["tokens_per_expert"] for r in want]
    for r in train:
        assert [sum(layer) for layer in r["tokens_per_expert"]] == [TOKENS_PER_STEP * K] * 4


def test_train_ep_says_how_it_spreads_the_experts(launched):
    assert (
        "experts: 4 per layer over the 2 ranks of each EP group (2 each), 2 groups; the experts' "
        "FSDP over 2 ranks" in launched(EP, 4, *EP2_DP2).stdout
    )


# -------------------------------------------------------------------------------------------------
# Checkpoints


@pytest.mark.resume
def test_ep_resume_is_bit_identical(launched, corpus, cache_dir, tmp_path):
    full, out = launched(EP, 2, *EP2).out, tmp_path / "resumed"
    argv = cmd(corpus, cache_dir, out, **MOE) + list(EP2)
    assert_resumes_bit_identically(EP, full, out, argv, 2, tmp_path)


def test_an_ep_checkpoint_resumes_in_train_fsdp(launched, corpus, cache_dir, tmp_path):
    # The experts' DTensors are saved by their global shape: written by 4 ranks as dp 2 x ep 2,
    # read by train_fsdp.py on 2 ranks, which shards every expert over both.
    out = tmp_path / "resumed"
    ep_run = launched(EP, 4, *EP2_DP2).out
    copy_sharded_checkpoint(ep_run, 4, out)
    proc = run_script(FSDP, cmd(corpus, cache_dir, out, **MOE), world=2)
    assert "at step 4" in proc.stdout
    assert_state_dicts_close(load_weights(out), load_weights(launched(DP, 1).out))


# -------------------------------------------------------------------------------------------------
# Flags that cannot work, refused in one line before any work


@pytest.mark.parametrize(
    "overrides, flags, world, expect",
    [
        ({}, ["--ep", "2"], 1, "--ep 2 must divide the number of ranks (1)"),
        ({"num_experts": 3}, ["--ep", "2"], 2, "--ep 2 must divide --num-experts 3"),
        ({"num_experts": None, "experts_per_token": None}, [], 1,
         "expert parallelism shards a mixture of experts, and this model is dense"),
        ({"num_experts": 2, "experts_per_token": 3}, [], 1,
         "--experts-per-token 3 is more than --num-experts 2"),
    ],
    ids=["ep-not-dividing-the-ranks", "ep-not-dividing-the-experts", "dense-model",
         "more-experts-per-token-than-experts"],
)  # fmt: skip
def test_train_ep_refuses_what_it_cannot_do(corpus, cache_dir, tmp_path, overrides, flags,
                                            world, expect):  # fmt: skip
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out, **{**MOE, **overrides}) + flags
    assert_refused(EP, argv, expect, out, cache_dir, world=world)
    assert not out.exists(), "nothing is written before the flags are checked"


def test_data_parallel_size_is_the_other_side_of_the_grid():
    assert expert_parallel.data_parallel_size(8, 4, 8) == 2
    assert expert_parallel.data_parallel_size(4, 4, 4) == 1
    with pytest.raises(ValueError, match="--ep 4 must divide --num-experts 6"):
        expert_parallel.data_parallel_size(8, 4, 6)
