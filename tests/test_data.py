"""Specification of data.py: corpus sources, tokenizer, tokenize cache, (x, y) layouts."""

import errno
import json
import multiprocessing
import os
import re
import shutil
import time
from pathlib import Path

import datasets
import pytest
import torch
import torch.distributed as dist
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import data
from data import BOT, EOT, IGNORE_INDEX, PAD
from lib import distributed
from lib.extras import corpus, streaming
from tools import bench_loader

pytestmark = pytest.mark.quick  # the quick tier (`python -m pytest -m quick`)

VOCAB = 300  # small: trains in well under a second

SAMPLE_TEXTS = [
    f"def function_{i}(x, y):\n    return x * {i} + y  # comment number {i}\n" for i in range(40)
] + ["The quick brown fox jumps over the lazy dog.\n" * 3, "print('hello, world')\n"]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    return write(path, "".join(json.dumps(row) + "\n" for row in rows))


def texts_dataset(texts: list[str]) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"text": texts})


def ids_dataset(docs: list[list[int]]) -> datasets.Dataset:
    """A stand-in for tokenize()'s output, with exactly the ids a test needs."""
    return datasets.Dataset.from_dict({"input_ids": docs})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    cache = tmp_path_factory.mktemp("cache")
    return data.get_tokenizer(texts_dataset(SAMPLE_TEXTS), VOCAB, cache_dir=str(cache))


# -----------------------------------------------------------------------------
# Tokenizer


def test_trained_tokenizer_has_special_ids_0_1_2(tokenizer):
    assert [tokenizer.token_to_id(t) for t in (PAD, BOT, EOT)] == [0, 1, 2]
    assert data.SPECIAL_TOKENS == [PAD, BOT, EOT]


def test_special_ids_survive_save_and_load_by_path(tokenizer, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(tokenizer.to_str())
    loaded = data.get_tokenizer(texts_dataset(["unused"]), path=str(path))
    assert [loaded.token_to_id(t) for t in (PAD, BOT, EOT)] == [0, 1, 2]
    assert (loaded.pad_id, loaded.bot_id, loaded.eot_id) == (0, 1, 2)
    assert loaded.encode("x = 1\n") == tokenizer.encode("x = 1\n")


def test_literal_special_token_text_is_encoded_as_text(tokenizer, tmp_path):
    text = "if s == '[BOT]' or s == '[EOT]' or s == '[PAD]': pass"
    (tmp_path / "tokenizer.json").write_text(tokenizer.to_str())
    loaded = data.get_tokenizer(texts_dataset(["unused"]), path=str(tmp_path / "tokenizer.json"))
    for tok in (tokenizer, loaded):
        ids = tok.encode(text)
        assert not {0, 1, 2} & set(ids)
        assert tok.decode(ids) == text  # byte-level round trip is exact


def test_get_tokenizer_reuses_cached_tokenizer_for_same_texts(tmp_path, monkeypatch):
    calls = []
    train = data._train_tokenizer
    monkeypatch.setattr(data, "_train_tokenizer", lambda *a: calls.append(1) or train(*a))
    first = data.get_tokenizer(texts_dataset(SAMPLE_TEXTS), VOCAB, cache_dir=str(tmp_path))
    [cached_file] = (tmp_path / "tokenizers").glob("*/tokenizer.json")
    mtime = cached_file.stat().st_mtime_ns

    second = data.get_tokenizer(texts_dataset(SAMPLE_TEXTS), VOCAB, cache_dir=str(tmp_path))
    assert len(calls) == 1
    assert cached_file.stat().st_mtime_ns == mtime
    assert second.to_str() == first.to_str()
    assert second.tokenizer.encode_special_tokens  # set on cache hits too


def test_get_tokenizer_retrains_for_different_texts_or_vocab_size(tmp_path):
    data.get_tokenizer(texts_dataset(SAMPLE_TEXTS), VOCAB, cache_dir=str(tmp_path))
    data.get_tokenizer(texts_dataset(SAMPLE_TEXTS[:-1]), VOCAB, cache_dir=str(tmp_path))
    data.get_tokenizer(texts_dataset(SAMPLE_TEXTS), VOCAB + 10, cache_dir=str(tmp_path))
    assert len(list((tmp_path / "tokenizers").glob("*/tokenizer.json"))) == 3
    assert not list((tmp_path / "tokenizers").glob("*/*.tmp"))  # temp files were renamed


def test_get_tokenizer_rejects_unreadable_file(tmp_path):
    broken = write(tmp_path / "tokenizer.json", '{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(ValueError, match="could not read .*tokenizer.json.*--tokenizer"):
        data.get_tokenizer(texts_dataset(["x"]), path=str(broken))


def test_get_tokenizer_rejects_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        data.get_tokenizer(texts_dataset(["x"]), path=str(tmp_path / "nope.json"))


def test_get_tokenizer_rejects_tokenizer_without_special_tokens(tmp_path):
    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel()
    plain.train_from_iterator(SAMPLE_TEXTS, trainers.BpeTrainer(vocab_size=VOCAB))
    plain.save(str(tmp_path / "plain.json"))
    with pytest.raises(ValueError, match=r"none of the usual beginning-of-document .*--bot-token"):
        data.get_tokenizer(texts_dataset(["x"]), path=str(tmp_path / "plain.json"))


# -----------------------------------------------------------------------------
# Corpus sources


def test_load_corpus_txt_gives_one_document_per_file_in_sorted_order(tmp_path):
    write(tmp_path / "b.txt", "second file\n\nwith a blank line\n")
    write(tmp_path / "a.txt", "first file\nline two\n")
    ds = data.load_corpus(str(tmp_path / "*.txt"), cache_dir=str(tmp_path / ".cache"))
    assert ds.column_names == ["text"]
    assert ds["text"] == ["first file\nline two\n", "second file\n\nwith a blank line\n"]


def test_load_corpus_jsonl_uses_custom_text_column_and_drops_others(tmp_path):
    rows = [{"id": 1, "body": "alpha"}, {"id": 2, "body": "beta"}]
    path = write_jsonl(tmp_path / "docs.jsonl", rows)
    ds = data.load_corpus(str(path), text_column="body", cache_dir=str(tmp_path / ".cache"))
    assert ds.column_names == ["text"]
    assert ds["text"] == ["alpha", "beta"]


def test_load_corpus_parquet(tmp_path):
    path = tmp_path / "docs.parquet"
    datasets.Dataset.from_dict({"text": ["one", "two"], "n": [1, 2]}).to_parquet(str(path))
    ds = data.load_corpus(str(path), cache_dir=str(tmp_path / ".cache"))
    assert ds.column_names == ["text"]
    assert ds["text"] == ["one", "two"]


def test_load_corpus_directory_recurses_sorts_and_skips_hidden_paths(tmp_path):
    folder = tmp_path / "corpus"
    write(folder / "z.txt", "z")
    write(folder / "sub" / "a.txt", "sub/a")
    write(folder / "m.txt", "m")
    write(folder / "notes.md", "not a supported file")
    write(folder / ".hidden" / "x.txt", "hidden")
    ds = data.load_corpus(str(folder), cache_dir=str(tmp_path / ".cache"))
    assert ds["text"] == ["m", "sub/a", "z"]


def test_load_corpus_glob_matches_only_its_files(tmp_path):
    write_jsonl(tmp_path / "train_1.jsonl", [{"text": "a"}])
    write_jsonl(tmp_path / "train_2.jsonl", [{"text": "b"}, {"text": "c"}])
    write_jsonl(tmp_path / "test_1.jsonl", [{"text": "held out"}])
    ds = data.load_corpus(str(tmp_path / "train_*.jsonl"), cache_dir=str(tmp_path / ".cache"))
    assert ds["text"] == ["a", "b", "c"]


def test_load_corpus_missing_text_column_lists_existing_columns(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"content": "x", "meta": "y"}])
    with pytest.raises(ValueError, match=r"no column 'text'.*\['content', 'meta'\]"):
        data.load_corpus(str(path), cache_dir=str(tmp_path / ".cache"))


def test_load_corpus_no_matching_files_is_an_error(tmp_path):
    write(tmp_path / "readme.md", "unsupported")
    with pytest.raises(ValueError, match="no .txt/.jsonl/.json/.parquet files found"):
        data.load_corpus(str(tmp_path / "*.txt"), cache_dir=str(tmp_path / ".cache"))
    with pytest.raises(ValueError, match="no .txt/.jsonl/.json/.parquet files found"):
        data.load_corpus(str(tmp_path), cache_dir=str(tmp_path / ".cache"))


def test_load_corpus_missing_path_is_an_error_not_a_hub_lookup(tmp_path, monkeypatch):
    def no_hub(*args, **kwargs):
        raise AssertionError("must not reach a load_dataset")

    monkeypatch.setattr("lib.checkpoints.files.load_cached", no_hub)
    with pytest.raises(ValueError, match="no .txt"):
        data.load_corpus(str(tmp_path / "missing.jsonl"), cache_dir=str(tmp_path / ".cache"))


def test_load_corpus_hub_name_with_config_loads_that_config(tmp_path, monkeypatch):
    calls = []

    def hub(path, name=None, **kwargs):
        calls.append((path, name, kwargs["split"]))
        return datasets.Dataset.from_dict({"text": ["one", " ", "two"], "label": [0, 1, 2]})

    monkeypatch.setattr("lib.checkpoints.files.load_cached", hub)
    ds = data.load_corpus("org/wikitext:wikitext-2-raw-v1", cache_dir=str(tmp_path / ".cache"))
    assert calls == [("org/wikitext", "wikitext-2-raw-v1", "train")]
    assert ds.column_names == ["text"] and ds["text"] == ["one", "two"]
    data.load_corpus("org/name", cache_dir=str(tmp_path / ".cache"))
    assert calls[-1] == ("org/name", None, "train")  # no config: datasets' default


def test_load_corpus_hub_dataset_without_its_config_says_how_to_name_one(tmp_path, monkeypatch):
    def hub(path, name=None, **kwargs):  # what datasets raises for wikitext without a config
        raise ValueError(
            "Config name is missing.\nPlease pick one among the available configs: "
            "['wikitext-103-raw-v1', 'wikitext-2-raw-v1']\nExample of usage:\n\t`load_dataset(...)`"
        )

    monkeypatch.setattr("lib.checkpoints.files.load_cached", hub)
    with pytest.raises(ValueError) as error:
        data.load_corpus("wikitext", cache_dir=str(tmp_path / ".cache"))
    message = str(error.value)
    assert "\n" not in message
    assert "--data wikitext:CONFIG" in message and "'wikitext-2-raw-v1'" in message


def test_load_corpus_mixed_file_types_is_an_error(tmp_path):
    write(tmp_path / "a.txt", "a")
    write_jsonl(tmp_path / "b.jsonl", [{"text": "b"}])
    with pytest.raises(ValueError, match=r"mixes file types \['.jsonl', '.txt'\]"):
        data.load_corpus(str(tmp_path), cache_dir=str(tmp_path / ".cache"))


def test_load_corpus_drops_empty_documents(tmp_path):
    rows = [{"text": "keep"}, {"text": ""}, {"text": " \n\t"}, {"text": None}, {"text": "too"}]
    path = write_jsonl(tmp_path / "docs.jsonl", rows)
    assert data.load_corpus(str(path), cache_dir=str(tmp_path / ".cache"))["text"] == [
        "keep",
        "too",
    ]


def test_load_corpus_with_only_empty_documents_is_an_error(tmp_path):
    write(tmp_path / "a.txt", "")
    write(tmp_path / "b.txt", "  \n\n")
    with pytest.raises(ValueError, match="no non-empty documents"):
        data.load_corpus(str(tmp_path), cache_dir=str(tmp_path / ".cache"))


def test_load_corpus_stdlib_has_every_module_including_os(tmp_path):
    ds = data.load_corpus("stdlib", cache_dir=str(tmp_path / ".cache"))
    assert len(ds) > 1000
    assert Path(os.__file__).read_text() in set(ds["text"])


# -----------------------------------------------------------------------------
# .txt corpora: documents by paragraph, line or file (--txt-split)

PARAGRAPHS = (
    "First Citizen:\nBefore we proceed.\n\nAll:\nSpeak, speak.\n\nFirst Citizen:\nYou are.\n"
)


def test_one_txt_file_is_split_by_paragraph_by_default(tmp_path):
    path = write(tmp_path / "input.txt", PARAGRAPHS + "\n\n")  # nanoGPT's single input.txt
    ds = data.load_corpus(str(path), cache_dir=str(tmp_path / ".cache"))
    assert ds["text"] == [
        "First Citizen:\nBefore we proceed.",
        "All:\nSpeak, speak.",
        "First Citizen:\nYou are.",  # the trailing blank lines are an empty paragraph, dropped
    ]
    assert corpus.txt_split_mode(str(path)) == "paragraph"
    explicit = data.load_corpus(
        str(path), cache_dir=str(tmp_path / ".cache"), txt_split="paragraph"
    )
    assert explicit["text"] == ds["text"]


def test_txt_split_line_gives_one_document_per_non_empty_line(tmp_path):
    path = write(tmp_path / "input.txt", PARAGRAPHS)
    ds = data.load_corpus(str(path), cache_dir=str(tmp_path / ".cache"), txt_split="line")
    assert ds["text"] == [
        "First Citizen:",
        "Before we proceed.",
        "All:",
        "Speak, speak.",
        "First Citizen:",
        "You are.",
    ]


def test_txt_split_file_keeps_each_file_whole_and_one_file_is_refused_saying_why(tmp_path):
    write(tmp_path / "a.txt", PARAGRAPHS)
    write(tmp_path / "b.txt", "second\n\nfile\n")
    cache = str(tmp_path / ".cache")
    ds = data.load_corpus(str(tmp_path / "*.txt"), cache_dir=cache, txt_split="file")
    assert ds["text"] == [PARAGRAPHS, "second\n\nfile\n"]
    with pytest.raises(ValueError, match="is 1 document.*pass --txt-split paragraph or line"):
        data.load_corpus(str(tmp_path / "a.txt"), cache_dir=cache, txt_split="file")
    write(tmp_path / "one.txt", "one paragraph\nof two lines\n\n")
    with pytest.raises(
        ValueError, match=r"\(one paragraph, with --txt-split auto\).*--txt-split line"
    ):
        data.load_corpus(str(tmp_path / "one.txt"), cache_dir=cache)


def test_a_directory_or_glob_keeps_one_document_per_file_unless_told(tmp_path):
    folder = tmp_path / "corpus"
    write(folder / "a.txt", PARAGRAPHS)
    write(folder / "b.txt", "second\n\nfile\n")
    cache = str(tmp_path / ".cache")
    for spec in (str(folder), str(folder / "*.txt"), str(folder / "a*.txt")):
        assert corpus.txt_split_mode(spec) == "file"  # a glob of one file too: its form decides
    assert data.load_corpus(str(folder), cache_dir=cache)["text"] == [
        PARAGRAPHS,
        "second\n\nfile\n",
    ]
    split = data.load_corpus(str(folder), cache_dir=cache, txt_split="paragraph")
    assert len(split) == 3 + 2
    with pytest.raises(
        ValueError, match=r"is 1 document \(each .txt file is one, with --txt-split auto"
    ):
        data.load_corpus(str(folder / "a*.txt"), cache_dir=cache)


def test_switching_txt_split_never_reuses_the_other_splits_tokens(tokenizer, tmp_path):
    path = write(tmp_path / "input.txt", "\n".join([PARAGRAPHS] * 3))  # 9 paragraphs
    cache = str(tmp_path / ".cache")
    tokens = {}
    for mode in ("paragraph", "line", "auto"):
        docs = data.load_corpus(str(path), cache_dir=cache, txt_split=mode)
        tokens[mode] = data.tokenize(docs, tokenizer)
        assert tokens[mode]["input_ids"] == [
            [1, *tokenizer.encode(text), 2] for text in docs["text"]
        ]
    files = {mode: {f["filename"] for f in ds.cache_files} for mode, ds in tokens.items()}
    assert files["paragraph"].isdisjoint(files["line"])
    assert len(tokens["paragraph"]) == 9 and len(tokens["line"]) == 18
    assert files["auto"] == files["paragraph"]  # the same split: the same cache


@pytest.mark.parametrize(
    ("spec", "what"),
    [("docs.jsonl", ".jsonl files"), ("stdlib", "the standard library"), ("org/name", "a hub")],
)
def test_txt_split_is_refused_for_data_that_is_not_txt(tmp_path, monkeypatch, spec, what):
    def no_load(*args, **kwargs):
        raise AssertionError("must be refused before any data is read")

    monkeypatch.setattr("lib.checkpoints.files.load_cached", no_load)
    if spec.endswith(".jsonl"):
        spec = str(write_jsonl(tmp_path / spec, [{"text": "a"}, {"text": "b"}]))
    with pytest.raises(ValueError, match=f"--txt-split line applies to .txt files only.*{what}"):
        data.load_corpus(spec, cache_dir=str(tmp_path / ".cache"), txt_split="line")
    with pytest.raises(ValueError, match="--txt-split must be one of auto, paragraph, line, file"):
        data.load_corpus(spec, cache_dir=str(tmp_path / ".cache"), txt_split="lines")


def test_train_dp_trains_on_one_input_txt_and_refuses_txt_split_for_jsonl(tmp_path):
    from harness import DP, cmd, run_script, write_corpus

    # nanoGPT's case: one input.txt, no flag. Its paragraphs are the documents.
    docs = write_corpus(tmp_path / "docs")
    text = "\n\n".join(p.read_text().strip() for p in sorted(docs.glob("*.txt")))
    input_txt = write(tmp_path / "input.txt", text + "\n")
    out = tmp_path / "out"
    proc = run_script(DP, cmd(input_txt, tmp_path / ".cache", out, max_steps=2, eval_interval=2))
    assert (out / "model.pt").is_file(), proc.stdout[-2000:]

    jsonl = write_jsonl(tmp_path / "docs.jsonl", [{"text": "a"}, {"text": "b"}])
    argv = cmd(jsonl, tmp_path / ".cache", tmp_path / "out2", txt_split="line")
    proc = run_script(DP, argv, expect_rc=2)
    assert proc.stderr.count("error: ") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--txt-split line applies to .txt files only" in proc.stderr


def test_a_jsonl_file_that_is_not_utf8_is_refused_naming_the_file_and_line(tmp_path):
    # datasets' json reader keeps the bytes; only reading the text failed, without a file name.
    lines = ['{"text": "plain text"}', '{"text": "caf\u00e9 au lait"}']
    path = tmp_path / "latin1.jsonl"
    path.write_bytes("\n".join(lines).encode("latin-1") + b"\n")
    byte = len(lines[0]) + 1 + lines[1].index("\u00e9")
    expect = f"{path} line 2 (byte {byte}) is not UTF-8 text"
    with pytest.raises(ValueError, match=re.escape(expect) + ".*convert it to UTF-8"):
        data.load_corpus(str(path), cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize("in_the_way", ["cache", "cache/datasets"])
def test_a_cache_dir_that_cannot_be_written_is_refused_naming_it_not_data(tmp_path, in_the_way):
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"doc {i}"} for i in range(4)])
    write(tmp_path / in_the_way, "a file where a directory should be")
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=f"^--cache-dir {cache} cannot be created or written"):
        data.load_corpus(str(docs), cache_dir=str(cache))
    write(tmp_path / "cache2" / "tokenizers", "in the way of the tokenizer cache")
    with pytest.raises(ValueError, match=f"^--cache-dir {tmp_path / 'cache2'} cannot be"):
        data.get_tokenizer(texts_dataset(SAMPLE_TEXTS), VOCAB, str(tmp_path / "cache2"))


@pytest.mark.parametrize("spec", ["stdlib", "docs.jsonl"])
def test_a_full_disk_while_the_corpus_is_cached_names_the_cache_not_the_data(
    tmp_path, monkeypatch, spec
):
    # datasets' writers report a full disk (a quota, a file size limit) as an OSError naming no
    # file, inside an error of their own: the message must name the cache, not blame a document
    # (for the stdlib, whose undecodable bytes are replaced, not one of its encoding tests).
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"doc {i}"} for i in range(4)])

    def full_disk(*args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise datasets.exceptions.DatasetGenerationError("An error occurred") from e

    monkeypatch.setattr("lib.checkpoints.files.load_cached", full_disk)
    cache = tmp_path / "cache"
    said = re.escape(f"--cache-dir {cache} cannot be created or written (No space left on device)")
    with pytest.raises(ValueError, match=f"^{said}"):
        data.load_corpus(spec if spec == "stdlib" else str(docs), cache_dir=str(cache))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_cache_dir_is_refused_naming_it(tmp_path):
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"doc {i}"} for i in range(4)])
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o555)
    with pytest.raises(ValueError, match=f"^--cache-dir {cache} cannot be created or written"):
        data.load_corpus(str(docs), cache_dir=str(cache))


# -----------------------------------------------------------------------------
# Fingerprints: what a checkpoint records of the data


def test_the_corpus_fingerprint_is_of_its_documents_and_is_hashed_once(tmp_path, monkeypatch):
    docs = [write(tmp_path / "a" / f"doc_{i}.txt", f"document {i}\n" * (i + 1)) for i in range(6)]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    cache = str(tmp_path / "cache")

    def fingerprint(spec: str) -> str:
        return data.fingerprint(data.load_corpus(spec, cache_dir=cache), cache)

    digest = fingerprint(str(tmp_path / "a"))
    assert re.fullmatch("[0-9a-f]{64}", digest)
    # The same documents, wherever they are and however the path is spelled.
    assert fingerprint(f"{tmp_path}/b//") == fingerprint(f"{tmp_path}/./a/") == digest
    # Once hashed, a start-up reads the digest from the cache instead of every document.
    assert os.listdir(os.path.join(cache, "fingerprints"))
    monkeypatch.setattr(data, "hash_texts", lambda *args: pytest.fail("hashed again"))
    assert fingerprint(str(tmp_path / "a")) == digest
    monkeypatch.undo()
    # Two documents swapped, one edited, one removed: each another fingerprint.
    texts = docs[0].read_text(), docs[1].read_text()
    docs[0].write_text(texts[1]), docs[1].write_text(texts[0])
    swapped = fingerprint(str(tmp_path / "a"))
    docs[2].write_text("edited\n")
    edited = fingerprint(str(tmp_path / "a"))
    docs[3].unlink()
    assert len({digest, swapped, edited, fingerprint(str(tmp_path / "a"))}) == 4


def test_a_streams_fingerprint_is_its_first_documents_and_its_files_sizes(tmp_path):
    files = [write_jsonl(tmp_path / "s" / f"{i}.jsonl", [{"text": f"d{i}"}]) for i in range(2)]
    source = corpus.resolve_source(str(tmp_path / "s"))
    digest = streaming.stream_fingerprint(source, ["first", "second"])
    assert digest == streaming.stream_fingerprint(corpus.resolve_source(f"{tmp_path}//s/"),
                                               ["first", "second"])  # fmt: skip
    assert streaming.stream_fingerprint(source, ["second", "first"]) != digest
    write_jsonl(files[1], [{"text": "d1"}, {"text": "one more document"}])  # the corpus grew
    assert streaming.stream_fingerprint(source, ["first", "second"]) != digest


@pytest.mark.parametrize("streaming", [False, True])
def test_build_datasets_gives_the_tokenizer_the_corpus_fingerprint(request, streaming):
    from harness import STREAMING, build_args

    from lib import training
    from lib.extras.streaming import (
        stream_fingerprint,  # (the parameter `streaming` hides the module)
    )

    # The session's corpus and cache (conftest.py); "corpus" is this module's name for
    # lib/extras/corpus.py.
    docs, cache = request.getfixturevalue("corpus"), request.getfixturevalue("cache_dir")
    args, plan = build_args(docs, cache, **(STREAMING if streaming else {}))
    *_, tokenizer = training.build_datasets(args, plan.tokenizer)
    if streaming:  # the stream's own (its validation documents, its files' sizes)
        loaded = corpus.resolve_source(str(docs))
        assert re.fullmatch("[0-9a-f]{64}", tokenizer.corpus_sha256)
        assert tokenizer.corpus_sha256 != stream_fingerprint(loaded, [])
    else:
        loaded = data.load_corpus(str(docs), cache_dir=str(cache))
        assert tokenizer.corpus_sha256 == data.fingerprint(loaded, str(cache))


# -----------------------------------------------------------------------------
# Split


def test_split_corpus_is_deterministic_disjoint_and_complete():
    ds = texts_dataset([f"doc {i}" for i in range(200)])
    train, val = data.split_corpus(ds, val_fraction=0.05, seed=3)
    train_again, val_again = data.split_corpus(ds, val_fraction=0.05, seed=3)
    assert val["text"] == val_again["text"] and train["text"] == train_again["text"]
    assert len(val) == 10
    assert not set(train["text"]) & set(val["text"])
    assert sorted([*train["text"], *val["text"]]) == sorted(ds["text"])


def test_split_corpus_keeps_one_validation_document_and_needs_two():
    train, val = data.split_corpus(texts_dataset(["a", "b"]), val_fraction=0.01)
    assert (len(train), len(val)) == (1, 1)
    with pytest.raises(ValueError, match="at least 2 documents"):
        data.split_corpus(texts_dataset(["only one"]))


# -----------------------------------------------------------------------------
# Tokenize


def test_tokenize_wraps_each_document_in_bot_and_eot(tokenizer):
    texts = ["x = 1\n", "def f():\n    return [BOT]\n"]
    ids = data.tokenize(texts_dataset(texts), tokenizer)
    assert ids.column_names == ["input_ids"]
    for text, row in zip(texts, ids["input_ids"], strict=True):
        assert row == [1, *tokenizer.encode(text), 2]
        assert row.count(1) == 1 and row.count(2) == 1


def test_tokenize_in_worker_processes_still_encodes_special_text_as_text(tokenizer):
    texts = [f"token {i} is [BOT] not a boundary" for i in range(4)]
    ids = data.tokenize(texts_dataset(texts), tokenizer, num_proc=2)
    assert all(row.count(1) == 1 for row in ids["input_ids"])


def test_encoding_sets_no_flag_that_is_already_set(tokenizer):
    # Setting encode_special_tokens borrows a tokenizers.Tokenizer exclusively: another thread
    # encoding meanwhile (--streaming's reader beside the main thread) then fails, "Already
    # borrowed" (tokenizers 0.22). So encoding only reads it, once it is on (the stand-in below
    # fails on a set); a --num-proc worker, whose unpickled copy lost it, sets it (test above).
    class ReadOnlyFlag:
        encode_special_tokens = property(lambda self: True, lambda self, value: pytest.fail("set"))

        def encode_batch(self, texts, add_special_tokens):
            return tokenizer.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)

    ids = data._encode_batch(["x = [BOT]"], ReadOnlyFlag(), 1, 2)["input_ids"]
    assert ids == [[1, *tokenizer.encode("x = [BOT]"), 2]]


def test_tokenize_with_worker_processes_gives_the_same_tokens_and_counts_them(tokenizer):
    docs = texts_dataset(SAMPLE_TEXTS * 3)  # 126 documents: two map() batches, or two processes
    one, two = data.tokenize(docs, tokenizer), data.tokenize(docs, tokenizer, num_proc=2)
    assert two["input_ids"] == one["input_ids"]
    assert data.count_tokens(two) == sum(len(row) for row in one["input_ids"])
    assert data.count_tokens(one.select([0, 42])) == len(one[0]["input_ids"]) * 2  # same text


def test_tokenize_second_call_loads_the_cached_result(tokenizer, tmp_path):
    write(tmp_path / "a.txt", "import os\nprint(os.getcwd())\n")
    write(tmp_path / "b.txt", "x = [i * i for i in range(10)]\n")
    docs = data.load_corpus(str(tmp_path / "*.txt"), cache_dir=str(tmp_path / ".cache"))
    first = data.tokenize(docs, tokenizer)
    [cache_file] = {f["filename"] for f in first.cache_files}
    stat = os.stat(cache_file)

    # A fresh tokenizer object from the same JSON, as in a new process.
    fresh = data.DocumentTokenizer(Tokenizer.from_str(tokenizer.to_str()), tokenizer.specials)
    second = data.tokenize(docs, fresh)
    assert {f["filename"] for f in second.cache_files} == {cache_file}
    assert (os.stat(cache_file).st_ino, os.stat(cache_file).st_mtime_ns) == (
        stat.st_ino,
        stat.st_mtime_ns,
    )  # not rewritten
    assert second["input_ids"] == first["input_ids"]


def test_tokenize_with_a_different_tokenizer_does_not_reuse_the_cache(tokenizer, tmp_path):
    write(tmp_path / "a.txt", "import os\n\nprint(os.getcwd())\n")  # two paragraphs
    docs = data.load_corpus(str(tmp_path / "a.txt"), cache_dir=str(tmp_path / ".cache"))
    other = data.get_tokenizer(texts_dataset(["print(os.getcwd())\n" * 20]), VOCAB, str(tmp_path))
    first, second = data.tokenize(docs, tokenizer), data.tokenize(docs, other)
    assert first.cache_files != second.cache_files
    assert second["input_ids"][0] == [1, *other.encode(docs["text"][0]), 2]


# -----------------------------------------------------------------------------
# PretrainingDataset


def test_pad_mode_layout():
    doc = [1, 10, 11, 12, 2]  # [BOT] three tokens [EOT]
    x, y = data.PretrainingDataset(ids_dataset([doc]), seq_length=8, mode="pad", pad_id=0)[0]
    assert x.tolist() == [1, 10, 11, 12, 2, 0, 0, 0]
    ignore = IGNORE_INDEX
    assert y.tolist() == [10, 11, 12, 2, ignore, ignore, ignore, ignore]
    assert x.dtype == y.dtype == torch.int64


def test_pad_mode_clips_long_documents_and_has_one_example_per_document():
    docs = [[1, *range(10, 30), 2], [1, 5, 2]]
    ds = data.PretrainingDataset(ids_dataset(docs), seq_length=6, mode="pad")
    assert len(ds) == 2
    x, y = ds[0]
    assert x.tolist() == [1, 10, 11, 12, 13, 14]
    assert y.tolist() == [10, 11, 12, 13, 14, 15]  # no padding, nothing ignored


def test_pack_mode_covers_every_token_exactly_once(tokenizer, tmp_path):
    for i in range(12):
        write(tmp_path / f"doc{i:02}.txt", SAMPLE_TEXTS[i] * (i % 3 + 1))
    docs = data.load_corpus(str(tmp_path), cache_dir=str(tmp_path / ".cache"))
    ids = data.tokenize(docs, tokenizer)
    stream = [t for row in ids["input_ids"] for t in row]  # 12 docs: all in one map batch
    seq_length = 16
    ds = data.PretrainingDataset(ids, seq_length)

    assert len(ds) == (len(stream) - 1) // seq_length
    pairs = [ds[i] for i in range(len(ds))]
    rebuilt = torch.cat([x for x, _ in pairs] + [pairs[-1][1][-1:]]).tolist()
    assert rebuilt == stream[: len(rebuilt)]
    assert len(stream) - len(rebuilt) < seq_length  # only the tail that fills no window is lost


def test_pack_mode_windows_overlap_by_one_token_with_no_tail_lost():
    docs = [[1, 10, 11, 2], [1, 20, 21, 22, 23, 2], [1, 30, 2]]  # 13 tokens = 3 * 4 + 1
    ds = data.PretrainingDataset(ids_dataset(docs), seq_length=4)
    assert [ds[i][0].tolist() for i in range(len(ds))] == [
        [1, 10, 11, 2],
        [1, 20, 21, 22],
        [23, 2, 1, 30],
    ]
    assert ds[2][1].tolist() == [2, 1, 30, 2]  # the stream's last token is a target


def test_pack_mode_gives_int64_x_and_shifted_y_of_seq_length():
    ds = data.PretrainingDataset(ids_dataset([list(range(1, 50))]), seq_length=7)
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.shape == y.shape == (7,)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x[1:], y[:-1])


def test_pack_mode_with_too_few_tokens_says_how_many_are_needed():
    with pytest.raises(ValueError, match="has 5 tokens.*at least 9"):
        data.PretrainingDataset(ids_dataset([[1, 3, 2], [1, 2]]), seq_length=8)


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="unknown mode 'stack'"):
        data.PretrainingDataset(ids_dataset([[1, 2]]), seq_length=4, mode="stack")


def test_build_datasets_prints_the_corpus_in_tokens_and_the_share_of_an_epoch(
    tmp_path, capsys, monkeypatch
):
    from harness import build_args, write_corpus

    from lib import training

    monkeypatch.delenv("RANK", raising=False)
    docs = write_corpus(tmp_path / "docs")
    args, plan = build_args(docs, tmp_path / "cache", num_proc=2, max_steps=30)
    train, val, tokenizer = training.build_datasets(args, plan.tokenizer)
    out = capsys.readouterr().out
    train_docs, val_docs = data.split_corpus(
        data.load_corpus(str(docs), cache_dir=args.cache_dir), 0.125
    )
    tokens = sum(len(tokenizer.encode(t)) + 2 for t in train_docs["text"])
    steps = len(train) // 8
    assert (
        f"data: 28 train documents = {tokens:,} tokens -> {len(train):,} sequences of 32 (pack); "
        f"4 validation documents = " in out
    )
    assert f" tokens -> {len(val.dataset)} sequences\n" in out  # (val: the first --eval-batches)
    assert f"this run: 30 steps x 8 sequences = 240 sequences = {30 / steps:.2f} epochs" in out

    monkeypatch.setenv("RANK", "1")  # printed once, by global rank 0
    training.build_datasets(args, plan.tokenizer)
    assert "data:" not in capsys.readouterr().out


def test_benchmark_loader_reports_a_positive_speed():
    ds = data.PretrainingDataset(ids_dataset([list(range(100))]), seq_length=8)
    assert bench_loader.benchmark_loader(ds, batch_size=4, num_batches=5) > 0


# -----------------------------------------------------------------------------
# main_process_first


def test_main_process_first_without_distributed_just_runs_the_body():
    ran = []
    with distributed.main_process_first():
        ran.append(True)
    assert ran == [True]


def _record_order(rank: int, store: str, log: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    with distributed.main_process_first():
        with open(log, "a") as f:
            f.write(f"{rank} start\n")
        time.sleep(
            0.3 if rank == 0 else 0
        )  # rank 1 would overtake a slow rank 0 without the barrier
        with open(log, "a") as f:
            f.write(f"{rank} end\n")
    dist.destroy_process_group()


def test_main_process_first_runs_local_rank_0_before_the_others(tmp_path):
    # fork: the children inherit the imported modules, so nothing is re-imported.
    context = multiprocessing.get_context("fork")
    log = tmp_path / "log.txt"
    args = (str(tmp_path / "store"), str(log))
    procs = [context.Process(target=_record_order, args=(rank, *args)) for rank in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert log.read_text().split("\n")[:-1] == ["0 start", "0 end", "1 start", "1 end"]
