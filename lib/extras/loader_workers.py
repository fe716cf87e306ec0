"""DataLoader worker processes (--num-workers, one by default on a GPU): each ends with the
training process however that one ends. lib/training.py imports this file only when a loader has
workers; with none, the batches are read in the training process itself.

    loader = DataLoader(..., num_workers=n, worker_init_fn=loader_workers.ignore_stop_signals)
    batches = loader_workers.start(loader)  # iter(loader), its workers ended at exit
"""

import atexit
import multiprocessing
import os
import signal
import weakref
from collections.abc import Iterator

from torch.utils.data import DataLoader

from lib.exits import STOP_SIGNALS, end_with_parent

# The iterators of start() whose workers may still run (one that finished drops out by itself).
_open_loaders: weakref.WeakSet = weakref.WeakSet()
_exit_hook_registered = False


def ignore_stop_signals(worker_id: int) -> None:
    """A worker ignores STOP_SIGNALS, which Ctrl-C and Slurm send to every process of a job: a
    worker killed by one would fail the step in flight, and the training process saves a
    checkpoint first and then ends its workers itself (start). Deaf to SIGTERM, a worker must
    not outlive its parent either: the kernel kills it when the parent exits."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    parent = multiprocessing.parent_process()  # the training process (with any start method)
    if end_with_parent(signal.SIGKILL) and parent is not None and os.getppid() != parent.pid:
        # Already reparented: if the parent exited before prctl took effect, no signal comes.
        try:
            os.kill(parent.pid, 0)  # no signal: only whether there is such a process
        except ProcessLookupError:
            os.kill(os.getpid(), signal.SIGKILL)
        except PermissionError:
            pass  # there is one, of another user


def start(loader: DataLoader) -> Iterator:
    """iter(loader), whose workers end with this process however it ends. They ignore the stop
    signals, and at an exit after an error (when the DataLoader's own shutdown is off)
    multiprocessing would wait for them forever, so an atexit hook ends them first."""
    global _exit_hook_registered
    batches = iter(loader)
    if not _exit_hook_registered:
        atexit.register(_end_open_loaders)
        _exit_hook_registered = True
    _open_loaders.add(batches)
    return batches


def _end_open_loaders() -> None:
    for batches in list(_open_loaders):
        # The DataLoader's own shutdown (as when its iterator is dropped): a few milliseconds.
        batches._shutdown_workers()
        for worker in batches._workers:
            if worker.is_alive():  # deaf even to that (stuck in a batch): no reason to wait
                worker.kill()
