"""The model a run trains, as the flags say it: the --model preset with the shape flags over it,
or the config.json and tokenizer of --init-from; and the special tokens the flags name. The one
place flags become a shape (the train scripts, tools/bench.py, memory_plan.py, profile_step.py).

    model_config.add_shape_flags(group, flags.number_arg)     # --num-layers, --hidden-size, ...
    preset, tokenizer, config = model_config.model_source(args)  # checked: errors name the flags
"""

import dataclasses
import os

from data import load_tokenizer
from model import LlamaConfig

# The shape flags: each replaces one LlamaConfig field of the --model preset (preset_config).
SHAPE_FLAGS = {
    "num_layers": ("num_hidden_layers", "decoder layers"),
    "hidden_size": ("hidden_size", "model width"),
    "num_heads": ("num_attention_heads", "attention heads"),
    "num_kv_heads": ("num_key_value_heads", "key/value heads (fewer: grouped-query attention)"),
    "ffn_size": ("intermediate_size", "width of the SwiGLU MLP"),
}
# The mixture-of-experts flags (checked by check_expert_flags in lib/extras/moe.py): each replaces
# one LlamaConfig field too, with its own range (flag: field, what it is, the kind and lower bound
# for number_arg, metavar).
EXPERT_FLAGS = {
    "num_experts": ("num_local_experts", "experts per MoE layer (0: the dense SwiGLU MLP)",
                    int, 0, "N"),
    "experts_per_token": ("num_experts_per_tok", "experts each token goes to, at most "
                          "--num-experts", int, 1, "K"),
    "router_aux_loss_coef": ("router_aux_loss_coef", "weight of the load-balancing loss in the "
                             "training loss", float, 0, "C"),
}  # fmt: skip
# Every flag that changes the preset's shape: refused with --init-from, named at start-up; but
# the load-balancing loss's weight is no shape: a run that goes on from another may change it.
MODEL_FLAGS = [*SHAPE_FLAGS, *EXPERT_FLAGS]
TRAINING_ONLY = ("router_aux_loss_coef",)


def add_shape_flags(group, number_arg) -> None:
    """--num-layers ... --ffn-size, --num-experts ...: each refused outside its range."""
    for name, (field, what) in SHAPE_FLAGS.items():
        help = f"{what}: LlamaConfig.{field} (default: the preset's)"
        flag = f"--{name.replace('_', '-')}"
        group.add_argument(flag, type=number_arg(int, 1), default=None, metavar="N", help=help)
    for name, (field, what, kind, low, metavar) in EXPERT_FLAGS.items():  # presets: dense
        help = f"{what}: LlamaConfig.{field} (default: {getattr(LlamaConfig, field)})"
        parse = number_arg(kind, low)
        flag = f"--{name.replace('_', '-')}"
        group.add_argument(flag, type=parse, default=None, metavar=metavar, help=help)


def preset_config(args, preset: str, vocab_size: int | None = None) -> LlamaConfig:
    """The preset with the shape and expert flags applied, and vocab_size (else --vocab-size,
    else the preset's). ValueError naming the flags that do not fit."""
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
    if experts:  # flags that shape a mixture of experts: do they fit together?
        from lib.extras.moe import check_expert_flags

        defaults = {field: getattr(LlamaConfig, field) for field, *_ in EXPERT_FLAGS.values()}
        check_expert_flags(experts, defaults | config)
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
        ratio = f"{said('hidden_size')} / {said('num_heads')} = head_dim {d // h}"
        raise ValueError(f"{ratio}: rotary embeddings need an even head_dim")
    return LlamaConfig(**config)


def model_name(args, preset: str | None) -> str:
    """The name of the model at start-up: tiny, tiny with --num-layers 8, or from DIR."""
    if preset is None:
        return f"from {args.init_from}"
    given = [n for n in MODEL_FLAGS if getattr(args, n, None) is not None]
    flags = " ".join(f"--{n.replace('_', '-')} {getattr(args, n)}" for n in given)
    return f"{preset} with {flags}" if flags else preset


def model_shape(args) -> LlamaConfig:
    """The architecture this run trains, known before any data is read: the --model preset
    shaped by the flags (vocab_size: that of a trained tokenizer), or the config.json of
    --init-from."""
    if args.init_from is None:
        return preset_config(args, args.model or "tiny")
    from lib.checkpoints.finished_run import init_from_config  # only for --init-from

    config = init_from_config(args.init_from)
    if getattr(args, "router_aux_loss_coef", None) is None:
        return config
    if not config.num_local_experts:
        weighs = "--router-aux-loss-coef weighs the load-balancing loss of a mixture of experts"
        raise ValueError(f"{weighs}, and --init-from {args.init_from} is a dense model")
    return dataclasses.replace(config, router_aux_loss_coef=args.router_aux_loss_coef)


def model_source(args) -> tuple[str | None, str | None, LlamaConfig]:
    """(preset or None, tokenizer.json or None: train one, config) from --model and --tokenizer or
    --init-from, checked before any data is read: ValueError naming the flags that do not fit."""
    model, tokenizer = args.model or "tiny", args.tokenizer
    if args.init_from is not None:
        from lib.checkpoints.finished_run import check_init_from  # only for --init-from

        shaping = ["model", "tokenizer", "vocab_size"]
        shaping += [n for n in MODEL_FLAGS if n not in TRAINING_ONLY]
        given = [f"--{n.replace('_', '-')}" for n in shaping if getattr(args, n) is not None]
        check_init_from(args, given)
        # The weights only mean something with the tokenizer they were trained with.
        model, tokenizer = None, os.path.join(args.init_from, "tokenizer.json")
    config = model_shape(args)
    if tokenizer is not None:  # a given tokenizer.json: are its special tokens found?
        loaded = load_tokenizer(tokenizer, special_tokens(args))
        if args.init_from is not None:  # and is it the one the weights were trained with?
            from lib.checkpoints.finished_run import check_tokenizer

            check_tokenizer(config, loaded, args.init_from)
    elif any(special_tokens(args).values()):
        raise ValueError(
            "--bot-token, --eot-token and --pad-token name tokens of --tokenizer's (or "
            "--init-from's) tokenizer; the one a run trains has its own: [BOT], [EOT], [PAD]"
        )
    return model, tokenizer, config


def refuse_experts(parser, args, script: str) -> None:
    """parser.error (exit code 2) if this run's model is a mixture of experts, which `script`
    cannot train (moe.NO_EXPERTS says why); called after flags.run_settings, before any work."""
    if experts := model_shape(args).num_local_experts:
        from lib.extras.moe import cannot_train  # a mixture of experts: lib/extras/moe.py

        parser.error(cannot_train(script, args, experts))


def vocab_size(args) -> int:
    """The vocabulary of a tokenizer this run trains: --vocab-size, or the preset's own."""
    return model_shape(args).vocab_size


def special_tokens(args) -> dict[str, str | None]:
    """The special tokens that the flags name (None: lib/extras/hf_tokenizer.py finds it in the
    tokenizer)."""
    return {"bot": args.bot_token, "eot": args.eot_token, "pad": args.pad_token}
