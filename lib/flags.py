"""The command line every train_*.py shares, its checks, and the settings derived from it.

    parser = flags.build_parser("Pretrain a Llama ...")  # the shared flags; a lesson adds its own
    args = parser.parse_args()                           # never changed afterwards
    settings = flags.run_settings(parser, args, devices, device)  # checked; micro-batch, ...

Tools and tests drive the scripts by these flags' names: keep them stable. Every check runs
before any data is read. Any flag can also come from `--config FILE` (lib/extras/config_file.py)."""

import argparse
import math
import os
import sys
from dataclasses import dataclass

import torch

from data import SPECIAL_TOKENS
from lib import model_config, training
from lib.distributed import backend_for, rank_from_env, world_size_from_env
from model import LlamaConfig, count_active_parameters, count_parameters

MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # a byte-level BPE: every byte, and [PAD], [BOT], [EOT]
MAX_VOCAB_SIZE = 2**20  # past any real one (Llama 3: 128,256); the trainer allocates it up front
MAX_SEED = 2**63 - 1  # torch seeds are 64-bit, and epoch e's (--seed + e) must fit too
MAX_SKIPPED_IN_A_ROW = 10  # --skip-nonfinite: this many in a row stop the run (NonFiniteGuard)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, but not "None" (its help says what leaving it out does)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag raises ValueError: exits.run prints it once (on global rank 0, not
    per torchrun process) and exits with 2, as argparse would. No prefixes: --mode isn't --model."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def error(self, message: str):
        raise ValueError(f"{message} (see --help)")

    def parse_known_args(self, args=None, namespace=None):
        """As argparse parses, but with the values of --config FILE (lib/extras/config_file.py) as
        the defaults of this parse (the parser itself unchanged): the command line wins over the
        file, and the file over the defaults."""
        argv = sys.argv[1:] if args is None else list(args)
        if namespace is None and any(a.split("=")[0] == "--config" for a in argv):
            from lib.extras import config_file  # only for --config

            namespace = config_file.config_namespace(self, argv)
        return super().parse_known_args(argv, namespace)


def build_parser(
    description: str, distributed: bool = False, sharded: bool = False
) -> argparse.ArgumentParser:
    """The flags every train script takes, in groups; distributed: also --backend (the torchrun
    scripts); sharded: also --async-save (the torchrun scripts that save sharded checkpoints)."""
    p = ArgumentParser(description=description, formatter_class=HelpFormatter)
    config_help = "a TOML file of flag values (seq-length = 512); the command line wins over it"
    p.add_argument("--config", metavar="FILE", default=None, help=config_help)
    if distributed or sharded:
        backend_help = "process group backend (default: nccl on GPU, gloo on CPU)"
        p.add_argument("--backend", choices=["nccl", "gloo"], default=None, help=backend_help)
        timeout_help = (
            "how long a collective waits for the other ranks before the run stops: long enough "
            "for a step's collectives (a rank's long work alone, such as tokenizing or writing "
            "model.pt, is waited for on a group of its own, not in a collective)"
        )
        p.add_argument("--dist-timeout", type=number_arg(float, 0, low_open=True), default=30.0,
                       metavar="MINUTES", help=timeout_help)  # fmt: skip
    add_data_flags(p.add_argument_group("data"))
    add_model_flags(p.add_argument_group("model and batch"))
    add_optimization_flags(p.add_argument_group("optimization"))
    add_output_flags(p.add_argument_group("logging and checkpoints"), sharded)
    add_memory_flags(p.add_argument_group("memory"))
    check_help = (
        "check the flags (for WORLD_SIZE processes) and exit: run_ddp.sh does, before torchrun"
    )
    p.add_argument("--check", action="store_true", help=check_help)
    return p


# The flags of each group, one call each, laid out as a table (the formatter would give every
# argument a line of its own).
# fmt: off
def add_data_flags(g) -> None:
    g.add_argument("--data", default="stdlib", help="corpus: 'stdlib' (this Python's standard "
                   "library), a file, glob or directory of .txt/.jsonl/.json/.parquet, or a hub "
                   "dataset")
    g.add_argument("--text-column", default="text", help="column holding the text (json/parquet)")
    g.add_argument("--txt-split", choices=["auto", "paragraph", "line", "file"], default="auto",
                   help=".txt only: a document per paragraph, line or file (auto: paragraph for "
                   "one file, else file)")
    g.add_argument("--tokenizer", default=None, help="an existing tokenizer.json (this suite's "
                   "or any Hugging Face one); default: train a byte-level BPE and cache it")
    add_special_token_flags(g)
    g.add_argument("--vocab-size", type=number_arg(int, MIN_VOCAB_SIZE, MAX_VOCAB_SIZE),
                   default=None, help="vocabulary of a trained tokenizer, 259 to 2^20 (default: "
                   "the preset's)")
    g.add_argument("--data-mode", choices=["pack", "pad"], default="pack", help="pack: "
                   "documents concatenated into full windows; pad: one document per row")
    g.add_argument("--document-mask", action="store_true", help="pack mode: tokens attend only "
                   "within their own document (slower on CPU)")
    g.add_argument("--attention", choices=["auto", "sdpa", "flex"], default="auto",
                   help="kernel of --document-mask: sdpa (a dense mask) or flex (FlexAttention, "
                   "CUDA only). auto: flex with one CUDA GPU per process, else sdpa")
    g.add_argument("--val-fraction", type=number_arg(float, 0, 1, low_open=True, high_open=True),
                   default=0.01, help="fraction of documents held out for validation")
    g.add_argument("--cache-dir", default=".cache", help="tokenizer and tokenized-data cache")
    g.add_argument("--num-workers", type=number_arg(int, 0), default=None, help="DataLoader "
                   "worker processes (default: 0 on a CPU, 1 on a GPU); with --streaming, steps "
                   "read ahead in one thread")
    g.add_argument("--num-proc", type=number_arg(int, 1), default=None, help="processes that "
                   "tokenize the corpus (default: one; under torchrun, for 100,000 documents or "
                   "more, one per process of the node); the tokens are the same for any value")
    g.add_argument("--streaming", action="store_true", help="read the corpus as a stream, each "
                   "data-parallel rank its own shard (docs/data.md)")


def add_model_flags(g) -> None:
    g.add_argument("--model", default=None, help="preset: tiny, small, medium, 1b, 7b, 13b, 70b "
                   "(default: tiny; with --init-from, its architecture)")
    model_config.add_shape_flags(g, number_arg)
    g.add_argument("--init-from", default=None, metavar="DIR", help="start from a finished run's "
                   "out-dir (model.pt, config.json, tokenizer.json): its weights, architecture "
                   "and tokenizer")
    g.add_argument("--seq-length", type=number_arg(int, 1), default=256,
                   help="tokens per training sequence")
    g.add_argument("--batch-size", type=number_arg(int, 1), default=16,
                   help="global batch: sequences per optimizer step, over all devices")
    g.add_argument("--micro-batch-size", type=micro_batch_size_arg, default=None,
                   help="sequences per device per forward; accumulation makes up the rest "
                   "(default: none). auto (CUDA): the largest that fits, measured")


def add_optimization_flags(g) -> None:
    g.add_argument("--max-steps", type=number_arg(int, 1), default=200,
                   help="optimizer steps to train for")
    g.add_argument("--lr", type=number_arg(float, 0, low_open=True), default=3e-3, help="peak "
                   "learning rate of AdamW (--optimizer muon: of the embedding, lm_head, norms)")
    g.add_argument("--min-lr-ratio", type=number_arg(float, 0, 1), default=0.1, help="the cosine "
                   "schedule decays to lr * this (0 to 1: the lr never rises after warmup)")
    g.add_argument("--warmup-steps", type=number_arg(int, 0), default=20,
                   help="linear warmup from lr/warmup to --lr")
    g.add_argument("--grad-clip", type=number_arg(float, 0), default=1.0,
                   help="max gradient norm (0: off)")
    g.add_argument("--skip-nonfinite", action="store_true", help="skip the update of a step whose "
                   f"loss or gradient is NaN/inf instead of stopping (but not "
                   f"{MAX_SKIPPED_IN_A_ROW} in a row)")
    g.add_argument("--weight-decay", type=number_arg(float, 0), default=0.1,
                   help="AdamW decay of matrices")
    g.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw", help="muon: Muon "
                   "for the decoder layers' matrices, AdamW for the rest (lib/extras/muon.py)")
    g.add_argument("--muon-lr", type=number_arg(float, 0, low_open=True), default=0.02,
                   help="Muon's peak learning rate (--optimizer muon; the schedule as --lr's)")
    g.add_argument("--seed", type=number_arg(int, 0, MAX_SEED), default=1337,
                   help="seed of weights and data order (epoch e's: seed + e)")
    g.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="auto: bf16 autocast on GPUs that support it, else fp32")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="torch.compile each decoder layer")


def add_output_flags(g, sharded: bool) -> None:
    g.add_argument("--log-interval", type=number_arg(int, 1), default=10,
                   help="steps between logged losses")
    g.add_argument("--eval-interval", type=number_arg(int, 1), default=50,
                   help="steps between evaluations")
    g.add_argument("--eval-batches", type=number_arg(int, 1), default=10,
                   help="evaluate on the first N global batches of the validation split")
    g.add_argument("--eval-tasks", default=None, metavar="NAME_OR_FILE[:N],...",
                   help="also score zero-shot tasks at each evaluation, as tools/evaluate.py "
                   "does: hellaswag, arc_easy, arc_challenge, piqa, winogrande, lambada_openai, "
                   "or a .jsonl/.json/.parquet file (fields context, choices, label); N: the "
                   "first N examples only (docs/evaluation.md)")
    g.add_argument("--save-interval", type=number_arg(int, 1), default=100,
                   help="steps between checkpoints")
    g.add_argument("--keep-checkpoints", type=number_arg(int, 2), default=3, help="checkpoints "
                   "to keep, at least 2: a resume falls back from a damaged newest one")
    g.add_argument("--out-dir", default="out", help="metrics, checkpoints and the final model")
    if sharded:
        g.add_argument("--async-save", action="store_true", help="write each checkpoint in the "
                       "background, from a copy in CPU memory, while training goes on (the "
                       "run's last one at once)")
    g.add_argument("--resume", default="auto", help="auto: from --out-dir's latest checkpoint "
                   "if any; never: start fresh; or a checkpoint file's path")
    g.add_argument("--sample-tokens", type=number_arg(int, 0), default=64,
                   help="tokens to generate from the trained model at the end (0: none)")
    g.add_argument("--sample-prompt", default="def ", help="prompt of the final sample")
    g.add_argument("--tensorboard", action="store_true", help="also log to TensorBoard, in "
                   "OUT_DIR/tensorboard (pip install -r requirements-tensorboard.txt)")


def add_memory_flags(g) -> None:
    g.add_argument("--activation-checkpointing", action="store_true", help="recompute each "
                   "decoder layer in backward: less activation memory for ~1/3 more compute")
    g.add_argument("--plan", action="store_true",
                   help="print the per-GPU memory estimate of this run (python -m "
                   "tools.memory_plan's) at start-up")
    g.add_argument("--comm-ledger", action="store_true", help="record every collective of one "
                   "training step (the run's third), print them and write "
                   "OUT_DIR/comm_ledger.json (lib/extras/comm_ledger.py)")
# fmt: on


def add_special_token_flags(group) -> None:
    """--bot-token, --eot-token, --pad-token: flags of the train scripts and of export_hf.py."""
    for role, what, examples in (
        ("bot", "begins each document", "<|begin_of_text|>, <s>, <|endoftext|>"),
        ("eot", "ends each document", "<|end_of_text|>, </s>, <|endoftext|>"),
        ("pad", "pads rows in --data-mode pad", "<pad>; else the end token"),
    ):
        usual = f"(default: its tokenizer_config.json's, else the usual: {examples})"
        help = f"a given tokenizer's token that {what} {usual}"
        group.add_argument(f"--{role}-token", default=None, metavar="TOKEN", help=help)


def micro_batch_size_arg(value: str) -> int | str:
    """--micro-batch-size: a positive integer, or 'auto'."""
    if value != "auto" and not (value.strip().isdecimal() and int(value) >= 1):
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}")
    return value if value == "auto" else int(value)


def number_arg(kind=float, low=None, high=None, low_open: bool = False, high_open: bool = False):
    """Every numeric flag's `type=`: a finite `kind` (int or float) in [low, high] (low, high
    excluded with low_open, high_open; None: no bound), else argparse.ArgumentTypeError, which
    argparse reports naming the flag: `argument --top-p: expected a number in (0, 1], got 'nan'`.

        p.add_argument("--top-p", type=flags.number_arg(float, 0, 1, low_open=True))
    """

    def show(bound) -> str:
        return f"{bound:g}" if isinstance(bound, float) else str(bound)

    what = "an integer" if kind is int else "a number"
    if low is not None and high is not None:
        brackets = ("(" if low_open else "[") + (")" if high_open else "]")
        what += f" in {brackets[0]}{show(low)}, {show(high)}{brackets[1]}"
    elif low is not None:
        what += f" {'>' if low_open else '>='} {show(low)}"
    elif high is not None:
        what += f" {'<' if high_open else '<='} {show(high)}"

    def parse(value: str):
        try:
            number = kind(value)
        except (TypeError, ValueError):
            number = None
        if (
            number is None
            or (isinstance(number, float) and not math.isfinite(number))
            or (low is not None and (number <= low if low_open else number < low))
            or (high is not None and (number >= high if high_open else number > high))
        ):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
        return number

    parse.__name__ = kind.__name__  # argparse's name for the type in its own messages
    return parse


# -------------------------------------------------------------------------------------------------
# The run's settings, checked


@dataclass(frozen=True)
class RunSettings:
    """What the flags imply for this run, derived once and passed on explicitly (`args` is never
    changed: a checkpoint records it)."""

    model: str | None  # the preset to build; None with --init-from (its config.json)
    tokenizer: str | None  # the tokenizer.json (--tokenizer, or from --init-from); None: train
    devices: int  # how many devices share one global batch (GPUs, or data-parallel ranks)
    micro_batch_size: int | None  # sequences per device per forward; None: auto, not measured
    accumulation: int  # micro-batches per device per optimizer step
    precision: str  # "fp32", "bf16" or "fp16": --precision auto resolved for the device
    attention: str  # the kernel of --document-mask: "sdpa" or "flex"
    grad_clip: float  # --grad-clip

    @property
    def max_grad_norm(self) -> float:
        """clip_grad_norm_'s bound: --grad-clip, or no clipping (inf) for 0."""
        return self.grad_clip if self.grad_clip > 0 else math.inf


def run_settings(
    parser,
    args,
    devices: int,
    device: torch.device,
    replicas: int = 1,
    default_micro_batch_size: int | None = None,
    context_parallel: bool = False,
) -> RunSettings:
    """Check the flags against each other, the processes and the device (ValueError through
    parser.error); return the settings. devices: how many share one global batch (GPUs under
    DataParallel, ranks under DDP, data-parallel groups under TP and PP); replicas and
    context_parallel: as masks.resolve_attention takes them; default_micro_batch_size: the
    micro-batch without --micro-batch-size (None: --batch-size / devices). With
    --micro-batch-size auto, the micro-batch is None until auto_batch.auto_micro_batch_size has
    measured it on the GPU."""
    # Each number's own range was checked as it was parsed (number_arg).
    check_processes(parser, args, device)
    check_optional_flags(parser, args, device)
    if args.warmup_steps > args.max_steps and int(os.environ.get("RANK", "0")) == 0:
        # Not refused: `--max-steps 10` for a quick try should not need --warmup-steps as well.
        longer = f"--warmup-steps {args.warmup_steps} is more than --max-steps {args.max_steps}"
        never = f"the learning rate rises for the whole run and never reaches --lr {args.lr}"
        print(f"warning: {longer}: {never}", file=sys.stderr)
    auto = args.micro_batch_size == "auto"
    micro = default_micro_batch_size if args.micro_batch_size is None else args.micro_batch_size
    if auto or micro is None:
        micro = args.batch_size // devices  # each device's share (auto: the largest candidate)
    per_step = micro * devices
    if micro == 0 or args.batch_size % per_step:
        product = f"--micro-batch-size ({micro}) x devices ({devices}) = {per_step}"
        exactly = "so that every optimizer step sees exactly the global batch"
        parser.error(f"--batch-size {args.batch_size} must be a multiple of {product}, {exactly}")
    # Model, tokenizer and sequence length: checked now, not after minutes of data preparation.
    try:
        model, tokenizer, config = model_config.model_source(args)
    except ValueError as e:
        parser.error(str(e))
    if args.seq_length > config.max_position_embeddings:
        longest = f"max_position_embeddings ({config.max_position_embeddings})"
        name = model or args.init_from
        parser.error(f"--seq-length {args.seq_length} exceeds the {name} model's {longest}")
    attention = "sdpa"  # without --document-mask, plain causal attention: SDPA's flash kernel
    if args.document_mask or args.attention != "auto":
        import masks

        attention = masks.resolve_attention(args, device, replicas, context_parallel)
    return RunSettings(
        model=model,
        tokenizer=tokenizer,
        devices=devices,
        micro_batch_size=None if auto else micro,
        accumulation=args.batch_size // per_step,
        precision=training.resolve_precision(args.precision, device),
        attention=attention,
        grad_clip=args.grad_clip,
    )


def check_processes(parser, args, device: torch.device) -> None:
    """parser.error unless the processes fit the script and the flags: RANK and WORLD_SIZE,
    and --backend for the device (the grid of ranks is the strategy module's setup's to check)."""
    rank_from_env("RANK", world_size := world_size_from_env())  # ValueError unless valid
    if world_size > 1 and not hasattr(args, "backend"):  # (only the torchrun scripts have it)
        one = f"{parser.prog} is one process, not a torchrun worker (WORLD_SIZE={world_size})"
        parser.error(f"{one}: start it with python, or use train_ddp.py")
    try:
        backend_for(getattr(args, "backend", None), device)
    except ValueError as e:
        parser.error(str(e))


def check_optional_flags(parser, args, device: torch.device) -> None:
    """parser.error for an optional feature that cannot run here, checked by the module of that
    feature, which is imported only when its flag is given."""
    if args.streaming:
        from lib.extras import streaming

        streaming.check_flags(parser, args)
    if args.tensorboard:
        from lib.extras import tensorboard

        tensorboard.check_installed(parser)
    if args.compile:
        from lib.extras import speed

        if missing := speed.compiler_missing(device):
            parser.error(missing)
    if getattr(args, "eval_tasks", None) is not None:
        from lib.extras import training_tasks

        training_tasks.check_flag(parser, args)
    if getattr(args, "comm_ledger", False):
        from lib.extras import comm_ledger

        if problem := comm_ledger.refusal(args):
            parser.error(problem)
    if args.micro_batch_size == "auto":
        from lib.extras import auto_batch

        auto_batch.check_device(parser)
    check_companions(parser, args)


# A flag that only matters with another, given without it, is refused rather than ignored:
# (its name, whether the run uses it, the flag it needs). Others of the class are refused where
# their feature is checked (--attention flex in masks.py, --val-fraction in streaming.py).
COMPANIONS = (
    ("muon_lr", lambda args: args.optimizer == "muon", "--optimizer muon"),
    ("sample_prompt", lambda args: args.sample_tokens > 0, "--sample-tokens above 0"),
)


def check_companions(parser, args) -> None:
    """parser.error for a flag set away from its default that this run would ignore."""
    for name, used, needs in COMPANIONS:
        if name not in vars(args):  # (a tool's flags: not every one)
            continue
        if getattr(args, name) != parser.get_default(name) and not used(args):
            flag = f"--{name.replace('_', '-')}"
            parser.error(f"{flag} applies only with {needs}, which this run does not have: "
                         f"add that, or leave out {flag}")  # fmt: skip


def describe_run(args, run: RunSettings, config: LlamaConfig, device: torch.device) -> str:
    """The start-up summary: model, device, batch and schedule, with the figures derived."""
    tokens_per_step = args.batch_size * args.seq_length
    model = f"model: {model_config.model_name(args, run.model)}, "
    model += f"{count_parameters(config) / 1e6:.2f}M parameters"
    if config.num_local_experts:  # a mixture of experts: a token uses k experts' weights
        model += f" ({count_active_parameters(config) / 1e6:.2f}M active per token)"
    model += f", vocab {config.vocab_size}"
    if config.num_local_experts:
        model += f", experts {config.num_local_experts}, {config.num_experts_per_tok} per token"
    hardware = f"device: {device} x {run.devices}, precision {run.precision}"
    hardware += f", compile {args.compile}"
    if args.document_mask:
        hardware += f", document mask by {run.attention}"
    batch = f"batch: {args.batch_size} sequences x {args.seq_length} tokens"
    split = f"micro-batch {run.micro_batch_size} x {run.devices} devices x {run.accumulation}"
    batch += f" = {tokens_per_step:,} tokens per step = {split} accumulation steps"
    tokens = f"{args.max_steps * tokens_per_step / 1e6:.1f}M tokens"
    lr = f"lr {args.lr} (warmup {args.warmup_steps}, cosine to {args.lr * args.min_lr_ratio:g})"
    if args.optimizer == "muon":  # two learning rates, one schedule
        lr = f"AdamW {lr}; Muon lr {args.muon_lr} (the same schedule)"
    return "\n".join([model, hardware, batch, f"schedule: {args.max_steps} steps = {tokens}, {lr}"])


def check_only(parser, args) -> bool:
    """--check: say that every flag passed (run_settings raised otherwise), and True: the
    lesson stops before any work (run_ddp.sh checks a command this way before torchrun)."""
    if args.check:
        print(f"{parser.prog}: the flags are fine (--check: nothing was run)")
    return args.check


def measured(settings, args, model, attn_mask, optimizer, config, device):
    """The settings with --micro-batch-size auto measured on the GPU with the model as wrapped
    (lib/extras/auto_batch.py, imported only then); the settings as they are otherwise."""
    if args.micro_batch_size != "auto":
        return settings
    from lib.extras.auto_batch import auto_micro_batch_size

    # A forward of one process takes micro-batch x replicas rows: DataParallel's GPUs, or 1.
    replicas = 1 if torch.distributed.is_initialized() else settings.devices
    vocab_size = config.vocab_size
    return auto_micro_batch_size(
        args, settings, model, attn_mask, optimizer, vocab_size, device, replicas
    )
