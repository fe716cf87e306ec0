"""--eval-tasks: tools/evaluate.py's zero-shot tasks, scored at each evaluation of a run by the
lesson's own forward, however the model is split (docs/evaluation.md). Imported only for that
flag.

A request (context, continuation) is one row of the validation's shape, (1, --seq-length): its
tokens as lm-eval reads them (lib/extras/evaluation.py's lone_row: the context cut from the left
to fit), padded on the right, with targets IGNORE_INDEX except the continuation's tokens. Then
the model's forward with scores=True (model.row_scores) gives each row's summed log-likelihood
and its count of non-greedy tokens, and both are sums like the loss: a sequence split over CP's
ranks, or the vocabulary over TP's, adds up to the same figures. So each lesson scores the rows
where it computes its validation loss (training.evaluate, or the pipeline's last stage), and its
all_reduce of the validation sums adds these up too:

    rows = prepare(args, tokenizer)                      # the tasks' rows, once per process
    shard = TaskShard(rows, dp_rank, dp, micro_batch, device)  # this replica's share
    totals = shard.score(forward)                        # forward(x, y) -> (B, 2): (R, 2) sums
    ... all_reduce(totals) over the data-parallel ranks ...
    results(rows, totals)                                # {task: evaluation.task_results}

Every rank of a replica runs the same forwards (each is a collective under FSDP, TP, PP, CP and
EP), and every replica as many, padding rows topped up: no rank waits for another. The figures
are tools/evaluate.py's on the same weights (tests/test_training_tasks.py holds them to it),
with two differences, both documented: the rows are the lone ones (tools/evaluate.py scores the
choices of one context in one row: the same sums, within float rounding), and a context is cut
to --seq-length tokens, not to the model's max_position_embeddings.
"""

import functools
import math

import torch

from lib.distributed import main_process_first
from lib.extras import eval_tasks, evaluation
from model import IGNORE_INDEX


def check_flag(parser, args) -> None:
    """parser.error, at start, for a bad --eval-tasks: an unknown name, a missing file, a bad N
    or record, a hub task that cannot be read (each a line of its own)."""
    try:
        with main_process_first():  # a hub task is downloaded (or read from the cache) once
            load_tasks(args.eval_tasks)
    except ValueError as e:
        parser.error(f"--eval-tasks: {e}")


@functools.cache  # read once per process: checked at start, planned after the tokenizer
def load_tasks(spec: str) -> tuple[evaluation.Task, ...]:
    """The tasks of --eval-tasks NAME_OR_FILE[:N],... (eval_tasks.parse_tasks' syntax)."""
    return tuple(eval_tasks.load_task(name, n) for name, n in eval_tasks.parse_tasks(spec))


class TaskRows:
    """Every request of the tasks as a row of seq_length tokens (evaluation.Row: its tokens, and
    where its continuation's tokens are predicted), padded only when a batch is made (`batch`):
    a task of 10,000 questions at a long window would take gigabytes as one padded tensor. Per
    task, its first row and the requests whose context was cut to fit."""

    def __init__(self, tasks, tokenizer, seq_length: int):
        self.tasks, self.starts, self.truncated, self.rows = list(tasks), [], [], []
        self.seq_length, self.pad_id = seq_length, tokenizer.pad_id
        for task in self.tasks:
            requests = [request for example in task.examples for request in example.requests]
            # share=False: one request a row, in order (each its own targets)
            rows, truncated = evaluation.plan_rows(tokenizer, requests, seq_length, share=False)
            self.starts.append(len(self.rows))
            self.truncated.append(truncated)
            self.rows += rows

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, ids: list[int], size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y (size, seq_length) of the rows `ids`, then rows of padding: x padded with the
        pad token, y IGNORE_INDEX but at the continuation's tokens."""
        x = torch.full((size, self.seq_length), self.pad_id, dtype=torch.long)
        y = torch.full((size, self.seq_length), IGNORE_INDEX, dtype=torch.long)
        for b, row in enumerate(self.rows[i] for i in ids):
            [(_, at, tokens)] = row.targets  # (a lone row: one request)
            x[b, : len(row.tokens)] = torch.tensor(row.tokens)
            y[b, at] = torch.tensor(tokens)
        return x, y


@functools.cache  # once per process: ValidationShard and the loop ask for the same rows
def _prepare(spec: str, tokenizer, seq_length: int) -> TaskRows:
    return TaskRows(load_tasks(spec), tokenizer, seq_length)


def prepare(args, tokenizer) -> TaskRows:
    """The rows of --eval-tasks for this run's tokenizer and --seq-length."""
    return _prepare(args.eval_tasks, tokenizer, args.seq_length)


class TaskShard:
    """The rows a data-parallel replica scores: every `ranks`-th from `rank` on, in batches of
    `rows`, as many batches on every replica (the longest share's count), a short one topped up
    with padding rows (all targets IGNORE_INDEX: nothing to any sum)."""

    def __init__(self, task_rows: TaskRows, rank: int, ranks: int, rows: int, device):
        self.task_rows, self.rows, self.device = task_rows, rows, device
        self.mine = list(range(rank, len(task_rows), ranks))
        self.num_batches = math.ceil(math.ceil(len(task_rows) / ranks) / rows)

    def batches(self):
        """(row ids, x, y) of each batch on the device; x, y (rows, T), the ids of its real rows."""
        for b in range(self.num_batches):
            ids = self.mine[b * self.rows : (b + 1) * self.rows]
            x, y = self.task_rows.batch(ids, self.rows)
            yield ids, x.to(self.device), y.to(self.device)

    @torch.no_grad()
    def score(self, forward) -> torch.Tensor:
        """(R, 2) in float64 on the device: each row of this share's (log-likelihood, misses), zero
        for the others' rows. forward(x, y) -> (rows, 2), the lesson's forward with scores=True;
        (on a pipeline's stages but the last, zeros of any shape: they hold none)."""
        totals = torch.zeros(len(self.task_rows), 2, dtype=torch.float64, device=self.device)
        for ids, x, y in self.batches():
            scores = forward(x, y)
            if ids and scores.dim() == 2:
                totals[ids] += scores[: len(ids)].double()
        return totals


def results(task_rows: TaskRows, totals: torch.Tensor) -> dict[str, dict]:
    """{task: evaluation.task_results} from every row's (log-likelihood, misses), summed over
    the ranks (R, 2)."""
    out, values = {}, totals.tolist()
    where = zip(task_rows.starts, task_rows.truncated, strict=True)
    for task, (start, truncated) in zip(task_rows.tasks, where, strict=True):
        count = sum(len(example.requests) for example in task.examples)
        scores = [(ll, misses == 0) for ll, misses in values[start : start + count]]
        out[task.name] = evaluation.task_results(
            task, evaluation.task_totals(task, scores, truncated)
        )
    return out


class Results:
    """results(task_rows, scores) for this run's tasks, called with evaluate()'s rows: the
    loop's, with every rank's (R x 2) scores summed."""

    def __init__(self, args, tokenizer):
        self.task_rows = prepare(args, tokenizer)  # (made once: ValidationSet's rows)

    def __call__(self, scores: torch.Tensor) -> dict[str, dict]:
        return results(self.task_rows, scores.view(-1, 2).cpu())


def figures(results: dict[str, dict]) -> dict[str, float]:
    """metrics.jsonl's keys for the results: TASK_acc, TASK_acc_norm (where the task has it),
    TASK_perplexity (a last-word task's)."""
    out = {}
    for name, result in results.items():
        for metric in ("acc", "acc_norm", "perplexity"):
            if result.get(metric) is not None:
                out[f"{name}_{metric}"] = result[metric]
    return out


def describe(results: dict[str, dict]) -> str:
    """The log line's part, "TASK acc_norm A, TASK acc B, ...": acc_norm where the task has it."""
    parts = []
    for name, result in results.items():
        metric = "acc_norm" if result["acc_norm"] is not None else "acc"
        parts.append(f"{name} {metric} {result[metric]:.4f}")
    return ", ".join(parts)
