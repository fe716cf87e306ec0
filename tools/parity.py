"""Proof you can see: every parallel strategy of the suite trains like one process.

    python -m tools.parity                          # every strategy on CPU (gloo): ~10 min, 2 cores
    python -m tools.parity --only ddp,cp,tp-sp      # some of them (the reference always runs)
    python -m tools.parity --png docs/parity.png --json parity.json   # renew the README's picture
    python -m tools.parity --optimizer muon --png docs/parity-muon.png   # the same, with Muon

Each strategy runs the same short training -- same corpus, tokenizer, seed, global batch of
sequences, fp32, document masks on -- as a user would launch it (`torchrun --nproc_per_node=N
train_*.py ...`, on CPU with gloo), and is compared with single-process training (train_dp.py
in one CPU process): the largest relative difference of a logged training loss, over every step,
and the largest absolute difference of a final weight (model.pt). They differ only where the
ranks add partial results in another order; AdamW then amplifies those fp32 rounding
differences on the embedding rows of rare tokens, so the weights are compared with a bound and
the losses far more tightly. The bounds are the test suite's (tests/harness.py, explained in
tests/test_training.py): a strategy that exceeds them makes tools/parity.py exit with status 1.

The picture (--png): every strategy's loss curve in one panel (they lie on top of each other),
each one's loss distance from the reference, step by step, on a log scale in the next, and the
largest distance of its final weights in the last.

nn.DataParallel (train_dp.py) splits a batch over GPUs only: on a CPU it is the single process
itself, the reference row. Expert parallelism (the ep rows) trains a mixture of experts, another
model: its rows are compared with that model in one process (single-moe, which runs when one of
them does). The runs write under a temporary directory (or --work-dir, kept), and share one
tokenizer and data cache (--cache-dir).
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lib import flags
from tools.plot_metrics import check_output_file, load_pyplot, output_failed, read_metrics

REPO = Path(__file__).resolve().parents[1]  # the repository root
REFERENCE = "single"
MOE_REFERENCE = "single-moe"  # the mixture of experts in one process: the ep rows' reference

# name -> (script, processes, flags, what it shows). Each is the lesson's own command line.
MICRO = ["--micro-batch-size", "2"]  # a pipeline needs micro-batches to fill it
MOE = ["--num-experts", "4", "--experts-per-token", "2"]  # the tiny model with 4 experts per MLP
STRATEGIES: dict[str, tuple[str, int, list[str], str]] = {
    REFERENCE: ("train_dp.py", 1, [], "one process (nn.DataParallel on a CPU)"),
    "ddp": ("train_ddp.py", 2, [], "DDP: gradients all-reduced"),
    "zero1": ("train_zero1.py", 2, [], "ZeRO-1: optimizer state sharded"),
    "fsdp-zero2": ("train_fsdp.py", 2, ["--zero-stage", "2"], "FSDP2, ZeRO-2"),
    "fsdp-zero3": ("train_fsdp.py", 2, ["--zero-stage", "3"], "FSDP2, ZeRO-3"),
    "hsdp": ("train_fsdp.py", 4, ["--replicate", "2"], "HSDP: 2 replicas x 2 shards"),
    "tp": ("train_tp.py", 2, ["--tp", "2"], "tensor parallel"),
    "tp-sp": ("train_tp.py", 2, ["--tp", "2", "--sequence-parallel"], "TP + sequence parallel"),
    "tp-fsdp": ("train_tp.py", 4, ["--tp", "2"], "2D: FSDP 2 x TP 2"),
    "pp-gpipe": ("train_pp.py", 2, ["--pp", "2", "--schedule", "gpipe", *MICRO], "PP, GPipe"),
    "pp-1f1b": ("train_pp.py", 2, ["--pp", "2", "--schedule", "1f1b", *MICRO], "PP, 1F1B"),
    "pp-interleaved": (
        "train_pp.py", 2, ["--pp", "2", "--schedule", "interleaved", *MICRO],
        "PP, interleaved 1F1B (2 stages per rank)",
    ),
    "cp": ("train_cp.py", 2, ["--cp", "2"], "context parallel (zigzag)"),
    "cp-fsdp": ("train_cp.py", 4, ["--cp", "2"], "2D: dp 2 x CP 2, FSDP over all 4"),
    "cp-hsdp": (
        "train_cp.py", 4, ["--cp", "2", "--replicate", "2"],
        "dp 2 x CP 2, HSDP: 2 replicas x 2 shards",
    ),
    "3d": (
        "train_pp.py", 8, ["--pp", "2", "--tp", "2", "--schedule", "1f1b", *MICRO],
        "3D: FSDP 2 x PP 2 x TP 2",
    ),
    # A mixture of experts is another model: the ep rows are compared with it in one process.
    MOE_REFERENCE: ("train_dp.py", 1, MOE, "one process, 4 experts (the ep rows' reference)"),
    "ep": ("train_ep.py", 2, ["--ep", "2", *MOE], "expert parallel: 2 experts per rank"),
    "ep-fsdp": (
        "train_ep.py", 4, ["--ep", "2", *MOE], "dp 2 x EP 2, the experts FSDP over dp",
    ),
}  # fmt: skip
REFERENCES = (REFERENCE, MOE_REFERENCE)


def reference_of(name: str) -> str:
    """The single-process run a strategy is compared with: the same model's."""
    return MOE_REFERENCE if "--num-experts" in STRATEGIES[name][2] else REFERENCE


# The test suite's bounds (tests/harness.py): weights within ATOL + RTOL * |reference|, logged
# losses within LOSS_RTOL (relative).
ATOL, RTOL, LOSS_RTOL = 1e-4, 1e-4, 1e-5
FLOOR = 1e-10  # where the log-scale plots draw a difference of exactly 0
# A mixture of experts: where its routing first differs from the reference's, the largest share
# of a step's (token, expert) assignments that may have moved (see compare). Measured: 2 of 4,096
# (DDP and EP alike, at step 19 of tools/parity.py's defaults); a wrong gradient moves hundreds.
ROUTING_SHARE = 0.01


def common_flags(args, out_dir: Path) -> list[str]:
    """What every run shares: the data, the model, the global batch, the schedule, fp32."""
    files = ["--data", args.data, "--cache-dir", args.cache_dir, "--out-dir", str(out_dir)]
    model = ["--model", "tiny", "--vocab-size", str(args.vocab_size)]
    batch = ["--seq-length", str(args.seq_length), "--batch-size", str(args.batch_size)]
    schedule = ["--max-steps", str(args.steps), "--lr", "1e-3", "--warmup-steps", "2"]
    schedule += ["--seed", str(args.seed), "--val-fraction", str(args.val_fraction)]
    run = ["--precision", "fp32", "--document-mask", "--num-workers", "0", "--sample-tokens", "0"]
    logs = ["--log-interval", "1", "--eval-interval", str(args.steps)]
    logs += ["--save-interval", str(args.steps), "--optimizer", args.optimizer]
    return [*files, *model, *batch, *schedule, *run, *logs]


TABLE_HEADER = (
    f"{'strategy':<16}{'ranks':>6}  {'max loss diff':>14}{'max weight diff':>17}  ok   what"
)


def table_row(name: str, r: dict) -> str:
    """The printed table's row of strategy `name`, from its compare() result `r`."""
    script, processes, _, what = STRATEGIES[name]
    diffs = f"{r['max_loss_rel_diff']:>14.1e}{r['max_weight_abs_diff']:>17.1e}"
    ok = "yes" if r["within_tolerance"] else "NO "
    row = f"{name:<16}{processes:>6}  {diffs}  {ok:<4} {what} ({script})"
    if r["routing_differs_from_step"]:
        differs = f"its routing differs from step {r['routing_differs_from_step']} on"
        row += f"; {differs}: held to the bounds before it"
    return row


def check_work_dir(path: str) -> None:
    """ValueError unless --work-dir `path` is a folder or can become one: neither it nor a
    folder above it is a file (which the runs would never overwrite); said before any run."""
    for folder in (Path(path), *Path(path).parents):
        if folder.exists():
            if not folder.is_dir():
                advice = "name a folder for the runs (one that does not exist is created)"
                raise ValueError(f"--work-dir {path}: {folder} is a file, not a folder; {advice}")
            return


def launch(name: str, args, work_dir: Path) -> Path:
    """Run one strategy to the end; its out-dir. SystemExit with its output if it fails."""
    script, processes, flags, _ = STRATEGIES[name]
    out = work_dir / name
    if processes == 1:
        command = [sys.executable, str(REPO / script)]
    else:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command = [*torchrun, f"--nproc_per_node={processes}", str(REPO / script)]
    command += common_flags(args, out) + flags
    # One thread per process: the ranks do not oversubscribe the cores, and every run computes
    # with the same threading (hence the same kernels) as the reference.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU and gloo everywhere, also on a GPU machine
    started = time.perf_counter()
    pipe = subprocess.PIPE
    with subprocess.Popen(command, cwd=REPO, env=env, stdout=pipe, stderr=pipe, text=True) as proc:
        try:
            stdout, stderr = proc.communicate()
        finally:  # Ctrl-C, or SIGTERM (see the end): stop it with a SIGTERM, which torchrun
            # passes on to its ranks; a kill (what subprocess.run sends) leaves them running.
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    if proc.returncode != 0:
        # The lesson's own one-line error if it said one (torchrun's report follows it), else
        # the end of its output.
        said = [line for line in stderr.splitlines() if re.match(r"(rank \d+: )?error: ", line)]
        tail = "\n".join(said or (stdout + stderr).splitlines()[-30:])
        raise SystemExit(
            f"tools/parity.py: {name} failed (exit code {proc.returncode}):\n"
            f"  {' '.join(command)}\n{tail}"
        )
    print(
        f"  {name:<15} {time.perf_counter() - started:6.1f} s  ({processes} processes)", flush=True
    )
    return out


def compare(out: Path, reference: Path) -> dict:
    """How far one run is from the reference: losses (relative), weights (absolute).

    A mixture of experts routes each token to its top k experts: a discrete choice, which a
    near-tie between two experts' scores makes on a rounding difference. Once a step's routing
    differs from the reference's (its logged tokens_per_expert), the two runs compute different
    things from that step on, whatever the strategy (train_ddp.py's as well): only the steps
    before it are held to the bounds, and the final weights only if it never happens. A
    rounding difference moves a token or two there; a wrong gradient, many at once: more than
    ROUTING_SHARE of the step's (token, expert) assignments moved is outside the bounds."""
    train, reference_train = read_metrics(str(out))[0], read_metrics(str(reference))[0]
    losses = {r["step"]: r["loss"] for r in train}
    expected = {r["step"]: r["loss"] for r in reference_train}
    routing = {r["step"]: r.get("tokens_per_expert") for r in train}
    expected_routing = {r["step"]: r.get("tokens_per_expert") for r in reference_train}
    diverged = next((s for s in sorted(expected) if routing.get(s) != expected_routing[s]), None)
    moved_share = 0.0  # the share of the assignments that moved to another expert, at `diverged`
    if diverged is not None and None not in (routing.get(diverged), expected_routing[diverged]):
        pairs = [
            (got, want)
            for got_layer, want_layer in zip(
                routing[diverged], expected_routing[diverged], strict=True
            )
            for got, want in zip(got_layer, want_layer, strict=True)
        ]
        moved = sum(abs(got - want) for got, want in pairs) / 2
        moved_share = moved / sum(want for _, want in pairs)
    if losses.keys() != expected.keys():
        raise SystemExit(
            f"tools/parity.py: {out.name} logged steps {sorted(losses)}, not {sorted(expected)}"
        )
    loss_diff = {s: abs(losses[s] - expected[s]) / abs(expected[s]) for s in expected}
    weights = torch.load(out / "model.pt", weights_only=True)
    reference_weights = torch.load(reference / "model.pt", weights_only=True)
    if weights.keys() != reference_weights.keys():
        raise SystemExit(
            f"tools/parity.py: {out.name}'s model.pt has other tensors than the reference"
        )
    weight_diff, excess = 0.0, 0.0  # excess > 1: outside ATOL + RTOL * |reference| somewhere
    for key, want in reference_weights.items():
        diff = (weights[key].float() - want.float()).abs()
        weight_diff = max(weight_diff, diff.max().item())
        excess = max(excess, (diff / (ATOL + RTOL * want.float().abs())).max().item())
    worst_loss = max(loss_diff.values())
    held = [d for s, d in loss_diff.items() if diverged is None or s < diverged]
    return {
        "losses": [losses[s] for s in sorted(losses)],
        "loss_diff_by_step": [loss_diff[s] for s in sorted(loss_diff)],
        "max_loss_rel_diff": worst_loss,
        "max_weight_abs_diff": weight_diff,
        "routing_differs_from_step": diverged,
        "within_tolerance": max(held, default=0.0) <= LOSS_RTOL
        and (excess <= 1.0 or diverged is not None)
        and (diverged is None or 0 < moved_share <= ROUTING_SHARE),
    }


def draw(results: dict, reference_losses: dict[str, list[float]], path: str) -> None:
    """Loss curves; each step's loss distance from its reference; the final weights' distance.
    reference_losses: {reference: its losses}, the dense model's and the experts' (if run)."""
    plt = load_pyplot()
    fig, (curves, gaps, weights) = plt.subplots(
        1, 3, figsize=(18, 5.5), gridspec_kw={"width_ratios": [1, 1, 0.8]}
    )
    steps = range(1, len(reference_losses[REFERENCE]) + 1)
    for name, losses in reference_losses.items():
        curves.plot(steps, losses, color="black", linewidth=5, alpha=0.5, label=name)
    for name, r in results.items():
        curves.plot(steps, r["losses"], linewidth=1, label=name)
        # A difference of exactly 0 has no logarithm: drawn at the floor of the axis instead.
        # A mixture of experts' steps from the one its routing differs at: crosses (not held).
        flip = r["routing_differs_from_step"] or len(steps) + 1
        held = [(s, max(d, FLOOR)) for s, d in zip(steps, r["loss_diff_by_step"], strict=True)]
        line = gaps.plot(
            *zip(*[p for p in held if p[0] < flip], strict=True),
            marker="o",
            markersize=3,
            linestyle="none",
            alpha=0.7,
            label=name,
        )
        if flip <= len(steps):
            gaps.plot(
                *zip(*[p for p in held if p[0] >= flip], strict=True),
                marker="x",
                linestyle="none",
                color=line[0].get_color(),
            )
    curves.set(xlabel="step", ylabel="training loss", title="every strategy: one curve per model")
    curves.legend(fontsize=7, ncol=2)
    gaps.axhline(LOSS_RTOL, color="red", linestyle="--", label="tests' bound")
    gaps.set(
        xlabel="step",
        ylabel="|loss - one process| / loss",
        yscale="log",
        ylim=(FLOOR, 1e-3),
        title=f"loss: distance from one process (0 drawn at {FLOOR:g})",
    )
    gaps.legend(fontsize=7, ncol=2)
    names = list(results)
    flipped = [results[n]["routing_differs_from_step"] is not None for n in names]
    weights.barh(
        names,
        [max(results[n]["max_weight_abs_diff"], FLOOR) for n in names],
        color=["lightgray" if f else "tab:blue" for f in flipped],
    )
    if any(flipped):  # a legend entry for the gray bars
        weights.barh(
            [names[flipped.index(True)]],
            [0],
            color="lightgray",
            label="routing differs (x: not held to the bound)",
        )
    weights.axvline(ATOL, color="red", linestyle="--", label=f"tests' bound ({ATOL:g} + rel.)")
    weights.set(
        xscale="log",
        xlim=(FLOOR, 1e-3),
        xlabel="largest |w - w of one process|",
        title="final weights: distance from one process",
    )
    weights.invert_yaxis()
    weights.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = flags.ArgumentParser(  # a bad flag: one line (below), never read as a longer one
        description="Run every parallel strategy on CPU for a short training on the same data "
        "and seed; print each one's largest loss and weight difference from single-process "
        "training, and draw all loss curves in one PNG.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument(
        "--only", default=None, help=f"comma-separated subset of: {', '.join(STRATEGIES)}"
    )
    p.add_argument("--data", default="stdlib", help="corpus, as the train scripts' --data")
    p.add_argument("--cache-dir", default=".cache", help="tokenizer and tokenized-data cache")
    p.add_argument(
        "--steps", type=flags.number_arg(int, 1), default=20, help="optimizer steps of every run"
    )
    p.add_argument(
        "--seq-length", type=flags.number_arg(int, 1), default=64, help="tokens per sequence"
    )
    p.add_argument(
        "--batch-size", type=flags.number_arg(int, 1), default=8, help="global sequences per step"
    )
    p.add_argument(
        "--vocab-size",
        type=flags.number_arg(int, flags.MIN_VOCAB_SIZE, flags.MAX_VOCAB_SIZE),
        default=512,
        help="of the trained tokenizer",
    )
    p.add_argument(
        "--seed", type=flags.number_arg(int, 0, flags.MAX_SEED), default=1234, help="of every run"
    )
    p.add_argument(
        "--val-fraction",
        type=flags.number_arg(float, 0, 1, low_open=True, high_open=True),
        default=0.01,
        help="documents held out",
    )
    p.add_argument(
        "--png",
        default="parity.png",
        help="the picture ('' for none; docs/parity.png is the README's: pass that to renew it)",
    )
    p.add_argument("--json", default=None, help="also write the table as JSON to this file")
    p.add_argument("--work-dir", default=None, help="keep the runs here (none: a temp dir)")
    p.add_argument(
        "--optimizer",
        choices=["adamw", "muon"],
        default="adamw",
        help="every run's (muon: each strategy's Muon against Muon in one process)",
    )
    args = p.parse_args()
    for flag, path in (("--png", args.png), ("--json", args.json)):  # now, not after the runs
        try:
            if path:
                check_output_file(flag, path)
        except ValueError as e:
            p.error(str(e))
    names = list(STRATEGIES) if args.only is None else [n.strip() for n in args.only.split(",")]
    if not all(names):
        p.error(f"--only: a comma-separated list of: {', '.join(STRATEGIES)}")
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        p.error(
            f"--only: unknown strategy {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}"
        )
    for flag in ("steps", "seq_length", "batch_size", "vocab_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if args.work_dir is not None:
        check_work_dir(args.work_dir)
    if args.png:
        load_pyplot()  # no matplotlib: say so now, not after ten minutes of training
    # The references first, alone (the first also fills the tokenizer and data cache): the
    # dense one always, the mixture of experts' when a strategy trains one.
    strategies = [n for n in names if n not in REFERENCES]
    names = [r for r in REFERENCES if r == REFERENCE or r in map(reference_of, strategies)]
    names += strategies

    with tempfile.TemporaryDirectory(prefix="parity_") as tmp:
        work_dir = Path(args.work_dir or tmp)
        try:
            work_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # not ours to write (check_work_dir saw no file in the way)
            raise ValueError(f"--work-dir {work_dir}: cannot create it ({e.strerror or e})") from e
        print(f"parity: {len(names)} runs of {args.steps} steps in {work_dir}")
        outs = {name: launch(name, args, work_dir) for name in names}
        results = {n: compare(outs[n], outs[reference_of(n)]) for n in strategies}
        reference_losses = {r: compare(outs[r], outs[r])["losses"] for r in REFERENCES if r in outs}

    print(f"\n{TABLE_HEADER}")
    for name, r in results.items():
        print(table_row(name, r))
    print(
        f"(loss diff: relative, the largest over {args.steps} steps; weight diff: absolute, the "
        f"largest over model.pt; ok: within the tests' bounds, losses {LOSS_RTOL:g} and weights "
        f"{ATOL:g} + {RTOL:g} x |w|)"
    )
    if args.json:
        table = {"settings": vars(args), "reference_losses": reference_losses, "results": results}
        try:
            Path(args.json).write_text(json.dumps(table, indent=1))
        except OSError as e:  # the table above is out already
            raise output_failed("--json", args.json, e) from e
    if args.png and results:
        draw(results, reference_losses, args.png)
        print(f"wrote {args.png}")
    failed = [n for n, r in results.items() if not r["within_tolerance"]]
    if failed:  # a NaN loss or weight lands here too: it compares as outside any bound
        raise SystemExit(f"tools/parity.py: outside the tolerance: {', '.join(failed)}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))  # launch's cleanup
    try:
        main()
    except KeyboardInterrupt:  # the run under way was stopped (launch); no traceback
        sys.exit(130)
    except ValueError as e:  # bad input (flags.ArgumentParser's too): one line, as exits.run
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
