"""Specification of the caches' checks (lib/checkpoints/files.py, at its end): every file the data
pipeline caches under --cache-dir (the corpus as read, the documents kept, the tokens, the packed
windows, the corpus fingerprint, the trained tokenizer) is checked by its checksums before it is
used; a damaged one, or one that cannot be verified, is made again with a one-line warning,
never used as it is."""

import errno
import hashlib
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


def write_corpus(folder: Path, documents: int = 60) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [
        {"text": f"def f_{i}(x):\n    return x * {i} + {i * i}\n" * (i % 4 + 1)}
        for i in range(documents)
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
    before = cached_files(pipeline(corpus, cache))
    path = before[step]
    others = {p: os.stat(p).st_ino for p in before.values() if p != path}
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
    # Only that file is made again: the others (for the corpus, every cache made from it) stay.
    assert {p: os.stat(p).st_ino for p in others} == others
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
    # Each is made again, with a warning of its own: the corpus as read is prepared anew beside
    # its folder (the caches made from it stay there, each checked as it is reached), the
    # tokenizer trained again.
    made_files = cached_files(made)
    steps = ["corpus", "kept", "tokenizer", "tokens", "windows"]
    assert len(lines) == len(steps), lines
    for line, step in zip(lines, steps, strict=True):
        if step == "tokenizer":
            assert line.startswith("warning: the cached tokenizer ") and (
                "has no checksums (a cache from before them)" in line), line  # fmt: skip
        else:
            assert line == (f"warning: {made_files[step]} ({WHAT[step]}, cached) has no checksums "
                            f"(a cache from before them, or one whose writing was cut short): "
                            f"making it again"), line  # fmt: skip
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
    before = cached_files(pipeline(corpus, cache))
    path = before.pop("corpus")
    others = {p: os.stat(p).st_ino for p in before.values()}
    capsys.readouterr()
    os.remove(path)
    assert contents(pipeline(corpus, cache)) == expected
    err = capsys.readouterr().err
    assert err.startswith(f"warning: {os.path.dirname(path)} (the corpus as read, cached) lacks a")
    assert err.count("\n") == 1 and err.rstrip().endswith("making it again"), err
    assert {p: os.stat(p).st_ino for p in others} == others  # (the caches made from it stay)


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


# A run paused in its tokenizing map (the encoder held at its second batch, the first written,
# until a line comes on stdin): a moment of the test's choosing, not a race, for another run to
# find the corpus damaged and make it again.
PAUSED_CHILD = """
import functools, hashlib, sys
sys.path.insert(0, {repo!r})
import data, datasets
datasets.disable_progress_bars()
encode, batches = data._encode_batch, []

@functools.wraps(encode)  # (the tokens' cache key is the same: it reads the wrapped source)
def encode_after_a_pause(texts, **ids):
    batches.append(len(texts))
    if len(batches) == 2:
        print("paused", flush=True)
        sys.stdin.readline()
    return encode(texts, **ids)

data._encode_batch = encode_after_a_pause
docs = data.load_corpus({corpus!r}, cache_dir={cache!r})
tokens = data.tokenize(docs, data.get_tokenizer(docs, {vocab}, {cache!r}))
windows = data.PretrainingDataset(tokens, {seq}).rows[:]["window"]
print(hashlib.sha256(windows.tobytes()).hexdigest())
"""


def test_a_corpus_made_again_under_a_run_tokenizing_it_loses_nothing_of_that_run(tmp_path, capsys):
    # Once: datasets prepared the damaged corpus anew in a folder of its own and renamed that
    # over the old one (shutil.rmtree first), deleting under the tokenizing run the file its map
    # was writing (FileNotFoundError at datasets' rename) and every cache made from the corpus.
    corpus = write_corpus(tmp_path / "corpus", documents=200)  # (tokenized in 4 map batches)
    reference = pipeline(corpus, tmp_path / "reference")
    windows = hashlib.sha256(reference["windows"][:]["window"].tobytes()).hexdigest()
    cache = tmp_path / "cache"
    code = PAUSED_CHILD.format(
        repo=str(REPO), corpus=str(corpus), cache=str(cache), vocab=VOCAB, seq=SEQ
    )
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    child = subprocess.Popen([sys.executable, "-c", code], text=True, **pipes)
    try:
        assert child.stdout.readline() == "paused\n"  # (else it ended: its error below)
        [corpus_file] = cache.rglob("json-train.arrow")
        folder = corpus_file.parent
        theirs = [p for p in folder.iterdir() if not p.name.startswith(("json-", "dataset_info"))]
        made = {p: p.stat().st_ino for p in theirs}  # (the corpus aside: it is made again)
        assert any(p.name.startswith("tmp") for p in made), made  # (the map's file, being written)
        # A damaged copy renamed over it (flipped in place, the byte would be flipped under the
        # tokenizing run too, which had found the file whole and maps it).
        shutil.copy(corpus_file, tmp_path / "copy.arrow")
        flip_a_byte(str(tmp_path / "copy.arrow"))
        os.replace(tmp_path / "copy.arrow", corpus_file)
        files._cached_ok.clear()
        docs = data.load_corpus(str(corpus), cache_dir=str(cache))  # made again meanwhile
        assert docs["text"] == reference["docs"]["text"]
        lost = [p.name for p, inode in made.items() if not p.exists() or p.stat().st_ino != inode]
        err = capsys.readouterr().err
        assert err.startswith(f"warning: {corpus_file} (the corpus as read, cached) is damaged")
    finally:
        try:
            out, child_err = child.communicate("go\n", timeout=300)
        finally:
            child.kill()  # (if it never ended: ended already, nothing happens)
    assert child.returncode == 0 and "Traceback" not in child_err, child_err
    assert out.splitlines()[-1] == windows  # the tokenizing run's windows are the right ones
    assert lost == []  # nothing it had made or was making was deleted under it
    assert contents(pipeline(corpus, cache)) == contents(reference)  # and all of it is whole
    assert capsys.readouterr().err == ""
