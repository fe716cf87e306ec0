"""Convert between a training run's --out-dir and a Hugging Face Llama directory.

    python export_hf.py out hf_model                  # out/ -> hf_model/, for transformers
    python export_hf.py --from-hf hf_model out2       # a (single-file) HF Llama -> out2/

The exported directory loads with nothing but `transformers` installed:

    from transformers import AutoTokenizer, LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained("hf_model")
    tokenizer = AutoTokenizer.from_pretrained("hf_model")   # adds [BOT] in front, as in training

Our model already is Hugging Face's Llama: `LlamaConfig` uses its field names and RoPE its
`rotate_half` layout, so converting is renaming tensors (`layers.0.attention.wq` ->
`model.layers.0.self_attn.q_proj`), nothing more. This script writes every file itself,
safetensors included (the format is a JSON header and raw bytes, ~30 lines below), so the suite
needs neither `transformers` nor `safetensors` installed.

--from-hf reads config.json, model.safetensors and tokenizer.json of a Llama directory and
writes model.pt, config.json and tokenizer.json, which generate.py reads. The tokenizer must be
one of this suite's ([PAD], [BOT], [EOT] = ids 0, 1, 2), because the data pipeline relies on them.
"""

import argparse
import json
import os
import struct
import sys

import torch

import checkpoints
import stopping
from checkpoints import load_model
from data import BOT, EOT, PAD, load_tokenizer
from model import LlamaConfig, LlamaForPretraining

# -------------------------------------------------------------------------------------------------
# safetensors: an 8-byte little-endian header length N, N bytes of JSON header
# {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then every
# tensor's raw little-endian bytes, back to back (offsets count from the end of the header).

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None
) -> None:
    assert sys.byteorder == "little", "tensor bytes are written as they lie in memory"
    tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    header, offset = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the tensors start 8-byte aligned
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for t in tensors.values():
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())  # (numel * itemsize,)
    os.replace(tmp, path)  # atomic, as every file this suite writes


def load_safetensors(path: str) -> dict[str, torch.Tensor]:
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8].ljust(8, b"\0"))
    try:
        header = json.loads(blob[8 : 8 + n]) if 8 + n <= len(blob) else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file")
    header.pop("__metadata__", None)
    if unknown := {info["dtype"] for info in header.values()} - set(DTYPES_BY_NAME):
        raise ValueError(f"{path} holds tensors of dtype {unknown}; this reader knows no such")
    data = memoryview(blob)[8 + n :]
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = DTYPES_BY_NAME[info["dtype"]]
        # bytearray: a writable copy, so the tensor owns its memory.
        flat = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype) if end > begin else (
            torch.empty(0, dtype=dtype))  # fmt: skip
        tensors[name] = flat.reshape(info["shape"])
    return tensors


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
        "rope_scaling": None,
        "initializer_range": 0.02,
        "bos_token_id": tokenizer.token_to_id(BOT),
        "eos_token_id": tokenizer.token_to_id(EOT),
        "pad_token_id": tokenizer.token_to_id(PAD),
        "torch_dtype": "float32",
        "use_cache": True,
    }


def config_from_hf(hf: dict) -> LlamaConfig:
    """Our LlamaConfig from a HF config.json; ValueError for what our model cannot represent."""
    if hf.get("model_type") != "llama":
        raise ValueError(f"model_type is {hf.get('model_type')!r}; only 'llama' converts")
    # transformers 5 writes rope_theta inside rope_parameters; 4.x writes it at the top level.
    rope = hf.get("rope_parameters") or {}
    head_dim = hf.get("hidden_size", 4096) // hf.get("num_attention_heads", 32)  # HF defaults
    unsupported = {
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        "rope_scaling": hf.get("rope_scaling") is not None,
        "rope_type": rope.get("rope_type", "default") != "default",
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
    tensors = {to_hf_name(name): t for name, t in state_dict.items()}
    save_safetensors(tensors, os.path.join(hf_dir, "model.safetensors"), {"format": "pt"})
    write_json(os.path.join(hf_dir, "config.json"), hf_config(config, tokenizer))

    # Every training document starts with [BOT]: a post-processor makes HF's tokenizer add it,
    # as Llama's tokenizers add <s>, so `tokenizer(text)` gives the ids the model was trained on.
    from tokenizers.processors import TemplateProcessing

    bot_id = tokenizer.token_to_id(BOT)
    tokenizer.post_processor = TemplateProcessing(
        single=f"{BOT} $A", pair=f"{BOT} $A {BOT} $B", special_tokens=[(BOT, bot_id)]
    )
    checkpoints.atomic_write_text(os.path.join(hf_dir, "tokenizer.json"), tokenizer.to_str())
    special = {"bos_token": BOT, "eos_token": EOT, "pad_token": PAD}  # byte-level: no unk
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


def import_hf(hf_dir: str, out_dir: str) -> None:
    """A single-file Hugging Face Llama directory -> model.pt, config.json, tokenizer.json."""
    if not os.path.isdir(hf_dir):
        raise ValueError(f"{hf_dir} is not a directory")
    if os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json")):
        raise ValueError(
            f"{hf_dir} holds a sharded checkpoint (model.safetensors.index.json); only a single "
            f"model.safetensors converts: re-save it with save_pretrained(path, "
            f"max_shard_size='1000GB')"
        )
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not os.path.isfile(os.path.join(hf_dir, name)):
            raise ValueError(f"{hf_dir} has no {name}")
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = config_from_hf(json.load(f))

    tokenizer = load_tokenizer(os.path.join(hf_dir, "tokenizer.json"))  # checks the special ids
    tokenizer.post_processor = None  # data.py adds [BOT] and [EOT] itself

    state_dict = {}
    for name, t in load_safetensors(os.path.join(hf_dir, "model.safetensors")).items():
        if name.endswith("rotary_emb.inv_freq"):  # older checkpoints saved RoPE's table
            continue
        state_dict[from_hf_name(name)] = t.float()  # train and keep master weights in fp32
    if config.tie_word_embeddings and "tok_embeddings.weight" in state_dict:
        state_dict["lm_head.weight"] = state_dict["tok_embeddings.weight"]
    model = LlamaForPretraining(config)
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        raise ValueError(f"{hf_dir}'s tensors do not fit its config.json ({e})") from e
    os.makedirs(out_dir, exist_ok=True)
    checkpoints.save_final(out_dir, model, config, tokenizer)


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
        help="convert a HF Llama directory (config.json, model.safetensors, tokenizer.json) "
        "into model.pt, config.json, tokenizer.json",
    )
    args = p.parse_args()
    if args.from_hf:
        import_hf(args.src, args.dst)
        print(f"wrote model.pt, config.json and tokenizer.json to {args.dst}")
    else:
        export(args.src, args.dst)
        print(f"wrote a Hugging Face Llama to {args.dst} (LlamaForCausalLM.from_pretrained)")


if __name__ == "__main__":
    stopping.run(main)
