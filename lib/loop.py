"""What every lesson's loop does around its step, written once: the start-up summary, the progress
bar, the non-finite guard and, after each step, the log, evaluation, checkpoint and stop on signals.

    loop = TrainingLoop(args, settings, state, device, start_step)
    for step in loop:                                   # the progress bar; steps count from 0
        ...                                             # the lesson's own step
        if loop.step_ok(step, step_loss, grad_norm):    # the non-finite guard
            optimizer.step()
        ...
        loop.after_step(step, loss, grad_norm, evaluate, save)  # log, evaluate, save, stop

A lesson's `evaluate()` returns the validation sums (loss, targets, bytes: its collectives are
its own), `save(step)` writes a checkpoint (.pt from rank 0, or DCP shards from every rank).
Every rank takes the same decisions at the same step, so no collective is ever left waiting."""

import contextlib
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from lib.checkpoints.files import CHECKPOINT_DIR_RE, finish_in_flight, list_checkpoints
from lib.checkpoints.out_dir import TrainingState, record_run
from lib.exits import STOP_SIGNALS, Stopped, TrainingError
from lib.flags import MAX_SKIPPED_IN_A_ROW, describe_run
from lib.metrics import Metrics, Throughput, bar_postfix, build_memory, router_figures


class TrainingLoop:
    """The steps from `start_step` to --max-steps, and what runs around each of them."""

    def __init__(
        self,
        args,
        settings,
        state: TrainingState,
        device,
        start_step: int,
        layout=None,
        description: str | None = None,
    ):
        """state: what the lesson trains; layout: how its ranks are arranged (a strategy module's
        Layout, for --plan; None: every rank, or DataParallel's GPU, one data-parallel replica),
        described at start-up by `description` (the strategy module's describe(layout))."""
        config = state.config
        self.args, self.model, self.optimizer = args, state.model, state.optimizer
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0
        self.ledger = None  # --comm-ledger: the collectives of one step (lib/extras/comm_ledger.py)
        if getattr(args, "comm_ledger", False):
            from lib.extras import comm_ledger

            if problem := comm_ledger.refusal(args, start_step):  # (a resumed run: its own)
                raise TrainingError(problem)
            self.ledger = comm_ledger.StepLedger(args.out_dir, start_step, layout, self.is_main)
        # The GPUs (or processes) a step runs on, for MFU: every rank's, or DataParallel's.
        devices = dist.get_world_size() if dist.is_initialized() else settings.devices
        self.metrics = Metrics(args.out_dir, self.is_main, start_step, args.tensorboard)
        if self.is_main:
            print(describe_run(args, settings, config, device))
            if description is not None:
                print(f"parallelism: {description}")
            # --optimizer muon (under ZeRO-1, the wrapper's optim is this rank's share of it)
            muon_optimizer = getattr(state.optimizer, "optim", state.optimizer)
            if hasattr(muon_optimizer, "describe_newton_schulz"):
                zero = state.optimizer if muon_optimizer is not state.optimizer else None
                print(muon_optimizer.describe_newton_schulz(zero))
            print(build_memory(state.model, device))
            record_run(args, settings, start_step)  # OUT_DIR/args.jsonl: the settings
            if args.plan:  # lib/extras/memory.py: only for --plan
                from lib.extras import memory
                from lib.parallel.layout import Layout

                layout = layout or Layout(world_size=devices, dp=devices)
                print(memory.estimate_for_run(args, settings, config, layout))
        # The learning rates to name if the loss goes NaN: Muon's first, when it runs.
        rates = "--muon-lr or --lr" if getattr(args, "optimizer", None) == "muon" else "--lr"
        self.guard = NonFiniteGuard(device, skip=args.skip_nonfinite, rates=rates)
        self.throughput = Throughput(config, args, device, devices)  # tokens/s, MFU, ...
        self.stop_request = StopRequest(device)  # Ctrl-C, SIGTERM, ...: stop cleanly (see there)
        self.bar = tqdm(
            range(start_step, args.max_steps),
            initial=start_step,
            total=args.max_steps,
            desc="train",
            disable=not self.is_main,
        )
        self.lr, self.muon_lr, self.stopping = 0.0, None, False
        self.task_results = None  # --eval-tasks: the tasks' figures from evaluate()'s rows
        if getattr(args, "eval_tasks", None):
            from lib.extras import training_tasks

            self.task_results = training_tasks.Results(args, state.tokenizer)

    def __iter__(self):
        for step in self.bar:
            groups = self.optimizer.param_groups
            # This step's, logged after it. --optimizer muon: the group Muon steps (first, see
            # training.build_optimizer) has its own lr; AdamW's groups share --lr's schedule.
            self.lr = next(g["lr"] for g in groups if not g.get("muon"))
            self.muon_lr = next((g["lr"] for g in groups if g.get("muon")), None)
            if self.ledger is not None:
                self.ledger.start(step)
            yield step
        self.stop_request.finish()

    def step_ok(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
        """The non-finite guard (NonFiniteGuard) for the step's loss and gradient norm (None:
        not checked); False: skip the step's update (--skip-nonfinite)."""
        return self.guard.step_ok(step + 1, loss, grad_norm)

    def after_step(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, evaluate, save
    ) -> None:
        """After the optimizer step, on every rank alike:
        1. a stop requested by a signal on any rank is agreed on by all (a collective);
        2. a NaN/inf since the last check stops the run before any log, evaluation or save;
        3. every --log-interval steps, loss, lr, throughput, gradient norm (GPU reads: only then);
        4. every --eval-interval steps evaluate(), every --save-interval steps (and at a stop) save;
        5. at a stop, Stopped, which exits.run reports (exit code 128 + the signal).
        The last step logs, evaluates and saves whatever the intervals. (--comm-ledger: the
        step it records ends here, before all of these.)"""
        if self.ledger is not None:
            self.ledger.finish(step)
        self.throughput.step()
        done = step + 1
        last = done == self.args.max_steps
        stop = self.stop_request.all_reduce() and not last
        intervals = (self.args.log_interval, self.args.eval_interval, self.args.save_interval)
        do_log, do_eval, do_save = (done % interval == 0 or last for interval in intervals)
        do_save = do_save or stop  # saved once, if this step saves anyway
        self.stopping = stop or last  # its checkpoint is the run's last one (written at once)
        if do_log or do_eval or do_save:
            self.guard.check(self.args.out_dir)
        if do_log:
            value = loss.item()
            figures = self.throughput.figures()
            self.bar.set_postfix(bar_postfix(value, self.lr, figures))
            # A mixture of experts' routing, summed over the ranks (a collective); {} if dense.
            self.metrics.log(
                step=done,
                loss=value,
                lr=self.lr,
                **({} if self.muon_lr is None else {"muon_lr": self.muon_lr}),
                **figures,
                grad_norm=grad_norm.item(),
                **router_figures(self.model),
            )
        if do_eval:
            totals = evaluate()  # (a lesson's evaluate's sums; with --eval-tasks, its rows')
            loss_sum, targets, text_bytes = totals[:3].tolist()
            bits_per_byte = loss_sum / math.log(2) / text_bytes if text_bytes else math.nan
            tasks = self.task_results(totals[3:]) if self.task_results else {}
            self.metrics.log_validation(done, loss_sum / targets, bits_per_byte, tasks)
            self.throughput.restart()  # keep evaluation time out of the tokens/s figure
        if stop and self.is_main:  # every rank has it: all stop after this step, and save it
            name = signal.Signals(self.stop_request.signal).name
            tqdm.write(f"{name}: stopping after step {done}, with a checkpoint")
        if do_save:
            save(done)
            self.throughput.restart()
        if stop:
            raise Stopped(done, self.stop_request.signal)  # exits.run says so and exits


# -------------------------------------------------------------------------------------------------
# The non-finite guard


class NonFiniteGuard:
    """Notices the first step whose loss (or gradient norm) is NaN or infinite, recorded on the
    device with no wait for the GPU; the next check, before the loop logs, evaluates or saves,
    stops the run naming the step, so the last checkpoint stays the last good state. With
    --skip-nonfinite such a step's update is skipped instead (each step then waits for the GPU
    once), but MAX_SKIPPED_IN_A_ROW in a row stop it: a run that stays broken would "train" on."""

    MAX_SKIPPED_IN_A_ROW = MAX_SKIPPED_IN_A_ROW  # (lib/flags.py: --skip-nonfinite's help)

    def __init__(self, device: torch.device, skip: bool, rates: str = "--lr"):
        """rates: the learning-rate flags a message suggests lowering."""
        self.skip, self.rates = skip, rates
        self.first_bad_step = torch.zeros((), dtype=torch.long, device=device)  # 0: none yet
        self.skipped_in_a_row = 0

    def step_ok(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
        """Record step's loss and gradient norm (None: not checked); False: skip its update."""
        finite = torch.isfinite(loss)
        if grad_norm is not None:
            finite &= torch.isfinite(grad_norm)
        if self.skip:
            if bool(finite):
                self.skipped_in_a_row = 0
                return True
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row == self.MAX_SKIPPED_IN_A_ROW:
                raise TrainingError(
                    f"the loss or the gradient was NaN/infinite at "
                    f"{self.skipped_in_a_row} steps in a row "
                    f"({step - self.skipped_in_a_row + 1} to {step}): the run is "
                    f"not recovering, so it stopped (--skip-nonfinite skipped "
                    f"their updates, so nothing saved holds NaN/inf). Try a lower "
                    f"{self.rates} or --grad-clip."
                )
            print(
                f"warning: step {step} has a non-finite loss or gradient; its update is skipped",
                file=sys.stderr,
            )
            return False
        first = (self.first_bad_step == 0) & ~finite
        self.first_bad_step = torch.where(first, step, self.first_bad_step)
        return True

    def check(self, out_dir: str) -> None:
        if step := int(self.first_bad_step):
            # A save in flight (--async-save) holds the state before the bad step: complete it
            # (every rank meets this check alike), else the run may end with no checkpoint.
            finish_in_flight()
            saved = list_checkpoints(out_dir) + list_checkpoints(out_dir, CHECKPOINT_DIR_RE)
            kept = (
                f"the checkpoints in {out_dir} are the last good ones"
                if saved
                else "no checkpoint had been saved yet"
            )
            raise TrainingError(
                f"the loss or the gradient became NaN/infinite at step {step}; "
                f"stopped before saving anything from that state ({kept}). Try "
                f"a lower {self.rates}, --grad-clip, or --skip-nonfinite to skip such "
                f"steps."
            )


# -------------------------------------------------------------------------------------------------
# A clean stop on a signal (exits.STOP_SIGNALS: Ctrl-C, SIGTERM, Slurm's SIGUSR1, ...)

# torchrun passes its signals on to its workers, which a terminal's Ctrl-C (or Slurm) reached
# already: a repeat within this many seconds is that echo, not a second request.
ECHO_SECONDS = 2.0


class StopRequest:
    """A STOP_SIGNALS signal stops the run after the step in flight, with a checkpoint, on every
    rank at the same step: ranks receive it at different moments (or only some do), and one leaving
    alone would leave the others waiting forever. So every rank all-reduces (MAX) its signal after
    each step, read a step later (no wait). Again: KeyboardInterrupt at once (files stay whole)."""

    def __init__(self, device: torch.device):
        self.signal = 0  # the signal all ranks agreed to stop on (0: none)
        self._received, self._received_at = 0, 0.0  # this process's first signal, and when
        self._distributed = dist.is_initialized() and dist.get_world_size() > 1
        self._flag = torch.zeros((), dtype=torch.int64, device=device)
        # On a GPU the result is copied to pinned host memory behind the all-reduce, an event
        # marking that point; on CPU, gloo's threads run it while the next step computes.
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
                raise KeyboardInterrupt  # asked again: stop at once (exits.run says so)
            return
        self._received, self._received_at = signum, now
        if signum == signal.SIGHUP:  # the terminal is gone: what is written to it would fail
            for fd in (sys.stdout.fileno(), sys.stderr.fileno()):
                if os.isatty(fd):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
        if int(os.environ.get("RANK", "0")) == 0:
            # Received, not yet agreed: a rank whose peer died is told SIGTERM by torchrun too,
            # and fails in the next collective (exits.run says so) instead of saving.
            note = (
                f"\n{signal.Signals(signum).name} received (the same signal again stops at "
                f"once, without saving)\n"
            )
            # os.write, not print: a handler may run in the middle of a print to stderr.
            with contextlib.suppress(OSError):
                os.write(sys.stderr.fileno(), note.encode())

    def all_reduce(self) -> int:
        """A collective every rank calls after every step: the signal to stop on after it, the same
        on all ranks (the MAX of those received; one process: its own, no collective); 0: go on."""
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
        """After the last step, before the process group goes: wait for the all-reduce left in
        flight, whose handle would otherwise outlive the group and can abort the process at
        exit (gloo: "terminate called without an active exception")."""
        if self._wait is not None:
            self._wait()
            self._wait = None
