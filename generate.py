"""Continue a prompt with a model trained by any train_*.py script.

    python generate.py --out-dir out --prompt "def " --max-new-tokens 100
    python generate.py --out-dir out --prompt "import os" --temperature 0          # greedy
    python generate.py --out-dir out --prompt "class " --top-p 0.9 --seed 1        # reproducible

Reads the three files every training script writes at the end of a run (`model.pt`,
`config.json`, `tokenizer.json`) and prints the prompt followed by its continuation. The prompt
is prefixed with the beginning-of-document token ([BOT], or the one a Hugging Face tokenizer
uses), as every training document is, and decoding stops at the end-of-document token ([EOT]),
which the model learnt to put at the end of a document. On a GPU the weights are loaded in bf16
(half the memory) where the GPU supports it; on CPU they stay fp32.

The training scripts' end-of-run sample calls `generate_text` below, so what they print is
exactly what this script prints for the same prompt and seed.
"""

import argparse

import torch

import stopping
from checkpoints import load_model
from data import DocumentTokenizer
from model import LlamaForPretraining


def generate_text(
    model: LlamaForPretraining,
    tokenizer: DocumentTokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int | None = None,
    use_cache: bool = True,
) -> str:
    """`prompt` followed by up to max_new_tokens generated tokens, stopping at the end of a
    document (the tokenizer's eot_id).

    temperature 0 is greedy (deterministic). `seed` makes sampling reproducible (None: a fresh
    random draw). The continuation is cut where the model's context (max_position_embeddings)
    ends.
    """
    model.eval()
    device = model.tok_embeddings.weight.device
    ids = [tokenizer.bot_id, *tokenizer.encode(prompt)]
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
        eos_id=tokenizer.eot_id,
        generator=generator,
        use_cache=use_cache,
    )  # (1, T + generated)
    return tokenizer.decode(out[0].tolist())  # skips the special tokens: BOT, EOT


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
    stopping.run(main)
