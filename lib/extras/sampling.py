"""Text generation from a model: KV-cache decoding, greedy, temperature, top-k and top-p
sampling, and text in, text out. What tools/generate.py prints and a run's final sample.

    ids = generate(model, input_ids, 64, temperature=0.8, top_k=50)   # (B, T + generated)
    text = generate_text(model, tokenizer, "def ", 64, seed=0)
"""

import torch

from model import KVCache, LlamaForPretraining


@torch.no_grad()
def generate(
    model: LlamaForPretraining,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> torch.Tensor:
    """Continue input_ids (B, T) by up to max_new_tokens; returns (B, T + generated). With the
    KV cache the prompt runs once, then each step feeds the newest token. temperature 0 is
    greedy. Stops once every sequence has produced eos_id (then repeated)."""
    B, T = input_ids.shape
    total = T + max_new_tokens
    if total > model.config.max_position_embeddings:
        longest = f"max_position_embeddings ({model.config.max_position_embeddings})"
        raise ValueError(
            f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds the model's {longest}"
        )
    config, dtype = model.config, model.tok_embeddings.weight.dtype
    caches = None
    if use_cache:
        shape = (B, config.num_key_value_heads, total, config.head_dim)
        caches = [KVCache(*shape, input_ids.device, dtype) for _ in model.layers]
    tokens = next_input = input_ids
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        logits = model(next_input if use_cache else tokens, kv_caches=caches)[:, -1, :]  # (B, V)
        next_token = sample(logits.float(), temperature, top_k, top_p, generator)  # (B,)
        if eos_id is not None:
            next_token = torch.where(finished, eos_id, next_token)
            finished |= next_token == eos_id
        tokens = torch.cat((tokens, next_token[:, None]), dim=1)
        next_input = next_token[:, None]  # (B, 1)
        if eos_id is not None and bool(finished.all()):
            break
    return tokens


def sample(logits, temperature=1.0, top_k=None, top_p=None, generator=None) -> torch.Tensor:
    """Pick one token id per row of logits (B, V): greedy at temperature 0, else sampled."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth_best = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if top_p is not None:
        # Keep the smallest set of most likely tokens whose probability adds up to top_p.
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_logits.softmax(dim=-1) > top_p  # mass before this token > p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


# -------------------------------------------------------------------------------------------------
# Text in, text out: what tools/generate.py prints and every train script's sample at the end


def generate_text(
    model: LlamaForPretraining,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    *sampling,
    **named_sampling,
) -> str:
    """`prompt` followed by up to max_new_tokens generated tokens, stopping at the end of a
    document (the tokenizer's eot_id) or of the model's context; sampling as generate_ids."""
    ids, _ = generate_ids(model, tokenizer, prompt, max_new_tokens, *sampling, **named_sampling)
    return tokenizer.decode(ids)  # skips the special tokens: BOT, EOT


def generate_ids(
    model: LlamaForPretraining,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int | None = None,
    use_cache: bool = True,
) -> tuple[list[int], bool]:
    """generate_text's token ids ([BOT], the prompt's, the generated ones), and whether the
    model's context cut them short. temperature 0 is greedy; `seed` makes sampling reproducible."""
    model.eval()
    device = model.tok_embeddings.weight.device
    ids = [tokenizer.bot_id, *tokenizer.encode(prompt)]
    context = model.config.max_position_embeddings
    room = context - len(ids)
    if room <= 0:
        raise ValueError(
            f"the prompt is {len(ids)} tokens, no shorter than the model's context of {context}"
        )
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    out = generate(
        model,
        torch.tensor([ids], device=device),
        min(max_new_tokens, room),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=tokenizer.eot_id,
        generator=generator,
        use_cache=use_cache,
    )[0].tolist()  # T + generated
    cut = max_new_tokens > room and len(out) == context and out[-1] != tokenizer.eot_id
    return out, cut


def print_sample(args, model, tokenizer) -> None:
    """--sample-tokens' sample of a trained model, after "sample:": `prompt` and a continuation,
    generate_text with seed 0, what `python -m tools.generate --seed 0 --prompt ...
    --max-new-tokens ...` prints (on CPU too)."""
    print(f"sample:\n{sample_text(model, tokenizer, args.sample_prompt, args.sample_tokens)}")


def sample_text(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """print_sample's text: the prompt and its continuation."""
    with torch.compiler.set_stance("force_eager"):  # compiled layers: a compile per new shape
        return generate_text(model, tokenizer, prompt, max_new_tokens, seed=0)
