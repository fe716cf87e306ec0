"""Specification of train_dp.py and train_ddp.py: both scripts train the same model the same way.

Every test here drives the scripts exactly as a user does, from the command line, on a tiny
corpus written by a fixture (no network), with the `tiny` model, 32-token sequences and a global
batch of 8. What they hold (DESIGN.md, "Invariants that tests hold"):

  - DDP on 2 gloo ranks == one process on the same global batch, in pack and in pad mode;
  - train_dp.py == a plain training loop written out below; gradient accumulation == one big batch;
  - a resumed run == the uninterrupted run, bit for bit; checkpoints load across the two scripts;
  - only global rank 0 writes files; bad arguments fail clearly and touch nothing.

Launches are the slow part (~4 s for one process, ~11 s for 2 ranks, mostly imports), so the
runs that several tests compare against are made once per session (`trained`) and shared; tests
copy an output directory before changing anything in it.

Tolerances (fp32 on CPU, OMP_NUM_THREADS=1 in every launched process): different ways of
splitting one batch (2 ranks, micro-batches) add the same numbers in a different order, ~1e-7
relative per gradient element. AdamW divides each update by the gradient's running RMS, so after 8
steps at lr 1e-3 the weights differ by at most a few 1e-6 (measured max 6e-6 over these configs);
ATOL/RTOL below leave a margin of 3-4x over that and are still 50x below one early update
(~lr = 1e-3), so a gradient pointing anywhere else fails them. Resuming replays the
identical operations, so there the comparison is torch.equal.
"""

import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

import common
from model import IGNORE_INDEX, LlamaConfig, LlamaForPretraining

REPO = Path(__file__).resolve().parents[1]

DP, DDP = "train_dp.py", "train_ddp.py"

# The weights of two runs that split the same global batch differently (see the module docstring).
ATOL, RTOL = 2e-5, 1e-4
# Logged losses are means over ~250 targets of the same batch: they agree far more closely
# (measured: 9e-7 relative). The logged pre-clip gradient norm is checked too (measured: 6e-6),
# because the weights cannot show a gradient that is off by a constant factor: clipping (the
# norms here are ~5 > --grad-clip 1) and AdamW both cancel a uniform scale.
LOSS_RTOL, GRAD_NORM_RTOL = 1e-5, 1e-4

LAUNCH_TIMEOUT = 300  # seconds; a hung collective fails the test instead of the whole CI job

# The settings every run shares unless a test overrides one. 8 steps, a checkpoint every 4 (all
# kept), an evaluation every 4 on one global batch of validation data. val_fraction 0.125 of the
# 32 documents leaves 4 for validation (an even count: see test_ddp_validation_loss_counts_...)
# and 28 for training: in pad mode (one document per row) that is 3 steps per epoch, so 8 steps
# cross two epoch boundaries and a resume from step 4 lands mid-epoch.
BASE = {
    "model": "tiny",
    "seq_length": 32,
    "batch_size": 8,
    "vocab_size": 320,
    "max_steps": 8,
    "lr": 1e-3,
    "warmup_steps": 2,
    "seed": 1234,
    "val_fraction": 0.125,
    "log_interval": 1,
    "eval_interval": 4,
    "eval_batches": 1,
    "save_interval": 4,
    "keep_checkpoints": 5,
    "num_workers": 0,
    "sample_tokens": 0,
    "data_mode": "pack",
}
NUM_DOCS = 32


# -------------------------------------------------------------------------------------------------
# Helpers: write a corpus, run a script, read its outputs, compare weights


def write_corpus(root: Path, num_docs: int = NUM_DOCS) -> Path:
    """Deterministic pseudo-English and pseudo-Python documents of very different lengths.

    About a quarter are one or two short lines (fewer than 32 tokens), so pad mode really pads
    and the number of targets differs between rows, micro-batches and ranks.
    """
    rng = random.Random(0)
    words = (
        "the a model data train loss step rank batch token layer weight grad sum mean over "
        "under with from into of and or not if then else return value index shard epoch"
    ).split()
    root.mkdir(parents=True, exist_ok=True)
    for i in range(num_docs):
        lines = []
        for _ in range(rng.randint(1, 2) if i % 4 == 1 else rng.randint(15, 60)):
            if rng.random() < 0.5:
                sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
                lines.append(sentence.capitalize() + ".")
            else:
                name, k = f"{rng.choice(words)}_{rng.randint(0, 99)}", rng.randint(0, 9)
                lines.append(f"def {name}(x, y):\n    return x * {k} + y")
        (root / f"doc_{i:02d}.txt").write_text("\n".join(lines) + "\n")
    return root


def cli(data_dir: Path, cache_dir: Path, out_dir, **overrides) -> list[str]:
    """The command-line arguments for BASE updated with `overrides` (None drops a flag)."""
    settings = {**BASE, **overrides}
    argv = ["--data", str(data_dir), "--cache-dir", str(cache_dir), "--out-dir", str(out_dir)]
    for name, value in settings.items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def launch_env(**extra) -> dict:
    # One thread per process: 2 ranks on 2 cores do not oversubscribe them, and every run
    # (1 or 2 processes) computes with the same threading, hence the same kernels.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):  # fmt: skip
        env.pop(name, None)  # never inherit a launcher's rendezvous
    env.update(extra)
    return env


def run_script(
    script: str, argv: list[str], world: int = 1, expect_rc: int | None = 0
) -> subprocess.CompletedProcess:
    """Run `script` as a user would: `python script` for world 1, torchrun for more ranks.

    Asserts the exit code (unless expect_rc is None) and shows the run's output if it differs.
    """
    if world == 1:
        cmd = [sys.executable, str(REPO / script), *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={world}", str(REPO / script), *argv]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT
    )
    if expect_rc is not None:
        assert proc.returncode == expect_rc, describe(proc, f"expected exit code {expect_rc}")
    return proc


def describe(proc: subprocess.CompletedProcess, what: str) -> str:
    cmd = " ".join(str(part) for part in proc.args)
    return (
        f"{what}, got {proc.returncode} from: {cmd}\n"
        f"--- stdout (tail) ---\n{proc.stdout[-4000:]}\n"
        f"--- stderr (tail) ---\n{proc.stderr[-6000:]}"
    )


def load_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(out_dir / "model.pt", map_location="cpu", weights_only=True)


def load_checkpoint(out_dir: Path, step: int) -> dict:
    path = out_dir / "checkpoints" / f"step_{step:07d}.pt"
    return torch.load(path, map_location="cpu", weights_only=True)


def read_metrics(out_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of metrics.jsonl, in file order."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]


def assert_state_dicts_close(actual: dict, expected: dict, atol=ATOL, rtol=RTOL) -> None:
    assert actual.keys() == expected.keys()
    worst = max((actual[k] - expected[k]).abs().max().item() for k in expected)
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], atol=atol, rtol=rtol,
            msg=lambda m, name=name: f"{name}: {m} (largest difference of any tensor: {worst:.2e})",
        )  # fmt: skip


def assert_state_dicts_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    differ = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not differ, f"not bit-identical: {differ}"


def flatten(obj, prefix: str = "") -> dict:
    """Nested dicts/lists (an optimizer or scheduler state) as {path: leaf}."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return {prefix: obj}
    return {k: v for key, value in items for k, v in flatten(value, f"{prefix}/{key}").items()}


def assert_same_losses(actual_dir: Path, expected_dir: Path) -> None:
    """The same logged steps, with equal train/val losses and gradient norms (within rtol)."""
    (train_a, eval_a), (train_e, eval_e) = read_metrics(actual_dir), read_metrics(expected_dir)
    assert [r["step"] for r in train_a] == [r["step"] for r in train_e]
    assert [r["step"] for r in eval_a] == [r["step"] for r in eval_e]
    for key, a, e, rtol in [
        ("loss", train_a, train_e, LOSS_RTOL),
        ("grad_norm", train_a, train_e, GRAD_NORM_RTOL),
        ("val_loss", eval_a, eval_e, LOSS_RTOL),
    ]:
        got, want = [r[key] for r in a], [r[key] for r in e]
        assert got == pytest.approx(want, rel=rtol), f"{key}: {got} != {want}"


def build_args(data_dir: Path, cache_dir: Path, devices: int = 1, **overrides):
    """The scripts' own argument namespace for these settings, checked as they check it."""
    parser = common.build_parser("test")
    args = parser.parse_args(cli(data_dir, cache_dir, "unused", **overrides))
    common.check_args(parser, args, devices)
    return args


def copy_checkpoint(src_dir: Path, step: int, dst_dir: Path) -> Path:
    """Copy one checkpoint into dst_dir/checkpoints/, as if a run there had stopped after it."""
    name = f"step_{step:07d}.pt"
    (dst_dir / "checkpoints").mkdir(parents=True)
    return Path(shutil.copy(src_dir / "checkpoints" / name, dst_dir / "checkpoints" / name))


def snapshot(root: Path) -> dict[str, bytes]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -------------------------------------------------------------------------------------------------
# Session fixtures: one corpus, one cache, and the reference runs several tests compare against


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory, corpus) -> Path:
    """The tokenizer and tokenized-data cache, filled once here for both data modes."""
    cache = tmp_path_factory.mktemp("cache")
    for mode in ("pack", "pad"):
        common.build_datasets(build_args(corpus, cache, data_mode=mode))
    return cache


@pytest.fixture(scope="session")
def trained(tmp_path_factory, corpus, cache_dir):
    """trained(script, world=1, **overrides) -> the out-dir of that run, made once per session.

    Callers must not write into the returned directory: copy what they need to change.
    """
    runs: dict[tuple, Path] = {}

    def get(script: str, world: int = 1, **overrides) -> Path:
        key = (script, world, tuple(sorted(overrides.items())))
        if key not in runs:
            out = tmp_path_factory.mktemp(f"{Path(script).stem}_w{world}")
            run_script(script, cli(corpus, cache_dir, out, **overrides), world)
            runs[key] = out
        return runs[key]

    return get


# -------------------------------------------------------------------------------------------------
# DDP == one process


def test_ddp_two_ranks_matches_single_process_pack_mode(trained):
    ddp, dp = trained(DDP, world=2), trained(DP)
    assert_state_dicts_close(load_weights(ddp), load_weights(dp))
    assert_same_losses(ddp, dp)


def test_ddp_two_ranks_matches_single_process_pad_mode(trained, corpus, cache_dir):
    # Precondition: padding makes the ranks' halves of a global batch hold different numbers of
    # targets, so a per-rank mean (or a plain DDP average of per-rank means) would weigh tokens
    # unequally; only normalising by the global token count gives one process's gradient.
    args = build_args(corpus, cache_dir, data_mode="pad")
    train, _, _ = common.build_datasets(args)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))
    first_batch = order[: args.batch_size].tolist()
    targets = [(train[i][1] != IGNORE_INDEX).sum().item() for i in first_batch]
    rank0, rank1 = sum(targets[0::2]), sum(targets[1::2])  # DistributedSampler's interleaving
    assert rank0 != rank1, "the corpus must make ranks see different token counts in pad mode"

    ddp, dp = trained(DDP, world=2, data_mode="pad"), trained(DP, data_mode="pad")
    assert_state_dicts_close(load_weights(ddp), load_weights(dp))
    assert_same_losses(ddp, dp)


def test_ddp_validation_loss_counts_every_validation_sample(trained):
    # 3 validation documents (pad mode: 3 rows) for 2 ranks. train_dp.py evaluates all 3; DDP
    # must too, however it splits them, or its val_loss is that of a different data set.
    # val_fraction 3/32 -> round(3.0) = 3 of the 32 documents; one step is enough.
    overrides = {"data_mode": "pad", "val_fraction": 3 / NUM_DOCS, "max_steps": 1}
    ddp, dp = trained(DDP, world=2, **overrides), trained(DP, **overrides)
    (_, ddp_evals), (_, dp_evals) = read_metrics(ddp), read_metrics(dp)
    assert ddp_evals[0]["val_loss"] == pytest.approx(dp_evals[0]["val_loss"], rel=LOSS_RTOL), (
        "train_ddp.py's validation loss differs from train_dp.py's on the same validation set: "
        "DistributedSampler(drop_last=True) drops samples when the set does not divide by the "
        "world size"
    )


# -------------------------------------------------------------------------------------------------
# train_dp.py == a plain loop; accumulation == one big batch


def plain_training_loop(args) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The textbook single-process loop on the same data, order, optimizer and schedule."""
    train, _, tokenizer = common.build_datasets(args)
    torch.manual_seed(args.seed)
    model = LlamaForPretraining(
        LlamaConfig.from_preset(args.model, vocab_size=tokenizer.get_vocab_size())
    )
    optimizer = common.build_optimizer(model, args, "cpu")
    scheduler = common.build_scheduler(optimizer, args)
    steps_per_epoch = len(train) // args.batch_size
    losses = []
    for step in range(args.max_steps):
        epoch, i = divmod(step, steps_per_epoch)
        generator = torch.Generator().manual_seed(args.seed + epoch)  # as train_dp.py's
        order = torch.randperm(len(train), generator=generator)
        rows = [train[j] for j in order[i * args.batch_size : (i + 1) * args.batch_size].tolist()]
        x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])  # (B, T)
        loss_sum, num_tokens = model(x, y)
        loss = loss_sum / num_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return model.state_dict(), losses


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_dataparallel_path_matches_plain_training_loop(trained, corpus, cache_dir, mode):
    # On CPU, nn.DataParallel just calls its module: train_dp.py must then be this plain loop.
    # The loop runs in this process (torch's default thread count), the script with one thread,
    # so matmuls may block differently: ATOL/RTOL, not equality (measured: identical here).
    weights, losses = plain_training_loop(build_args(corpus, cache_dir, data_mode=mode))
    out = trained(DP, data_mode=mode)
    assert_state_dicts_close(load_weights(out), weights)
    logged = [r["loss"] for r in read_metrics(out)[0]]
    assert logged == pytest.approx(losses, rel=LOSS_RTOL)


@pytest.mark.parametrize(
    "script, world, micro_batch, one_batch",
    [
        (DP, 1, 2, 8),  # 4 micro-batches of 2 rows vs one forward of 8
        (DDP, 2, 1, 4),  # per rank: 4 micro-batches of 1 (no_sync on 3 of them) vs one of 4
    ],
)
def test_gradient_accumulation_matches_one_big_batch(
    trained, script, world, micro_batch, one_batch
):
    # Pad mode: the micro-batches hold different numbers of targets, so this also proves that
    # each is normalised by the whole global batch's count, not its own.
    accumulated = trained(script, world, data_mode="pad", micro_batch_size=micro_batch)
    big = trained(script, world, data_mode="pad", micro_batch_size=one_batch)
    assert_state_dicts_close(load_weights(accumulated), load_weights(big))
    assert_same_losses(accumulated, big)


# -------------------------------------------------------------------------------------------------
# Data order


class Indices(torch.utils.data.Dataset):
    """A fake dataset whose item i is i: the batches show which samples were read."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("n", [40, 37])  # divisible by the world size, and not
def test_distributed_sampler_shards_are_disjoint_and_reshuffled_each_epoch(n):
    world, seed, batch_size, epochs = 2, 1234, 8, 3
    dataset, steps_per_epoch = Indices(n), n // batch_size
    samplers = [DistributedSampler(dataset, world, rank, shuffle=True, seed=seed)
                for rank in range(world)]  # fmt: skip

    def ddp_order(rank):  # as train_ddp.py's order_for_epoch
        def order_for_epoch(epoch):
            samplers[rank].set_epoch(epoch)
            return list(samplers[rank])

        return order_for_epoch

    def dp_order(epoch):  # as train_dp.py's order_for_epoch
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()

    used = steps_per_epoch * batch_size // world  # what step_batches reads of each shard
    for epoch in range(epochs):
        shards = [ddp_order(rank)(epoch) for rank in range(world)]
        assert set(shards[0][:used]).isdisjoint(shards[1][:used])
        assert set(shards[0]) | set(shards[1]) == set(range(n))  # every sample has an owner
        if n % world == 0:
            assert set(shards[0]).isdisjoint(shards[1])
    assert ddp_order(0)(0) != ddp_order(0)(1), "set_epoch must reshuffle"
    assert dp_order(0) != dp_order(1)

    # Step s reads samples [s*B, (s+1)*B) of its epoch's shuffle: in train_dp.py's order, and over
    # both ranks together (each with 2 micro-batches of 2), from any start step (a resume), across
    # epoch boundaries.
    for start in (0, steps_per_epoch + 1):
        single = common.step_batches(dataset, dp_order, batch_size, 1, steps_per_epoch, start, 0,
                                     False)  # fmt: skip
        ranks = [common.step_batches(dataset, ddp_order(r), 2, 2, steps_per_epoch, start, 0,
                                     False) for r in range(world)]  # fmt: skip
        for step in range(start, epochs * steps_per_epoch):
            epoch, i = divmod(step, steps_per_epoch)
            expected = dp_order(epoch)[i * batch_size : (i + 1) * batch_size]
            (dp_batch,) = next(single)
            assert dp_batch.tolist() == expected, f"step {step}"
            got = [j for rank in ranks for micro in next(rank) for j in micro.tolist()]
            assert sorted(got) == sorted(expected), f"step {step}"


# -------------------------------------------------------------------------------------------------
# Files: who writes them, resuming from them, loading them


def test_only_rank_zero_writes(tmp_path, corpus, cache_dir):
    # Each rank runs in its own working directory with the same *relative* --out-dir, so any file
    # rank 1 wrote would land in its own directory. --sample-tokens exercises rank 0's generate.
    argv = cli(corpus, cache_dir, "out", max_steps=4, save_interval=2, sample_tokens=8)
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
                  "LOCAL_WORLD_SIZE": "2"}  # fmt: skip
    cwds = [tmp_path / f"rank{rank}" for rank in range(2)]
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]  # files: a full pipe can't block
    procs = []
    for rank, (cwd, log) in enumerate(zip(cwds, logs, strict=True)):
        cwd.mkdir()
        env = launch_env(RANK=str(rank), LOCAL_RANK=str(rank), **rendezvous)
        with open(log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, str(REPO / DDP), *argv], cwd=cwd,
                                          env=env, stdout=f, stderr=subprocess.STDOUT))  # fmt: skip
    try:
        for proc in procs:
            proc.wait(timeout=LAUNCH_TIMEOUT)
    finally:
        for proc in procs:
            proc.kill()  # no-op for a finished process
    outputs = [log.read_text() for log in logs]
    for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{output[-6000:]}"

    out = cwds[0] / "out"
    for name in ("model.pt", "config.json", "tokenizer.json", "metrics.jsonl"):
        assert (out / name).is_file(), name
    assert sorted(os.listdir(out / "checkpoints")) == ["step_0000002.pt", "step_0000004.pt"]
    assert os.listdir(cwds[1]) == [], "rank 1 wrote files"
    assert "sample:" in outputs[0] and "sample:" not in outputs[1]


@pytest.mark.parametrize("script, world", [(DP, 1), (DDP, 2)])
@pytest.mark.parametrize("how", ["auto", "path"])
def test_resume_is_bit_identical(trained, corpus, cache_dir, tmp_path, script, world, how):
    # Pad mode has 3 steps per epoch: the resume from step 4 starts mid-epoch 1 and crosses
    # into epoch 2 at step 6.
    full = trained(script, world, data_mode="pad")
    out = tmp_path / "resumed"
    checkpoint = copy_checkpoint(full, 4, out)
    # As if the first run had been killed after logging step 6: the resumed run must drop the
    # lines after its checkpoint and log steps 5-8 again, once each.
    lines = (full / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(r for r in lines if json.loads(r)["step"] <= 6))
    resume = "auto" if how == "auto" else str(checkpoint)

    proc = run_script(script, cli(corpus, cache_dir, out, data_mode="pad", resume=resume), world)
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout
    assert_state_dicts_equal(load_weights(out), load_weights(full))
    resumed_ckpt, full_ckpt = load_checkpoint(out, 8), load_checkpoint(full, 8)
    for part in ("optimizer", "scheduler"):
        got, want = flatten(resumed_ckpt[part]), flatten(full_ckpt[part])
        assert got.keys() == want.keys()
        for key in want:
            same = torch.equal(got[key], want[key]) if torch.is_tensor(want[key]) else (
                got[key] == want[key])  # fmt: skip
            assert same, f"{part}{key} differs after resuming"

    (train, evals), (full_train, full_evals) = read_metrics(out), read_metrics(full)
    assert [r["step"] for r in train] == list(range(1, 9)), "duplicated or missing train steps"
    assert [r["step"] for r in evals] == [4, 8]
    assert [r["loss"] for r in train] == [r["loss"] for r in full_train]  # exact
    assert [r["val_loss"] for r in evals] == [r["val_loss"] for r in full_evals]


@pytest.mark.parametrize(
    "writer, writer_world, reader, reader_world", [(DP, 1, DDP, 2), (DDP, 2, DP, 1)]
)
def test_checkpoints_cross_load_between_scripts(
    trained, corpus, cache_dir, tmp_path, writer, writer_world, reader, reader_world
):
    written = trained(writer, writer_world)
    checkpoint = copy_checkpoint(written, 4, tmp_path / "resumed")
    out = tmp_path / "resumed"
    run_script(reader, cli(corpus, cache_dir, out, resume=str(checkpoint)), reader_world)
    # Steps 1-4 came from the writer, 5-8 from the reader: the DDP == one process tolerance.
    assert_state_dicts_close(load_weights(out), load_weights(trained(reader, reader_world)))

    # The outputs of both scripts are plain: no wrapper prefixes, loadable safely and strictly.
    for out_dir in (written, out):
        weights = load_weights(out_dir)
        checkpoint_keys = load_checkpoint(out_dir, 8)["model"].keys()
        for key in [*weights, *checkpoint_keys]:
            assert not key.startswith(("module.", "_orig_mod.")) and "._orig_mod." not in key
        config = LlamaConfig(**json.loads((out_dir / "config.json").read_text()))
        LlamaForPretraining(config).load_state_dict(weights, strict=True)


# -------------------------------------------------------------------------------------------------
# Command line


@pytest.mark.parametrize("script", [DP, DDP])
def test_help_lists_the_command_line_contract(script):
    proc = run_script(script, ["--help"])
    flags = ["--data", "--batch-size", "--micro-batch-size", "--resume", "--out-dir"]
    if script == DDP:
        flags.append("--backend")
    missing = [flag for flag in flags if flag not in proc.stdout]
    assert not missing, f"{script} --help lacks {missing}"


# `python train_ddp.py` (no torchrun) is a process group of one: this is its only test.
@pytest.mark.parametrize("script", [DP, DDP])
def test_short_run_writes_outputs_and_loss_falls(corpus, cache_dir, tmp_path, script):
    out = tmp_path / "out"
    argv = cli(corpus, cache_dir, out, max_steps=20, lr=3e-3, warmup_steps=5, eval_interval=10,
               save_interval=10, sample_tokens=16)  # fmt: skip
    proc = run_script(script, argv)
    for name in ("model.pt", "config.json", "tokenizer.json", "metrics.jsonl"):
        assert (out / name).is_file(), name
    assert sorted(os.listdir(out / "checkpoints")) == ["step_0000010.pt", "step_0000020.pt"]
    assert "sample:" in proc.stdout

    train, evals = read_metrics(out)
    assert [r["step"] for r in train] == list(range(1, 21))
    assert {"step", "loss", "lr", "tokens_per_sec", "grad_norm"} <= train[0].keys()
    assert [r["step"] for r in evals] == [10, 20]
    for r in evals:
        assert math.isfinite(r["val_loss"])
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))
    # From ~ln(320) = 5.8 at the start; on this repetitive corpus the tiny model's last five
    # losses average ~2.3 (a 3.5-nat drop), so asking for 2 nats is a wide margin; and the
    # validation loss improves too (3.2 -> 2.4).
    losses = [r["loss"] for r in train]
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0, losses
    assert evals[1]["val_loss"] < evals[0]["val_loss"]


def test_run_ddp_sh_defaults_to_two_cpu_processes_that_train_like_one(
    trained, corpus, cache_dir, tmp_path
):
    # The launcher as a user runs it on a machine without GPUs: no NPROC_PER_NODE, so it must
    # pick 2 processes, meet through c10d on 127.0.0.1 and train exactly like one process.
    out = tmp_path / "out"
    env = launch_env(
        CUDA_VISIBLE_DEVICES="",  # no GPU, even where the test machine has one
        MASTER_PORT=str(free_port()),
        MAX_RESTARTS="0",  # a failure must fail the test, not be retried
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    for name in ("NPROC_PER_NODE", "NNODES", "NODE_RANK"):
        env.pop(name, None)
    proc = subprocess.run(
        ["bash", str(REPO / "run_ddp.sh"), *cli(corpus, cache_dir, out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, describe(proc, "run_ddp.sh failed")
    assert "--nproc-per-node=2" in proc.stderr  # the command, as `set -x` echoes it
    assert_state_dicts_close(load_weights(out), load_weights(trained(DP)))
    assert_same_losses(out, trained(DP))


@pytest.mark.parametrize("script", [DP, DDP])
def test_batch_size_not_divisible_by_micro_batch_exits_with_usage_error(
    corpus, cache_dir, tmp_path, script
):
    argv = cli(corpus, cache_dir, tmp_path / "out", batch_size=10, micro_batch_size=4)
    proc = run_script(script, argv, expect_rc=2)  # argparse's usage-error code
    assert "--batch-size" in proc.stderr and "--micro-batch-size" in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.parametrize("script, world", [(DP, 1), (DDP, 2)])  # DDP: every rank exits, none hangs
def test_resume_never_refuses_an_out_dir_with_checkpoints(
    trained, corpus, cache_dir, tmp_path, script, world
):
    out = tmp_path / "out"
    shutil.copytree(trained(script, world), out)
    before = snapshot(out)
    proc = run_script(script, cli(corpus, cache_dir, out, resume="never"), world, expect_rc=None)
    assert proc.returncode != 0, describe(proc, "expected a non-zero exit code")
    assert "--resume never" in proc.stderr
    assert snapshot(out) == before, "--resume never changed the existing run's files"
