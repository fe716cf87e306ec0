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
steps at lr 1e-3 most weights differ by a few 1e-6; single elements of rows few tokens touch (an
embedding row, an expert's matrix), where that RMS is tiny, reach 2.7e-5 (measured max over these
configs, with the seeded per-weight init). ATOL/RTOL below leave a margin of 3-4x over that and
are still 10x below one early update (~lr = 1e-3), so a gradient pointing anywhere else fails
them; the losses, compared at LOSS_RTOL, show any drift the weights' bound could hide. Resuming
replays the identical operations, so there the comparison is torch.equal.
"""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from harness import (
    DDP,
    DP,
    LAUNCH_TIMEOUT,
    LESSONS,
    LOSS_RTOL,
    NUM_DOCS,
    REPO,
    assert_same_losses,
    assert_state_dicts_close,
    assert_state_dicts_equal,
    assert_train_dp_starts_from,
    build_args,
    cmd,
    copy_checkpoint,
    describe,
    flatten,
    free_port,
    launch_env,
    load_checkpoint,
    load_weights,
    read_metrics,
    run_ddp_sh_env,
    run_script,
    snapshot,
)
from torch.utils.data import DistributedSampler

from lib import flags, model_config, training
from model import IGNORE_INDEX, LlamaConfig, LlamaForPretraining

# -------------------------------------------------------------------------------------------------
# DDP == one process


@pytest.mark.one_process
def test_ddp_two_ranks_matches_single_process_pack_mode(trained):
    ddp, dp = trained(DDP, world=2), trained(DP)
    assert_state_dicts_close(load_weights(ddp), load_weights(dp))
    assert_same_losses(ddp, dp)


@pytest.mark.one_process
def test_ddp_two_ranks_matches_single_process_pad_mode(trained, corpus, cache_dir):
    # Precondition: padding makes the ranks' halves of a global batch hold different numbers of
    # targets, so a per-rank mean (or a plain DDP average of per-rank means) would weigh tokens
    # unequally; only normalising by the global token count gives one process's gradient.
    args, plan = build_args(corpus, cache_dir, data_mode="pad")
    train, _, _ = training.build_datasets(args, plan.tokenizer)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))
    first_batch = order[: args.batch_size].tolist()
    targets = [(train[i][1] != IGNORE_INDEX).sum().item() for i in first_batch]
    rank0, rank1 = sum(targets[0::2]), sum(targets[1::2])  # DistributedSampler's interleaving
    assert rank0 != rank1, "the corpus must make ranks see different token counts in pad mode"

    ddp, dp = trained(DDP, world=2, data_mode="pad"), trained(DP, data_mode="pad")
    assert_state_dicts_close(load_weights(ddp), load_weights(dp))
    assert_same_losses(ddp, dp)


@pytest.mark.parametrize(
    "script, micro_batch", [(DDP, None), ("train_fsdp.py", 1)], ids=["ddp", "fsdp-uneven-batches"]
)
def test_validation_loss_counts_every_validation_sample(trained, script, micro_batch):
    # 3 validation documents (pad mode: 3 rows) for 2 ranks. train_dp.py evaluates all 3; the
    # ranks must too, however they split them, or val_loss is that of a different data set.
    # val_fraction 3/32 -> round(3.0) = 3 of the 32 documents; one step is enough. FSDP with
    # micro-batches of 1: 2 validation batches on rank 0 and 1 on rank 1, where every forward is
    # a collective: without the padding batch of training.ValidationShard, rank 0 waits forever.
    overrides = {"data_mode": "pad", "val_fraction": 3 / NUM_DOCS, "max_steps": 1}
    extra = {} if micro_batch is None else {"micro_batch_size": micro_batch}
    run = trained(script, world=2, **overrides, **extra)
    dp = trained(DP, **overrides)
    (_, evals), (_, dp_evals) = read_metrics(run), read_metrics(dp)
    assert evals[0]["val_loss"] == pytest.approx(dp_evals[0]["val_loss"], rel=LOSS_RTOL), (
        f"{script}'s validation loss differs from train_dp.py's on the same validation set: "
        "DistributedSampler(drop_last=True) drops samples when the set does not divide by the "
        "world size"
    )


@pytest.mark.parametrize("size, ranks, rows", [(3, 2, 1), (7, 3, 2), (1, 2, 4), (8, 2, 2)])
def test_validation_shards_cover_the_set_once_in_as_many_batches_on_every_rank(size, ranks, rows):
    samples = [(torch.full((4,), i), torch.full((4,), 100 + i)) for i in range(size)]
    val_set = training.ValidationSet(samples, range(size), torch.ones(100 + size, dtype=torch.long))
    shards = [list(training.ValidationShard(val_set, r, ranks, rows)) for r in range(ranks)]
    assert len({len(batches) for batches in shards}) == 1  # the same count on every rank
    targets = [
        int(row[0]) for batches in shards for _, y in batches for row in y if row[0] != IGNORE_INDEX
    ]
    assert sorted(targets) == [100 + i for i in range(size)]  # each sample once
    for batches in shards:
        for x, y in batches:
            assert x.shape == y.shape == (rows, 4)
            padding = y[:, 0] == IGNORE_INDEX
            assert (y[padding] == IGNORE_INDEX).all() and (x[padding] == 0).all()


# -------------------------------------------------------------------------------------------------
# train_dp.py == a plain loop; accumulation == one big batch


def plain_training_loop(args, plan) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The textbook single-process loop on the same data, order, optimizer and schedule."""
    train, _, tokenizer = training.build_datasets(args, plan.tokenizer)
    config = LlamaConfig.from_preset(plan.model, vocab_size=tokenizer.get_vocab_size())
    model = LlamaForPretraining(config, seed=args.seed)  # each weight seeded by --seed and its name
    optimizer = training.build_optimizer(model, args, "cpu")
    scheduler = training.build_scheduler(optimizer, args)
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


@pytest.mark.one_process
@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_dataparallel_path_matches_plain_training_loop(trained, corpus, cache_dir, mode):
    # On CPU, nn.DataParallel just calls its module: train_dp.py must then be this plain loop.
    # The loop runs in this process (torch's default thread count), the script with one thread,
    # so matmuls may block differently: ATOL/RTOL, not equality (measured: identical here).
    weights, losses = plain_training_loop(*build_args(corpus, cache_dir, data_mode=mode))
    out = trained(DP, data_mode=mode)
    assert_state_dicts_close(load_weights(out), weights)
    logged = [r["loss"] for r in read_metrics(out)[0]]
    assert logged == pytest.approx(losses, rel=LOSS_RTOL)


@pytest.mark.one_process
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


def test_an_epoch_is_the_splits_whole_batches_and_less_than_one_batch_is_refused():
    import argparse

    args = argparse.Namespace(batch_size=8)
    assert training.steps_per_epoch(Indices(17), args) == 2
    with pytest.raises(ValueError, match="--batch-size 8 is more than the 7 sequences"):
        training.steps_per_epoch(Indices(7), args)


@pytest.mark.parametrize("n", [40, 37])  # divisible by the world size, and not
def test_distributed_sampler_shards_are_disjoint_and_reshuffled_each_epoch(n):
    world, seed, batch_size, epochs = 2, 1234, 8, 3
    dataset, steps_per_epoch = Indices(n), n // batch_size
    samplers = [DistributedSampler(dataset, world, rank, shuffle=True, seed=seed)
                for rank in range(world)]  # fmt: skip

    def ddp_order(rank):  # as train_ddp.py's epoch_order
        def epoch_order(epoch):
            samplers[rank].set_epoch(epoch)
            return list(samplers[rank])

        return epoch_order

    def dp_order(epoch):  # as train_dp.py's epoch_order
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
        single = training.batches_from(dataset, dp_order, batch_size, 1, steps_per_epoch, start)
        ranks = [training.batches_from(dataset, ddp_order(r), 2, 2, steps_per_epoch, start)
                 for r in range(world)]  # fmt: skip
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
    argv = cmd(corpus, cache_dir, "out", max_steps=4, save_interval=2, sample_tokens=8)
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
    written = sorted(os.listdir(out / "checkpoints"))  # each with its checksums
    assert written == [f"step_000000{s}.pt{sums}" for s in (2, 4) for sums in ("", ".sums")]
    assert os.listdir(cwds[1]) == [], "rank 1 wrote files"
    assert "sample:" in outputs[0] and "sample:" not in outputs[1]


@pytest.mark.resume
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

    proc = run_script(script, cmd(corpus, cache_dir, out, data_mode="pad", resume=resume), world)
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
    run_script(reader, cmd(corpus, cache_dir, out, resume=str(checkpoint)), reader_world)
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


def test_a_resuming_what_the_data_is_not_how_data_names_it(trained, corpus, tmp_path):
    # --tokenizer: a given tokenizer does not change with the corpus, so only the data's own
    # fingerprint can tell that the documents changed.
    copy, out, cache = tmp_path / "copy", tmp_path / "resumed", tmp_path / "cache"
    shutil.copytree(corpus, copy)
    copy_checkpoint(trained(DP), 4, out)
    tokenizer = ["--tokenizer", str(trained(DP) / "tokenizer.json")]
    # The same documents, elsewhere and spelled otherwise: it resumes, as if never stopped.
    proc = run_script(DP, cmd(f"{copy}//", cache, out) + tokenizer)
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout
    assert_state_dicts_equal(load_weights(out), load_weights(trained(DP)))
    # Two documents swapped (the validation split and the data order change): refused in one
    # line, the checkpoints left as they were.
    first, second = copy / "doc_00.txt", copy / "doc_01.txt"
    texts = first.read_text(), second.read_text()
    first.write_text(texts[1]), second.write_text(texts[0])
    before = snapshot(out)
    proc = run_script(DP, cmd(copy, cache, out, max_steps=12) + tokenizer, expect_rc=2)
    assert f"error: --data {copy} is not the data the checkpoint was trained on" in proc.stderr
    assert proc.stderr.count("error: ") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert snapshot(out) == before


def test_sharded_checkpoints_record_the_data_fingerprint_too(trained, corpus, cache_dir, tmp_path):
    out = tmp_path / "fsdp"
    run_script("train_fsdp.py", cmd(corpus, cache_dir, out, max_steps=4), world=1)
    train_state = torch.load(out / "checkpoints/step_0000004/train_state.pt", weights_only=True)
    assert train_state["corpus_sha256"] == load_checkpoint(trained(DP), 4)["corpus_sha256"]


def test_init_from_starts_training_from_a_finished_runs_model(trained, corpus, cache_dir, tmp_path):
    # The architecture and the tokenizer come from the source run too, not from a preset or a
    # freshly trained tokenizer.
    assert_train_dp_starts_from(trained(DP), corpus, cache_dir, tmp_path / "continued")


# -------------------------------------------------------------------------------------------------
# Command line


@pytest.mark.parametrize("script", LESSONS)
def test_help_lists_the_command_line_contract(script):
    proc = run_script(script, ["--help"])
    flags = ["--data", "--batch-size", "--micro-batch-size", "--resume", "--out-dir"]
    flags += ["--vocab-size", "--num-layers", "--hidden-size", "--num-heads", "--ffn-size"]
    if script != DP:  # the torchrun scripts
        flags.append("--backend")
    missing = [flag for flag in flags if flag not in proc.stdout]
    assert not missing, f"{script} --help lacks {missing}"
    # One default per flag: a flag whose help says what leaving it out does shows no "None".
    assert "(default: None)" not in proc.stdout
    assert "--zero1" not in proc.stdout  # ZeRO-1 is train_zero1.py now


def test_the_flags_are_checked_without_changing_them(corpus, cache_dir):
    # The run plan holds what the flags imply; args stays what was parsed (a checkpoint
    # records it), even where the plan fills in defaults.
    parser = flags.build_parser("test")
    argv = cmd(corpus, cache_dir, "unused", batch_size=8, model=None)
    args = parser.parse_args(argv)
    plan = flags.run_settings(parser, args, 2, torch.device("cpu"))
    assert vars(args) == vars(parser.parse_args(argv))
    assert (plan.model, plan.micro_batch_size, plan.accumulation) == ("tiny", 4, 1)
    assert args.model is None and args.micro_batch_size is None


def test_shape_flags_override_the_preset_in_the_plan_the_model_and_the_summary(corpus, cache_dir):
    shape = dict(num_layers=3, hidden_size=128, num_heads=8, num_kv_heads=4, ffn_size=320)
    args, plan = build_args(corpus, cache_dir, **shape)
    model, config = training.build_model(args, plan.model, 321)  # the tokenizer's vocabulary
    assert config.to_dict() == {
        **LlamaConfig.from_preset("tiny").to_dict(),  # the rest stays tiny's
        "vocab_size": 321, "num_hidden_layers": 3, "hidden_size": 128, "num_attention_heads": 8,
        "num_key_value_heads": 4, "intermediate_size": 320,
    }  # fmt: skip
    checked = model_config.model_shape(args).to_dict()
    assert checked == {**config.to_dict(), "vocab_size": 320}  # checked
    assert len(model.layers) == 3 and model.layers[0].feed_forward.w1.weight.shape == (320, 128)
    assert plan.model == "tiny"  # the preset's name: the flags are recorded as flags
    summary = flags.describe_run(args, plan, config, torch.device("cpu"))
    assert summary.startswith(
        "model: tiny with --num-layers 3 --hidden-size 128 --num-heads 8 --num-kv-heads 4 "
        "--ffn-size 320, "
    )


@pytest.mark.parametrize("preset, vocab", [("tiny", 4096), ("small", 32000), ("1b", 32000)])
def test_a_trained_tokenizer_gets_the_presets_vocabulary_unless_vocab_size_is_given(
    corpus, cache_dir, preset, vocab
):
    args, _ = build_args(corpus, cache_dir, model=preset, vocab_size=None)
    assert model_config.vocab_size(args) == vocab
    args, _ = build_args(corpus, cache_dir, model=preset, vocab_size=500, num_layers=2)
    assert model_config.vocab_size(args) == 500


def test_build_datasets_trains_the_tokenizer_with_the_resolved_vocabulary(
    corpus, cache_dir, monkeypatch
):
    class Stop(Exception):  # stop at the tokenizer: the size it is asked for is the point
        pass

    def get_tokenizer(texts, vocab_size, *rest):
        raise Stop(vocab_size)

    monkeypatch.setattr(training.data, "get_tokenizer", get_tokenizer)
    args, plan = build_args(corpus, cache_dir, model="small", vocab_size=None)
    with pytest.raises(Stop) as stopped:
        training.build_datasets(args, plan.tokenizer)
    assert stopped.value.args == (32000,)


# `python train_ddp.py` (no torchrun) is a process group of one: this is its only test.
@pytest.mark.parametrize("script", [DP, DDP])
def test_short_run_writes_outputs_and_loss_falls(corpus, cache_dir, tmp_path, script):
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out, max_steps=20, lr=3e-3, warmup_steps=5, eval_interval=10,
               save_interval=10, sample_tokens=16)  # fmt: skip
    proc = run_script(script, argv)
    for name in ("model.pt", "config.json", "tokenizer.json", "metrics.jsonl"):
        assert (out / name).is_file(), name
    written = sorted(os.listdir(out / "checkpoints"))  # each with its checksums
    assert written == [f"step_00000{s}.pt{sums}" for s in (10, 20) for sums in ("", ".sums")]
    assert "sample:" in proc.stdout
    # Each evaluation is printed above the progress bar, as well as logged.
    assert "step 10: val loss " in proc.stdout and "step 20: val loss " in proc.stdout

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
    env = run_ddp_sh_env(MAX_RESTARTS="0")  # a failure must fail the test, not be retried
    proc = subprocess.run(
        ["bash", str(REPO / "run_ddp.sh"), *cmd(corpus, cache_dir, out)],
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
    argv = cmd(corpus, cache_dir, tmp_path / "out", batch_size=10, micro_batch_size=4)
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
    proc = run_script(script, cmd(corpus, cache_dir, out, resume="never"), world, expect_rc=None)
    assert proc.returncode != 0, describe(proc, "expected a non-zero exit code")
    assert "--resume never" in proc.stderr
    assert snapshot(out) == before, "--resume never changed the existing run's files"
