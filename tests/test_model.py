"""Specifications for model.py: the hand-written Llama decoder, its config, RoPE and generation."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import masks
from lib.extras import sampling
from lib.extras.sampling import sample
from model import (
    IGNORE_INDEX,
    PRESETS,
    Attention,
    KVCache,
    LlamaConfig,
    LlamaForPretraining,
    apply_rope,
    count_parameters,
    rope_cos_sin,
)

pytestmark = pytest.mark.quick  # the quick tier (`python -m pytest -m quick`)

VOCAB = 97
TOL = 1e-5


def tiny_config(**overrides) -> LlamaConfig:
    """A model small enough that every test here runs in well under a second on a CPU."""
    fields = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    }  # fmt: skip
    return LlamaConfig(**{**fields, **overrides})


def tiny_model(seed: int = 0, **overrides) -> LlamaForPretraining:
    torch.manual_seed(seed)
    return LlamaForPretraining(tiny_config(**overrides)).eval()


def random_tokens(*shape: int, seed: int = 1, low: int = 2) -> torch.Tensor:
    """Token ids in [low, VOCAB): ids below `low` stay free to serve as PAD / BOT / EOS."""
    return torch.randint(low, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def model() -> LlamaForPretraining:
    return tiny_model()


@pytest.fixture
def sharp_model() -> LlamaForPretraining:
    """A tiny model with large weights, for generation.

    Freshly initialised (std 0.02), the model is nearly a bigram model: its next token hardly
    depends on earlier tokens or positions, so it would hide a KV cache at the wrong positions.
    """
    model = tiny_model()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:  # every matrix; the norms stay at one
                parameter.normal_(std=0.3)
    return model


# -------------------------------------------------------------------------------------------------
# Forward and loss


def test_forward_without_targets_returns_logits_of_shape_B_T_vocab(model):
    logits = model(random_tokens(3, 10))
    assert logits.shape == (3, 10, VOCAB)
    assert logits.dtype == torch.float32


def test_forward_with_targets_returns_the_summed_loss_and_the_number_of_targets(model):
    x, targets = random_tokens(2, 12, seed=1), random_tokens(2, 12, seed=2)
    loss_sum, num_tokens = model(x, targets)
    logits = model(x)
    mean = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert loss_sum.ndim == 0 and int(num_tokens) == 24
    assert torch.allclose(loss_sum / num_tokens, mean, atol=TOL)


def test_ignore_index_targets_count_neither_in_the_loss_nor_in_num_tokens(model):
    x, targets = random_tokens(2, 12, seed=1), random_tokens(2, 12, seed=2)
    targets[0, 7:] = IGNORE_INDEX
    targets[1, :3] = IGNORE_INDEX
    loss_sum, num_tokens = model(x, targets)
    assert int(num_tokens) == 24 - 5 - 3
    counted = targets != IGNORE_INDEX
    log_probs = model(x).log_softmax(dim=-1)[counted]  # (num counted, vocab)
    expected = -log_probs.gather(1, targets[counted][:, None]).sum()
    assert torch.allclose(loss_sum, expected, atol=1e-4)


def test_loss_is_finite_and_every_parameter_receives_a_gradient():
    model = tiny_model().train()
    loss_sum, num_tokens = model(random_tokens(2, 16, seed=1), random_tokens(2, 16, seed=2))
    (loss_sum / num_tokens).backward()
    assert torch.isfinite(loss_sum)
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        assert torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().sum() > 0, name


def test_input_longer_than_max_position_embeddings_raises(model):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(random_tokens(1, 65))


# -------------------------------------------------------------------------------------------------
# Causality and masks


def causal_mask_for(x: torch.Tensor) -> torch.Tensor:
    return masks.create_causal_mask(x.size(1))


@pytest.mark.parametrize("mask_fn", [None, causal_mask_for], ids=["is_causal", "explicit_mask"])
@pytest.mark.parametrize("t", [0, 5, 11])
def test_changing_token_t_changes_no_logit_before_t_and_changes_logits_at_t(model, mask_fn, t):
    x = random_tokens(2, 12)
    changed = x.clone()
    changed[:, t] = (x[:, t] - 2 + 1) % (VOCAB - 2) + 2  # the next id, wrapping within [2, VOCAB)
    mask = mask_fn(x) if mask_fn else None
    before, after = model(x, attn_mask=mask), model(changed, attn_mask=mask)
    assert torch.allclose(before[:, :t], after[:, :t], atol=TOL, rtol=0)
    assert not torch.allclose(before[:, t], after[:, t], atol=1e-3)


def test_explicit_causal_mask_agrees_with_the_is_causal_path(model):
    x = random_tokens(3, 20)
    assert torch.allclose(model(x), model(x, attn_mask=causal_mask_for(x)), atol=TOL, rtol=0)


@pytest.mark.parametrize("pad_id", [0, 42])
@pytest.mark.parametrize("with_padding_mask", [False, True], ids=["causal", "causal+padding"])
def test_right_padding_leaves_the_logits_of_real_tokens_unchanged(model, pad_id, with_padding_mask):
    real = random_tokens(1, 10)
    padded = torch.cat((real, torch.full((1, 6), pad_id)), dim=1)  # (1, 16)
    mask = None
    if with_padding_mask:
        mask = masks.create_causal_mask(16) + masks.create_padding_mask(padded, pad_id)
    assert torch.allclose(model(padded, attn_mask=mask)[:, :10], model(real), atol=TOL, rtol=0)


def test_left_padding_with_causal_and_padding_mask_leaves_real_logits_unchanged(model):
    # RoPE is relative, so shifting the real tokens right by the padding changes nothing, as long
    # as they cannot see the padding.
    pad_id = 0
    real = random_tokens(1, 10)
    padded = torch.cat((torch.full((1, 6), pad_id), real), dim=1)  # (1, 16)
    mask = masks.create_causal_mask(16) + masks.create_padding_mask(padded, pad_id)
    assert torch.allclose(model(padded, attn_mask=mask)[:, 6:], model(real), atol=TOL, rtol=0)


def test_left_padded_batch_with_causal_and_padding_mask_gives_finite_logits_and_loss():
    model = tiny_model().train()
    pad_id = 0
    x = random_tokens(3, 12)
    x[0, :4] = pad_id
    x[1, :11] = pad_id
    x[2, :] = pad_id  # a row that is all padding
    targets = random_tokens(3, 12, seed=2)
    targets[x == pad_id] = IGNORE_INDEX
    mask = masks.create_causal_mask(12) + masks.create_padding_mask(x, pad_id)
    assert torch.isfinite(model(x, attn_mask=mask)).all()
    loss_sum, num_tokens = model(x, targets, attn_mask=mask)
    assert int(num_tokens) == 8 + 1 + 0  # the real tokens of each row
    assert torch.isfinite(loss_sum)
    (loss_sum / num_tokens).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_document_mask_makes_a_packed_document_see_only_itself(model):
    bot = 1
    doc1, doc2 = random_tokens(1, 9, seed=1), random_tokens(1, 7, seed=2)
    doc1[0, 0] = doc2[0, 0] = bot
    packed = torch.cat((doc1, doc2), dim=1)  # (1, 16); doc2 sits at positions 9..15
    mask = masks.create_causal_mask(16) + masks.create_document_mask(
        masks.document_ids(packed, bot)
    )
    logits = model(packed, attn_mask=mask)
    # doc2 alone runs from position 0; RoPE is relative, so its logits are the same.
    assert torch.allclose(logits[:, 9:], model(doc2), atol=TOL, rtol=0)
    assert torch.allclose(logits[:, :9], model(doc1), atol=TOL, rtol=0)


def test_without_the_document_mask_a_packed_document_sees_the_one_before(model):
    bot = 1
    doc1, doc2 = random_tokens(1, 9, seed=1), random_tokens(1, 7, seed=2)
    doc1[0, 0] = doc2[0, 0] = bot
    packed = torch.cat((doc1, doc2), dim=1)
    assert not torch.allclose(model(packed)[:, 9:], model(doc2), atol=1e-3)


def test_the_model_refuses_a_flex_attention_block_mask_on_cpu(model):
    # The GPU path of --document-mask (--attention flex) must not run on a CPU: there torch
    # 2.13's compiled FlexAttention gives NaN or wrong logits wherever Inductor generates AVX2
    # code (CPUs without AVX-512; ATEN_CPU_CAPABILITY=avx2 shows it on any x86 CPU), in a row
    # that starts mid-document like row 1 here. A clear error, not a wrong answer; flex == SDPA
    # is proven on CUDA (tests/gpu/test_gpu_model.py), and test_masks.py proves the BlockMask
    # allows exactly what the dense mask, which CPU runs use, allows.
    bot = 1
    x = random_tokens(2, 40)
    x[0, [0, 9, 25]] = bot
    x[1, [5, 6, 30]] = bot  # row 1 starts mid-document and has a one-token document
    block_mask = masks.create_document_block_mask(masks.document_ids(x, bot))
    with torch.no_grad(), pytest.raises(ValueError, match="FlexAttention runs on CUDA only"):
        model(x, attn_mask=block_mask)


# -------------------------------------------------------------------------------------------------
# Rotary position embeddings


def rotate_to(x: torch.Tensor, position: int, cos: torch.Tensor, sin: torch.Tensor):
    """apply_rope on one vector (head_dim,) placed at `position`."""
    return apply_rope(
        x[None, None, None], cos[position : position + 1], sin[position : position + 1]
    )[0, 0, 0]


@pytest.mark.parametrize("m, n", [(0, 0), (3, 0), (0, 7), (10, 4)])
def test_rope_dot_product_depends_only_on_relative_position(m, n):
    config = tiny_config(max_position_embeddings=128)
    cos, sin = rope_cos_sin(config)
    torch.manual_seed(0)
    q, k = torch.randn(config.head_dim), torch.randn(config.head_dim)
    reference = rotate_to(q, m, cos, sin) @ rotate_to(k, n, cos, sin)
    for shift in (1, 5, 17, 60, 100):
        shifted = rotate_to(q, m + shift, cos, sin) @ rotate_to(k, n + shift, cos, sin)
        assert torch.allclose(shifted, reference, atol=1e-4), shift


def test_rope_dot_product_changes_with_the_relative_position():
    config = tiny_config()
    cos, sin = rope_cos_sin(config)
    torch.manual_seed(0)
    q, k = torch.randn(config.head_dim), torch.randn(config.head_dim)
    dots = torch.stack([rotate_to(q, 8, cos, sin) @ rotate_to(k, n, cos, sin) for n in range(8)])
    assert dots.unique().numel() == 8


def test_rope_rotation_preserves_the_norm_and_is_the_identity_at_position_zero():
    config = tiny_config()
    cos, sin = rope_cos_sin(config)
    x = torch.randn(config.head_dim, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(rotate_to(x, 0, cos, sin), x)
    for position in (1, 13, 63):
        assert torch.allclose(rotate_to(x, position, cos, sin).norm(), x.norm(), atol=1e-5)


def test_rope_tables_have_shape_max_positions_by_head_dim():
    config = tiny_config()
    cos, sin = rope_cos_sin(config)
    assert cos.shape == sin.shape == (64, config.head_dim)


def test_apply_rope_is_hugging_faces_rotate_half_formula_bit_for_bit():
    # Hugging Face's Llama: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1), with
    # the plain sin table. model.py swaps the halves with a roll and keeps the minus sign in its
    # table: the same products and sums, so the same bits (and the checkpoints map 1:1).
    config = tiny_config()
    cos, sin = rope_cos_sin(config)
    half = config.head_dim // 2
    plain_sin = sin[:, half:].repeat(1, 2)  # the second half is the plain one
    assert torch.equal(sin[:, :half], -plain_sin[:, :half])

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    x = torch.randn(2, 3, 64, config.head_dim, generator=torch.Generator().manual_seed(0))
    assert torch.equal(apply_rope(x, cos, sin), x * cos + rotate_half(x) * plain_sin)


# -------------------------------------------------------------------------------------------------
# Attention


def reference_attention(attention: Attention, x, cos, sin):
    """softmax(Q K^T / sqrt(d) + causal) V, then wo; k and v heads repeated for each query group."""
    B, T, _ = x.shape
    nh, nkv, hd = attention.num_heads, attention.num_kv_heads, attention.head_dim
    q = attention.wq(x).view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
    k = attention.wk(x).view(B, T, nkv, hd).transpose(1, 2)  # (B, nkv, T, hd)
    v = attention.wv(x).view(B, T, nkv, hd).transpose(1, 2)  # (B, nkv, T, hd)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(hd)  # (B, nh, T, T)
    future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)
    y = scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v  # (B, nh, T, hd)
    return attention.wo(y.transpose(1, 2).reshape(B, T, nh * hd))


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["multi_head", "gqa", "multi_query"])
def test_attention_matches_a_hand_written_reference(num_kv_heads):
    config = tiny_config(num_key_value_heads=num_kv_heads)
    torch.manual_seed(0)
    attention = Attention(config)
    cos, sin = rope_cos_sin(config)
    x = torch.randn(2, 10, config.hidden_size)
    expected = reference_attention(attention, x, cos[:10], sin[:10])
    assert torch.allclose(attention(x, cos[:10], sin[:10]), expected, atol=TOL)


def test_gqa_equals_multi_head_attention_with_each_kv_head_copied_for_its_query_group():
    gqa_config = tiny_config(num_key_value_heads=2)
    mha_config = tiny_config(num_key_value_heads=4)
    torch.manual_seed(0)
    gqa, mha = Attention(gqa_config), Attention(mha_config)
    hd, group = gqa_config.head_dim, 2
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for name in ("wk", "wv"):
            heads = getattr(gqa, name).weight.view(2, hd, -1)  # (nkv, hd, d)
            getattr(mha, name).weight.copy_(heads.repeat_interleave(group, dim=0).flatten(0, 1))
    cos, sin = rope_cos_sin(gqa_config)
    x = torch.randn(2, 10, gqa_config.hidden_size)
    assert torch.allclose(gqa(x, cos[:10], sin[:10]), mha(x, cos[:10], sin[:10]), atol=TOL)


def test_kv_cache_appends_and_returns_everything_cached_so_far():
    torch.manual_seed(0)
    cache = KVCache(2, 3, 10, 4, device="cpu", dtype=torch.float32)
    k1, v1 = torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4)
    k2, v2 = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    cache.update(k1, v1)
    k, v = cache.update(k2, v2)
    assert cache.length == 7
    assert torch.equal(k, torch.cat((k1, k2), dim=2))
    assert torch.equal(v, torch.cat((v1, v2), dim=2))


def test_decoding_with_the_kv_cache_gives_the_logits_of_a_full_forward(model):
    config = model.config
    x = random_tokens(2, 14)
    caches = [
        KVCache(2, config.num_key_value_heads, 14, config.head_dim, "cpu", torch.float32)
        for _ in model.layers
    ]
    steps = [model(x[:, :8], kv_caches=caches)]  # prefill
    steps += [model(x[:, t : t + 1], kv_caches=caches) for t in range(8, 14)]  # one token each
    assert torch.allclose(torch.cat(steps, dim=1), model(x), atol=TOL, rtol=0)


def test_position_ids_and_an_attention_function_continue_a_sequence_from_elsewhere(sharp_model):
    # The two seams context parallelism uses (lib/parallel/context_parallel.py): position_ids
    # place a slice of a sequence at its positions (RoPE), and an attention function attends to
    # keys and values computed elsewhere. Here the second half of a sequence attends to the keys
    # and values of the first half, recorded by a first call, and gives the logits of the whole
    # sequence's run.
    x = random_tokens(2, 16)
    recorded = []

    def record(q, k, v, enable_gqa):
        recorded.append((k, v))  # one (k, v) per layer, rotated by their positions
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)

    def after_recorded(q, k, v, enable_gqa):
        k_before, v_before = recorded.pop(0)
        k, v = torch.cat((k_before, k), dim=2), torch.cat((v_before, v), dim=2)  # (B, nkv, 16, hd)
        causal = causal_lower_right(q.size(2), k.size(2))  # the queries are the last 8 positions
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=enable_gqa)

    first = sharp_model(x[:, :8], attn_mask=record)
    second = sharp_model(x[:, 8:], attn_mask=after_recorded, position_ids=torch.arange(8, 16))
    assert torch.allclose(torch.cat((first, second), dim=1), sharp_model(x), atol=TOL, rtol=0)
    # At positions 0..7 instead, the same keys and values give other logits: RoPE is applied.
    sharp_model(x[:, :8], attn_mask=record)
    misplaced = sharp_model(x[:, 8:], attn_mask=after_recorded)
    assert not torch.allclose(misplaced, second, atol=1e-2, rtol=0)


def test_position_ids_of_each_sequence_apply_to_that_sequence(sharp_model):
    x = random_tokens(2, 12)
    default = sharp_model(x)
    same = torch.arange(12)
    assert torch.equal(sharp_model(x, position_ids=same), default)  # (T,): the default's
    per_row = torch.stack((same, 2 * same))  # (B, T): row 1 twice as far apart
    logits = sharp_model(x, position_ids=per_row)
    assert torch.equal(logits[0], default[0])
    assert not torch.allclose(logits[1], default[1], atol=1e-2, rtol=0)


def test_feeding_several_tokens_into_a_filled_cache_raises(model):
    config = model.config
    caches = [
        KVCache(1, config.num_key_value_heads, 20, config.head_dim, "cpu", torch.float32)
        for _ in model.layers
    ]
    model(random_tokens(1, 5), kv_caches=caches)
    with pytest.raises(ValueError, match="one token per step"):
        model(random_tokens(1, 2), kv_caches=caches)


# -------------------------------------------------------------------------------------------------
# Configuration, presets, parameter count


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_key_value_heads": 4},
        {"num_key_value_heads": 2},
        {"num_key_value_heads": 1, "num_hidden_layers": 3},
        {"tie_word_embeddings": True},
        {"tie_word_embeddings": True, "num_key_value_heads": 2, "intermediate_size": 96},
    ],
    ids=["multi_head", "gqa", "multi_query", "tied", "tied_gqa"],
)
def test_count_parameters_matches_the_built_model(overrides):
    config = tiny_config(**overrides)
    model = LlamaForPretraining(config)
    assert count_parameters(config) == sum(p.numel() for p in model.parameters())


def test_tied_embeddings_are_one_tensor_counted_once():
    tied, untied = tiny_config(tie_word_embeddings=True), tiny_config()
    model = LlamaForPretraining(tied)
    assert model.lm_head.weight is model.tok_embeddings.weight
    assert count_parameters(untied) - count_parameters(tied) == VOCAB * tied.hidden_size


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds_a_config(name):
    config = LlamaConfig.from_preset(name)
    assert isinstance(config, LlamaConfig)
    assert config.to_dict() == {**LlamaConfig().to_dict(), **PRESETS[name]}


def test_preset_overrides_replace_fields():
    assert LlamaConfig.from_preset("tiny", vocab_size=123).vocab_size == 123


@pytest.mark.parametrize("name, published", [("7b", 6.74e9), ("13b", 13.0e9), ("70b", 69.0e9)])
def test_llama2_presets_have_the_published_parameter_counts(name, published):
    assert count_parameters(LlamaConfig.from_preset(name)) == pytest.approx(published, rel=0.01)


def test_unknown_preset_raises_and_lists_the_valid_names():
    with pytest.raises(ValueError) as error:
        LlamaConfig.from_preset("gigantic")
    for name in PRESETS:
        assert name in str(error.value)


@pytest.mark.parametrize(
    "config", [tiny_config(), LlamaConfig.from_preset("1b")], ids=["tiny", "1b"]
)
def test_config_round_trips_through_json(config):
    assert LlamaConfig(**json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize(
    "overrides",
    [
        {"hidden_size": 64, "num_attention_heads": 5},  # 64 % 5
        {"num_attention_heads": 4, "num_key_value_heads": 3},  # 4 % 3
        {"hidden_size": 12, "num_attention_heads": 4, "num_key_value_heads": 4},  # odd head_dim 3
    ],
    ids=["hidden_by_heads", "heads_by_kv_heads", "odd_head_dim"],
)
def test_invalid_head_shapes_raise(overrides):
    with pytest.raises(ValueError):
        tiny_config(**overrides)


# -------------------------------------------------------------------------------------------------
# Initialisation and state


def test_residual_projections_start_smaller_by_one_over_sqrt_two_layers():
    model = tiny_model(num_hidden_layers=4)
    scale = 1 / math.sqrt(2 * 4)
    for layer in model.layers:
        assert layer.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)
        for residual in (layer.attention.wo, layer.feed_forward.w2):
            assert residual.weight.std().item() == pytest.approx(0.02 * scale, rel=0.1)


def test_norm_weights_start_at_one(model):
    norms = [model.norm] + [
        n for layer in model.layers for n in (layer.attention_norm, layer.ffn_norm)
    ]
    for norm in norms:
        assert torch.equal(norm.weight, torch.ones_like(norm.weight))


def test_rope_tables_are_buffers_left_out_of_the_state_dict(model):
    assert {"rope_cos", "rope_sin"} <= dict(model.named_buffers()).keys()
    assert not any("rope" in key for key in model.state_dict())
    tiny_model(seed=1).load_state_dict(model.state_dict(), strict=True)


# -------------------------------------------------------------------------------------------------
# Training


def test_a_tiny_model_overfits_one_batch():
    model = tiny_model().train()
    data = random_tokens(4, 33, low=0)
    x, targets = data[:, :-1], data[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(50):
        loss_sum, num_tokens = model(x, targets)
        loss = loss_sum / num_tokens
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0], losses[:: len(losses) // 10]


# -------------------------------------------------------------------------------------------------
# Generation and sampling


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_cached_and_uncached_generation_give_the_same_tokens(sharp_model, temperature):
    prompt = random_tokens(2, 5)
    outputs = [
        sampling.generate(sharp_model,
            prompt, 20, temperature=temperature, use_cache=use_cache,
            generator=torch.Generator().manual_seed(7),
        )
        for use_cache in (True, False)
    ]  # fmt: skip
    assert outputs[0].shape == (2, 25)
    assert torch.equal(outputs[0][:, :5], prompt)
    assert torch.equal(outputs[0], outputs[1])


def test_greedy_generation_is_deterministic(sharp_model):
    prompt = random_tokens(2, 5)
    first = sampling.generate(sharp_model, prompt, 15, temperature=0)
    assert torch.equal(first, sampling.generate(sharp_model, prompt, 15, temperature=0))
    uncached = sampling.generate(sharp_model, prompt, 15, temperature=0, use_cache=False)
    assert torch.equal(first, uncached)


def test_greedy_generation_picks_the_most_likely_next_token(sharp_model):
    out = sampling.generate(sharp_model, random_tokens(1, 5), 6, temperature=0)
    logits = sharp_model(out[:, :-1])  # (1, 10, vocab): the prediction after every prefix
    assert torch.equal(logits[0, 4:].argmax(dim=-1), out[0, 5:])


def test_sampling_follows_the_generator_seed(sharp_model):
    prompt = random_tokens(1, 5)
    seeded = [
        sampling.generate(sharp_model, prompt, 20, generator=torch.Generator().manual_seed(s))
        for s in (1, 1, 2)
    ]
    assert torch.equal(seeded[0], seeded[1])
    assert not torch.equal(seeded[0], seeded[2])


def test_top_k_1_equals_greedy(sharp_model):
    prompt = random_tokens(2, 5)
    seeded = torch.Generator().manual_seed(0)
    top1 = sampling.generate(sharp_model, prompt, 15, top_k=1, generator=seeded)
    assert torch.equal(top1, sampling.generate(sharp_model, prompt, 15, temperature=0))


def test_generation_stops_right_after_eos(sharp_model):
    prompt = random_tokens(1, 5)
    greedy = sampling.generate(sharp_model, prompt, 20, temperature=0)[0, 5:]
    eos_id = int(greedy[3])
    first_eos = int((greedy == eos_id).nonzero()[0])  # the first time the model emits it
    out = sampling.generate(sharp_model, prompt, 20, temperature=0, eos_id=eos_id)
    assert out.shape == (1, 5 + first_eos + 1)
    assert torch.equal(out[0, 5:], greedy[: first_eos + 1])


def test_finished_rows_keep_receiving_eos_while_others_continue(sharp_model):
    prompt = random_tokens(2, 5, seed=4)
    greedy = sampling.generate(sharp_model, prompt, 12, temperature=0)[:, 5:]
    eos_id = int(greedy[0, 0])  # row 0 finishes at once
    row1_eos = (greedy[1] == eos_id).nonzero()
    length = int(row1_eos[0]) + 1 if len(row1_eos) else 12  # stops once every row has finished
    assert length > 1, "row 1 must outlive row 0 for this test to mean anything"
    out = sampling.generate(sharp_model, prompt, 12, temperature=0, eos_id=eos_id)[:, 5:]
    assert out.shape == (2, length)
    assert (out[0] == eos_id).all()
    assert torch.equal(out[1], greedy[1, :length])


def test_generating_past_max_position_embeddings_raises(model):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        sampling.generate(model, random_tokens(1, 60), 5)


def test_generating_up_to_exactly_max_position_embeddings_works(model):
    assert sampling.generate(model, random_tokens(1, 60), 4, temperature=0).shape == (1, 64)


def test_sample_at_temperature_zero_is_argmax():
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, temperature=0), logits.argmax(dim=-1))


def test_sample_with_a_tiny_top_p_is_greedy():
    logits = torch.randn(256, VOCAB, generator=torch.Generator().manual_seed(0))
    picked = sample(logits, temperature=1.0, top_p=1e-6, generator=torch.Generator().manual_seed(1))
    assert torch.equal(picked, logits.argmax(dim=-1))


def test_sample_with_top_k_only_picks_among_the_k_most_likely():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)).expand(4000, -1)
    picked = sample(logits, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1))
    allowed = set(logits[0].topk(5).indices.tolist())
    assert set(picked.tolist()) == allowed


def test_sample_with_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, -1)
    # Mass before token 1 is 0.5 <= 0.6 (kept); before token 2 it is 0.8 > 0.6 (dropped).
    picked = sample(logits, temperature=1.0, top_p=0.6, generator=torch.Generator().manual_seed(1))
    assert set(picked.tolist()) == {0, 1}
