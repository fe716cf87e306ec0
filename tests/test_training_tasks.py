"""Specification of --eval-tasks (lib/extras/training_tasks.py): at each evaluation a lesson scores
zero-shot tasks through its own forward, however the model is split, and its figures are those
tools/evaluate.py computes on the same weights. Nothing is downloaded: the tasks are small local
files the tests write (a last-word task, LAMBADA's kind, is built in memory).
"""

import json
import random
import re

import pytest
import torch
from conftest import TEXTS, tiny_model, tiny_tokenizer
from harness import DP, REPO, cmd, run_script

from lib.extras import evaluation, training_tasks
from lib.extras.eval_tasks import choice_example
from lib.extras.evaluation import Example, Task
from model import IGNORE_INDEX, row_scores

WORDS = "the a model data train loss step rank batch token layer weight grad sum mean".split()


def task_records(count: int, seed: int = 0) -> list[dict]:
    """Questions in the words of the test corpus (harness.write_corpus), short enough that no
    context is cut (context and choice well under the runs' 32 tokens)."""
    rng = random.Random(seed)
    phrase = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))
    records = []
    for _ in range(count):
        choices, n = [], rng.randint(2, 4)
        while len(choices) < n:  # distinct: two equal choices tie, and rounding picks one
            if (choice := phrase(rng.randint(1, 3))) not in choices:
                choices.append(choice)
        records.append(
            {
                "context": phrase(4).capitalize(),
                "choices": choices,
                "label": rng.randrange(len(choices)),
            }
        )
    return records


def write_task(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# -------------------------------------------------------------------------------------------------
# The scores of a row


def test_row_scores_are_each_rows_log_likelihood_and_its_non_greedy_targets():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    targets = torch.randint(0, 11, (3, 5))
    targets[0, 1:4] = logits[0, 1:4].argmax(-1)  # row 0: greedy at 1, 2, 3 ...
    targets[0, 0] = targets[0, 4] = IGNORE_INDEX  # ... and nothing else counted
    targets[2] = IGNORE_INDEX  # row 2: nothing to score
    scores = row_scores(logits, targets)  # (3, 2)
    log_probs = logits.log_softmax(-1)
    for b in range(3):
        kept = [(t, int(targets[b, t])) for t in range(5) if targets[b, t] != IGNORE_INDEX]
        ll = sum(float(log_probs[b, t, token]) for t, token in kept)
        misses = sum(int(logits[b, t].argmax()) != token for t, token in kept)
        assert float(scores[b, 0]) == pytest.approx(ll, abs=1e-5)
        assert int(scores[b, 1]) == misses
    assert int(scores[0, 1]) == 0 and int(scores[1, 1]) > 0


@pytest.mark.quick
def test_shards_of_the_rows_give_tools_evaluates_figures(tmp_path):
    """Two data-parallel shards in batches of 3 rows, their sums added: every task's figures
    are evaluation.evaluate's (tools/evaluate.py's) on the same model, LAMBADA's kind too."""
    tokenizer = tiny_tokenizer(tmp_path)
    model = tiny_model(tokenizer.get_vocab_size()).eval()  # a window of 64 tokens
    choice = Task("mine", [choice_example(r["context"], r["choices"], r["label"])
                           for r in task_records(12)])  # fmt: skip
    # A last-word task of requests the model gets right (its own greedy next token, where that
    # token is the continuation's only one) and of one it gets wrong.
    last = [Example([("The model", " loss")], 0, [4])]
    for cut in range(5, 40, 3):
        context = TEXTS[0][:cut]
        with torch.no_grad():
            ids = torch.tensor([[tokenizer.bot_id, *tokenizer.encode(context)]])
            token = int(model(ids)[0, -1].argmax())
        word = tokenizer.decode([token])
        if word.strip() and evaluation.encode_pair(tokenizer, context, word)[1] == [token]:
            last.append(Example([(context, word)], 0, [len(word)]))
    last_word = Task("last", last, kind="last_word")
    rows = training_tasks.TaskRows([choice, last_word], tokenizer, seq_length=64)
    totals = sum(
        training_tasks.TaskShard(rows, rank, 2, 3, torch.device("cpu")).score(
            lambda x, y: model(x, y, scores=True)
        )
        for rank in range(2)
    )
    ours = training_tasks.results(rows, totals)
    expected = evaluation.evaluate(model, tokenizer, [choice, last_word], window=64)
    assert ours.keys() == expected.keys()
    for name in expected:
        for metric, value in expected[name].items():
            close = pytest.approx(value, rel=1e-5) if isinstance(value, float) else value
            assert ours[name][metric] == close, (name, metric)
    assert 0 < expected["last"]["acc"] < 1  # both kinds of greedy check were made


def test_row_scores_on_the_vocabulary_shards_of_tp_are_the_whole_logits():
    # train_tp.py's logits are sharded over the vocabulary (loss_parallel): the greedy check
    # must see the largest logit of either shard.
    env = {"PYTHONPATH": str(REPO)}
    proc = run_script("tests/row_scores_sharded.py", [], world=2, env=env)
    # (Two processes print to one pipe: a line's newline may come after the other's line.)
    assert sorted(re.findall(r"rank \d: (?:same|differ)", proc.stdout)) == [
        "rank 0: same",
        "rank 1: same",
    ], proc.stdout


# -------------------------------------------------------------------------------------------------
# Bad input


def test_a_bad_eval_tasks_ends_in_one_line_before_training(corpus, cache_dir, tmp_path):
    bad = write_task(tmp_path / "bad.jsonl", [{"context": "a", "choices": ["b", "c"], "label": 5}])
    for spec, message in [
        ("nope", "--eval-tasks: unknown task 'nope'"),
        (bad, f"--eval-tasks: task file {bad} line 1: label 5 is out of range"),
        (str(tmp_path / "missing.jsonl"), "does not exist"),
    ]:
        out = tmp_path / "out"
        proc = run_script(DP, cmd(corpus, cache_dir, out, eval_tasks=spec), expect_rc=2)
        [line] = proc.stderr.strip().splitlines()
        assert message in line, proc.stderr
        assert not (out / "metrics.jsonl").exists()  # refused before any step


# -------------------------------------------------------------------------------------------------
# Every lesson, on two ranks


LESSON_RUNS = [
    ("train_dp.py", 1, {}),
    ("train_ddp.py", 2, {}),
    ("train_fsdp.py", 2, {}),
    ("train_tp.py", 2, {"tp": 2}),
    ("train_pp.py", 2, {"pp": 2}),
    ("train_cp.py", 2, {"cp": 2}),
    ("train_ep.py", 2, {"ep": 2, "num_experts": 2, "experts_per_token": 1}),
]


@pytest.mark.parametrize("lesson,world,flags", LESSON_RUNS, ids=[r[0] for r in LESSON_RUNS])
def test_a_lessons_figures_are_tools_evaluates_on_its_weights(
    lesson, world, flags, corpus, cache_dir, tmp_path
):
    """One step, evaluated after it: what the lesson logged for the tasks is what
    tools/evaluate.py computes from the run's model.pt (the same weights)."""
    task = write_task(tmp_path / "mine.jsonl", task_records(24))
    out = tmp_path / "out"
    steps = {"max_steps": 1, "warmup_steps": 1, "eval_interval": 1, "save_interval": 1}
    argv = cmd(corpus, cache_dir, out, **steps, **flags, eval_tasks=task)
    proc = run_script(lesson, argv, world=world)
    assert "mine acc_norm" in proc.stdout + proc.stderr  # in the log line
    [logged] = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                if "val_loss" in r]  # fmt: skip
    run_script("tools/evaluate.py", [str(out), "--tasks", task, "--device", "cpu"])
    expected = json.loads((out / "eval.json").read_text())["mine"]
    assert expected["truncated"] == 0 and expected["examples"] == 24
    assert logged["mine_acc"] == expected["acc"]
    assert logged["mine_acc_norm"] == expected["acc_norm"]
