"""Specification of two choices a run makes for speed and memory: which kernel runs the
--document-mask (--attention), and how --micro-batch-size auto searches for the largest
micro-batch that fits; and of tools/profile_step.py's reference, the yardstick of our training step.

Their GPU halves (FlexAttention's backward pass, GPU memory measurements) cannot run on a CPU.
What is held here: the decisions around them; the search on an injected memory model, and
auto_micro_batch_size on a CPU whose torch.cuda memory counters are simulated (train_pp.py's
probes through its pipeline on two gloo ranks: tests/pipeline_auto.py); and the clear
refusals a CPU run gives. (The BlockMask itself is specified in test_masks.py, the model's
flex_attention path in test_model.py.)
"""

import json
import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from harness import (
    DDP,
    DP,
    REPO,
    assert_state_dicts_equal,
    cmd,
    load_weights,
    read_metrics,
    run_script,
)

import masks
from lib import exits, flags, training
from lib.extras import auto_batch
from model import LlamaConfig, LlamaForPretraining
from tools import profile_step

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)  # only compared, never used

# -------------------------------------------------------------------------------------------------
# --attention


def attention_args(attention: str, document_mask: bool = True) -> SimpleNamespace:
    return SimpleNamespace(attention=attention, document_mask=document_mask)


@pytest.mark.parametrize(
    "document_mask, device, replicas, expected",
    [
        (True, CUDA, 1, "flex"),
        (True, CPU, 1, "sdpa"),  # no FlexAttention backward on CPU
        (True, CUDA, 2, "sdpa"),  # DataParallel cannot split a BlockMask over GPUs
        (False, CUDA, 1, "sdpa"),  # no mask: SDPA's causal flash kernel
    ],
)
def test_auto_attention_is_flex_only_for_a_document_mask_on_one_cuda_device(
    document_mask, device, replicas, expected
):
    args = attention_args("auto", document_mask)
    assert masks.resolve_attention(args, device, replicas) == expected


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_an_explicit_attention_choice_is_kept(attention):
    assert masks.resolve_attention(attention_args(attention), CUDA) == attention


@pytest.mark.parametrize(
    "args, device, replicas, reason",
    [
        (attention_args("flex"), CPU, 1, "needs a CUDA GPU"),
        (attention_args("flex", document_mask=False), CUDA, 1, "--document-mask"),
        (attention_args("flex"), CUDA, 2, "DataParallel"),
    ],
    ids=["on_cpu", "without_document_mask", "under_dataparallel"],
)
def test_flex_attention_where_it_cannot_run_is_refused_with_the_reason(
    args, device, replicas, reason
):
    with pytest.raises(ValueError, match=reason):
        masks.resolve_attention(args, device, replicas)


# -------------------------------------------------------------------------------------------------
# --micro-batch-size auto: the search, on an injected memory model


class Probe:
    """peak_bytes(n) for the search: records the sizes probed; `oom_from` raises no error but
    reports infinity, as auto_micro_batch_size does for torch.OutOfMemoryError."""

    def __init__(self, base: float, per_sequence: float, oom_from: int | None = None):
        self.base, self.per_sequence, self.oom_from = base, per_sequence, oom_from
        self.probed: list[int] = []

    def __call__(self, n: int) -> float:
        self.probed.append(n)
        if self.oom_from is not None and n >= self.oom_from:
            return float("inf")
        return self.base + self.per_sequence * n


def test_the_search_takes_the_largest_divisor_of_the_per_device_batch_that_fits():
    probe = Probe(base=0, per_sequence=1)
    best, peaks = auto_batch.search_micro_batch_size(12, probe, budget=6.5)
    assert best == 6
    assert probe.probed == [1, 2, 3, 4, 6]  # divisors only, small to large; 12 predicted 12 > 6.5
    assert peaks == {1: 1, 2: 2, 3: 3, 4: 4, 6: 6}


def test_the_whole_per_device_batch_is_chosen_when_it_fits():
    best, _ = auto_batch.search_micro_batch_size(8, Probe(base=10, per_sequence=1), budget=100)
    assert best == 8  # then accumulation is 1


def test_running_out_of_memory_ends_the_search_at_the_size_before():
    probe = Probe(base=0, per_sequence=1, oom_from=4)
    best, peaks = auto_batch.search_micro_batch_size(16, probe, budget=100)
    assert best == 2
    assert probe.probed == [1, 2, 4]
    assert peaks[4] == float("inf")


def test_a_size_over_budget_ends_the_search_although_a_larger_one_might_measure_less():
    # Memory is taken to grow with the micro-batch: the first size over budget is the last tried.
    peaks_by_size = {1: 10, 2: 20, 3: 200, 6: 30}
    probed = []
    best, _ = auto_batch.search_micro_batch_size(
        6, lambda n: probed.append(n) or peaks_by_size[n], budget=100
    )
    assert (best, probed) == (2, [1, 2, 3])


def test_a_size_predicted_over_budget_from_the_last_two_probes_is_never_probed():
    probe = Probe(base=10, per_sequence=10)  # 1: 20, 2: 30, 4: 50, 8: 90, 16 would be 170
    best, _ = auto_batch.search_micro_batch_size(16, probe, budget=95)
    assert best == 8
    assert probe.probed == [1, 2, 4, 8]


def test_a_size_the_run_cannot_take_is_neither_probed_nor_predicted_from():
    # (train_pp.py: a size whose count of micro-batches the schedule refuses.) 4 is passed over;
    # 6 is predicted from 2 and 3 (6 <= 6.5), probed, and chosen.
    probe = Probe(base=0, per_sequence=1)
    asked = []
    allowed = lambda n: asked.append(n) or n != 4
    best, peaks = auto_batch.search_micro_batch_size(12, probe, 6.5, allowed=allowed)
    assert (best, probe.probed, list(peaks)) == (6, [1, 2, 3, 6], [1, 2, 3, 6])
    assert asked == [1, 2, 3, 4, 6, 12]  # each as the search reached it; 12 predicted over


def test_the_search_finds_nothing_when_one_sequence_does_not_fit():
    probe = Probe(base=50, per_sequence=10)
    assert auto_batch.search_micro_batch_size(4, probe, budget=55) == (None, {1: 60})


class Tiny(torch.nn.Module):
    """A small Llama whose "GPU memory" peak is 100 + 100 per sequence of its last forward, and
    which runs out of memory from `oom_from` sequences on."""

    def __init__(self, oom_from: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaForPretraining(LlamaConfig.from_preset("tiny", vocab_size=97))
        self.oom_from, self.peak, self.batches = oom_from, 0, []

    def forward(self, x, y, attn_mask=None):
        self.batches.append(tuple(x.shape))
        if self.oom_from is not None and x.size(0) >= self.oom_from:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        self.peak = 100 + 100 * x.size(0)
        return self.model(x, y, attn_mask)


@pytest.fixture
def simulated_gpu(monkeypatch):
    """auto_micro_batch_size on the CPU, with torch.cuda's memory counters answered by Tiny."""

    def run(model: Tiny, total_memory: int, batch_size: int = 8, devices: int = 1):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device: SimpleNamespace(total_memory=total_memory))  # fmt: skip
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: model.peak)
        argv = f"--batch-size {batch_size} --seq-length 16 --micro-batch-size auto".split()
        args = flags.build_parser("test").parse_args(argv)
        plan = flags.RunSettings(
            model="tiny", tokenizer=None, devices=devices, micro_batch_size=None,
            accumulation=1, precision="fp32", attention="sdpa", grad_clip=1.0,
        )  # fmt: skip
        optimizer = training.build_optimizer(model, args, "cpu")
        rng = torch.get_rng_state()
        plan = auto_batch.auto_micro_batch_size(
            args, plan, model, lambda x: None, optimizer, 97, torch.device("cpu")
        )
        assert torch.equal(torch.get_rng_state(), rng), "the probes changed training's RNG"
        assert all(p.grad is None for p in model.parameters()), "a probe's gradient was left"
        return plan.micro_batch_size, plan.accumulation

    return run


def test_auto_sets_the_largest_fitting_micro_batch_and_the_accumulation(simulated_gpu, capsys):
    model = Tiny()
    # budget 0.9 * 700 = 630: 1 -> 200, 2 -> 300, 4 -> 500 fit; 8 (predicted 900) is not tried
    assert simulated_gpu(model, total_memory=700) == (4, 2)
    assert model.batches == [(1, 16), (2, 16), (4, 16)]  # (n, --seq-length) random tokens
    assert "micro-batch size auto: 4" in capsys.readouterr().out


def test_auto_stops_at_an_out_of_memory_error_and_frees_its_gradients(simulated_gpu):
    assert simulated_gpu(Tiny(oom_from=4), total_memory=10_000) == (2, 4)


def test_auto_probes_each_devices_share_of_the_batch(simulated_gpu):
    model = Tiny()
    assert simulated_gpu(model, total_memory=10_000, batch_size=8, devices=4) == (2, 1)
    assert model.batches == [(1, 16), (2, 16)]


def test_auto_refuses_a_gpu_where_not_one_sequence_fits(simulated_gpu):
    with pytest.raises(ValueError, match="not even 1 sequence of 16 tokens fits"):
        simulated_gpu(Tiny(), total_memory=150)


def test_the_plan_leaves_auto_to_be_measured_but_checks_the_devices_divide_the_batch(
    monkeypatch,
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    parser = flags.build_parser("test")
    argv = ["--batch-size", "12", "--micro-batch-size", "auto"]
    args = parser.parse_args(argv)
    plan = flags.run_settings(parser, args, 4, CPU)
    assert (plan.micro_batch_size, plan.accumulation) == (None, 1)  # until measured
    assert args.micro_batch_size == "auto"
    with pytest.raises(ValueError, match="--batch-size 12 must be a multiple"):
        flags.run_settings(parser, parser.parse_args(argv), 5, CPU)


def test_micro_batch_size_takes_a_number_or_auto_and_nothing_else():
    parser = flags.build_parser("test")
    assert parser.parse_args(["--micro-batch-size", "4"]).micro_batch_size == 4
    assert parser.parse_args(["--micro-batch-size", "auto"]).micro_batch_size == "auto"
    for bad in ["max", "0", "-1", "1.5", ""]:
        with pytest.raises(ValueError, match=f"expected a positive integer or 'auto', got '{bad}'"):
            parser.parse_args(["--micro-batch-size", bad])


# -------------------------------------------------------------------------------------------------
# On CPU: refused as usage errors, before anything is written


@pytest.mark.parametrize(
    "script, flags, message",
    [
        (DP, ["--micro-batch-size", "auto"], "--micro-batch-size auto measures GPU memory"),
        ("train_fsdp.py", ["--micro-batch-size", "auto"], "--micro-batch-size auto measures GPU"),
        ("train_pp.py", ["--micro-batch-size", "auto"], "--micro-batch-size auto measures GPU"),
        (DDP, ["--document-mask", "--attention", "flex"], "--attention flex needs a CUDA GPU"),
    ],
    ids=["auto_dp", "auto_fsdp", "auto_pp", "flex_ddp"],
)
def test_gpu_only_choices_on_cpu_exit_with_a_usage_error(corpus, cache_dir, tmp_path, script,
                                                         flags, message):  # fmt: skip
    proc = run_script(script, cmd(corpus, cache_dir, tmp_path / "out") + flags, expect_rc=2)
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()


# -------------------------------------------------------------------------------------------------
# tools/profile_step.py: the reference it times our step against is the same model


@pytest.mark.parametrize("tie", [False, True])
def test_profile_step_reference_computes_our_models_loss_and_gradients(tie):
    config = LlamaConfig.from_preset("tiny", vocab_size=300, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = LlamaForPretraining(config)
    params = profile_step.reference_params(model)
    tokens = torch.randint(300, (2, 33), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    ours, _ = model(x, y)
    cos, sin = profile_step.reference_rope_tables(config, 32, "cpu")
    reference = profile_step.reference_loss(params, x, y, config, cos, sin)
    torch.testing.assert_close(reference, ours, rtol=1e-6, atol=0)
    ours.backward()
    reference.backward()
    wq_wk_wv = params["layers"][0]["wqkv"].grad.split([192, 64, 64])  # 6 and 2 heads of 32
    for got, projection in zip(wq_wk_wv, ("wq", "wk", "wv"), strict=True):
        want = getattr(model.layers[0].attention, projection).weight.grad
        # fp32 sums in another order (one matmul instead of three): 1e-4 of the largest entry.
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())


def test_profile_step_reference_computes_a_mixture_of_experts_loss_and_gradients():
    # The balance loss given weight (0.5, not 0.001) so that a reference without it would show.
    config = LlamaConfig.from_preset("tiny", vocab_size=300, num_local_experts=4,
                                     router_aux_loss_coef=0.5)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForPretraining(config)
    params = profile_step.reference_params(model)
    tokens = torch.randint(300, (2, 33), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    ours, _ = model(x, y)
    cos, sin = profile_step.reference_rope_tables(config, 32, "cpu")
    reference = profile_step.reference_loss(params, x, y, config, cos, sin)
    torch.testing.assert_close(reference, ours, rtol=1e-6, atol=0)
    ours.backward()
    reference.backward()
    moe, layer = model.layers[0].feed_forward, params["layers"][0]
    w1, w3 = layer["w13"].grad.chunk(2, dim=1)  # (E, ffn, d) each
    for got, want in [(layer["gate"].grad, moe.gate.weight.grad), (w1, moe.w1.grad),
                      (w3, moe.w3.grad), (layer["w2"].grad, moe.w2.grad)]:  # fmt: skip
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())


def test_profile_step_prints_the_profile_and_both_step_times():
    argv = "--seq-length 16 --batch-size 4 --micro-batch-size 2 --warmup 1 --rounds 1 --steps 1"
    argv = argv.split() + ["--profile-steps", "1", "--rows", "5"]
    out = run_script("tools/profile_step.py", argv).stdout
    assert "aten::mm" in out  # the profiler's table
    assert "ours" in out and "reference" in out and "x reference" in out, out


def test_profile_step_profiles_a_mixture_of_experts():
    # --num-experts crashed building the reference ('Parameter' object has no attribute 'weight').
    argv = "--num-experts 4 --num-layers 1 --seq-length 8 --batch-size 2 --warmup 1 --rounds 1"
    argv = argv.split() + ["--steps", "1", "--profile-steps", "1", "--rows", "5"]
    out = run_script("tools/profile_step.py", argv).stdout
    assert "aten::mm" in out  # the profiler's table
    assert "ours" in out and "reference" in out and "x reference" in out, out


def test_profile_step_given_a_model_too_big_for_memory_says_so_in_one_line():
    # 2**40 x 2**16 fp32 embedding weights: 2**58 bytes, more than any 64-bit address space.
    argv = "--vocab-size 1099511627776 --hidden-size 65536 --num-heads 512 --num-kv-heads 512"
    proc = run_script("tools/profile_step.py", argv.split() + ["--num-layers", "1"], expect_rc=1)
    assert proc.stderr == (f"error: out of memory: you tried to allocate {2**58} bytes (a smaller "
                           f"--micro-batch-size or model needs less)\n")  # fmt: skip


def test_profile_step_refuses_more_threads_than_cores(monkeypatch, capsys):
    # 100000 threads crashed OpenMP (a segfault); more than the cores only times the waiting.
    cores = os.cpu_count() or 1
    monkeypatch.setattr(sys, "argv", ["tools/profile_step.py", "--threads", str(cores + 1)])
    with pytest.raises(SystemExit) as stopped:
        exits.run(profile_step.main)  # as its __main__ does
    assert stopped.value.code == 2
    assert f"argument --threads: expected an integer in [1, {cores}]" in capsys.readouterr().err


def test_profile_step_refuses_compile_without_a_cpp_compiler(tmp_path, monkeypatch, capsys):
    # As train_dp.py does (speed.compiler_missing): before the model is built, not in its
    # first step.
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(sys, "argv", ["tools/profile_step.py", "--compile"])
    with pytest.raises(SystemExit) as stopped:
        exits.run(profile_step.main)
    assert stopped.value.code == 2
    assert "--compile on a CPU needs a C++ compiler" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------------
# --micro-batch-size auto under torchrun: every rank agrees before any runs a size


def test_a_size_is_reserved_before_it_is_probed_and_the_reservation_predicted():
    reserved = []

    def reserve(n, predicted):
        reserved.append((n, predicted))
        return True

    probe = Probe(base=10, per_sequence=10)  # 1: 20, 2: 30, 4: 50
    best, _ = auto_batch.search_micro_batch_size(4, probe, 100, reserve, baseline=10)
    assert best == 4 and probe.probed == [1, 2, 4]
    # None for one sequence; 2 from 1's probe and the baseline; 4 from the last two probes.
    assert reserved == [(2, 30), (4, 50)]


def test_a_size_one_rank_cannot_reserve_is_run_by_no_rank_and_both_choose_the_same():
    # tests/agree_on_a_size.py: rank 1 cannot reserve 4 sequences; under 2 gloo ranks.
    proc = run_script("tests/agree_on_a_size.py", [], world=2, env={"PYTHONPATH": str(REPO)})
    lines = sorted(re.findall(r"rank \d: best \w+, probed \[[^]]*\], peaks \{[^}]*\}", proc.stdout))
    peaks = "{1: 20.0, 2: 30.0, 4: None}"
    assert lines == [f"rank {r}: best 2, probed [1, 2], peaks {peaks}" for r in (0, 1)], lines


# -------------------------------------------------------------------------------------------------
# --micro-batch-size auto in train_pp.py: each size probed through the pipeline's own schedule,
# on 2 gloo ranks whose GPU memory counters tests/pipeline_auto.py simulates (rank 1 needs 1000 +
# 200 bytes per sequence of a micro-batch, rank 0 1000 + 100; the budget is 0.9 of the memory).


@pytest.fixture(scope="module")
def pipeline_auto() -> tuple[str, dict]:
    """(stdout, {(case, rank): what the rank found}) of tests/pipeline_auto.py's cases."""
    proc = run_script("tests/pipeline_auto.py", [], world=2, env={"PYTHONPATH": str(REPO)})
    found = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.stdout, {(r["case"], r["rank"]): r for r in found}


def pipeline_choice(found: dict, case: str) -> tuple:
    """(size, micro-batches, sizes probed) of a case, the same on both ranks."""
    ranks = (found[case, 0], found[case, 1])
    choices = {(r["chose"], r["accumulation"], tuple(r["probed"])) for r in ranks}
    assert len(choices) == 1, f"the ranks chose differently: {choices}"
    return choices.pop()


def test_pipeline_auto_takes_the_largest_size_that_fits_on_every_rank(pipeline_auto):
    # 16 sequences per step: 4 (rank 1: 1800 <= 2000) fits every rank; 8 fits rank 0 alone
    # (1800) but not rank 1 (2600, predicted from 2 and 4: so not even probed).
    _, found = pipeline_auto
    assert pipeline_choice(found, "1f1b 16 2223") == (4, 4, (1, 2, 4))


def test_pipeline_auto_never_probes_a_size_whose_micro_batches_the_schedule_refuses(pipeline_auto):
    # All fit; 16 sequences in 1 micro-batch would too, but 1f1b needs m >= pp = 2 micro-batches.
    stdout, found = pipeline_auto
    assert pipeline_choice(found, "1f1b 16 1000000") == (8, 2, (1, 2, 4, 8))
    why = "16: 1f1b needs at least as many micro-batches as stages: 1 < 2"
    assert "micro-batch size auto: 8 (" in stdout and why in stdout, stdout
    # Interleaved 1F1B runs its micro-batches in rounds of m // pp: 2 sequences make 5
    # micro-batches, not a multiple of 2 rounds; 10 (1 micro-batch) it takes.
    assert pipeline_choice(found, "interleaved 10 1000000") == (10, 1, (1, 5, 10))
    assert "2: interleaved needs the micro-batches (5) to be a multiple of 2" in stdout, stdout


def test_pipeline_probes_leave_training_as_it_was(pipeline_auto):
    # No RNG drawn, no gradient left, no weight changed; then a step of the schedule built for
    # the size chosen gives bit for bit the loss and gradients of a pipeline that never probed.
    _, found = pipeline_auto
    assert len(found) == 6  # 3 cases x 2 ranks
    for (case, rank), r in found.items():
        assert r["layout"] == [r["accumulation"], r["chose"]], (case, rank)  # the start-up line
        assert r["rng_kept"] and r["weights_kept"] and r["grads_left"] == 0, (case, rank, r)
        assert r["same_loss"] and r["same_grads"] and r["grads_compared"] > 0, (case, rank, r)


def test_train_pp_with_auto_trains_as_with_the_size_it_chose(
    shared_run, corpus, cache_dir, tmp_path
):
    # train_pp.py itself on the simulated GPU (budget 1500: rank 1 fits 2 sequences, 1400), then
    # the run given --micro-batch-size 2 by hand (tests/test_pp.py's gpipe layout): the same
    # losses, gradient norms, validation losses and final weights, bit for bit.
    gpipe, out = ["--pp", "2", "--schedule", "gpipe"], tmp_path / "auto"
    argv = ["--lesson", "1667", *cmd(corpus, cache_dir, out), *gpipe, "--micro-batch-size", "auto"]
    proc = run_script("tests/pipeline_auto.py", argv, world=2, env={"PYTHONPATH": str(REPO)})
    assert "micro-batch size auto: 2 (" in proc.stdout, proc.stdout
    assert "m = 4 micro-batches of 2 sequences per pipeline" in proc.stdout, proc.stdout
    by_hand = lambda out: cmd(corpus, cache_dir, out) + [*gpipe, "--micro-batch-size", "2"]
    expected, _ = shared_run("train_pp.py", by_hand, 2)
    (train, evals), (want_train, want_evals) = read_metrics(out), read_metrics(expected)
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in train] == [r[key] for r in want_train], key
    assert [r["val_loss"] for r in evals] == [r["val_loss"] for r in want_evals]
    assert len(train) == 8 and len(evals) == 2
    assert_state_dicts_equal(load_weights(out), load_weights(expected))
