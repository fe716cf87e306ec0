"""Continue a prompt with a model trained by any train_*.py script.

    python -m tools.generate --out-dir out --prompt "def " --max-new-tokens 100
    python -m tools.generate --out-dir out --prompt "import os" --temperature 0       # greedy
    python -m tools.generate --out-dir out --prompt "class " --top-p 0.9 --seed 1     # reproducible

Reads the three files every training script writes at the end of a run (`model.pt`,
`config.json`, `tokenizer.json`) and prints the prompt followed by its continuation. The prompt
is prefixed with the beginning-of-document token ([BOT], or the one a Hugging Face tokenizer
uses), as every training document is, and decoding stops at the end-of-document token ([EOT]),
which the model learnt to put at the end of a document. On a GPU the weights are loaded in bf16
(half the memory) where the GPU supports it; on CPU they stay fp32.

The sample at the end of a training run calls generate_text (lib/extras/sampling.py), as this
script does, so what the run prints is exactly what this script prints for the same prompt and
seed.
"""

import argparse
import sys

import torch

from lib import exits, flags
from lib.checkpoints.finished_run import load_model
from lib.extras.sampling import generate_ids


def device_arg(value: str) -> torch.device:
    """--device: a device this torch can use here (argparse.ArgumentTypeError saying why not)."""
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a device; give cpu, cuda, cuda:1, mps, ..."
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no GPU is visible"
            raise argparse.ArgumentTypeError(
                f"{value}: no CUDA GPU here (torch {torch.__version__}: {build}); use --device cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(
                f"{value}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}"
            )
    elif device.type == "meta":
        raise argparse.ArgumentTypeError("meta tensors hold no values; use cpu or cuda")
    elif device.type != "cpu":
        try:
            torch.empty(1, device=device)
        except Exception as e:  # noqa: BLE001 - whatever the backend says, it cannot be used
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
            raise argparse.ArgumentTypeError(
                f"{value}: not usable here ({reason}); use --device cpu"
            ) from None
    return device


def main() -> None:
    p = flags.ArgumentParser(
        description="Continue a prompt with a trained model.", formatter_class=flags.HelpFormatter
    )  # never abbreviates a flag; a bad one ends in one line (exits.run)
    p.add_argument("--out-dir", default="out", help="a training run's --out-dir (model.pt, ...)")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument(
        "--max-new-tokens",
        type=flags.number_arg(int, 1),
        default=200,
        help="tokens to generate at most (fewer where the model's context ends: a note says so)",
    )
    p.add_argument(
        "--temperature",
        type=flags.number_arg(float, 0),
        default=0.8,
        help="0: greedy (deterministic)",
    )
    p.add_argument(
        "--top-k",
        type=flags.number_arg(int, 0),
        default=50,
        help="sample among the k likeliest (0: all)",
    )
    p.add_argument(
        "--top-p",
        type=flags.number_arg(float, 0, 1, low_open=True),
        default=None,
        help="nucleus sampling: keep the likeliest tokens of total probability p (default: off)",
    )
    p.add_argument(
        "--seed",
        type=flags.number_arg(int, 0, 2**64 - 1),
        default=None,
        help="sampling seed (default: random)",
    )
    p.add_argument(
        "--device",
        type=device_arg,
        default=None,
        help="cpu, cuda, cuda:1, ... (default: cuda if available)",
    )
    args = p.parse_args()
    try:
        args.prompt.encode("utf-8")  # bytes that are not UTF-8 arrive as lone surrogates
    except UnicodeEncodeError:
        p.error("--prompt is not valid UTF-8 text")
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")

    model, tokenizer = load_model(args.out_dir, device)
    if not all(bool(torch.isfinite(w).all()) for w in model.parameters()):  # a diverged run
        # (sampling would fail in torch.multinomial, and greedy decoding print nothing)
        raise ValueError(
            f"{args.out_dir}/model.pt holds NaN or infinite weights: nothing to "
            f"generate from (an earlier checkpoint may hold finite ones)"
        )
    ids, cut = generate_ids(
        model,
        tokenizer,
        args.prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        seed=args.seed,
    )
    print(tokenizer.decode(ids))
    if cut:
        context = model.config.max_position_embeddings
        new = len(ids) - 1 - len(tokenizer.encode(args.prompt))
        print(
            f"note: stopped at the model's context of {context} tokens, after {new} new tokens "
            f"of --max-new-tokens {args.max_new_tokens}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    exits.run(main)
