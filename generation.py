"""A finished run's model, loaded: what generate.py, export_hf.py and --init-from read from an
out-dir (model.pt, config.json, tokenizer.json, which every train script writes at its end).

    model, tokenizer = load_model("out", "cpu")
    text = generate_text(model, tokenizer, "def ", 64)     # model.py's sampling

The train scripts import this only for --init-from (init_from_config, check_init_from).
"""

import json
import os

import torch

from data import DocumentTokenizer, load_tokenizer
from model import LlamaConfig, LlamaForPretraining

OUT_DIR_FILES = ("model.pt", "config.json", "tokenizer.json")  # checkpoints.save_final's


def load_config(out_dir: str) -> LlamaConfig:
    """out_dir/config.json as a LlamaConfig; ValueError if it is not one of this suite's."""
    config_path = os.path.join(out_dir, "config.json")
    try:
        with open(config_path) as f:
            return LlamaConfig(**json.load(f))
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"{config_path} is not a config.json of this suite ({e})") from e


def init_from_config(init_from: str) -> LlamaConfig:
    """--init-from's architecture, its config.json; ValueError unless it is a finished run's."""
    missing = [n for n in OUT_DIR_FILES if not os.path.isfile(os.path.join(init_from, n))]
    if missing:
        raise ValueError(
            f"--init-from {init_from}: no {', '.join(missing)} there; point it at the "
            f"--out-dir of a finished run (or of `python export_hf.py --from-hf HF_DIR OUT_DIR`)"
        )
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


def load_model(
    out_dir: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[LlamaForPretraining, DocumentTokenizer]:
    """(model in eval mode on `device`, tokenizer) from a training run's --out-dir.

    Raises ValueError, with what to do about it, when the directory or one of its files is
    missing or unreadable. dtype defaults to `default_dtype(device)`.
    """
    device = torch.device(device)
    if not os.path.isdir(out_dir):
        raise ValueError(f"{out_dir} is not a directory: give a training run's --out-dir")
    missing = [name for name in OUT_DIR_FILES if not os.path.isfile(os.path.join(out_dir, name))]
    if missing:
        raise ValueError(
            f"{out_dir} has no {', '.join(missing)}; a training script writes model.pt, "
            f"config.json and tokenizer.json at the end of its run (or run "
            f"`python export_hf.py --from-hf HF_DIR {out_dir}`)"
        )
    config = load_config(out_dir)
    config_path = os.path.join(out_dir, "config.json")
    tokenizer = load_tokenizer(os.path.join(out_dir, "tokenizer.json"))
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.get_vocab_size()} tokens but the model only "
            f"{config.vocab_size}: {out_dir}'s files come from different runs"
        )

    model_path = os.path.join(out_dir, "model.pt")
    try:
        # weights_only=True: unpickling may only rebuild tensors, never run code, so a model.pt
        # from someone else cannot execute anything on this machine.
        state_dict = torch.load(model_path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read means "not a model.pt"
        raise ValueError(f"could not read {model_path} as a model state_dict ({e})") from e
    model = LlamaForPretraining(config)
    try:
        model.load_state_dict(state_dict)
    except (RuntimeError, AttributeError) as e:
        raise ValueError(f"{model_path} does not fit {config_path} ({e})") from e
    model.to(device=device, dtype=dtype or default_dtype(device))
    return model.eval(), tokenizer
