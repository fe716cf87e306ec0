"""Specification of export_hf.py: our out-dir <-> a Hugging Face Llama directory.

Without `transformers` these tests still prove the files: every tensor gets its Hugging Face
name, config.json has the fields transformers reads, and export followed by --from-hf gives back
the very same model. With `transformers` (a test dependency), the last tests load the export in
LlamaForCausalLM and compare logits and token ids, and import what transformers itself saves:
sharded, with Llama 3's RoPE scaling and a Llama 3 style tokenizer, then continue training it.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import DP, cmd, run_script, write_foreign_tokenizer
from safetensors.torch import load_file
from tokenizers import Tokenizer

import data
import export_hf
from checkpoints import load_model
from generate import generate_text

REPO = Path(__file__).resolve().parents[1]
TEXT = "def add(x, y):\n    return x + y"
HF_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"}  # fmt: skip


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
    proc = subprocess.run([sys.executable, str(REPO / "export_hf.py"), *argv], cwd=REPO,
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


def test_config_json_has_the_fields_transformers_needs(exported):
    out, hf_dir = exported
    ours = json.loads((out / "config.json").read_text())
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert {name: config[name] for name in ours} == ours  # every shape field, same names
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
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(
        (out / "config.json").read_text())  # fmt: skip
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
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, rope_parameters=rope,
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
