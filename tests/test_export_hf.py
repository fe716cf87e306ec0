"""Specification of tools/export_hf.py: our out-dir <-> a Hugging Face Llama directory.

Without `transformers` these tests still prove the files: every tensor gets its Hugging Face
name, config.json has the fields transformers reads, and export followed by --from-hf gives back
the very same model. With `transformers` (a test dependency), the last tests load the export in
LlamaForCausalLM and compare logits and token ids, and import what transformers itself saves:
sharded, with Llama 3's RoPE scaling and a Llama 3 style tokenizer, then continue training it.
"""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import DP, cmd, run_script, snapshot, write_foreign_tokenizer
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

import data
from lib import exits
from lib.checkpoints import files
from lib.checkpoints import model_pt as final_files
from lib.checkpoints.finished_run import load_model
from lib.extras.sampling import generate_text
from tools import evaluate, export_hf

REPO = Path(__file__).resolve().parents[1]
TEXT = "def add(x, y):\n    return x + y"
HF_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "final.sums"}  # fmt: skip


def hf_names(num_layers: int, tied: bool) -> set[str]:
    """The tensor names of transformers' LlamaForCausalLM, written out independently."""
    names = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if tied else {
        "lm_head.weight"})  # fmt: skip
    for i in range(num_layers):
        for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                       "input_layernorm", "post_attention_layernorm"):  # fmt: skip
            names.add(f"model.layers.{i}.{module}.weight")
    return names


def run_export(*argv: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "tools.export_hf", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def exported(request, make_out_dir, tmp_path_factory):
    """(out_dir, hf_dir): a tiny out-dir and its export, with and without tied embeddings."""
    out = make_out_dir(tie=request.param)
    hf_dir = tmp_path_factory.mktemp("hf")
    export_hf.export(str(out), str(hf_dir))
    return out, hf_dir


# -------------------------------------------------------------------------------------------------
# The exported directory


def test_export_writes_the_files_transformers_reads(exported):
    _, hf_dir = exported
    assert {p.name for p in hf_dir.iterdir()} == HF_FILES


def test_the_weights_are_as_readable_as_the_other_files(exported):
    # safetensors writes its file private (0600): on a shared machine no one else could load it.
    _, hf_dir = exported
    mode = {p.name: p.stat().st_mode & 0o777 for p in hf_dir.iterdir()}
    assert mode["model.safetensors"] == mode["config.json"], mode


def test_config_json_has_the_fields_transformers_needs(exported):
    out, hf_dir = exported
    ours = json.loads((out / "config.json").read_text())
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    # Every shape field, same names; the fingerprint is of the tokenizer.json beside each.
    ours_sha, theirs_sha = ours.pop("tokenizer_sha256"), config["tokenizer_sha256"]
    assert {name: config[name] for name in ours} == ours
    assert ours_sha == data.tokenizer_digest(data.load_tokenizer(str(out / "tokenizer.json")))
    assert theirs_sha == data.tokenizer_digest(data.load_tokenizer(str(hf_dir / "tokenizer.json")))
    assert config["head_dim"] == ours["hidden_size"] // ours["num_attention_heads"]
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    assert config["hidden_act"] == "silu" and config["torch_dtype"] == "float32"
    assert config["attention_bias"] is False and config["mlp_bias"] is False

    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("[BOT]", "[EOT]")
    assert tokenizer_config["model_max_length"] == ours["max_position_embeddings"]


def test_every_tensor_gets_its_hugging_face_name(exported):
    out, hf_dir = exported
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    # Tied embeddings: one matrix, stored once as embed_tokens (transformers ties it on load).
    assert set(tensors) == hf_names(config["num_hidden_layers"], config["tie_word_embeddings"])
    ours = torch.load(out / "model.pt", weights_only=True)
    assert torch.equal(tensors["model.layers.1.mlp.gate_proj.weight"],
                       ours["layers.1.feed_forward.w1.weight"])  # fmt: skip
    assert torch.equal(tensors["model.layers.0.post_attention_layernorm.weight"],
                       ours["layers.0.ffn_norm.weight"])  # fmt: skip


def test_the_exported_tokenizer_prepends_bot(exported):
    out, hf_dir = exported
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    exported_tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert exported_tokenizer.encode(TEXT).ids == [1, *ours.encode(TEXT).ids]


def test_export_then_from_hf_gives_back_the_same_model(exported, tmp_path):
    out, hf_dir = exported
    export_hf.import_hf(str(hf_dir), str(tmp_path))
    original = torch.load(out / "model.pt", weights_only=True)
    converted = torch.load(tmp_path / "model.pt", weights_only=True)
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[k], original[k]) for k in original)
    # The same config; its fingerprint is of the tokenizer.json it comes with (the exported one,
    # which prepends BOT by itself).
    back_config, config = (json.loads((d / "config.json").read_text()) for d in (tmp_path, out))
    back_sha = back_config.pop("tokenizer_sha256")
    assert back_config == {k: v for k, v in config.items() if k != "tokenizer_sha256"}
    assert back_sha == data.tokenizer_digest(data.load_tokenizer(str(tmp_path / "tokenizer.json")))
    # The same tokens and special tokens (the exported post-processor is kept, and not used:
    # data.py adds BOT itself).
    back, original = (data.load_tokenizer(str(d / "tokenizer.json")) for d in (tmp_path, out))
    assert back.encode(TEXT) == original.encode(TEXT)
    assert back.specials == original.specials == {"bot": "[BOT]", "eot": "[EOT]", "pad": "[PAD]"}


def test_cli_round_trip_leaves_an_out_dir_that_generate_reads(out_dir, tmp_path):
    hf_dir, back = tmp_path / "hf", tmp_path / "back"
    run_export(str(out_dir), str(hf_dir))
    run_export("--from-hf", str(hf_dir), str(back))
    texts = [generate_text(*load_model(str(d)), TEXT, 20, temperature=0) for d in (out_dir, back)]
    assert texts[0] == texts[1]


@pytest.mark.parametrize(
    "change",
    [{"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, {"attention_bias": True},
     {"model_type": "mistral"}, {"head_dim": 64},
     {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}],
    ids=["rope_scaling", "attention_bias", "model_type", "head_dim", "llama3_incomplete"],
)  # fmt: skip
def test_from_hf_refuses_configs_our_model_cannot_represent(exported, change):
    _, hf_dir = exported
    config = {**json.loads((hf_dir / "config.json").read_text()), **change}
    with pytest.raises(ValueError):
        export_hf.config_from_hf(config)


def test_a_big_export_is_written_in_files_of_at_most_shard_bytes(make_out_dir, tmp_path,
                                                                   monkeypatch):  # fmt: skip
    # One file's tensors in memory at a time: the export of a 70b run holds 2 GB, not 280.
    out, hf_dir = make_out_dir(), tmp_path / "hf"
    weights = torch.load(out / "model.pt", weights_only=True).values()
    limit = sum(t.numel() * t.element_size() for t in weights) // 4  # ~4 files or more
    monkeypatch.setattr(export_hf, "SHARD_BYTES", limit)
    export_hf.export(str(out), str(hf_dir))
    files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    assert len(files) > 2 and files == [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                                        for i in range(1, len(files) + 1)]  # fmt: skip
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    tensors, total = {}, 0
    for file in files:
        held = load_file(hf_dir / file)
        size = sum(t.numel() * t.element_size() for t in held.values())
        assert size <= limit or len(held) == 1, (file, size)
        assert all(index["weight_map"][name] == file for name in held)
        tensors, total = tensors | held, total + size
    assert set(index["weight_map"]) == set(tensors) and index["metadata"]["total_size"] == total
    export_hf.import_hf(str(hf_dir), str(tmp_path / "back"))
    original = torch.load(out / "model.pt", weights_only=True)
    back = torch.load(tmp_path / "back" / "model.pt", weights_only=True)
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in back)


# -------------------------------------------------------------------------------------------------
# With transformers installed: the export is a real Llama


def test_transformers_gives_the_same_logits(exported):
    transformers = pytest.importorskip("transformers")
    out, hf_dir = exported
    ours, tokenizer = load_model(str(out))
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    ids = torch.tensor([[1, *tokenizer.encode(TEXT)]])  # (1, T)
    with torch.no_grad():
        diff = (ours(ids) - theirs(ids).logits).abs().max().item()
    assert diff < 1e-4


def test_transformers_tokenizer_gives_the_training_ids(exported):
    transformers = pytest.importorskip("transformers")
    out, hf_dir = exported
    _, ours = load_model(str(out))
    theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
    text = TEXT + " [BOT] stays text"  # as in data.py: a literal special token is just text
    assert theirs(text)["input_ids"] == [1, *ours.encode(text)]
    assert theirs.decode(theirs(TEXT)["input_ids"], skip_special_tokens=True) == TEXT
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (1, 2, 0)


def test_from_hf_reads_a_checkpoint_saved_by_transformers(exported, tmp_path):
    transformers = pytest.importorskip("transformers")
    out, hf_dir = exported
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    theirs.save_pretrained(tmp_path / "saved")  # transformers' own config.json and safetensors
    (tmp_path / "saved" / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    export_hf.import_hf(str(tmp_path / "saved"), str(tmp_path / "out"))
    ours, tokenizer = load_model(str(tmp_path / "out"))
    ids = torch.tensor([[1, *tokenizer.encode(TEXT)]])
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() < 1e-4


def test_from_hf_imports_a_sharded_llama3_and_training_continues_from_it(
    tmp_path, corpus, cache_dir
):
    transformers = pytest.importorskip("transformers")
    hf_dir = tmp_path / "hf"
    tokenizer_path = write_foreign_tokenizer(
        hf_dir, ["<|begin_of_text|>", "<|end_of_text|>"], bos_post_processor="<|begin_of_text|>",
        bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
    )  # fmt: skip
    vocab = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()
    # Llama 3.1's RoPE scaling, with an original context short enough that it changes the
    # frequencies the test positions use; and shards of ~20 KB, as save_pretrained splits 7B+.
    # Given as rope_theta + rope_scaling, which every supported transformers accepts: 4.x writes
    # them so, 5 as one rope_parameters.
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=rope,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.save_pretrained(hf_dir, max_shard_size="20KB")
    assert (hf_dir / "model.safetensors.index.json").is_file()

    out = tmp_path / "out"
    run_export("--from-hf", str(hf_dir), str(out))
    ours, tokenizer = load_model(str(out), dtype=torch.float32)
    assert ours.config.rope_scaling["rope_type"] == "llama3"
    ids = torch.tensor([[tokenizer.bot_id, *tokenizer.encode(TEXT * 4)]])  # past position 16
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() < 1e-4
    assert (tokenizer.specials["bot"], tokenizer.specials["eot"]) == (
        "<|begin_of_text|>", "<|end_of_text|>")  # fmt: skip

    # Continue pretraining it: its tokenizer frames the documents, and the run's out-dir keeps it.
    argv = cmd(corpus, cache_dir, tmp_path / "more", max_steps=2, vocab_size=None, model=None)
    run_script(DP, [*argv, "--init-from", str(out)])
    more, more_tokenizer = load_model(str(tmp_path / "more"))
    assert more.config == ours.config and more_tokenizer.specials == tokenizer.specials


# -------------------------------------------------------------------------------------------------
# Bad input: one line, exit code 2, no traceback, and what already exists stays as it was


def run_main(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """tools/export_hf.py's main() with argv, as `python -m tools.export_hf` runs it (exits.run):
    (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["tools/export_hf.py", *argv])
    code = 0
    try:
        exits.run(export_hf.main)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *expected: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err


def write_sharded(hf_dir: Path, dst: Path) -> Path:
    """dst: hf_dir's export as save_pretrained writes a large model: two shards and an index."""
    dst.mkdir()
    tensors = load_file(hf_dir / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :]), 1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, dst / shard)
        weight_map |= dict.fromkeys(part, shard)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for name in HF_FILES - {"model.safetensors", "final.sums"}:  # (save_pretrained writes none)
        (dst / name).write_bytes((hf_dir / name).read_bytes())
    return dst


def siblings(path: Path) -> set[str]:
    return {p.name for p in path.parent.iterdir()}


def test_export_into_a_folder_holding_a_sharded_model_is_refused_and_leaves_it(exported, tmp_path):
    # It used to write model.safetensors beside the old index and shards, and --from-hf then
    # read the old shards with the new config.json.
    out, hf_dir = exported
    sharded = write_sharded(hf_dir, tmp_path / "sharded")
    before, beside = snapshot(sharded), siblings(sharded)
    proc = subprocess.run([sys.executable, "-m", "tools.export_hf", str(out), str(sharded)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert_one_line_error(proc.returncode, proc.stderr, f"{sharded} is not empty",
                          "pass a new or empty folder")  # fmt: skip
    assert snapshot(sharded) == before and siblings(sharded) == beside
    export_hf.import_hf(str(sharded), str(tmp_path / "back"))  # it is a model, and loads


@pytest.mark.parametrize("direction", ["export", "from_hf"])
def test_no_direction_writes_into_a_folder_with_files_or_over_a_file(
    exported, tmp_path, monkeypatch, capsys, direction
):
    out, hf_dir = exported
    src, flags = (out, []) if direction == "export" else (hf_dir, ["--from-hf"])
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"mine": true}\n')  # silently replaced, once
    (tmp_path / "a_file").write_text("keep me\n")
    before = snapshot(tmp_path)
    for dst, expected in ((other, "is not empty (it holds config.json)"),
                          (tmp_path / "a_file", "is a file, not a folder")):  # fmt: skip
        code, stdout, err = run_main(monkeypatch, capsys, *flags, str(src), str(dst))
        assert_one_line_error(code, err, expected, "pass a new or empty folder")
        assert stdout == "" and snapshot(tmp_path) == before
    # A file where a folder above it should be is named (not the "File exists" of its mkdir).
    code, stdout, err = run_main(monkeypatch, capsys, *flags, str(src), str(tmp_path / "a_file/x"))
    assert_one_line_error(code, err, f"cannot create it ({tmp_path / 'a_file'} is a file)")
    assert stdout == "" and snapshot(tmp_path) == before
    # An empty folder, or a new one (with its parents), is written whole.
    (tmp_path / "empty").mkdir()
    for dst in (tmp_path / "empty", tmp_path / "new" / "deeper"):
        code, stdout, err = run_main(monkeypatch, capsys, *flags, str(src), str(dst))
        assert code == 0, err
        assert {p.name for p in dst.iterdir()} == (
            HF_FILES if direction == "export" else {
                "model.pt", "config.json", "tokenizer.json", "tokenizer_config.json",
                "final.sums"})  # fmt: skip
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]


@pytest.mark.parametrize("direction", ["export", "from_hf"])
def test_a_failed_write_leaves_no_folder_behind(exported, tmp_path, monkeypatch, direction):
    out, hf_dir = exported

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    dst = tmp_path / "dst"
    if direction == "export":
        monkeypatch.setattr(export_hf, "write_json", disk_full)  # after model.safetensors
        with pytest.raises(ValueError, match="No space left on device.*nothing was written"):
            export_hf.export(str(out), str(dst))
    else:
        monkeypatch.setattr(final_files, "atomic_write_text", disk_full)  # after model.pt
        with pytest.raises(ValueError, match="No space left on device.*nothing was written"):
            export_hf.import_hf(str(hf_dir), str(dst))
    assert list(tmp_path.iterdir()) == []  # neither dst nor its temporary folder


def corrupt(hf_dir: Path, tmp_path: Path, name: str, content: bytes) -> Path:
    """A copy of the export with `content` as its file `name`, and checksums (final.sums) that
    agree: the checks of what the files hold are reached (a damaged export: see below)."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for path in hf_dir.iterdir():
        (bad / path.name).write_bytes(path.read_bytes())
    (bad / name).write_bytes(content)
    files.write_sums_of(str(bad), sorted(n.name for n in bad.iterdir() if n.name != "final.sums"))
    return bad


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("model.safetensors", b"junk\n", "cannot read model.safetensors as safetensors"),
        ("config.json", b"{not json", "config.json is not a JSON file"),
        ("config.json", b"\xff\xfe", "config.json is not a JSON file"),
        ("config.json", b"[1, 2]", "config.json: it is a JSON list"),
        ("config.json", b'{"model_type": "llama", "hidden_size": "abc", "num_attention_heads": 0}',
         "config.json: bad values: hidden_size 'abc', num_attention_heads 0"),
        ("model.safetensors.index.json", b'{"weight_map": {"x": "../elsewhere.safetensors"}}',
         "model.safetensors.index.json is not a safetensors index"),
        ("model.safetensors.index.json", b"[]", "model.safetensors.index.json is not a"),
    ],
    ids=["junk_safetensors", "config_not_json", "config_not_utf8", "config_a_list",
         "config_bad_values", "index_outside", "index_not_a_map"],
)  # fmt: skip
def test_from_hf_names_the_file_it_cannot_read(
    exported, tmp_path, monkeypatch, capsys, name, content, expected
):
    _, hf_dir = exported
    bad = corrupt(hf_dir, tmp_path, name, content)
    code, stdout, err = run_main(monkeypatch, capsys, "--from-hf", str(bad), str(tmp_path / "o"))
    assert_one_line_error(code, err, expected)
    assert stdout == "" and not (tmp_path / "o").exists()
    assert {p.name for p in tmp_path.iterdir()} == {"bad"}


@pytest.mark.parametrize("damage", ["flipped_byte", "edited_rope_theta"])
def test_from_hf_refuses_a_damaged_export_naming_the_file(
    exported, tmp_path, monkeypatch, capsys, damage
):
    # Once: a flipped byte in the export's weights, or an edited rope_theta in its config.json,
    # was imported without a word (and tools/evaluate.py, which imports a HF folder, used it).
    _, hf_dir = exported
    copy = tmp_path / "copy"
    shutil.copytree(hf_dir, copy)
    if damage == "flipped_byte":
        name, raw = "model.safetensors", bytearray((copy / "model.safetensors").read_bytes())
        raw[len(raw) // 2] ^= 0x01
        (copy / name).write_bytes(bytes(raw))
    else:
        name, config = "config.json", json.loads((copy / "config.json").read_text())
        (copy / name).write_text(json.dumps({**config, "rope_theta": config["rope_theta"] * 2}))
    code, stdout, err = run_main(monkeypatch, capsys, "--from-hf", str(copy), str(tmp_path / "o"))
    assert_one_line_error(code, err, f"{copy / name} is damaged", "export the run again")
    assert stdout == "" and not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match=f"{copy / name} is damaged"):
        with evaluate.run_dir(str(copy)):
            pass


def test_an_export_older_than_its_checksums_warns_and_a_folder_from_elsewhere_does_not(
    exported, tmp_path, capsys
):
    out, hf_dir = exported
    old, foreign = tmp_path / "old", tmp_path / "foreign"
    for folder in (old, foreign):
        shutil.copytree(hf_dir, folder)
        (folder / "final.sums").unlink()
    config = json.loads((foreign / "config.json").read_text())
    del config["tokenizer_sha256"]  # (transformers' save_pretrained writes no such field)
    (foreign / "config.json").write_text(json.dumps(config))
    export_hf.import_hf(str(old), str(tmp_path / "o1"))
    err = capsys.readouterr().err
    expected = f"warning: {old} has no final.sums (tools/export_hf.py wrote it before them)"
    assert err.startswith(expected) and err.count("\n") == 1, err
    export_hf.import_hf(str(foreign), str(tmp_path / "o2"))
    assert capsys.readouterr().err == ""
    back = torch.load(tmp_path / "o2" / "model.pt", weights_only=True)
    assert all(torch.equal(t, back[n]) for n, t in torch.load(out / "model.pt").items())


def test_an_export_source_that_is_not_a_folder_is_named_as_given(tmp_path, monkeypatch, capsys):
    # The message named --out-dir, a flag tools/export_hf.py does not have
    # (its source is positional).
    (tmp_path / "a_file").write_text("not a run\n")
    for src in (tmp_path / "missing", tmp_path / "a_file"):
        code, stdout, err = run_main(monkeypatch, capsys, str(src), str(tmp_path / "hf"))
        assert_one_line_error(code, err, f"error: {src} is not a directory", "training run's")
        assert "--out-dir " + str(src) not in err and stdout == ""
        assert not (tmp_path / "hf").exists()


def test_from_hf_refuses_a_tensor_its_config_has_no_place_for(exported, tmp_path):
    _, hf_dir = exported
    config = json.loads((hf_dir / "config.json").read_text())
    bad = corrupt(hf_dir, tmp_path, "config.json", json.dumps(
        {**config, "num_hidden_layers": 1}).encode())  # fmt: skip
    with pytest.raises(ValueError, match=r"holds model\.layers\.1\..*does not have"):
        export_hf.import_hf(str(bad), str(tmp_path / "o"))


# -------------------------------------------------------------------------------------------------
# Mixtral (a mixture of experts: tests/test_moe.py exports and loads one); here, its config.json


def test_a_dense_export_is_a_llama_without_mixture_of_experts_fields(exported):
    out, hf_dir = exported
    config = json.loads((hf_dir / "config.json").read_text())
    ours = json.loads((out / "config.json").read_text())
    assert "num_local_experts" not in ours and "num_local_experts" not in config
    assert config["model_type"] == "llama"


def test_from_hf_takes_a_mixtral_config_and_ignores_expert_fields_of_a_llama(exported):
    _, hf_dir = exported
    llama = json.loads((hf_dir / "config.json").read_text())
    assert export_hf.config_from_hf({**llama, "num_local_experts": 4}).num_local_experts == 0
    mixtral = {**llama, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 1,
               "router_aux_loss_coef": 0.0, "sliding_window": None}  # fmt: skip
    config = export_hf.config_from_hf(mixtral)
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 1)
    assert config.router_aux_loss_coef == 0.0
    defaults = export_hf.config_from_hf({**llama, "model_type": "mixtral"})  # MixtralConfig's
    assert (defaults.num_local_experts, defaults.num_experts_per_tok) == (8, 2)
    assert defaults.router_aux_loss_coef == 0.001


@pytest.mark.parametrize(
    "change, message",
    [({"sliding_window": 4096}, "this Mixtral's sliding_window differ"),
     ({"router_jitter_noise": 0.01}, "this Mixtral's router_jitter_noise differ"),
     ({"num_local_experts": 0}, "bad values: num_local_experts 0"),
     ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 must be an integer from 1 to"),
     ({"router_aux_loss_coef": -1}, "bad values: router_aux_loss_coef -1")],
    ids=["sliding_window", "router_jitter_noise", "no_experts", "k_above_experts", "coef"],
)  # fmt: skip
def test_from_hf_refuses_mixtral_settings_our_model_cannot_represent(
    exported, tmp_path, monkeypatch, capsys, change, message
):
    _, hf_dir = exported
    config = {**json.loads((hf_dir / "config.json").read_text()), "model_type": "mixtral",
              "num_local_experts": 4, **change}  # fmt: skip
    bad = corrupt(hf_dir, tmp_path, "config.json", json.dumps(config).encode())
    code, stdout, err = run_main(monkeypatch, capsys, "--from-hf", str(bad), str(tmp_path / "o"))
    assert_one_line_error(code, err, "config.json: ", message)
    assert stdout == "" and not (tmp_path / "o").exists()
