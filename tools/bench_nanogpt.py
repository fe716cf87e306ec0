"""Time train_dp.py against nanoGPT's CPU recipe, side by side, on one character-level corpus.

    python -m tools.bench_nanogpt --nanogpt ~/src/nanoGPT                 # the comparison, 2 rounds
    python -m tools.bench_nanogpt --nanogpt ~/src/nanoGPT --suite-flags "--optimizer muon \
        --max-steps 350 --warmup-steps 10 --muon-lr 0.03 --lr 4e-2"          # the laptop recipe
    python -m tools.bench_nanogpt --nanogpt ~/src/nanoGPT --max-steps 200      # a quick look
    python -m tools.bench_nanogpt --nanogpt ~/src/nanoGPT --step       # the step alone, one process
    python -m tools.bench_nanogpt --transformers                # the step alone vs LlamaForCausalLM
    python -m tools.bench_nanogpt --nanogpt ~/src/nanoGPT --compile      # this suite with --compile

nanoGPT is not a dependency: pass a checkout of github.com/karpathy/nanoGPT (its train.py,
model.py and config/train_shakespeare_char.py are used as they are). Nothing is downloaded.

What it does, in --work-dir:
  1. A character-level corpus: the ASCII-only .py files of this Python's standard library, in
     path order, up to --corpus-chars characters, one document per line of corpus.jsonl.
  2. train_dp.py's split of it (whole documents, --val-fraction 0.01), and the same split in
     nanoGPT's format (data/bench_char/{train,val}.bin, meta.pkl, as its shakespeare_char
     prepare.py writes them); a character-level tokenizer.json for this suite.
  3. This suite's tokenized data cached, so that no timed run pays for tokenizing.
  4. --rounds rounds of the two runs, alternating (A B, then B A, ...), each a fresh process
     from start-up to exit (the wall time includes imports, data loading and the final save):
     SUITE_FLAGS and then --suite-flags for train_dp.py; NANOGPT_FLAGS for nanoGPT's train.py
     with config/train_shakespeare_char.py (its README's CPU recipe); --max-steps for both.
  5. Per run: the wall time, the median step time (evaluation and saving left out), the
     validation loss each reports itself, and both final models scored on the same held-out
     text (the validation documents joined by newlines, in windows of 65 characters): mean
     nats per character. Then, per round, this suite's time to nanoGPT's held-out loss: its
     wall time over nanoGPT's where its final model is at least as good, else "not reached".

--compile compiles this suite's side, --compile-nanogpt the other (the like-for-like pair);
--busy N spins N processes meanwhile; --threads N sets OMP_NUM_THREADS. Nothing is asserted: a
measurement, not a test (tests/test_bench.py checks its preparation and parsing). A --nanogpt
folder that is not nanoGPT's: one line, exit 2; a failed run: one line (its log under
--work-dir), exit 1, after the table of the runs that finished.
"""

import argparse
import datetime
import importlib.util
import json
import os
import pickle
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the repository root

# The issue's shape, in the two programs' own flags.
SUITE_FLAGS = "--num-layers 4 --hidden-size 128 --num-heads 4 --num-kv-heads 4".split()
SUITE_FLAGS += "--ffn-size 344 --seq-length 64 --batch-size 12 --lr 1e-3 --warmup-steps 100".split()
NANOGPT_FLAGS = "--device=cpu --compile=False --eval_iters=20 --log_interval=1".split()
NANOGPT_FLAGS += "--block_size=64 --batch_size=12 --n_layer=4 --n_head=4".split()
NANOGPT_FLAGS += "--n_embd=128 --dropout=0.0".split()
# The laptop recipe (README, BENCHMARKS.md): Muon, fewer steps, higher rates, for --suite-flags.
LAPTOP = "--optimizer muon --max-steps 350 --warmup-steps 10 --muon-lr 0.03 --lr 4e-2".split()
SEQ_LENGTH = 64
CHAR_VOCAB = 99  # --transformers: the corpus's 96 characters and [PAD] [BOT] [EOT]
DATASET = "bench_char"  # nanoGPT's data/<dataset>/ under --work-dir
ITER_RE = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms")
NANO_VAL_RE = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)")


# -------------------------------------------------------------------------------------------------
# The corpus, in both formats


def stdlib_documents(max_chars: int) -> list[str]:
    """ASCII-only .py files of the standard library, in path order, up to max_chars in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or total >= max_chars:
            continue
        try:
            text = path.read_bytes().decode("ascii")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            docs.append(text)
            total += len(text)
    return docs


def char_tokenizer(chars: list[str]):
    """A tokenizers Tokenizer with one token per character: [PAD] [BOT] [EOT] = 0, 1, 2, then
    `chars` in order (a BPE with no merges: every character stays a token)."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[BOT]", "[EOT]", *chars])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.add_special_tokens(["[PAD]", "[BOT]", "[EOT]"])
    tokenizer.decoder = decoders.Fuse()  # characters back to back, no spaces between
    return tokenizer


def write_nanogpt_data(train_text: str, val_text: str, chars: list[str], data_dir: Path) -> None:
    """train.bin, val.bin (uint16 ids) and meta.pkl, as nanoGPT's shakespeare_char/prepare.py."""
    import numpy as np

    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = dict(enumerate(chars))
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("train", train_text), ("val", val_text)):
        ids = np.array([stoi[c] for c in text], dtype=np.uint16)
        ids.tofile(data_dir / f"{name}.bin")
    with open(data_dir / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)


def prepare(args) -> dict:
    """Steps 1-3 of the module docstring; the texts and paths the runs and the scoring need."""
    import data
    from lib import flags, training

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    corpus_path = work / "corpus.jsonl"
    docs = stdlib_documents(args.corpus_chars)
    corpus_path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    cache_dir = str(work / "cache")
    tokenizer = str(work / "tokenizer.json")
    files = ["--data", str(corpus_path), "--tokenizer", tokenizer, "--cache-dir", cache_dir]
    suite_argv = [*files, *SUITE_FLAGS]
    steps = ["--max-steps", str(getattr(args, "max_steps", 2000))]
    train_args = flags.build_parser("").parse_args(suite_argv + steps)
    # train_dp.py's own split of the documents (the same function, the same defaults).
    ds = data.load_corpus(str(corpus_path), "text", cache_dir)
    train_docs, val_docs = data.split_corpus(ds, train_args.val_fraction, seed=0)
    train_text, val_text = ("\n".join(d["text"]) for d in (train_docs, val_docs))
    chars = sorted(set(train_text) | set(val_text))
    char_tokenizer(chars).save(str(work / "tokenizer.json"))
    write_nanogpt_data(train_text, val_text, chars, work / "data" / DATASET)
    training.build_datasets(train_args, train_args.tokenizer)  # tokenized once, cached
    prepared = {"work": work, "suite_argv": suite_argv, "val_text": val_text, "chars": chars}
    return prepared | {"train_chars": len(train_text)}


# -------------------------------------------------------------------------------------------------
# The runs


def suite_command(
    prep: dict, out_dir: Path, max_steps: int, compile: bool = False, extra: str = ""
) -> list[str]:
    run = ["--max-steps", str(max_steps), "--out-dir", str(out_dir)]
    compiled = ["--compile"] if compile else []
    script = [sys.executable, str(REPO / "train_dp.py")]
    return [*script, *prep["suite_argv"], *run, *compiled, *shlex.split(extra)]


def nanogpt_command(nanogpt: Path, out_dir: Path, max_steps: int, compile=False) -> list[str]:
    script = [sys.executable, str(nanogpt / "train.py")]
    config = str(nanogpt / "config" / "train_shakespeare_char.py")
    run = [f"--max_iters={max_steps}", f"--lr_decay_iters={max_steps}", f"--dataset={DATASET}"]
    compiled = ["--compile=True"] if compile else []
    return [*script, config, *NANOGPT_FLAGS, *run, f"--out_dir={out_dir}", *compiled]


def timed_run(command: list[str], cwd: Path, env: dict, log: Path, name: str) -> float:
    """Run `command` to its end, its output into `log`; its wall time in seconds. A run that
    fails: TrainingError, in one line, saying how it ended (`name` the program) and its last line
    of output (the whole of it stays in `log`)."""
    from lib.exits import TrainingError

    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(command, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise TrainingError(f"{name} failed {how_it_ended(proc.returncode, log)}")
    return seconds


def how_it_ended(returncode: int, log: Path) -> str:
    """'with exit code 1: its last line of output (its output: LOG)', or 'killed by SIGKILL',
    or '... and no output (LOG)', in one line."""
    if returncode < 0:
        try:
            ended = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            ended = f"killed by signal {-returncode}"
    else:
        ended = f"with exit code {returncode}"
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    last = next((line for line in reversed(lines) if line), None)
    if last is None:
        return f"{ended} and no output ({log})"
    if len(last) > 300:  # its tail: a long line ends with what went wrong
        last = "..." + last[-300:]
    return f"{ended}: {last} (its output: {log})"


def suite_figures(out_dir: Path) -> dict:
    """Median step ms and the last validation loss, from a run's metrics.jsonl."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    step_ms = [r["step_ms"] for r in records if r.get("step_ms") is not None]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return {"step_ms": statistics.median(step_ms), "val_loss": val[-1] if val else None}


def nanogpt_figures(output: str, eval_interval: int = 250) -> dict:
    """Median step ms (iteration 0 and the evaluation iterations, whose time includes the
    evaluation, left out) and the last validation loss, from nanoGPT's printed output."""
    times, val = [], None
    for line in output.splitlines():
        if m := ITER_RE.match(line):
            if int(m[1]) % eval_interval:
                times.append(float(m[2]))
        elif m := NANO_VAL_RE.match(line):
            val = float(m[2])
    return {"step_ms": statistics.median(times) if times else None, "val_loss": val}


# -------------------------------------------------------------------------------------------------
# Both final models on the same held-out text


def held_out_windows(ids: list[int], seq_length: int):
    """(x, y) of the whole windows of seq_length + 1 ids at a stride of seq_length."""
    import torch

    n = (len(ids) - 1) // seq_length
    tokens = torch.tensor(ids[: n * seq_length + 1])
    return tokens[:-1].view(n, seq_length), tokens[1:].view(n, seq_length)


def mean_loss(logits_of, x, y, rows: int = 64) -> float:
    """Mean cross-entropy (nats per character) of logits_of(x) against y, in batches."""
    import torch
    import torch.nn.functional as F

    total = 0.0
    with torch.no_grad():
        for xb, yb in zip(x.split(rows), y.split(rows), strict=True):
            logits = logits_of(xb)
            total += F.cross_entropy(logits.flatten(0, 1), yb.flatten(), reduction="sum").item()
    return total / y.numel()


def score_suite(out_dir: Path, val_text: str) -> float:
    from lib.checkpoints.finished_run import load_model

    model, tokenizer = load_model(str(out_dir), "cpu")
    x, y = held_out_windows(tokenizer.encode(val_text), SEQ_LENGTH)
    return mean_loss(model, x, y)


def nanogpt_module(nanogpt: Path):
    """The model.py of the nanoGPT checkout `nanogpt`, imported from there."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", nanogpt / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def score_nanogpt(nanogpt: Path, out_dir: Path, val_text: str, chars: list[str]) -> float | None:
    import torch

    if not (out_dir / "ckpt.pt").exists():  # saved at evaluations after the first (every 250)
        return None
    module = nanogpt_module(nanogpt)
    ckpt = torch.load(out_dir / "ckpt.pt", map_location="cpu", weights_only=True)
    model = module.GPT(module.GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    model.eval()
    stoi = {ch: i for i, ch in enumerate(chars)}
    x, y = held_out_windows([stoi[c] for c in val_text], SEQ_LENGTH)
    # nanoGPT's forward with targets returns the logits of every position.
    return mean_loss(lambda xb: model(xb, xb)[0], x, y)


# -------------------------------------------------------------------------------------------------
# The step alone against transformers' LlamaForCausalLM (--transformers)


def llama_config(vocab_size: int):
    """The issue's shape as this suite's LlamaConfig."""
    from model import LlamaConfig

    shape = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4)  # SUITE_FLAGS
    heads = dict(num_attention_heads=4, num_key_value_heads=4)
    return LlamaConfig(vocab_size=vocab_size, max_position_embeddings=1024, **shape, **heads)


def hf_llama(config):
    """transformers' LlamaForCausalLM of the same shape, SDPA attention, fp32."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    # The fields both configs name alike, copied; then what ours has and theirs must be told.
    shared = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"]
    shared += ["num_attention_heads", "num_key_value_heads", "max_position_embeddings"]
    shared += ["rope_theta", "rms_norm_eps"]
    told = dict(tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    hf = HFConfig(**{n: getattr(config, n) for n in shared}, **told, attn_implementation="sdpa")
    return LlamaForCausalLM(hf).float()


def compare_steps(
    other, vocab_size, rounds, steps, nanogpt=None, compile_ours=False, compile_theirs=False
) -> dict:
    """ms per training step of this suite's model and of `other`'s at the same shape and batch
    (12 x 64 random tokens), timed in rounds that alternate which goes first: {(name, clock):
    [ms per step of each round]}. "transformers": LlamaForCausalLM, the same config, AdamW as
    the lessons build it (training.build_optimizer), the loss computed as ours. "nanogpt": its
    model.py and its own AdamW setup (configure_optimizers: on a CPU, not fused), from the
    checkout `nanogpt`, at its README's CPU shape. Both clip gradients at 1, as the lessons.
    compile_ours: this suite's layers and loss compiled as --compile does; compile_theirs:
    torch.compile on the other model, as nanoGPT's --compile=True does (the warm-up pays both)."""
    import torch
    import torch.nn.functional as F

    from lib import training
    from lib.extras import speed
    from model import LlamaForPretraining

    args = argparse.Namespace(lr=1e-3, weight_decay=0.1)
    torch.manual_seed(0)
    tokens = torch.randint(vocab_size, (12, 65))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    ours = LlamaForPretraining(llama_config(vocab_size))
    if compile_ours:
        speed.compile_layers(ours)

    def stepper(model, loss_of, optimizer):
        def step():
            loss_of(model).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    optimizer = training.build_optimizer(ours, args, "cpu")
    contenders = {"this suite": stepper(ours, lambda m: m(x, y)[0] / y.numel(), optimizer)}
    if other == "transformers":
        theirs = hf_llama(ours.config)
        optimizer = training.build_optimizer(theirs, args, "cpu")
    else:
        theirs, optimizer = nanogpt_model(nanogpt, vocab_size)

    def their_loss(model):  # for transformers: the same 64 targets, the loss computed as ours
        if other == "transformers":
            return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        return model(x, y)[1]

    model = torch.compile(theirs) if compile_theirs else theirs
    contenders[other] = stepper(model, their_loss, optimizer)
    for step in contenders.values():
        for _ in range(5):  # warm-up: the allocator, the first calls
            step()
    # Wall time, and the CPU time of the process: on a busy machine, where this process waits
    # for a core, the wall time counts the wait and the CPU time does not (with one thread, it
    # is the work done; with more, it also counts the threads' spinning at each join).
    times = {(name, clock): [] for name in contenders for clock in ("wall", "cpu")}
    for r in range(rounds):
        for name, step in list(contenders.items())[:: 1 if r % 2 == 0 else -1]:
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step()
            times[name, "wall"].append(1000 * (time.perf_counter() - wall) / steps)
            times[name, "cpu"].append(1000 * (time.process_time() - cpu) / steps)
    return times


def nanogpt_model(nanogpt: Path, vocab_size: int):
    """nanoGPT's GPT (its model.py, imported from the checkout) at its README's CPU shape (4
    layers, 4 heads, width 128, block 64, no dropout, no bias: its train.py's default), and the
    AdamW its train.py makes for it (train_shakespeare_char's beta2 0.99)."""
    import contextlib
    import io

    module = nanogpt_module(nanogpt)
    shape = dict(n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False)  # NANOGPT_FLAGS'
    config = module.GPTConfig(block_size=SEQ_LENGTH, vocab_size=vocab_size, **shape)
    with contextlib.redirect_stdout(io.StringIO()):  # its parameter count and optimizer notes
        model = module.GPT(config)
        return model, model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")


def report_steps(times: dict, other: str, rounds: int, steps: int) -> None:
    import torch

    timed = f"{rounds} alternating rounds of {steps} steps"
    setting = f"torch {torch.__version__}, {torch.get_num_threads()} threads; {timed}"
    print(f"training step, 12 x 64 tokens, {setting}; command: {shlex.join(['python', *sys.argv])}")
    target = ">= 1.2" if other == "transformers" else ">= 1.0"  # issue 27's
    for clock in ("wall", "cpu"):
        ours, theirs = times["this suite", clock], times[other, clock]
        for name, t in (("this suite", ours), (other, theirs)):
            median = f"median {statistics.median(t):7.2f} ms per step"
            print(f"  {clock:<4} {name:<13} {median} (rounds: {min(t):.2f}-{max(t):.2f})")
        ratios = [b / a for a, b in zip(ours, theirs, strict=True)]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        whose = f"{other}'" if other.endswith("s") else f"{other}'s"  # transformers', nanogpt's
        median = f"median {statistics.median(ratios):.2f}, {spread} (target {target})"
        print(f"  {clock:<4} this suite's speed / {whose}, per round: {median}")


# What a run of nanoGPT's train.py needs of its checkout besides train.py and model.py, and why.
NANOGPT_RUN_FILES = {
    "configurator.py": "its train.py reads it",
    "config/train_shakespeare_char.py": "the CPU recipe the runs follow",
}


def busy_neighbours(n: int) -> list[subprocess.Popen]:
    """n processes that keep one core each busy until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.error = lambda message: p.exit(2, f"error: {message} (see --help)\n")  # one line, no usage
    p.add_argument("--nanogpt", default=None, help="a checkout of karpathy/nanoGPT: run both")
    transformers = "time the step alone against transformers' LlamaForCausalLM"
    p.add_argument("--transformers", action="store_true", help=transformers)
    p.add_argument("--work-dir", default="bench_nanogpt_work", help="corpus, data, runs")
    p.add_argument("--rounds", type=int, default=2, help="rounds of both runs, alternating")
    p.add_argument("--max-steps", type=int, default=2000, help="steps of both runs")
    p.add_argument("--corpus-chars", type=int, default=2_000_000, help="size of the corpus")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the runs")
    p.add_argument("--busy", type=int, default=0, help="busy neighbour processes meanwhile")
    p.add_argument("--only", choices=["suite", "nanogpt"], default=None, help="run one side")
    step = (
        "with --nanogpt: time the training step alone of both models, in one process "
        "(alternating rounds), instead of the whole runs"
    )
    p.add_argument("--step", action="store_true", help=step)
    compiled = (
        "this suite with --compile (its layers and loss compiled; Inductor needs a C++ compiler "
        "on a CPU); nanoGPT stays as its recipe"
    )
    p.add_argument("--compile", action="store_true", help=compiled)
    both = (
        "nanoGPT (or, with --transformers, LlamaForCausalLM) compiled too: its own "
        "--compile=True, for a like-for-like comparison"
    )
    p.add_argument("--compile-nanogpt", action="store_true", help=both)
    more = "more flags for this suite's runs (after its own: they win), e.g. the laptop recipe"
    p.add_argument("--suite-flags", default="", help=f"{more}: {shlex.join(LAPTOP)}")
    p.add_argument("--step-rounds", type=int, default=9, help="--step, --transformers: rounds")
    p.add_argument("--step-steps", type=int, default=10, help="--step, --transformers: steps each")
    args = p.parse_args()
    if args.step and args.nanogpt is None:
        p.error("--step times nanoGPT's step: pass --nanogpt DIR too")
    if args.nanogpt is None and not args.transformers:
        p.error("nothing to do: pass --nanogpt DIR, --transformers, or both")
    counts = (args.rounds, args.max_steps, args.corpus_chars, args.step_rounds, args.step_steps)
    if min(counts) < 1 or args.busy < 0 or (args.threads is not None and args.threads < 1):
        p.error("--rounds, --max-steps, --corpus-chars, --step-* and --threads must be positive")
    if args.nanogpt is not None:
        nanogpt = Path(args.nanogpt).expanduser().resolve()
        if not (nanogpt / "train.py").is_file() or not (nanogpt / "model.py").is_file():
            p.error(f"--nanogpt {nanogpt}: no train.py and model.py there (a nanoGPT checkout)")
        runs_nanogpt = not args.step and args.only != "suite"
        for name, why in NANOGPT_RUN_FILES.items() if runs_nanogpt else ():
            if not (nanogpt / name).is_file():
                missing = f"--nanogpt {nanogpt}: no {name} there ({why})"
                raise ValueError(f"{missing}: not a nanoGPT checkout")
        if not args.step:
            run_both(args, nanogpt)
    others = (["nanogpt"] if args.step else []) + (["transformers"] if args.transformers else [])
    if others and args.threads:
        import torch

        torch.set_num_threads(args.threads)
    for other in others:
        neighbours = busy_neighbours(args.busy)
        try:
            vocab = CHAR_VOCAB - 3 if other == "nanogpt" else CHAR_VOCAB  # its 96 characters
            checkout = nanogpt if other == "nanogpt" else None
            steps = (
                args.step_rounds,
                args.step_steps,
                checkout,
                args.compile,
                args.compile_nanogpt,
            )
            times = compare_steps(other, vocab, *steps)
        finally:
            for proc in neighbours:
                proc.kill()
        report_steps(times, other, args.step_rounds, args.step_steps)


def run_both(args, nanogpt: Path) -> None:
    """Steps 1-5 of the module docstring, and the report."""
    prep = prepare(args)
    work = prep["work"]
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    sides = ["suite", "nanogpt"] if args.only is None else [args.only]
    neighbours = busy_neighbours(args.busy)
    rows = []
    try:
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                out = work / f"{side}_out"
                shutil.rmtree(out, ignore_errors=True)
                log = work / f"{side}_{r}.log"
                if side == "suite":
                    cmd = suite_command(prep, out, args.max_steps, args.compile, args.suite_flags)
                    cwd, name = REPO, "train_dp.py"
                else:  # train.py reads ./configurator.py and ./data/<dataset>/: from work
                    shutil.copy(nanogpt / "configurator.py", work / "configurator.py")
                    cmd = nanogpt_command(nanogpt, out, args.max_steps, args.compile_nanogpt)
                    cwd, name = work, f"nanoGPT's train.py (from --nanogpt {nanogpt})"
                print(f"round {r + 1}: {side} ...", file=sys.stderr, flush=True)
                wall = timed_run(cmd, cwd, env, log, name)
                if side == "suite":
                    row = suite_figures(out) | {"held_out": score_suite(out, prep["val_text"])}
                else:
                    output = log.read_text(errors="replace")
                    if not any(ITER_RE.match(line) for line in output.splitlines()):
                        silent = "its train.py printed no 'iter N: loss L, time T ms' line"
                        wrong = f"(its output: {log}): not nanoGPT's train.py"
                        raise ValueError(f"--nanogpt {nanogpt}: {silent} {wrong}")
                    held_out = score_nanogpt(nanogpt, out, prep["val_text"], prep["chars"])
                    row = nanogpt_figures(output) | {"held_out": held_out}
                rows.append({"round": r + 1, "side": side, "wall_s": wall, **row})
    except Exception:
        if rows:  # the runs that finished are measured: their table, before the error's line
            report(args, prep, rows)
        raise
    finally:
        for proc in neighbours:
            proc.kill()
    report(args, prep, rows)


# The environment variables that steer a CPU run's speed: OpenMP's threads and waiting (GNU's,
# Intel's), MKL's and ATen's kernels, glibc's allocator. A printed command keeps each one set.
RUNTIME_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "ATEN_CPU_", "MALLOC_")


def runtime_settings(environ) -> list[str]:
    """NAME=value for each variable of environ that RUNTIME_PREFIXES names, sorted."""
    return [f"{k}={v}" for k, v in sorted(environ.items()) if k.startswith(RUNTIME_PREFIXES)]


def report(args, prep: dict, rows: list[dict]) -> None:
    import torch

    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
            cpu = next(names, cpu)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"tools/bench_nanogpt.py, {date}")
    print(f"command: {shlex.join([*runtime_settings(os.environ), 'python', *sys.argv])}")
    threads = args.threads or os.environ.get("OMP_NUM_THREADS", "unset")
    machine = f"{cpu}, {os.cpu_count()} cores; OMP_NUM_THREADS {threads}"
    print(f"torch {torch.__version__}; {machine}; busy neighbours {args.busy}")
    texts = f"{prep['train_chars']:,} train / {len(prep['val_text']):,} held-out"
    steps = (
        f"{args.max_steps} steps of 12 x 64 (this suite: then --suite-flags {args.suite_flags!r})"
    )
    print(f"corpus: {len(prep['chars'])} characters, {texts}; {steps}\n")
    print("| round | run     | wall s | step ms (median) | own val loss | held-out nats/char |")
    print("| ----: | :------ | -----: | ---------------: | -----------: | -----------------: |")
    for r in rows:
        own, held = (("-" if v is None else f"{v:.4f}") for v in (r["val_loss"], r["held_out"]))
        step_ms = "-" if r["step_ms"] is None else f"{r['step_ms']:.2f}"  # only evaluation steps
        cells = f"{r['round']:5} | {r['side']:<7} | {r['wall_s']:6.1f} | {step_ms:>16}"
        print(f"| {cells} | {own:>12} | {held:>18} |")
    by = {side: [r for r in rows if r["side"] == side] for side in ("suite", "nanogpt")}
    pairs = list(zip(by["suite"], by["nanogpt"], strict=False))
    if pairs:
        print("\nthis suite's time to nanoGPT's held-out loss (target <= 0.35x its wall time):")
        for s, n in pairs:  # reached where the suite's final model is at least as good
            shown = lambda v: "-" if v is None else f"{v:.4f}"
            ours, theirs = shown(s["held_out"]), shown(n["held_out"])
            reached = "-" not in (ours, theirs) and s["held_out"] <= n["held_out"]
            times = f"{s['wall_s']:.1f} s against {n['wall_s']:.1f} s"
            losses = f"held-out {ours} against {theirs} nats/char"
            ratio = f"{s['wall_s'] / n['wall_s']:.2f}x ({times}; {losses})"
            print(f"  round {s['round']}: {'' if reached else 'not reached in '}{ratio}")
        step = [n["step_ms"] / s["step_ms"] if n["step_ms"] else None for s, n in pairs]
        ratios = ", ".join("-" if v is None else f"{v:.2f}" for v in step)
        speed = "suite step speed / nanoGPT's (their step ms over ours)"
        print(f"{speed}, per round: {ratios} (target >= 1.00)")


if __name__ == "__main__":
    from lib import exits

    exits.run(main)  # a folder that is not nanoGPT: one line, exit 2; a failed run: exit 1
