"""How every script ends: `run(main)` wraps its main(), so that bad input (ValueError), a failed
run (TrainingError) or too little memory ends in one line on stderr and an exit code, not a
traceback, and a training loop stopped on a signal (`Stopped`, lib/loop.py's StopRequest) says
so and exits with 128 + the signal. And the processes a run starts end with it.
"""

import atexit
import ctypes
import datetime
import multiprocessing
import os
import signal
import sys
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
    """Call a script's main(); a known failure ends in one line on stderr (say_once), not a
    traceback. Exit codes: 2 for bad input (ValueError), 1 for a failed run (TrainingError, out
    of memory) or anything else (a bug: every rank prints its traceback), 128 + the signal's
    number after a stop on one (130 for Ctrl-C, 143 for SIGTERM, as a shell reports that
    signal's kill): whatever watches the run sees "cut short", not "done".
    os_exit (the lessons that join a process group): end with end_process."""
    rank = os.environ.get("RANK", "0")  # not a number: this process says so (lib/distributed.py)
    is_main = not rank.strip().isdecimal() or int(rank) == 0
    code = 0
    try:
        stopped = None
        try:
            main()
        except Stopped as e:
            stopped = e.step, e.signum  # not e: its traceback would keep main's frames alive
        if stopped is not None:
            if is_main:
                print(f"stopped at step {stopped[0]}, checkpoint saved; run the same command to "
                      f"resume", flush=True)  # fmt: skip
            if dist.is_initialized():
                # Here, not in the loop: main's frames (DDP's reducer, the DataLoader workers)
                # are gone. The barrier keeps every rank until rank 0 has said so (and written its
                # files): torchrun stops the other workers when one exits with an error.
                dist.barrier()
                dist.destroy_process_group()
            code = 128 + stopped[1]
    except (ValueError, TrainingError) as e:
        say_once(f"error: {e}", is_main)
        code = 2 if isinstance(e, ValueError) else 1
    except KeyboardInterrupt:  # a Ctrl-C before training, or a second one: stopped at once
        if is_main:
            print("interrupted: stopped at once, without saving; what was written is intact (a "
                  "training run: the same command resumes it)", file=sys.stderr)  # fmt: skip
        code = 128 + signal.SIGINT
    except SystemExit:
        raise  # argparse's usage errors (exit code 2), ...
    except BrokenPipeError:  # whatever read the output stopped (`| head`): as SIGPIPE would end it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's own flush)
        code = 128 + signal.SIGPIPE
    except BaseException as e:  # noqa: BLE001 - (DCP's CheckpointException is a BaseException)
        # Caught rather than left to the interpreter, so that under torchrun this process too
        # ends with end_process. Out of memory is no bug: one line, with what to change.
        if (memory := out_of_memory(e)) is None:
            traceback.print_exc()
        else:
            say_once(f"error: out of memory: {memory} (a smaller --micro-batch-size or model "
                     f"needs less)", is_main)  # fmt: skip
        code = 1
    if os_exit:
        end_process(code)
    if code:
        sys.exit(code)


def out_of_memory(e: BaseException) -> str | None:
    """torch's out-of-memory error in one line (a GPU's, or the CPU allocator's RuntimeError)."""
    if isinstance(e, torch.OutOfMemoryError):
        return (str(e) or "no details").splitlines()[0]
    _, found, details = str(e).partition("DefaultCPUAllocator: can't allocate memory: ")
    return details.split(". Error code")[0] if found and isinstance(e, RuntimeError) else None


failure_store: list[dist.Store] = []  # distributed.rendezvous_store's, under torchrun
FAILURE_WAIT = 30  # seconds: rank 0 meets a failure every rank meets within moments of them


def say_once(line: str, is_main: bool) -> None:
    """Print `line` on stderr on rank 0; another rank waits (up to FAILURE_WAIT s) until rank 0
    has: torchrun stops all workers once one exits with an error, maybe rank 0 before its line is
    out. A failure that rank 0 never says (it met none) is said by the rank that met it, and any
    rank's where no torchrun gathers the ranks' output (RANK set by hand, a leftover)."""
    if is_main:
        print(line, file=sys.stderr, flush=True)
    elif not failure_store and "TORCHELASTIC_RUN_ID" not in os.environ:
        print(f"rank {os.environ['RANK']}: {line}", file=sys.stderr, flush=True)
    for store in failure_store:
        try:
            if is_main:
                store.set("failure_said", "1")
            else:
                store.wait(["failure_said"], datetime.timedelta(seconds=FAILURE_WAIT))
        except dist.DistError:  # timed out (or the store has gone, with its node)
            if not is_main:
                print(f"rank {os.environ['RANK']}: {line}", file=sys.stderr, flush=True)


def end_process(code: int) -> None:
    """Exit with `code` after the atexit handlers, without the interpreter's own teardown:
    torch.distributed's C++ objects outlive destroy_process_group() (FSDP keeps the gloo group),
    and freeing them after Python has shut down aborts the process ("terminate called without an
    active exception"), which torchrun reports as a failure. Every file is written by now."""
    atexit._run_exitfuncs()  # what a normal exit runs first; emptied, so it never runs twice
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# -------------------------------------------------------------------------------------------------
# The processes of a run: the signals that stop a training loop cleanly (lib/loop.py's
# StopRequest): Ctrl-C (SIGINT), SIGTERM (kill, a scheduler's preemption) and SIGUSR1 (the early
# warning that slurm_ddp.sbatch asks Slurm for, before the time limit)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def ignore_stop_signals(worker_id: int) -> None:
    """A DataLoader worker ignores STOP_SIGNALS, which Ctrl-C and Slurm send to every process of
    a job: killed, it would fail the step in flight; the training process ends it itself
    (training._start_loader). Deaf to SIGTERM, it must never outlive the training process: the
    kernel kills it when its parent exits (the DataLoader only checks between batches)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    parent = multiprocessing.parent_process()  # the training process (with any start method)
    end_with_parent(signal.SIGKILL, parent.pid if parent is not None else None)


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def end_with_parent(signum: int, parent: int | None = None) -> None:
    """Linux: have the kernel send `signum` to this process when its parent exits (prctl's
    PR_SET_PDEATHSIG), however it ends: a SIGKILL passes nothing on to children, who would run
    on as orphans. Elsewhere (or should prctl fail), nothing. `parent`: its pid, if known; if it
    exited before this call, `signum` comes now."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # no C library to call, or no prctl in it
        return
    if parent is not None and os.getppid() != parent:
        try:
            os.kill(parent, 0)  # no signal: only whether there is such a process
        except ProcessLookupError:
            os.kill(os.getpid(), signum)
        except PermissionError:
            pass  # there is, someone else's
