"""Continue a prompt with a model trained by any train_*.py script.

    python generate.py --out-dir out --prompt "def " --max-new-tokens 100
    python generate.py --out-dir out --prompt "import os" --temperature 0          # greedy
    python generate.py --out-dir out --prompt "class " --top-p 0.9 --seed 1        # reproducible

Reads the three files every training script writes at the end of a run (`model.pt`,
`config.json`, `tokenizer.json`) and prints the prompt followed by its continuation. The prompt
is prefixed with [BOT], as every training document is, and decoding stops at [EOT], the token the
model learnt to put at the end of a document. On a GPU the weights are loaded in bf16 (half the
memory) where the GPU supports it; on CPU they stay fp32.

The training scripts' end-of-run sample calls `generate_text` below, so what they print is
exactly what this script prints for the same prompt and seed.
"""

import argparse
import json
import os

import torch
from tokenizers import Tokenizer

from data import BOT, EOT, load_tokenizer
from model import LlamaConfig, LlamaForPretraining

OUT_DIR_FILES = ("model.pt", "config.json", "tokenizer.json")


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs that support it, else fp32 (CPUs run bf16 matmuls slowly, if at all)."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_config(out_dir: str) -> LlamaConfig:
    """out_dir/config.json as a LlamaConfig; ValueError if it is not one of this suite's."""
    config_path = os.path.join(out_dir, "config.json")
    try:
        with open(config_path) as f:
            return LlamaConfig(**json.load(f))
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"{config_path} is not a config.json of this suite ({e})") from e


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
    model: LlamaForPretraining,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int | None = None,
    use_cache: bool = True,
) -> str:
    """`prompt` followed by up to max_new_tokens generated tokens, stopping at [EOT].

    temperature 0 is greedy (deterministic). `seed` makes sampling reproducible (None: a fresh
    random draw). The continuation is cut where the model's context (max_position_embeddings)
    ends.
    """
    model.eval()
    device = model.tok_embeddings.weight.device
    ids = [tokenizer.token_to_id(BOT)] + tokenizer.encode(prompt).ids
    room = model.config.max_position_embeddings - len(ids)
    if room <= 0:
        raise ValueError(
            f"the prompt is {len(ids)} tokens, no shorter than the model's context of "
            f"{model.config.max_position_embeddings}"
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
        eos_id=tokenizer.token_to_id(EOT),
        generator=generator,
        use_cache=use_cache,
    )  # (1, T + generated)
    return tokenizer.decode(out[0].tolist())  # skips the special tokens: [BOT], [EOT]


def main() -> None:
    p = argparse.ArgumentParser(
        description="Continue a prompt with a trained model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # a mistyped flag is an error, never read as a longer one
    )
    p.add_argument("--out-dir", default="out", help="a training run's --out-dir (model.pt, ...)")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (deterministic)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest (0: all)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep mass p")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)"
    )
    args = p.parse_args()
    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0:
        p.error("--max-new-tokens, --temperature and --top-k must be >= 0")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    model, tokenizer = load_model(args.out_dir, device)
    text = generate_text(
        model,
        tokenizer,
        args.prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        seed=args.seed,
    )
    print(text)


if __name__ == "__main__":
    from common import run  # here, not at the top: common imports this module

    run(main)
