"""Muon's cost under sharding: how much longer a Muon step takes than an AdamW step, on 1 rank
and on N, under DDP and FSDP; and Newton-Schulz calls per rank per step.

    torchrun --standalone --nproc_per_node=2 -m tools.bench_muon        # the issue's shape
    torchrun --standalone --nproc_per_node=4 -m tools.bench_muon --rounds 5
    python -m tools.bench_muon --batched    # one process: batched Newton-Schulz against one call
                                            # per matrix, on the matrices of the model
    python -m tools.bench_muon --batched --device cuda   # the same on a GPU, in bf16

The default shape is one where Newton-Schulz dominates the step (--hidden-size 512 --ffn-size
1536 --num-layers 4, 16 tokens x 2 sequences a step): Muon's extra time is then almost all
Newton-Schulz, which the ranks now split. Every rank joins one process group; each measurement
uses the first n ranks (a group of their own: 1, then all N), the others waiting at a barrier.
Each layout and n trains one model (the lessons' build: meta device, fully_shard or DDP,
init_weights) with two optimizers, training.build_optimizer's AdamW and Muon: per round, --steps
AdamW steps, then --steps Muon steps, each timed whole (forward, backward, step). The rounds
alternate every measurement, so the machine's noise falls on each alike; the medians of the
rounds are reported. The global batch stays the same at every n (--batch-size sequences).

Reported: the step times, Muon's extra (Muon's step less AdamW's), its ratio at N ranks to that
at 1 (the target: at most 0.6 at 2 ranks, 0.35 at 4: each rank orthogonalises 1/N of the
matrices, and the exchange costs a little), how much of the extra is Newton-Schulz itself (the
busiest rank's wall-clock in it; the rest is the exchange and the momentum), the same ratio in
CPU time (the busiest rank's process time: what the ranks compute and exchange, whatever else
the machine runs), and the Newton-Schulz calls on each rank.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from lib import distributed, exits, flags, model_config, training
from lib.extras import muon
from model import IGNORE_INDEX

LAYOUTS = ("ddp", "fsdp")
NEWTON_SCHULZ_SECONDS = [0.0]  # this rank's wall-clock in muon.newton_schulz (time_newton_schulz)


def build_parser() -> argparse.ArgumentParser:
    p = flags.ArgumentParser(description="Time Muon's step against AdamW's, on 1 rank and N.",
                             formatter_class=flags.HelpFormatter)  # fmt: skip
    p.add_argument("--model", default="tiny", help="preset, shaped by the flags below")
    model_config.add_shape_flags(p, flags.number_arg)
    p.set_defaults(hidden_size=512, ffn_size=1536, num_layers=4, num_heads=8, num_kv_heads=8)
    p.add_argument("--vocab-size", type=int, default=512, help="the model's vocabulary")
    p.add_argument("--seq-length", type=int, default=16, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per step, all ranks")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: ddp, fsdp")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per optimizer and round")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--batched", action="store_true", help="instead: batched Newton-Schulz "
                   "against one call per matrix, in this process")  # fmt: skip
    where = "with --batched: where Newton-Schulz runs (the ranks run on CPU)"
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help=where)
    return p


def build(layout: str, args, group):
    """(model, AdamW, Muon) on the ranks of `group`, as train_ddp.py and train_fsdp.py build
    them. Muon's replicas are `group`'s (build_optimizer would name every rank's)."""
    model, config = training.build_model(args, args.model, args.vocab_size)
    if layout == "fsdp":
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    training.init_weights(model, config, args, torch.device("cpu"))
    adamw = training.build_optimizer(model, argparse.Namespace(**vars(args), optimizer="adamw"),
                                     "cpu")  # fmt: skip
    muon_args = argparse.Namespace(**vars(args), optimizer="muon")
    with_muon = training.build_optimizer(model, muon_args, "cpu")
    if layout == "ddp":
        with_muon.replicated_over = group if dist.get_world_size(group) > 1 else None
        model = DDP(model, process_group=group, **distributed.NO_FORWARD_BUFFER_SYNC)
    return model, adamw, with_muon


def time_newton_schulz() -> None:
    """From now on, muon.newton_schulz adds its wall-clock seconds to NEWTON_SCHULZ_SECONDS."""
    plain = muon.newton_schulz

    def timed(g: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return plain(g, dtype)
        finally:
            NEWTON_SCHULZ_SECONDS[0] += time.perf_counter() - start

    muon.newton_schulz = timed


def timed_steps(model, optimizer, args, group) -> tuple[float, float, float]:
    """Seconds per step, --steps steps, as the slowest rank of `group` took them: wall-clock,
    this process's CPU time (which other jobs on the machine do not stretch), and the wall-clock
    in Newton-Schulz."""
    n = dist.get_world_size(group)
    rows = args.batch_size // n  # this rank's share of the global batch
    shape = (rows, args.seq_length + 1)
    tokens = torch.randint(args.vocab_size, shape, generator=torch.Generator())
    x, y = tokens[:, :-1], tokens[:, 1:]  # (B, T) each
    dist.barrier(group)
    start, cpu, NEWTON_SCHULZ_SECONDS[0] = time.perf_counter(), time.process_time(), 0.0
    for _ in range(args.steps):
        loss_sum, _ = model(x, y)
        (loss_sum / (y != IGNORE_INDEX).sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.barrier(group)
    cpu = time.process_time() - cpu
    seconds = [time.perf_counter() - start, cpu, NEWTON_SCHULZ_SECONDS[0]]
    seconds = torch.tensor(seconds, dtype=torch.float64) / args.steps
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return tuple(seconds.tolist())


def measure(args) -> None:
    """Every (layout, n), AdamW then Muon, round after round; rank 0 prints the table."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = sorted({1, 2, world} & set(range(1, world + 1)))
    groups = {n: dist.new_group(list(range(n))) for n in sizes}  # (every rank makes each)
    layouts = args.layouts.split(",")
    built = {(layout, n): build(layout, args, groups[n]) for layout in layouts for n in sizes
             if rank < n}  # fmt: skip
    times = {(layout, n, o, clock): [] for layout in layouts for n in sizes
             for o in ("adamw", "muon") for clock in ("wall", "cpu", "ns")}  # fmt: skip
    calls = {}
    for round_ in range(args.rounds + 1):  # round 0: warm-up, not counted
        for layout in layouts:
            for n in sizes:
                if rank < n:
                    model, adamw, with_muon = built[layout, n]
                    for name, optimizer in (("adamw", adamw), ("muon", with_muon)):
                        wall, cpu, ns = timed_steps(model, optimizer, args, groups[n])
                        if round_:
                            times[layout, n, name, "wall"].append(wall)
                            times[layout, n, name, "cpu"].append(cpu)
                            times[layout, n, name, "ns"].append(ns)
                    mine = [None] * n
                    dist.all_gather_object(mine, with_muon.newton_schulz_matrices, group=groups[n])
                    calls[layout, n] = mine
                dist.barrier()
    if rank == 0:
        print(report(args, layouts, sizes, times, calls, built))


def report(args, layouts, sizes, times, calls, built) -> str:
    median = {key: statistics.median(value) for key, value in times.items()}

    def extra(layout, n, clock):  # Muon's step less AdamW's
        return median[layout, n, "muon", clock] - median[layout, n, "adamw", clock]

    lines = [f"Muon against AdamW: {args.rounds} alternating rounds of {args.steps} steps, "
             f"medians; hidden {args.hidden_size}, ffn {args.ffn_size}, {args.num_layers} "
             f"layers, {args.batch_size} x {args.seq_length} tokens a step, {args.threads} "
             f"thread(s) per rank; load average at the end {os.getloadavg()[0]:.1f} on "
             f"{os.cpu_count()} CPUs", "",
             "| layout | ranks | AdamW step (ms) | Muon step (ms) | Muon's extra (ms) | "
             "of which Newton-Schulz (ms) | extra / extra at 1 rank | CPU: extra / at 1 rank | "
             "Newton-Schulz calls per rank |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for layout in layouts:
        for n in sizes:
            a, m = median[layout, n, "adamw", "wall"], median[layout, n, "muon", "wall"]
            wall = extra(layout, n, "wall") / extra(layout, 1, "wall")
            cpu = extra(layout, n, "cpu") / extra(layout, 1, "cpu")
            lines.append(f"| {layout} | {n} | {a * 1e3:.1f} | {m * 1e3:.1f} | "
                         f"{(m - a) * 1e3:.1f} | {median[layout, n, 'muon', 'ns'] * 1e3:.1f} | "
                         f"{wall:.2f} | {cpu:.2f} | "
                         f"{', '.join(map(str, calls[layout, n]))} |")  # fmt: skip
    lines.append("")
    lines.append(built[layouts[0], 1][2].describe_newton_schulz() + " (1 rank)")
    return "\n".join(lines)


def batched_against_one_by_one(args) -> None:
    """Newton-Schulz on the model's matrices, batched by shape and one call each, alternating."""
    config = model_config.preset_config(args, args.model, args.vocab_size)
    d, f = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (f, d), (d, f), (f, d)] * config.num_hidden_layers
    device = torch.device(args.device)
    updates = [torch.randn(s, device=device) for s in shapes]
    times = {True: [], False: []}
    for round_ in range(args.rounds + 1):
        for batched in (False, True):
            start = time.perf_counter()
            muon.orthogonalize_all(updates, batch=batched)
            if device.type == "cuda":  # (the kernels run after the calls return)
                torch.cuda.synchronize()
            if round_:
                times[batched].append(time.perf_counter() - start)
    one, batch = (statistics.median(times[b]) * 1e3 for b in (False, True))
    print(f"Newton-Schulz on {len(shapes)} matrices ({config.num_hidden_layers} layers of "
          f"d {d}, ffn {f}) on {device.type} in {muon.newton_schulz_dtype(updates[0])}, "
          f"{torch.get_num_threads()} thread(s), medians of {args.rounds} "
          f"alternating rounds: one call per matrix {one:.1f} ms, batched by shape "
          f"{batch:.1f} ms ({batch / one:.2f}x)")  # fmt: skip


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.device == "cuda" and not args.batched:
        parser.error("--device cuda is for --batched only (the ranks are CPU processes)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no GPU here")
    # What the bench does not vary takes the lessons' defaults (seed, weight decay, --lr, ...).
    defaults = vars(flags.build_parser("").parse_args([]))
    args = argparse.Namespace(**{**defaults, **vars(args)})
    del args.optimizer
    torch.set_num_threads(args.threads)
    if args.batched:
        batched_against_one_by_one(args)
        return
    rank, _, world_size, _ = distributed.torchrun_rank()
    dist.init_process_group("gloo", store=distributed.rendezvous_store(), rank=rank,
                            world_size=world_size)  # fmt: skip
    time_newton_schulz()
    try:
        measure(args)
    finally:
        dist.destroy_process_group()
    exits.end_process(0)


if __name__ == "__main__":
    exits.run(main)  # a bad flag: one line and exit 2
