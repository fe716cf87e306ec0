"""docs/scale.md's table and plot: Llama 3.1 8B, 70B and 405B on 8 to 1,024 H100s, each layout's
memory per GPU and predicted step time, MFU and where the time goes, from tools/memory_plan.py.

    python -m tools.plot_scale                       # the table (markdown), as docs/scale.md has it
    python -m tools.plot_scale --png docs/scale.png  # and the plot

Each row is one `python -m tools.memory_plan` command (printed beside it), and one strategy row
of its plan: the layout's own (zero3 for FSDP, hsdp for HSDP, zero2 for a pipeline, which keeps
the weights gathered between its micro-batches). Plotting needs matplotlib
(requirements-plot.txt); the table does not.
"""

import io
import json
import sys
from contextlib import redirect_stdout

from lib import exits, flags
from tools import memory_plan
from tools.plot_metrics import check_output_file, load_pyplot, output_failed

# Llama 3.1's shapes as the planner's flags (the presets' 7b and 70b, reshaped).
LLAMA = {
    "8B": "--model 7b --ffn-size 14336 --num-kv-heads 8 --vocab-size 128256",
    "70B": "--model 70b --vocab-size 128256",
    "405B": "--model 70b --hidden-size 16384 --num-layers 126 --num-heads 128 --ffn-size 53248 "
    "--vocab-size 128256",
}
WORKLOAD = "--seq-length 8192 --gpu h100 --gpu-memory 80"
# (model, layout in words, strategy row, the layout's flags)
LAYOUTS = (
    ("8B", "FSDP 8", "zero3", "--world-size 8 --micro-batch-size 2"),
    ("8B", "FSDP 64", "zero3", "--world-size 64 --micro-batch-size 2"),
    ("8B", "HSDP 8 x 8", "hsdp", "--world-size 64 --replicate 8 --micro-batch-size 2"),
    ("8B", "FSDP 1024", "zero3", "--world-size 1024 --micro-batch-size 2"),
    ("8B", "HSDP 128 x 8", "hsdp", "--world-size 1024 --replicate 128 --micro-batch-size 2"),
    ("70B", "FSDP 64", "zero3", "--world-size 64"),
    ("70B", "TP 8 x FSDP 8", "zero3", "--world-size 64 --tp 8 --sequence-parallel"),
    ("70B", "FSDP 1024", "zero3", "--world-size 1024"),
    ("70B", "TP 4 x FSDP 256", "zero3", "--world-size 1024 --tp 4 --sequence-parallel"),
    ("70B", "TP 8 x FSDP 128", "zero3", "--world-size 1024 --tp 8 --sequence-parallel"),
    (
        "70B",
        "TP 8 x PP 4 x FSDP 32, interleaved",
        "zero2",
        "--world-size 1024 --tp 8 --sequence-parallel --pp 4 --micro-batches 16 "
        "--schedule interleaved --stages-per-rank 2",
    ),
    ("405B", "TP 8 x FSDP 128", "zero3", "--world-size 1024 --tp 8 --sequence-parallel"),
    ("405B", "TP 4 x FSDP 256", "zero3", "--world-size 1024 --tp 4 --sequence-parallel"),
    (
        "405B",
        "TP 8 x PP 8 x FSDP 2",
        "zero2",
        "--world-size 128 --tp 8 --sequence-parallel --pp 8 --micro-batches 32",
    ),
    (
        "405B",
        "TP 8 x PP 8 x FSDP 8",
        "zero2",
        "--world-size 512 --tp 8 --sequence-parallel --pp 8 --micro-batches 32",
    ),
    (
        "405B",
        "TP 8 x PP 16 x FSDP 8, interleaved",
        "zero2",
        "--world-size 1024 --tp 8 --sequence-parallel --pp 16 --micro-batches 32 "
        "--schedule interleaved --stages-per-rank 2",
    ),
)
HEADER = (
    "| model | GPUs | layout | row | AC | GB per GPU | step s | tokens/s per GPU | MFU "
    "| compute | comm | bubble | command |"
)


def command(model: str, layout: str) -> str:
    """The memory_plan command of one row."""
    return f"python -m tools.memory_plan {LLAMA[model]} {layout} {WORKLOAD}"


def plan_of(model: str, layout: str) -> dict:
    """memory_plan's --json plan for one row, computed in this process."""
    argv = sys.argv
    sys.argv = ["tools/memory_plan.py", *f"{LLAMA[model]} {layout} {WORKLOAD}".split(), "--json"]
    try:
        out = io.StringIO()
        with redirect_stdout(out):
            memory_plan.main()
    finally:
        sys.argv = argv
    return json.loads(out.getvalue())


def rows() -> list[dict]:
    """Each row's figures: its plan's strategy row, and the plan's world size."""
    result = []
    for model, words, strategy, layout in LAYOUTS:
        p = plan_of(model, layout)
        r = p["strategies"][strategy]
        checkpointed = r["recompute"] != "none"
        memory = r["total_checkpointed_gb" if checkpointed else "total_gb"]
        fits = r["fits_checkpointed" if checkpointed else "fits"]
        row = dict(model=model, gpus=p["world_size"], layout=words, strategy=strategy)
        result.append(
            {**r, **row, "fits": fits, "memory_gb": memory, "command": command(model, layout)}
        )
    return result


def markdown(table: list[dict]) -> str:
    """The table docs/scale.md quotes."""
    lines = [HEADER, "|" + " --- |" * (HEADER.count("|") - 1)]
    for r in table:
        step = r["step_time_s"]
        memory = f"{r['memory_gb']:.1f}" + ("" if r["fits"] else " (does not fit)")
        lines.append(
            f"| {r['model']} | {r['gpus']:,} | {r['layout']} | {r['strategy']} | {r['recompute']} "
            f"| {memory} | {step:.2f} | {r['tokens_per_sec_per_gpu']:,.0f} | {r['mfu']:.1%} "
            f"| {r['compute_s'] / step:.0%} | {r['exposed_comm_s'] / step:.0%} "
            f"| {r['bubble_s'] / step:.0%} | `{r['command']}` |"
        )
    return "\n".join(lines)


def plot(table: list[dict], path: str) -> None:
    """One horizontal bar per row: its step time split into compute, exposed communication,
    the pipeline's bubble and the optimizer step, as shares; its MFU at the end."""
    plt = load_pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(table) + 1.5))
    labels = [f"{r['model']} on {r['gpus']:,}: {r['layout']}" for r in table]
    parts = (("compute_s", "compute"), ("exposed_comm_s", "exposed communication"),
             ("bubble_s", "pipeline bubble"), ("optimizer_s", "optimizer step"))  # fmt: skip
    left = [0.0] * len(table)
    for key, name in parts:
        shares = [r[key] / r["step_time_s"] for r in table]
        ax.barh(labels, shares, left=left, label=name)
        left = [a + b for a, b in zip(left, shares, strict=True)]
    for i, r in enumerate(table):
        ax.text(1.01, i, f"MFU {r['mfu']:.0%}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.12)
    ax.set_xlabel("share of the step (predicted: python -m tools.plot_scale; docs/scale.md)")
    ax.set_title("Llama 3.1 on H100s: where each step's time goes")
    ax.legend(loc="upper center", bbox_to_anchor=(0.4, -0.09), ncol=4, fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise output_failed("--png", path, e) from e


def main() -> None:
    p = flags.ArgumentParser(
        description="docs/scale.md's table (and plot) of predicted step times on H100s.",
        formatter_class=flags.HelpFormatter,
    )
    p.add_argument("--png", default=None, help="also draw the plot into this file")
    args = p.parse_args()
    if args.png:
        try:
            check_output_file("--png", args.png)
        except ValueError as e:
            p.error(str(e))
    table = rows()
    print(markdown(table))
    if args.png:
        plot(table, args.png)


if __name__ == "__main__":
    exits.run(main)
