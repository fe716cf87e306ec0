"""How a run ends when it does not finish: one line for a known failure, a clean stop on a signal.

`run(main)` wraps every script's main(): a bad input (ValueError) or a failed training run
(TrainingError) ends in one line on stderr and an exit code, not a traceback. `StopRequest` turns
Ctrl-C (SIGINT), SIGTERM and SIGUSR1 into a stop after the step in flight, on every rank at the
same step, with a checkpoint there; the loop raises `Stopped`, and `run` says so and exits.
"""

import atexit
import ctypes
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist


class TrainingError(Exception):
    """The run cannot go on (a non-finite loss, ...); nothing bad was saved."""


class Stopped(Exception):
    """A training loop stopped on a signal (StopRequest), with a checkpoint at `step`."""

    def __init__(self, step: int, signum: int):
        super().__init__(step, signum)
        self.step, self.signum = step, signum


def run(main: Callable[[], None], os_exit: bool = False) -> None:
    """Call a script's main(); a known failure ends in one line on stderr, not a traceback.

    The checks in this suite raise ValueError for bad input (no data at that path, a checkpoint
    of another model, ...), exit code 2, and TrainingError when training itself fails, exit code
    1; a traceback would only bury the message. Under torchrun every rank meets the same
    failure, so only global rank 0 prints it.

    Any other exception (a bug, or a failure no check here names) prints its traceback, as
    Python would, and exits with 1. However main() ends, the process ends: see
    training.step_batches for the DataLoader workers. os_exit=True (the lessons that join a
    process group): it ends with end_process, os._exit once the atexit handlers have run,
    rather than the interpreter's own teardown, which torch.distributed's C++ objects can abort.

    A run stopped by a signal (Stopped) ends in one line too, and exits with 128 + the signal's
    number: 130 after Ctrl-C (SIGINT), 143 after SIGTERM, what a shell reports for a process
    that signal killed. Whatever watches the run (a script, torchrun, Slurm) then sees "cut
    short, not finished": 0 would say the run is complete (model.pt written, nothing to resume)
    and 1 that it failed. A Ctrl-C that interrupts at once (before training, or a second one)
    exits with 130 as well.
    """
    is_main = int(os.environ.get("RANK", "0")) == 0
    code = 0
    try:
        stopped = None
        try:
            main()
        except Stopped as e:
            stopped = e.step, e.signum  # not e: its traceback would keep main's frames alive
        if stopped is not None:
            if dist.is_initialized():
                # Here, not in the loop: main's frames (DDP's reducer, the DataLoader workers)
                # are gone. The barrier keeps every rank until rank 0 has written its files:
                # torchrun stops the other workers when one exits with an error.
                dist.barrier()
                dist.destroy_process_group()
            if is_main:
                print(f"stopped at step {stopped[0]}, checkpoint saved; run the same command to "
                      f"resume")  # fmt: skip
            code = 128 + stopped[1]
    except (ValueError, TrainingError) as e:
        if is_main:
            print(f"error: {e}", file=sys.stderr)
        code = 2 if isinstance(e, ValueError) else 1
    except KeyboardInterrupt:
        if is_main:
            print("interrupted: stopped at once, without saving; any checkpoints in --out-dir are "
                  "intact: run the same command to resume", file=sys.stderr)  # fmt: skip
        code = 128 + signal.SIGINT
    except SystemExit:
        raise  # argparse's usage errors (exit code 2), ...
    except BaseException:  # noqa: BLE001 - (DCP's CheckpointException is a BaseException)
        # Printed by every rank: an unexpected failure may be one rank's own. Caught rather than
        # left to the interpreter, so that this process too ends with end_process under torchrun.
        traceback.print_exc()
        code = 1
    if os_exit:
        end_process(code)
    if code:
        sys.exit(code)


def end_process(code: int) -> None:
    """Exit with `code` after the atexit handlers, but without the interpreter's own teardown.

    A process that used torch.distributed keeps C++ objects past destroy_process_group(): FSDP's
    and DTensor's sharding keep the gloo process group alive (its threads still run), with
    tensors of its collectives. They are freed only after Python has shut down, and freeing a
    tensor that Python still owned then needs a GIL that no longer exists: the process aborts
    ("terminate called without an active exception", SIGABRT) after a finished run, and torchrun
    reports the run as failed. Seen a few times in the test suite, mostly in train_fsdp.py.
    So: the handlers registered with atexit (the out-dir lock's release, logging, ...) run here,
    while Python is whole; the output is flushed; and os._exit skips the rest. Every file of the
    run is closed by now (checkpoints and metrics are written whole, or renamed into place).
    """
    atexit._run_exitfuncs()  # what a normal exit runs first; emptied, so it never runs twice
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# -------------------------------------------------------------------------------------------------
# Interruptions: Ctrl-C (SIGINT), SIGTERM (kill, a scheduler's preemption) and SIGUSR1 (the early
# warning that slurm_ddp.sbatch asks Slurm for, before the time limit)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# torchrun passes the signals it receives on to its workers, which a Ctrl-C in the terminal (or
# Slurm, which signals every process of a job step) has reached already: each worker gets the
# same signal twice, milliseconds apart. A repeat within this many seconds is that echo.
ECHO_SECONDS = 2.0


class StopRequest:
    """A STOP_SIGNALS signal stops the run cleanly: after the step in flight, with a checkpoint
    there, on every rank at the same step.

    The signal handler only notes the signal; the training loop calls all_reduce() after each step.
    Ranks receive a signal at slightly different moments (or only some of them do), and a rank
    that left the loop alone would leave the others waiting forever in their next collective.
    So every rank all-reduces (MAX) the signal it has received, every step, and reads the
    result one step later: all ranks see the same value after the same step, and stop there
    together. Read a step late, the result costs no wait for the GPU: its all-reduce was queued
    behind the previous step, which has finished by then.

    A second signal (other than the echo above) raises KeyboardInterrupt at once, saving or
    not: every file is written under a temporary name and renamed once complete, so what is cut
    short is never visible (the next start removes it), and the newest checkpoint is the one
    before. One process alone (train_dp.py) stops right after the step in flight.
    """

    def __init__(self, device: torch.device):
        self.signal = 0  # the signal all ranks agreed to stop on (0: none)
        self._received, self._received_at = 0, 0.0  # this process's first signal, and when
        self._distributed = dist.is_initialized() and dist.get_world_size() > 1
        self._flag = torch.zeros((), dtype=torch.int64, device=device)
        # On a GPU the result is copied to pinned host memory behind the all-reduce, and an
        # event marks that point of the stream; on CPU, gloo runs the all-reduce in its own
        # threads while the next step computes.
        self._cuda = self._flag.is_cuda
        self._result = torch.zeros((), dtype=torch.int64, pin_memory=True) if self._cuda else None
        self._event = torch.cuda.Event() if self._cuda else None
        self._wait = None  # waits for the all-reduce in flight (None: none yet)
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self._received:
            if now - self._received_at > ECHO_SECONDS:
                raise KeyboardInterrupt  # asked again: stop at once (run() says so)
            return
        self._received, self._received_at = signum, now
        if int(os.environ.get("RANK", "0")) == 0:
            note = (
                f"\n{signal.Signals(signum).name}: stopping after this step, with a "
                f"checkpoint (the same signal again stops at once, without saving)\n"
            )
            # os.write, not print: a handler may run in the middle of a print to stderr.
            os.write(sys.stderr.fileno(), note.encode())

    def all_reduce(self) -> int:
        """A collective: every rank calls it after every step. The signal to stop on after this
        step, the same on all ranks (the MAX over the ranks of the signal each received; one
        process: its own, with no collective); 0: go on."""
        if not self._distributed:
            self.signal = self._received
            return self.signal
        if self._wait is not None:
            self._wait()  # the all-reduce issued after the previous step
            self.signal = int(self._result if self._cuda else self._flag)
            if self.signal:
                return self.signal
        self._flag.fill_(self._received)
        if self._cuda:
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)  # queued on the stream
            self._result.copy_(self._flag, non_blocking=True)
            self._event.record()
            self._wait = self._event.synchronize  # waits for the stream up to here, no further
        else:
            work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)
            self._wait = work.wait
        return 0

    def finish(self) -> None:
        """After the last step, before the process group goes: wait for the all-reduce that
        all_reduce() left in flight. Its handle would otherwise outlive the process group, and a
        collective's work freed only at interpreter exit can abort the process there (gloo:
        "terminate called without an active exception")."""
        if self._wait is not None:
            self._wait()
            self._wait = None


def ignore_stop_signals(worker_id: int) -> None:
    """A DataLoader worker ignores STOP_SIGNALS, which a terminal's Ctrl-C and Slurm (its
    warning, scancel, a preemption) send to every process of a job, workers included: the
    training process still reads batches until it stops, then ends its workers itself, through
    the DataLoader (they leave when told; training.step_batches makes sure they are told, even
    when the run ends in an error). A worker killed by the signal instead would fail the step in
    flight, and the run would lose everything since its last checkpoint.

    Deaf to SIGTERM, a worker must never outlive the training process: on Linux the kernel kills
    it (SIGKILL) the moment its parent exits, however (a SIGKILL, the OOM killer, torchrun's
    kill after its timeout), even in the middle of a batch. (The DataLoader's own check of its
    parent runs only between batches, every 5 s; where prctl is missing, it is the only one.)
    """
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    parent = multiprocessing.parent_process()  # the training process (with any start method)
    end_with_parent(signal.SIGKILL, parent.pid if parent is not None else None)


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def end_with_parent(signum: int, parent: int | None = None) -> None:
    """Linux: have the kernel send `signum` to this process when its parent exits (prctl's
    PR_SET_PDEATHSIG), whatever ends the parent: a SIGKILL passes nothing on to its children,
    who would otherwise run on as orphans. Elsewhere (or should prctl fail), nothing happens.

    The parent is the thread that started this process (for a DataLoader worker, the training
    loop's; for a rank, torchrun's main thread), and a DataLoader worker under the forkserver
    start method has the fork server for parent, which ends with the training process.
    `parent`: the pid of the process that started this one, if known; if it has exited before
    this call (too early for the kernel to notice), `signum` comes at once.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # no C library to call, or no prctl in it
        return
    if parent is not None and os.getppid() != parent and not _exists(parent):
        os.kill(os.getpid(), signum)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: only whether there is such a process
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # there is, someone else's
    return True
