"""Specification of what a run on many nodes needs and gloo on one machine hides: how long ranks
wait for each other (--dist-timeout, and the waits that are not collectives), a backend for each
device, the one-line messages for a peer that is gone or late.
"""

import argparse
import datetime
import multiprocessing
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from harness import LAUNCH_TIMEOUT, REPO, cmd, describe, launch_env, run_script

from lib import exits, training
from lib.checkpoints import files, model_pt, resuming, safe_load, sharded
from lib.distributed import backend_for, group_options
from model import LlamaConfig, LlamaForPretraining

# -------------------------------------------------------------------------------------------------
# The process group's options


@pytest.mark.quick
def test_cpu_offload_on_gpus_gives_the_cpu_a_backend_too():
    # --cpu-offload keeps the gradients on the CPU: clip_grad_norm_ all-reduces them there, and
    # NCCL has no CPU backend, so the group needs gloo for the CPU beside NCCL for the GPUs.
    cuda = torch.device("cuda", 0)
    assert backend_for(None, cuda, cpu_offload=True) == "cuda:nccl,cpu:gloo"
    assert backend_for("nccl", cuda, cpu_offload=True) == "cuda:nccl,cpu:gloo"
    assert backend_for(None, cuda) == "nccl"
    assert backend_for(None, torch.device("cpu"), cpu_offload=True) == "gloo"


@pytest.mark.quick
def test_group_options_give_the_group_dist_timeout_and_the_offload_backend(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    args = argparse.Namespace(backend=None, dist_timeout=0.5, cpu_offload=True)
    options = group_options(args, torch.device("cuda", 0))  # (no GPU used: only the device's type)
    assert options["timeout"] == datetime.timedelta(seconds=30)
    assert options["backend"] == "cuda:nccl,cpu:gloo"
    assert group_options(argparse.Namespace(backend=None, dist_timeout=30), torch.device("cpu"))[
        "backend"
    ] == "gloo"  # fmt: skip


@pytest.mark.quick
def test_every_torchrun_lesson_takes_dist_timeout_with_a_default_of_30_minutes():
    from lib.flags import build_parser

    args = build_parser("x", distributed=True).parse_args([])
    assert args.dist_timeout == 30
    assert build_parser("x", distributed=True).parse_args(["--dist-timeout", "5"]).dist_timeout == 5
    assert not hasattr(build_parser("x").parse_args([]), "dist_timeout")  # (train_dp.py's)


# -------------------------------------------------------------------------------------------------
# A peer gone or late: one line each, gloo's words and NCCL's


@pytest.mark.quick
@pytest.mark.parametrize(
    "text",
    [
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:3",
        "NCCL communicator was aborted on rank 1.",
        "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network "
        "error, NCCL version 2.21.5",
        "[Rank 0] Exception (either an error or timeout) detected by watchdog at work: 12",
    ],
)
def test_a_peer_that_ended_is_said_in_one_line(text):
    assert "another process of this run ended" in exits.peer_ended(RuntimeError(text))


@pytest.mark.quick
@pytest.mark.parametrize(
    "text",
    [
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
        "1800000ms for recv operation to complete",
        "Application timeout caused pair closure",
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
        "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 "
        "milliseconds before timing out.",
    ],
)
def test_a_collective_that_timed_out_names_the_flag_to_raise(text):
    line = exits.peer_ended(RuntimeError(text))
    assert "raise --dist-timeout" in line and "\n" not in line


@pytest.mark.quick
def test_other_errors_are_no_peers_business():
    assert exits.peer_ended(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert exits.peer_ended(ValueError("Connection closed by peer")) is None


# -------------------------------------------------------------------------------------------------
# Rank 0 working alone for longer than --dist-timeout


def run_slow_rank0(slow: str, argv: list[str]) -> subprocess.CompletedProcess:
    """train_fsdp.py on 2 ranks under tests/slow_rank0.py `slow` ("8": its lone work 8 s
    slower; "step=8": its first step)."""
    program = [str(REPO / "tests" / "slow_rank0.py"), slow, str(REPO / "train_fsdp.py"), *argv]
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         *program], cwd=REPO, env=launch_env(), capture_output=True, text=True,
        timeout=LAUNCH_TIMEOUT,
    )  # fmt: skip


def test_a_rank0_slower_than_dist_timeout_is_waited_for(corpus, tmp_path):
    # Every part of rank 0's lone work (tokenizing, choosing the out-dir, completing a
    # checkpoint, writing model.pt) takes 8 s more than it would, and --dist-timeout is 6 s:
    # the others wait on a group made for waiting, so the run ends well, with its model.pt.
    out, cache = tmp_path / "out", tmp_path / "cache"  # (a cache of its own: tokenized here)
    argv = cmd(corpus, cache, out, max_steps=2, save_interval=100, dist_timeout=0.1)
    proc = run_slow_rank0("8", argv)
    assert proc.returncode == 0, describe(proc, "a slow rank 0 stopped the run")
    assert (out / "model.pt").is_file()


def test_a_step_slower_than_dist_timeout_stops_the_run_naming_the_flag(corpus, cache_dir, tmp_path):
    # Inside a step's collectives, the timeout holds: the rank that waited says so, and which
    # flag to raise (rank 0, the late one, only finds its peer gone).
    argv = cmd(corpus, cache_dir, tmp_path / "out", max_steps=3, dist_timeout=0.05)
    proc = run_slow_rank0("step=12", argv)
    assert proc.returncode != 0
    assert "rank 1: error: a collective waited longer than --dist-timeout" in proc.stderr, (
        proc.stderr
    )
    assert "raise --dist-timeout" in proc.stderr


# -------------------------------------------------------------------------------------------------
# Resuming: each rank checks its own share of the checkpoint's files


def write_checked_files(folder: Path, names: list[str]) -> None:
    """Files of a few bytes each, and the checksums of them all beside them (files.SUMS)."""
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes(name.encode() * 100)
    sums = {name: files.checksums(str(folder / name)) for name in names}
    files.write_sums(sums, str(folder / files.SUMS))


@pytest.mark.quick
def test_each_rank_checks_the_shards_its_rank_wrote_and_rank0_the_rest(tmp_path):
    # Written by 3 ranks, resumed on 2: rank 0 checks __0_ and __2_ and .metadata, rank 1 __1_.
    names = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    write_checked_files(tmp_path / "ckpt", names)
    assert [n for n in names if sharded.rank_share(n, 0, 2)] == [n for n in names if n != names[2]]
    assert [n for n in names if sharded.rank_share(n, 1, 2)] == ["__1_0.distcp"]
    (tmp_path / "ckpt" / "__1_0.distcp").write_bytes(b"damaged")
    verify_sums = resuming.verify_sums
    verify_sums(str(tmp_path / "ckpt" / files.SUMS), lambda n: sharded.rank_share(n, 0, 2))
    with pytest.raises(ValueError, match=r"__1_0.distcp is damaged"):
        verify_sums(str(tmp_path / "ckpt" / files.SUMS), lambda n: sharded.rank_share(n, 1, 2))


@pytest.mark.parametrize("resume", ["auto", "explicit"])
def test_a_damaged_shard_of_another_rank_is_found_by_that_rank(
    trained, corpus, cache_dir, tmp_path, resume
):
    # Rank 1's shard of the newest checkpoint has a flipped bit, which only rank 1 reads: every
    # rank learns of it (a gather on the waiting group), and as when rank 0 alone read every
    # file, --resume auto goes back to the checkpoint before and a named one is refused.
    run = trained("train_fsdp.py", world=2)
    out = tmp_path / "out"
    for step in (4, 8):
        name = f"checkpoints/step_{step:07d}"
        shutil.copytree(run / name, out / name)
    shard = out / "checkpoints" / "step_0000008" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    if resume == "explicit":
        argv = cmd(corpus, cache_dir, out, resume=str(shard.parent))
        proc = run_script("train_fsdp.py", argv, world=2, expect_rc=1)  # (torchrun's code)
        assert f"{shard} is damaged" in proc.stderr, proc.stderr
        assert proc.stderr.count("error: ") == 1, proc.stderr  # (said once, by rank 0)
        assert "Traceback" not in proc.stderr.split("error: ")[0], proc.stderr  # (torchrun's after)
        return
    proc = run_script("train_fsdp.py", cmd(corpus, cache_dir, out), world=2)
    assert f"warning: {shard} is damaged" in proc.stderr, proc.stderr
    assert "step_0000004 at step 4" in proc.stdout, proc.stdout


# -------------------------------------------------------------------------------------------------
# The end of a sharded run: model.pt from the last checkpoint, .metadata read once


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip


@pytest.mark.quick
def test_model_pt_from_a_dcp_checkpoint_reads_its_metadata_once(tmp_path, monkeypatch):
    # On 1,024 ranks .metadata maps every piece of every tensor: read once per tensor, as before,
    # it made the end of a 70b run take hours while every other rank waited.
    config = tiny_config()
    torch.manual_seed(0)
    weights = LlamaForPretraining(config).state_dict()
    dcp.save({"model": weights}, checkpoint_id=str(tmp_path / "step"), no_dist=True)
    reads = []
    load = safe_load.MetadataUnpickler.load
    monkeypatch.setattr(
        safe_load.MetadataUnpickler, "load", lambda self: reads.append(1) or load(self)
    )
    model_pt.save_tensor_by_tensor(
        config, model_pt.tensor_reader(str(tmp_path / "step")), str(tmp_path / "model.pt")
    )
    assert len(reads) == 1
    written = torch.load(tmp_path / "model.pt", weights_only=True)
    assert written.keys() == weights.keys()
    assert all(torch.equal(written[k], weights[k]) for k in weights)


@pytest.mark.quick
def test_the_generate_command_after_a_sharded_run_says_where_the_model_fits():
    args = argparse.Namespace(out_dir="out", sample_prompt="def ")
    size = sum(t.numel() * 4 for t in LlamaForPretraining(tiny_config()).state_dict().values())
    on_gpu = model_pt.generate_command(args, tiny_config(), gpu_memory=10 * size)
    assert on_gpu.startswith("python -m tools.generate --out-dir out --prompt 'def '; ")
    assert "--device" not in on_gpu and "in fp32" in on_gpu
    too_big = model_pt.generate_command(args, tiny_config(), gpu_memory=size)
    assert "--prompt 'def ' --device cpu;" in too_big and "too big for one GPU" in too_big
    assert "--device" not in model_pt.generate_command(args, tiny_config(), gpu_memory=0)  # a CPU


# -------------------------------------------------------------------------------------------------
# Every rank the same tokenizer and corpus


class FakeTokenizer:
    def __init__(self, text: str, corpus: str):
        self.text, self.corpus_sha256 = text, corpus

    def to_str(self) -> str:
        return self.text


def digests_checked(rank: int, corpora: list[str], store_path: str, errors) -> None:
    """Rank `rank` of len(corpora) in a gloo group: same_data_on_every_rank's error, if any."""
    dist.init_process_group("gloo", rank=rank, world_size=len(corpora),
                            store=dist.FileStore(store_path, len(corpora)))  # fmt: skip
    try:
        training.same_data_on_every_rank(FakeTokenizer("{}", corpora[rank]))
        errors[rank] = None
    except ValueError as e:
        errors[rank] = str(e)
    finally:
        dist.destroy_process_group()


def test_a_rank_with_another_corpus_is_named_on_every_rank(tmp_path):
    # Two nodes whose disks hold other versions of --data: every rank stops, naming the rank.
    context = multiprocessing.get_context("spawn")
    errors = context.Manager().dict()
    corpora = ["a" * 64, "b" * 64]
    ranks = [context.Process(target=digests_checked, args=(r, corpora, str(tmp_path / "s"), errors))
             for r in range(2)]  # fmt: skip
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=120)
    assert errors[0] == errors[1] and errors[0].startswith("rank 1 has another corpus (sha256 bbb")


@pytest.mark.quick
def test_the_same_digests_on_every_rank_are_no_error():
    digests = [("t" * 64, "c" * 64)] * 4
    assert training.data_mismatch(digests) is None
    assert "rank 2 has another tokenizer" in training.data_mismatch([*digests[:2], ("x", "c" * 64)])


# -------------------------------------------------------------------------------------------------
# Tokenizing: a node's processes share a big corpus (the same tokens: tests/test_data.py)


@pytest.mark.quick
def test_a_big_corpus_is_tokenized_by_as_many_processes_as_the_node_runs(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert training.tokenizing_processes(training.NODE_TOKENIZING_DOCS) == 8
    assert training.tokenizing_processes(1000) is None  # small: starting processes costs more
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert training.tokenizing_processes(10**7) == 4  # at most one per core
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert training.tokenizing_processes(10**7) is None  # one process: nobody waits
