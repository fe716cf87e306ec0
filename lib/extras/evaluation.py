"""Zero-shot multiple choice, scored as lm-evaluation-harness scores it: what tools/evaluate.py
runs on a finished run (and what a lesson's --eval-tasks will run during training).

    tasks = [eval_tasks.load_task("hellaswag", limit=500)]          # lib/extras/eval_tasks.py
    results = evaluate(model, tokenizer, tasks, window=model.config.max_position_embeddings)
    results["hellaswag"]["acc_norm"]                                 # 0.25 is chance

Each choice of an example is a (context, continuation) pair of strings, the continuation
starting with the target delimiter " " (" " + choice). Its score is the log-likelihood the model
gives the continuation's tokens after the context's, summed (lm-eval's `loglikelihood`):

- acc: the choice with the highest sum is the answer (ties: the first, as numpy's argmax);
- acc_norm: that sum divided by the choice's length in characters (the choice without the
  delimiter: lm-eval's `completion_len`), so long answers are not penalised for their length;
- a last-word task (LAMBADA): acc is whether every continuation token is the model's greedy
  choice, and perplexity is exp(-mean log-likelihood of the last word);
- each accuracy's standard error is the sample standard deviation (n - 1) over sqrt(n), lm-eval's
  `mean_stderr`; perplexity's is the delta method's, ppl x the stderr of the mean log-likelihood
  (lm-eval bootstraps it, with random draws: the two agree to within their noise).

The token split is lm-eval's (`TemplateLM._encode_pair` and `HFLM._loglikelihood_tokens`):
trailing spaces of the context move to the continuation; the context is encoded alone and the
context + continuation whole, and the continuation's tokens are the whole encoding's beyond the
context's length; the model reads context tokens + continuation tokens, cut from the left to the
last window + 1 tokens (lm-eval's truncation, counted here), less the last one. Every encoding
starts with the beginning-of-document token, as every training document does (and as lm-eval's
default does on this suite's export, whose tokenizer adds it); an empty context is that token.

Batched: the rows are sorted by length, longest first, and cut into padded batches of at most
`batch_tokens` tokens (padding on the right: under causal attention no real token sees it). The
choices of one example that share their context (HellaSwag's four endings, ARC's and PIQA's
answers) are one row: the context once, then each choice's tokens, each attending to the context
and to itself only, at the positions it would have alone (a mask and position ids). Winogrande's
choices differ in their contexts and are rows of their own.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

TARGET_DELIMITER = " "  # lm-eval's default target_delimiter, between a context and a choice


@dataclass
class Example:
    """One question: a (context, continuation) pair per choice, the index of the right one, and
    the length in characters that acc_norm divides each choice's log-likelihood by."""

    requests: list[tuple[str, str]]
    label: int
    lengths: list[int]


@dataclass
class Task:
    """A task's examples. kind "choice": multiple choice (acc, acc_norm); "last_word": one
    request per example (LAMBADA: acc, perplexity). norm: whether acc_norm is one of the task's
    metrics in lm-eval (not Winogrande's, where every choice has the same continuation)."""

    name: str
    examples: list[Example]
    kind: str = "choice"
    norm: bool = True
    chance: float = field(init=False)

    def __post_init__(self) -> None:
        n = max(len(self.examples), 1)
        per_example = (1 / len(e.requests) for e in self.examples)
        self.chance = 0.0 if self.kind == "last_word" else sum(per_example) / n


# -------------------------------------------------------------------------------------------------
# Tokens


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm-eval splits them (see the module's doc), the
    context's starting with the beginning-of-document token."""
    bot = [tokenizer.bot_id]
    if context == "":  # lm-eval: the prefix token is the context
        tokens = tokenizer.encode(continuation)
        return (bot, tokens) if tokens[:1] != bot else (tokens[:1], tokens[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:  # "a " + "b" -> "a" + " b": the space belongs to the word after it
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = bot + tokenizer.encode(context)
    whole = bot + tokenizer.encode(context + continuation)
    return context_ids, whole[len(context_ids) :]


@dataclass
class Row:
    """One sequence of a batch: its tokens, their RoPE positions, the branch each belongs to (0:
    the shared context and a lone request; i > 0: choice i's tokens after a shared context),
    and for each request in it, (request id, the indices whose logits predict its tokens, the
    tokens)."""

    tokens: list[int]
    positions: list[int]
    branches: list[int]
    targets: list[tuple[int, list[int], list[int]]]


def lone_row(request: int, context: list[int], continuation: list[int], window: int) -> Row:
    """A request alone: context + continuation, cut to the last window + 1 tokens, less the
    last (lm-eval's input); the continuation's tokens are predicted by the last positions."""
    tokens = (context + continuation)[-(window + 1) :][:-1]
    n, m = len(tokens), len(continuation)
    return Row(tokens, list(range(n)), [0] * n, [(request, list(range(n - m, n)), continuation)])


def shared_row(requests: list[int], context: list[int], continuations: list[list[int]]) -> Row:
    """Requests with one context: the context once, then each continuation less its last token
    (branch i). Its first token is predicted by the context's last position, each next one by
    its own previous token, at the positions it would have after the context alone."""
    tokens, positions, branches = list(context), list(range(len(context))), [0] * len(context)
    targets = []
    for branch, (request, continuation) in enumerate(zip(requests, continuations, strict=True), 1):
        start = len(tokens)
        inputs = continuation[:-1]
        tokens += inputs
        positions += range(len(context), len(context) + len(inputs))
        branches += [branch] * len(inputs)
        predictors = [len(context) - 1, *range(start, start + len(inputs))]
        targets.append((request, predictors, continuation))
    return Row(tokens, positions, branches, targets)


def plan_rows(
    tokenizer, requests: list[tuple[str, str]], window: int, share: bool = True
) -> tuple[list[Row], set[int]]:
    """The rows that score `requests` (a list of (context, continuation)), and the ids of the
    requests whose context was cut from the left to fit the window. Requests in a row next to
    each other with the same context share a row where it fits in the window (share)."""
    encoded = [encode_pair(tokenizer, context, cont) for context, cont in requests]
    for i, (_, continuation) in enumerate(encoded):
        if not continuation:
            raise ValueError(f"request {i}: the continuation {requests[i][1]!r} has no tokens")
        if len(continuation) > window:
            raise ValueError(
                f"request {i}: the continuation alone has {len(continuation)} "
                f"tokens, more than the model's window of {window}"
            )
    truncated = {i for i, (c, d) in enumerate(encoded) if len(c) + len(d) > window + 1}
    rows, i = [], 0
    while i < len(encoded):
        j = i + 1  # the requests i..j-1 have the same context
        while share and j < len(encoded) and encoded[j][0] == encoded[i][0]:
            j += 1
        context, continuations = encoded[i][0], [d for _, d in encoded[i:j]]
        if j - i > 1 and len(context) + sum(len(d) - 1 for d in continuations) <= window:
            rows.append(shared_row(list(range(i, j)), context, continuations))
        else:
            rows += [lone_row(k, encoded[k][0], encoded[k][1], window) for k in range(i, j)]
        i = j
    return rows, truncated


# -------------------------------------------------------------------------------------------------
# Scores


def batches(rows: list[Row], batch_tokens: int) -> list[list[Row]]:
    """The rows, longest first, in batches of at most batch_tokens padded tokens (one row at
    least)."""
    ordered = sorted(rows, key=lambda row: -len(row.tokens))
    out = []
    for row in ordered:  # the first row of a batch is its longest: its length x rows
        if out and len(out[-1][0].tokens) * (len(out[-1]) + 1) <= batch_tokens:
            out[-1].append(row)
        else:
            out.append([row])
    return out


def batch_inputs(batch: list[Row], pad_id: int, device) -> dict:
    """The model's inputs for a batch: input_ids (B, T), right-padded; where a row shares a
    context, also attn_mask (B, 1, T, T), True where a query may attend to a key (earlier, and
    of the context or its own branch), and position_ids (B, T)."""
    T = len(batch[0].tokens)
    pad = [T - len(row.tokens) for row in batch]
    ids = torch.tensor(
        [row.tokens + [pad_id] * p for row, p in zip(batch, pad, strict=True)], device=device
    )
    if not any(any(row.branches) for row in batch):
        return {"input_ids": ids}  # plain causal attention: the fast path
    branches = torch.tensor(
        [row.branches + [-1] * p for row, p in zip(batch, pad, strict=True)], device=device
    )
    positions = torch.tensor(
        [row.positions + [0] * p for row, p in zip(batch, pad, strict=True)], device=device
    )
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (T, T)
    query, key = branches[:, :, None], branches[:, None, :]  # (B, T, 1), (B, 1, T)
    mask = causal & ((key == 0) | (key == query))  # (B, T, T); padding (-1) sees itself
    return {"input_ids": ids, "attn_mask": mask[:, None], "position_ids": positions}


@torch.no_grad()
def score_requests(
    model: Callable,
    tokenizer,
    requests: list[tuple[str, str]],
    window: int,
    share: bool = True,
    batch_tokens: int = 4096,
    device=None,
) -> tuple[list[tuple[float, bool]], set[int]]:
    """(log-likelihood, is_greedy) of each (context, continuation), as lm-eval's loglikelihood
    returns them, and the ids of the requests cut to the window. model(input_ids, attn_mask=...,
    position_ids=...) -> logits (B, T, vocab); with share=False, model(input_ids) alone."""
    rows, truncated = plan_rows(tokenizer, requests, window, share)
    results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    for batch in batches(rows, batch_tokens):
        logits = model(**batch_inputs(batch, tokenizer.pad_id, device))  # (B, T, vocab)
        T = logits.size(1)
        flat = [b * T + i for b, row in enumerate(batch) for _, at, _ in row.targets for i in at]
        chosen = logits.flatten(0, 1)[torch.tensor(flat, device=logits.device)]  # (N, vocab)
        log_probs = chosen.float().log_softmax(-1)  # in fp32, whatever the model's dtype
        targets = [t for row in batch for _, _, tokens in row.targets for t in tokens]
        targets = torch.tensor(targets, device=logits.device)
        picked = log_probs.gather(1, targets[:, None])[:, 0]  # (N,)
        greedy = log_probs.argmax(-1) == targets  # (N,)
        start = 0
        for row in batch:
            for request, _, tokens in row.targets:
                end = start + len(tokens)
                results[request] = (float(picked[start:end].sum()), bool(greedy[start:end].all()))
                start = end
    return results, truncated


# -------------------------------------------------------------------------------------------------
# Metrics

# A task's sums, what ranks add up (all_reduce) before the metrics are read from them.
TOTALS = ("examples", "acc", "acc_norm", "ll", "ll_squared", "truncated")


def first_max(values: list[float]) -> int:
    """The index of the largest value, the first of equal ones (numpy's argmax)."""
    return max(range(len(values)), key=values.__getitem__)


def task_totals(task: Task, scores: list[tuple[float, bool]], truncated: set[int]) -> torch.Tensor:
    """The sums TOTALS names, in float64, of `task`'s examples, whose requests were scored in
    order (score_requests's results and truncated ids)."""
    totals = torch.zeros(len(TOTALS), dtype=torch.float64)
    start = 0
    for example in task.examples:
        ids = range(start, start + len(example.requests))
        start += len(example.requests)
        lls = [scores[i][0] for i in ids]
        if task.kind == "last_word":
            acc, acc_norm, ll = float(scores[ids[0]][1]), 0.0, lls[0]
        else:
            normed = [ll / length for ll, length in zip(lls, example.lengths, strict=True)]
            acc = float(first_max(lls) == example.label)
            acc_norm, ll = float(first_max(normed) == example.label), lls[example.label]
        cut = float(any(i in truncated for i in ids))
        totals += torch.tensor([1.0, acc, acc_norm, ll, ll * ll, cut], dtype=torch.float64)
    return totals


def mean_stderr(total: float, total_squared: float, n: int) -> float | None:
    """The standard error of a mean from the sum of its values and of their squares: the
    sample standard deviation (n - 1) / sqrt(n), lm-eval's mean_stderr; None for one value."""
    if n < 2:
        return None
    variance = max(total_squared - total * total / n, 0.0) / (n - 1)
    return math.sqrt(variance / n)


def task_results(task: Task, totals: torch.Tensor) -> dict:
    """eval.json's entry of a task from its totals: acc, acc_norm (None where lm-eval reports
    none), their standard errors, examples, chance, truncated (examples whose context was cut);
    a last-word task's perplexity and its standard error too."""
    n, acc, acc_norm, ll, ll_squared, cut = totals.tolist()
    n = int(n)
    if n == 0:
        raise ValueError(f"task {task.name} has no examples")
    # acc is 0 or 1, so the sum of its squares is its sum
    result = {"acc": acc / n, "acc_stderr": mean_stderr(acc, acc, n)}
    norm = task.kind == "choice" and task.norm
    result["acc_norm"] = acc_norm / n if norm else None
    result["acc_norm_stderr"] = mean_stderr(acc_norm, acc_norm, n) if norm else None
    if task.kind == "last_word":
        perplexity = math.exp(-ll / n)
        se = mean_stderr(ll, ll_squared, n)
        result["perplexity"] = perplexity
        result["perplexity_stderr"] = None if se is None else perplexity * se
    return result | {"examples": n, "chance": task.chance, "truncated": int(cut)}


def evaluate(model, tokenizer, tasks: list[Task], window: int, **scoring) -> dict[str, dict]:
    """{task name: task_results} of each task, scored on one process (score_requests's
    keywords: share, batch_tokens, device)."""
    results = {}
    for task in tasks:
        requests = [request for example in task.examples for request in example.requests]
        scores, truncated = score_requests(model, tokenizer, requests, window, **scoring)
        results[task.name] = task_results(task, task_totals(task, scores, truncated))
    return results
