"""A Mixtral-style mixture of experts: the MLP that --num-experts puts in every decoder layer.

    mlp = MoEFeedForward(config)            # config.num_local_experts > 0 (a model.LlamaConfig)
    y = mlp(x)                              # x (B, T, d): each token through k of E experts
    figures = router_figures(model)         # the balance loss and tokens per expert, and reset

model.py builds it in place of the dense FeedForward (and imports this file only then: copying a
lesson for a dense model needs no lib/extras/moe.py) and adds the load-balancing loss
(balance_loss_sum) to the loss it returns; lib/metrics.py logs router_figures where this file is
loaded. The checks of the expert flags are here too (check_expert_flags, and NO_EXPERTS: which
lessons cannot train experts). No training or distributed code: expert parallelism
(lib/parallel/expert_parallel.py) sets the `dispatch` of each layer to its all-to-all, which calls
run_experts on the tokens a rank receives.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class MoEFeedForward(nn.Module):
    """Mixtral's sparse mixture of experts, dropless: each token goes to num_experts_per_tok of
    num_local_experts SwiGLU experts, and its output is their outputs weighted by the router.

    Routing (Mixtral's): a linear router `gate` scores the experts, softmax over them in fp32,
    the top k kept and their probabilities renormalised to sum to 1. Dropless: no capacity
    factor, every token reaches all k of its experts however many others chose the same ones,
    so a token's output never depends on which other tokens share its batch, and any split of
    the batch over micro-batches and ranks computes the same thing.

    The experts' weights are stacked, expert first: w1 and w3 (E, ffn, d), w2 (E, d, ffn), the
    names of FeedForward's w1 (gate), w3 (up) and w2 (down). Expert parallelism shards dim 0
    over ranks: `dispatch` then sends each expert's tokens to the rank that holds it, which
    calls run_experts on them with its own experts, and brings the outputs back.

    While training (record_routing, set by LlamaForPretraining.forward for a training forward
    with targets), the routing is kept in `routing` for the load-balancing loss, and the
    statistics since the last router_stats() call accumulate in the buffers below (not saved).
    """

    def __init__(self, config):
        super().__init__()
        E, d, ffn = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.num_experts_per_tok = config.num_experts_per_tok
        self.gate = nn.Linear(d, E, bias=False)  # the router: one score per expert
        self.w1 = nn.Parameter(torch.empty(E, ffn, d))  # gate projections
        self.w3 = nn.Parameter(torch.empty(E, ffn, d))  # up projections
        self.w2 = nn.Parameter(torch.empty(E, d, ffn))  # down projections
        # Expert parallelism (lib/parallel/expert_parallel.py) sets this to a function like
        # run_experts that sends the tokens to the ranks holding their experts and brings the
        # outputs back.
        self.dispatch: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None
        self.record_routing = False
        self.routing: tuple[torch.Tensor, torch.Tensor] | None = None  # (probs, experts)
        # Logging (router_stats): (token, slot) assignments per expert, and the balance loss
        # summed over sequences weighted by their targets, with that weight. Not in state_dict.
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.long), False)
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)
        self.register_buffer("aux_loss_tokens", torch.zeros((), dtype=torch.long), False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, d) -> router probabilities (N, E) in fp32, and each token's k experts (N, k)
        with their weights (N, k), which sum to 1."""
        probs = self.gate(x).float().softmax(dim=-1)  # (N, E)
        weights, experts = probs.topk(self.num_experts_per_tok, dim=-1)  # (N, k) each
        weights = weights / weights.sum(dim=-1, keepdim=True)  # renormalised, as Mixtral does
        return probs, weights, experts

    def run_experts(
        self,
        x: torch.Tensor,
        counts: list[int],
        weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The experts' SwiGLU on tokens grouped by expert: x (M, d) holds counts[0] tokens for
        the first expert of w1/w2/w3, then counts[1] for the second, ...; returns (M, d) in the
        same order. One matmul per expert over all of its tokens (an expert with none costs an
        empty matmul, and every expert stays in the autograd graph, as DDP wants).
        weights: the (w1, w2, w3) of the experts that counts counts, stacked as this module's;
        default this module's own (expert parallelism passes the shards this rank holds)."""
        w1s, w2s, w3s = (self.w1, self.w2, self.w3) if weights is None else weights
        outputs = [
            F.linear(F.silu(F.linear(tokens, w1)) * F.linear(tokens, w3), w2)  # (count, d)
            for tokens, w1, w3, w2 in zip(x.split(counts), w1s, w3s, w2s, strict=True)
        ]
        return torch.cat(outputs)  # (M, d)

    # Never compiled (--compile compiles the rest of each layer around it): its split sizes are
    # read on the host every step, and compiled, in bf16 on an H200 with torch 2.11, it trained
    # wrong (a loss 143% off the fp32 run's; eager it stays within 3%: tests/gpu).
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        E, k = self.w1.size(0), self.num_experts_per_tok
        tokens = x.reshape(B * T, d)  # (N, d), N = B * T
        probs, weights, experts = self.route(tokens)  # (N, E), (N, k), (N, k)
        if self.record_routing:
            self.routing = (probs.view(B, T, E), experts.view(B, T, k))
        # Each token makes k (token, slot) pairs; sorted by expert (stable: in token order within
        # an expert), each expert's tokens are one contiguous block for run_experts.
        expert_of_pair = experts.flatten()  # (N * k,) pair j is token j // k's slot j % k
        order = expert_of_pair.argsort(stable=True)  # (N * k,) pairs, by expert
        counts = torch.bincount(expert_of_pair, minlength=E).tolist()  # split sizes: a sync
        run = self.run_experts if self.dispatch is None else self.dispatch
        y = run(tokens[order // k], counts)  # (N * k, d), sorted by expert
        y = torch.empty_like(y).index_copy(0, order, y)  # (N * k, d), back in pair order
        # Each token's output: its k experts' outputs, weighted (in fp32, as the router); summed
        # into a new (B, T, d) tensor, not a view (FSDP2 warns of a wrapped module's view output).
        out = (y.view(B, T, k, d) * weights.view(B, T, k, 1)).sum(dim=2)  # (B, T, d)
        return out.to(x.dtype)

    @torch.no_grad()
    @torch.no_grad()
    def reset_router_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.aux_loss_sum.zero_()
        self.aux_loss_tokens.zero_()


def sequence_balance_loss(
    probs: torch.Tensor, experts: torch.Tensor, counted: torch.Tensor
) -> torch.Tensor:
    """The load-balancing loss of one MoE layer for each sequence: (B,).

    Switch Transformer's E * sum_i f_i * P_i, in Mixtral's form (transformers'
    load_balancing_loss_func): f_i is the number of (token, slot) assignments to expert i per
    token (summing to k over the experts), P_i the mean router probability of expert i. It is
    k when the load is perfectly even, and reaches E when the router puts all its probability
    on one expert that every token takes. Its gradient reaches the router through P alone.

    Per sequence (DeepSeek-V3's sequence-wise balance loss): f and P are over each sequence's
    own tokens, so a sequence's loss does not depend on the others in its batch, and any split
    of the global batch over micro-batches and ranks gives the same loss. (transformers'
    Mixtral computes it once over the whole batch it is given, all layers pooled.)

    probs (B, T, E) the router's probabilities; experts (B, T, k) the chosen experts; counted
    (B, T) bool: the tokens that count (those with a target). A sequence with none gives 0.
    """
    E = probs.size(-1)
    assigned = F.one_hot(experts, E).sum(dim=2)  # (B, T, E): 1 where a slot chose the expert
    counted = counted.unsqueeze(-1)  # (B, T, 1)
    num_counted = counted.sum(dim=1).clamp(min=1)  # (B, 1)
    f = (assigned * counted).sum(dim=1) / num_counted  # (B, E), sums to k
    P = (probs * counted).sum(dim=1) / num_counted  # (B, E), sums to 1
    return E * (f * P).sum(dim=-1)  # (B,)


def balance_loss_sum(experts: list[MoEFeedForward], counted: torch.Tensor) -> torch.Tensor:
    """Sum over the MoE layers `experts` (just run) and the sequences of each sequence's
    balance loss x its number of targets; also adds to each layer's router_stats. counted (B, T)
    bool: the tokens that have a target."""
    num_counted = counted.sum(dim=1)  # (B,)
    total = torch.zeros((), device=counted.device)
    for moe in experts:
        probs, chosen = moe.routing  # (B, T, E), (B, T, k)
        moe.record_routing, moe.routing = False, None
        layer_sum = (sequence_balance_loss(probs, chosen, counted) * num_counted).sum()
        total = total + layer_sum
        with torch.no_grad():  # on the device, no sync: router_stats reads them
            moe.tokens_per_expert.index_add_(0, chosen.flatten(), torch.ones_like(chosen.flatten()))
            moe.aux_loss_sum += layer_sum.detach().to(moe.aux_loss_sum.dtype)
            moe.aux_loss_tokens += num_counted.sum()
    return total


def router_stats(model: nn.Module) -> dict:
    """The routing of a mixture of experts since the last call, and reset: {} for a dense model.

    {"aux_loss": the balance loss over the training forwards since then (sum over layers of the
     target-weighted mean over sequences, so that loss = cross-entropy + router_aux_loss_coef x
     aux_loss; None if none ran), "aux_loss_per_layer": [one per MoE layer],
     "tokens_per_expert": [[(token, slot) assignments of each expert] for each MoE layer]}.

    Counted in training forwards with targets only, as buffers on the device, so reading them
    here is the only host sync. `model` may be wrapped (DDP, FSDP, ...): each process counts
    its own batches (all-reduce for global figures); under nn.DataParallel, the first GPU's.
    """
    moes = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if not moes:
        return {}
    counts = torch.stack([m.tokens_per_expert for m in moes]).tolist()  # (layers, E)
    sums = torch.stack([m.aux_loss_sum.float() for m in moes]).tolist()
    tokens = torch.stack([m.aux_loss_tokens for m in moes]).tolist()
    for m in moes:
        m.reset_router_stats()
    per_layer = [s / n if n else None for s, n in zip(sums, tokens, strict=True)]
    aux = None if None in per_layer else sum(per_layer)
    return {"aux_loss": aux, "aux_loss_per_layer": per_layer, "tokens_per_expert": counts}


def router_figures(model: nn.Module, group=None) -> dict:
    """A mixture of experts' routing since the last call, over the global batch, for
    metrics.log: {"aux_loss": the load-balancing loss as moe.router_stats gives it (sum over
    the MoE layers of the target-weighted mean over sequences), "tokens_per_expert": [[the
    (token, slot) assignments of each expert] for each MoE layer]}; {} for a dense model.

    Each rank counts its own micro-batches (moe.router_stats' buffers, on the device); they
    are summed over the data-parallel ranks of `group` (default: every rank) with one
    all-reduce before router_stats reads and resets them, so aux_loss is the global batch's
    (each rank's sums and target counts added, not its means averaged) and each layer's
    tokens_per_expert adds up to the tokens of the steps since the last call (padding included)
    x experts_per_token. A collective: every rank calls it, at the same steps. `model` may be
    wrapped (DDP, FSDP: their buffers are not sharded); under nn.DataParallel over several
    GPUs, what the first GPU's share of each batch routed.
    """
    moes = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if not moes:
        return {}
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        buffers = ("tokens_per_expert", "aux_loss_sum", "aux_loss_tokens")
        counts = [getattr(m, name) for m in moes for name in buffers]
        # One message: float64 adds the integer counts exactly (below 2^53).
        summed = torch.cat([t.double().flatten() for t in counts])
        dist.all_reduce(summed, group=group)
        for t, total in zip(counts, summed.split([t.numel() for t in counts]), strict=True):
            t.copy_(total.view_as(t))
    stats = router_stats(model)
    return {"aux_loss": stats["aux_loss"], "tokens_per_expert": stats["tokens_per_expert"]}


# -------------------------------------------------------------------------------------------------
# The expert flags (model_config.EXPERT_FLAGS), checked


def check_expert_flags(given: dict, config: dict) -> None:
    """ValueError naming the expert flags (`given`: those on the command line) that do not fit
    `config` (the preset's fields, every flag applied). Without experts (0 is a number of them:
    the dense MLP), the other two flags mean nothing and are refused rather than ignored."""
    experts, k = config["num_local_experts"], config["num_experts_per_tok"]
    if not experts:
        pointless = [f"--{n.replace('_', '-')}" for n in given if n != "num_experts"]
        if pointless:
            said = "--num-experts 0" if "num_experts" in given else "no --num-experts (dense)"
            raise ValueError(
                f"{' and '.join(pointless)} shape a mixture of experts, and with {said} there is "
                f"none: give --num-experts N (N >= 1) too, or leave them out"
            )
    elif k > experts:
        default = "" if "experts_per_token" in given else " (the default)"
        raise ValueError(
            f"--experts-per-token {k}{default} is more than --num-experts {experts}: each token "
            f"goes to that many different experts; give --experts-per-token {experts} or fewer"
        )


# The lessons that cannot train a mixture of experts (--num-experts, or an --init-from of one),
# and why: model_config.refuse_experts says so at flag-check time.
NO_EXPERTS = {
    "train_tp.py": "its plan splits the dense MLP's Linear layers (w1, w2, w3), which a mixture "
    "of experts replaces by a router and stacked experts",
    "train_pp.py": "its stages do not compute the experts' load-balancing loss",
    "train_cp.py": "it splits every sequence over ranks, and a sequence's load-balancing loss "
    "needs the whole sequence",
}


def cannot_train(script: str, args, experts: int) -> str:
    """Why `script`, one of NO_EXPERTS, refuses this run's mixture of `experts` experts."""
    given = (
        f"--num-experts {experts}"
        if args.init_from is None
        else f"--init-from {args.init_from}, with {experts} experts"
    )
    return (
        f"{script} cannot train a mixture of experts ({given}): {NO_EXPERTS[script]}. "
        f"Train it with train_dp.py, train_ddp.py, train_zero1.py or train_fsdp.py, or with "
        f"expert parallelism: train_ep.py --ep N"
    )
