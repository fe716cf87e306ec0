"""The model a run trains, as flags say it: the --model preset with the shape flags over it, or
--init-from's config.json (model_shape); and the special tokens the flags name.

    model_flags.add_shape_flags(group, cli.number_arg)  # --num-layers, --hidden-size, ...
    config = model_flags.preset_config(args, "tiny")  # LlamaConfig, checked: errors name flags

One place turns flags into a shape, for the train scripts (cli.run_settings's checks before any data
is read, training.build_model), bench.py, memory_plan.py and profile_step.py alike.
"""

import os

from model import LlamaConfig

# The shape flags: each replaces one LlamaConfig field of the --model preset (preset_config).
SHAPE_FLAGS = {
    "num_layers": ("num_hidden_layers", "decoder layers"),
    "hidden_size": ("hidden_size", "model width"),
    "num_heads": ("num_attention_heads", "attention heads"),
    "num_kv_heads": ("num_key_value_heads", "key/value heads (fewer: grouped-query attention)"),
    "ffn_size": ("intermediate_size", "width of the SwiGLU MLP"),
}
# The mixture-of-experts flags (moe.MoEFeedForward): each replaces one LlamaConfig field too,
# with its own range (flag: field, what, number_arg's kind and lower bound, metavar).
EXPERT_FLAGS = {
    "num_experts": ("num_local_experts", "experts per MoE layer (0: the dense SwiGLU MLP)",
                    int, 0, "N"),
    "experts_per_token": ("num_experts_per_tok", "experts each token goes to, at most "
                          "--num-experts", int, 1, "K"),
    "router_aux_loss_coef": ("router_aux_loss_coef", "weight of the load-balancing loss in the "
                             "training loss", float, 0, "C"),
}  # fmt: skip
# Every flag that changes the preset's shape: refused with --init-from, named at start-up.
MODEL_FLAGS = [*SHAPE_FLAGS, *EXPERT_FLAGS]


def add_shape_flags(group, number_arg) -> None:
    """--num-layers ... --ffn-size, --num-experts ...: the train scripts', bench.py's and
    memory_plan.py's. Each shape flag is a positive integer, each expert flag a number in its
    own range, refused otherwise as it is parsed: number_arg is cli.number_arg (passed in, since
    cli imports this module)."""

    for name, (field, what) in SHAPE_FLAGS.items():
        group.add_argument(f"--{name.replace('_', '-')}", type=number_arg(int, 1), default=None,
                           metavar="N", help=f"{what}: LlamaConfig.{field} (default: the "
                           f"preset's)")  # fmt: skip
    for name, (field, what, kind, low, metavar) in EXPERT_FLAGS.items():  # presets: dense
        group.add_argument(f"--{name.replace('_', '-')}", type=number_arg(kind, low),
                           default=None, metavar=metavar, help=f"{what}: LlamaConfig.{field} "
                           f"(default: {getattr(LlamaConfig, field)})")  # fmt: skip


def preset_config(args, preset: str, vocab_size: int | None = None) -> LlamaConfig:
    """The preset with the shape and expert flags applied, and vocab_size (else --vocab-size,
    else the preset's): the one place flags become a shape, for the flag checks, the model
    built and memory_plan.py alike. ValueError naming the flags that do not fit."""
    try:
        base = LlamaConfig.from_preset(preset)
    except ValueError as e:
        raise ValueError(f"--model: {e}") from None
    vocab = getattr(args, "vocab_size", None) if vocab_size is None else vocab_size
    given = {n: getattr(args, n, None) for n in SHAPE_FLAGS} | {"vocab_size": vocab}
    given = {name: value for name, value in given.items() if value is not None}
    for name, value in given.items():
        if value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    experts = {n: getattr(args, n, None) for n in EXPERT_FLAGS}
    experts = {name: value for name, value in experts.items() if value is not None}
    config = {**base.to_dict(), **{SHAPE_FLAGS.get(n, (n,))[0]: v for n, v in given.items()}}
    config |= {EXPERT_FLAGS[name][0]: value for name, value in experts.items()}
    check_experts(experts, config)
    d, h, kv = (config[SHAPE_FLAGS[n][0]] for n in ("hidden_size", "num_heads", "num_kv_heads"))
    # LlamaConfig refuses these too, but by its field names: the messages here name the flags.
    said = lambda n: (
        f"--{n.replace('_', '-')} {config[SHAPE_FLAGS[n][0]]}"
        + ("" if n in given else f" (the {preset} preset's)")
    )
    if d % h or h % kv:
        a, b = ("hidden_size", "num_heads") if d % h else ("num_heads", "num_kv_heads")
        raise ValueError(f"{said(a)} is not divisible by {said(b)}")
    if d // h % 2:
        raise ValueError(
            f"{said('hidden_size')} / {said('num_heads')} = head_dim {d // h}: rotary embeddings "
            f"need an even head_dim"
        )
    return LlamaConfig(**config)


def check_experts(given: dict, config: dict) -> None:
    """ValueError naming the expert flags (`given`: those on the command line) that do not fit
    `config` (the preset's fields with every flag applied). Zero is a number of experts (the
    dense MLP), unlike the shape flags' zero; without experts, the other two flags mean nothing
    and are refused rather than ignored."""
    experts = config.get("num_local_experts", LlamaConfig.num_local_experts)
    k = config.get("num_experts_per_tok", LlamaConfig.num_experts_per_tok)
    if not experts:
        pointless = [f"--{n.replace('_', '-')}" for n in given if n != "num_experts"]
        if pointless:
            said = "--num-experts 0" if "num_experts" in given else "no --num-experts (dense)"
            raise ValueError(
                f"{' and '.join(pointless)} shape a mixture of experts, and with {said} there is "
                f"none: give --num-experts N (N >= 1) too, or leave them out"
            )
    elif k > experts:
        default = "" if "experts_per_token" in given else " (the default)"
        raise ValueError(
            f"--experts-per-token {k}{default} is more than --num-experts {experts}: each token "
            f"goes to that many different experts; give --experts-per-token {experts} or fewer"
        )


def model_name(args, preset: str | None) -> str:
    """The model's name at start-up: tiny, tiny with --num-layers 8, or from DIR (--init-from)."""
    if preset is None:
        return f"from {args.init_from}"
    given = [n for n in MODEL_FLAGS if getattr(args, n, None) is not None]
    flags = " ".join(f"--{n.replace('_', '-')} {getattr(args, n)}" for n in given)
    return f"{preset} with {flags}" if flags else preset


def model_shape(args) -> LlamaConfig:
    """The architecture this run will train, known before any data is read: --init-from's
    config.json, or the --model preset with the shape flags applied. Its vocab_size is the one a
    tokenizer trained by the run gets (vocab_size below); the model's is that tokenizer's, or
    --tokenizer's, which changes no check made with this. ValueError saying why if none."""
    if args.init_from is None:
        return preset_config(args, args.model or "tiny")
    from checkpoints import OUT_DIR_FILES, load_config  # only for --init-from

    missing = [n for n in OUT_DIR_FILES if not os.path.isfile(os.path.join(args.init_from, n))]
    if missing:
        raise ValueError(
            f"--init-from {args.init_from}: no {', '.join(missing)} there; point it at the "
            f"--out-dir of a finished run (or of `python export_hf.py --from-hf HF_DIR OUT_DIR`)"
        )
    return load_config(args.init_from)


# The lessons that cannot train a mixture of experts (--num-experts, or an --init-from of one),
# and why: refuse_experts says so at flag-check time.
NO_EXPERTS = {
    "train_tp.py": "its plan splits the dense MLP's Linear layers (w1, w2, w3), which a mixture "
    "of experts replaces by a router and stacked experts",
    "train_pp.py": "its stages do not compute the experts' load-balancing loss",
    "train_cp.py": "it splits every sequence over ranks, and a sequence's load-balancing loss "
    "needs the whole sequence",
}


def refuse_experts(parser, args, script: str) -> None:
    """parser.error (ValueError, exit code 2) if this run's model is a mixture of experts and
    `script`, one of NO_EXPERTS, cannot train one; called after
    cli.run_settings, before any work."""
    experts = model_shape(args).num_local_experts
    if experts:
        given = (f"--num-experts {experts}" if args.init_from is None
                 else f"--init-from {args.init_from}, with {experts} experts")  # fmt: skip
        parser.error(
            f"{script} cannot train a mixture of experts ({given}): {NO_EXPERTS[script]}. "
            f"Train it with train_dp.py, train_ddp.py, train_zero1.py or train_fsdp.py, or with "
            f"expert parallelism: train_ep.py --ep N"
        )


def vocab_size(args) -> int:
    """The vocabulary of a tokenizer this run trains: --vocab-size, or the preset's own."""
    return model_shape(args).vocab_size


def special_tokens(args) -> dict[str, str | None]:
    """The special tokens the flags name (None: found in the tokenizer, see data.load_tokenizer)."""
    return {"bot": args.bot_token, "eot": args.eot_token, "pad": args.pad_token}
