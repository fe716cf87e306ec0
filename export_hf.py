"""Convert between a training run's --out-dir and a Hugging Face Llama directory.

    python export_hf.py out hf_model                  # out/ -> hf_model/, for transformers
    python export_hf.py --from-hf hf_model out2       # a HF Llama (also sharded) -> out2/
    python train_ddp.py --init-from out2 ...          # and continue pretraining it

The exported directory loads with nothing but `transformers` installed:

    from transformers import AutoTokenizer, LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained("hf_model")
    tokenizer = AutoTokenizer.from_pretrained("hf_model")   # adds BOT in front, as in training

Our model already is Hugging Face's Llama: `LlamaConfig` uses its field names and RoPE its
`rotate_half` layout, so converting is renaming tensors (`layers.0.attention.wq` ->
`model.layers.0.self_attn.q_proj`), nothing more. The weights are read and written with the
`safetensors` library.

--from-hf reads config.json, model.safetensors (or the shards model.safetensors.index.json lists)
and tokenizer.json of a Llama directory (Llama 2, 3.x, TinyLlama, SmolLM, ...: what
save_pretrained writes) and writes model.pt, config.json, tokenizer.json and tokenizer_config.json,
which generate.py and --init-from read. The tokenizer is kept as it is; its beginning/end-of-
document tokens are the ones the directory's tokenizer_config.json names (bos_token, eos_token),
or found by convention, or given with --bot-token/--eot-token (data.load_tokenizer).
"""

import argparse
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import checkpoints
import cli
import stopping
from checkpoints import load_model
from data import load_tokenizer
from model import LlamaConfig, LlamaForPretraining

# -------------------------------------------------------------------------------------------------
# Names and config

# Our names (Meta's) -> Hugging Face's, inside each decoder layer and outside of them.
LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}


def to_hf_name(name: str) -> str:
    """'layers.3.attention.wq.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    module = name.removesuffix(".weight")
    if module.startswith("layers."):
        _, i, inner = module.split(".", 2)
        return f"model.layers.{i}.{LAYER_NAMES[inner]}.weight"
    return f"{TOP_NAMES[module]}.weight"


HF_NAMES = {hf: ours for ours, hf in LAYER_NAMES.items()}
HF_TOP_NAMES = {hf: ours for ours, hf in TOP_NAMES.items()}


def from_hf_name(name: str) -> str:
    """The inverse of to_hf_name; ValueError for a tensor our model does not have."""
    module = name.removesuffix(".weight")
    if module.startswith("model.layers.") and name.endswith(".weight"):
        _, _, i, inner = module.split(".", 3)
        if inner in HF_NAMES:
            return f"layers.{i}.{HF_NAMES[inner]}.weight"
    elif module in HF_TOP_NAMES and name.endswith(".weight"):
        return f"{HF_TOP_NAMES[module]}.weight"
    raise ValueError(f"tensor {name} has no counterpart in this suite's Llama (biases? scaling?)")


def hf_config(config: LlamaConfig, tokenizer) -> dict:
    """transformers' LlamaConfig as config.json: our fields (already HF's names) plus the rest."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **config.to_dict(),
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": tokenizer.bot_id,
        "eos_token_id": tokenizer.eot_id,
        "pad_token_id": tokenizer.pad_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def config_from_hf(hf: dict) -> LlamaConfig:
    """Our LlamaConfig from a HF config.json; ValueError for what our model cannot represent."""
    if hf.get("model_type") != "llama":
        raise ValueError(f"model_type is {hf.get('model_type')!r}; only 'llama' converts")
    # transformers 5 writes RoPE's settings (rope_theta, and the scaling) in rope_parameters;
    # 4.x writes rope_theta at the top level and the scaling in rope_scaling.
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    head_dim = hf.get("hidden_size", 4096) // hf.get("num_attention_heads", 32)  # HF defaults
    unsupported = {
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        "rope_type": rope_type not in ("default", "llama3"),
        "attention_bias": bool(hf.get("attention_bias")),
        "mlp_bias": bool(hf.get("mlp_bias")),
        "head_dim": hf.get("head_dim") not in (None, head_dim),
    }
    if bad := [name for name, is_bad in unsupported.items() if is_bad]:
        raise ValueError(f"this Llama's {', '.join(bad)} differ from what model.py implements")
    config = {
        "num_key_value_heads": hf.get("num_attention_heads", 32),  # HF's default: no grouping
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }  # transformers' defaults, for fields a config.json may leave out
    config.update({name: hf[name] for name in LlamaConfig().to_dict() if name in hf})
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    config["rope_scaling"] = None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if missing := [k for k in keys if k not in rope]:
            raise ValueError(f"this Llama's llama3 rope scaling lacks {', '.join(missing)}")
        config["rope_scaling"] = {"rope_type": "llama3", **{k: rope[k] for k in keys}}
    return LlamaConfig(**config)


# -------------------------------------------------------------------------------------------------
# The two directions


def write_json(path: str, obj: dict) -> None:
    checkpoints.atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def export(out_dir: str, hf_dir: str) -> None:
    """A training run's out-dir -> a directory transformers loads."""
    model, tokenizer = load_model(out_dir, "cpu", torch.float32)
    config = model.config
    os.makedirs(hf_dir, exist_ok=True)
    state_dict = model.state_dict()
    if config.tie_word_embeddings:
        # One matrix, two names; HF stores it once, as embed_tokens, and ties it on load.
        del state_dict["lm_head.weight"]
    tensors = {to_hf_name(name): t.contiguous() for name, t in state_dict.items()}
    path = os.path.join(hf_dir, "model.safetensors")
    save_file(tensors, f"{path}.tmp{os.getpid()}", metadata={"format": "pt"})
    os.replace(f"{path}.tmp{os.getpid()}", path)  # atomic, as every file this suite writes
    write_json(os.path.join(hf_dir, "config.json"), hf_config(config, tokenizer))

    # Every training document starts with BOT: a post-processor makes HF's tokenizer add it, as
    # Llama's tokenizers add <s>, so `tokenizer(text)` gives the ids the model was trained on.
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    hf_tokenizer = Tokenizer.from_str(tokenizer.to_str())
    bot = tokenizer.specials["bot"]
    hf_tokenizer.post_processor = TemplateProcessing(
        single=f"{bot} $A", pair=f"{bot} $A {bot} $B", special_tokens=[(bot, tokenizer.bot_id)]
    )
    checkpoints.atomic_write_text(os.path.join(hf_dir, "tokenizer.json"), hf_tokenizer.to_str())
    special = tokenizer.config()  # bos_token, eos_token, pad_token
    write_json(os.path.join(hf_dir, "special_tokens_map.json"), special)
    write_json(
        os.path.join(hf_dir, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "model_max_length": config.max_position_embeddings,
            # decode(encode(code)) must give the code back: no "tidying" of spaces before '.'
            "clean_up_tokenization_spaces": False,
            # A literal "[BOT]" in a text is text, as in data.py, not a document boundary.
            "split_special_tokens": True,
        },
    )


def import_hf(hf_dir: str, out_dir: str, specials: dict[str, str | None] | None = None) -> None:
    """A Hugging Face Llama directory -> model.pt, config.json, tokenizer.json (kept as it is)
    and tokenizer_config.json (its special tokens: see data.load_tokenizer)."""
    if not os.path.isdir(hf_dir):
        raise ValueError(f"{hf_dir} is not a directory")
    for name in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(hf_dir, name)):
            raise ValueError(f"{hf_dir} has no {name}")
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = config_from_hf(json.load(f))
    tokenizer = load_tokenizer(os.path.join(hf_dir, "tokenizer.json"), specials)
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise ValueError(
            f"{hf_dir}'s tokenizer has {tokenizer.get_vocab_size()} tokens, its model only "
            f"{config.vocab_size}"
        )
    model = LlamaForPretraining(config)
    load_hf_weights(model, hf_dir)
    os.makedirs(out_dir, exist_ok=True)
    checkpoints.save_final(out_dir, model, config, tokenizer)


def load_hf_weights(model: LlamaForPretraining, hf_dir: str) -> None:
    """Copy the tensors of hf_dir's safetensors file(s) into the model, one at a time (in fp32:
    training keeps master weights in fp32), so that memory holds the model and one tensor more,
    never a second copy of the whole model. ValueError naming what does not fit."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):  # sharded: the index maps each tensor to its file
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{hf_dir} has no model.safetensors (nor model.safetensors.index.json)")
    params = model.state_dict(keep_vars=True)
    loaded = set()
    for file in files:
        try:
            with safe_open(os.path.join(hf_dir, file), framework="pt") as f:
                for hf_name in f.keys():
                    if hf_name.endswith("rotary_emb.inv_freq"):  # older checkpoints saved RoPE's
                        continue
                    name, tensor = from_hf_name(hf_name), f.get_tensor(hf_name)
                    if tensor.shape != params[name].shape:
                        raise ValueError(
                            f"{hf_dir}: {hf_name} has shape {tuple(tensor.shape)}, but its "
                            f"config.json makes it {tuple(params[name].shape)}"
                        )
                    with torch.no_grad():
                        params[name].copy_(tensor)
                    loaded.add(name)
        except OSError as e:  # a shard missing or unreadable (SafetensorError is an OSError)
            raise ValueError(f"{hf_dir}: cannot read {file} ({e})") from e
    if model.config.tie_word_embeddings and "tok_embeddings.weight" in loaded:
        loaded.add("lm_head.weight")  # the same matrix as the embedding
    if missing := sorted(set(params) - loaded):
        raise ValueError(f"{hf_dir} lacks {len(missing)} tensors of its config, e.g. {missing[0]}")


def main() -> None:
    p = argparse.ArgumentParser(
        description="Export a run's --out-dir to the Hugging Face Llama format, or back.",
        allow_abbrev=False,  # a mistyped flag is an error, never read as a longer one
    )
    p.add_argument("src", help="a training run's --out-dir (or, with --from-hf, a HF directory)")
    p.add_argument("dst", help="the HF directory to write (or, with --from-hf, an out-dir)")
    p.add_argument(
        "--from-hf",
        action="store_true",
        help="convert a HF Llama directory (config.json, model.safetensors or its shards, "
        "tokenizer.json) into model.pt, config.json, tokenizer.json, tokenizer_config.json",
    )
    cli.add_special_token_flags(p)
    args = p.parse_args()
    if args.from_hf:
        import_hf(args.src, args.dst, cli.special_tokens(args))
        print(f"wrote model.pt, config.json and tokenizer.json to {args.dst}")
    else:
        if any(cli.special_tokens(args).values()):
            p.error("--bot-token, --eot-token and --pad-token go with --from-hf")
        export(args.src, args.dst)
        print(f"wrote a Hugging Face Llama to {args.dst} (LlamaForCausalLM.from_pretrained)")


if __name__ == "__main__":
    stopping.run(main)
