"""Specification of bits per byte: every evaluation reports, beside the loss per token, the loss in
bits per byte of the text the validation targets stand for, which compares runs whatever their
tokenizers (a tokenizer with longer tokens has a higher loss per token for the same model).

A token's bytes come from the tokenizer's vocabulary (data.DocumentTokenizer.token_bytes): for a
byte-level BPE (this suite's, GPT-2's, Llama 3's) one byte per character of its string, for a
SentencePiece-style one the UTF-8 of its text ("▁" a space, "<0x0A>" one byte); special tokens
stand for no text. The test of that: the bytes of a text's tokens add up to the text's.
"""

import math

import pytest
import torch
from harness import DP, build_args, cmd, read_metrics, run_script
from tokenizers import Tokenizer, models, pre_tokenizers

import data
from lib import training

pytestmark = pytest.mark.quick

TEXT = "def add(x, y):\n    return x + y  # é, ü, 漢字 and 🙂\n\tdone"


def test_a_byte_level_tokenizers_token_bytes_add_up_to_the_texts(out_dir):
    tokenizer = data.load_tokenizer(str(out_dir / "tokenizer.json"))  # as data.py trains them
    sizes = tokenizer.token_bytes()
    assert int(sizes[tokenizer.encode(TEXT)].sum()) == len(TEXT.encode())
    assert sizes[tokenizer.bot_id] == sizes[tokenizer.eot_id] == sizes[tokenizer.pad_id] == 0


def test_a_sentencepiece_style_tokenizers_token_bytes_add_up_to_the_texts(tmp_path):
    # "▁" for a space, a byte fallback for what the vocabulary lacks (Llama 2's and Mistral's
    # kind), built with the tokenizers library by hand.
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += ["▁def", "▁add", "(x,", "▁y):", "▁return", "▁x", "▁+", "▁y", "▁#", "▁and", "▁"]
    model = models.Unigram([(piece, -1.0) for piece in pieces], unk_id=0, byte_fallback=True)
    sp = Tokenizer(model)
    # (prepend_scheme "first", Llama 2's, adds a space no text has: one byte more per document)
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    sp.add_special_tokens(["<s>", "</s>"])
    path = tmp_path / "tokenizer.json"
    sp.save(str(path))
    tokenizer = data.load_tokenizer(str(path), {"bot": "<s>", "eot": "</s>", "pad": "</s>"})
    text = "def add(x, y):  é"
    ids = tokenizer.encode(text)
    pieces = [sp.id_to_token(i) for i in ids]  # both kinds: whole pieces and lone bytes
    assert "▁add" in pieces and "<0x64>" in pieces and "<0xC3>" in pieces, pieces
    assert int(tokenizer.token_bytes()[ids].sum()) == len(text.encode())


def test_validation_logs_bits_per_byte_of_its_targets_text(corpus, cache_dir, tmp_path):
    out = tmp_path / "out"
    run_script(DP, cmd(corpus, cache_dir, out, max_steps=4))
    _, evals = read_metrics(out)
    # What the loop divides by, recomputed here: the targets' count and their text's bytes.
    args, plan = build_args(corpus, cache_dir, max_steps=4)
    _, val_set, tokenizer = training.build_datasets(args, plan.tokenizer)
    targets = torch.cat([val_set[i][1] for i in range(len(val_set))])
    counted = targets[targets != -100]
    text_bytes = int(tokenizer.token_bytes()[counted].sum())
    assert evals and text_bytes > len(counted) / 2
    for record in evals:
        bits = record["val_loss"] * len(counted) / math.log(2) / text_bytes
        assert record["val_bpb"] == pytest.approx(bits, rel=1e-6)
