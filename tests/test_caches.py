"""Specification of the caches' checks (lib/checkpoints/files.py, at its end): every file the data
pipeline caches under --cache-dir (the corpus as read, the documents kept, the tokens, the packed
windows, the corpus fingerprint, the trained tokenizer) is checked by its checksums before it is
used; a damaged one, or one that cannot be verified, is made again with a one-line warning,
never used as it is."""

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest

import data
from lib.checkpoints import files

REPO = Path(__file__).resolve().parents[1]
VOCAB, SEQ = 300, 16
# What the warning calls each cached file, by the step that makes it.
WHAT = {"corpus": "the corpus as read", "kept": "the documents kept", "tokens": "the tokens",
        "windows": "the packed windows"}  # fmt: skip


def write_corpus(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [
        {"text": f"def f_{i}(x):\n    return x * {i} + {i * i}\n" * (i % 4 + 1)} for i in range(60)
    ]
    rows[7]["text"] = "   "  # dropped: the documents kept are a file of their own (an index)
    (folder / "docs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder / "docs.jsonl"


def pipeline(corpus: Path, cache: Path) -> dict:
    """Each cached step of a run's data, as a new process makes (or finds) it: the datasets, by
    the name of their step."""
    files._cached_ok.clear()  # (a new process has verified nothing yet)
    docs = data.load_corpus(str(corpus), cache_dir=str(cache))
    tokenizer = data.get_tokenizer(docs, VOCAB, str(cache))
    tokens = data.tokenize(docs, tokenizer)
    windows = data.PretrainingDataset(tokens, SEQ).rows
    return {"docs": docs, "tokens": tokens, "windows": windows}


def cached_files(made: dict) -> dict[str, str]:
    """The Arrow file of each step: the corpus as read and the documents kept (its index) back
    docs; tokens and windows one each."""
    corpus, kept = (f["filename"] for f in made["docs"].cache_files)
    [tokens] = (f["filename"] for f in made["tokens"].cache_files)
    [windows] = (f["filename"] for f in made["windows"].cache_files)
    return {"corpus": corpus, "kept": kept, "tokens": tokens, "windows": windows}


def contents(made: dict) -> tuple:
    return made["docs"]["text"], made["tokens"]["input_ids"], made["windows"][:]["window"].tolist()


@pytest.fixture(scope="module", autouse=True)
def no_progress_bars():
    """datasets' progress bars off (they go to stderr, which the tests read), then back on."""
    datasets.disable_progress_bars()
    yield
    datasets.enable_progress_bars()


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """(corpus, a cache as a first run leaves it, what it holds)."""
    root = tmp_path_factory.mktemp("first")
    corpus = write_corpus(root / "corpus")
    made = pipeline(corpus, root / "cache")
    return corpus, root / "cache", contents(made)


def copy_cache(first_run, tmp_path: Path) -> Path:
    """A copy of the first run's cache (datasets' paths in it are its own: the same names)."""
    shutil.copytree(first_run[1], tmp_path / "cache")
    return tmp_path / "cache"


def flip_a_byte(path: str) -> None:
    raw = bytearray(Path(path).read_bytes())
    raw[len(raw) * 2 // 3] ^= 0x01
    Path(path).write_bytes(bytes(raw))


@pytest.mark.quick
def test_a_first_run_sums_every_cached_file_and_a_second_reads_them_unchanged(
    first_run, tmp_path, capsys
):
    corpus, _, expected = first_run
    cache = copy_cache(first_run, tmp_path)
    made = pipeline(corpus, cache)
    assert contents(made) == expected and capsys.readouterr().err == ""
    for path in cached_files(made).values():
        assert os.path.isfile(f"{path}{files.SUMS}"), path
    stats = {p: os.stat(p).st_mtime_ns for p in cached_files(made).values()}
    pipeline(corpus, cache)
    assert {p: os.stat(p).st_mtime_ns for p in stats} == stats  # found, checked, not made again


@pytest.mark.quick
@pytest.mark.parametrize("damage", ["flipped_byte", "truncated", "checksums_garbled"])
@pytest.mark.parametrize("step", ["corpus", "kept", "tokens", "windows"])
def test_a_damaged_cache_file_is_made_again_with_a_one_line_warning(
    first_run, tmp_path, capsys, step, damage
):
    # Once: a flipped byte in any of them was trained on without a word (a token id 16777489,
    # in the tokens, ended in an IndexError deep in the embedding); a truncated one ended in
    # pyarrow's traceback ("Expected to be able to read 7200 bytes for message body"), or blamed
    # --data for the corpus.
    corpus, _, expected = first_run
    cache = copy_cache(first_run, tmp_path)
    path = cached_files(pipeline(corpus, cache))[step]
    capsys.readouterr()
    if damage == "flipped_byte":
        flip_a_byte(path)
    elif damage == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        Path(f"{path}{files.SUMS}").write_text('{"chunk": "x", "crc32": []}')
    made = pipeline(corpus, cache)
    err = capsys.readouterr().err
    assert err.startswith(f"warning: {path} ({WHAT[step]}, cached) ") and err.count("\n") == 1, err
    assert err.rstrip().endswith(": making it again"), err
    assert ("has checksums that cannot be read" if damage == "checksums_garbled" else
            "is damaged: its bytes are not those written") in err  # fmt: skip
    assert contents(made) == expected
    assert contents(pipeline(corpus, cache)) == expected and capsys.readouterr().err == ""


@pytest.mark.quick
def test_a_cache_from_before_checksums_is_made_again_once(first_run, tmp_path, capsys):
    # Once: a cache without checksums (an older suite's) was used as it was; so was a file whose
    # checksums were never written (a kill between datasets' rename and them).
    corpus, _, expected = first_run
    cache = copy_cache(first_run, tmp_path)
    for sums in cache.rglob(f"*{files.SUMS}"):
        sums.unlink()
    made = pipeline(corpus, cache)
    lines = capsys.readouterr().err.splitlines()
    corpus_file = cached_files(made)["corpus"]
    # The corpus as read is prepared anew, and everything made from it with it (datasets
    # empties its folder), the tokenizer trained again: a warning for each of the two.
    assert lines[0] == (f"warning: {corpus_file} (the corpus as read, cached) has no checksums "
                        f"(a cache from before them, or one whose writing was cut short): "
                        f"making it again"), lines  # fmt: skip
    assert lines[1].startswith("warning: the cached tokenizer ") and len(lines) == 2, lines
    assert "has no checksums (a cache from before them)" in lines[1]
    assert contents(made) == expected
    Path(f"{cached_files(made)['tokens']}{files.SUMS}").unlink()  # (one file's, cut short)
    assert contents(pipeline(corpus, cache)) == expected
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: {cached_files(made)['tokens']} (the tokens, cached) has no")


@pytest.mark.quick
@pytest.mark.parametrize("damage", ["edited", "without_checksums"])
def test_a_damaged_corpus_fingerprint_is_hashed_again(first_run, tmp_path, monkeypatch, damage):
    # Once: an edited digest in cache/fingerprints/ was recorded in every checkpoint of the run
    # (and refused their resume, "other documents"), as long as it had 64 characters.
    corpus, _, _ = first_run
    cache = copy_cache(first_run, tmp_path)
    docs = pipeline(corpus, cache)["docs"]
    digest = data.fingerprint(docs, str(cache))
    [memo] = (cache / "fingerprints").glob("*.sha256")
    if damage == "edited":
        memo.write_text(("0" if digest[0] != "0" else "1") + digest[1:])
    else:
        Path(f"{memo}{files.SUMS}").unlink()
    assert data.fingerprint(docs, str(cache)) == digest
    monkeypatch.setattr(data, "hash_texts", lambda *args: pytest.fail("hashed again"))
    assert data.fingerprint(docs, str(cache)) == digest  # (written again, with its checksums)


CHILD = """
import sys, time
sys.path.insert(0, {repo!r})
import data, datasets
datasets.disable_progress_bars()
time.sleep(max(0.0, {start} - time.time()))  # both at once, past their imports
docs = data.load_corpus({corpus!r}, cache_dir={cache!r})
tokens = data.tokenize(docs, data.get_tokenizer(docs, {vocab}, {cache!r}))
print(len(data.PretrainingDataset(tokens, {seq})), sum(map(len, tokens["input_ids"])))
"""


def test_two_runs_sharing_a_new_cache_dir_at_once_both_succeed_and_leave_it_whole(
    first_run, tmp_path, capsys
):
    # Once (before files.one_at_a_time): one run found the other's file between datasets'
    # rename and its checksums, took it for one whose writing was cut short ("has no
    # checksums"), and removed it to make it again, under the other run's feet.
    corpus, _, expected = first_run
    cache = tmp_path / "cache"
    start = time.time() + 8  # (a child's imports take ~3 s on a busy 2-core machine)
    code = CHILD.format(repo=str(REPO), start=start, corpus=str(corpus), cache=str(cache),
                        vocab=VOCAB, seq=SEQ)  # fmt: skip
    children = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    results = [child.communicate(timeout=300) for child in children]
    for child, (_, err) in zip(children, results, strict=True):
        assert child.returncode == 0 and "warning" not in err and "Traceback" not in err, err
    assert results[0][0] == results[1][0]
    assert contents(pipeline(corpus, cache)) == expected  # every file found whole
    assert capsys.readouterr().err == ""


@pytest.mark.quick
def test_a_prepared_corpus_missing_its_file_is_made_again(first_run, tmp_path, capsys):
    # Once: "error: --data ...: cannot be read: [Errno 2] Failed to open local file
    # '.../json-train.arrow'", blaming the data for a file deleted from the cache.
    corpus, _, expected = first_run
    cache = copy_cache(first_run, tmp_path)
    path = cached_files(pipeline(corpus, cache))["corpus"]
    capsys.readouterr()
    os.remove(path)
    assert contents(pipeline(corpus, cache)) == expected
    err = capsys.readouterr().err
    assert err.startswith(f"warning: {os.path.dirname(path)} (the corpus as read, cached) lacks a")
    assert err.count("\n") == 1 and err.rstrip().endswith("making it again"), err


@pytest.mark.quick
def test_a_full_disk_while_tokenizing_names_the_cache_in_one_line(first_run, tmp_path, monkeypatch):
    # Once: OSError: [Errno 27] File too large, in a traceback from fsspec (a file size limit).
    corpus, _, _ = first_run
    cache = copy_cache(first_run, tmp_path)
    made = pipeline(corpus, cache)
    tokenizer = data.get_tokenizer(made["docs"], VOCAB, str(cache))
    folder = os.path.dirname(cached_files(made)["tokens"])
    os.remove(cached_files(made)["tokens"])  # (the tokens are made again)

    def full(*args, **kwargs):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(datasets.Dataset, "map", full)
    with pytest.raises(ValueError) as error:
        data.tokenize(made["docs"], tokenizer)
    assert str(error.value).startswith(f"--cache-dir: the tokens cannot be written into {folder}")
    assert "(File too large)" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.quick
def test_a_damaged_cache_file_that_cannot_be_removed_is_refused_in_one_line(
    first_run, tmp_path, monkeypatch, capsys
):
    # A cache shared with another user, read-only to this one (root writes anywhere: a removal
    # that fails stands in for it).
    corpus, _, _ = first_run
    cache = copy_cache(first_run, tmp_path)
    path = cached_files(pipeline(corpus, cache))["tokens"]
    flip_a_byte(path)
    real = os.remove

    def refused(name, *args, **kwargs):
        if str(name).startswith(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(os, "remove", refused)
    with pytest.raises(ValueError) as error:
        pipeline(corpus, cache)
    assert capsys.readouterr().err == ""  # (no warning that it is made again: it is not)
    message = str(error.value)
    assert message.startswith(f"{path} (the tokens, cached) is damaged") and "\n" not in message
    assert "cannot be removed (Permission denied): remove it by hand, or choose another" in message
