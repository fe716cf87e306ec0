"""The model a run trains, as flags say it: the --model preset with the shape flags over it.

    model_flags.add_shape_flags(group)                # --num-layers, --hidden-size, ...
    config = model_flags.preset_config(args, "tiny")  # LlamaConfig, checked: errors name flags

One place turns flags into a shape, for the train scripts (cli.plan_run's checks before any data
is read, training.build_model), bench.py, memory_plan.py and profile_step.py alike.
"""

from model import LlamaConfig

# The shape flags: each replaces one LlamaConfig field of the --model preset (preset_config).
SHAPE_FLAGS = {
    "num_layers": ("num_hidden_layers", "decoder layers"),
    "hidden_size": ("hidden_size", "model width"),
    "num_heads": ("num_attention_heads", "attention heads"),
    "num_kv_heads": ("num_key_value_heads", "key/value heads (fewer: grouped-query attention)"),
    "ffn_size": ("intermediate_size", "width of the SwiGLU MLP"),
}


def add_shape_flags(group) -> None:
    """--num-layers ... --ffn-size: the train scripts', bench.py's and memory_plan.py's."""
    for name, (field, what) in SHAPE_FLAGS.items():
        group.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, metavar="N",
                           help=f"{what}: LlamaConfig.{field} (default: the preset's)")  # fmt: skip


def preset_config(args, preset: str, vocab_size: int | None = None) -> LlamaConfig:
    """The preset with the shape flags applied, and vocab_size (else --vocab-size, else the
    preset's): the one place flags become a shape, for the plan's checks, the model built and
    memory_plan.py alike. ValueError naming the flags that do not fit."""
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
    config = {**base.to_dict(), **{SHAPE_FLAGS.get(n, (n,))[0]: v for n, v in given.items()}}
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


def model_name(args, preset: str | None) -> str:
    """The model's name at start-up: tiny, tiny with --num-layers 8, or from DIR (--init-from)."""
    if preset is None:
        return f"from {args.init_from}"
    given = [n for n in SHAPE_FLAGS if getattr(args, n, None) is not None]
    flags = " ".join(f"--{n.replace('_', '-')} {getattr(args, n)}" for n in given)
    return f"{preset} with {flags}" if flags else preset
