"""Attention masks: causal, padding and document (for packed sequences).

Every dense mask here is *additive*: a float tensor of 0 where a query may attend to a key and
-inf where it may not, added to the attention scores before the softmax. Each function encodes
one rule, and rules combine by addition, as in the classic DataParallel/DDP Llama recipe:

    mask = create_causal_mask(T, device) + create_padding_mask(input_ids, pad_id, device)
    logits = model(input_ids, attn_mask=mask)

Shapes: scores are (B, heads, T_query, T_key), so masks are (1 or B, 1, T, T) and broadcast over
the batch and head dimensions.

The one trap: a query row whose keys are *all* -inf makes softmax compute 0/0 = NaN, and one NaN
poisons the whole batch through the backward pass. It happens with left padding (the first pad
query may see only padding keys). Here a query is always allowed to attend to itself, in every
rule, so no row of any sum of these masks can be fully blocked. Real tokens never attend to padding
anyway; what a padding query computes is thrown away by the loss.

When no mask is needed at all (unpadded causal training), pass none: the model then calls SDPA with
`is_causal=True`, which is what lets flash attention run on GPU.

A dense (B, 1, T, T) mask costs T^2 memory per sequence and rules out flash attention. For the
document mask there is a sparse alternative for GPUs, FlexAttention's BlockMask
(`create_document_block_mask`): the same rule written as a function of (query, key) positions,
from which PyTorch records which blocks of 128 x 128 positions are blocked entirely (skipped),
fully allowed, or mixed.
"""

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


def create_causal_mask(seq_len: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """(1, 1, T, T): query i may attend to keys 0..i."""
    blocked = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(diagonal=1)
    return _additive(blocked, dtype)[None, None]  # (T, T) -> (1, 1, T, T)


def create_padding_mask(input_ids: torch.Tensor, pad_id: int, device=None, dtype=torch.float32):
    """(B, 1, T, T): no query attends to a padding key, except a padding query to itself."""
    input_ids = input_ids.to(device) if device is not None else input_ids
    T = input_ids.size(1)
    is_pad_key = (input_ids == pad_id)[:, None, :]  # (B, 1, T): the key side
    is_self = torch.eye(T, dtype=torch.bool, device=input_ids.device)[None]  # (1, T, T)
    blocked = is_pad_key & ~is_self  # (B, T, T)
    return _additive(blocked, dtype)[:, None]  # (B, 1, T, T)


def create_document_mask(document_ids: torch.Tensor, device=None, dtype=torch.float32):
    """(B, 1, T, T): a query attends only to keys of its own document.

    document_ids (B, T) numbers the documents inside each packed row; see `document_ids`. Combine
    with the causal mask. A token is always in its own document, so the diagonal stays open.
    """
    document_ids = document_ids.to(device) if device is not None else document_ids
    same_document = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T_q, T_k)
    return _additive(~same_document, dtype)[:, None]  # (B, 1, T, T)


def document_ids(input_ids: torch.Tensor, bot_id: int) -> torch.Tensor:
    """(B, T) document number of each token in packed rows, where every document starts with BOT.

    A row that starts in the middle of a document gives that partial document number 0.
    """
    return torch.cumsum(input_ids == bot_id, dim=1)


def document_mask_mod(document_ids: torch.Tensor):
    """FlexAttention's mask_mod for causal attention within documents: True = attend.

    The rule of create_causal_mask + create_document_mask, for one (batch, head, query, key)
    position at a time; document_ids (B, T) as `document_ids` returns them.
    """

    def causal_within_document(b, h, q_idx, kv_idx):
        same_document = document_ids[b, q_idx] == document_ids[b, kv_idx]
        return (q_idx >= kv_idx) & same_document

    return causal_within_document


def create_document_block_mask(document_ids: torch.Tensor) -> BlockMask:
    """A BlockMask of causal attention within documents, for model(..., attn_mask=...) on GPU.

    Building it evaluates the rule once for every (query, key) pair, one byte each, on
    document_ids' device (H=None: one mask for all heads); the model then runs flex_attention,
    which keeps no (T, T) tensor through forward and backward as SDPA's dense mask does.
    """
    B, T = document_ids.shape
    return create_block_mask(
        document_mask_mod(document_ids), B, None, T, T, device=document_ids.device
    )


def _additive(blocked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """True (blocked) -> -inf, False (allowed) -> 0."""
    return torch.zeros(blocked.shape, dtype=dtype, device=blocked.device).masked_fill(
        blocked, float("-inf")
    )


# -------------------------------------------------------------------------------------------------
# --document-mask in a run: which kernel runs it (lib/flags.py asks), and the mask of each batch
# (lib/training.py asks)


def resolve_attention(args, device: torch.device, replicas: int = 1, context_parallel=False) -> str:
    """The kernel that runs --document-mask: "flex" or "sdpa" (--attention auto chooses).

    replicas: how many GPUs nn.DataParallel splits each batch over (train_dp.py): it splits
    every tensor argument along the batch, but a BlockMask is no tensor, and each GPU would get
    the whole batch's mask, on GPU 0. context_parallel: train_cp.py, whose ranks attend with
    SDPA and build their own rows of the mask (lib/parallel/context_parallel.py).
    """
    if args.attention == "auto":
        flex = args.document_mask and device.type == "cuda" and replicas == 1
        return "flex" if flex and not context_parallel else "sdpa"
    if args.attention == "flex":
        if not args.document_mask:
            raise ValueError(
                "--attention flex runs the --document-mask; without that mask attention is plain "
                "causal and SDPA's flash kernel is already the fast path (drop --attention)"
            )
        if context_parallel:
            raise ValueError(
                "--attention flex is not supported under context parallelism: each rank runs "
                "SDPA with its own rows of the document mask; use --attention sdpa (or auto)"
            )
        if device.type != "cuda":
            raise ValueError(
                f"--attention flex needs a CUDA GPU: in torch {torch.__version__}, FlexAttention "
                f"has no backward pass on CPU; use --attention sdpa (or auto)"
            )
        if replicas > 1:
            raise ValueError(
                f"--attention flex cannot run under DataParallel over {replicas} GPUs (it splits "
                f"tensors over the GPUs, not a BlockMask); use train_ddp.py or --attention sdpa"
            )
    return args.attention


def document_masks(bot_id: int, attention: str):
    """mask(x): the document mask of a batch of packed tokens x (B, T), documents starting at
    bot_id: a BlockMask for attention "flex", else a dense (B, 1, T, T) additive mask."""

    def mask(x: torch.Tensor) -> torch.Tensor | BlockMask:
        doc_ids = document_ids(x, bot_id)  # (B, T)
        if attention == "flex":  # block-sparse: the model runs flex_attention
            return create_document_block_mask(doc_ids)
        return create_causal_mask(x.size(1), x.device) + create_document_mask(doc_ids)

    return mask
