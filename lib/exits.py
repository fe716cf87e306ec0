"""How every script ends: `run(main)` wraps its main(), so that bad input (ValueError), a failed
run (TrainingError) or too little memory ends in one line on stderr and an exit code, not a
traceback, and a stop on a signal (`Stopped`, lib/loop.py's StopRequest) says so and exits with
128 + the signal. And the processes a run starts end with it."""

import atexit
import ctypes
import datetime
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
    """Call a script's main(); a known failure ends in one line on stderr (say_once). Exit codes:
    2 for bad input (ValueError), 1 for a failed run (TrainingError, out of memory) or anything
    else (a bug: every rank prints its traceback), 128 + the signal after a stop on one (130 for
    Ctrl-C, 143 for SIGTERM, as a shell reports a kill): a watcher sees "cut short", not "done".
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
                resume = "run the same command to resume"
                print(f"stopped at step {stopped[0]}, checkpoint saved; {resume}", flush=True)
            if dist.is_initialized():
                # Here, main's frames (DDP's reducer, loader workers) are gone; the barrier keeps
                # all ranks until rank 0 has said so: torchrun stops all once one exits in error.
                dist.barrier()
                dist.destroy_process_group()
            code = 128 + stopped[1]
    except (ValueError, TrainingError) as e:
        say_once(f"error: {e}", is_main)
        code = 2 if isinstance(e, ValueError) else 1
    except SystemExit:
        raise  # argparse's usage errors (exit code 2), ...
    except BrokenPipeError:  # whatever read the output stopped (`| head`): as SIGPIPE would end it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's own flush)
        code = 128 + signal.SIGPIPE
    except BaseException as e:  # noqa: BLE001 - (DCP's CheckpointException is a BaseException)
        # Caught rather than left to the interpreter, so that under torchrun this process too
        # ends with end_process. Out of memory is no bug: one line, with what to change.
        if interrupted(e):  # a Ctrl-C before training, or a second one: stopped at once
            # (said through say_once: a rank waiting on this one in a collective fails as this
            # one ends, and would otherwise wait FAILURE_WAIT s for rank 0's word)
            intact = "what was written is intact (a training run: the same command resumes it)"
            say_once(f"interrupted: stopped at once, without saving; {intact}", is_main)
            code = 128 + signal.SIGINT
        elif (memory := out_of_memory(e)) is not None:
            smaller = "a smaller --micro-batch-size or model needs less"
            say_once(f"error: out of memory: {memory} ({smaller})", is_main)
        elif (why := peer_ended(e)) is not None and (is_main or not timed_out(e)):
            say_once(f"error: {why}", is_main)
        elif why is not None:  # a timeout: rank 0 may be the late one, and never meet it
            print(f"rank {rank}: error: {why}", file=sys.stderr, flush=True)
        else:
            traceback.print_exc()
        code = code or 1
    if os_exit:
        end_process(code)
    if code:
        sys.exit(code)


def interrupted(e: BaseException) -> bool:
    """Whether `e` is a Ctrl-C: KeyboardInterrupt, or DCP's CheckpointException wrapping one
    (dcp.save raises it, with no message, for a KeyboardInterrupt during its write)."""
    if isinstance(e, KeyboardInterrupt):
        return True
    failures = getattr(e, "failures", None)
    return isinstance(failures, dict) and any(
        isinstance(f[0], KeyboardInterrupt) for f in failures.values() if isinstance(f, tuple)
    )


def out_of_memory(e: BaseException) -> str | None:
    """An out-of-memory error in one line: a GPU's (torch.OutOfMemoryError), or the RuntimeError
    of the CPU allocator."""
    if isinstance(e, torch.OutOfMemoryError):
        return (str(e) or "no details").splitlines()[0]
    _, found, details = str(e).partition("DefaultCPUAllocator: can't allocate memory: ")
    return details.split(". Error code")[0] if found and isinstance(e, RuntimeError) else None


# The errors of gloo and NCCL for a connection that the other side closed, or a process that
# NCCL's watchdog ended (ProcessGroupNCCL aborts the communicator once one collective fails).
PEER_ENDED = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "remote process exited",
    "NCCL error",
    "detected by watchdog",
    "Some NCCL operations have failed",
)
# ... and for a collective that waited longer than the group's timeout: gloo's ("Timed out
# waiting 1800000ms for recv operation", "Application timeout caused pair closure"), NCCL's
# watchdog ("WorkNCCL(...) ran for 600000 milliseconds before timing out"), the store's ("wait
# timeout after 30000ms").
TIMED_OUT = (
    "Timed out waiting",
    "Application timeout caused pair closure",
    "before timing out",
    "Watchdog caught collective",
    "wait timeout",
)


def peer_ended(e: BaseException) -> str | None:
    """Why a collective failed, in one line, where another process of the run is gone or did
    not come in time (--dist-timeout); None for any other error."""
    if not isinstance(e, RuntimeError):  # (torch.distributed.DistError is one)
        return None
    resume = "the checkpoints are intact: run the same command to resume"
    text = str(e)
    if timed_out(e):
        waited = "a collective waited longer than --dist-timeout for another process of this run"
        hung = "if that one is alive but slow, raise --dist-timeout"
        return f"{waited} (slow, hung or gone: see its own output); {hung}; {resume}"
    if any(s in text for s in PEER_ENDED):
        ended = "another process of this run ended (killed, or failed: see its own output)"
        return f"{ended}, so this one cannot go on; {resume}"
    return None


def timed_out(e: BaseException) -> bool:
    """Whether a collective (or the store) gave up waiting for the other ranks."""
    return isinstance(e, RuntimeError) and any(s in str(e) for s in TIMED_OUT)


failure_store: list[dist.Store] = []  # the store of distributed.rendezvous_store (torchrun)
FAILURE_WAIT = 30  # seconds: rank 0 meets a failure every rank meets within moments of them


def say_once(line: str, is_main: bool) -> None:
    """Print `line` on stderr on rank 0; the others wait (up to FAILURE_WAIT s) until it has: once
    one exits, torchrun stops all, maybe rank 0 before its line is out. A failure rank 0 never
    meets is said by the rank that met it, as is any where no torchrun gathers the output."""
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
    """Exit with `code` after the atexit handlers, without the interpreter's teardown (all files
    are written): freeing torch.distributed's C++ objects, which outlive destroy_process_group(),
    after shutdown aborts ("terminate called without an active exception"), a torchrun failure."""
    atexit._run_exitfuncs()  # what a normal exit runs first; emptied, so it never runs twice
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# -------------------------------------------------------------------------------------------------
# The processes of a run. The signals that stop a training loop cleanly (StopRequest): Ctrl-C
# (SIGINT), SIGTERM (kill, preemption), SIGUSR1 (slurm_ddp.sbatch's warning before the time
# limit), SIGHUP (the terminal or SSH closed), SIGQUIT (Ctrl-\\); torchrun passes each on.

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT)
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def end_with_parent(signum: int) -> bool:
    """Linux: have the kernel send `signum` to this process when its parent exits, however it ends
    (prctl's PR_SET_PDEATHSIG): a SIGKILL passes nothing on, and children would run on as orphans.
    Elsewhere, or if prctl fails, nothing. Whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no C library to call, or no prctl in it
        return False
