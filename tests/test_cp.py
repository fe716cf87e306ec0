"""Specification of context parallelism (train_cp.py, lib/parallel/context_parallel.py): splitting
every sequence over 2 ranks trains exactly like one process on the same global batch, with document
masks and padding, resumes bit for bit, and writes the same sharded checkpoints as train_fsdp.py.

The pieces are checked in-process first (the zigzag split; this rank's attention against the
whole sequence, with the all-gather emulated by stacking the ranks along the batch), then the
script is launched as a user would (torchrun, 2 gloo ranks on CPU) with the training tests'
settings (harness.py, conftest.py) and compared with train_dp.py with test_training.py's
tolerances: CP changes which rank computes which token, and adds the gradients of the keys and
values in another order, not the arithmetic. Measured on this corpus (fp32, against train_dp.py
with the same flags), --cp 2 on 2 ranks: --document-mask, weights within 1.1e-5, logged losses
2.1e-7 (relative), gradient norms 3.4e-6, validation losses 1.1e-7; pad mode with activation
checkpointing and 4 micro-batches, weights within 6.8e-6, losses 5.1e-7, gradient norms 3.5e-6.
By hand (4 processes are too slow for CI on 2 cores): --cp 2 on 4 ranks (dp 2 x cp 2), weights
within 1.2e-5 (--document-mask) and 7.5e-6 (pad mode), losses 1.2e-7 and 8.5e-7; --cp 4 on 4
ranks with --document-mask, weights within 5.2e-6; --cp 2 --compile on 2 ranks, weights within
1.5e-5 (the layers compile around the gather: one graph break per layer, no recompilation).
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from harness import (
    DP,
    assert_same_losses,
    assert_state_dicts_close,
    cmd,
    load_weights,
    run_script,
)
from test_bad_input import assert_refused
from test_fsdp import (
    FSDP,
    assert_resumes_bit_identically,
    copy_sharded_checkpoint,
)

import masks
from lib import flags
from lib.parallel.context_parallel import (
    attend_to_sequence,
    chunk_masks,
    in_sequence_order,
    zigzag_positions,
    zigzag_slice,
)
from masks import create_causal_mask, create_document_mask, document_ids

CP = "train_cp.py"
BOT = 1  # a token id that starts a document, for the masks of the in-process tests

# -------------------------------------------------------------------------------------------------
# The zigzag split


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_the_ranks_slices_cover_every_position_once_and_come_back_in_order(cp):
    T = 24
    sequence = torch.arange(T)[None]  # (1, T): each token is its position
    slices = [zigzag_slice(sequence, r, cp) for r in range(cp)]
    for r, piece in enumerate(slices):
        assert torch.equal(piece[0], zigzag_positions(T, r, cp))
    assert sorted(torch.cat(slices, dim=1)[0].tolist()) == list(range(T))
    # in_sequence_order takes them stacked, in rank order, as the all-gather returns them.
    stacked = torch.stack([piece[..., None] for piece in slices])  # (cp, 1, T / cp, 1)
    assert torch.equal(in_sequence_order(stacked)[..., 0], sequence)


def test_rank_r_holds_chunks_r_and_2cp_minus_1_minus_r():
    # --cp 2, 8 tokens in 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert zigzag_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 1, 2).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("cp", [2, 4])
def test_every_rank_has_the_same_causal_attention_work(cp):
    # The token at position p attends to p + 1 keys: the zigzag split balances the sums.
    work = [(zigzag_positions(64, r, cp) + 1).sum().item() for r in range(cp)]
    assert len(set(work)) == 1, work


# -------------------------------------------------------------------------------------------------
# Attention of a rank's queries to the whole sequence, and the model on a rank's slice


def packed_tokens(B: int, T: int, vocab: int) -> torch.Tensor:
    """Random tokens with documents starting (BOT) at a few positions, some mid-chunk."""
    x = torch.randint(BOT + 1, vocab, (B, T), generator=torch.Generator().manual_seed(0))
    x[0, [0, 5, 13]] = BOT
    x[-1, [9, 10, 30]] = BOT
    return x


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("document_mask", [False, True], ids=["causal", "document-mask"])
def test_each_ranks_attention_is_its_rows_of_full_causal_attention(cp, document_mask):
    B, nh, nkv, T, hd = 2, 6, 2, 36, 8  # grouped-query attention: 3 query heads per key head
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, T, hd, generator=gen, dtype=torch.float64) for n in (nh, nkv, nkv))
    doc_ids = document_ids(packed_tokens(B, T, 50), BOT) if document_mask else None
    mask = (
        (create_causal_mask(T) + create_document_mask(doc_ids)).double() if document_mask else None
    )
    full = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )
    for r in range(cp):
        rows = zigzag_positions(T, r, cp)
        masks = chunk_masks(T, r, cp, doc_ids)
        y = attend_to_sequence(q[:, :, rows], k, v, r, cp, masks, enable_gqa=True)
        torch.testing.assert_close(y, full[:, :, rows], atol=1e-12, rtol=0)


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("document_mask", [False, True], ids=["causal", "document-mask"])
def test_the_model_on_the_ranks_slices_gives_the_logits_of_the_whole_sequence(cp, document_mask):
    # The cp ranks emulated in one process: their slices stacked along the batch (cp * B rows),
    # each row with its own positions; the attention function views the stacked keys and values
    # as the all-gather returns them (cp, ...), and runs each rank's queries against them.
    model = tiny_model(vocab_size=50, context=64).double()
    B, T = 2, 36
    x = packed_tokens(B, T, 50)
    doc_ids = document_ids(x, BOT) if document_mask else None
    mask = (
        (create_causal_mask(T) + create_document_mask(doc_ids)).double() if document_mask else None
    )
    expected = model(x, attn_mask=mask)  # (B, T, vocab)

    def attend(q, k, v, enable_gqa):
        kv = torch.stack((k, v)).unflatten(1, (cp, B)).transpose(0, 1)  # (cp, 2, B, nkv, T/cp, hd)
        k_all, v_all = in_sequence_order(kv)  # (B, nkv, T, hd)
        ranks = q.split(B)  # (B, nh, T/cp, hd) each
        ys = [
            attend_to_sequence(q_r, k_all, v_all, r, cp, chunk_masks(T, r, cp, doc_ids), enable_gqa)
            for r, q_r in enumerate(ranks)
        ]
        return torch.cat(ys)

    slices = torch.cat([zigzag_slice(x, r, cp) for r in range(cp)])  # (cp * B, T / cp)
    positions = torch.cat([zigzag_positions(T, r, cp).expand(B, -1) for r in range(cp)])
    logits = model(slices, attn_mask=attend, position_ids=positions)
    want = torch.cat([zigzag_slice(expected, r, cp) for r in range(cp)])
    torch.testing.assert_close(logits, want, atol=1e-10, rtol=0)


# -------------------------------------------------------------------------------------------------
# Training: the same as one process


@pytest.fixture(scope="module")
def cp_run(shared_run, corpus, cache_dir):
    """--cp 2 on 2 ranks with --document-mask, packed rows (dp 1). Tests must not write into it."""
    flags = ["--cp", "2", "--document-mask", "--plan"]
    out, stdout = shared_run(CP, lambda o: cmd(corpus, cache_dir, o) + flags, world=2)
    assert "dp 1 x cp 2" in stdout, stdout
    assert "memory per GPU" in stdout, stdout  # --plan: tools/memory_plan.py's, with cp
    return out


@pytest.fixture(scope="module")
def dp_document_mask_run(shared_run, corpus, cache_dir):
    return shared_run(DP, lambda out: cmd(corpus, cache_dir, out) + ["--document-mask"])[0]


@pytest.mark.one_process
def test_cp2_with_document_masks_trains_like_one_process(cp_run, dp_document_mask_run):
    # Documents start anywhere in a row, so the mask crosses the chunks of both ranks.
    assert_state_dicts_close(load_weights(cp_run), load_weights(dp_document_mask_run))
    # The losses and the pre-clip gradient norm too: a gradient off by a constant factor (say,
    # the targets counted on both ranks of the group) would not show in the weights.
    assert_same_losses(cp_run, dp_document_mask_run)


@pytest.mark.one_process
def test_cp2_pads_checkpoints_accumulates_and_replicates_like_one_process(
    trained, corpus, cache_dir, tmp_path
):
    # Pad mode (rows of one document each, targets IGNORE_INDEX after it, so the ranks' slices
    # hold different numbers of targets) with plain causal attention; the recompute of
    # --activation-checkpointing gathers the keys and values again in backward; 4 micro-batches
    # per step accumulate the gradients of the gathered keys and values too. --replicate 2: the
    # FSDP side as HSDP (2 replicas of shard groups of 1 on 2 ranks; 2 x 2 with cp 2 on 4 ranks
    # is tools/parity.py's cp-hsdp, checked by hand: weights within 9.7e-6, losses 1.6e-7).
    out = tmp_path / "out"
    flags = ["--cp", "2", "--activation-checkpointing", "--micro-batch-size", "2"]
    proc = run_script(
        CP, cmd(corpus, cache_dir, out, data_mode="pad") + flags + ["--replicate", "2"], world=2
    )
    assert "; HSDP 2 x 1 (replicas x shard group)" in proc.stdout, proc.stdout
    reference = trained(DP, data_mode="pad")
    assert_state_dicts_close(load_weights(out), load_weights(reference))
    assert_same_losses(out, reference)


# -------------------------------------------------------------------------------------------------
# Resuming


@pytest.mark.resume
def test_cp_resume_is_bit_identical(cp_run, corpus, cache_dir, tmp_path):
    out = tmp_path / "resumed"
    argv = cmd(corpus, cache_dir, out) + ["--cp", "2", "--document-mask"]
    assert_resumes_bit_identically(CP, cp_run, out, argv, 2, tmp_path)


def test_a_cp_checkpoint_resumes_in_train_fsdp_on_one_rank(cp_run, corpus, cache_dir, tmp_path):
    # FSDP shards over all ranks under CP too: the same DCP directories as train_fsdp.py's.
    # Steps 5-8 then run unsplit, in one process: the tolerance, not equality.
    out = tmp_path / "resumed"
    copy_sharded_checkpoint(cp_run, 4, out)
    (out / "metrics.jsonl").write_text((cp_run / "metrics.jsonl").read_text())  # steps 1-4
    proc = run_script(FSDP, cmd(corpus, cache_dir, out) + ["--document-mask"], world=1)
    assert "at step 4" in proc.stdout
    assert_state_dicts_close(load_weights(out), load_weights(cp_run))
    assert_same_losses(out, cp_run)


# -------------------------------------------------------------------------------------------------
# Bad input


def test_cp_that_does_not_divide_the_ranks_is_refused_in_one_line(corpus, cache_dir, tmp_path):
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out) + ["--cp", "2"]  # one process
    assert_refused(CP, argv, "--cp 2 must divide the number of ranks (1)", out, cache_dir)
    assert not out.exists(), "nothing is written before the flags are checked"


def test_replicate_that_does_not_divide_the_ranks_is_refused_in_one_line(
    corpus, cache_dir, tmp_path
):
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out) + ["--cp", "1", "--replicate", "2"]  # one process
    assert_refused(CP, argv, "--replicate 2 must divide the number of ranks (1)", out, cache_dir)


def test_a_sequence_that_does_not_split_into_2_cp_chunks_is_refused(corpus, cache_dir, tmp_path):
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out, seq_length=31) + ["--cp", "1"]
    assert_refused(CP, argv, "--seq-length 31 must be divisible by 2 x --cp = 2", out, cache_dir)
    assert not out.exists()


def test_flex_attention_is_refused_and_auto_chooses_sdpa_under_context_parallelism(
    corpus, cache_dir
):
    parser = flags.build_parser("test")
    flex = parser.parse_args(
        cmd(corpus, cache_dir, "unused") + ["--document-mask", "--attention", "flex"]
    )
    with pytest.raises(ValueError, match="not supported under context parallelism"):
        masks.resolve_attention(flex, torch.device("cuda"), context_parallel=True)
    auto = parser.parse_args(cmd(corpus, cache_dir, "unused") + ["--document-mask"])
    assert masks.resolve_attention(auto, torch.device("cuda")) == "flex"  # precondition
    assert masks.resolve_attention(auto, torch.device("cuda"), context_parallel=True) == "sdpa"
