"""A finished run's model, loaded: what tools/generate.py, tools/export_hf.py and --init-from read
from an out-dir (model.pt, config.json, tokenizer.json, which every train script writes at its end).

    model, tokenizer = load_model("out", "cpu")
    text = generate_text(model, tokenizer, "def ", 64)     # lib/extras/sampling.py

The train scripts import this only for --init-from (init_from_config, check_init_from).
"""

import contextlib
import json
import math
import os
import pickle
import sys
import zipfile

import torch

from data import DocumentTokenizer, load_tokenizer, tokenizer_digest
from lib.checkpoints.files import CHECKPOINT_DIR_RE, FINAL_SUMS, list_checkpoints, verify_sums
from model import LlamaConfig, LlamaForPretraining, reset_buffers

OUT_DIR_FILES = ("model.pt", "config.json", "tokenizer.json")  # what model_pt.save_final writes


# config.json's fields that our LlamaConfig takes: an integer (True) or any number (False).
CONFIG_NUMBERS = {
    "vocab_size": True,
    "hidden_size": True,
    "intermediate_size": True,
    "num_hidden_layers": True,
    "num_attention_heads": True,
    "num_key_value_heads": True,
    "max_position_embeddings": True,
    "rope_theta": False,
    "rms_norm_eps": False,
    "num_local_experts": True,  # a Mixtral's
    "num_experts_per_tok": True,
}


def is_number(value, integer: bool = False) -> bool:
    """A positive finite number (an integer if `integer`), not a bool or a string."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        return False
    return 0 < value < 2**31 if integer else value > 0 and math.isfinite(value)


def check_config_values(hf: dict) -> None:
    """ValueError naming the fields of a config.json (this suite's, or a HF one's: the same names)
    that are not what LlamaConfig takes (a size that is not a positive integer, ...), before
    anything computes with them."""
    bad = [
        f"{name} {hf[name]!r}"
        for name, integer in CONFIG_NUMBERS.items()
        if name in hf and not is_number(hf[name], integer)
    ]
    if "tie_word_embeddings" in hf and not isinstance(hf["tie_word_embeddings"], bool):
        bad.append(f"tie_word_embeddings {hf['tie_word_embeddings']!r}")
    if not isinstance(hf.get("tokenizer_sha256", ""), str):
        bad.append(f"tokenizer_sha256 {hf['tokenizer_sha256']!r}")
    coef = hf.get("router_aux_loss_coef", 0)  # may be 0: no balance loss
    if coef != 0 and not is_number(coef):
        bad.append(f"router_aux_loss_coef {coef!r}")
    for name in ("rope_scaling", "rope_parameters"):
        if hf.get(name) is not None and not isinstance(hf[name], dict):
            bad.append(f"{name} {hf[name]!r}")
        elif "rope_theta" in (hf.get(name) or {}) and not is_number(hf[name]["rope_theta"]):
            bad.append(f"{name}.rope_theta {hf[name]['rope_theta']!r}")
    if bad:
        raise ValueError(f"bad values: {', '.join(bad)} (sizes are integers from 1 to 2**31 - 1)")


def load_config(out_dir: str) -> LlamaConfig:
    """out_dir/config.json as a LlamaConfig; ValueError if it is not one of this suite's."""
    config_path = os.path.join(out_dir, "config.json")
    try:
        with open(config_path) as f:
            fields = json.load(f)
        check_config_values(fields if isinstance(fields, dict) else {})  # (LlamaConfig(**[]) fails)
        return LlamaConfig(**fields)
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"{config_path} is not a config.json of this suite ({e})") from e


def check_tokenizer(config: LlamaConfig, tokenizer, where: str) -> None:
    """ValueError unless `tokenizer` is the one the model was trained with, by the fingerprint
    its config.json records (an out-dir from before fingerprints has none: not checked)."""
    if config.tokenizer_sha256 not in (None, tokenizer_digest(tokenizer)):
        raise ValueError(
            f"{where}/tokenizer.json is not the tokenizer this model was trained "
            f"with (config.json records another one's sha256): put back the run's "
            f"own tokenizer.json"
        )


_verified: set[tuple] = set()  # the out-dirs verify_final checked in this process, as they were

# What verify_final's messages say of a folder's writer: why a folder has no final.sums, what a
# whole copy of it holds, and how its changed file is put right. A run's --out-dir, or the
# Hugging Face folder tools/export_hf.py writes (which its --from-hf reads back).
RUN = (
    "its run is older than them",
    f"every final file of the run (model.pt, config.json, tokenizer.json, tokenizer_config.json, "
    f"{FINAL_SUMS})",
    "its run wrote it: put back the run's own file, or train again",
)
EXPORT = (
    "tools/export_hf.py wrote it before them",
    "every file of the export",
    "tools/export_hf.py wrote it: export the run again",
)


def verify_final(out_dir: str, writer: tuple[str, str, str] = RUN) -> None:
    """ValueError naming the first of out_dir's final files (model.pt, config.json, ...) whose
    bytes are not those its run (or `writer`: EXPORT) wrote, by the checksums beside them
    (files.FINAL_SUMS). An out-dir without them (written before they were) is used with a
    warning: it cannot be verified. The files of an out-dir are read only after this."""
    older, whole, again = writer
    sums = os.path.join(out_dir, FINAL_SUMS)
    stats = [
        (n, os.stat(p).st_mtime_ns, os.stat(p).st_size)
        for n in sorted(os.listdir(out_dir))
        if os.path.isfile(p := os.path.join(out_dir, n))
    ]
    seen = (os.path.realpath(out_dir), tuple(stats))  # (checked once, unless a file changed)
    if seen in _verified:
        return
    if not os.path.isfile(sums):
        print(
            f"warning: {out_dir} has no {FINAL_SUMS} ({older}): its files cannot be verified, "
            f"and are used as they are",
            file=sys.stderr,
        )
        _verified.add(seen)
        return
    listed = {}  # (an unreadable final.sums: verify_sums says so)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        with open(sums) as f:
            listed = dict(json.load(f)["crc32"])
    if missing := [n for n in listed if not os.path.isfile(os.path.join(out_dir, n))]:
        raise ValueError(
            f"{out_dir} has no {', '.join(missing)}, which {FINAL_SUMS} lists: copy {whole}"
        )
    try:
        verify_sums(sums)
    except ValueError as e:
        raise ValueError(f"{e}; it was changed since {again}") from e
    _verified.add(seen)


def unfinished(out_dir: str, missing: list[str]) -> str | None:
    """The message for a run's out-dir whose run has not finished (checkpoints, no model.pt)."""
    if not (list_checkpoints(out_dir) or list_checkpoints(out_dir, CHECKPOINT_DIR_RE)):
        return None
    return (
        f"{out_dir} holds a run that has not finished: checkpoints, but no "
        f"{', '.join(missing)}, which a run writes at its end. Run its training command again "
        f"to resume and finish it (its args.jsonl has the command)"
    )


def init_from_config(init_from: str) -> LlamaConfig:
    """--init-from's architecture, its config.json; ValueError unless it is a finished run's."""
    missing = [n for n in OUT_DIR_FILES if not os.path.isfile(os.path.join(init_from, n))]
    if missing:
        raise ValueError(
            unfinished(init_from, missing)
            or (
                f"--init-from {init_from}: no {', '.join(missing)} there; point it at the "
                f"--out-dir of a finished run (or of `python -m tools.export_hf --from-hf HF_DIR "
                f"OUT_DIR`)"
            )
        )
    verify_final(init_from)  # (once: open_weights, reading them later, does not again)
    return load_config(init_from)


def check_init_from(args, given: list[str]) -> None:
    """ValueError if --init-from comes with flags that shape the model or its tokenizer
    (`given`), or names the --out-dir itself."""
    if given:
        raise ValueError(
            f"--init-from {args.init_from} brings its own architecture (config.json) and "
            f"tokenizer (tokenizer.json): leave out {', '.join(given)}"
        )
    if os.path.realpath(args.init_from) == os.path.realpath(args.out_dir):
        # Refused rather than resolved either way: resuming would ignore --init-from, and a
        # fresh start would write its checkpoints and model.pt over the very files it starts
        # from (a run never destroys what is already there).
        raise ValueError(
            f"--init-from {args.init_from} is also the --out-dir: a run writes its model.pt "
            f"there, over the weights it starts from. To train on from that run's own "
            f"checkpoints, leave out --init-from (it resumes; raise --max-steps); to start "
            f"a new run from its model, give another --out-dir"
        )


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs that support it, else fp32 (CPUs run bf16 matmuls slowly, if at all)."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def open_weights(out_dir: str) -> tuple[dict, LlamaConfig, DocumentTokenizer]:
    """(model.pt's state_dict, config, tokenizer) of a training run's --out-dir, its tensors
    mapped from the file (torch.load's mmap): a tensor is read when it is used, and a slice of
    it reads only its own pages, so a sharded lesson's --init-from reads just its shards. The
    names and shapes are checked against the config's model (ValueError, with what to do),
    after every file's checksums (verify_final).
    """
    if not os.path.isdir(out_dir):
        raise ValueError(f"{out_dir} is not a directory: give a training run's --out-dir")
    missing = [name for name in OUT_DIR_FILES if not os.path.isfile(os.path.join(out_dir, name))]
    if missing:
        raise ValueError(
            unfinished(out_dir, missing)
            or (
                f"{out_dir} has no {', '.join(missing)}; a training script writes model.pt, "
                f"config.json and tokenizer.json at the end of its run (or run "
                f"`python -m tools.export_hf --from-hf HF_DIR {out_dir}`)"
            )
        )
    verify_final(out_dir)
    config = load_config(out_dir)
    config_path = os.path.join(out_dir, "config.json")
    tokenizer = load_tokenizer(os.path.join(out_dir, "tokenizer.json"))
    check_tokenizer(config, tokenizer, out_dir)
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.get_vocab_size()} tokens but the model only "
            f"{config.vocab_size}: {out_dir}'s files come from different runs"
        )
    model_path = os.path.join(out_dir, "model.pt")
    try:
        if not zipfile.is_zipfile(model_path):  # what torch.save writes (mmap needs one)
            raise pickle.UnpicklingError("not a zip archive")
        # weights_only=True: unpickling may only rebuild tensors, never run code, so a model.pt
        # from someone else cannot execute anything on this machine.
        state_dict = torch.load(model_path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any failure to read means "not a model.pt"
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, pickle.UnpicklingError):  # (torch's text suggests weights_only=False)
            reason = "not a file torch.save wrote, or a damaged one"
        raise ValueError(f"could not read {model_path} as a model state_dict ({reason})") from e
    if isinstance(state_dict, dict) and {"model", "optimizer"} <= state_dict.keys():
        raise ValueError(
            f"{model_path} is a training checkpoint, not the model.pt a run writes at "
            f"its end: resume the run to its end, or copy that model.pt"
        )
    try:
        with torch.device("meta"):  # the names and shapes the config gives, with no storage
            expected = LlamaForPretraining(config).state_dict()
    except (RuntimeError, MemoryError, ValueError) as e:
        raise ValueError(f"{config_path}: not a model this suite can build ({e})") from e
    wrong = [] if isinstance(state_dict, dict) else ["it is not a state_dict"]
    if not wrong:
        missing = sorted(expected.keys() - state_dict.keys())
        unexpected = sorted(state_dict.keys() - expected.keys())
        shapes = [
            f"{k} {tuple(state_dict[k].shape)} (wants {tuple(v.shape)})"
            for k, v in expected.items()
            if k in state_dict and getattr(state_dict[k], "shape", None) != v.shape
        ]
        wrong = (
            [f"missing {', '.join(missing[:3])}"] * bool(missing)
            + [f"unexpected {', '.join(unexpected[:3])}"] * bool(unexpected)
            + shapes[:3]
        )
    if wrong:
        raise ValueError(f"{model_path} does not fit {config_path} ({'; '.join(wrong)})")
    return state_dict, config, tokenizer


def load_model(
    out_dir: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[LlamaForPretraining, DocumentTokenizer]:
    """(model in eval mode on `device`, tokenizer) from a training run's --out-dir
    (open_weights: ValueError, with what to do, for a missing or unreadable file). dtype
    defaults to `default_dtype(device)`."""
    device = torch.device(device)
    state_dict, config, tokenizer = open_weights(out_dir)
    with torch.device("meta"):
        model = LlamaForPretraining(config)
    try:
        model.to_empty(device=device)
    except (RuntimeError, MemoryError) as e:  # sizes too large for this machine's memory
        raise ValueError(f"{out_dir}/config.json: a model too large to build here ({e})") from e
    model.load_state_dict(state_dict)
    reset_buffers(model, config)
    model.to(dtype=dtype or default_dtype(device))
    return model.eval(), tokenizer
