"""Profile one training step as train_dp.py runs it, next to a lean reference step.

    python -m tools.profile_step                    # tiny, train_dp.py's default batch, on the CPU
    python -m tools.profile_step --threads 1        # one CPU thread (steadier timings)
    python -m tools.profile_step --threads 1 --clock cpu   # CPU time: steadier on a busy machine
    python -m tools.profile_step --compile          # per-layer torch.compile, as train_dp --compile
    python -m tools.profile_step --model small --seq-length 1024 --batch-size 8 \
        --precision bf16                            # GPU

It prints
  1. torch.profiler's table of our step (the top --rows operators by self time): where the time
     goes, and which copies, casts and fills there are;
  2. milliseconds per step of our step and of `reference_step`: the same Llama (the same
     weights, optimizer and loss), written lean, with torch.nn.functional ops only (one matmul
     for q, k and v, one for the gate and up projections, no modules, no wrapper; with
     --num-experts, the routing and load-balancing loss of lib/extras/moe.py, written so too).
     The two are timed in alternating rounds (the median is printed), so that a busy machine
     slows both alike; their ratio is what the suite's readable model and loop cost;
  3. with --compile: how long compiling took (the first step, less a compiled one), and the
     eager step's time next to the compiled one's.

Our step is train_dp.py's: nn.DataParallel(Replica(model)), the loss normalised by the batch's
tokens, gradient clipping, the non-finite guard, AdamW (training.build_optimizer), the schedule. The
data is random tokens, the same batch every step: a step's time does not depend on the text.
"""

import argparse
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from lib import exits, flags, loop, model_config, training
from lib.extras import speed
from lib.parallel.replica import Replica
from model import IGNORE_INDEX, LlamaConfig, LlamaForPretraining, rope_cos_sin

# -------------------------------------------------------------------------------------------------
# Our step: train_dp.py's loop body


def gpu_ids(device) -> list[int] | None:
    return [device.index] if device.type == "cuda" else None


def our_step(args, config: LlamaConfig, device, precision: str, compile: bool):
    """step(micro_batches) -> None: one optimizer step of train_dp.py (model, optimizer, ...)."""
    torch.manual_seed(0)
    model = LlamaForPretraining(config).to(device)
    optimizer = training.build_optimizer(model, args, device.type)
    scheduler = training.build_scheduler(optimizer, args)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    guard = loop.NonFiniteGuard(device, skip=False)
    if compile:
        speed.compile_layers(model)
    # One GPU, like the reference (train_dp.py itself takes every visible GPU).
    dp_model = nn.DataParallel(Replica(model, device, precision), device_ids=gpu_ids(device))

    def step(micro_batches) -> None:
        global_tokens = sum((y != IGNORE_INDEX).sum() for _, y in micro_batches)
        step_loss = torch.zeros((), device=device)
        for x, y in micro_batches:
            loss_sum, _ = dp_model(x, y, None)
            loss_sum = loss_sum.sum()
            scaler.scale(loss_sum / global_tokens).backward()
            step_loss += loss_sum.detach()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if guard.step_ok(1, step_loss, None if scaler.is_enabled() else grad_norm):
            scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    return step


# -------------------------------------------------------------------------------------------------
# The reference: the same model and update, written lean


def reference_params(model: LlamaForPretraining) -> dict:
    """The reference's weights: a copy of `model`'s, with wq|wk|wv and w1|w3 concatenated into
    one matrix each (one matmul instead of three, and of two; a mixture of experts: w1|w3 of
    each expert, stacked (E, 2 * ffn, d), and the router's `gate`)."""

    def leaf(*tensors: torch.Tensor, dim: int = 0) -> nn.Parameter:
        return nn.Parameter(torch.cat([t.detach() for t in tensors], dim))

    def mlp(ffn: nn.Module) -> dict:
        # As lib/extras/moe.py holds them: w1, w3 (E, ffn, d), w2 (E, d, ffn).
        if model.config.num_local_experts:
            return {
                "gate": leaf(ffn.gate.weight),
                "w13": leaf(ffn.w1, ffn.w3, dim=1),
                "w2": leaf(ffn.w2),
            }
        return {"w13": leaf(ffn.w1.weight, ffn.w3.weight), "w2": leaf(ffn.w2.weight)}

    layers = [
        {
            "attention_norm": leaf(layer.attention_norm.weight),
            "wqkv": leaf(
                layer.attention.wq.weight, layer.attention.wk.weight, layer.attention.wv.weight
            ),
            "wo": leaf(layer.attention.wo.weight),
            "ffn_norm": leaf(layer.ffn_norm.weight),
            **mlp(layer.feed_forward),
        }
        for layer in model.layers
    ]
    embedding = leaf(model.tok_embeddings.weight)
    tied = model.config.tie_word_embeddings
    lm_head = embedding if tied else leaf(model.lm_head.weight)
    return {
        "embedding": embedding,
        "layers": layers,
        "norm": leaf(model.norm.weight),
        "lm_head": lm_head,
    }


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in model.py's (rotate_half) layout; x (B, heads, T, hd), cos/sin (T, hd/2)."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, heads, T, hd/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference_layer(h, layer: dict, cos, sin, config: LlamaConfig):
    """(h after the layer, its load-balancing loss summed over the sequences x their tokens: a
    mixture of experts' (reference_moe), None for the dense MLP)."""
    B, T, d = h.shape
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    eps = config.rms_norm_eps
    a = F.rms_norm(h, (d,), layer["attention_norm"], eps)
    q, k, v = F.linear(a, layer["wqkv"]).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q = reference_rope(q.view(B, T, nh, hd).transpose(1, 2), cos, sin)  # (B, nh, T, hd)
    k = reference_rope(k.view(B, T, nkv, hd).transpose(1, 2), cos, sin)  # (B, nkv, T, hd)
    v = v.view(B, T, nkv, hd).transpose(1, 2)  # (B, nkv, T, hd)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nh)
    h = h + F.linear(y.transpose(1, 2).reshape(B, T, d), layer["wo"])  # (B, T, d)
    x = F.rms_norm(h, (d,), layer["ffn_norm"], eps)
    if "gate" in layer:  # a mixture of experts
        y, balance = reference_moe(x, layer, config)
        return h + y, balance
    gate, up = F.linear(x, layer["w13"]).chunk(2, -1)
    return h + F.linear(F.silu(gate) * up, layer["w2"]), None


# Not compiled, as the forward of lib/extras/moe.py is not (--compile compiles the rest of the
# layer): the split sizes are read on the host.
@torch.compiler.disable
def reference_moe(x: torch.Tensor, layer: dict, config: LlamaConfig):
    """Mixtral's dropless mixture of experts on x (B, T, d), as lib/extras/moe.py computes it: the
    router's softmax in fp32, the top k renormalised, each expert's tokens in one block (one
    matmul for its gate and up projections, one for down). Returns (out (B, T, d), the
    per-sequence load-balancing loss x the sequence's tokens, summed: every target counts)."""
    B, T, d = x.shape
    E, k = config.num_local_experts, config.num_experts_per_tok
    tokens = x.reshape(B * T, d)
    probs = F.linear(tokens, layer["gate"]).float().softmax(dim=-1)  # (N, E)
    weights, experts = probs.topk(k, dim=-1)  # (N, k)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    order = experts.flatten().argsort(stable=True)  # (N * k,) the (token, slot) pairs by expert
    counts = torch.bincount(experts.flatten(), minlength=E).tolist()
    outputs = []
    for chunk, w13, w2 in zip(
        tokens[order // k].split(counts), layer["w13"], layer["w2"], strict=True
    ):
        gate, up = F.linear(chunk, w13).chunk(2, -1)
        outputs.append(F.linear(F.silu(gate) * up, w2))
    y = torch.cat(outputs)  # (N * k, d), by expert
    y = torch.empty_like(y).index_copy(0, order, y)  # (N * k, d), in pair order
    out = (y.view(B, T, k, d) * weights.view(B, T, k, 1)).sum(dim=2).to(x.dtype)
    # Switch's E * sum_i f_i * P_i per sequence: f the share of assignments, P the mean probability
    f = F.one_hot(experts.view(B, T, k), E).sum(dim=2).float().mean(dim=1)  # (B, E)
    P = probs.view(B, T, E).mean(dim=1)  # (B, E)
    return out, T * E * (f * P).sum()


def reference_rope_tables(config: LlamaConfig, T: int, device) -> tuple:
    """cos, sin (T, hd/2): model.py's tables hold each value twice, once per half (sin's first
    half negated: the second is the plain one)."""
    return tuple(t[:T, config.head_dim // 2 :] for t in rope_cos_sin(config, device))


def reference_loss(params: dict, x, y, config, cos, sin, layer_fn=reference_layer):
    """The summed cross-entropy of next tokens y (B, T) after x (B, T), as model(x, y)[0] (a
    mixture of experts: plus router_aux_loss_coef x its load-balancing loss, as there)."""
    h = F.embedding(x, params["embedding"])  # (B, T, d)
    balance = []
    for layer in params["layers"]:
        h, layer_balance = layer_fn(h, layer, cos, sin, config)
        balance += [] if layer_balance is None else [layer_balance]
    h = F.rms_norm(h, (h.size(-1),), params["norm"], config.rms_norm_eps)
    logits = F.linear(h, params["lm_head"])  # (B, T, vocab)
    loss_sum = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
    return loss_sum + config.router_aux_loss_coef * sum(balance) if balance else loss_sum


def reference_step(args, config: LlamaConfig, device, precision: str, compile: bool):
    """step(micro_batches) -> None: forward, loss, backward, clipping and AdamW, nothing else;
    it starts from the same weights as our_step."""
    torch.manual_seed(0)
    params = reference_params(LlamaForPretraining(config).to(device))
    flat = [params["embedding"], params["norm"]]
    flat += [] if config.tie_word_embeddings else [params["lm_head"]]  # tied: the embedding
    flat += [p for layer in params["layers"] for p in layer.values()]
    optimizer = torch.optim.AdamW(
        flat,
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=args.weight_decay,
        fused=device.type == "cuda",
    )
    layer_fn = torch.compile(reference_layer) if compile else reference_layer
    cos, sin = reference_rope_tables(config, args.seq_length, device)

    def step(micro_batches) -> None:
        global_tokens = sum(y.numel() for _, y in micro_batches)
        for x, y in micro_batches:
            with training.autocast(device, precision):
                loss_sum = reference_loss(params, x, y, config, cos, sin, layer_fn)
            (loss_sum / global_tokens).backward()
        torch.nn.utils.clip_grad_norm_(flat, args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


# -------------------------------------------------------------------------------------------------
# Timing and profiling


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --clock: wall time, or this process's CPU time. On a CPU machine that other jobs share, the
# wall time of a step counts the moments it waited for a core; with --threads 1 the CPU time is
# the work itself and steadies the comparison (with more threads it also counts their spinning).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_steps(step, micro_batches, device, steps: int, clock=time.perf_counter) -> float:
    """Seconds per step, over `steps` steps, by `clock`."""
    synchronize(device)
    start = clock()
    for _ in range(steps):
        step(micro_batches)
    synchronize(device)
    return (clock() - start) / steps


def compare(
    steps: dict, micro_batches, device, rounds: int, steps_per_round: int, clock=time.perf_counter
) -> dict:
    """{name: median ms per step}, the contenders timed in alternating rounds."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(time_steps(step, micro_batches, device, steps_per_round, clock))
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def profile_table(step, micro_batches, device, steps: int, rows: int) -> str:
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(micro_batches)
        synchronize(device)
    sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=rows)


def main() -> None:
    defaults = flags.build_parser("defaults")  # train_dp.py's defaults, kept in step with it
    default = defaults.get_default
    p = flags.ArgumentParser(  # a bad flag: one line (exits.run), never read as a longer one
        description="Profile train_dp.py's training step and time it against a lean reference.",
        formatter_class=flags.HelpFormatter,
    )
    p.add_argument("--model", default="tiny", help="preset, as in train_dp.py")
    model_config.add_shape_flags(p, flags.number_arg)
    p.add_argument(
        "--vocab-size",
        type=flags.number_arg(int, flags.MIN_VOCAB_SIZE),
        default=None,
        help="vocabulary (default: preset's)",
    )
    p.add_argument(
        "--seq-length",
        type=flags.number_arg(int, 1),
        default=default("seq_length"),
        help="tokens/row",
    )
    p.add_argument(
        "--batch-size",
        type=flags.number_arg(int, 1),
        default=default("batch_size"),
        help="rows per step",
    )
    p.add_argument(
        "--micro-batch-size",
        type=flags.number_arg(int, 1),
        default=None,
        help="rows per forward (default: all)",
    )
    p.add_argument(
        "--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto", help="as train_dp"
    )
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    p.add_argument(
        "--threads",
        type=flags.number_arg(int, 1, os.cpu_count() or 1),  # more only time the waiting for a core
        default=None,
        help="CPU threads (default: torch's)",
    )
    p.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="time steps by the wall clock or by this process's CPU time (steadier on a busy "
        "machine with --threads 1)",
    )
    p.add_argument(
        "--warmup", type=flags.number_arg(int, 1), default=3, help="steps before timing (compiling)"
    )
    p.add_argument(
        "--rounds", type=flags.number_arg(int, 1), default=5, help="alternating timing rounds"
    )
    p.add_argument(
        "--steps", type=flags.number_arg(int, 1), default=3, help="steps per contender per round"
    )
    p.add_argument(
        "--profile-steps", type=flags.number_arg(int, 1), default=3, help="steps in the profile"
    )
    p.add_argument(
        "--rows", type=flags.number_arg(int, 1), default=15, help="rows of the profiler table"
    )
    args = p.parse_args()
    micro = args.micro_batch_size or args.batch_size
    if args.batch_size % micro:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --micro-batch-size {micro}")
    if args.threads:
        torch.set_num_threads(args.threads)
    # The optimizer's and the schedule's settings: train_dp.py's defaults.
    names = ("lr", "weight_decay", "grad_clip", "warmup_steps", "max_steps", "min_lr_ratio")
    args = argparse.Namespace(**vars(args), **{name: default(name) for name in names})
    try:
        config = model_config.preset_config(args, args.model)  # shape flags, --vocab-size
    except ValueError as e:
        p.error(str(e))
    if args.seq_length > config.max_position_embeddings:
        p.error(f"--seq-length exceeds the model's {config.max_position_embeddings} positions")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if args.compile and (missing := speed.compiler_missing(device)):
        p.error(missing)
    precision = training.resolve_precision(args.precision, device)

    tokens = torch.randint(
        config.vocab_size,
        (args.batch_size, args.seq_length + 1),
        generator=torch.Generator().manual_seed(0),
    ).to(device)
    # (micro, T) each, contiguous as the DataLoader's are
    micro_batches = [(x[:, :-1].contiguous(), x[:, 1:].contiguous()) for x in tokens.split(micro)]
    print(
        f"model {args.model} (1 step = {args.batch_size} x "
        f"{args.seq_length} tokens, micro-batch {micro}), {device}, precision {precision}, "
        f"{torch.get_num_threads()} CPU threads, torch {torch.__version__}"
    )

    steps = {
        "ours": our_step(args, config, device, precision, args.compile),
        "reference": reference_step(args, config, device, precision, args.compile),
    }
    if args.compile:
        steps["ours, eager"] = our_step(args, config, device, precision, compile=False)
    first = {}  # the first step's seconds: with --compile, that is when compiling happens
    for name, step in steps.items():
        first[name] = time_steps(step, micro_batches, device, 1)
        for _ in range(args.warmup - 1):
            step(micro_batches)

    print(f"\nour step, profiled over {args.profile_steps} steps:")
    print(profile_table(steps["ours"], micro_batches, device, args.profile_steps, args.rows))

    ms = compare(steps, micro_batches, device, args.rounds, args.steps, CLOCKS[args.clock])
    print(
        f"{args.clock} ms per step (median of {args.rounds} alternating rounds of {args.steps} "
        f"steps):"
    )
    for name, value in ms.items():
        print(f"  {name:<12} {value:9.1f} ms   {value / ms['reference']:5.2f} x reference")
    if args.compile:
        for name in ("ours", "reference"):
            print(
                f"compiling {name}: {first[name] - ms[name] / 1000:.1f} s (its first step, less "
                f"a compiled step)"
            )
        print(f"our step compiled: {ms['ours, eager'] / ms['ours']:.2f} x faster than eager")


if __name__ == "__main__":
    exits.run(main)  # bad flags: one line, exit 2; sizes that cannot be allocated: exit 1
