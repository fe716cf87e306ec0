"""Zero-shot multiple choice on a finished run (or a Hugging Face Llama directory): what the model
knows, scored as lm-evaluation-harness scores it (docs/evaluation.md).

    python -m tools.evaluate out --tasks hellaswag,arc_easy,arc_challenge,piqa,winogrande
    python -m tools.evaluate out --tasks hellaswag:500,mine.jsonl       # 500 examples; a file
    python -m tools.evaluate hf_model --tasks piqa                      # a HF Llama directory

Prints a table and writes DIR/eval.json (or --output): {task: {acc, acc_norm, acc_stderr,
acc_norm_stderr, examples, chance, truncated}}, LAMBADA's also perplexity and its stderr; it
replaces an earlier eval.json and writes nothing else. A HF directory is converted first, into a
temporary folder that goes at the end (tools/export_hf.py's --from-hf). The scoring is
lib/extras/evaluation.py's, the tasks lib/extras/eval_tasks.py's (a task file's schema).
"""

import contextlib
import json
import os
import tempfile

import torch

from lib import exits, flags
from lib.checkpoints import files
from lib.checkpoints.finished_run import load_model
from lib.extras import eval_tasks, evaluation
from tools.generate import device_arg

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def is_hf_dir(path: str) -> bool:
    """A Hugging Face model directory (safetensors weights, no model.pt)."""
    has = lambda name: os.path.isfile(os.path.join(path, name))
    weights = has("model.safetensors") or has("model.safetensors.index.json")
    return not has("model.pt") and has("config.json") and weights


@contextlib.contextmanager
def run_dir(path: str):
    """`path` as a run's out-dir: itself, or a HF directory converted into a temporary one."""
    if not is_hf_dir(path):
        yield path
        return
    from tools.export_hf import import_hf

    with tempfile.TemporaryDirectory(prefix="evaluate_") as tmp:
        import_hf(path, os.path.join(tmp, "run"))
        yield os.path.join(tmp, "run")


def check_output(path: str) -> None:
    """ValueError unless `path` can take eval.json: its folder exists, and it is new or an
    earlier eval.json (never a model's file, or anything else, written over)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--output {path}: no folder {folder}")
    if not os.path.exists(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            earlier = json.load(f)
        ours = isinstance(earlier, dict) and all(
            isinstance(r, dict) and "examples" in r for r in earlier.values()
        )
    except (OSError, ValueError):
        ours = False
    if not ours:
        raise ValueError(f"{path} exists and is not an earlier eval.json: give another --output")


def table(results: dict[str, dict]) -> str:
    """The results as an aligned text table, one task a line (- where a metric does not apply)."""

    def number(value, stderr=None) -> str:
        if value is None:
            return "-"
        return f"{value:.4f}" + ("" if stderr is None else f" ± {stderr:.4f}")

    lines = [("task", "examples", "acc", "acc_norm", "chance", "note")]
    for name, r in results.items():
        notes = [f"perplexity {r['perplexity']:.2f}"] if "perplexity" in r else []
        notes += [f"{r['truncated']} truncated"] if r["truncated"] else []
        lines.append(
            (
                name,
                str(r["examples"]),
                number(r["acc"], r["acc_stderr"]),
                number(r["acc_norm"], r["acc_norm_stderr"]),
                number(r["chance"] or None),
                ", ".join(notes),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def main() -> None:
    p = flags.ArgumentParser(
        description="Zero-shot multiple choice on a finished run or a Hugging Face directory.",
        formatter_class=flags.HelpFormatter,
    )
    p.add_argument("model_dir", metavar="DIR", help="a run's --out-dir, or a HF Llama directory")
    p.add_argument(
        "--tasks",
        required=True,
        help=f"NAME[:N],... : {', '.join(eval_tasks.HUB_TASKS)}, or a .jsonl/.json/.parquet "
        f"file (fields context, choices, label); N: the first N examples only",
    )
    p.add_argument(
        "--output", default=None, help="where to write the results (default DIR/eval.json)"
    )
    p.add_argument(
        "--batch-tokens",
        type=flags.number_arg(int, 1),
        default=4096,
        help="padded tokens per forward (fewer: less memory)",
    )
    p.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="the weights' dtype (auto: bf16 on a GPU that has it, else fp32); "
        "log-probabilities are always fp32",
    )
    p.add_argument(
        "--device",
        type=device_arg,
        default=None,
        help="cpu, cuda, ... (default: cuda if available)",
    )
    args = p.parse_args()
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    output = args.output or os.path.join(args.model_dir, "eval.json")
    check_output(output)  # before the work, not after
    # The tasks first: a bad name or record fails before the model is read.
    tasks = [eval_tasks.load_task(spec, n) for spec, n in eval_tasks.parse_tasks(args.tasks)]

    with run_dir(args.model_dir) as out_dir:
        model, tokenizer = load_model(out_dir, device, PRECISIONS.get(args.precision))
    window = model.config.max_position_embeddings
    results = evaluation.evaluate(
        model, tokenizer, tasks, window, batch_tokens=args.batch_tokens, device=device
    )
    print(table(results))
    files.atomic_write_text(output, json.dumps(results, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    exits.run(main)
