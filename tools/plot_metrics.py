"""Plot training curves from one or several runs' metrics.jsonl.

    python -m tools.plot_metrics out                               # -> out/metrics.png
    python -m tools.plot_metrics out_dp out_ddp --output dp_vs_ddp.png    # runs overlaid

Four panels against the optimizer step: train and validation loss (the validation's also in
bits per byte of text, on the right axis: it compares runs with different tokenizers), learning
rate, training tokens/s and MFU (model FLOPs utilisation, where a script logs it as `mfu`, a
fraction of the device's peak); a fifth where a run scored zero-shot tasks (--eval-tasks): each
task's accuracy (`TASK_acc_norm`, or `TASK_acc` where the task has no acc_norm). Each run gets
one colour, labelled with its directory's name.

Plotting is optional: `pip install -r requirements-plot.txt` (matplotlib). Reading the metrics
needs only the standard library, and nothing here imports torch.
"""

import argparse
import json
import os
import sys


def read_metrics(out_dir: str) -> tuple[list[dict], list[dict]]:
    """(train records, evaluation records) of out_dir/metrics.jsonl, each sorted by step.

    Train lines carry `loss`, evaluation lines `val_loss`. Where a step appears twice (a run
    resumed from an earlier checkpoint logs those steps again), the later line wins; a last line
    cut short by a kill is skipped.
    """
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{path} does not exist; pass a training run's --out-dir")
    train, evals = {}, {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path} ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue  # a half-written last line
            raise ValueError(f"{path}, line {i + 1}, is not JSON: {line[:80]!r}") from None
        if problem := record_problem(record):
            raise ValueError(
                f"{path}, line {i + 1}: {problem}; it is not a line a training script writes"
            )
        if "loss" in record:
            train[record["step"]] = record
        if "val_loss" in record:
            evals[record["step"]] = record
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


# each a number, or null
PLOTTED = ("loss", "val_loss", "val_bpb", "lr", "muon_lr", "tokens_per_sec", "mfu")


# The keys of a zero-shot task's figures (--eval-tasks): TASK_acc, TASK_acc_norm.
TASK_METRICS = ("_acc", "_acc_norm")


def task_curves(evals: list[dict]) -> list[str]:
    """The key to plot for each task the evaluation records score: TASK_acc_norm, or TASK_acc
    where the task has no acc_norm (Winogrande, LAMBADA)."""
    keys = {k for r in evals for k in r if k.endswith(TASK_METRICS)}
    tasks = sorted({k.removesuffix("_norm").removesuffix("_acc") for k in keys})
    return [f"{t}_acc_norm" if f"{t}_acc_norm" in keys else f"{t}_acc" for t in tasks]


def record_problem(record) -> str | None:
    """What makes a metrics.jsonl record unplottable (None: nothing): a step that is not an
    integer, a plotted value that is neither a number nor null (lib/metrics.py writes a NaN or
    infinite value as null)."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return f'"step" is {step!r}, not an integer'
    for key in [*PLOTTED, *(k for k in record if k.endswith(TASK_METRICS))]:
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f'"{key}" is {value!r}, not a number'
    return None


def run_labels(out_dirs: list[str]) -> list[str]:
    """Each directory's own name, or its whole path where two names are the same."""
    names = [os.path.basename(os.path.normpath(d)) for d in out_dirs]
    return [name if names.count(name) == 1 else d for name, d in zip(names, out_dirs, strict=True)]


def load_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "error: plotting needs matplotlib: pip install -r requirements-plot.txt"
        ) from None
    matplotlib.use("Agg")  # write files; no display needed (servers, CI)
    import matplotlib.pyplot as plt

    return plt


def check_output_file(flag: str, path: str) -> None:
    """ValueError unless `path` names a file that can be written (tools/parity.py's --png and --json
    too): not a folder, and in a folder that exists; said before the work, not after it."""
    folder = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder; name the file to write in it")
    if not os.path.isdir(folder):
        raise ValueError(
            f"{flag} {path}: there is no folder {folder}; create it first, or "
            f"name a file in a folder that exists"
        )


def output_failed(flag: str, path: str, error: OSError) -> ValueError:
    """The one-line error for an output that check_output_file passed but that could not be
    written after the work (a read-only or full disk): what was printed stands."""
    return ValueError(f"{flag} {path}: could not write it ({error.strerror or error})")


def plot(runs: dict[str, tuple[list[dict], list[dict]]], output: str) -> None:
    """Draw the four panels for every run in `runs` ({label: (train, evals)}) into `output`."""
    plt = load_pyplot()
    tasks = any(task_curves(evals) for _, evals in runs.values())  # a fifth panel, or none
    fig, axes = plt.subplots(3 if tasks else 2, 2, figsize=(11, 10 if tasks else 7), sharex=True)
    (ax_loss, ax_lr), (ax_speed, ax_mfu) = axes[:2]
    if tasks:
        ax_tasks = axes[2][0]
        axes[2][1].axis("off")
        ax_tasks.set(title="zero-shot tasks (--eval-tasks)", ylabel="accuracy", xlabel="step")
    ax_bpb = ax_loss.twinx()  # the validation's bits per byte (runs from before it: none)

    def series(records, key, scale=1.0):
        points = [(r["step"], r[key] * scale) for r in records if r.get(key) is not None]
        return [s for s, _ in points], [v for _, v in points]

    any_mfu = False
    for i, (label, (train, evals)) in enumerate(runs.items()):
        color = f"C{i}"  # one colour per run across all four panels
        ax_loss.plot(*series(train, "loss"), color=color, alpha=0.8, label=f"{label} train")
        ax_loss.plot(*series(evals, "val_loss"), "o--", color=color, label=f"{label} val")
        ax_bpb.plot(*series(evals, "val_bpb"), "s:", color=color, alpha=0.6)
        ax_lr.plot(*series(train, "lr"), color=color, label=label)
        if steps := series(train, "muon_lr")[0]:  # --optimizer muon: Muon's, dashed
            ax_lr.plot(steps, series(train, "muon_lr")[1], "--", color=color, label=f"{label} Muon")
        ax_speed.plot(*series(train, "tokens_per_sec"), color=color, label=label)
        for j, key in enumerate(task_curves(evals)):  # a marker per task, the run's colour
            style = "osd^v<>p"[j % 8] + "-"
            ax_tasks.plot(*series(evals, key), style, color=color, label=f"{label} {key}")
        steps, mfu = series(train, "mfu", scale=100)
        if steps:
            any_mfu = True
            ax_mfu.plot(steps, mfu, color=color, label=label)

    ax_loss.set(title="loss", ylabel="cross-entropy (nats per token)")
    ax_bpb.set_ylabel("validation: bits per byte (squares)")
    ax_lr.set(title="learning rate", ylabel="lr")
    ax_speed.set(title="training throughput", ylabel="tokens / s", xlabel="step")
    ax_mfu.set(title="model FLOPs utilisation", ylabel="MFU (%)", xlabel="step")
    if not any_mfu:
        centre = {"ha": "center", "va": "center", "transform": ax_mfu.transAxes}
        ax_mfu.text(0.5, 0.5, "no MFU logged", color="gray", **centre)
    for ax in (ax_lr, ax_speed):
        ax.set_ylim(bottom=0)  # a dip in throughput should look like one, not like a cliff
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    # To a temporary file, renamed over `output` once complete: a failed write (a full disk, a
    # format matplotlib lacks) leaves no partial file, and an earlier plot there intact.
    extension = os.path.splitext(output)[1].lstrip(".").lower() or "png"
    tmp = f"{output}.tmp{os.getpid()}"
    try:
        fig.savefig(tmp, dpi=100, format=extension)
        os.replace(tmp, output)
    except OSError as e:
        raise ValueError(f"--output {output}: cannot write it ({e.strerror or e})") from None
    except ValueError as e:  # matplotlib: "Format 'xyz' is not supported (supported formats: ..."
        raise ValueError(f"--output {output}: {e}") from None
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)


def main() -> None:
    p = argparse.ArgumentParser(
        description="Plot loss, lr, tokens/s and MFU of training runs.", allow_abbrev=False
    )
    p.error = lambda message: p.exit(2, f"error: {message} (see --help)\n")  # one line, no usage
    p.add_argument("out_dirs", nargs="+", help="one or more runs' --out-dir (with metrics.jsonl)")
    p.add_argument(
        "--output",
        default=None,
        help="PNG to write (default: OUT_DIR/metrics.png for one run, metrics.png for several)",
    )
    args = p.parse_args()
    real = [os.path.realpath(d) for d in args.out_dirs]
    for i, d in enumerate(args.out_dirs):  # one curve, or two lying on each other: not meant
        if real[i] in real[:i]:
            first = args.out_dirs[real.index(real[i])]
            raise ValueError(f"{first} and {d} are the same run: name each run once")
    runs = {
        label: read_metrics(d)
        for label, d in zip(run_labels(args.out_dirs), args.out_dirs, strict=True)
    }
    for label, (train, _) in runs.items():
        if not train:
            raise ValueError(f"run {label} has logged no training step yet")
    output = args.output or (
        os.path.join(args.out_dirs[0], "metrics.png") if len(args.out_dirs) == 1 else "metrics.png"
    )
    check_output_file("--output", output)
    plot(runs, output)
    print(f"wrote {output}")


if __name__ == "__main__":
    # As exits.run, without importing torch: bad input is one line on stderr, exit code 2.
    try:
        main()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
