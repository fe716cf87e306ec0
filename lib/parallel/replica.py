"""What nn.DataParallel copies onto each GPU in train_dp.py (and tools/bench.py,
tools/profile_step.py)."""

import torch
import torch.nn as nn

from lib.training import autocast


class Replica(nn.Module):
    """What DataParallel copies onto each GPU: the model's forward, under autocast, with the loss.

    DataParallel runs each replica in a thread of its own, and autocast's state is per thread, so
    autocast is entered here, inside the replica. The loss is computed here too: each replica
    returns its loss sum and token count (two numbers) instead of its logits, because gathering
    every replica's (batch, T, vocab) logits onto GPU 0 is the classic recipe's memory hot spot.
    """

    def __init__(self, model: nn.Module, device: torch.device, precision: str):
        super().__init__()
        self.model, self.device, self.precision = model, device, precision

    def forward(self, x, y, attn_mask=None, scores: bool = False):
        with autocast(self.device, self.precision):
            if scores:  # --eval-tasks: (rows, 2), each row's (model.row_scores), concatenated
                return self.model(x, y, attn_mask, scores=True)
            loss_sum, num_tokens = self.model(x, y, attn_mask)
        return loss_sum[None], num_tokens[None]  # (1,) each: DataParallel concatenates them
