"""Specification of tokenizers made elsewhere (lib/extras/hf_tokenizer.py): any Hugging Face
tokenizer.json works, its beginning/end-of-document and padding tokens found by the flags
(--bot-token, ...), a tokenizer_config.json beside it, or the usual names, in that order; and
whatever is wrong with them is said before any data is read."""

from pathlib import Path

import datasets
import pytest
from conftest import tiny_model
from harness import build_args, write_foreign_tokenizer

import data
from lib.checkpoints.finished_run import load_model
from lib.checkpoints.model_pt import save_final

LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
TEXT = "def add(x, y):\n    return x + y"


def specials(tokenizer) -> tuple:
    return tuple(tokenizer.specials[role] for role in ("bot", "eot", "pad"))


def test_a_gpt2_style_tokenizer_begins_and_ends_documents_with_endoftext(tmp_path):
    tokenizer = data.load_tokenizer(str(write_foreign_tokenizer(tmp_path, ["<|endoftext|>"])))
    # One token for both ends, and no padding token: pad mode pads with the end token.
    assert specials(tokenizer) == ("<|endoftext|>",) * 3
    assert tokenizer.bot_id == tokenizer.eot_id == tokenizer.pad_id == 0


def test_a_llama3_style_tokenizer_is_found_and_its_bos_is_not_doubled(tmp_path):
    path = write_foreign_tokenizer(tmp_path, LLAMA3, bos_post_processor="<|begin_of_text|>")
    tokenizer = data.load_tokenizer(str(path))
    assert specials(tokenizer) == ("<|begin_of_text|>", "<|end_of_text|>", "<|end_of_text|>")
    # The tokenizer's own post-processor would add <|begin_of_text|> too: it must not run.
    assert tokenizer.tokenizer.encode(TEXT).ids[0] == tokenizer.bot_id
    [row] = data.tokenize(datasets.Dataset.from_dict({"text": [TEXT]}), tokenizer)["input_ids"]
    assert row == [tokenizer.bot_id, *tokenizer.encode(TEXT), tokenizer.eot_id]
    assert row[1] != tokenizer.bot_id and tokenizer.decode(row) == TEXT
    # A literal special token in a text is text.
    assert tokenizer.bot_id not in tokenizer.encode("<|begin_of_text|> is text")


def test_tokenizer_config_beside_wins_over_conventions_and_flags_over_both(tmp_path):
    path = write_foreign_tokenizer(tmp_path, LLAMA3, eos_token={"content": "<|eot_id|>"})
    assert data.load_tokenizer(str(path)).specials["eot"] == "<|eot_id|>"  # HF's object form
    flagged = data.load_tokenizer(str(path), {"eot": "<|end_of_text|>", "pad": "<|eot_id|>"})
    assert specials(flagged) == ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")


def test_unknown_or_missing_special_tokens_are_refused_naming_the_flag(tmp_path):
    path = str(write_foreign_tokenizer(tmp_path / "llama", LLAMA3))
    with pytest.raises(ValueError, match=r"--bot-token '<s>' is not a token of .*tokenizer.json"):
        data.load_tokenizer(path, {"bot": "<s>"})
    path = str(write_foreign_tokenizer(tmp_path / "bare", ["<unk>"]))
    with pytest.raises(ValueError, match=r"none of the usual beginning-of-document .*--bot-token"):
        data.load_tokenizer(path)


def test_a_folder_or_a_missing_file_as_the_tokenizer_is_named_for_what_it_is(tmp_path):
    with pytest.raises(ValueError, match=r"is a folder: name the tokenizer.json in it"):
        data.load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match=r"'.*nothing.json' does not exist"):
        data.load_tokenizer(str(tmp_path / "nothing.json"))


def test_a_run_refuses_bad_special_tokens_before_reading_data(tmp_path, corpus, cache_dir):
    path = str(write_foreign_tokenizer(tmp_path, ["<unk>"]))
    for flags, message in [
        ({"tokenizer": path}, "none of the usual beginning-of-document tokens"),
        ({"tokenizer": path, "bot_token": "<unk>", "eot_token": "<nope>"}, "--eot-token '<nope>'"),
        ({"eot_token": "<unk>"}, "the one a run trains has its own: \\[BOT\\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            build_args(corpus, cache_dir, **flags)  # the scripts' own parse and checks


def test_an_out_dir_keeps_its_special_tokens_for_generate_and_init_from(tmp_path):
    tokenizer = data.load_tokenizer(str(write_foreign_tokenizer(tmp_path / "tok", LLAMA3)))
    model = tiny_model(tokenizer.get_vocab_size())
    flagged = data.load_tokenizer(str(tmp_path / "tok" / "tokenizer.json"), {"eot": "<|eot_id|>"})
    (tmp_path / "out").mkdir()
    save_final(str(tmp_path / "out"), model, model.config, flagged)
    _, loaded = load_model(str(tmp_path / "out"))
    assert loaded.specials == flagged.specials  # from out/tokenizer_config.json
    assert loaded.eot_id == tokenizer.token_to_id("<|eot_id|>")


@pytest.mark.parametrize("damage", ["unparsable", "flipped_byte", "from_before_checksums"])
def test_a_damaged_cached_tokenizer_is_trained_again_with_a_warning(tmp_path, capsys, damage):
    # Once: "Exception: key must be a string at line 331 column 5", a traceback; and a flipped
    # byte that still parses (a setting changed) was used as it was, as was any tokenizer cached
    # without checksums (from before them), whatever its bytes.
    texts = datasets.Dataset.from_dict({"text": ["def f(x):\n    return x + 1\n"] * 20})
    first = data.get_tokenizer(texts, 300, str(tmp_path))
    [cached] = (tmp_path / "tokenizers").glob("*/tokenizer.json")
    text = cached.read_text()
    if damage == "unparsable":
        cached.write_text(text.replace('"vocab": {', '"vocab": {3: 1, ', 1))
    else:
        cached.write_text(text.replace('"fuse_unk": false', '"fuse_unk": true', 1))
    if damage == "from_before_checksums":
        Path(f"{cached}.sums").unlink()
    again = data.get_tokenizer(texts, 300, str(tmp_path))
    err = capsys.readouterr().err
    said = "has no checksums (a cache from before them)" if damage.startswith("from") else (
        "is damaged")  # fmt: skip
    assert err.startswith(f"warning: the cached tokenizer {cached} {said}"), err
    assert err.count("\n") == 1, err
    assert again.to_str() == first.to_str() and cached.read_text() == text
    data.get_tokenizer(texts, 300, str(tmp_path))
    assert capsys.readouterr().err == ""  # (trained again, and whole)
