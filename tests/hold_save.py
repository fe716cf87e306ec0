"""Run a train script with one checkpoint's write held, as a disk that stops answering would:

    python -m torch.distributed.run --nproc_per_node=2 tests/hold_save.py step_0000003 \
        train_fsdp.py --async-save [flags]

DCP writes a checkpoint's shards through FileSystemWriter.write_data (with --async-save, in a
background thread). Here, for the checkpoint whose directory name contains the given text, it
never returns: the test can then kill the run while that save is in flight, at a moment it
chooses rather than one a timing race picks.
"""

import runpy
import sys
import threading
from pathlib import Path

from torch.distributed.checkpoint import filesystem

REPO = Path(__file__).resolve().parent.parent


def hold(name: str) -> None:
    write_data = filesystem.FileSystemWriter.write_data

    def held_write_data(self, plan, planner):
        if name in str(self.path):
            threading.Event().wait()  # forever: the process is killed meanwhile
        return write_data(self, plan, planner)

    filesystem.FileSystemWriter.write_data = held_write_data


if __name__ == "__main__":
    hold(sys.argv[1])
    sys.argv = sys.argv[2:]
    sys.path.insert(0, str(REPO))
    runpy.run_path(sys.argv[0], run_name="__main__")
