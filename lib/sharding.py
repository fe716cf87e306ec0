"""What the lessons that shard the model with FSDP share (train_fsdp.py, train_cp.py,
train_ep.py, and FSDP across groups in train_tp.py and train_pp.py): FSDP's flags and the
start-up line that describes them.
"""

from lib.flags import number_arg


def describe(args, world_size: int) -> str:
    """How add_flags' lessons shard the model, for the start-up summary."""
    shards = world_size // args.replicate
    hsdp = f"HSDP {args.replicate} x {shards} (replicas x shard group), " * (args.replicate > 1)
    return f"{hsdp}FSDP ZeRO-{args.zero_stage} over {shards} ranks, cpu offload {args.cpu_offload}"


def add_flags(parser) -> None:
    """FSDP's flags, the same in every lesson that shards with it (train_fsdp.py, train_cp.py,
    train_ep.py): --zero-stage, --cpu-offload, --replicate (HSDP)."""
    parser.add_argument("--zero-stage", type=int, choices=[2, 3], default=3, help="3: weights "
                        "resharded after forward (least memory); 2: weights kept gathered until "
                        "backward (less communication). Gradients and optimizer state: sharded "
                        "in both")  # fmt: skip
    parser.add_argument("--cpu-offload", action="store_true", help="keep sharded weights, "
                        "gradients and optimizer state in CPU memory; the optimizer step runs on "
                        "the CPU (ZeRO-Offload's idea; slower, fits far bigger models)")
    parser.add_argument("--replicate", type=number_arg(int, 1), default=1, help="HSDP: shard "
                        "within groups of world_size / R ranks (say, one node each) and keep R "
                        "replicas of the shards; 1: plain FSDP over all ranks")  # fmt: skip
