"""FSDP's flags and grid, the same in train_fsdp.py and in every lesson that extends it
(train_tp.py, train_pp.py, train_cp.py and train_ep.py shard with FSDP across their groups):

    fsdp.add_flags(parser)  # --zero-stage, --cpu-offload, --replicate
    layout = fsdp.setup(parser, args, world_size, device)  # checked; HSDP's mesh, if any
    fsdp.describe(layout)  # the start-up line

The other strategy modules have the same three functions, and call these for FSDP's part.
"""

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lib.distributed import divide_ranks
from lib.flags import number_arg
from lib.parallel.layout import Layout


def add_flags(parser) -> None:
    """FSDP's flags: --zero-stage, --cpu-offload, --replicate (HSDP)."""
    parser.add_argument(
        "--zero-stage",
        type=int,
        choices=[2, 3],
        default=3,
        help="3: weights resharded after forward (least memory); 2: weights kept gathered until "
        "backward (less communication). Gradients and optimizer state: sharded in both",
    )
    parser.add_argument(
        "--cpu-offload",
        action="store_true",
        help="keep sharded weights, gradients and optimizer state in CPU memory; the optimizer "
        "step runs on the CPU (ZeRO-Offload's idea; slower, fits far bigger models)",
    )
    parser.add_argument(
        "--replicate",
        type=number_arg(int, 1),
        default=1,
        help="HSDP: shard within groups of 1/R of the data-parallel ranks (say, one node each) and "
        "keep R replicas of the shards; 1: plain FSDP over all of them",
    )


def setup(parser, args, world_size: int, device) -> Layout:
    """train_fsdp.py's layout: every rank reads its own share of the batch (dp = world_size), and
    FSDP shards over all of them, or (--replicate R) HSDP's grid of R rows. Checked before any
    work (ValueError through parser.error); the mesh is built unless --check (no process group)."""
    check_replicate(parser, args, world_size)
    fsdp_mesh = None if args.check else hsdp_mesh(args, world_size, device)
    rank = 0 if args.check else dist.get_rank()
    return Layout(world_size, world_size, dp_rank=rank, fsdp_mesh=fsdp_mesh, **options(args))


def options(args) -> dict:
    """The Layout's FSDP fields from the flags."""
    return dict(replicate=args.replicate, zero_stage=args.zero_stage, cpu_offload=args.cpu_offload)


def check_replicate(parser, args, ranks: int) -> None:
    """ValueError (through parser.error) unless --replicate divides the `ranks` FSDP shards over."""
    try:
        divide_ranks(ranks, "--replicate", args.replicate, "replicas x shard groups")
    except ValueError as e:
        parser.error(str(e))


def hsdp_mesh(args, ranks: int, device):
    """FSDP's mesh over all `ranks`: None (plain FSDP), or with --replicate R, HSDP's grid of R
    rows of ranks / R: each row (consecutive ranks, a node say) one shard group, the rows replicas
    of each other's shards, all-reducing their gradients."""
    if args.replicate == 1:
        return None
    dims = (args.replicate, ranks // args.replicate)
    return init_device_mesh(device.type, dims, mesh_dim_names=("replicate", "shard"))


def grid(args, dp: int, device, outer=(), inner=()) -> tuple:
    """(mesh, fsdp_mesh, dp_rank, dp_group) of a lesson that shards with FSDP over `dp` groups of
    ranks, with the dimensions `outer` (before) and `inner` (after them: consecutive ranks), each a
    (size, name). The mesh names FSDP's dimensions "replicate" and "shard" (HSDP, --replicate R)
    or "dp"; fsdp_mesh is that part of it. The dp group, the ranks in the same place in the other
    dimensions, is where the lesson adds up the sums of the batch's shares."""
    fsdp_dims = ((args.replicate, "replicate"), (dp // args.replicate, "shard"))
    fsdp_dims = fsdp_dims if args.replicate > 1 else ((dp, "dp"),)
    dims = (*outer, *fsdp_dims, *inner)
    mesh = init_device_mesh(
        device.type, [s for s, _ in dims], mesh_dim_names=tuple(n for _, n in dims)
    )
    fsdp_mesh = mesh[tuple(n for _, n in fsdp_dims)] if args.replicate > 1 else mesh["dp"]
    groups = mesh  # HSDP: FSDP's two dimensions are one dp group, from a mesh of its own
    if args.replicate > 1:
        flat = (*outer, (dp, "dp"), *inner)
        groups = init_device_mesh(
            device.type, [s for s, _ in flat], mesh_dim_names=tuple(n for _, n in flat)
        )
    return mesh, fsdp_mesh, groups.get_local_rank("dp"), groups["dp"].get_group()


def describe(layout: Layout) -> str:
    """FSDP's part of the start-up summary: HSDP's grid, the ZeRO stage, offload."""
    shards = layout.world_size // (layout.tp * layout.pp * layout.replicate)
    hsdp = f"HSDP {layout.replicate} x {shards} (replicas x shard group), " * (layout.replicate > 1)
    zero = f"FSDP ZeRO-{layout.zero_stage} over {shards} ranks"
    return f"{hsdp}{zero}, cpu offload {layout.cpu_offload}"
