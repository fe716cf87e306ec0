"""What each rank of a lesson's grid holds and where its collectives run, for
lib/extras/comm_formulas.py's rows: the ledger's name of each process group (GroupNames), and the
local shapes of the parameters one rank holds, by FSDP unit (Shapes), from a config and a Layout
alone. Every decoder layer has the same shapes: one is built on the meta device and counted."""

import dataclasses
import math

import torch

from lib.parallel.layout import Layout
from model import LlamaConfig, LlamaForPretraining

# The matrices tensor parallelism splits by rows of their weight (ColwiseParallel: Shard(0)) and
# by columns (RowwiseParallel: Shard(1)); the norms' gains stay whole.
COLWISE = ("wq", "wk", "wv", "w1", "w3", "lm_head", "tok_embeddings")
ROWWISE = ("wo", "w2")


# -------------------------------------------------------------------------------------------------
# The groups, named as the ledger names them


class GroupNames:
    """The ledger's name of each group a lesson's collectives run on, from the Layout alone: the
    lesson's mesh dimensions in order (then FSDP's own mesh), a dimension spanning every rank
    being the default group itself, which is named after the first such dimension. experts: the
    model is a mixture of experts, which train_ep.py trains on its (dp, ep) mesh at any --ep, 1
    included (dp then spans every rank, and ep is a group of one)."""

    def __init__(self, layout: Layout, experts: bool = False):
        n = layout.world_size
        fsdp = [("replicate", layout.replicate), ("shard", n_shard(layout))]
        fsdp = fsdp if layout.replicate > 1 else [("dp", layout.dp)]
        if layout.tp > 1 or layout.pp > 1:
            mesh = ([("pp", layout.pp)] if layout.pp > 1 else []) + fsdp + [("tp", layout.tp)]
            fsdp_mesh = []
        elif layout.cp > 1 or layout.ep > 1 or experts:
            mesh = [("dp", n // layout.ep // layout.cp)]
            mesh += [("cp", layout.cp)] if layout.cp > 1 else [("ep", layout.ep)]
            fsdp_mesh = fsdp if layout.replicate > 1 else []
        else:  # DDP, ZeRO-1, FSDP: the default group, or HSDP's mesh
            mesh, fsdp_mesh = [], fsdp if layout.replicate > 1 else []
        spanning = [name for name, size in mesh + fsdp_mesh if size == n]
        self.world = spanning[0] if spanning else "world"
        self.sizes = dict(mesh + fsdp_mesh)
        self.layout = layout

    def of(self, dim: str) -> tuple[str, int]:
        """(name, size) of the group of mesh dimension `dim`, or "world" (the default group)."""
        if dim == "world":
            return self.world, self.layout.world_size
        size = self.sizes[dim]  # (KeyError: the layout has no such dimension)
        return (self.world if size == self.layout.world_size else dim), size

    def fsdp(self) -> list[tuple[str, int]]:
        """FSDP's groups: the one it shards over (HSDP: its shard groups, then the replicas)."""
        if self.layout.replicate > 1:
            return [self.of("shard"), self.of("replicate")]
        if self.layout.tp > 1 or self.layout.pp > 1:
            return [self.of("dp")]
        return [self.of("world")]  # FSDP over every rank (CP and EP too: fsdp_mesh None)

    def dp_group(self) -> tuple[str, int]:
        """Where the lesson adds up the step's sums: train_tp.py's and train_pp.py's dp group (a
        mesh of its own under HSDP, named by its ranks), every rank elsewhere."""
        layout = self.layout
        if not (layout.tp > 1 or layout.pp > 1):
            return self.of("world")
        if layout.replicate > 1:  # (named by its ranks: those of a dimension, if they are)
            if layout.dp == layout.world_size:
                return self.world, layout.dp
            if layout.dp == layout.replicate:  # shard groups of one rank
                return self.of("replicate")
            return "replicate+shard", layout.dp
        return self.of("dp")


def sharded(layout: Layout) -> bool:
    """Whether FSDP shards the data-parallel ranks' states (ZeRO-2, ZeRO-3, and every expert-
    parallel layout: train_ep.py shards with FSDP alone) or DDP replicates them (the planner's ddp
    and zero1 rows of a tensor-, pipeline- or context-parallel layout too, over its dp ranks)."""
    return layout.zero_stage >= 2 or layout.ep > 1


def n_shard(layout: Layout) -> int:
    """The ranks of one FSDP shard group (HSDP's, or all those FSDP spans)."""
    return layout.world_size // (layout.tp * layout.pp * layout.replicate)


# -------------------------------------------------------------------------------------------------
# The parameters each rank holds, and FSDP's units of them


@dataclasses.dataclass
class Shapes:
    """The local shapes of the parameters one rank holds, by FSDP unit: tensor parallelism's
    split applied (COLWISE: dim 0 / tp; ROWWISE: dim 1 / tp), in the units the lessons give
    fully_shard (each decoder layer, then the root: embedding, final norm, lm_head; a pipeline
    stage is the root of its own layers; in a mixture of experts, each layer's router and its
    experts are units of their own, the experts split over ep). Every decoder layer has the same
    shapes: one is built (on the meta device) and counted `layers` times, so that a model of any
    depth costs the same to count."""

    layer: list  # [shape, ...] of one decoder layer's unit, its router and experts apart
    router: list  # [shape] of one MoE layer's router unit (empty: dense)
    experts: list  # [shape, ...] of one MoE layer's experts unit (empty: dense)
    root: list  # [shape, ...] of this rank's root unit (empty: a pipeline stage without one)
    embedding: list  # [shape] of the root's embedding (on the first stage), in the model's order
    head: list  # [shape, ...] of the root's final norm and lm_head (on the last stage)
    layers: int  # decoder layers on this rank

    def __init__(self, config: LlamaConfig, layout: Layout, rank: int = 0):
        one = dataclasses.replace(config, num_hidden_layers=1)
        with torch.device("meta"):
            model = LlamaForPretraining(one)
        tp = layout.tp
        local = {name: local_shape(name, p.shape, tp) for name, p in model.named_parameters()}
        layer = {n.split(".", 2)[2]: s for n, s in local.items() if n.startswith("layers.")}
        root = {n: s for n, s in local.items() if not n.startswith("layers.")}
        expert_names = [n for n in layer if ".feed_forward.w" in f".{n}" and len(layer[n]) == 3]
        self.experts = [split_experts(layer.pop(n), layout.ep) for n in expert_names]
        self.router = [layer.pop(n) for n in list(layer) if n.startswith("feed_forward.gate")]
        self.layer = list(layer.values())
        first, last, self.layers = stage_contents(config, layout, rank)
        embedding = [s for n, s in root.items() if n.startswith("tok_embeddings")]
        head = [s for n, s in root.items() if not n.startswith("tok_embeddings")]  # norm, lm_head
        self.embedding, self.head = (embedding if first else []), (head if last else [])
        self.root = self.embedding + self.head

    @classmethod
    def flat(cls, num_params: int) -> "Shapes":
        """A bare parameter count (no config to build a layer from): one flat parameter of
        `num_params` elements in the root, no layers."""
        shapes = cls.__new__(cls)
        shapes.layer, shapes.router, shapes.experts, shapes.layers = [], [], [], 0
        shapes.embedding, shapes.head = [], [(num_params,)]
        shapes.root = shapes.head
        return shapes

    def units(self) -> list[tuple[list, int]]:
        """FSDP's units, the experts' apart, as (shapes, how many): each layer's router (train_ep.py
        shards the router, the experts, then the rest of the layer), each layer, the root."""
        units = [(self.router, self.layers), (self.layer, self.layers), (self.root, 1)]
        return [(shapes, n) for shapes, n in units if shapes and n]

    def count(self) -> int:
        """How many parameters (tensors) this rank holds, the experts' apart."""
        return sum(len(shapes) * n for shapes, n in self.units())


def local_shape(name: str, shape: torch.Size, tp: int) -> tuple:
    """A parameter's shape on one tp rank."""
    leaf = name.rsplit(".", 2)[-2]  # "layers.0.attention.wq.weight" -> "wq"
    shape = list(shape)
    if leaf in COLWISE and len(shape) == 2:
        shape[0] //= tp
    elif leaf in ROWWISE and len(shape) == 2:
        shape[1] //= tp
    return tuple(shape)


def split_experts(shape: tuple, ep: int) -> tuple:
    """One MoE layer's stacked (E, out, in) expert weight on one ep rank: E / ep experts."""
    return (shape[0] // ep, *shape[1:])


def stage_contents(config: LlamaConfig, layout: Layout, rank: int) -> tuple[bool, bool, int]:
    """(whether `rank` holds the embedding, the final norm and lm_head, its decoder layers): all
    of them, or its pipeline stages' (lib/parallel/pipeline.py's split: rank r's stages r, r + pp,
    ...; the mesh's outermost dimension, so pp rank = rank // (world_size / pp))."""
    if layout.pp == 1:
        return True, True, config.num_hidden_layers
    from lib.parallel.pipeline import split_layers, stage_ids_of_rank

    v = stages_per_rank(layout)
    stages = stage_ids_of_rank(rank // (layout.world_size // layout.pp), layout.pp, v)
    ranges = split_layers(config.num_hidden_layers, layout.pp * v)
    last = layout.pp * v - 1  # (a range's len() is a C integer: not for 10^30 layers)
    return 0 in stages, last in stages, sum(ranges[s].stop - ranges[s].start for s in stages)


def stages_per_rank(layout: Layout) -> int:
    """A pipeline rank's stages: --stages-per-rank under the interleaved schedule, else one (as
    the planner's --stages-per-rank, 2 by default, means nothing to the other schedules)."""
    return layout.stages_per_rank if layout.schedule == "interleaved" else 1


def padded(shape: tuple, ranks: int) -> int:
    """Elements of a parameter as FSDP2 lays it out over `ranks`: dim 0 rounded up to a multiple
    of `ranks` (each rank's shard the same size, the last ones padded)."""
    rest = math.prod(shape[1:])
    return math.ceil(shape[0] / ranks) * ranks * rest
