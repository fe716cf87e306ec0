"""What the lessons that shard the model with FSDP share (train_fsdp.py, train_cp.py,
train_ep.py, and FSDP across groups in train_tp.py and train_pp.py): FSDP's flags and the
start-up line that describes them.
"""

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lib.flags import number_arg


def hsdp_mesh(args, world_size: int, device) -> DeviceMesh | None:
    """FSDP's mesh: None (plain FSDP over all ranks), or with --replicate R, HSDP's grid of R
    rows of world_size / R ranks: each row (consecutive ranks, a node say) one shard group, the
    rows replicas of each other's shards, all-reducing their gradients."""
    if args.replicate == 1:
        return None
    dims = (args.replicate, world_size // args.replicate)
    return init_device_mesh(device.type, dims, mesh_dim_names=("replicate", "shard"))


def describe(args, world_size: int) -> tuple[str, dict]:
    """How add_flags' lessons shard the model: the start-up summary's line, and --plan's layout
    (TrainingLoop's `layout` and `plan`)."""
    shards = world_size // args.replicate
    hsdp = f"HSDP {args.replicate} x {shards} (replicas x shard group), " * (args.replicate > 1)
    text = f"{hsdp}FSDP ZeRO-{args.zero_stage} over {shards} ranks, cpu offload {args.cpu_offload}"
    return text, dict(replicate=args.replicate)


def add_flags(parser) -> None:
    """FSDP's flags, the same in every lesson that shards with it (train_fsdp.py, train_cp.py,
    train_ep.py): --zero-stage, --cpu-offload, --replicate (HSDP)."""
    parser.add_argument("--zero-stage", type=int, choices=[2, 3], default=3, help="3: weights "
                        "resharded after forward (least memory); 2: weights kept gathered until "
                        "backward (less communication). Gradients and optimizer state: sharded "
                        "in both")  # fmt: skip
    parser.add_argument(
        "--cpu-offload",
        action="store_true",
        help="keep sharded weights, "
        "gradients and optimizer state in CPU memory; the optimizer step runs on "
        "the CPU (ZeRO-Offload's idea; slower, fits far bigger models)",
    )
    parser.add_argument("--replicate", type=number_arg(int, 1), default=1, help="HSDP: shard "
                        "within groups of world_size / R ranks (say, one node each) and keep R "
                        "replicas of the shards; 1: plain FSDP over all ranks")  # fmt: skip
