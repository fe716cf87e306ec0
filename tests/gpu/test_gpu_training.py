"""GPU proof of the training scripts: each one trains on one CUDA GPU (NCCL under torchrun), in
bf16 and fp16, with and without --compile, with FlexAttention document masks, --micro-batch-size
auto, activation checkpointing and FSDP CPU offload, and resumes exactly.

Every test here skips where CUDA is absent, so the CPU suite stays green;
`python -m tools.gpu_report` runs them with the benchmarks on a GPU machine (BENCHMARKS.md). The
runs are short (tiny model, 30 steps of 16 x 64 tokens) so the whole file takes minutes, and they
run in parallel (`pytest -n 4`): nothing here times anything, the benchmarks do.

Tolerances, and why:
- fp32 against fp32 (activation checkpointing, CPU offload, FlexAttention, --micro-batch-size
  auto): the same arithmetic in another order or on another device, so per-step losses agree to
  LOSS_RTOL = 1e-4 relative (tests/harness.py's 1e-5 is for 8 steps on the CPU; 30 steps at a
  higher learning rate let AdamW amplify the rounding further). The one exception is TF32,
  which this suite never turns on: a 1e-3 difference would show it.
- bf16 or fp16 autocast against fp32: the matmuls round their inputs to 8 (bf16) or 11 (fp16)
  significant bits, so the logged losses drift apart over the run; the bound is MIXED_RTOL =
  3e-2 relative at every step, an order of magnitude under what a real fault moves (a wrong
  scale, a skipped step, a wrongly masked token changes a loss by far more).
- Resume: the resumed steps log the very losses of the uninterrupted run, and the final
  weights are bit-identical (CUDA's kernels are deterministic for a fixed shape and device).
"""

import re
import shutil
from pathlib import Path

import pytest
import torch
from harness import STREAMING, cmd, load_weights, read_metrics, run_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DP, DDP, ZERO1 = "train_dp.py", "train_ddp.py", "train_zero1.py"
FSDP, TP, PP, CP = "train_fsdp.py", "train_tp.py", "train_pp.py", "train_cp.py"
EP = "train_ep.py"

# 30 steps of 16 sequences x 64 tokens, a checkpoint every 10: long enough that the loss falls
# clearly, short enough for ~20 launches in a few minutes.
GPU = {
    "seq_length": 64,
    "batch_size": 16,
    "max_steps": 30,
    "lr": 3e-3,
    "warmup_steps": 5,
    "eval_interval": 10,
    "save_interval": 10,
    "precision": "fp32",
}
LOSS_RTOL = 1e-4
MIXED_RTOL = 3e-2


@pytest.fixture(scope="session")
def gpu_run(tmp_path_factory, corpus, cache_dir):
    """gpu_run(script, *flags, **overrides) -> the out-dir of that run on GPU 0, made once.

    python for train_dp.py (DataParallel over the one visible GPU), torchrun with one process
    (NCCL) for the others. Callers must not write into the returned directory.
    """
    runs: dict[tuple, Path] = {}

    def get(script: str, *flags: str, **overrides) -> Path:
        key = (script, flags, tuple(sorted(overrides.items())))
        if key not in runs:
            out = tmp_path_factory.mktemp(Path(script).stem)
            argv = cmd(corpus, cache_dir, out, **{**GPU, **overrides}) + list(flags)
            proc = run_script(script, argv, torchrun=script != DP)
            (out / "stdout.txt").write_text(proc.stdout)  # for the tests that read what it said
            runs[key] = out
        return runs[key]

    return get


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)[0]]


def assert_losses_close(actual: Path, expected: Path, rtol: float) -> None:
    got, want = losses(actual), losses(expected)
    assert len(got) == len(want) == GPU["max_steps"]
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert worst <= rtol, f"largest relative loss difference {worst:.2e} > {rtol:.0e}"


def assert_trained(out: Path) -> None:
    """The loss fell, and the logged speed and memory figures are plausible for this GPU."""
    train, evals = read_metrics(out)
    first, last = train[0]["loss"], sum(r["loss"] for r in train[-5:]) / 5
    assert last < 0.8 * first, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    assert [r["step"] for r in evals] == [10, 20, 30]
    total_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    known_peak = any(key in torch.cuda.get_device_name(0) for key in ("H100", "H200", "A100"))
    for record in train[1:]:
        assert 0 < record["peak_memory_gb"] < total_gb, record
        assert record["tokens_per_sec"] > 0, record
        if known_peak:  # a tiny model uses a sliver of the GPU, but never more than all of it
            assert 0 < record["mfu"] < 1, record
    assert (out / "model.pt").is_file() and (out / "config.json").is_file()


# -------------------------------------------------------------------------------------------------
# Every script, one GPU, bf16 (the default on GPUs that have it)

SCRIPTS = [
    (DP, ()),
    (DDP, ()),
    (ZERO1, ()),
    (FSDP, ()),
    (TP, ("--tp", "1")),
    (PP, ("--pp", "1")),
    (CP, ("--cp", "1")),  # a group of one: CP's attention path, flash via causal_lower_right
    (EP, ("--num-experts", "4", "--ep", "1")),  # the dispatch's all-to-alls over NCCL
]  # fmt: skip
SCRIPT_IDS = ["dp", "ddp", "zero1", "fsdp", "tp", "pp", "cp", "ep"]


@pytest.mark.parametrize("script, flags", SCRIPTS, ids=SCRIPT_IDS)
def test_every_script_trains_in_bf16_on_one_gpu(gpu_run, script, flags):
    out = gpu_run(script, *flags, precision="bf16")
    assert_trained(out)
    assert_losses_close(out, gpu_run(script, *flags), MIXED_RTOL)  # bf16 tracks fp32


@pytest.mark.parametrize("script, flags", SCRIPTS, ids=SCRIPT_IDS)
def test_every_script_trains_in_bf16_with_compile(gpu_run, script, flags):
    out = gpu_run(script, *flags, "--compile", precision="bf16")
    assert_trained(out)
    assert_losses_close(out, gpu_run(script, *flags), MIXED_RTOL)


# (train_pp.py: its stages agree on a skipped step through pipeline.unscale_.)
@pytest.mark.parametrize("script, flags", [(DP, ()), (DDP, ()), (PP, ("--pp", "1"))])
def test_fp16_with_the_grad_scaler_trains_and_tracks_fp32(gpu_run, script, flags):
    out = gpu_run(script, *flags, precision="fp16")
    assert_trained(out)
    assert_losses_close(out, gpu_run(script, *flags), MIXED_RTOL)


# -------------------------------------------------------------------------------------------------
# The GPU-only paths, each against the plain fp32 run


def test_flex_attention_document_mask_trains_like_sdpa(gpu_run):
    flex = gpu_run(DDP, "--document-mask", "--attention", "flex")
    assert_trained(flex)
    assert_losses_close(flex, gpu_run(DDP, "--document-mask", "--attention", "sdpa"), LOSS_RTOL)
    # Precondition: the mask changes training (else this test would prove nothing).
    assert losses(flex) != losses(gpu_run(DDP))


def test_activation_checkpointing_gives_the_same_losses(gpu_run):
    out = gpu_run(DDP, "--activation-checkpointing")
    assert_losses_close(out, gpu_run(DDP), LOSS_RTOL)


def test_fsdp_cpu_offload_gives_the_same_losses(gpu_run):
    out = gpu_run(FSDP, "--cpu-offload")
    assert_trained(out)
    assert_losses_close(out, gpu_run(FSDP), LOSS_RTOL)


@pytest.mark.parametrize("script", [DP, DDP, FSDP])
def test_micro_batch_size_auto_measures_a_size_and_trains_like_the_plain_run(gpu_run, script):
    out = gpu_run(script, micro_batch_size="auto")
    assert "micro-batch size auto:" in (out / "stdout.txt").read_text()
    assert_trained(out)
    # Whatever size it chose, accumulation makes up the same global batch: the same losses.
    assert_losses_close(out, gpu_run(script), LOSS_RTOL)


def chosen_size(out: Path) -> str:
    """The micro-batch --micro-batch-size auto chose, as the run said it."""
    said = re.search(r"micro-batch size auto: (\d+) ", (out / "stdout.txt").read_text())
    assert said, "the run did not say which size it chose"
    return said.group(1)


def test_pipeline_micro_batch_size_auto_trains_as_with_the_size_it_chose(gpu_run):
    # One stage on one GPU (--pp 1): each size probed through the schedule itself.
    out = gpu_run(PP, "--pp", "1", micro_batch_size="auto")
    assert_trained(out)
    by_hand = gpu_run(PP, "--pp", "1", micro_batch_size=chosen_size(out))
    assert_losses_close(out, by_hand, LOSS_RTOL)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a pipeline of 2 stages needs 2 GPUs")
def test_pipeline_micro_batch_size_auto_on_two_gpus(corpus, cache_dir, tmp_path):
    # Both stages probe every size together; 1f1b needs 2 micro-batches, so at most 16 / 2.
    runs = {}
    for name, micro in [("auto", "auto"), ("by_hand", None)]:
        out = tmp_path / name
        micro = micro or chosen_size(runs["auto"])
        argv = cmd(corpus, cache_dir, out, **{**GPU, "micro_batch_size": micro}) + ["--pp", "2"]
        (out / "stdout.txt").write_text(run_script(PP, argv, world=2).stdout)
        runs[name] = out
    assert int(chosen_size(runs["auto"])) <= GPU["batch_size"] // 2
    assert_trained(runs["auto"])
    assert_losses_close(runs["auto"], runs["by_hand"], LOSS_RTOL)


# -------------------------------------------------------------------------------------------------
# Resume


def copy_checkpoint(src: Path, step: int, dst: Path) -> None:
    """The one checkpoint of `step` (a .pt file or a DCP directory) into dst/checkpoints/."""
    (dst / "checkpoints").mkdir(parents=True)
    for path in (src / "checkpoints").glob(f"step_{step:07d}*"):
        copy = shutil.copytree if path.is_dir() else shutil.copy
        copy(path, dst / "checkpoints" / path.name)


# --streaming: the data position gathered over NCCL (gather_object) into the checkpoint.
@pytest.mark.parametrize("data", [{}, STREAMING], ids=["cached", "streaming"])
@pytest.mark.parametrize("script", [DDP, FSDP])
def test_resume_on_the_gpu_is_exact(gpu_run, corpus, cache_dir, tmp_path, script, data):
    full = gpu_run(script, precision="bf16", **data)
    out = tmp_path / "resumed"
    copy_checkpoint(full, 10, out)
    argv = cmd(corpus, cache_dir, out, **{**GPU, "precision": "bf16", **data})
    proc = run_script(script, argv, torchrun=True)
    assert "at step 10" in proc.stdout
    want = [r["loss"] for r in read_metrics(full)[0] if r["step"] > 10]
    assert losses(out) == want
    got_weights, want_weights = load_weights(out), load_weights(full)
    differ = [k for k in want_weights if not torch.equal(got_weights[k], want_weights[k])]
    assert not differ, f"not bit-identical after resuming: {differ}"
