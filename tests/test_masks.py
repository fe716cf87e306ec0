"""Specifications for masks.py: additive attention masks that combine by addition."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from masks import (
    create_causal_mask,
    create_document_block_mask,
    create_document_mask,
    create_padding_mask,
    document_ids,
)

pytestmark = pytest.mark.quick  # the quick tier (`python -m pytest -m quick`)

PAD = 0
BOT = 1

# Rows of token ids (PAD = 0, BOT = 1) that exercise every way a row can be padded.
LEFT_PADDED = torch.tensor([[PAD, PAD, PAD, 5, 6, 7], [PAD, 4, 5, 6, 7, 8]])
RIGHT_PADDED = torch.tensor([[5, 6, 7, PAD, PAD, PAD], [4, 5, 6, 7, 8, PAD]])
ALL_PADDING = torch.tensor([[PAD] * 6, [5, 6, 7, 8, 9, 10]])
PACKED = torch.tensor([[7, 8, BOT, 4, 5, BOT], [BOT, 4, BOT, 5, 6, 7]])


def is_blocked(mask: torch.Tensor) -> torch.Tensor:
    return mask == float("-inf")


# -------------------------------------------------------------------------------------------------
# Shapes and values


def test_causal_mask_has_shape_1_1_T_T():
    assert create_causal_mask(5).shape == (1, 1, 5, 5)


def test_padding_mask_has_shape_B_1_T_T():
    assert create_padding_mask(RIGHT_PADDED, PAD).shape == (2, 1, 6, 6)


def test_document_mask_has_shape_B_1_T_T():
    assert create_document_mask(document_ids(PACKED, BOT)).shape == (2, 1, 6, 6)


def test_masks_broadcast_over_heads_when_added_to_scores():
    scores = torch.randn(2, 4, 6, 6)  # (B, heads, T, T)
    mask = create_causal_mask(6) + create_padding_mask(LEFT_PADDED, PAD)
    assert mask.shape == (2, 1, 6, 6)
    assert (scores + mask).shape == (2, 4, 6, 6)


@pytest.mark.parametrize(
    "mask",
    [
        create_causal_mask(6),
        create_padding_mask(LEFT_PADDED, PAD),
        create_document_mask(document_ids(PACKED, BOT)),
    ],
    ids=["causal", "padding", "document"],
)
def test_mask_values_are_exactly_zero_or_minus_infinity(mask):
    assert mask.dtype == torch.float32
    assert torch.all((mask == 0) | is_blocked(mask))
    assert (mask == 0).any() and is_blocked(mask).any()


def test_mask_dtype_follows_the_dtype_argument():
    mask = create_causal_mask(4, dtype=torch.bfloat16)
    assert mask.dtype == torch.bfloat16
    assert torch.equal(is_blocked(mask), is_blocked(create_causal_mask(4)))


# -------------------------------------------------------------------------------------------------
# What each rule blocks


def test_causal_mask_blocks_exactly_the_strict_upper_triangle():
    T = 7
    expected = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)
    assert torch.equal(is_blocked(create_causal_mask(T))[0, 0], expected)


@pytest.mark.parametrize(
    "input_ids", [LEFT_PADDED, RIGHT_PADDED, ALL_PADDING], ids=["left", "right", "all_padding_row"]
)
def test_padding_mask_blocks_padding_keys_except_on_the_diagonal(input_ids):
    mask = create_padding_mask(input_ids, PAD)
    B, T = input_ids.shape
    for b in range(B):
        for q in range(T):
            for k in range(T):
                expected = bool(input_ids[b, k] == PAD) and q != k
                assert bool(is_blocked(mask[b, 0, q, k])) == expected, (b, q, k)


def test_document_mask_blocks_exactly_the_cross_document_pairs():
    ids = document_ids(PACKED, BOT)
    mask = create_document_mask(ids)
    B, T = PACKED.shape
    for b in range(B):
        for q in range(T):
            for k in range(T):
                expected = bool(ids[b, q] != ids[b, k])
                assert bool(is_blocked(mask[b, 0, q, k])) == expected, (b, q, k)


def test_document_ids_count_the_bot_tokens_seen_so_far():
    expected = torch.cumsum(PACKED == BOT, dim=1)
    assert torch.equal(document_ids(PACKED, BOT), expected)
    assert document_ids(PACKED, BOT)[1].tolist() == [1, 1, 2, 2, 2, 2]


def test_a_row_starting_mid_document_gives_that_document_number_zero():
    assert document_ids(PACKED, BOT)[0].tolist() == [0, 0, 1, 1, 1, 2]


# -------------------------------------------------------------------------------------------------
# The trap: no query row may be blocked entirely (softmax would compute 0/0 = NaN)

CAUSAL = create_causal_mask(6)
MASKS_THAT_COULD_BLOCK_A_WHOLE_ROW = {
    "left_padding": create_padding_mask(LEFT_PADDED, PAD),
    "right_padding": create_padding_mask(RIGHT_PADDED, PAD),
    "all_padding_row": create_padding_mask(ALL_PADDING, PAD),
    "causal+left_padding": CAUSAL + create_padding_mask(LEFT_PADDED, PAD),
    "causal+right_padding": CAUSAL + create_padding_mask(RIGHT_PADDED, PAD),
    "causal+all_padding_row": CAUSAL + create_padding_mask(ALL_PADDING, PAD),
    "causal+document": CAUSAL + create_document_mask(document_ids(PACKED, BOT)),
    "causal+padding+document": CAUSAL
    + create_padding_mask(PACKED, 7)
    + create_document_mask(document_ids(PACKED, BOT)),
}


@pytest.mark.parametrize(
    "mask", MASKS_THAT_COULD_BLOCK_A_WHOLE_ROW.values(), ids=MASKS_THAT_COULD_BLOCK_A_WHOLE_ROW
)
def test_every_query_row_can_attend_to_at_least_one_key(mask):
    assert torch.all((mask == 0).any(dim=-1))


@pytest.mark.parametrize(
    "mask", MASKS_THAT_COULD_BLOCK_A_WHOLE_ROW.values(), ids=MASKS_THAT_COULD_BLOCK_A_WHOLE_ROW
)
def test_softmax_of_masked_scores_has_no_nan(mask):
    torch.manual_seed(0)
    scores = torch.randn(mask.size(0), 4, 6, 6)  # (B, heads, T, T)
    probs = (scores + mask).softmax(dim=-1)
    assert not torch.isnan(probs).any()
    assert torch.allclose(probs.sum(dim=-1), torch.ones(()))


def test_a_padding_query_in_left_padding_attends_only_to_itself():
    mask = CAUSAL + create_padding_mask(LEFT_PADDED, PAD)
    first_row = mask[0, 0, 0]  # the first pad query sees only padding keys, causally
    assert first_row[0] == 0 and is_blocked(first_row[1:]).all()


# -------------------------------------------------------------------------------------------------
# The BlockMask for FlexAttention: the same rule as causal + document, block-sparse


def packed_rows(T: int = 320, seed: int = 0) -> torch.Tensor:
    """(3, T) packed rows with documents of 1 to ~100 tokens; the first starts mid-document."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(2, 50, (3, T), generator=generator)
    starts = torch.rand(3, T, generator=generator) < 0.02
    starts[1, 0] = starts[2, 0] = True  # rows 1 and 2 start with a document; row 0 mid-way
    starts[2, 1] = True  # a one-token document
    rows[starts] = BOT
    return rows


def test_block_mask_rule_allows_exactly_what_the_dense_causal_document_mask_allows():
    ids = packed_rows()
    B, T = ids.shape
    block_mask = create_document_block_mask(document_ids(ids, BOT))
    # The BlockMask's own mask_mod, evaluated at every (query, key) pair.
    allowed = create_mask(block_mask.mask_mod, B, 1, T, T, device="cpu")  # (B, 1, T, T)
    dense = create_causal_mask(T) + create_document_mask(document_ids(ids, BOT))
    assert torch.equal(allowed, dense == 0)


def test_block_mask_skips_exactly_the_blocks_with_no_allowed_pair():
    ids = packed_rows()
    B, T = ids.shape
    block_mask = create_document_block_mask(document_ids(ids, BOT))
    q_block, kv_block = block_mask.BLOCK_SIZE
    allowed = create_causal_mask(T) + create_document_mask(document_ids(ids, BOT)) == 0
    # Pad (B, 1, T, T) to whole blocks, then ask of each block whether any pair in it is allowed.
    nq, nk = -(-T // q_block), -(-T // kv_block)
    padded = torch.zeros(B, 1, nq * q_block, nk * kv_block, dtype=torch.bool)
    padded[..., :T, :T] = allowed
    any_allowed = padded.view(B, 1, nq, q_block, nk, kv_block).any(dim=5).any(dim=3)  # (B,1,nq,nk)
    computed = block_mask.to_dense().bool()  # (B, 1, nq, nk): the blocks the kernel visits
    assert torch.equal(computed, any_allowed)
    below_diagonal = torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=-1)
    assert not computed[..., below_diagonal].all(), "the documents should skip blocks, too"
