"""Muon (--optimizer muon): orthogonalised momentum for the decoder's matrices, AdamW for the rest.

Muon (Keller Jordan, 2024; torch.optim.Muon) keeps a momentum of each weight matrix's gradient,
and steps along that momentum "orthogonalised": Newton-Schulz iterations push every singular
value of the update towards 1, so that no direction of the matrix dominates the step. It is for
the hidden matrices: the attention's wq, wk, wv, wo and the MLP's w1, w2, w3 (each expert's too).
The embedding, lm_head, the norms and a mixture of experts' router stay with AdamW.

    optimizer = build_optimizer(model, args, device_type)  # (lib/training.py's, for muon)

Why sharding matters: Newton-Schulz multiplies the whole matrix by its transpose, so each step
needs the whole update, not a rank's rows of it. `orthogonalized` is written once for every
lesson, and does what each layout needs (docs/optimizers.md: what each costs):
  - one process, DDP, ZeRO-1, the pipeline's stages: every matrix this rank updates is whole;
  - FSDP (and HSDP, CP): each rank holds rows of every matrix, a DTensor: the update is
    all-gathered (full_tensor), orthogonalised on every rank, and each keeps its own rows. The
    same for TP's column and row shards, and both at once (2-D DTensors);
  - a mixture of experts: the experts' weights are stacked (E, ., .), and EP and FSDP split them
    along E, so a rank holds whole experts' matrices: each is orthogonalised where it is, with no
    traffic. Gathering is needed only where a shard cuts across a matrix.
Every layout thus computes exactly the one-process update (tests/test_muon.py).
"""

import math

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

# Newton-Schulz's quintic coefficients and steps, and the momentum: torch.optim.Muon's defaults
# (from Keller Jordan's implementation).
NS_COEFFICIENTS, NS_STEPS, MOMENTUM, EPS = (3.4445, -4.7750, 2.0315), 5, 0.95, 1e-7


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """Whether Muon updates this parameter: a decoder layer's attention or MLP matrix (a
    mixture of experts' stacked (E, out, in) ones included), not its router, norms, the
    embedding or lm_head."""
    return ".attention.w" in name or (".feed_forward.w" in name and param.dim() >= 2)


class MuonWithAdamW(torch.optim.AdamW):
    """AdamW, whose param groups with "muon": True take Muon's step instead (their "lr" is then
    Muon's). One optimizer, so that every lesson's loop, schedule and checkpoints, and ZeRO-1's
    ZeroRedundancyOptimizer (which builds this class on each rank's share of the groups), see the
    usual API; its state holds AdamW's moments for the one kind, Muon's momentum for the other."""

    def __init__(self, params, **adamw):
        super().__init__(params, **adamw)
        for group in self.param_groups:
            group.setdefault("muon", False)

    @torch.no_grad()
    def step(self, closure=None):
        every = self.param_groups
        self.param_groups = [g for g in every if not g["muon"]]  # AdamW's own step: its groups
        try:
            loss = super().step(closure)
        finally:
            self.param_groups = every
        for group in every:
            if group["muon"]:
                self.muon_step(group)
        return loss

    def muon_step(self, group: dict) -> None:
        """Muon's update of one group: momentum, Nesterov's look-ahead, Newton-Schulz, then
        decoupled weight decay and the step, its lr scaled for the matrix's shape."""
        lr, decay = group["lr"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:  # (and a step count, as AdamW keeps one)
                state["momentum_buffer"] = torch.zeros_like(p.grad)
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.grad.device)
            state["step"] += 1
            buffer = state["momentum_buffer"]  # an average of the gradients, as torch's
            buffer.lerp_(p.grad, 1 - MOMENTUM)
            update = p.grad.lerp(buffer, MOMENTUM)  # Nesterov's look-ahead
            # Keller Jordan's scale: a tall matrix's orthogonalised update has smaller entries.
            rows, cols = p.shape[-2:]
            scale = math.sqrt(max(1.0, rows / cols))
            local = p.to_local() if isinstance(p, DTensor) else p
            local.mul_(1 - lr * decay)
            local.add_(orthogonalized(update).to(local.dtype), alpha=-lr * scale)


def orthogonalized(update: torch.Tensor) -> torch.Tensor:
    """Newton-Schulz of `update`, each matrix of its last two dimensions; for a DTensor, the
    part this rank holds (see the module's docstring for what each layout costs)."""
    if not isinstance(update, DTensor):
        return newton_schulz(update)
    matrix_dims = (update.dim() - 2, update.dim() - 1)
    if not any(isinstance(p, Shard) and p.dim in matrix_dims for p in update.placements):
        return newton_schulz(update.to_local())  # whole matrices here (experts split along E)
    whole = newton_schulz(update.full_tensor())  # an all-gather: every rank the whole matrix
    # This rank's part, as init_weights slices: no traffic (src_data_rank=None).
    mesh, placements = update.device_mesh, update.placements
    return distribute_tensor(whole, mesh, placements, src_data_rank=None).to_local()


def newton_schulz(g: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Five quintic Newton-Schulz iterations on each matrix of g (..., rows, cols), as
    torch.optim.Muon computes them (the same operations, addmm's fused multiply-adds included):
    the singular values pushed to about 1, the singular vectors kept. In bf16 on a GPU
    (torch.optim.Muon's choice: fast, and Muon is robust to it), in fp32 elsewhere (a CPU's bf16
    matmuls are slow, and the tests compare layouts closely)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype or (torch.bfloat16 if g.is_cuda else torch.float32))
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:  # torch.optim.Muon's own steps
        x = x / x.norm().clamp(min=EPS)  # spectral norm at most 1
        for _ in range(NS_STEPS):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:  # a stack of matrices (experts), each as above: batched
        shape, x = x.shape, x.reshape(-1, *x.shape[-2:])
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=EPS)
        for _ in range(NS_STEPS):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        x = x.reshape(shape)
    return x.mT if tall else x
