"""Specification of interruptions: Ctrl-C (SIGINT), SIGTERM, SIGHUP (a closed terminal) and
SIGQUIT stop a run cleanly; a process whose peer died says that.

After the step in flight (the same step on every rank), the run saves a checkpoint there, prints
one line saying so and exits with 128 + the signal's number, without a traceback; the same
command then resumes, and ends with exactly the weights of a run never interrupted (on CPU, bit
for bit). Each test signals a real run the way a terminal, `kill` or Slurm would.
"""

import os
import re
import signal
import threading
import time

import pytest
import torch
from harness import (
    DDP,
    DP,
    cmd,
    load_weights,
    read_metrics,
    run_script,
    start,
    wait_for_step,
)
from test_faults import FAULT_RUN, assert_weights_equal, finish, worker_pid

from lib import exits, loop

FSDP = "train_fsdp.py"
STOPPED = re.compile(r"stopped at step (\d+), checkpoint saved; run the same command to resume")


def assert_stopped_cleanly(output: str, out, max_steps: int, sharded: bool = False) -> int:
    """The one line of a clean stop (once: rank 0 alone), its checkpoint, no model.pt; the step."""
    stops = STOPPED.findall(output)
    assert len(stops) == 1, output[-6000:]
    step = int(stops[0])
    assert 1 <= step < max_steps, output[-6000:]
    name = f"step_{step:07d}" if sharded else f"step_{step:07d}.pt"
    assert (out / "checkpoints" / name).exists(), sorted(os.listdir(out / "checkpoints"))
    assert not (out / "model.pt").exists(), "a stopped run wrote model.pt"
    assert f"stopping after step {step}, with a checkpoint" in output  # said once all agreed
    return step


def assert_resumes_to(reference, script, argv, world, step, out) -> None:
    """The same command again: it resumes at `step` and ends bit-identical to `reference`."""
    proc = run_script(script, argv, world)
    assert f"at step {step}" in proc.stdout, proc.stdout[-4000:]
    assert_weights_equal(load_weights(out), load_weights(reference))
    train_steps = [r["step"] for r in read_metrics(out)[0]]
    assert train_steps == list(range(1, len(train_steps) + 1)), "steps repeated or missing"


# SIGHUP: the terminal (or SSH connection) closed, and with it the run's output. The terminal
# signals the whole process group, as for Ctrl-C. (SIGQUIT, Ctrl-\, takes the same handler:
# test_every_stop_signal_requests_a_stop, below.)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=["ctrl-c", "sighup"])
def test_a_signal_stops_train_dp_cleanly_and_the_same_command_resumes_bit_identically(
    trained, corpus, cache_dir, tmp_path, signum
):
    run = {**FAULT_RUN, "max_steps": 64}  # ~20 ms a step here: room for the signal to land
    reference = trained(DP, **run)
    out = tmp_path / "out"
    # A DataLoader worker: the terminal's signal reaches it too, and it must keep serving.
    argv = cmd(corpus, cache_dir, out, **run, num_workers=1)
    proc = start(DP, argv)
    wait_for_step(out, 2, proc)
    os.killpg(proc.pid, signum)
    rc, output = finish(proc)

    assert rc == 128 + signum, output[-6000:]
    assert "Traceback" not in output, output[-6000:]
    step = assert_stopped_cleanly(output, out, run["max_steps"])
    assert_resumes_to(reference, DP, argv, 1, step, out)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup"])
def test_a_signal_to_torchrun_stops_every_ddp_rank_at_one_step_and_the_run_resumes(
    trained, corpus, cache_dir, tmp_path, signum
):
    reference = trained(DDP, world=2, **FAULT_RUN)
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out, **FAULT_RUN)
    proc = start(DDP, argv, world=2)
    wait_for_step(out, 2, proc)
    proc.send_signal(signum)  # to torchrun alone, as `kill` would: it signals its workers
    rc, output = finish(proc)

    # The workers exit with 128 + signum; torchrun, signalled itself, ends with a traceback of
    # its own (SignalException) and exit code 1, as it would without them.
    assert rc != 0, output[-6000:]
    got = f"got signal: {int(signum)}"
    assert output.count("Traceback") == output.count(got) == 1, output[-6000:]
    step = assert_stopped_cleanly(output, out, FAULT_RUN["max_steps"])
    assert_resumes_to(reference, DDP, argv, 2, step, out)


def test_sigterm_to_every_process_stops_fsdp_with_a_sharded_checkpoint_and_it_resumes(
    trained, corpus, cache_dir, tmp_path
):
    reference = trained(FSDP, world=2, **FAULT_RUN)
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out, **FAULT_RUN, num_workers=1)  # workers get it too
    proc = start(FSDP, argv, world=2)
    wait_for_step(out, 2, proc)
    # To torchrun and its workers at once, as Slurm signals a job step: each worker gets the
    # signal twice (torchrun passes it on), and must take the echo for the same request.
    os.killpg(proc.pid, signal.SIGTERM)
    rc, output = finish(proc)

    assert rc != 0, output[-6000:]
    assert output.count("Traceback") == output.count("got signal: 15") == 1, output[-6000:]
    step = assert_stopped_cleanly(output, out, FAULT_RUN["max_steps"], sharded=True)
    assert (out / "checkpoints" / f"step_{step:07d}" / "train_state.pt").is_file()
    assert_resumes_to(reference, FSDP, argv, 2, step, out)


def test_every_stop_signal_requests_a_stop(capfd):
    handlers = {signum: signal.getsignal(signum) for signum in exits.STOP_SIGNALS}
    assert {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT} <= set(handlers)
    try:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
            request = loop.StopRequest(torch.device("cpu"))
            assert request.all_reduce() == 0
            os.kill(os.getpid(), signum)  # the handler runs before the next line
            assert request.all_reduce() == signum
            assert f"{signal.Signals(signum).name} received" in capfd.readouterr().err
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def test_a_second_signal_stops_at_once_but_an_echo_of_the_first_does_not(monkeypatch):
    handlers = {signum: signal.getsignal(signum) for signum in exits.STOP_SIGNALS}
    try:
        request = loop.StopRequest(torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs before the next line
        assert request.all_reduce() == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGUSR1)  # torchrun's echo, milliseconds later: ignored
        monkeypatch.setattr(loop, "ECHO_SECONDS", 0.0)  # as if seconds had passed
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(1)  # (the handler interrupts this)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def test_a_process_that_joined_a_process_group_ends_with_os_exit_after_its_atexit_handlers(
    monkeypatch,
):
    # exits.end_process: no interpreter teardown for C++ objects of torch.distributed to abort.
    calls = []
    monkeypatch.setattr(exits.atexit, "_run_exitfuncs", lambda: calls.append("atexit"))
    monkeypatch.setattr(exits.os, "_exit", calls.append)
    exits.run(lambda: None, os_exit=True)  # as every lesson that joins a process group

    def refused():
        raise ValueError("bad input")

    with pytest.raises(SystemExit):  # (os._exit is a stand-in here, so run() goes on)
        exits.run(refused, os_exit=True)
    assert calls == ["atexit", 0, "atexit", 2]


def say_as_rank(rank: int, monkeypatch, capsys, store) -> str:
    """exits.run of a main() that meets bad input, as global rank `rank` of a torchrun run
    whose store is `store` (None: none yet); its stderr."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr(exits, "failure_store", [] if store is None else [store])

    def fails():
        raise ValueError("bad input")

    with pytest.raises(SystemExit) as exit_:
        exits.run(fails)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_a_failure_every_rank_meets_is_said_once_by_rank_0_and_no_rank_exits_before_it(
    monkeypatch, capsys
):
    # torchrun stops every worker once one exits with an error: rank 1 leaving first could stop
    # rank 0 before its line is out (seen in CI: no "error:" line at all). So rank 1 waits for it.
    store = torch.distributed.HashStore()
    said = threading.Timer(1.0, lambda: store.set("failure_said", "1"))  # a slow rank 0
    said.start()
    started = time.monotonic()
    assert say_as_rank(1, monkeypatch, capsys, store) == ""
    assert time.monotonic() - started >= 0.9  # it waited for rank 0, and said nothing itself
    said.join()

    store = torch.distributed.HashStore()
    assert say_as_rank(0, monkeypatch, capsys, store) == "error: bad input\n"
    assert store.check(["failure_said"])  # what the others wait for


def test_a_failure_rank_0_does_not_meet_is_said_by_the_rank_that_met_it(monkeypatch, capsys):
    monkeypatch.setattr(exits, "FAILURE_WAIT", 0.5)
    err = say_as_rank(3, monkeypatch, capsys, torch.distributed.HashStore())
    assert err == "rank 3: error: bad input\n"


def test_without_a_store_a_rank_speaks_for_itself_unless_torchrun_runs_it(monkeypatch, capsys):
    # Before its store exists, torchrun's rank 0 says what all ranks met (a bad flag); a rank
    # that no torchrun launched (RANK set by hand, or left over) has no one to say it for it.
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert say_as_rank(1, monkeypatch, capsys, None) == "rank 1: error: bad input\n"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert say_as_rank(1, monkeypatch, capsys, None) == ""
    assert say_as_rank(0, monkeypatch, capsys, None) == "error: bad input\n"


def test_out_of_memory_ends_in_one_line_and_any_other_error_in_a_traceback(capsys):
    def raises(error: BaseException):
        def main():
            raise error

        return main

    gpu = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nand more")
    for main, said in [
        (raises(gpu), "CUDA out of memory. Tried to allocate 2.00 GiB."),
        # The CPU allocator's own error: 2**58 bytes, more than any 64-bit address space.
        (lambda: torch.empty(2**56), f"you tried to allocate {2**58} bytes"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            exits.run(main)
        assert exit_.value.code == 1
        advice = "(a smaller --micro-batch-size or model needs less)"
        assert capsys.readouterr().err == f"error: out of memory: {said} {advice}\n"
    with pytest.raises(SystemExit) as exit_:
        exits.run(raises(RuntimeError("a bug")))  # which keeps its traceback
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith("RuntimeError: a bug\n"), err


def test_a_rank_whose_peer_was_killed_says_so_in_one_line_and_saves_nothing(
    corpus, cache_dir, tmp_path
):
    # torchrun answers a dead worker with SIGTERM to the others; the survivor must not claim a
    # checkpoint it cannot make (its next collective fails): one line, no traceback of its own.
    out = tmp_path / "out"
    proc = start(DDP, cmd(corpus, cache_dir, out, **{**FAULT_RUN, "max_steps": 400}), world=2)
    wait_for_step(out, 2, proc)
    saved = checkpoints_in(out)
    os.kill(worker_pid(proc, rank=1), signal.SIGKILL)
    rc, output = finish(proc)

    assert rc != 0
    assert "another process of this run ended" in output, output[-6000:]
    assert "with a checkpoint" not in output and not STOPPED.search(output), output[-6000:]
    # torchrun's own ChildFailedError report is its only traceback.
    assert output.count("Traceback") <= 1, output[-6000:]
    assert checkpoints_in(out) == saved, "a checkpoint was written after the peer died"


def checkpoints_in(out) -> list[str]:
    return sorted(os.listdir(out / "checkpoints")) if (out / "checkpoints").exists() else []


# A second Ctrl-C while a checkpoint is written: stopped at once, whatever is being written.


def test_a_second_ctrl_c_inside_dcp_save_ends_in_one_line_with_exit_130(capsys):
    # dcp.save wraps the KeyboardInterrupt of its write in a CheckpointException with an empty
    # message (once: an IndexError in save_failed, a traceback).
    from torch.distributed.checkpoint.api import CheckpointException

    def main():
        raise CheckpointException("", {0: (KeyboardInterrupt(), None)})

    with pytest.raises(SystemExit) as exit_:
        exits.run(main)
    assert exit_.value.code == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted: stopped at once") and "Traceback" not in err, err


def test_a_write_that_fails_without_a_message_is_said_in_one_line():
    from lib.checkpoints.out_dir import save_failed

    error = save_failed("out/checkpoints/step_0000001", RuntimeError(""))
    assert "could not save the checkpoint out/checkpoints/step_0000001: RuntimeError" in str(error)


def test_a_second_ctrl_c_on_rank_0_tells_the_waiting_ranks_at_once(monkeypatch, capsys):
    # A rank blocked in a collective with rank 0 fails as rank 0 ends, and waits for its word
    # (say_once) before saying anything itself: rank 0 must give it (once: ~30 s, then SIGKILL).
    store = torch.distributed.HashStore()
    monkeypatch.setattr(exits, "failure_store", [store])
    monkeypatch.setenv("RANK", "0")

    def main():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_:
        exits.run(main)
    assert exit_.value.code == 130
    assert store.check(["failure_said"])
    assert "interrupted" in capsys.readouterr().err


def test_a_ctrl_c_during_a_write_leaves_no_temporary_file(tmp_path):
    from lib.checkpoints.files import atomic_save

    def write(obj, f):
        f.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_save(None, str(tmp_path / "model.pt"), write)
    assert os.listdir(tmp_path) == []
