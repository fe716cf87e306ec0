"""What the training tests share: the settings of their runs, and helpers to launch the scripts
as a user would, read their outputs and compare weights. The tolerances are explained in
test_training.py's docstring."""

import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from lib.flags import build_parser, run_settings

REPO = Path(__file__).resolve().parents[1]

DP, DDP, ZERO1 = "train_dp.py", "train_ddp.py", "train_zero1.py"
# Every lesson, in the order the README reads them.
LESSONS = [DP, DDP, ZERO1, "train_fsdp.py", "train_tp.py", "train_pp.py", "train_cp.py",
           "train_ep.py"]  # fmt: skip

# The weights of two runs that split the same global batch differently (see the module docstring).
ATOL, RTOL = 1e-4, 1e-4
# Logged losses are means over ~250 targets of the same batch: they agree far more closely
# (measured: 9e-7 relative). The logged pre-clip gradient norm is checked too (measured: 6e-6),
# because the weights cannot show a gradient that is off by a constant factor: clipping (the
# norms here are ~5 > --grad-clip 1) and AdamW both cancel a uniform scale.
LOSS_RTOL, GRAD_NORM_RTOL = 1e-5, 1e-4

LAUNCH_TIMEOUT = 300  # seconds; a hung collective fails the test instead of the whole CI job

# The settings every run shares unless a test overrides one. 8 steps, a checkpoint every 4 (all
# kept), an evaluation every 4 on one global batch of validation data. val_fraction 0.125 of the
# 32 documents leaves 4 for validation (an even count: see test_ddp_validation_loss_counts_...)
# and 28 for training: in pad mode (one document per row) that is 3 steps per epoch, so 8 steps
# cross two epoch boundaries and a resume from step 4 lands mid-epoch.
BASE = {
    "model": "tiny",
    "seq_length": 32,
    "batch_size": 8,
    "vocab_size": 320,
    "max_steps": 8,
    "lr": 1e-3,
    "warmup_steps": 2,
    "seed": 1234,
    "val_fraction": 0.125,
    "log_interval": 1,
    "eval_interval": 4,
    "eval_batches": 1,
    "save_interval": 4,
    "keep_checkpoints": 5,
    "num_workers": 0,
    "sample_tokens": 0,
    "data_mode": "pack",
}
NUM_DOCS = 32
# BASE for --streaming, which refuses --val-fraction (validation: the stream's first documents).
STREAMING = {"streaming": True, "val_fraction": None}


# -------------------------------------------------------------------------------------------------
# Helpers: write a corpus, run a script, read its outputs, compare weights


def write_corpus(root: Path, num_docs: int = NUM_DOCS) -> Path:
    """Deterministic pseudo-English and pseudo-Python documents of very different lengths.

    About a quarter are one or two short lines (fewer than 32 tokens), so pad mode really pads
    and the number of targets differs between rows, micro-batches and ranks.
    """
    rng = random.Random(0)
    words = (
        "the a model data train loss step rank batch token layer weight grad sum mean over "
        "under with from into of and or not if then else return value index shard epoch"
    ).split()
    root.mkdir(parents=True, exist_ok=True)
    for i in range(num_docs):
        lines = []
        for _ in range(rng.randint(1, 2) if i % 4 == 1 else rng.randint(15, 60)):
            if rng.random() < 0.5:
                sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
                lines.append(sentence.capitalize() + ".")
            else:
                name, k = f"{rng.choice(words)}_{rng.randint(0, 99)}", rng.randint(0, 9)
                lines.append(f"def {name}(x, y):\n    return x * {k} + y")
        (root / f"doc_{i:02d}.txt").write_text("\n".join(lines) + "\n")
    return root


def cmd(data_dir: Path, cache_dir: Path, out_dir, **overrides) -> list[str]:
    """The command-line arguments for BASE updated with `overrides` (None drops a flag, True
    gives a switch such as --streaming)."""
    settings = {**BASE, **overrides}
    argv = ["--data", str(data_dir), "--cache-dir", str(cache_dir), "--out-dir", str(out_dir)]
    for name, value in settings.items():
        if value is True:
            argv.append(f"--{name.replace('_', '-')}")
        elif value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def launch_env(**extra) -> dict:
    # One thread per process: 2 ranks on 2 cores do not oversubscribe them, and every run
    # (1 or 2 processes) computes with the same threading, hence the same kernels.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):  # fmt: skip
        env.pop(name, None)  # never inherit a launcher's rendezvous
    env.update(extra)
    return env


def run_ddp_sh_env(**extra) -> dict:
    """The environment for run_ddp.sh: its torchrun and python on PATH, no GPU, a free port."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = launch_env(CUDA_VISIBLE_DEVICES="", MASTER_PORT=str(free_port()), PATH=path)
    for name in ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "MAX_RESTARTS", "RDZV_ID"):
        env.pop(name, None)
    env.update(extra)
    return env


def script_command(
    script: str,
    argv: list[str],
    world: int = 1,
    torchrun: bool | None = None,
    nonfinite: str | None = None,
) -> list[str]:
    """`python script` for world 1, torchrun for more ranks (or for one, with torchrun=True).
    nonfinite: the steps whose loss tests/nonfinite.py makes NaN ("2", or "2-": 2 and later)."""
    # A tool (tools/NAME.py) runs as a module from the repository root, as the README says.
    tool = script.startswith("tools/")
    program = ["-m", f"tools.{Path(script).stem}", *argv] if tool else [str(REPO / script), *argv]
    if nonfinite is not None:
        program = [str(REPO / "tests" / "nonfinite.py"), nonfinite, *program]
    if not (world > 1 if torchrun is None else torchrun):
        return [sys.executable, *program]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={world}", *program]  # fmt: skip


def run_script(
    script: str,
    argv: list[str],
    world: int = 1,
    expect_rc: int | None = 0,
    torchrun: bool | None = None,
    preexec_fn=None,
    nonfinite: str | None = None,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """Run `script` as a user would: `python script` for world 1, torchrun for more ranks (or
    for one, with torchrun=True).

    Asserts the exit code (unless expect_rc is None) and shows the run's output if it differs.
    preexec_fn: run in the child before the script starts (subprocess.run's), e.g. to set limits.
    nonfinite: make these steps' losses NaN (tests/nonfinite.py), e.g. "2" or "2-".
    env: variables over launch_env's (e.g. PYTHONPATH for a script of tests/ that imports lib/).
    """
    proc = subprocess.run(
        script_command(script, argv, world, torchrun, nonfinite), cwd=REPO,
        env=launch_env(**(env or {})),
        capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, preexec_fn=preexec_fn,
    )  # fmt: skip
    if expect_rc is not None:
        assert proc.returncode == expect_rc, describe(proc, f"expected exit code {expect_rc}")
    return proc


def file_size_limit(max_bytes: int):
    """A preexec_fn for run_script: no file the run writes may grow past max_bytes.

    A write beyond it fails with EFBIG ("File too large"), as one on a full disk fails with
    ENOSPC: the same OSError, without root or a real full disk. (Python ignores SIGXFSZ, so the
    write returns the error instead of the signal killing the process.)
    """

    def limit() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, hard))

    return limit


def describe(proc: subprocess.CompletedProcess, what: str) -> str:
    command = " ".join(str(part) for part in proc.args)
    return (
        f"{what}, got {proc.returncode} from: {command}\n"
        f"--- stdout (tail) ---\n{proc.stdout[-4000:]}\n"
        f"--- stderr (tail) ---\n{proc.stderr[-6000:]}"
    )


def load_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(out_dir / "model.pt", map_location="cpu", weights_only=True)


def load_checkpoint(out_dir: Path, step: int) -> dict:
    path = out_dir / "checkpoints" / f"step_{step:07d}.pt"
    return torch.load(path, map_location="cpu", weights_only=True)


def read_metrics(out_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of metrics.jsonl, in file order."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]


def assert_state_dicts_close(actual: dict, expected: dict, atol=ATOL, rtol=RTOL) -> None:
    assert actual.keys() == expected.keys()
    worst = max((actual[k] - expected[k]).abs().max().item() for k in expected)
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], atol=atol, rtol=rtol,
            msg=lambda m, name=name: f"{name}: {m} (largest difference of any tensor: {worst:.2e})",
        )  # fmt: skip


def assert_state_dicts_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    differ = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not differ, f"not bit-identical: {differ}"


def flatten(obj, prefix: str = "") -> dict:
    """Nested dicts/lists (an optimizer or scheduler state) as {path: leaf}."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return {prefix: obj}
    return {k: v for key, value in items for k, v in flatten(value, f"{prefix}/{key}").items()}


def assert_same_losses(actual_dir: Path, expected_dir: Path) -> None:
    """The same logged steps, with equal train/val losses and gradient norms (within rtol)."""
    (train_a, eval_a), (train_e, eval_e) = read_metrics(actual_dir), read_metrics(expected_dir)
    assert [r["step"] for r in train_a] == [r["step"] for r in train_e]
    assert [r["step"] for r in eval_a] == [r["step"] for r in eval_e]
    for key, a, e, rtol in [
        ("loss", train_a, train_e, LOSS_RTOL),
        ("grad_norm", train_a, train_e, GRAD_NORM_RTOL),
        ("val_loss", eval_a, eval_e, LOSS_RTOL),
        ("val_bpb", eval_a, eval_e, LOSS_RTOL),  # (the same loss, over the same text's bytes)
    ]:
        got, want = [r[key] for r in a], [r[key] for r in e]
        assert got == pytest.approx(want, rel=rtol), f"{key}: {got} != {want}"


def build_args(data_dir: Path, cache_dir: Path, devices: int = 1, **overrides):
    """The scripts' own (args, plan) for these settings, checked as they check them (on CPU)."""
    parser = build_parser("test")
    args = parser.parse_args(cmd(data_dir, cache_dir, "unused", **overrides))
    return args, run_settings(parser, args, devices, torch.device("cpu"))


def copy_checkpoint(src_dir: Path, step: int, dst_dir: Path) -> Path:
    """Copy one checkpoint into dst_dir/checkpoints/, as if a run there had stopped after it."""
    name = f"step_{step:07d}.pt"
    (dst_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    if (sums := src_dir / "checkpoints" / f"{name}.sums").exists():  # its checksums, beside it
        shutil.copy(sums, dst_dir / "checkpoints" / sums.name)
    return Path(shutil.copy(src_dir / "checkpoints" / name, dst_dir / "checkpoints" / name))


def checkpoint_files(out_dir: Path) -> list[str]:
    """The checkpoints in OUT/checkpoints, each with its checksums beside it (asserted)."""
    names = sorted(p.name for p in (out_dir / "checkpoints").iterdir())
    checkpoints = [n for n in names if not n.endswith(".sums")]
    assert names == sorted([*checkpoints, *(f"{n}.sums" for n in checkpoints if n.endswith(".pt"))])
    return checkpoints


def snapshot(root: Path) -> dict[str, bytes]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_train_dp_starts_from(source: Path, data_dir: Path, cache_dir: Path, out: Path) -> None:
    """train_dp.py --init-from `source` trains on from exactly its model.pt, config and tokenizer.

    One step at a negligible learning rate: the weights that come out are the ones that went in,
    to within ~1e-9, while freshly initialised weights would differ by ~0.02.
    """
    # --init-from brings the model and its tokenizer: no --model, no --vocab-size.
    settings = dict(model=None, vocab_size=None, max_steps=1, lr=1e-9, warmup_steps=0)
    argv = cmd(data_dir, cache_dir, out, **settings)
    run_script(DP, argv + ["--init-from", str(source)])
    assert_state_dicts_close(load_weights(out), load_weights(source), atol=1e-7, rtol=0)
    for name in ("config.json", "tokenizer.json"):
        assert (out / name).read_text() == (source / name).read_text(), name


def start(script: str, argv: list[str], world: int = 1) -> subprocess.Popen:
    """Start `script` as run_script runs it, without waiting: in a session (and process group)
    of its own, so that a test can signal the group as a terminal or Slurm would, and clean up."""
    return subprocess.Popen(
        script_command(script, argv, world), cwd=REPO, env=launch_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def wait_for_step(out_dir: Path, step: int, proc: subprocess.Popen) -> None:
    """Wait until the run has logged `step` in metrics.jsonl; fail (killing it) if it never does."""
    metrics, deadline = out_dir / "metrics.jsonl", time.monotonic() + LAUNCH_TIMEOUT
    while True:
        steps = []
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                try:
                    steps.append(json.loads(line)["step"])
                except ValueError:
                    pass  # a line being written
        if steps and max(steps) >= step:
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_group(proc)
            raise AssertionError(f"step {step} was never logged:\n{proc.communicate()[0][-6000:]}")
        time.sleep(0.02)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of a start()ed run's process group (its workers included)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # every process of it has exited


def write_foreign_tokenizer(
    directory: Path, specials: list[str], bos_post_processor: str | None = None, **config
) -> Path:
    """DIRECTORY/tokenizer.json: a byte-level BPE as other projects make them, with `specials`
    first (e.g. Llama 3's <|begin_of_text|>, <|end_of_text|>, or GPT-2's one <|endoftext|>), no
    [PAD]/[BOT]/[EOT]; bos_post_processor: a post-processor that prepends that token, as Llama's
    tokenizer.json has. config: entries of a tokenizer_config.json beside it (bos_token, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(["def add(x, y):\n    return x + y\n"] * 8, trainer)
    if bos_post_processor is not None:
        bos = (bos_post_processor, tokenizer.token_to_id(bos_post_processor))
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if config:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


# -------------------------------------------------------------------------------------------------
# A run that must end by itself: how long it took after a line, and what it left running

# The environment variable that marks every process of a watched run: torchrun passes its
# environment on to the ranks, and a DataLoader worker is a fork of its rank. Unlike a process
# group or a session (torchrun starts each rank in a session of its own), it stays with a
# process that outlives its parent.
RUN_MARKER = "LLAMA_TEST_RUN"


@dataclass
class WatchedRun:
    returncode: int
    output: str  # stdout and stderr together
    ended: float  # time.monotonic() when the launcher exited
    lines: list[tuple[float, str]] = field(default_factory=list)  # (when it was read, line)
    left: list[str] = field(default_factory=list)  # the run's processes still alive after it
    gone_after: float = 0.0  # seconds from the launcher's exit until none of the run was left

    def seconds_after(self, text: str) -> float:
        """From the first line holding `text` to the launcher's exit."""
        when = next(t for t, line in self.lines if text in line)
        return self.ended - when


def processes_of_run(marker: str) -> list[str]:
    """The live processes (not zombies) whose environment holds RUN_MARKER=marker, from /proc:
    "pid command" each."""
    found, tag = [], f"{RUN_MARKER}={marker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if tag not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue  # exited meanwhile, or not ours to read
        if state != "Z":
            found.append(f"{entry} {command.decode(errors='replace')[:200]}")
    return found


def kill_run(marker: str) -> None:
    """SIGKILL every live process of a watched run."""
    for process in processes_of_run(marker):
        try:
            os.kill(int(process.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass


def watch_run(
    command: list[str], timeout: float = LAUNCH_TIMEOUT, preexec_fn=None, during=None,
    grace: float = 5.0,
) -> WatchedRun:  # fmt: skip
    """Run `command` (script_command's) with every process marked (RUN_MARKER), noting when
    each line of its output came and when the launcher exited; then what of the run is still
    alive `grace` seconds later (WatchedRun.left), which is killed, so that a failing test
    leaves nothing behind. during(proc, marker, lines): called once the run has started, e.g.
    to signal it. On a timeout every process of the run is killed and the test fails."""
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(
        command, cwd=REPO, env=launch_env(**{RUN_MARKER: marker}), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, preexec_fn=preexec_fn,
    )  # fmt: skip
    lines: list[tuple[float, str]] = []

    def read() -> None:  # until every process holding the pipe has exited
        for line in proc.stdout:
            lines.append((time.monotonic(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if during is not None:
            during(proc, marker, lines)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        left = processes_of_run(marker)
        kill_run(marker)
        proc.wait()
        reader.join(timeout=5)
        output = "".join(line for _, line in lines)
        raise AssertionError(
            f"the run did not end within {timeout} s; its processes then: {left}\n"
            f"--- output (tail) ---\n{output[-6000:]}"
        ) from None
    except BaseException:  # `during` failed: leave nothing running
        kill_run(marker)
        proc.wait()
        raise
    ended = time.monotonic()
    while (left := processes_of_run(marker)) and time.monotonic() < ended + grace:
        time.sleep(0.05)
    gone_after = time.monotonic() - ended
    kill_run(marker)
    reader.join(timeout=5)
    output = "".join(line for _, line in lines)
    return WatchedRun(proc.returncode, output, ended, list(lines), left, gone_after)
