"""Convert between a training run's --out-dir and a Hugging Face Llama (or Mixtral) directory.

    python -m tools.export_hf out hf_model                  # out/ -> hf_model/, for transformers
    python -m tools.export_hf --from-hf hf_model out2       # a HF Llama (also sharded) -> out2/
    python train_ddp.py --init-from out2 ...          # and continue pretraining it

The exported directory loads with nothing but `transformers` installed:

    from transformers import AutoTokenizer, LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained("hf_model")
    tokenizer = AutoTokenizer.from_pretrained("hf_model")   # adds BOT in front, as in training

Our model already is Hugging Face's Llama: `LlamaConfig` uses its field names and RoPE its
`rotate_half` layout, so converting is renaming tensors (`layers.0.attention.wq` ->
`model.layers.0.self_attn.q_proj`), nothing more. The weights are read and written with the
`safetensors` library.

A mixture of experts (num_local_experts > 0) is Hugging Face's Mixtral: it is written as
MixtralForCausalLM (model_type "mixtral"), with the tensor names transformers' save_pretrained
writes, and which transformers 4.x and 5.x load: the router `block_sparse_moe.gate` and one
matrix per expert, `block_sparse_moe.experts.3.w1` (our experts are stacked, (E, ...): split
on export, stacked again on import). --from-hf also reads the fused layout transformers 5 holds
in memory (`mlp.gate`, `mlp.experts.gate_up_proj` (E, 2 x ffn, d), `mlp.experts.down_proj`).

--from-hf reads config.json, model.safetensors (or the shards model.safetensors.index.json lists)
and tokenizer.json of a Llama directory (Llama 2, 3.x, TinyLlama, SmolLM, ...: what
save_pretrained writes) and writes model.pt, config.json, tokenizer.json and tokenizer_config.json,
which tools/generate.py and --init-from read. The tokenizer is kept as it is; its beginning/end-of-
document tokens are the ones the directory's tokenizer_config.json names (bos_token, eos_token),
or found by convention, or given with --bot-token/--eot-token (data.load_tokenizer).

Either direction writes a whole new folder or nothing (new_folder): DST must not exist yet or be
empty, since files already there (another model's shards and index, its config.json) would mix
with the new ones; it is written under a temporary name beside DST and renamed at the end.
"""

import contextlib
import dataclasses
import functools
import json
import os
import re
import shutil
from dataclasses import fields

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from data import load_tokenizer, tokenizer_digest
from lib import exits, flags, model_config
from lib.checkpoints import files
from lib.checkpoints.finished_run import (
    EXPORT,
    check_config_values,
    check_tokenizer,
    is_number,
    open_weights,
    verify_final,
)
from lib.checkpoints.model_pt import save_final, save_tensor_by_tensor
from model import MOE_FIELDS, LlamaConfig, LlamaForPretraining

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
    "feed_forward.gate": "block_sparse_moe.gate",  # a mixture of experts' router (Mixtral)
}
TOP_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}
# The export's safetensors files hold at most this many bytes each (transformers' own default
# is 5 GB): what the export holds in memory at once, whatever the model's size.
SHARD_BYTES = 2 * 10**9


def to_hf_name(name: str) -> str:
    """'layers.3.attention.wq.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    module = name.removesuffix(".weight")
    if module.startswith("layers."):
        _, i, inner = module.split(".", 2)
        return f"model.layers.{i}.{LAYER_NAMES[inner]}.weight"
    return f"{TOP_NAMES[module]}.weight"


HF_NAMES = {hf: ours for ours, hf in LAYER_NAMES.items()} | {"mlp.gate": "feed_forward.gate"}
HF_TOP_NAMES = {hf: ours for ours, hf in TOP_NAMES.items()}

# A mixture of experts' stacked weights: ours `layers.3.feed_forward.w1` (E, ffn, d), one
# matrix per expert in a Mixtral file, as transformers saves it (and as 4.x holds it)...
OUR_EXPERTS = re.compile(r"layers\.(\d+)\.feed_forward\.(w[123])")
HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
# ... or fused per layer, as transformers 5 holds it in memory: gate_up_proj (E, 2 x ffn, d) is
# w1 (gate) then w3 (up) along dim 1, down_proj (E, d, ffn) is w2.
HF_FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def to_hf_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One tensor of our state_dict as the (name, tensor) pairs of a HF file: a stacked expert
    weight becomes one matrix per expert, the rest is renamed (to_hf_name)."""
    if match := OUR_EXPERTS.fullmatch(name):
        i, w = match.groups()
        # clone: each expert its own storage (safetensors refuses tensors that share memory)
        return [
            (f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight", matrix.clone())
            for e, matrix in enumerate(tensor)
        ]
    return [(to_hf_name(name), tensor.contiguous())]


def from_hf_tensors(
    hf_name: str, tensor: torch.Tensor
) -> list[tuple[str, int | None, torch.Tensor]]:
    """One tensor of a HF file as (our name, expert or None, values): an expert's matrix goes
    into row `expert` of our stacked weight, a fused one into every row; the rest is renamed
    (from_hf_name). ValueError for a tensor our model does not have."""
    if match := HF_EXPERT.fullmatch(hf_name):
        i, e, w = match.groups()
        return [(f"layers.{int(i)}.feed_forward.{w}", int(e), tensor)]
    if match := HF_FUSED_EXPERTS.fullmatch(hf_name):
        i, kind = match.groups()
        if tensor.dim() != 3 or (kind == "gate_up_proj" and tensor.size(1) % 2):
            raise ValueError(
                f"{hf_name} has shape {tuple(tensor.shape)}: not (experts, 2 x ffn, hidden) "
                f"or (experts, hidden, ffn)"
            )
        prefix = f"layers.{int(i)}.feed_forward"
        if kind == "down_proj":
            return [(f"{prefix}.w2", e, matrix) for e, matrix in enumerate(tensor)]
        gate, up = tensor.chunk(2, dim=1)  # (E, ffn, d) each
        pairs = (("w1", gate), ("w3", up))
        return [(f"{prefix}.{w}", e, matrix) for w, part in pairs for e, matrix in enumerate(part)]
    return [(from_hf_name(hf_name), None, tensor)]


def from_hf_name(name: str) -> str:
    """The inverse of to_hf_name; ValueError for a tensor our model does not have."""
    module = name.removesuffix(".weight")
    if module.startswith("model.layers.") and name.endswith(".weight"):
        _, _, i, *inner = module.split(".", 3)
        if i.isdigit() and inner and inner[0] in HF_NAMES:
            return f"layers.{int(i)}.{HF_NAMES[inner[0]]}.weight"
    elif module in HF_TOP_NAMES and name.endswith(".weight"):
        return f"{HF_TOP_NAMES[module]}.weight"
    raise ValueError(f"tensor {name} has no counterpart in this suite's Llama (biases? scaling?)")


def hf_config(config: LlamaConfig, tokenizer) -> dict:
    """transformers' LlamaConfig (or MixtralConfig, for a mixture of experts) as config.json: our
    fields (already HF's names) plus the rest."""
    common = {
        **config.to_dict(),  # with experts: num_local_experts, num_experts_per_tok, router_aux_..
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": tokenizer.bot_id,
        "eos_token_id": tokenizer.eot_id,
        "pad_token_id": tokenizer.pad_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if config.num_local_experts:
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            **common,
            "sliding_window": None,  # full attention, as ours
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **common,
        "attention_bias": False,
        "mlp_bias": False,
    }


def config_from_hf(hf: dict) -> LlamaConfig:
    """Our LlamaConfig from a HF config.json (a Llama, or a Mixtral: a mixture of experts);
    ValueError for what our model cannot represent."""
    if not isinstance(hf, dict):
        raise ValueError(f"it is a JSON {type(hf).__name__}, not an object of settings")
    model_type = hf.get("model_type")
    if model_type not in ("llama", "mixtral"):
        raise ValueError(f"model_type is {model_type!r}; only 'llama' and 'mixtral' convert")
    check_config_values(hf)
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
        # Mixtral's: attention within a sliding window, and noise on the router's inputs.
        "sliding_window": hf.get("sliding_window") is not None,
        "router_jitter_noise": bool(hf.get("router_jitter_noise")),
    }
    kind = "Llama" if model_type == "llama" else "Mixtral"
    if bad := [name for name, is_bad in unsupported.items() if is_bad]:
        raise ValueError(f"this {kind}'s {', '.join(bad)} differ from what model.py implements")
    if model_type == "llama":
        config = {
            "num_key_value_heads": hf.get("num_attention_heads", 32),  # HF's default: no grouping
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": False,
        }  # transformers' defaults, for fields a config.json may leave out
    else:
        config = {
            "intermediate_size": 14336,
            "num_key_value_heads": 8,
            "rope_theta": 1e6,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096 * 32,
            "tie_word_embeddings": False,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.001,
        }  # transformers' MixtralConfig defaults
    names = [f.name for f in fields(LlamaConfig)]
    if model_type == "llama":  # no experts, whatever else its config.json may hold
        names = [name for name in names if name not in MOE_FIELDS]
    config.update({name: hf[name] for name in names if name in hf})
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    config["rope_scaling"] = None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if missing := [k for k in keys if k not in rope]:
            raise ValueError(f"this Llama's llama3 rope scaling lacks {', '.join(missing)}")
        if bad := [k for k in keys if not is_number(rope[k], k.startswith("original"))]:
            raise ValueError(f"this Llama's llama3 rope scaling has a bad {', '.join(bad)}")
        config["rope_scaling"] = {"rope_type": "llama3", **{k: rope[k] for k in keys}}
    return LlamaConfig(**config)


# -------------------------------------------------------------------------------------------------
# The two directions


def write_json(path: str, obj: dict) -> None:
    files.atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


@contextlib.contextmanager
def new_folder(path: str, flag: str):
    """Write a whole folder or nothing: yields a temporary folder beside `path` to write into,
    renamed to `path` once everything is in it (atomic), and removed if anything fails.

    `path` must be new or an empty folder (rename replaces an empty one): files already there
    (an older model's shards and index, its config.json, ...) would mix with the new ones into
    a folder that loads the wrong weights, or be lost. ValueError naming them otherwise, before
    anything is read or written. flag: how the messages name `path`.
    """
    path = os.path.normpath(path)
    todo = "pass a new or empty folder, or move this one away first"
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a file, not a folder: {todo}")
    if os.path.isdir(path):
        try:
            names = sorted(os.listdir(path))
        except OSError as e:
            raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from e
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise ValueError(
                f"{flag} {path} is not empty (it holds {shown}): tools/export_hf.py writes a whole "
                f"folder, never into one whose files would mix with the new ones; {todo}"
            )
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a killed export of the same pid's, long ago
        os.mkdir(tmp)
    except OSError as e:  # FileExistsError: a file where a folder above `path` should be
        why = f"{e.filename} is a file" if isinstance(e, FileExistsError) else e.strerror or e
        raise ValueError(f"{flag} {path}: cannot create it ({why})") from e
    try:
        yield tmp
        try:
            os.rename(tmp, path)  # atomic; replaces an empty folder, never a non-empty one
        except OSError as e:
            raise ValueError(
                f"{flag} {path}: cannot move the finished files into place ({e.strerror or e}); "
                f"nothing was written there"
            ) from e
    except OSError as e:  # a full disk, ...: the partial folder goes, the old state stays
        raise ValueError(
            f"{flag} {path}: cannot write it ({e.strerror or e}); nothing was written there"
        ) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export(out_dir: str, hf_dir: str) -> str:
    """A training run's out-dir -> a directory transformers loads (a new or empty one: see
    new_folder; it appears whole or not at all). Returns the transformers class that loads it:
    LlamaForCausalLM, or MixtralForCausalLM for a mixture of experts."""
    with new_folder(hf_dir, "the output folder") as tmp:
        return write_export(out_dir, tmp)


def write_export(out_dir: str, hf_dir: str) -> str:
    state_dict, config, tokenizer = open_weights(out_dir)  # mapped: read a tensor at a time
    if config.tie_word_embeddings:
        # One matrix, two names; HF stores it once, as embed_tokens, and ties it on load.
        del state_dict["lm_head.weight"]
    write_safetensors(state_dict, hf_dir)

    # Every training document starts with BOT: a post-processor makes HF's tokenizer add it, as
    # Llama's tokenizers add <s>, so `tokenizer(text)` gives the ids the model was trained on.
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    hf_tokenizer = Tokenizer.from_str(tokenizer.to_str())
    bot = tokenizer.specials["bot"]
    hf_tokenizer.post_processor = TemplateProcessing(
        single=f"{bot} $A", pair=f"{bot} $A {bot} $B", special_tokens=[(bot, tokenizer.bot_id)]
    )
    files.atomic_write_text(os.path.join(hf_dir, "tokenizer.json"), hf_tokenizer.to_str())
    # config.json carries the fingerprint of the tokenizer.json beside it (--from-hf checks it).
    config = dataclasses.replace(config, tokenizer_sha256=tokenizer_digest(hf_tokenizer))
    write_json(os.path.join(hf_dir, "config.json"), hf_config(config, tokenizer))
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
    # The checksums of every file above, which --from-hf checks before it reads any of them
    # (transformers reads the folder as it is, and ignores this file).
    files.write_sums_of(hf_dir, sorted(os.listdir(hf_dir)))
    return hf_config(config, tokenizer)["architectures"][0]


def write_safetensors(state_dict: dict, hf_dir: str) -> None:
    """The HF tensors of state_dict (mapped from model.pt) into model.safetensors, or, past
    SHARD_BYTES, into model-0000i-of-0000n.safetensors files with the index transformers reads:
    one file's tensors in memory at a time, however big the model."""
    sizes = {name: t.numel() * t.element_size() for name, t in state_dict.items()}
    shards, size = [[]], 0
    for name in state_dict:
        if shards[-1] and size + sizes[name] > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += sizes[name]
    umask = os.umask(0)
    os.umask(umask)
    weight_map = {}
    for i, names in enumerate(shards, 1):
        file = "model.safetensors"
        if len(shards) > 1:
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = dict(pair for name in names for pair in to_hf_tensors(name, state_dict[name]))
        path = os.path.join(hf_dir, file)
        try:
            save_file(tensors, path, metadata={"format": "pt"})
        except SafetensorError as e:  # its I/O errors (a full disk) are not OSErrors
            raise OSError(str(e)) from e
        weight_map |= dict.fromkeys(tensors, file)
        del tensors  # (the next file's come from the mapped model.pt)
        with contextlib.suppress(OSError):  # (a filesystem without modes: as safetensors left it)
            os.chmod(path, 0o666 & ~umask)  # safetensors writes it private (0600): others may read
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        write_json(os.path.join(hf_dir, "model.safetensors.index.json"), index)


def read_json(path: str):
    """A JSON file's value; ValueError naming the file if it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path} ({e.strerror or e})") from e
    except ValueError as e:  # not JSON, or not UTF-8 text
        raise ValueError(f"{path} is not a JSON file ({e})") from e


def import_hf(hf_dir: str, out_dir: str, specials: dict[str, str | None] | None = None) -> None:
    """A Hugging Face Llama (or Mixtral) directory -> model.pt, config.json, tokenizer.json (kept
    as it is) and tokenizer_config.json (its special tokens: see data.load_tokenizer), in a new
    or empty out_dir (see new_folder: it appears whole or not at all)."""
    if not os.path.isdir(hf_dir):
        raise ValueError(f"{hf_dir} is not a directory")
    for name in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(hf_dir, name)):
            raise ValueError(f"{hf_dir} has no {name}")
    with new_folder(out_dir, "the output folder") as tmp:
        config_path = os.path.join(hf_dir, "config.json")
        # An export of this suite's is checked by its checksums (final.sums) before any file
        # is read; one written before them (its config.json has our tokenizer_sha256) is used
        # with a warning; a folder from elsewhere (transformers' save_pretrained) has neither.
        summed = os.path.isfile(os.path.join(hf_dir, files.FINAL_SUMS))
        if summed:
            verify_final(hf_dir, EXPORT)
        hf_config_json = read_json(config_path)
        if not summed and isinstance(hf_config_json, dict) and "tokenizer_sha256" in hf_config_json:
            verify_final(hf_dir, EXPORT)  # (its warning)
        try:
            config = config_from_hf(hf_config_json)
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ValueError(f"{config_path}: {e}") from e
        tokenizer = load_tokenizer(os.path.join(hf_dir, "tokenizer.json"), specials)
        check_tokenizer(config, tokenizer, hf_dir)  # (an export's config.json has its sha256)
        if tokenizer.get_vocab_size() > config.vocab_size:
            raise ValueError(
                f"{hf_dir}'s tokenizer has {tokenizer.get_vocab_size()} tokens, its model only "
                f"{config.vocab_size}"
            )
        read = hf_reader(config, hf_dir)  # (every name and shape checked first)
        write = functools.partial(save_tensor_by_tensor, config, read)
        save_final(tmp, write, config, tokenizer)


def hf_reader(config: LlamaConfig, hf_dir: str):
    """read(name, meta) -> our tensor `name` in fp32 (training keeps master weights in fp32),
    from hf_dir's safetensors file(s): what save_tensor_by_tensor writes model.pt from, one
    tensor at a time, never the whole model. Every tensor's name and shape is checked against
    the config first, from the files' headers alone (ValueError naming what does not fit)."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):  # sharded: the index maps each tensor to its file
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        files = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []
        # File names of the folder itself: never a path elsewhere (../, /etc/...).
        if not files or not all(isinstance(f, str) and f == os.path.basename(f) for f in files):
            raise ValueError(
                f"{index} is not a safetensors index: it needs a weight_map from each tensor's "
                f"name to the name of its file in {hf_dir}"
            )
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{hf_dir} has no model.safetensors (nor model.safetensors.index.json)")
    with torch.device("meta"):
        params = LlamaForPretraining(config).state_dict()
    # What must be loaded: every tensor, and of a mixture of experts' stacked weights (E, ...)
    # each expert's row (a Mixtral file holds one matrix per expert): (name, expert or None).
    expected = {
        (name, e)
        for name, p in params.items()
        for e in (range(p.size(0)) if OUR_EXPERTS.fullmatch(name) else [None])
    }
    sources: dict[str, list[tuple[str, str]]] = {}  # our name -> the (file, HF name)s it needs
    loaded = set()
    for file in files:
        try:
            with safe_open(os.path.join(hf_dir, file), framework="pt") as f:
                for hf_name in f.keys():
                    if hf_name.endswith("rotary_emb.inv_freq"):  # older checkpoints saved RoPE's
                        continue
                    shape = f.get_slice(hf_name).get_shape()  # from the header: no data read
                    meta = torch.empty(shape, device="meta")
                    for name, expert, values in from_hf_tensors(hf_name, meta):
                        where = (hf_dir, file, hf_name, shape, name, expert)
                        check_hf_tensor(*where, values, params, expected, config)
                        sources.setdefault(name, []).append((file, hf_name))
                        loaded.add((name, expert))
        except (OSError, SafetensorError) as e:  # a shard missing, unreadable or not one
            raise ValueError(f"{hf_dir}: cannot read {file} as safetensors ({e})") from e
    if config.tie_word_embeddings and ("tok_embeddings.weight", None) in loaded:
        loaded.add(("lm_head.weight", None))  # the same matrix as the embedding (read's `tied`)
    if missing := sorted(expected - loaded, key=str):
        name, expert = missing[0]
        example = name if expert is None else f"{name} (expert {expert})"
        raise ValueError(f"{hf_dir} lacks {len(missing)} tensors of its config, e.g. {example}")

    tied = {"lm_head.weight": "tok_embeddings.weight"} if config.tie_word_embeddings else {}

    def read(name: str, meta: torch.Tensor) -> torch.Tensor:
        value, name = torch.empty(meta.shape, dtype=torch.float32), tied.get(name, name)
        for file, hf_name in dict.fromkeys(sources[name]):  # (a fused one: once)
            with safe_open(os.path.join(hf_dir, file), framework="pt") as f:
                for ours, expert, values in from_hf_tensors(hf_name, f.get_tensor(hf_name)):
                    if ours == name:
                        (value if expert is None else value[expert]).copy_(values)
        return value

    return read


def check_hf_tensor(
    hf_dir, file, hf_name, shape, name, expert, values, params, expected, config
) -> None:
    """ValueError unless the HF tensor (values: its meta part for our `name`) fits the config."""
    if (name, expert) not in expected:
        what = "" if expert is None else f" (expert {expert})"
        raise ValueError(
            f"{hf_dir}: {file} holds {hf_name}{what}, which a model of its config.json "
            f"({describe(config)}) does not have"
        )
    param = params[name]  # (E, ...) for an expert's row, else whole
    if values.shape != (param.shape if expert is None else param.shape[1:]):
        fits = "" if expert is None else f" (experts, ...) of {name}"
        raise ValueError(
            f"{hf_dir}: {hf_name} has shape {tuple(shape)}, but its config.json makes "
            f"it{fits} {tuple(param.shape)}"
        )


def describe(config: LlamaConfig) -> str:
    """'2 layers', or '2 layers, 4 experts': what decides which tensors a model has."""
    experts = f", {config.num_local_experts} experts" if config.num_local_experts else ""
    return f"{config.num_hidden_layers} layers{experts}"


def main() -> None:
    p = flags.ArgumentParser(
        description="Export a run's --out-dir to the Hugging Face Llama (or Mixtral) format, "
        "or back."
    )  # never abbreviates a flag; a bad one ends in one line (exits.run)
    p.add_argument("src", help="a training run's --out-dir (or, with --from-hf, a HF directory)")
    p.add_argument(
        "dst",
        help="the HF directory to write (or, with --from-hf, an out-dir): a new or empty folder",
    )
    p.add_argument(
        "--from-hf",
        action="store_true",
        help="convert a HF Llama or Mixtral directory (config.json, model.safetensors or its "
        "shards, tokenizer.json) into model.pt, config.json, tokenizer.json, tokenizer_config.json",
    )
    flags.add_special_token_flags(p)
    args = p.parse_args()
    if args.from_hf:
        import_hf(args.src, args.dst, model_config.special_tokens(args))
        print(f"wrote model.pt, config.json and tokenizer.json to {args.dst}")
    else:
        if any(model_config.special_tokens(args).values()):
            p.error("--bot-token, --eot-token and --pad-token go with --from-hf")
        architecture = export(args.src, args.dst)
        kind = "Mixtral" if architecture.startswith("Mixtral") else "Llama"
        print(f"wrote a Hugging Face {kind} to {args.dst} ({architecture}.from_pretrained)")


if __name__ == "__main__":
    exits.run(main)
