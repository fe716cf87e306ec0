"""Muon (--optimizer muon): orthogonalised momentum for the decoder's matrices, AdamW for the rest.

Muon (Keller Jordan, 2024; torch.optim.Muon) keeps a momentum of each weight matrix's gradient,
and steps along that momentum "orthogonalised": Newton-Schulz iterations push every singular
value of the update towards 1, so that no direction of the matrix dominates the step. It is for
the hidden matrices: the attention's wq, wk, wv, wo and the MLP's w1, w2, w3 (each expert's too).
The embedding, lm_head, the norms and a mixture of experts' router stay with AdamW.

    optimizer = build_optimizer(model, args, device_type)  # (lib/training.py's, for muon)

Why sharding matters: Newton-Schulz multiplies the whole matrix by its transpose, so each step
needs the whole update, not a rank's rows of it. And it is costly (~30 x rows x cols x min(rows,
cols) FLOPs), so each matrix is orthogonalised on exactly one rank of those that share it, its
owner (assign_owners: the same on every rank), and the result goes back (docs/optimizers.md):
  - one process, ZeRO-1's per-rank optimizers: every matrix this rank updates is whole and its
    own: orthogonalised here;
  - DDP (replicated_over, the ranks holding the same replicas): every rank has every matrix's
    whole update; each orthogonalises the matrices it owns and broadcasts the results (nanochat's
    way), so every rank ends with every result;
  - FSDP, HSDP, CP, TP, TP + FSDP, the pipeline's stages: each rank holds a piece of every
    matrix, a DTensor. The pieces travel to each matrix's owner in an all-to-all over the ranks
    of the matrix's mesh, the owner orthogonalises the whole matrix, and a second all-to-all sends
    each rank its piece of the result (ShardedExchange);
  - a mixture of experts: the experts' weights are stacked (E, ., .), and EP and FSDP split them
    along E, so a rank holds whole experts' matrices: each is orthogonalised where it is, with no
    traffic.
The owners work in rounds, each its costliest matrix left (Exchange.rounds), and the collectives
are asynchronous (async_op): the pieces of later rounds arrive, and one round's results travel,
while the owners run Newton-Schulz on the next. Every layout computes exactly the one-process
update, bit for bit (tests/test_muon.py).
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# Newton-Schulz's quintic coefficients and steps, and the momentum: torch.optim.Muon's defaults
# (from Keller Jordan's implementation).
NS_COEFFICIENTS, NS_STEPS, MOMENTUM, EPS = (3.4445, -4.7750, 2.0315), 5, 0.95, 1e-7


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """Whether Muon updates this parameter: a decoder layer's attention or MLP matrix (a
    mixture of experts' stacked (E, out, in) ones included), not its router, norms, the
    embedding or lm_head."""
    return ".attention.w" in name or (".feed_forward.w" in name and param.dim() >= 2)


def replica_group(params: list[torch.Tensor]):
    """The process group over which these plain tensors are replicas (DDP's, in a job of several
    processes), or None (one process; DTensors: their meshes say who shares them)."""
    plain = not any(isinstance(p, DTensor) for p in params)
    return dist.group.WORLD if plain and dist.is_initialized() else None


class MuonWithAdamW(torch.optim.AdamW):
    """AdamW, whose param groups with "muon": True take Muon's step instead (their "lr" is then
    Muon's). One optimizer, so that every lesson's loop, schedule and checkpoints, and ZeRO-1's
    ZeroRedundancyOptimizer (which builds this class on each rank's share of the groups), see the
    usual API; its state holds AdamW's moments for the one kind, Muon's momentum for the other.

    replicated_over: the process group whose ranks all hold these same plain tensors (DDP): they
    then split the Newton-Schulz work. None (ZeRO-1's per-rank optimizers are built without it):
    a plain tensor is this rank's alone. A DTensor's mesh says who shares it."""

    def __init__(self, params, replicated_over=None, **adamw):
        super().__init__(params, **adamw)
        for group in self.param_groups:
            group.setdefault("muon", False)
        self.replicated_over = replicated_over
        self.exchanges = {}  # each Muon group's exchanges, by its parameters (plan_exchanges)
        self.newton_schulz_matrices = 0  # how many this rank orthogonalised in the last step

    @torch.no_grad()
    def step(self, closure=None):
        every = self.param_groups
        self.param_groups = [g for g in every if not g["muon"]]  # AdamW's own step: its groups
        try:
            loss = super().step(closure)
        finally:
            self.param_groups = every
        self.newton_schulz_matrices = 0
        for group in every:
            if group["muon"]:
                self.muon_step(group)
        return loss

    def muon_step(self, group: dict) -> None:
        """Muon's update of one group: momentum, Nesterov's look-ahead, Newton-Schulz (each
        matrix on its owner), then decoupled weight decay and the step, its lr scaled for the
        matrix's shape."""
        lr, decay = group["lr"], group["weight_decay"]
        params = [p for p in group["params"] if p.grad is not None]  # (the same on every rank)
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:  # (and a step count, as AdamW keeps one)
                state["momentum_buffer"] = torch.zeros_like(p.grad)
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.grad.device)
            state["step"] += 1
            # An average of the gradients, as torch's; every rank keeps its part of each.
            state["momentum_buffer"].lerp_(p.grad, 1 - MOMENTUM)

        def update(p):  # Nesterov's look-ahead, made where an exchange needs it
            return p.grad.lerp(self.state[p]["momentum_buffer"], MOMENTUM)

        def apply(p, result: torch.Tensor) -> None:  # result: this rank's part of p's update
            # Keller Jordan's scale: a tall matrix's orthogonalised update has smaller entries.
            rows, cols = p.shape[-2:]
            scale = math.sqrt(max(1.0, rows / cols))
            local = p.to_local() if isinstance(p, DTensor) else p
            local.mul_(1 - lr * decay)
            local.add_(result.to(local.dtype), alpha=-lr * scale)

        key = tuple(id(p) for p in params)
        if key not in self.exchanges:
            self.exchanges[key] = plan_exchanges(params, self.replicated_over)
        for exchange in self.exchanges[key]:  # (in the same order on every rank)
            exchange.run([params[i] for i in exchange.indices], update, apply)
            self.newton_schulz_matrices += exchange.orthogonalised_here()

    def describe_newton_schulz(self, zero=None) -> str:
        """How the Newton-Schulz work is split, as this rank sees it, for the start-up summary:
        "Newton-Schulz: 14 matrices over 2 ranks, 7 each, 0.0021 TFLOP per rank per step". zero:
        ZeRO-1's ZeroRedundancyOptimizer, of which this is one rank's share: "Newton-Schulz: 28
        matrices shared out by ZeRO-1 over 2 ranks, 14 on this rank, 0.0018 TFLOP per step"."""
        params = [p for g in self.param_groups if g["muon"] for p in g["params"]]
        if zero is not None:  # (each rank knows only its share: no collective to ask the others)
            every = [p for g in zero.param_groups if g.get("muon") for p in g["params"]]
            count, mine = (sum(math.prod(p.shape[:-2]) for p in ps) for ps in (every, params))
            flops = sum(newton_schulz_flops(p.shape) for p in params)
            shared = f"shared out by ZeRO-1 over {zero.world_size} ranks, {mine} on this rank"
            return f"Newton-Schulz: {count} matrices {shared}, {flops / 1e12:.3g} TFLOP per step"
        exchanges = plan_exchanges(params, self.replicated_over)
        return "Newton-Schulz: " + "; ".join(exchange.describe() for exchange in exchanges)


# -------------------------------------------------------------------------------------------------
# Who orthogonalises which matrix


def newton_schulz_flops(shape: torch.Size) -> int:
    """The FLOPs of NS_STEPS iterations on a (..., rows, cols) update: per matrix and step, with
    m its shorter side and n its longer, X X^T (2 m^2 n), that squared (2 m^3) and the result
    times X (2 m^2 n). 4.4e12 for a 4096 x 11008 matrix, 2.1e12 for a 4096 x 4096 one."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * NS_STEPS * (4 * m * m * n + 2 * m**3)


def assign_owners(costs: list[int], ranks: int) -> list[int]:
    """Each matrix's owner among `ranks`, from the matrices' costs alone, so every rank computes
    the same: the costliest first, each to the least loaded rank (ties: the lowest) of those
    with fewer than ceil(M / N) matrices. The counts then differ by at most one, and the loads
    by about one matrix's cost."""
    cap, load, count = -(-len(costs) // ranks), [0] * ranks, [0] * ranks
    owners = [0] * len(costs)
    for m in sorted(range(len(costs)), key=lambda m: (-costs[m], m)):
        owner = min((r for r in range(ranks) if count[r] < cap), key=lambda r: (load[r], r))
        owners[m], load[owner], count[owner] = owner, load[owner] + costs[m], count[owner] + 1
    return owners


def plan_exchanges(params: list, replicated_over) -> list:
    """The exchanges of one Muon group's matrices: one per set of ranks that shares some of
    them (a DTensor's mesh, or DDP's replicas), and one for the matrices this rank keeps."""
    kinds, exchanges = {}, []
    for i, p in enumerate(params):
        kind = sharing(p, replicated_over)
        kinds.setdefault(kind, []).append(i)
    for kind, indices in kinds.items():
        local = kind[0] == "local"  # (its shapes: those of this rank's part, experts' stacks)
        shapes = [local_part(params[i]).shape if local else params[i].shape for i in indices]
        if kind[0] == "replicated":
            exchanges.append(ReplicatedExchange(indices, shapes, replicated_over))
        elif kind[0] == "sharded":
            exchanges.append(ShardedExchange(indices, shapes, params[indices[0]].device_mesh))
        else:
            exchanges.append(Exchange(indices, shapes))
    return exchanges


def sharing(p: torch.Tensor, replicated_over) -> tuple:
    """How the ranks share p's matrices: ("local",) this rank's alone (or whole here: a stack of
    experts split along E); ("replicated",) DDP's replicas; ("sharded", mesh ranks) pieces or
    copies of each matrix on the ranks of a DTensor's mesh (a stack split both along E and
    across its matrices, none in the lessons today, too: its owner orthogonalises it whole)."""
    if not isinstance(p, DTensor):
        if replicated_over is None or dist.get_world_size(replicated_over) == 1:
            return ("local",)
        return ("replicated",)
    matrix_dims, mesh = (p.dim() - 2, p.dim() - 1), p.device_mesh
    # (Shard, and _StridedShard, FSDP's over TP's rows, have a dim; Replicate has none.)
    placed = zip(p.placements, mesh.shape, strict=True)
    shards = [q.dim for q, n in placed if hasattr(q, "dim") and n > 1]
    across = any(d in matrix_dims for d in shards)  # a matrix's rows or columns split
    along = any(d not in matrix_dims for d in shards)  # whole matrices split among ranks
    if mesh.size() == 1 or (along and not across):
        return ("local",)
    return ("sharded", tuple(mesh.mesh.flatten().tolist()))


# -------------------------------------------------------------------------------------------------
# The exchanges: where each update's pieces go, and its result comes back from


class Exchange:
    """Matrices this rank orthogonalises by itself: its own, or whole here (a stack of experts
    split along E)."""

    def __init__(self, indices: list[int], shapes: list):
        self.indices, self.shapes = indices, shapes
        self.costs = [newton_schulz_flops(shape) for shape in shapes]
        self.ranks, self.owners, self.me = 1, [0] * len(shapes), 0

    def run(self, params: list, update, apply) -> None:
        """apply(p, this rank's part of p's orthogonalised update(p)), for each p in params (the
        exchange's matrices, in its order); every rank of the exchange runs it."""
        if batched(params[0]):
            results = orthogonalize_all([local_part(update(p)) for p in params], batch=True)
            for p, result in zip(params, results, strict=True):
                apply(p, result)
        else:  # one matrix at a time: one update and one result in memory
            for p in params:
                apply(p, newton_schulz(local_part(update(p))))

    def rounds(self, batch: bool) -> list[list[list[int]]]:
        """The owners' work in rounds, the same on every rank: rounds[i][r], the matrices rank r
        orthogonalises in round i: its i-th costliest (with batch, its i-th shape's matrices,
        in one call), or none. The exchanges send one round's results while the ranks compute
        the next round, so that the traffic overlaps Newton-Schulz."""
        units = []
        for rank in range(self.ranks):
            mine = [k for k, owner in enumerate(self.owners) if owner == rank]
            mine.sort(key=lambda k: (-self.costs[k], k))  # (rounds of like cost on every rank)
            by_unit = {}
            for k in mine:
                by_unit.setdefault(tuple(self.shapes[k]) if batch else k, []).append(k)
            units.append(list(by_unit.values()))
        count = max(map(len, units), default=0)
        return [[unit[i] if i < len(unit) else [] for unit in units] for i in range(count)]

    def orthogonalised_here(self) -> int:
        """How many matrices this rank orthogonalises in each step (each expert's counted)."""
        owned = [k for k, owner in enumerate(self.owners) if owner == self.me]
        return sum(math.prod(self.shapes[k][:-2]) for k in owned)

    def describe(self) -> str:
        counts = [sum(math.prod(self.shapes[k][:-2]) for k, o in enumerate(self.owners) if o == r)
                  for r in range(self.ranks)]  # fmt: skip
        loads = [sum(c for c, o in zip(self.costs, self.owners, strict=True) if o == r)
                 for r in range(self.ranks)]  # fmt: skip
        each = f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
        where = f"over {self.ranks} ranks, {each} each" if self.ranks > 1 else "on this rank alone"
        return f"{sum(counts)} matrices {where}, {max(loads) / 1e12:.3g} TFLOP per rank per step"


class ReplicatedExchange(Exchange):
    """DDP's replicas: every rank holds every matrix's whole update (the gradients were
    all-reduced). Each orthogonalises the matrices it owns and broadcasts each result (nanochat's
    way): every rank receives the others' results, ~1/N each. One round's broadcasts travel while
    the ranks compute the next round (Exchange.rounds); a rank applies them after that."""

    def __init__(self, indices: list[int], shapes: list, group):
        super().__init__(indices, shapes)
        self.group, self.ranks, self.me = group, dist.get_world_size(group), dist.get_rank(group)
        self.owners = assign_owners(self.costs, self.ranks)

    def run(self, params: list, update, apply) -> None:
        device, dtype, batch = params[0].device, newton_schulz_dtype(params[0]), batched(params[0])
        in_flight = []  # the last round's broadcasts
        for work in self.rounds(batch):
            results = orthogonalize_all([update(params[k]) for k in work[self.me]], batch)
            started = []
            for rank, ks in enumerate(work):  # in rank order on every rank
                if not ks:  # (none left on this rank: it owns one matrix fewer, or none)
                    continue
                if rank == self.me:
                    buffer = torch.cat([result.reshape(-1) for result in results])
                else:
                    numel = sum(params[k].numel() for k in ks)
                    buffer = torch.empty(numel, dtype=dtype, device=device)
                handle = dist.broadcast(buffer, group=self.group, group_src=rank, async_op=True)
                started.append((ks, buffer, handle))
            apply_broadcasts(in_flight, params, apply)  # (sent while this round was computed)
            in_flight = started
        apply_broadcasts(in_flight, params, apply)


def apply_broadcasts(in_flight: list, params: list, apply) -> None:
    """Waits for each (matrices, flat buffer, broadcast) in turn and applies its results."""
    for ks, buffer, handle in in_flight:
        handle.wait()
        for k, piece in zip(ks, buffer.split([params[k].numel() for k in ks]), strict=True):
            apply(params[k], piece.view(params[k].shape))


class ShardedExchange(Exchange):
    """The ranks of a DTensor's mesh (FSDP, HSDP, CP, TP, TP + FSDP, a stage's dp ranks): each
    holds a piece of every matrix, or a copy (HSDP's replicas). For each round of work
    (Exchange.rounds), an all-to-all sends each piece to its matrix's owner, once (one copy of
    each: from the replica in the owner's row), the owner orthogonalises the whole matrix, and a
    second all-to-all sends each rank its piece of the result. Each rank receives ~1/N of the
    matrices whole, then its pieces of the results. Every round's pieces set off at the start,
    so later rounds' arrive while the owners compute; a round's results travel during the next
    round's Newton-Schulz."""

    def __init__(self, indices: list[int], shapes: list, mesh):
        super().__init__(indices, shapes)
        self.mesh, self.ranks = mesh, mesh.size()
        self.owners = assign_owners(self.costs, self.ranks)
        self.group = None  # made at the first step, with the pieces' places (connect)

    def connect(self, params: list[DTensor]) -> None:
        """The mesh's ranks as one process group, and where each rank's piece of each matrix
        lies (chunks[rank][k]: offsets and sizes, DCP's description of a DTensor's piece);
        senders[k]: the ranks that send matrix k's pieces to its owner, one per distinct piece."""
        self.group = mesh_group(self.mesh)
        self.me = dist.get_rank(self.group)
        mine = [p.__create_chunk_list__()[0] for p in params]
        mine = [(tuple(c.offsets), tuple(c.sizes)) for c in mine]
        self.chunks = [None] * self.ranks
        dist.all_gather_object(self.chunks, mine, group=self.group)
        self.sizes = [[math.prod(chunk[1]) for chunk in chunks] for chunks in self.chunks]
        self.senders = []
        for k, owner in enumerate(self.owners):
            holders = {}  # each distinct piece's holders, in rank order
            for rank in range(self.ranks):
                holders.setdefault(self.chunks[rank][k], []).append(rank)
            # HSDP: the holder in the owner's replica row (rank // shard group size).
            picked = [ranks[owner * len(ranks) // self.ranks] for ranks in holders.values()]
            self.senders.append({r for r in picked if self.sizes[r][k]})

    def run(self, params: list[DTensor], update, apply) -> None:
        if self.group is None:
            self.connect(params)
        batch = batched(params[0])
        rounds = self.rounds(batch)
        # Every round's pieces to their owners, at once; each round waits for its own only.
        arriving = [self.send_pieces(work, params, update) for work in rounds]
        in_flight = None  # the last round's results, on their way back
        for work, pieces in zip(rounds, arriving, strict=True):
            wholes = self.assemble(work, pieces)
            results = orthogonalize_all(wholes, batch)
            del wholes  # (freed before the next round's are assembled)
            started = self.send_results(work, results, params[0])
            if in_flight is not None:  # (sent while this round was computed)
                self.apply_results(*in_flight, params, apply)
            in_flight = work, started
        if in_flight is not None:
            self.apply_results(*in_flight, params, apply)

    def send_pieces(self, work: list[list[int]], params: list[DTensor], update) -> tuple:
        """Starts the all-to-all of one round: this rank's pieces of each owner's matrices in
        `work` to that owner. Returns (from_rank, the transfer): from_rank[r], the matrices of
        this rank's whose pieces come from rank r, in order."""
        me, ranks = self.me, range(self.ranks)
        to_owner = [[k for k in work[r] if me in self.senders[k]] for r in ranks]
        from_rank = [[k for k in work[me] if r in self.senders[k]] for r in ranks]
        sent = [[update(params[k]).to_local().reshape(-1) for k in ks] for ks in to_owner]
        wanted = [[self.sizes[r][k] for k in from_rank[r]] for r in ranks]
        dtype, device = params[0].grad.dtype, params[0].device  # (the updates')
        return from_rank, Transfer(sent, wanted, self.group, dtype, device)

    def assemble(self, work: list[list[int]], pieces: tuple) -> list[torch.Tensor]:
        """The whole updates of this rank's matrices in `work`, in order, once their pieces
        (send_pieces) have arrived."""
        from_rank, transfer = pieces
        wholes = {k: None for k in work[self.me]}
        for r, (ks, got) in enumerate(zip(from_rank, transfer.wait(), strict=True)):
            for k, piece in zip(ks, got, strict=True):
                if wholes[k] is None:
                    wholes[k] = piece.new_empty(self.shapes[k])
                wholes[k][region(self.chunks[r][k])] = piece.view(self.chunks[r][k][1])
        return list(wholes.values())

    def send_results(self, work: list[list[int]], results: list, like: DTensor) -> "Transfer":
        """Starts the all-to-all that sends each rank its pieces of this round's results."""
        me, ranks, chunks = self.me, range(self.ranks), self.chunks
        mine = list(zip(work[me], results, strict=True))
        sent = [[result[region(chunks[r][k])].reshape(-1) for k, result in mine] for r in ranks]
        wanted = [[self.sizes[me][k] for k in ks] for ks in work]
        return Transfer(sent, wanted, self.group, newton_schulz_dtype(like), like.device)

    def apply_results(self, work: list[list[int]], transfer: "Transfer", params, apply) -> None:
        """Waits for one round's results (send_results) and applies this rank's pieces."""
        mine = self.chunks[self.me]  # (offsets, sizes) of this rank's piece of each matrix
        for ks, got in zip(work, transfer.wait(), strict=True):
            for k, piece in zip(ks, got, strict=True):
                apply(params[k], piece.view(mine[k][1]))


def region(chunk: tuple) -> tuple[slice, ...]:
    """The slices of a whole tensor that a piece (offsets, sizes) covers."""
    return tuple(slice(o, o + n) for o, n in zip(*chunk, strict=True))


def mesh_group(mesh):
    """One process group of all the mesh's ranks: the group of its one dimension with more than
    one rank, or else a new group of them all (made by those ranks alone, in the same order)."""
    wide = [d for d, n in enumerate(mesh.shape) if n > 1]
    if len(wide) == 1:
        return mesh.get_group(wide[0])
    ranks = sorted(mesh.mesh.flatten().tolist())
    return dist.new_group(ranks, use_local_synchronization=True)


class Transfer:
    """One all_to_all_single in flight (async_op): parts[r], the flat tensors this rank sends
    rank r; sizes[r], the sizes of those it receives from rank r. wait() returns received[r]:
    a list of flat tensors. The tensors sent are held until then."""

    def __init__(self, parts: list, sizes: list, group, dtype, device):
        flat = [t.to(dtype) for ts in parts for t in ts]
        self.send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
        self.received = torch.empty(sum(map(sum, sizes)), dtype=dtype, device=device)
        sent_splits = [sum(t.numel() for t in ts) for ts in parts]
        self.splits, self.sizes = [sum(s) for s in sizes], sizes
        self.work = dist.all_to_all_single(
            self.received, self.send, self.splits, sent_splits, group=group, async_op=True
        )

    def wait(self) -> list[list[torch.Tensor]]:
        self.work.wait()
        self.send = None  # (sent: freed)
        received = self.received.split(self.splits)
        return [list(r.split(s)) for r, s in zip(received, self.sizes, strict=True)]


def local_part(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# -------------------------------------------------------------------------------------------------
# Newton-Schulz


def newton_schulz_dtype(g: torch.Tensor) -> torch.dtype:
    """bf16 on a GPU (torch.optim.Muon's choice: fast, and Muon is robust to it), fp32
    elsewhere (a CPU's bf16 matmuls are slow, and the tests compare layouts closely)."""
    return torch.bfloat16 if g.is_cuda else torch.float32


# Whether an owner orthogonalises its same-shape matrices in one call (torch.stack), by device
# type: only where it measured faster (tools/bench_muon.py --batched, BENCHMARKS.md). On a CPU
# it was not (batched: 0.92x-1.24x the time of one call each over five runs, median 1.09x), and
# one call per matrix keeps each matrix's bits independent of which others its owner holds. On
# a GPU it is not measured yet (--batched --device cuda), so not batched either: one call per
# matrix also lets each result travel while the next is computed (Exchange.rounds).
BATCH_SAME_SHAPES = {"cpu": False}


def batched(t: torch.Tensor) -> bool:
    """Whether an owner batches its same-shape matrices on t's device (BATCH_SAME_SHAPES)."""
    return BATCH_SAME_SHAPES.get(t.device.type, False)


def orthogonalize_all(updates: list[torch.Tensor], batch: bool | None = None) -> list:
    """newton_schulz of each update: batched by shape if `batch` (None: batched(updates[0]))."""
    if not updates or not (batched(updates[0]) if batch is None else batch):
        return [newton_schulz(update) for update in updates]
    by_shape, results = {}, [None] * len(updates)
    for i, update in enumerate(updates):
        by_shape.setdefault(tuple(update.shape), []).append(i)
    for same in by_shape.values():
        stacked = newton_schulz(torch.stack([updates[i] for i in same]))
        for i, result in zip(same, stacked.unbind(), strict=True):
            results[i] = result
    return results


def newton_schulz(g: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Five quintic Newton-Schulz iterations on each matrix of g (..., rows, cols), as
    torch.optim.Muon computes them (the same operations, addmm's fused multiply-adds included):
    the singular values pushed to about 1, the singular vectors kept. In bf16 on a GPU
    (torch.optim.Muon's choice: fast, and Muon is robust to it), in fp32 elsewhere (a CPU's bf16
    matmuls are slow, and the tests compare layouts closely): newton_schulz_dtype."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype or newton_schulz_dtype(g))
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:  # torch.optim.Muon's own steps
        x = x / x.norm().clamp(min=EPS)  # spectral norm at most 1
        for _ in range(NS_STEPS):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:  # a stack of matrices (experts), each as above: batched
        shape, x = x.shape, x.reshape(-1, *x.shape[-2:])
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=EPS)
        for _ in range(NS_STEPS):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        x = x.reshape(shape)
    return x.mT if tall else x
