"""--tensorboard: every number of metrics.jsonl also in OUT_DIR/tensorboard, as train/<name> or
val/<name> (lib/metrics.py's Metrics imports this file only for the flag).

    pip install -r requirements-tensorboard.txt
    tensorboard --logdir out/tensorboard
"""

import importlib.util
import os


def check_installed(parser) -> None:
    """parser.error, before any work, if the tensorboard package is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        install = "pip install -r requirements-tensorboard.txt"
        parser.error(
            f"--tensorboard needs the tensorboard package: {install} (or drop --tensorboard: "
            "metrics.jsonl has every value)"
        )


class TensorBoard:
    """Writes each logged record to OUT_DIR/tensorboard, flushed at once: a killed run loses
    nothing it logged. A resumed run hides the steps after its start (purge_step), as
    metrics.jsonl is cut there too."""

    def __init__(self, out_dir: str, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        directory = os.path.join(out_dir, "tensorboard")
        self.writer = SummaryWriter(directory, purge_step=resume_step + 1)

    def log(self, record: dict) -> None:
        group = "val" if "val_loss" in record else "train"
        for name, value in record.items():
            if name != "step" and isinstance(value, (int, float)):
                tag = f"{group}/{name.removeprefix('val_')}"
                self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()
