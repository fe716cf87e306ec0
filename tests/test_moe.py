"""Specification of the mixture of experts in lib/extras/moe.py (MoEFeedForward) and its Mixtral
export.

A config with num_local_experts > 0 replaces every layer's SwiGLU MLP by Mixtral's sparse MoE:
a router sends each token to num_experts_per_tok experts, dropless (no token is ever dropped),
and training adds a per-sequence load-balancing loss to loss_sum. What the parallel strategies
rely on is proven here on one process: the output of a sequence and its loss do not depend on
which other sequences share its batch, so any split of the global batch sums to the same loss
and gradient. A dense config (0 experts) is exactly the model it was before experts existed.

All in-process, tiny fp32 models; the transformers tests load the export in MixtralForCausalLM.
"""

import json
import math

import datasets
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import data
from lib import exits
from lib.checkpoints.finished_run import load_model
from lib.checkpoints.model_pt import save_final
from lib.extras import sampling, speed
from lib.extras.moe import MoEFeedForward, router_stats, sequence_balance_loss
from lib.extras.sampling import generate_text
from model import (
    IGNORE_INDEX,
    LlamaConfig,
    LlamaForPretraining,
    count_active_parameters,
    count_parameters,
)
from tools import export_hf, generate

pytestmark = pytest.mark.quick  # the quick tier (`python -m pytest -m quick`)

VOCAB = 97
E, K = 4, 2  # experts, experts per token
TEXT = "def add(x, y):\n    return x + y"


def moe_config(**overrides) -> LlamaConfig:
    fields = {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "num_local_experts": E, "num_experts_per_tok": K,
    }  # fmt: skip
    return LlamaConfig(**{**fields, **overrides})


def sharp(model: LlamaForPretraining, std: float = 0.3, seed: int = 0) -> LlamaForPretraining:
    """Every parameter random and large (norm gains too), so that routing, positions and every
    token matter: a fresh std-0.02 model routes almost uniformly and is nearly a bigram model."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(std=std)
            else:
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
    return model


def moe_model(seed: int = 0, **overrides) -> LlamaForPretraining:
    torch.manual_seed(seed)
    return sharp(LlamaForPretraining(moe_config(**overrides)), seed=seed)


def random_tokens(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-6) -> None:
    """Equal within `rel` of the largest value: fp32 rounding alone (an expert's matmul over a
    different number of tokens sums in another order), where any routing error is of order 1."""
    assert actual.shape == expected.shape
    error, scale = (actual - expected).abs().max().item(), expected.abs().max().item()
    assert error <= rel * scale, f"max difference {error:.3g}, largest value {scale:.3g}"


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """4 sequences of 12 tokens; some targets are padding (IGNORE_INDEX): a few of sequence 1,
    all of sequence 3, so that sequences weigh differently and one not at all."""
    x, y = random_tokens(4, 12, seed=seed), random_tokens(4, 12, seed=seed + 100)
    y[1, 8:] = IGNORE_INDEX
    y[3, :] = IGNORE_INDEX
    return x, y


# -------------------------------------------------------------------------------------------------
# Config


DENSE_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                "rope_theta", "rms_norm_eps", "tie_word_embeddings", "rope_scaling"]  # fmt: skip


def test_a_dense_config_writes_the_fields_it_always_had():
    dense = moe_config(num_local_experts=0)
    assert list(dense.to_dict()) == DENSE_FIELDS  # config.json and checkpoints: as before
    assert LlamaConfig(**dense.to_dict()) == dense  # and an old config.json is a dense model
    # Non-default MoE settings on a dense model are kept, so the round trip stays exact.
    odd = moe_config(num_local_experts=0, num_experts_per_tok=1)
    assert LlamaConfig(**json.loads(json.dumps(odd.to_dict()))) == odd


def test_a_moe_config_round_trips_through_json():
    config = moe_config(router_aux_loss_coef=0.02)
    saved = config.to_dict()
    assert (saved["num_local_experts"], saved["num_experts_per_tok"]) == (E, K)
    assert LlamaConfig(**json.loads(json.dumps(saved))) == config


def test_the_default_coefficient_is_transformers_mixtral_default():
    transformers = pytest.importorskip("transformers")
    assert LlamaConfig().router_aux_loss_coef == transformers.MixtralConfig().router_aux_loss_coef
    assert LlamaConfig().num_experts_per_tok == transformers.MixtralConfig().num_experts_per_tok


@pytest.mark.parametrize(
    "overrides, message",
    [({"num_local_experts": -1}, "num_local_experts -1 must be an integer >= 0"),
     ({"num_local_experts": 2.0}, "num_local_experts 2.0 must be an integer"),
     ({"num_experts_per_tok": 0}, "num_experts_per_tok 0 must be an integer from 1 to "
                                  "num_local_experts \\(4\\)"),
     ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 must be"),
     ({"num_experts_per_tok": True}, "num_experts_per_tok True must be"),
     ({"router_aux_loss_coef": -0.1}, "router_aux_loss_coef -0.1 must be a finite number >= 0"),
     ({"router_aux_loss_coef": math.inf}, "router_aux_loss_coef inf must be"),
     ({"router_aux_loss_coef": math.nan}, "router_aux_loss_coef nan must be"),
     ({"router_aux_loss_coef": "0.1"}, "router_aux_loss_coef '0.1' must be")],
)  # fmt: skip
def test_invalid_moe_settings_raise_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        moe_config(**overrides)


def test_count_parameters_counts_every_expert_and_active_parameters_k_of_them():
    config = moe_config()
    model = LlamaForPretraining(config)
    assert count_parameters(config) == sum(p.numel() for p in model.parameters())
    d, ffn, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    idle_experts = layers * (E - K) * 3 * d * ffn  # each token skips E - k experts per layer
    assert count_active_parameters(config) == count_parameters(config) - idle_experts
    dense = moe_config(num_local_experts=0)
    assert count_active_parameters(dense) == count_parameters(dense)


# -------------------------------------------------------------------------------------------------
# A dense model is what it was


def test_a_dense_model_is_unchanged():
    """Names, parameter count and loss of model.py before experts existed. (Its logits are
    tests/test_model.py's business; recorded values would hold on one CPU's kernels only.)"""
    config = moe_config(hidden_size=64, intermediate_size=128, num_local_experts=0)
    torch.manual_seed(0)
    model = LlamaForPretraining(config).eval()
    names = {"tok_embeddings.weight", "norm.weight", "lm_head.weight"} | {
        f"layers.{i}.{name}.weight" for i in range(2)
        for name in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                     "feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "attention_norm",
                     "ffn_norm")}  # fmt: skip
    assert set(model.state_dict()) == names
    assert count_parameters(config) == 86464
    assert [name for name, _ in model.named_buffers()] == ["rope_cos", "rope_sin"]
    x = random_tokens(2, 10, seed=1)
    with torch.no_grad():
        logits = model(x)
    # Training mode adds nothing to a dense model's loss.
    y = random_tokens(2, 10, seed=2)
    loss_sum, _ = model.train()(x, y)
    assert torch.equal(
        loss_sum, F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
    )
    assert router_stats(model) == {}


def test_a_moe_model_keeps_the_layer_names_and_stacks_its_experts():
    model = LlamaForPretraining(moe_config())
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items() if ".0." in name}
    assert shapes == {
        "layers.0.attention.wq.weight": (32, 32),
        "layers.0.attention.wk.weight": (16, 32),
        "layers.0.attention.wv.weight": (16, 32),
        "layers.0.attention.wo.weight": (32, 32),
        "layers.0.attention_norm.weight": (32,),
        "layers.0.ffn_norm.weight": (32,),
        "layers.0.feed_forward.gate.weight": (E, 32),
        "layers.0.feed_forward.w1": (E, 64, 32),
        "layers.0.feed_forward.w3": (E, 64, 32),
        "layers.0.feed_forward.w2": (E, 32, 64),
    }  # the logging buffers are not saved


def test_experts_start_like_the_dense_mlp():
    model = LlamaForPretraining(moe_config(num_hidden_layers=4, hidden_size=256))
    scale = 1 / math.sqrt(2 * 4)
    for layer in model.layers:
        moe = layer.feed_forward
        for weight in (moe.gate.weight, moe.w1, moe.w3):
            assert weight.std().item() == pytest.approx(0.02, rel=0.1)
        assert moe.w2.std().item() == pytest.approx(0.02 * scale, rel=0.1)


# -------------------------------------------------------------------------------------------------
# Routing and the experts


@pytest.fixture
def moe() -> MoEFeedForward:
    torch.manual_seed(0)
    module = MoEFeedForward(moe_config())
    with torch.no_grad():
        for weight in (module.gate.weight, module.w1, module.w3, module.w2):
            weight.normal_(std=0.2)
    return module


def test_routing_picks_the_top_k_experts_and_renormalises_their_weights(moe):
    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(0))
    probs, weights, experts = moe.route(x)
    expected_probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)  # (N, E)
    assert probs.dtype == torch.float32 and torch.allclose(probs, expected_probs, atol=1e-6)
    assert experts.shape == weights.shape == (50, K)
    for n in range(50):
        ranked = sorted(range(E), key=lambda e: -expected_probs[n, e].item())
        assert set(experts[n].tolist()) == set(ranked[:K])
    chosen = expected_probs.gather(1, experts)  # (N, k)
    assert torch.allclose(weights, chosen / chosen.sum(-1, keepdim=True), atol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.ones(50), atol=1e-6)


def per_token_reference(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """The MoE written as a loop over tokens: each token through its k experts, weighted."""
    out = torch.zeros_like(x)
    for n, token in enumerate(x):
        probs = torch.softmax(moe.gate.weight @ token, dim=-1)  # (E,)
        top = probs.topk(K)
        for weight, e in zip(top.values / top.values.sum(), top.indices, strict=True):
            hidden = F.silu(moe.w1[e] @ token) * (moe.w3[e] @ token)  # (ffn,)
            out[n] += weight * (moe.w2[e] @ hidden)
    return out


@pytest.mark.parametrize("skewed", [False, True], ids=["random", "all_to_experts_0_and_1"])
def test_the_batched_experts_equal_a_loop_over_tokens(moe, skewed):
    x = torch.randn(3, 10, 32, generator=torch.Generator().manual_seed(1))
    if skewed:  # every token prefers experts 0 then 1: nothing is dropped, however crowded
        with torch.no_grad():
            moe.gate.weight.zero_()
            moe.gate.weight[0, 0], moe.gate.weight[1, 0] = 3.0, 2.0
        x[..., 0] = 5 + x[..., 0].abs()
        assert set(moe.route(x.flatten(0, 1))[2].flatten().tolist()) == {0, 1}
    with torch.no_grad():
        out = moe(x)
        expected = per_token_reference(moe, x.flatten(0, 1)).view(3, 10, 32)
    assert_close(out, expected)
    # A tensor of its own: FSDP2 warns that an in-place op on a wrapped module's view output
    # would skip its hooks (train_ep.py wraps the experts).
    assert out._base is None and out.is_contiguous()


def test_run_experts_takes_tokens_grouped_by_expert(moe):
    """The expert-parallel entry point: tokens sorted by expert, and how many each has."""
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(2))
    counts = [2, 0, 4, 1]  # expert 1 receives none
    out = moe.run_experts(x, counts)
    assert out.shape == x.shape
    for row, e in enumerate([0, 0, 2, 2, 2, 2, 3]):
        token = x[row]
        expected = moe.w2[e] @ (F.silu(moe.w1[e] @ token) * (moe.w3[e] @ token))
        assert_close(out[row], expected)
    # Given weights (expert parallelism: the experts a rank holds), counts are for those.
    local = tuple(w[2:] for w in (moe.w1, moe.w2, moe.w3))  # experts 2 and 3 only
    assert_close(moe.run_experts(x[2:], [4, 1], local), out[2:])


def test_a_dispatch_set_on_the_layer_runs_the_experts_in_place_of_run_experts(moe):
    """Expert parallelism's hook: the layer routes and weights as ever, and hands the tokens,
    grouped by expert, with their counts, to `dispatch` instead of run_experts."""
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(3))
    expected = moe(x)
    calls = []

    def dispatch(tokens, counts):
        calls.append(counts)
        return moe.run_experts(tokens, counts)

    moe.dispatch = dispatch
    assert_close(moe(x), expected)
    assert len(calls) == 1 and sum(calls[0]) == 2 * 3 * K and len(calls[0]) == E


def test_dropless_a_sequence_output_does_not_depend_on_its_batch():
    # In fp64: what is checked is the routing (an error of order 1), not which fp32 kernel a CPU
    # runs for an expert's matmul over 12 tokens or 48 (on an AMD EPYC with torch 2.11 and AVX2,
    # fp32 differed by 1.05e-6 of the largest value).
    model = moe_model().double().eval()
    x = random_tokens(4, 12)
    with torch.no_grad():
        together = model(x)
        alone = torch.cat([model(x[i : i + 1]) for i in range(4)])
    assert_close(together, alone)


# -------------------------------------------------------------------------------------------------
# The load-balancing loss


def gate_logits_of(model: LlamaForPretraining, x: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE layer's router logits (B, T, E) for input x, read with forward hooks."""
    logits = []
    hooks = [layer.feed_forward.gate.register_forward_hook(lambda m, i, out: logits.append(out))
             for layer in model.layers]  # fmt: skip
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return [out.view(*x.shape, E) for out in logits]


def balance_loss_by_hand(gate_logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Sum over sequences of E * sum_i f_i P_i x (the sequence's targets), written as loops:
    f_i = assignments to expert i / counted tokens, P_i = mean probability of expert i, both
    over the sequence's tokens that have a target."""
    total = 0.0
    for logits, sequence_targets in zip(gate_logits, targets, strict=True):
        counted = [t for t in range(len(logits)) if sequence_targets[t] != IGNORE_INDEX]
        if not counted:
            continue
        probs = [torch.softmax(logits[t].double(), dim=-1) for t in counted]
        chosen = [set(p.topk(K).indices.tolist()) for p in probs]
        aux = E * sum(
            sum(i in c for c in chosen) / len(counted) * sum(p[i] for p in probs) / len(counted)
            for i in range(E)
        )
        total += aux.item() * len(counted)
    return total


def test_the_balance_loss_in_loss_sum_is_the_per_sequence_formula():
    coef = 0.5
    model = moe_model(router_aux_loss_coef=coef)
    x, y = batch()
    gates = gate_logits_of(model.eval(), x)
    expected = sum(balance_loss_by_hand(g, y) for g in gates)

    with torch.no_grad():
        ce_sum, num_tokens = model.eval()(x, y)  # evaluation: cross-entropy alone
        loss_sum, train_tokens = model.train()(x, y)
    assert int(num_tokens) == int(train_tokens) == 4 * 12 - 4 - 12
    assert (loss_sum - ce_sum).item() == pytest.approx(coef * expected, rel=1e-5)
    assert router_stats(model)["aux_loss"] == pytest.approx(expected / int(num_tokens), rel=1e-6)


def test_the_balance_loss_of_one_sequence_equals_transformers_mixtral():
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    model = moe_model()
    x = random_tokens(1, 20)
    for gate_logits in gate_logits_of(model, x):
        theirs = mixtral.load_balancing_loss_func((gate_logits[0],), E, K)
        probs = gate_logits.softmax(-1)
        ours = sequence_balance_loss(probs, probs.topk(K).indices, torch.ones(1, 20, dtype=bool))
        assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)


def test_balance_loss_is_k_when_perfectly_balanced_and_e_times_k_when_collapsed():
    probs = torch.full((1, 8, E), 1 / E)
    balanced = torch.tensor([[0, 1], [2, 3]] * 4).view(1, 8, K)
    everyone = torch.ones(1, 8, dtype=bool)
    assert sequence_balance_loss(probs, balanced, everyone).item() == pytest.approx(K)
    collapsed = torch.zeros(1, 8, E)
    collapsed[..., 0] = 1.0
    top_two = torch.tensor([0, 1]).expand(1, 8, K)
    assert sequence_balance_loss(collapsed, top_two, everyone).item() == pytest.approx(E)
    assert sequence_balance_loss(probs, balanced, torch.zeros(1, 8, dtype=bool)).item() == 0


def loss_and_grads(model, pieces, x, y, total_targets):
    model.zero_grad()
    loss = 0.0
    for piece in pieces:
        loss_sum, _ = model(x[piece], y[piece])
        (loss_sum / total_targets).backward()
        loss += loss_sum.item() / total_targets
    return loss, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "split", [[2, 2], [1, 3], [3, 1], [1, 1, 1, 1]], ids=["2+2", "1+3", "3+1", "1+1+1+1"]
)
def test_any_split_of_the_batch_gives_the_same_loss_and_gradients(split):
    """What every strategy relies on: micro-batches and ranks each sum their pieces' loss_sum,
    divided by the global number of targets; the total and its gradient are one process's.
    In fp64, as the test above: on an AMD EPYC with torch 2.11 and AVX2, fp32 rounding alone
    moved an embedding gradient past the bounds."""
    model = moe_model(router_aux_loss_coef=0.5).double().train()
    x, y = batch()
    total_targets = int((y != IGNORE_INDEX).sum())
    whole, whole_grads = loss_and_grads(model, [slice(0, 4)], x, y, total_targets)
    bounds = [sum(split[:i]) for i in range(len(split) + 1)]
    pieces = [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    split_loss, split_grads = loss_and_grads(model, pieces, x, y, total_targets)
    assert split_loss == pytest.approx(whole, abs=1e-6)
    for name, grad in whole_grads.items():
        assert torch.allclose(split_grads[name], grad, atol=1e-6, rtol=1e-5), name


def test_the_router_learns_from_both_the_loss_and_the_balance_loss():
    x, y = batch()
    grads = {}
    for coef in (0.0, 1.0):
        model = moe_model(router_aux_loss_coef=coef).train()
        loss_sum, num_tokens = model(x, y)
        (loss_sum / num_tokens).backward()
        for name, parameter in model.named_parameters():
            assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
        grads[coef] = model.layers[0].feed_forward.gate.weight.grad
        assert grads[coef].abs().sum() > 0
    assert not torch.allclose(grads[0.0], grads[1.0])


def test_evaluation_and_generation_add_no_balance_loss_and_count_nothing():
    model = moe_model(router_aux_loss_coef=0.5).eval()
    x, y = batch()
    with torch.no_grad():
        loss_sum, _ = model(x, y)
        logits = model(x)
        sampling.generate(model, x[:1], 3)
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
    assert torch.allclose(loss_sum, ce, atol=1e-4)
    stats = router_stats(model)
    assert stats["aux_loss"] is None and stats["tokens_per_expert"] == [[0] * E] * 2


def test_router_stats_count_since_the_last_read_and_reset():
    model = moe_model(router_aux_loss_coef=0.5).train()
    x, y = batch()
    per_forward = []
    for _ in range(2):
        loss_sum, num_tokens = model(x, y)
        with torch.no_grad():
            ce_sum, _ = model.eval()(x, y)
        model.train()
        per_forward.append((loss_sum - ce_sum).item() / 0.5 / int(num_tokens))
    stats = router_stats(model)
    assert stats["aux_loss"] == pytest.approx(sum(per_forward) / 2, rel=1e-5)
    assert stats["aux_loss"] == pytest.approx(sum(stats["aux_loss_per_layer"]))
    # Every (token, slot) of both forwards, padding included: the load each expert carried.
    assert [sum(counts) for counts in stats["tokens_per_expert"]] == [2 * 4 * 12 * K] * 2
    assert len(stats["tokens_per_expert"][0]) == E
    again = router_stats(model)
    assert again["aux_loss"] is None and again["tokens_per_expert"] == [[0] * E] * 2


def test_activation_checkpointing_gives_the_same_loss_gradients_and_counts():
    x, y = batch()
    results = []
    for checkpointing in (False, True):
        model = moe_model(router_aux_loss_coef=0.5).train()
        if checkpointing:
            speed.apply_activation_checkpointing(model)  # backward runs each layer again
        loss_sum, _ = model(x, y)
        loss_sum.backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        results.append((loss_sum.item(), grads, router_stats(model)))
        assert all(layer.feed_forward.routing is None for layer in model.layers)
    (loss, grads, stats), (loss_ac, grads_ac, stats_ac) = results
    assert loss_ac == loss and stats_ac == stats  # the recomputation counts nothing twice
    for name, grad in grads.items():
        assert torch.allclose(grads_ac[name], grad, atol=1e-6), name


# -------------------------------------------------------------------------------------------------
# Out-dir, tools/generate.py and the Mixtral export


@pytest.fixture(scope="module")
def moe_out_dir(tmp_path_factory):
    """An out-dir (model.pt, config.json, tokenizer.json) of a sharp tiny MoE, as training
    writes it."""
    cache = tmp_path_factory.mktemp("moe_tokenizer")
    texts = datasets.Dataset.from_dict({"text": [TEXT + "\n", "The loss goes down.\n"] * 6})
    tokenizer = data.get_tokenizer(texts, 300, str(cache))
    config = moe_config(vocab_size=tokenizer.get_vocab_size(), rope_theta=500000.0)
    model = sharp(LlamaForPretraining(config)).eval()
    out = tmp_path_factory.mktemp("moe_out")
    save_final(str(out), model, config, tokenizer)
    return out


@pytest.fixture(scope="module")
def mixtral_dir(moe_out_dir, tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("mixtral") / "hf"
    assert export_hf.export(str(moe_out_dir), str(hf_dir)) == "MixtralForCausalLM"
    return hf_dir


def test_generate_samples_from_a_moe_out_dir(moe_out_dir, monkeypatch, capsys):
    model, tokenizer = load_model(str(moe_out_dir))
    cached = generate_text(model, tokenizer, "def ", 12, temperature=0)
    uncached = generate_text(model, tokenizer, "def ", 12, temperature=0, use_cache=False)
    assert cached == uncached and len(cached) > len("def ")
    argv = ["--out-dir", str(moe_out_dir), "--prompt", "def ", "--max-new-tokens", "12"]
    monkeypatch.setattr("sys.argv", ["tools/generate.py", *argv, "--temperature", "0"])
    exits.run(generate.main)
    assert capsys.readouterr().out == cached + "\n"


def mixtral_names(num_layers: int, num_experts: int) -> set[str]:
    """The tensor names transformers' MixtralForCausalLM.save_pretrained writes."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        names |= {f"{layer}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight",
                  f"{layer}.block_sparse_moe.gate.weight"}  # fmt: skip
        names |= {f"{layer}.block_sparse_moe.experts.{e}.{w}.weight"
                  for e in range(num_experts) for w in ("w1", "w2", "w3")}  # fmt: skip
    return names


def test_export_writes_a_mixtral_directory(moe_out_dir, mixtral_dir):
    config = json.loads((mixtral_dir / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    ours = json.loads((moe_out_dir / "config.json").read_text())
    ours.pop("tokenizer_sha256")  # (each config.json's is of the tokenizer.json beside it)
    assert {name: config[name] for name in ours} == ours  # our fields, under Mixtral's names
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (E, K)
    assert config["sliding_window"] is None and config["router_jitter_noise"] == 0.0
    tensors = load_file(mixtral_dir / "model.safetensors")
    assert set(tensors) == mixtral_names(2, E)
    weights = torch.load(moe_out_dir / "model.pt", weights_only=True)
    for e in range(E):
        for w in ("w1", "w2", "w3"):
            hf = tensors[f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"]
            assert torch.equal(hf, weights[f"layers.1.feed_forward.{w}"][e])
    assert torch.equal(tensors["model.layers.0.block_sparse_moe.gate.weight"],
                       weights["layers.0.feed_forward.gate.weight"])  # fmt: skip


def test_transformers_mixtral_gives_the_same_logits(moe_out_dir, mixtral_dir):
    transformers = pytest.importorskip("transformers")
    ours, tokenizer = load_model(str(moe_out_dir))
    theirs = transformers.MixtralForCausalLM.from_pretrained(mixtral_dir).eval()
    ids = torch.tensor([[tokenizer.bot_id, *tokenizer.encode(TEXT * 2)]])  # (1, T)
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() <= 1e-4


def test_export_then_from_hf_gives_back_the_same_moe(moe_out_dir, mixtral_dir, tmp_path):
    export_hf.import_hf(str(mixtral_dir), str(tmp_path / "back"))
    original = torch.load(moe_out_dir / "model.pt", weights_only=True)
    back = torch.load(tmp_path / "back" / "model.pt", weights_only=True)
    assert back.keys() == original.keys()
    assert all(torch.equal(back[name], original[name]) for name in original)
    back_config, config = (json.loads((d / "config.json").read_text())
                           for d in (tmp_path / "back", moe_out_dir))  # fmt: skip
    back_config.pop("tokenizer_sha256"), config.pop("tokenizer_sha256")  # (their tokenizers')
    assert back_config == config


def copy_with(hf_dir, dst, tensors: dict, config: dict | None = None):
    """dst: hf_dir's tokenizer and config.json (or `config`), with `tensors` as its weights."""
    dst.mkdir()
    save_file({name: t.contiguous() for name, t in tensors.items()}, dst / "model.safetensors")
    config = config or json.loads((hf_dir / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    return dst


def test_from_hf_reads_what_transformers_saves_and_its_fused_experts(
    moe_out_dir, mixtral_dir, tmp_path
):
    transformers = pytest.importorskip("transformers")
    original = torch.load(moe_out_dir / "model.pt", weights_only=True)
    theirs = transformers.MixtralForCausalLM.from_pretrained(mixtral_dir).eval()
    theirs.save_pretrained(tmp_path / "saved")  # transformers' own config.json and files
    (tmp_path / "saved" / "tokenizer.json").write_bytes(
        (mixtral_dir / "tokenizer.json").read_bytes()
    )
    # transformers 5 holds the experts fused: mlp.experts.gate_up_proj (E, 2 ffn, d), ...
    fused = theirs.state_dict()
    if "model.layers.0.mlp.experts.gate_up_proj" not in fused:
        pytest.skip(f"transformers {transformers.__version__} holds the experts one by one")
    copy_with(tmp_path / "saved", tmp_path / "fused", fused)
    for source in ("saved", "fused"):
        export_hf.import_hf(str(tmp_path / source), str(tmp_path / f"{source}_out"))
        back = torch.load(tmp_path / f"{source}_out" / "model.pt", weights_only=True)
        assert back.keys() == original.keys(), source
        assert all(torch.equal(back[name], original[name]) for name in original), source


def test_from_hf_refuses_a_mixtral_whose_experts_do_not_fit_its_config(mixtral_dir, tmp_path):
    tensors = load_file(mixtral_dir / "model.safetensors")
    config = json.loads((mixtral_dir / "config.json").read_text())
    missing = {n: t for n, t in tensors.items() if ".experts.3.w2." not in n}
    bad = copy_with(mixtral_dir, tmp_path / "missing", missing)
    with pytest.raises(ValueError, match=r"lacks 2 tensors .* layers\.0\.feed_forward\.w2 "
                                         r"\(expert 3\)"):  # fmt: skip
        export_hf.import_hf(str(bad), str(tmp_path / "o1"))
    fewer = copy_with(mixtral_dir, tmp_path / "fewer", tensors, {**config, "num_local_experts": 3})
    with pytest.raises(ValueError, match=r"holds model\.layers\.0\.block_sparse_moe\.experts\.3"
                                         r".*\(2 layers, 3 experts\) does not have"):  # fmt: skip
        export_hf.import_hf(str(fewer), str(tmp_path / "o2"))
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
