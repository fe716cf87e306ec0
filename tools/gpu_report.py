"""Prove the suite on a CUDA GPU in one command: the GPU tests, then tools/bench.py on two presets.

    python -m tools.gpu_report                     # everything, into gpu_report/ (about 10 minutes)
    python -m tools.gpu_report --out /tmp/r --skip-bench   # the tests alone
    python -m tools.gpu_report --skip-tests                # the benchmarks alone

1. `pytest tests/gpu`: every training script trains on this GPU (bf16, fp16, --compile,
   FlexAttention, --micro-batch-size auto, activation checkpointing, CPU offload), tracks fp32
   and resumes exactly (tests/gpu/test_gpu_training.py says what each test checks, and why its
   tolerance). Run in parallel with pytest-xdist where it is installed.
2. `tools/bench.py` for `small` at seq 1024 and `1b` at seq 2048 (bf16, --compile, vocabulary
   32000): tokens/s, MFU and peak memory of every strategy, and what DDP, ZeRO-1 and FSDP cost
   at world size 1 (BENCHMARKS.md's targets); then `--matmuls` on the same shapes, the fraction
   of the GPU's peak the model's matmuls reach (tools/memory_plan.py's --matmul-efficiency).

Everything lands in --out: report.md (ready to paste into BENCHMARKS.md: date, device, torch,
driver, commit, each exact command and its output), gpu_tests.log, and each benchmark's .txt
and .json. The exit code is non-zero when a test fails or a benchmark does not finish; the
report is written either way.
"""

import argparse
import datetime
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from lib import flags

REPO = Path(__file__).resolve().parents[1]  # the repository root

# The presets and shapes of BENCHMARKS.md's targets; the micro-batch sizes fit an 80 GB GPU.
BENCHES = {
    "small": "--model small --seq-length 1024 --micro-batch-size 32 --steps 30 --warmup 10".split(),
    "1b": "--model 1b --seq-length 2048 --micro-batch-size 8 --steps 20 --warmup 8".split(),
}
BENCH_COMMON = ["--vocab-size", "32000", "--precision", "bf16", "--compile", "--num-workers", "4"]


def run(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    """Run cmd from the repository root, its output into log (and echoed); (exit code, seconds)."""
    print(f"$ {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(
                cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, text=True
            )
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = 124
            f.write(f"\ntools/gpu_report.py: stopped after {timeout:.0f} s\n")
    return code, time.perf_counter() - start


def machine() -> list[str]:
    props = torch.cuda.get_device_properties(0)
    lines = [
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, "
        f"{props.multi_processor_count} SMs, {torch.cuda.device_count()} visible",
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), Python {sys.version.split()[0]}",
    ]
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        lines.append(f"driver: {subprocess.check_output(query, text=True).split()[0]}")
    except (OSError, subprocess.CalledProcessError, IndexError):
        pass
    try:
        commit = subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True, stderr=subprocess.DEVNULL
        ).strip()
        dirty = subprocess.check_output(["git", "status", "--porcelain"], cwd=REPO, text=True)
        lines.append(f"commit: {commit}{' (with uncommitted changes)' if dirty.strip() else ''}")
    except (OSError, subprocess.CalledProcessError):
        pass
    return lines


def tail_summary(text: str) -> str:
    """pytest's closing line (`N passed, ...`) and the short summary of what failed."""
    lines = text.strip().splitlines()
    start = next((i for i, line in enumerate(lines) if "short test summary" in line), None)
    keep = lines[start:] if start is not None else lines[-1:]
    return "\n".join(keep[-60:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", default="gpu_report", help="folder for the report and the logs")
    p.add_argument("--skip-tests", action="store_true", help="only the benchmarks")
    p.add_argument("--skip-bench", action="store_true", help="only the tests")
    p.add_argument(
        "--workers",
        type=flags.number_arg(int, 1),
        default=4,
        help="parallel test processes (xdist)",
    )
    p.add_argument(
        "--presets", default="small,1b", help=f"benchmarks to run, of {', '.join(BENCHES)}"
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: tools/gpu_report.py needs a CUDA GPU; torch sees none", file=sys.stderr)
        return 2
    presets = [name.strip() for name in args.presets.split(",") if name.strip()]
    unknown = [name for name in presets if name not in BENCHES]
    if unknown:
        print(f"error: --presets: unknown {', '.join(unknown)}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    report = ["# GPU proof", "", *(f"- {line}" for line in machine()), ""]

    def save() -> None:  # after every stage: a run cut short still leaves what it measured
        (out / "report.md").write_text("\n".join(report) + "\n")

    save()
    failed = False
    if not args.skip_tests:
        cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rfEs", "-p", "no:cacheprovider"]
        try:
            import xdist  # noqa: F401  (pytest-xdist: the launches run side by side)

            cmd += ["-n", str(args.workers)]
        except ImportError:
            pass
        code, seconds = run(cmd, out / "gpu_tests.log", timeout=1800)
        failed |= code != 0
        summary = tail_summary((out / "gpu_tests.log").read_text())
        command = shlex.join(["python", *cmd[1:]])
        report += ["## GPU tests", "", f"`{command}`: exit {code}, {seconds:.0f} s", ""]
        report += ["```text", summary, "```", ""]
        save()
    if not args.skip_bench:
        report += ["## tools/bench.py", ""]
        for name in presets:
            txt, js = out / f"bench_{name}.txt", out / f"bench_{name}.json"
            bench = [sys.executable, "-m", "tools.bench"]
            cmd = [*bench, *BENCHES[name], *BENCH_COMMON, "--json", str(js)]
            code, seconds = run(cmd, txt, timeout=1200)
            failed |= code != 0
            table = [line for line in txt.read_text().splitlines() if not line.startswith("bench:")]
            start = next(
                (i for i, line in enumerate(table) if line.startswith("tools/bench.py,")), 0
            )
            report += [f"exit {code}, {seconds:.0f} s", "", "```text", *table[start:], "```", ""]
            save()
            # The same shape's matmuls alone: the planner's --matmul-efficiency on this GPU.
            txt = out / f"matmuls_{name}.txt"
            cmd = [*bench, "--matmuls", *BENCHES[name], "--vocab-size", "32000"]
            code, seconds = run(cmd, txt, timeout=600)
            failed |= code != 0
            report += [f"exit {code}, {seconds:.0f} s", "", "```text", txt.read_text(), "```", ""]
            save()
    print("\n".join(report))
    print(f"report: {out / 'report.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
