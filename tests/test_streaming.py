"""Specification of lib/extras/streaming.py (--streaming): exact resume, one shard per rank,
held-out validation, and the same windows as the cached path, in-process on corpora made in
tmp_path; then the train scripts' side: the position each checkpoint saves, and a run under torchrun
resumed from one. (A killed streaming job: tests/test_faults.py.)"""

import io
import json
import pickle
import random
import types
from pathlib import Path

import datasets
import pytest
import torch
from harness import STREAMING, build_args, cmd, run_script
from test_bad_input import assert_refused
from test_fsdp import assert_resumes_bit_identically

import data
from lib import flags, training
from lib.checkpoints import resuming
from lib.extras import streaming

TP = "train_tp.py"

WORDS = "the a model data train loss step rank batch token layer shard epoch value".split()


@pytest.fixture(autouse=True)
def small_reads(monkeypatch):
    """Read 3 documents at a time (not 64), so that positions fall inside files and epochs."""
    monkeypatch.setattr(streaming, "READ_DOCS", 3)


def write_corpus(root: Path, files: int, docs_per_file: int | None = None) -> Path:
    """`files` .jsonl files of short documents of different lengths (about 40 documents in
    all, unless docs_per_file says), each text unique."""
    docs_per_file = docs_per_file or 40 // files
    rng = random.Random(files)
    root.mkdir(parents=True)
    for f in range(files):
        rows = [
            {"body": f"doc {f}-{j}: " + " ".join(rng.choices(WORDS, k=rng.randint(2, 14)))}
            for j in range(docs_per_file + f % 2)  # files of different sizes
        ]
        (root / f"part_{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def write_txt(root: Path, files: int) -> Path:
    """.txt corpora, read by datasets' text builder: a directory of `files` documents, or one
    input.txt of paragraphs (files=1)."""
    texts = [p.read_text() for p in sorted(write_corpus(root / "jsonl", 1).glob("*"))][0]
    paragraphs = [json.loads(line)["body"] for line in texts.splitlines()]
    if files == 1:
        (root / "input.txt").write_text("\n\n".join(paragraphs) + "\n")
        return root / "input.txt"
    (root / "txt").mkdir()
    for f in range(files):
        (root / "txt" / f"{f}.txt").write_text(" ".join(paragraphs[f::files]) * 3)
    return root / "txt"


def corpus_texts(root: Path) -> list[str]:
    return [json.loads(line)["body"] for p in sorted(root.glob("*.jsonl")) for line in p.open()]


def open_stream(root: Path, tmp_path: Path, *extra: str) -> streaming.Stream:
    argv = ["--data", str(root), "--text-column", "body", "--cache-dir", str(tmp_path / "cache")]
    argv += ["--vocab-size", "300", "--seq-length", "16", "--batch-size", "4"]
    args = flags.build_parser("test").parse_args([*argv, "--eval-batches", "1", *extra])
    return streaming.open_stream(args, None)


def take(batches, steps: int) -> list:
    return [next(batches) for _ in range(steps)]


def assert_same_steps(got: list, want: list) -> None:
    assert len(got) == len(want)
    for step_got, step_want in zip(got, want, strict=True):
        for (x, y), (x_want, y_want) in zip(step_got, step_want, strict=True):
            assert torch.equal(x, x_want) and torch.equal(y, y_want)


def saved_and_loaded(state: dict) -> dict:
    """As a checkpoint keeps it: torch.save, then torch.load with weights_only=True."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def rows_as_texts(steps: list, tokenizer) -> list[str]:
    """Pad mode, no document clipped: the document of each row, in order."""
    return [tokenizer.decode(row.tolist()) for step in steps for x, _ in step for row in x]


@pytest.mark.parametrize(
    ("kind", "files", "world"),
    [("jsonl", 4, 2), ("jsonl", 3, 2), ("jsonl", 1, 1), ("txt", 10, 2), ("txt", 1, 2)],
)
@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_resuming_from_any_step_gives_exactly_the_same_batches(tmp_path, kind, files, world, mode):
    if kind == "jsonl":  # whole files per rank where the ranks divide them, else every other doc
        stream = open_stream(write_corpus(tmp_path / "docs", files), tmp_path, "--data-mode", mode)
    else:  # the text builder: a document per file, or per paragraph of one file
        root = write_txt(tmp_path / "docs", files)
        stream = open_stream(root, tmp_path, "--data-mode", mode, "--text-column", "text")
    ranks = [streaming.StreamingBatches(stream, 2, 2, rank, world) for rank in range(world)]
    steps, states = [[] for _ in ranks], [[batches.state_dict()] for batches in ranks]
    while min(batches.state_dict()["epoch"] for batches in ranks) < 2:  # 2 epoch boundaries
        for rank, batches in enumerate(ranks):  # the ranks' reads interleaved in one process
            steps[rank].append(next(batches))
            states[rank].append(batches.state_dict())
    for rank in range(world):
        for k in range(len(steps[rank])):
            state = saved_and_loaded(states[rank][k])
            resumed = streaming.StreamingBatches(stream, 2, 2, rank, world, state=state)
            assert_same_steps(take(resumed, len(steps[rank]) - k), steps[rank][k:])


def test_reading_ahead_in_a_thread_changes_neither_batches_nor_positions(tmp_path):
    stream = open_stream(write_corpus(tmp_path / "docs", 3), tmp_path)
    plain = streaming.StreamingBatches(stream, 2, 1, 0, 1)
    ahead = streaming.StreamingBatches(stream, 2, 1, 0, 1, read_ahead=3)
    while plain.state_dict()["epoch"] < 2:  # the thread opens the next epochs' readers itself
        assert_same_steps([next(ahead)], [next(plain)])
        resumed = streaming.StreamingBatches(stream, 2, 1, 0, 1, state=ahead.state_dict())
        assert_same_steps(take(resumed, 2), take(streaming.StreamingBatches(
            stream, 2, 1, 0, 1, state=plain.state_dict()), 2))  # fmt: skip


@pytest.mark.parametrize("files", [4, 3])
def test_two_ranks_read_disjoint_documents_that_make_up_the_training_stream(tmp_path, files):
    root = write_corpus(tmp_path / "docs", files)
    stream = open_stream(root, tmp_path, "--data-mode", "pad", "--seq-length", "48")
    per_rank = []
    for rank in range(2):
        batches, steps = streaming.StreamingBatches(stream, 1, 1, rank, 2), []
        while True:  # one row per step: epoch 0 ends where a step's state says epoch 1
            step = next(batches)
            if batches.state_dict()["epoch"] > 0:
                break
            steps.append(step)
        per_rank.append(rows_as_texts(steps, stream.tokenizer))
    texts = corpus_texts(root)
    train = texts[stream.val_documents :]
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == sorted(train)
    assert all(len(stream.tokenizer.encode(t)) + 2 <= 48 for t in texts)  # none clipped


def test_validation_documents_are_held_out_and_never_trained_on(tmp_path):
    root = write_corpus(tmp_path / "docs", 2)
    texts = corpus_texts(root)
    # The first validation document again, later in the corpus: held out as well.
    with (root / "part_1.jsonl").open("a") as f:
        f.write(json.dumps({"body": texts[0]}) + "\n")
    stream = open_stream(root, tmp_path, "--data-mode", "pad", "--seq-length", "48")
    assert stream.val_documents == 4  # pad mode: --eval-batches x --batch-size documents
    val = [stream.tokenizer.decode(stream.val_set[i][0].tolist()) for i in range(4)]
    assert val == texts[:4]
    trained = rows_as_texts(
        take(streaming.StreamingBatches(stream, 4, 1, 0, 1), 20), stream.tokenizer
    )
    assert set(trained) == set(texts[4:])  # several epochs: every other document, no other
    assert len(trained) == 80

    pack = open_stream(root, tmp_path, "--data-mode", "pack")
    held_out = set(texts[: pack.val_documents])
    assert sum(map(len, held_out)) >= 4 * 17 * streaming.VAL_CHARS_PER_TOKEN
    windows = [
        x for step in take(streaming.StreamingBatches(pack, 4, 1, 0, 1), 30) for x, _ in step
    ]
    trained = pack.tokenizer.decode(torch.cat(windows).flatten().tolist())
    assert not [t for t in held_out if t in trained]


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_a_stream_opens_where_datasets_could_not_fingerprint_a_table(tmp_path, monkeypatch, mode):
    """datasets names an in-memory table (Dataset.from_dict) by pickling it with dill, which
    fails where pyarrow is installed outside a folder named site-packages (`pip install
    --target DIR`, DIR on PYTHONPATH: a GPU image, a cluster's shared folder; seen with dill
    0.4: PicklingError, MonthDayNano). Injected here, whatever dill this is: that naming fails."""

    def unpicklable(dataset):
        raise pickle.PicklingError("Can't pickle <class 'MonthDayNano'> (injected)")

    monkeypatch.setattr(datasets.arrow_dataset, "generate_fingerprint", unpicklable)
    with pytest.raises(pickle.PicklingError):  # the injection bites datasets' own from_dict
        datasets.Dataset.from_dict({"text": ["a document"]})
    stream = open_stream(write_corpus(tmp_path / "docs", 2), tmp_path, "--data-mode", mode)
    assert len(stream.val_set) > 0 and next(streaming.StreamingBatches(stream, 4, 1, 0, 1))


def test_windows_follow_the_packing_of_the_cached_path(tmp_path):
    root = write_corpus(tmp_path / "docs", 1, docs_per_file=60)
    stream = open_stream(root, tmp_path)  # one process, one file: the corpus order
    docs = datasets.Dataset.from_dict({"text": corpus_texts(root)[stream.val_documents :]})
    tokens = data.tokenize(docs, stream.tokenizer)
    cached = data.PretrainingDataset(tokens, 16)  # < 1000 documents: one stream, as streamed
    steps = take(streaming.StreamingBatches(stream, 3, 2, 0, 1), len(cached) // 6)
    pairs = [(x[i], y[i]) for step in steps for x, y in step for i in range(3)]
    for i, (x, y) in enumerate(pairs):
        assert torch.equal(x, cached[i][0]) and torch.equal(y, cached[i][1])
    stream_tokens = [t for ids in tokens["input_ids"] for t in ids]
    rebuilt = torch.cat([x for x, _ in pairs] + [pairs[-1][1][-1:]]).tolist()
    assert rebuilt == stream_tokens[: len(rebuilt)]  # every token once, windows share one


def test_a_hub_name_with_a_config_is_streamed(tmp_path, monkeypatch):
    calls = []
    texts = [f"hub document {i} " * (i % 5 + 1) for i in range(40)]

    def hub(path, name=None, **kwargs):
        calls.append((path, name, kwargs.get("streaming")))
        rows = datasets.Dataset.from_dict({"content": texts, "n": list(range(40))})
        return rows.to_iterable_dataset(num_shards=4)

    monkeypatch.setattr("datasets.load_dataset", hub)
    argv = ["--data", "org/corpus:en", "--text-column", "content", "--cache-dir", str(tmp_path)]
    argv += ["--vocab-size", "300", "--seq-length", "8", "--batch-size", "2", "--eval-batches"]
    args = flags.build_parser("test").parse_args([*argv, "1", "--data-mode", "pad", "--streaming"])
    stream = streaming.open_stream(args, None)
    assert calls == [("org/corpus", "en", True)]
    steps = take(streaming.StreamingBatches(stream, 2, 1, 1, 2), 10)  # rank 1 of 2: 1 of 4 shards
    assert steps[0][0][0].shape == (2, 8)


def test_resuming_with_other_ranks_or_validation_is_refused(tmp_path):
    stream = open_stream(write_corpus(tmp_path / "docs", 4), tmp_path)
    state = streaming.StreamingBatches(stream, 2, 1, 0, 2).state_dict()
    with pytest.raises(ValueError, match="rank 0 of 2 data-parallel ranks, not 0 of 4"):
        streaming.StreamingBatches(stream, 2, 1, 0, 4, state=state)
    with pytest.raises(ValueError, match="held out 9 validation documents.*--eval-batches"):
        streaming.StreamingBatches(stream, 2, 1, 0, 2, state={**state, "val_documents": 9})


def test_a_corpus_that_validation_uses_up_is_refused(tmp_path):
    root = write_corpus(tmp_path / "docs", 1, docs_per_file=3)
    with pytest.raises(ValueError, match="first 3 documents .* leaves none to train on"):
        open_stream(root, tmp_path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-proc", "2"], "--streaming tokenizes as it reads"),
        (["--val-fraction", "0.1"], "--val-fraction does not apply to --streaming"),
    ],
)
def test_streaming_refuses_flags_of_a_corpus_cached_whole(argv, message):
    # (argv, not flags: the module lib.flags, once cli, is `flags` here)
    parser = flags.build_parser("test")
    args = parser.parse_args(["--streaming", *argv])
    with pytest.raises(ValueError, match=message):
        flags.run_settings(parser, args, 1, torch.device("cpu"))


CPU = torch.device("cpu")

# -------------------------------------------------------------------------------------------------
# The train scripts' side: training.step_batches, data_positions, checkpoints


def test_step_batches_goes_on_from_the_saved_position_of_its_own_data_parallel_rank(tmp_path):
    root = write_corpus(tmp_path / "docs", 4)
    argv = ["--data", str(root), "--text-column", "body", "--cache-dir", str(tmp_path / "cache")]
    argv += ["--vocab-size", "300", "--seq-length", "16", "--batch-size", "4", "--streaming"]
    args = flags.build_parser("test").parse_args([*argv, "--eval-batches", "1"])
    stream, val, tokenizer = training.build_datasets(args, None)
    assert isinstance(stream, streaming.Stream) and training.steps_per_epoch(stream, args) is None
    assert val.dataset is stream.val_set and tokenizer is stream.tokenizer
    settings = types.SimpleNamespace(accumulation=1)  # one micro-batch of 2 per step

    def batches(rank: int, start_step: int = 0, position=None, ranks: int = 2):
        start, shard = (start_step, position), (rank, ranks)
        return training.step_batches(args, settings, stream, None, 2, CPU, start, shard)

    ranks = [batches(0), batches(1)]
    take(ranks[0], 3), take(ranks[1], 3)
    # What a checkpoint holds (data_positions on rank 0, here without torchrun: one state each).
    position = saved_and_loaded([training.data_positions(b)[0] for b in ranks])
    assert [state["rank"] for state in position] == [0, 1]
    for rank in range(2):
        assert_same_steps(take(batches(rank, 3, position), 4), take(ranks[rank], 4))
    with pytest.raises(ValueError, match="read by 2 data-parallel ranks, this run has 4"):
        batches(0, 3, position, ranks=4)
    with pytest.raises(ValueError, match="holds no position in the stream"):
        batches(0, 3, None)
    assert training.data_positions(iter([])) is None  # a cached dataset: the step says where


def test_a_streaming_checkpoint_resumes_only_with_streaming(corpus, cache_dir):
    args, _ = build_args(corpus, cache_dir)
    ckpt = {"step": 4, "args": {**vars(args), "streaming": True}}
    with pytest.raises(ValueError, match="made with --streaming True \\(now False\\)"):
        resuming.check_resumable(ckpt, None, args, None)
    args.streaming = True  # and a checkpoint from before the flag was not streamed
    old = {"step": 4, "args": {k: v for k, v in vars(args).items() if k != "streaming"}}
    with pytest.raises(ValueError, match="made with --streaming False \\(now True\\)"):
        resuming.check_resumable(old, None, args, None)


def test_a_tensor_parallel_streaming_run_resumes_from_its_sharded_checkpoint_bit_identically(
    corpus, cache_dir, tmp_path
):
    # The DCP path (train_state.pt holds the position), with two ranks that share one data
    # shard (tp 2, dp 1): one position is saved, and both ranks go on from it.
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    flags = ["--tp", "2", "--eval-interval", "8"]
    run_script(TP, cmd(corpus, cache_dir, full, **STREAMING) + flags, world=2)
    argv = cmd(corpus, cache_dir, resumed, **STREAMING) + flags
    assert_resumes_bit_identically(TP, full, resumed, argv, 2, tmp_path)
    position = torch.load(full / "checkpoints/step_0000004/train_state.pt", weights_only=True)
    assert [state["rank"] for state in position["data"]] == [0]
    # Another number of data-parallel ranks is refused as the stream is opened, the last check
    # before the loop: before, args.jsonl had already recorded the start it refused.
    argv = cmd(corpus, cache_dir, full, **STREAMING, max_steps=12) + ["--tp", "1"]
    expect = "the checkpoint's stream was read by 1 data-parallel ranks, this run has 2"
    assert_refused(TP, argv, expect, full, cache_dir, world=2)
