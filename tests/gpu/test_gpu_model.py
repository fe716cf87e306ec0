"""GPU proof of the model's CUDA kernels: FlexAttention with the document BlockMask gives what
SDPA with the dense mask gives, forward and backward, bf16 autocast tracks fp32, and context
parallelism's attention (causal_lower_right, grouped-query) gives each rank's rows of full
attention.

Tolerance: both paths run in fp32 (no TF32: this suite never enables it), so they differ only in
summation order: the relative difference of logits and of every gradient, as a norm
(||a - b|| / ||b||), stays far under FP32_REL = 1e-5; TF32 matmuls would show as ~1e-3.
"""

import pytest
import torch
from conftest import tiny_model

import masks
from lib.parallel.context_parallel import attend_to_sequence, chunk_masks, zigzag_positions
from model import LlamaForPretraining

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FP32_REL = 1e-5
BOT = 1
T = 128


def random_model(seed: int) -> LlamaForPretraining:
    """conftest's tiny model (2 layers, 4 query and 2 key/value heads, every weight random and
    large), with heads of width 32: FlexAttention's kernels want at least 16."""
    return tiny_model(320, seed=seed, width=128, context=T, std=0.1).train().cuda()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def packed_batch(vocab_size: int, seed: int) -> torch.Tensor:
    """(3, T) random tokens with documents starting at random places; row 1 starts
    mid-document and holds a one-token document."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(3, vocab_size, (3, T), generator=generator)
    for row in range(3):
        starts = torch.randperm(T, generator=generator)[:5]
        x[row, starts] = BOT
    x[1, 0] = 5
    x[1, [60, 61]] = BOT
    return x.cuda()


def loss_and_grads(model, x, attn_mask):
    model.zero_grad(set_to_none=True)
    y = torch.roll(x, -1, dims=1)
    loss_sum, count = model(x, y, attn_mask)
    (loss_sum / count).backward()
    return model(x, attn_mask=attn_mask).detach(), {
        name: p.grad.detach().clone() for name, p in model.named_parameters()
    }


@pytest.mark.parametrize("seed", [0, 1])
def test_flex_attention_equals_sdpa_forward_and_backward_on_cuda(seed):
    model = random_model(seed)
    x = packed_batch(320, seed)
    doc_ids = masks.document_ids(x, BOT)
    dense = masks.create_causal_mask(x.size(1), x.device) + masks.create_document_mask(doc_ids)
    flex_logits, flex_grads = loss_and_grads(model, x, masks.create_document_block_mask(doc_ids))
    sdpa_logits, sdpa_grads = loss_and_grads(model, x, dense)
    assert relative(flex_logits, sdpa_logits) < FP32_REL
    for name, grad in sdpa_grads.items():
        assert relative(flex_grads[name], grad) < FP32_REL, name
    # Precondition: the mask matters, so equality above is not the causal mask twice.
    plain_logits, _ = loss_and_grads(model, x, None)
    assert relative(plain_logits, sdpa_logits) > 1e-2


def test_bf16_autocast_logits_track_fp32():
    model = random_model(seed=2)
    x = packed_batch(320, seed=2)
    with torch.no_grad():
        fp32 = model(x)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16 = model(x).float()
    # bf16 keeps 8 significant bits (2^-8 = 4e-3 relative per rounding): a few roundings deep,
    # the logits agree to about 1e-2 and never to 1e-4.
    assert 1e-4 < relative(bf16, fp32) < 3e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_context_parallel_attention_is_each_ranks_rows_of_full_attention_on_cuda(dtype):
    # The CUDA kernels context_parallel.attend_to_sequence reaches through causal_lower_right:
    # in bf16 flash attention (grouped-query: 6 query heads share 2 key/value heads), in fp32 a
    # materialised mask. Against full causal SDPA in the same dtype, forward and backward.
    B, nh, nkv, T, hd, cp = 2, 6, 2, 256, 32, 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(B, n, T, hd, generator=gen, device="cuda", dtype=dtype).requires_grad_()
        for n in (nh, nkv, nkv)
    )
    full = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True
    )
    rows = torch.cat([zigzag_positions(T, r, cp, "cuda") for r in range(cp)])
    mine = torch.cat(
        [attend_to_sequence(q[:, :, zigzag_positions(T, r, cp, "cuda")], k, v, r, cp,
                            chunk_masks(T, r, cp, None), True)
         for r in range(cp)], dim=2,
    )  # fmt: skip
    tolerance = FP32_REL if dtype == torch.float32 else 3e-2  # bf16: 8 bits, sums reordered
    assert relative(mine.float(), full[:, :, rows].float()) < tolerance
    grad = torch.randn_like(full)
    want = torch.autograd.grad(full, (q, k, v), grad)
    got = torch.autograd.grad(mine, (q, k, v), grad[:, :, rows])
    for name, a, b in zip("qkv", got, want, strict=True):
        assert relative(a.float(), b.float()) < tolerance, name
