"""A Llama decoder written by hand, small enough to read in one sitting, and its initial weights.

Llama 2/3's architecture: token embeddings -> N x [RMSNorm -> grouped-query attention with rotary
position embeddings -> residual -> RMSNorm -> SwiGLU MLP (num_local_experts > 0: Mixtral's mixture
of experts, lib/extras/moe.py) -> residual] -> RMSNorm -> lm_head. Names follow Meta's code (`wq
wk wv wo`, `w1 w2 w3`, `attention_norm`, `ffn_norm`), LlamaConfig Hugging Face's config.json,
RoPE its `rotate_half` layout: weights map 1:1. No training or distributed code: strategies wrap
or shard it.

    model = LlamaForPretraining(LlamaConfig.from_preset("tiny", vocab_size=4096))
    logits = model(input_ids)                              # (B, T, vocab_size)
    loss_sum, num_tokens = model(input_ids, targets)       # summed loss, and how many targets count
    logits = model(next_ids, kv_caches=caches)  # KV-cache decoding (lib/extras/sampling.py)
"""

import functools
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

IGNORE_INDEX = -100  # targets the loss ignores (padding): F.cross_entropy's default


# -------------------------------------------------------------------------------------------------
# Configuration


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008  # width of the SwiGLU MLP
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32  # < num_attention_heads means grouped-query attention
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False  # share the embedding matrix with lm_head
    # Llama 3.1+'s long-context RoPE, config.json's {"rope_type": "llama3", ...}; None: plain RoPE.
    rope_scaling: dict | None = None
    # Mixtral's mixture of experts (moe.MoEFeedForward; 0: the dense MLP): a router sends each token
    # to num_experts_per_tok of num_local_experts, and coef x the balance loss joins the loss.
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001  # transformers' MixtralConfig default
    # The sha256 of the tokenizer the weights were trained with (data.tokenizer_digest): a
    # finished run's config.json has it, and whatever loads the model checks its tokenizer.json.
    tokenizer_sha256: str | None = None

    def __post_init__(self) -> None:
        d, nh, kv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        E, k, coef = self.num_local_experts, self.num_experts_per_tok, self.router_aux_loss_coef
        if d % nh:
            raise ValueError(f"hidden_size {d} is not divisible by num_attention_heads {nh}")
        if nh % kv:
            raise ValueError(
                f"num_attention_heads {nh} is not divisible by num_key_value_heads {kv}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if not is_integer(E) or E < 0:
            raise ValueError(f"num_local_experts {E!r} must be an integer >= 0 (0: the dense MLP)")
        if E > 0 and not (is_integer(k) and 1 <= k <= E):
            raise ValueError(
                f"num_experts_per_tok {k!r} must be an integer from 1 to "
                f"num_local_experts ({E}): each token goes to that many different "
                f"experts"
            )
        number = is_integer(coef) or isinstance(coef, float)
        if not (number and math.isfinite(coef) and coef >= 0):
            raise ValueError(f"router_aux_loss_coef {coef!r} must be a finite number >= 0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "LlamaConfig":
        """A named size; `overrides` replace fields (typically vocab_size, from the tokenizer)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        """The fields (`LlamaConfig(**c.to_dict())` round-trips), less the MoE fields of a dense
        model and a tokenizer fingerprint of None: its files are as before either existed."""
        config = {f.name: getattr(self, f.name) for f in fields(self)}
        if all(config[name] == getattr(LlamaConfig, name) for name in MOE_FIELDS):
            for name in MOE_FIELDS:
                del config[name]
        if config["tokenizer_sha256"] is None:
            del config["tokenizer_sha256"]
        return config


# LlamaConfig's fields for a mixture of experts, left out of a dense model's to_dict().
MOE_FIELDS = ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef")


def is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int in Python


# `tiny` trains visibly in minutes on a laptop CPU; `small` ~ GPT-2 124M, `medium` ~ 350M, `1b` ~
# Llama 3.2 1B, 7b-70b Llama 2's (memory planning). vocab_size: the tokenizer's (32000: Llama 2's).
PRESETS: dict[str, dict] = {
    name: dict(vocab_size=vocab, hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=context,
               **extra)
    for name, (vocab, d, ffn, layers, heads, kv, context, extra) in {
        #          vocab   hidden  ffn    layers heads kv  context
        "tiny":   (4096,   192,    512,   4,     6,    2,  1024, {}),
        "small":  (32000,  768,    2048,  12,    12,   12, 2048, {}),
        "medium": (32000,  1024,   2816,  24,    16,   16, 2048, {}),
        "1b":     (32000,  2048,   8192,  16,    32,   8,  4096,
                   dict(rope_theta=500000.0, tie_word_embeddings=True)),
        "7b":     (32000,  4096,   11008, 32,    32,   32, 4096, {}),
        "13b":    (32000,  5120,   13824, 40,    40,   40, 4096, {}),
        "70b":    (32000,  8192,   28672, 80,    64,   8,  4096, {}),
    }.items()
}  # fmt: skip


def count_parameters(config: LlamaConfig, experts: int | None = None) -> int:
    """Parameter count from the shapes alone (70b would not fit in memory); experts: how many of
    each MoE layer's to count (default all)."""
    d, kv_dim = config.hidden_size, config.num_key_value_heads * config.head_dim
    attention = d * d + 2 * d * kv_dim + d * d  # wq, wk + wv (grouped), wo
    mlp = 3 * d * config.intermediate_size  # w1, w2, w3 (of one expert, if there are experts)
    if config.num_local_experts:
        router = d * config.num_local_experts  # gate
        mlp = router + (config.num_local_experts if experts is None else experts) * mlp
    norms = 2 * d  # attention_norm, ffn_norm
    embeddings = config.vocab_size * d
    lm_head = 0 if config.tie_word_embeddings else config.vocab_size * d
    return embeddings + config.num_hidden_layers * (attention + mlp + norms) + d + lm_head


def count_active_parameters(config: LlamaConfig) -> int:
    """The parameters one token's forward uses (FLOPs per token, MFU): each MoE layer's router
    and num_experts_per_tok of its experts; count_parameters for a dense model."""
    return count_parameters(config, experts=config.num_experts_per_tok)


# -------------------------------------------------------------------------------------------------
# Rotary position embeddings (RoPE)


def rope_cos_sin(config: LlamaConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (max_position_embeddings, head_dim), in float32; channels i and i +
    head_dim/2 rotate as one pair (Hugging Face's `rotate_half` layout, not Meta's neighbours),
    and sin's first half is negated: apply_rope's swap of the halves then rotates."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, device=device).float() / dim))
    if config.rope_scaling is not None:
        inv_freq = llama3_rope_frequencies(inv_freq, config.rope_scaling)
    positions = torch.arange(config.max_position_embeddings, device=device).float()
    angles = torch.outer(positions, inv_freq)  # (T, dim/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, dim): both halves of a pair turn together
    sin = angles.sin()
    sin[:, : dim // 2] *= -1  # rotate_half's minus sign, in the table once
    return angles.cos(), sin


def llama3_rope_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's RoPE for long contexts: frequencies whose wavelength is longer than the
    original context / low_freq_factor are slowed down by `factor`; those shorter than original
    context / high_freq_factor stay; those between are blended linearly in 1/wavelength."""
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise ValueError(f"rope_scaling {scaling}: only rope_type 'llama3' is implemented")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    blend = ((context / wavelength - low) / (high - low)).clamp(0, 1)  # 0: slow, 1: unchanged
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, head_dim) by position: a query at m and a key at n so rotated have a
    dot product that depends only on m - n. Hugging Face's x * cos + rotate_half(x) * sin bit for
    bit, rotate_half's cat(-x2, x1) as one roll and the minus sign in the sin table."""
    return x * cos.to(x.dtype) + x.roll(x.size(-1) // 2, -1) * sin.to(x.dtype)


# -------------------------------------------------------------------------------------------------
# The decoder


class KVCache:
    """One layer's keys and values so far, preallocated: a decoding step writes one slot."""

    def __init__(self, batch_size, num_kv_heads, max_length, head_dim, device, dtype):
        shape = (batch_size, num_kv_heads, max_length, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # how many positions are filled

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, kv_heads, T, head_dim); return everything cached so far."""
        start, end = self.length, self.length + k.size(2)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


# FlexAttention (--document-mask's BlockMask) is only fast compiled (eagerly: the whole (T, T)
# scores), so compiled on first use; in a layer --compile compiles, the plain one joins its graph.
@functools.cache
def compiled_flex_attention():
    return torch.compile(flex_attention)


def fused_flex_attention(q, k, v, block_mask: BlockMask, enable_gqa: bool) -> torch.Tensor:
    """flex_attention(q, k, v) with a BlockMask, one fused kernel. CUDA only: on a CPU without
    AVX-512, torch 2.13's compiled kernel is wrong; no silent fallback to a dense (T, T) mask."""
    if q.device.type != "cuda":
        raise ValueError(
            f"FlexAttention runs on CUDA only, not on {q.device.type} (on CPU, torch "
            f"2.13 computes it wrongly without AVX-512): pass the dense mask "
            f"masks.create_causal_mask(T) + masks.create_document_mask(ids) instead "
            f"of a BlockMask"
        )
    attend = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
    return attend(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        d = config.hidden_size
        self.wq = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.num_heads * self.head_dim, d, bias=False)

    def forward(self, x, cos, sin, attn_mask=None, cache: KVCache | None = None):
        B, T, _ = x.shape
        hd = self.head_dim
        # The head counts come from the projections' outputs, not the config: under tensor
        # parallelism wq/wk/wv are split by columns, and a rank computes nh / tp and nkv / tp.
        q = self.wq(x).view(B, T, -1, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.wk(x).view(B, T, -1, hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.wv(x).view(B, T, -1, hd).transpose(1, 2)  # (B, nkv, T, hd)
        nh, nkv = q.size(1), k.size(1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v)  # (B, nkv, S, hd) with S = all positions so far
        # Grouped-query attention: `enable_gqa` shares a k/v head among nh/nkv query heads, no copy.
        if isinstance(attn_mask, BlockMask):  # --document-mask by FlexAttention: no (T, T) mask
            y = fused_flex_attention(q, k, v, attn_mask, enable_gqa=nkv != nh)  # (B, nh, T, hd)
        elif callable(attn_mask):  # context parallelism's: keys and values from other ranks too
            y = attn_mask(q, k, v, enable_gqa=nkv != nh)  # (B, nh, T, hd)
        else:
            if attn_mask is not None and attn_mask.dtype != torch.bool:
                attn_mask = attn_mask.to(q.dtype)  # SDPA wants an additive mask in q's dtype
            # No mask: `is_causal=True` lets SDPA pick its fastest kernel (flash attention on GPU)
            # with no (T, T) mask; a single decoding step (T == 1) attends to the whole cache.
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                is_causal=attn_mask is None and T > 1,
                enable_gqa=nkv != nh,
            )  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, nh * hd)  # (B, T, nh * hd)
        return self.wo(y)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + feed_forward(norm(.)), dense or MoE."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.num_local_experts > 0:
            from lib.extras.moe import (
                MoEFeedForward,  # here: a dense model never loads lib/extras/moe.py
            )

            self.feed_forward = MoEFeedForward(config)
        else:
            self.feed_forward = FeedForward(config)

    def forward(self, x, cos, sin, attn_mask=None, cache=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, attn_mask, cache)
        return x + self.feed_forward(self.ffn_norm(x))


class LlamaForPretraining(nn.Module):
    def __init__(self, config: LlamaConfig, seed: int | None = None):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        # Not parameters and not saved (persistent=False): they are a pure function of the config.
        cos, sin = rope_cos_sin(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.rope_cos.is_meta:  # built on the meta device: shapes only, nothing to fill
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Fill every parameter (initial_weight) and buffer (reset_buffers), as the constructor does
        or once a meta-device model has storage (to_empty); seed None: drawn from torch's RNG."""
        seed = int(torch.randint(2**62, ())) if seed is None else seed
        reset_buffers(self, self.config)
        for name, param in self.named_parameters():
            param.copy_(initial_weight(self.config, name, param.shape, seed, param.device))

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        attn_mask: torch.Tensor | BlockMask | Callable | None = None,
        kv_caches: list[KVCache] | None = None,
        position_ids: torch.Tensor | None = None,
        scores: bool = False,
    ):
        """input_ids (B, T) -> the logits (B, T, vocab); with targets (B, T), (loss_sum,
        num_tokens): the cross-entropy summed over targets that are not IGNORE_INDEX (padding), and
        their number. The caller divides by the *whole* global batch's count, so the gradient is
        the same however the batch is split (and nn.DataParallel gathers two scalars per replica).
        A mixture of experts in training adds coef x each sequence's balance loss x its targets.

        attn_mask: None (plain causal, the fast path); a masks.py mask for SDPA (causal included,
        broadcasting to (B, heads, T, T)); a FlexAttention BlockMask (CUDA); or attend(q, k, v,
        enable_gqa) -> (B, heads, T, head_dim), as lib/parallel/context_parallel.py passes it.
        position_ids: RoPE positions, (T,) or (B, T); None: 0..T-1 after a KV cache's tokens (CP
        passes those of its slice).
        scores: with targets, row_scores of each row instead of the loss (evaluation's tasks).
        """
        B, T = input_ids.shape
        start = kv_caches[0].length if kv_caches is not None else 0
        if start + T > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence of {start + T} tokens exceeds max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )
        if kv_caches is not None and start > 0 and T > 1:
            raise ValueError("with a KV cache, feed the prompt once, then one token per step")
        if position_ids is None:
            cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]  # (T, hd)
        else:  # (1 or B, 1, T, hd): broadcast over the heads
            cos, sin = (t[position_ids].unsqueeze(-3) for t in (self.rope_cos, self.rope_sin))

        # A mixture of experts keeps its routing for the balance loss in a training forward only
        # (not when activation checkpointing recomputes a layer: this forward switched it off).
        experts = [layer.feed_forward for layer in self.layers if self.config.num_local_experts]
        balance = self.training and targets is not None and bool(experts)
        for moe in experts:
            moe.record_routing, moe.routing = balance, None

        x = self.tok_embeddings(input_ids)  # (B, T, d)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn_mask, kv_caches[i] if kv_caches is not None else None)
        if targets is None:
            return self.lm_head(self.norm(x))  # (B, T, vocab)
        if scores:
            return row_scores(self.lm_head(self.norm(x)), targets)  # (B, 2)
        loss_sum, num_tokens = self.loss(x, targets)
        if balance:
            from lib.extras.moe import balance_loss_sum

            aux_sum = balance_loss_sum(experts, targets != IGNORE_INDEX)
            loss_sum = loss_sum + self.config.router_aux_loss_coef * aux_sum
        return loss_sum, num_tokens

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss_sum, num_tokens) of the last hidden states x (B, T, d): final norm, lm_head and
        cross-entropy; a method of its own for --compile to fuse (training.compile_layers)."""
        logits = self.lm_head(self.norm(x))  # (B, T, vocab)
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )  # logits (B*T, vocab) against targets (B*T,)
        num_tokens = (targets != IGNORE_INDEX).sum()
        return loss_sum, num_tokens


def row_scores(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, 2) for logits (B, T, vocab) against targets (B, T): per row, the log-likelihood of its
    targets that are not IGNORE_INDEX, summed (in fp32), and how many of them are not the greedy
    choice: a zero-shot task's row (lib/extras/training_tasks.py) targets a continuation alone.
    Both are sums, so the slices of a row on several ranks (CP) add up to the row's. A target
    is greedy when its log-probability is the largest (a tie counts, where argmax takes the
    first), so nothing indexes the vocabulary: under TP's loss_parallel, logits sharded over it,
    log_softmax and nll_loss run on the shards, the max is reduced over them, and full_tensor()
    makes the results whole."""
    B, T = targets.shape
    log_probs = logits.float().log_softmax(-1)  # (B, T, vocab)
    picked = -F.nll_loss(
        log_probs.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )  # (B*T,): each target's log-probability, 0 where ignored
    best = log_probs.amax(-1).flatten()  # (B*T,)
    picked, best = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (picked, best))
    misses = (targets.flatten() != IGNORE_INDEX) & (picked < best)  # (B*T,)
    return torch.stack([picked.view(B, T).sum(-1), misses.view(B, T).sum(-1).float()], dim=1)


# -------------------------------------------------------------------------------------------------
# Initial weights, the same however the model is split


def initial_weight(config: LlamaConfig, name: str, shape, seed: int, device=None) -> torch.Tensor:
    """The initial value of parameter `name` (as LlamaForPretraining names it), whole, from a
    generator seeded by `seed` and the name: the same weights however the model is built (whole, or
    on the meta device and sharded, each rank drawing every parameter whole and keeping its slice).
    GPT-2's recipe: N(0, 0.02), the projections into the residual stream (wo, w2, experts' too)
    scaled by 1/sqrt(2 * layers) to keep its variance with depth; RMSNorm weights start at one."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    std = 0.02
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w2")):
        std /= math.sqrt(2 * config.num_hidden_layers)
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    generator = torch.Generator(device or "cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


@torch.no_grad()
def reset_buffers(module: nn.Module, config: LlamaConfig) -> None:
    """The buffers of `module` (a model, or a part of one) anew: the RoPE tables, a function of
    the config, and a mixture of experts' routing statistics, zeroed."""
    for sub in module.modules():
        if hasattr(sub, "rope_cos"):
            sub.rope_cos, sub.rope_sin = rope_cos_sin(config, sub.rope_cos.device)
        if hasattr(sub, "reset_router_stats"):
            sub.reset_router_stats()
