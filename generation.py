"""A finished run's model, loaded and sampled: what generate.py does on the command line and
every train script does at the end of its run (the sample), in one place.

    model, tokenizer = load_model("out", "cpu")      # model.pt, config.json, tokenizer.json
    text = generate_text(model, tokenizer, "def ", 64, temperature=0)

The train scripts import this only for their sample (and --init-from): a lesson runs without it
when --sample-tokens is 0.
"""

import os

import torch
from tokenizers import Tokenizer

from checkpoints import OUT_DIR_FILES, load_config
from data import DocumentTokenizer, load_tokenizer
from model import LlamaForPretraining


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs that support it, else fp32 (CPUs run bf16 matmuls slowly, if at all)."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_model(
    out_dir: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[LlamaForPretraining, Tokenizer]:
    """(model in eval mode on `device`, tokenizer) from a training run's --out-dir.

    Raises ValueError, with what to do about it, when the directory or one of its files is
    missing or unreadable. dtype defaults to `default_dtype(device)`.
    """
    device = torch.device(device)
    if not os.path.isdir(out_dir):
        raise ValueError(f"--out-dir {out_dir} is not a directory")
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


def generate_text(
    model: LlamaForPretraining, tokenizer: DocumentTokenizer, prompt: str, max_new_tokens: int,
    *sampling, **named_sampling,
) -> str:
    """`prompt` followed by up to max_new_tokens generated tokens, stopping at the end of a
    document (the tokenizer's eot_id); the sampling arguments are generate_ids' (temperature,
    top_k, top_p, seed, use_cache).

    temperature 0 is greedy (deterministic). `seed` makes sampling reproducible (None: a fresh
    random draw). The continuation is cut where the model's context (max_position_embeddings)
    ends (generate_ids says whether it was).
    """
    ids, _ = generate_ids(model, tokenizer, prompt, max_new_tokens, *sampling, **named_sampling)
    return tokenizer.decode(ids)  # skips the special tokens: BOT, EOT


def generate_ids(
    model: LlamaForPretraining,
    tokenizer: DocumentTokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int | None = None,
    use_cache: bool = True,
) -> tuple[list[int], bool]:
    """generate_text's token ids ([BOT], the prompt's, the generated ones), and whether the
    model's context cut the continuation short of max_new_tokens (not an end of document)."""
    model.eval()
    device = model.tok_embeddings.weight.device
    ids = [tokenizer.bot_id, *tokenizer.encode(prompt)]
    context = model.config.max_position_embeddings
    room = context - len(ids)
    if room <= 0:
        raise ValueError(
            f"the prompt is {len(ids)} tokens, no shorter than the model's context of {context}"
        )
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(
        torch.tensor([ids], device=device),  # (1, T)
        min(max_new_tokens, room),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=tokenizer.eot_id,
        generator=generator,
        use_cache=use_cache,
    )[0].tolist()  # T + generated
    cut = max_new_tokens > room and len(out) == context and out[-1] != tokenizer.eot_id
    return out, cut
