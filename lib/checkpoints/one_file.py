"""TEMPORARY adapter (replaced by the checkpoint package's own): the interface over the old code."""

import torch.distributed as dist

from lib import distributed, training
from lib.checkpoints import TrainingState, prepare_out_dir, resume, save_checkpoint

__all__ = ["Checkpoints", "TrainingState"]


class Checkpoints:
    def __init__(self, args):
        self.args = args
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0

    def _rank0(self, fn, *args):
        if dist.is_initialized():
            return distributed.from_rank0(fn, self.is_main, *args)
        return fn(*args)

    def prepare_out_dir(self):
        return self._rank0(prepare_out_dir, self.args)

    def resume(self, path, state):
        return resume(path, state, self.args)

    def save(self, step, state, position):
        self._rank0(save_checkpoint, self.args, step, state, position)

    def finish(self, state, device):
        s = state
        self._rank0(training.finish_run, self.args, s.model, s.config, s.tokenizer, device)
