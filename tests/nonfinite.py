"""Run a train script with the losses of chosen steps made NaN: a non-finite step, on any CPU.

    python tests/nonfinite.py 2 train_dp.py [flags]     # step 2's loss is NaN
    python -m torch.distributed.run --nproc_per_node=2 tests/nonfinite.py 2- train_ddp.py [flags]
                                                       # step 2's and every later step's

The tests of the non-finite guard need a step whose loss is not finite. An absurd learning rate
gives one only where a CPU's arithmetic happens to overflow (with AVX-512 kernels, --lr 1e4 first
overflowed at step 4, not 2), so the tests inject it instead (harness.run_script's nonfinite=):
in the chosen steps, every training forward's summed loss is multiplied by NaN, so the loss, and
through its backward every gradient, is NaN on every rank. The weights stay what the script made
them. Steps are counted by optimizer.zero_grad(), which every loop calls once, after its step.
"""

import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def poison(steps: str) -> None:
    """Patch the model so that the steps `steps` names ("N", or "N-": N and later) are NaN."""
    sys.path.insert(0, str(REPO))
    import model

    first, open_ended = int(steps.rstrip("-")), steps.endswith("-")
    done = 0  # optimizer steps taken so far: the loop is in step done + 1

    zero_grad = torch.optim.Optimizer.zero_grad

    def counting_zero_grad(self, *args, **kwargs):
        nonlocal done
        done += 1
        return zero_grad(self, *args, **kwargs)

    forward = model.LlamaForPretraining.forward

    def poisoned_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        step = done + 1
        if torch.is_grad_enabled() and (step == first or (open_ended and step >= first)):
            loss_sum, num_tokens = out
            return loss_sum * float("nan"), num_tokens
        return out

    torch.optim.Optimizer.zero_grad = counting_zero_grad
    model.LlamaForPretraining.forward = poisoned_forward


if __name__ == "__main__":
    steps, script, *argv = sys.argv[1:]
    poison(steps)
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")
