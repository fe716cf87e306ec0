"""The communication ledger (--comm-ledger): every collective one training step asks of the
process groups, counted as the groups are asked, and written to OUT_DIR/comm_ledger.json.

    with CommLedger(layout) as ledger:         # lib/loop.py: around the third step it runs
        ...                                    # the lesson's step: forward, backward, optimizer
    rows = ledger.rows()                       # [{op, group, group_size, calls, bytes}, ...]

Each row adds up the calls of one operation on one group: `bytes` is the whole buffer each call
produces or consumes (all_gather's output, reduce_scatter's input, all_reduce's and broadcast's
tensor, all_to_all's input, a send's or recv's tensor), what lib/extras/comm_formulas.py's
step_rows predicts; the planner turns those into bytes on the wire (an all-reduce of B bytes
sends 2 (n - 1) / n B of them in a ring). A group is named after its dimension in one of the
Layout's device meshes ("dp", "replicate", "shard", "tp", "pp", "cp", "ep"), else after the
dimensions it spans ("dp+tp"; "world": every rank).

How it sees them: a TorchDispatchMode, as torch.distributed.tensor.debug.CommDebugMode is. Every
collective of torch.distributed reaches the dispatcher as an operator: the c10d ones
(c10d.allreduce_, _allgather_base_, _reduce_scatter_base_, alltoall_base_, send, recv_,
broadcast_, ...) for dist.all_reduce and its kin, and from C++ too: ProcessGroup's methods call
those operators, so DDP's reducer (its bucketed all-reduces in backward) and FSDP2's all-gathers
and reduce-scatters are seen; the functional ones (_c10d_functional.all_gather_into_tensor,
reduce_scatter_tensor, all_reduce, all_to_all_single, ...) for DTensor's redistributions (TP, SP,
CP's gathers, gradient norms of sharded gradients) and EP's all-to-alls. The mode is a thread's
state that autograd carries into its own threads, and sees what is asked of a group whatever its
backend: gloo and nccl alike. A DTensor operation is let through first (NotImplemented) so that
the collectives it turns into are seen, not the operation. The profiler's record_param_comms
records would see the same calls, but only through a trace that costs every operator of the
step; it is not what a learner needs to read.

Ranks can differ (a pipeline's first and last stages): every rank records its own step, and the
JSON holds every rank's rows, each with its "rank"; the printed table is rank 0's. Under
--compile, Dynamo traces the functional collectives into its graphs, run by compiled code that
no dispatch mode is guaranteed to see: --comm-ledger refuses --compile (refusal).
"""

import json
import os
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

# The run's step the ledger records (0: its first): past the first ones, whose collectives differ
# (DDP builds its buckets in the first backward and sends their new order in the second step's
# forward), so that the ledger is what every later step sends. (lib/flags.py's help: "third".)
LEDGER_STEP = 2

c10d = torch.ops.c10d
functional = torch.ops._c10d_functional


def _sum_bytes(tensors) -> int:
    """The bytes of a tensor, or of a (nested) list of them."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_sum_bytes(t) for t in tensors)


# operator -> (op, the index of its process group argument, how to read its bytes from args).
# The c10d operators take the group as a ProcessGroup, the functional ones by its name.
C10D = {
    c10d.allreduce_: ("all_reduce", 1, lambda a: _sum_bytes(a[0])),
    c10d.allreduce_coalesced_: ("all_reduce", 1, lambda a: _sum_bytes(a[0])),
    c10d.allgather_: ("all_gather", 2, lambda a: _sum_bytes(a[0])),
    c10d._allgather_base_: ("all_gather", 2, lambda a: _sum_bytes(a[0])),
    c10d.allgather_coalesced_: ("all_gather", 2, lambda a: _sum_bytes(a[0])),
    c10d.allgather_into_tensor_coalesced_: ("all_gather", 2, lambda a: _sum_bytes(a[0])),
    c10d.reduce_scatter_: ("reduce_scatter", 2, lambda a: _sum_bytes(a[1])),
    c10d._reduce_scatter_base_: ("reduce_scatter", 2, lambda a: _sum_bytes(a[1])),
    c10d.reduce_scatter_tensor_coalesced_: ("reduce_scatter", 2, lambda a: _sum_bytes(a[1])),
    c10d.alltoall_: ("all_to_all", 2, lambda a: _sum_bytes(a[1])),
    c10d.alltoall_base_: ("all_to_all", 2, lambda a: _sum_bytes(a[1])),
    c10d.broadcast_: ("broadcast", 1, lambda a: _sum_bytes(a[0])),
    c10d.send: ("send", 1, lambda a: _sum_bytes(a[0])),
    c10d.recv_: ("recv", 1, lambda a: _sum_bytes(a[0])),
    c10d.recv_any_source_: ("recv", 1, lambda a: _sum_bytes(a[0])),
    c10d.reduce_: ("reduce", 1, lambda a: _sum_bytes(a[0])),
    c10d.gather_: ("gather", 2, lambda a: _sum_bytes(a[1])),
    c10d.scatter_: ("scatter", 2, lambda a: _sum_bytes(a[0])),
    c10d.barrier: ("barrier", 1, lambda a: 0),
}
FUNCTIONAL = {
    functional.all_reduce: ("all_reduce", 2, lambda a: _sum_bytes(a[0])),
    functional.all_reduce_: ("all_reduce", 2, lambda a: _sum_bytes(a[0])),
    functional.all_reduce_coalesced: ("all_reduce", 2, lambda a: _sum_bytes(a[0])),
    functional.all_reduce_coalesced_: ("all_reduce", 2, lambda a: _sum_bytes(a[0])),
    # (input, group_size, group_name): the output is group_size inputs
    functional.all_gather_into_tensor: ("all_gather", 2, lambda a: a[1] * _sum_bytes(a[0])),
    functional.all_gather_into_tensor_coalesced: (
        "all_gather",
        2,
        lambda a: a[1] * _sum_bytes(a[0]),
    ),
    functional.all_gather_into_tensor_out: (
        "all_gather",
        2,
        lambda a: a[1] * _sum_bytes(a[0]),
    ),
    functional.reduce_scatter_tensor: ("reduce_scatter", 3, lambda a: _sum_bytes(a[0])),
    functional.reduce_scatter_tensor_coalesced: ("reduce_scatter", 3, lambda a: _sum_bytes(a[0])),
    functional.all_to_all_single: ("all_to_all", 3, lambda a: _sum_bytes(a[0])),
    functional.broadcast: ("broadcast", 2, lambda a: _sum_bytes(a[0])),
    functional.broadcast_: ("broadcast", 2, lambda a: _sum_bytes(a[0])),
}
RECORDED = {**C10D, **FUNCTIONAL}
# The order the table lists the operations in.
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")


class CommLedger(TorchDispatchMode):
    """Counts, while it is on, each collective this process asks of a process group: per (op,
    group) the calls and the bytes (the module docstring). `layout`: the strategy module's
    Layout, whose meshes name the groups (None: only "world" and ranks)."""

    def __init__(self, layout=None):
        super().__init__()
        self.names, self.sizes = group_names(layout)
        self.counts = defaultdict(lambda: [0, 0])  # (op, group, group_size) -> [calls, bytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A DTensor first turns its operation into plain tensors' collectives, which this mode
        # then sees; run here, its own operation would hide them.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        recorded = RECORDED.get(func._overloadpacket)
        if recorded is not None:
            op, group_at, size_of = recorded
            at = func._schema.arguments[group_at].name
            group = args[group_at] if len(args) > group_at else kwargs[at]
            name, size = self.name_of(group)
            calls_bytes = self.counts[(op, name, size)]
            calls_bytes[0] += 1
            calls_bytes[1] += size_of(args)
        return func(*args, **kwargs)

    def name_of(self, group) -> tuple[str, int]:
        """(the name, the size) of a process group, given as itself or by its name."""
        if isinstance(group, str) and group in self.sizes:  # (the meshes' groups, by name)
            return self.names[group], self.sizes[group]
        if isinstance(group, str):  # (a group made elsewhere: torch's own lookup, not public)
            group = dist.distributed_c10d._resolve_process_group(group)
        elif isinstance(group, torch.ScriptObject):  # (how the c10d operators receive it)
            group = dist.ProcessGroup.unbox(group)
        ranks = tuple(dist.get_process_group_ranks(group))
        name = self.names.get(group.group_name) or self.names.get(ranks, describe_ranks(ranks))
        return name, len(ranks)

    def rows(self) -> list[dict]:
        """This process's rows, in OPS order, then by group."""
        order = {op: i for i, op in enumerate(OPS)}
        keys = sorted(self.counts, key=lambda k: (order.get(k[0], len(OPS)), k[0], k[1]))
        return [
            dict(op=op, group=group, group_size=size, calls=calls, bytes=nbytes)
            for (op, group, size), (calls, nbytes) in ((k, self.counts[k]) for k in keys)
        ]


def group_names(layout) -> tuple[dict, dict]:
    """({a process group's name, or the ranks of a set of them: what the ledger calls it}, {the
    name of each group named so: its size}). Each
    dimension of the Layout's meshes by its group (mesh, then fsdp_mesh), the default group as
    "world": so a group is named after its own purpose where two hold the same ranks (CP's "cp"
    and FSDP's "world" on 4 ranks). But a mesh dimension that spans every rank is the default
    group itself (init_device_mesh reuses it), and keeps the dimension's name: on 2 ranks CP's
    and FSDP's collectives are all "cp". Then, for a group made elsewhere, by its ranks: those
    of each dimension, of each pair of them ("dp+tp", as Muon's exchange may span), and of all."""
    names, by_ranks, sizes = {}, {}, {}
    meshes = [] if layout is None else [layout.mesh, layout.fsdp_mesh]
    for mesh in (m for m in meshes if m is not None):
        dims = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
        for d, dim in enumerate(dims):
            group = mesh.get_group(d)
            names.setdefault(group.group_name, dim)
            sizes[group.group_name] = mesh.size(d)
            by_ranks.setdefault(tuple(dist.get_process_group_ranks(group)), dim)
        for i in range(len(dims)):
            for j in range(i + 1, len(dims)):
                ranks = tuple(sorted(mesh[(dims[i], dims[j])].mesh.flatten().tolist()))
                by_ranks.setdefault(ranks, f"{dims[i]}+{dims[j]}")
    if dist.is_initialized():
        names.setdefault(dist.group.WORLD.group_name, "world")
        sizes[dist.group.WORLD.group_name] = dist.get_world_size()
        by_ranks.setdefault(tuple(range(dist.get_world_size())), "world")
    return names | by_ranks, sizes


def describe_ranks(ranks: tuple) -> str:
    """A group no mesh names: by its ranks."""
    return "ranks " + ",".join(map(str, ranks))


# -------------------------------------------------------------------------------------------------
# --comm-ledger in a run: lib/loop.py's TrainingLoop records its step LEDGER_STEP


def refusal(args, start_step: int = 0) -> str | None:
    """Why this run, from `start_step` (a resumed one's), cannot keep --comm-ledger's ledger (a
    one-line message), or None."""
    if args.compile:
        # Dynamo traces DTensor's functional collectives into its graphs, run by compiled code
        # that no dispatch mode is guaranteed to see: a ledger that may miss some is refused.
        return "--comm-ledger records collectives in eager mode only: leave out --compile"
    if start_step + LEDGER_STEP >= args.max_steps:
        resumed = f" (resumed at step {start_step})" if start_step else ""
        return (
            f"--comm-ledger records the run's step {LEDGER_STEP + 1} (the first ones differ): "
            f"--max-steps must be at least {start_step + LEDGER_STEP + 1}{resumed}, "
            f"got {args.max_steps}"
        )
    return None


class StepLedger:
    """What TrainingLoop does for --comm-ledger: `start(step)` before the lesson's step (the
    ledger's, from its start), `finish(step)` at the start of after_step (evaluation, saving and
    logging apart), which prints rank 0's rows and writes every rank's to OUT_DIR."""

    def __init__(self, out_dir: str, start_step: int, layout, is_main: bool):
        self.out_dir, self.layout, self.is_main = out_dir, layout, is_main
        self.step = start_step + LEDGER_STEP  # of this run: a resumed one records its own third
        self.ledger = None

    def start(self, step: int) -> None:
        if step == self.step:
            self.ledger = CommLedger(self.layout)
            self.ledger.__enter__()

    def finish(self, step: int) -> None:
        if step != self.step or self.ledger is None:
            return
        self.ledger.__exit__(None, None, None)
        rows = self.ledger.rows()
        self.ledger = None
        every = gather_rows(rows)  # (a collective on every rank, after the step recorded)
        if self.is_main:
            # (tqdm.write: below the progress bar, not through it)
            tqdm.write(table(rows, step + 1))
            if not dist.is_initialized():
                tqdm.write(
                    "no process group: DataParallel copies between the GPUs of one process, "
                    "which no collective of torch.distributed sees (comm_ledger.json is empty)"
                )
            tqdm.write(f"wrote {write(self.out_dir, every)}")


# -------------------------------------------------------------------------------------------------
# The outputs: every rank's rows in OUT_DIR/comm_ledger.json, rank 0's as a table


def gather_rows(rows: list[dict]) -> list[dict]:
    """Every rank's rows, each with its "rank" (a collective, outside the recorded step; one
    process: its own, rank 0)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [dict(rank=0, **row) for row in rows]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    return [dict(rank=r, **row) for r, rank_rows in enumerate(every) for row in rank_rows]


def write(out_dir: str, rows: list[dict]) -> str:
    """OUT_DIR/comm_ledger.json (atomically: a temporary file renamed); its path."""
    path = os.path.join(out_dir, "comm_ledger.json")
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def table(rows: list[dict], step: int) -> str:
    """One rank's rows as a table, with the step they are of."""
    lines = [f"communication ledger of step {step} (rank 0; every rank's in comm_ledger.json):"]
    if not rows:
        return lines[0] + " no collectives"
    lines.append(f"  {'op':<15}{'group':<12}{'size':>5}{'calls':>7}{'bytes':>15}")
    for r in rows:
        lines.append(
            f"  {r['op']:<15}{r['group']:<12}{r['group_size']:>5}{r['calls']:>7}{r['bytes']:>15,}"
        )
    return "\n".join(lines)
