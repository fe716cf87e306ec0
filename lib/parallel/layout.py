"""The Layout: how a run's ranks are arranged, what every strategy module's `setup` returns and
what the memory planner (lib/extras/memory.py) reads. The sizes of its grid, the FSDP options, and
(under torchrun, not for --check) the device meshes and groups the lesson's collectives run on.

    layout = tensor_parallel.setup(parser, args, world_size, device)  # checked; its meshes
    layout.dp, layout.dp_rank, layout.dp_group   # who splits the batch, and how the sums add up
    layout.mesh["tp"], layout.fsdp_mesh          # what parallelize_module, fully_shard split over
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Layout:
    """world_size = dp x tp x pp x cp ranks (dp: the data-parallel groups that split each global
    batch). ep: the ranks that share out a mixture of experts' experts (each rank still reads its
    own share of the batch: dp = world_size). replicate: HSDP's replicas of FSDP's shard groups."""

    world_size: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    replicate: int = 1
    zero_stage: int = 3  # FSDP's: 3 reshards the weights after forward, 2 keeps them gathered
    cpu_offload: bool = False
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # the pipeline's (pp > 1)
    stages_per_rank: int = 1
    # What the start-up line says beside the grid: a pipeline's layers per stage and its
    # micro-batches of so many sequences; a mixture of experts' experts per layer.
    stage_layers: tuple[int, ...] = ()
    micro_batches: int = 1
    micro_batch_size: int = 1
    experts: int = 0
    # The device meshes and groups, under torchrun (None for --check and the planner): the
    # strategy's own grid, named by its dimensions; what fully_shard shards over (None: all
    # ranks); and this rank's place among the dp groups, with the group that adds up their sums.
    mesh: object = field(default=None, compare=False, repr=False)
    fsdp_mesh: object = field(default=None, compare=False, repr=False)
    dp_rank: int = 0
    dp_group: object = field(default=None, compare=False, repr=False)
