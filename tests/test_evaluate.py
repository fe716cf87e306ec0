"""Specification of zero-shot evaluation (lib/extras/evaluation.py, lib/extras/eval_tasks.py,
tools/evaluate.py): every choice's log-likelihood is the model's own (fp32, hand-computed from
its logits), split into tokens as lm-evaluation-harness splits them, and acc / acc_norm / their
standard errors follow lm-eval's rules; bad task files end in one line. Nothing is downloaded:
the tasks are small local files and hand-made hub records. Where lm-eval is installed
(requirements-eval.txt), one test scores the same requests with it on this suite's HF export.
"""

import json
import math
import os
import sys

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer

from lib import exits
from lib.extras import eval_tasks, evaluation
from lib.extras.evaluation import Example, Task
from tools import evaluate

# Contexts from the tiny tokenizer's own texts (conftest.TEXTS), so that its merges apply.
RECORDS = [
    {"context": "def add(x, y):\n   ", "choices": ["return x + y", "return self.batch", "x"],
     "label": 0},
    {"context": "The model reads the data and", "choices": ["the loss goes down.", "y"],
     "label": 0},
    {"context": "class Rank:\n    def", "choices": ["step(self):", "add(x, y):"], "label": 1},
    {"context": "", "choices": ["def add", "class Rank"], "label": 1},
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model(tokenizer.get_vocab_size())  # fp32, a window of 64 tokens


def write_task(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def by_hand(model, tokenizer, context: str, continuation: str) -> float:
    """The log-likelihood of the continuation, from one forward of BOT + the whole text: the
    context's trailing white space goes to the continuation, whose tokens are those of the
    whole encoding beyond the context's."""
    context_ids = [tokenizer.bot_id] + tokenizer.encode(context.rstrip())
    whole = [tokenizer.bot_id] + tokenizer.encode(context + continuation)
    with torch.no_grad():
        logits = model(torch.tensor([whole[:-1]]))[0].double()  # (T, vocab)
    log_probs = logits.log_softmax(-1)
    return sum(float(log_probs[i - 1, whole[i]]) for i in range(len(context_ids), len(whole)))


# -------------------------------------------------------------------------------------------------
# Tokens and scores


@pytest.mark.quick
def test_a_pair_is_split_as_lm_eval_splits_it(tokenizer):
    bot = tokenizer.bot_id
    context, continuation = evaluation.encode_pair(tokenizer, "def add(x, y): ", "return")
    # the trailing space moves to the continuation: " return" is encoded as in the whole text
    assert context == [bot] + tokenizer.encode("def add(x, y):")
    assert context + continuation == [bot] + tokenizer.encode("def add(x, y): return")
    # an empty context is the beginning-of-document token alone
    assert evaluation.encode_pair(tokenizer, "", " x") == ([bot], tokenizer.encode(" x"))


@pytest.mark.quick
def test_every_choices_log_likelihood_is_the_models_own(model, tokenizer):
    requests = [(r["context"], " " + c) for r in RECORDS for c in r["choices"]]
    scores, truncated = evaluation.score_requests(model, tokenizer, requests, window=64)
    assert truncated == set()
    for (context, continuation), (ll, _) in zip(requests, scores, strict=True):
        assert ll == pytest.approx(by_hand(model, tokenizer, context, continuation), abs=1e-4)


@pytest.mark.quick
def test_choices_that_share_a_context_are_one_row_and_score_as_alone(model, tokenizer):
    requests = [(RECORDS[0]["context"], " " + c) for c in RECORDS[0]["choices"]]
    rows, _ = evaluation.plan_rows(tokenizer, requests, window=64)
    assert len(rows) == 1 and len(rows[0].targets) == 3
    shared, _ = evaluation.score_requests(model, tokenizer, requests, 64)
    alone, _ = evaluation.score_requests(model, tokenizer, requests, 64, share=False)
    for (a, greedy_a), (b, greedy_b) in zip(shared, alone, strict=True):
        assert a == pytest.approx(b, abs=1e-5) and greedy_a == greedy_b


def test_batches_of_any_size_give_the_same_scores(model, tokenizer):
    requests = [(r["context"], " " + c) for r in RECORDS for c in r["choices"]]
    one_row, _ = evaluation.score_requests(model, tokenizer, requests, 64, batch_tokens=1)
    all_rows, _ = evaluation.score_requests(model, tokenizer, requests, 64, batch_tokens=10**6)
    assert [s[0] for s in one_row] == pytest.approx([s[0] for s in all_rows], abs=1e-5)


def test_a_context_longer_than_the_window_is_cut_from_the_left_and_counted(model, tokenizer):
    context = "The model reads the data and the loss goes down. " * 12  # well over 64 tokens
    requests = [(context, " def add"), ("class Rank:", " def step")]
    scores, truncated = evaluation.score_requests(model, tokenizer, requests, window=64)
    assert truncated == {0}
    context_ids, continuation = evaluation.encode_pair(tokenizer, context, " def add")
    kept = (context_ids + continuation)[-65:]  # lm-eval's last window + 1 tokens
    with torch.no_grad():
        log_probs = model(torch.tensor([kept[:-1]]))[0].double().log_softmax(-1)
    m = len(continuation)
    expected = sum(float(log_probs[63 - m + 1 + i, t]) for i, t in enumerate(continuation))
    assert scores[0][0] == pytest.approx(expected, abs=1e-4)
    task = Task("long", [Example([r], 0, [1]) for r in requests], kind="last_word")
    assert evaluation.evaluate(model, tokenizer, [task], 64)["long"]["truncated"] == 1


# -------------------------------------------------------------------------------------------------
# Metrics


def totals_of(task, lls, greedy=None) -> dict:
    scores = [(ll, g) for ll, g in zip(lls, greedy or [False] * len(lls), strict=True)]
    return evaluation.task_results(task, evaluation.task_totals(task, scores, set()))


@pytest.mark.quick
def test_acc_takes_the_largest_sum_and_acc_norm_the_largest_per_character():
    # choice 0: -10 over 2 characters (-5 each); choice 1: -12 over 20 (-0.6 each)
    task = Task("t", [Example([("q", " ab"), ("q", " " + "x" * 20)], 1, [2, 20])])
    result = totals_of(task, [-10.0, -12.0])
    assert (result["acc"], result["acc_norm"], result["chance"]) == (0.0, 1.0, 0.5)


@pytest.mark.quick
def test_a_tie_goes_to_the_first_choice_as_numpys_argmax():
    task = Task("t", [Example([("q", " a"), ("q", " b")], 0, [1, 1])])
    assert totals_of(task, [-1.0, -1.0])["acc"] == 1.0


@pytest.mark.quick
def test_the_standard_error_is_lm_evals_mean_stderr():
    examples = [Example([("q", " a"), ("q", " b")], label, [1, 1]) for label in (0, 0, 0, 1, 1)]
    result = totals_of(Task("t", examples), [-1.0, -2.0] * 5)  # choice 0 wins every time
    hits = [1, 1, 1, 0, 0]
    mean = sum(hits) / 5
    stderr = math.sqrt(sum((h - mean) ** 2 for h in hits) / 4) / math.sqrt(5)  # n - 1, sqrt(n)
    assert result["acc"] == 0.6 and result["acc_stderr"] == pytest.approx(stderr, rel=1e-12)
    one = totals_of(Task("t", examples[:1]), [-1.0, -2.0])
    assert one["acc_stderr"] is None  # one example: no spread to measure


@pytest.mark.quick
def test_a_last_word_task_reports_greedy_accuracy_and_perplexity():
    task = Task("lambada", [Example([("a b", " c")], 0, [1]) for _ in range(2)], "last_word")
    result = totals_of(task, [-1.0, -3.0], [True, False])
    assert result["acc"] == 0.5 and result["acc_norm"] is None
    assert result["perplexity"] == pytest.approx(math.exp(2.0))
    # the delta method: perplexity x the standard error of the mean log-likelihood (1.0)
    assert result["perplexity_stderr"] == pytest.approx(math.exp(2.0) * 1.0)


# -------------------------------------------------------------------------------------------------
# The hub's tasks, from hand-made records (lm-eval's task YAMLs and utils)


@pytest.mark.quick
def test_hub_records_become_lm_evals_prompts():
    hella = eval_tasks.hellaswag({
        "activity_label": "Baking", "ctx_a": "A man mixes flour.", "ctx_b": "then he",
        "endings": ["bakes [title] it.", "sings."], "label": "0"})  # fmt: skip
    assert hella.requests[0] == ("Baking: A man mixes flour. Then he", " bakes. it.")
    assert (hella.label, hella.lengths) == (0, [10, 6])
    arc = eval_tasks.arc({"question": "Why?", "answerKey": "B",
                          "choices": {"text": ["x", "yy"], "label": ["A", "B"]}})  # fmt: skip
    assert arc.requests == [("Question: Why?\nAnswer:", " x"), ("Question: Why?\nAnswer:", " yy")]
    assert arc.label == 1
    piqa = eval_tasks.piqa({"goal": "Open a jar", "sol1": "twist", "sol2": "sing", "label": 0})
    assert piqa.requests[1] == ("Question: Open a jar\nAnswer:", " sing")
    wino = eval_tasks.winogrande({"sentence": "Tom gave Ann a book because _ was kind.",
                                  "option1": "Tom", "option2": "Ann", "answer": "2"})  # fmt: skip
    assert wino.requests == [("Tom gave Ann a book because Tom", " was kind."),
                             ("Tom gave Ann a book because Ann", " was kind.")]  # fmt: skip
    assert wino.label == 1
    lambada = eval_tasks.lambada({"text": "he opened the door"})
    assert lambada.requests == [("he opened the", " door")]


# -------------------------------------------------------------------------------------------------
# tools/evaluate.py


def run_main(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """tools/evaluate.py's main() as `python -m tools.evaluate` runs it: (code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["tools/evaluate.py", *argv])
    code = 0
    try:
        exits.run(evaluate.main)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.quick
def test_the_tool_prints_a_table_and_writes_eval_json_only(make_out_dir, tmp_path, monkeypatch,
                                                             capsys):  # fmt: skip
    out = make_out_dir()
    before = set(os.listdir(out))
    task = write_task(tmp_path / "code.jsonl", RECORDS)
    code, printed, _ = run_main(monkeypatch, capsys, str(out), "--tasks", f"{task}:3")
    assert code == 0 and printed.splitlines()[0].split()[:5] == [
        "task", "examples", "acc", "acc_norm", "chance"]  # fmt: skip
    assert set(os.listdir(out)) == before | {"eval.json"}
    result = json.loads((out / "eval.json").read_text())["code"]
    assert {"acc", "acc_norm", "acc_stderr", "acc_norm_stderr", "examples"} <= result.keys()
    assert result["examples"] == 3


@pytest.mark.quick
def test_the_tool_never_writes_over_a_file_that_is_not_an_eval_json(
    out_dir, tmp_path, monkeypatch, capsys
):
    task = write_task(tmp_path / "code.jsonl", RECORDS)
    config = out_dir / "config.json"
    before = config.read_bytes()
    code, _, err = run_main(monkeypatch, capsys, str(out_dir), "--tasks", task, "--output",
                            str(config))  # fmt: skip
    assert code == 2 and err == (
        f"error: {config} exists and is not an earlier eval.json: give another --output\n"
    )
    assert config.read_bytes() == before


def test_a_hugging_face_directory_scores_as_the_run_it_was_exported_from(
    out_dir, tmp_path, monkeypatch, capsys
):
    from tools.export_hf import export

    hf_dir = tmp_path / "hf"
    export(str(out_dir), str(hf_dir))
    task = write_task(tmp_path / "code.jsonl", RECORDS)
    scores = []
    for source in (out_dir, hf_dir):
        output = tmp_path / f"{source.name}.json"
        code, _, err = run_main(monkeypatch, capsys, str(source), "--tasks", task,
                                "--output", str(output))  # fmt: skip
        assert code == 0, err
        scores.append(json.loads(output.read_text()))
    assert scores[0] == scores[1]


@pytest.mark.parametrize(
    "record, message",
    [
        ({"context": "a", "choices": ["b", "c"]}, "line 1: no field label"),
        ({"context": "a", "choices": ["b", "c"], "label": 2}, "line 1: label 2 is out of range"),
        ({"context": "a", "choices": ["b", " "], "label": 0}, "line 1: choice 1 is empty"),
        ({"context": "a", "choices": ["b"], "label": 0}, "line 1: 1 choice(s)"),
        ({"context": 3, "choices": ["b", "c"], "label": 0}, "line 1: context is a int"),
        ({"context": "a", "choices": ["b", "c"], "label": "0"}, "line 1: label '0' is not"),
    ],
)  # fmt: skip
@pytest.mark.quick
def test_a_bad_record_ends_in_one_line_naming_it(tmp_path, monkeypatch, capsys, record, message):
    task = write_task(tmp_path / "bad.jsonl", [record])
    code, out, err = run_main(monkeypatch, capsys, str(tmp_path), "--tasks", task)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: task file {task} {message}")
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # nothing written


@pytest.mark.parametrize(
    "tasks, message",
    [
        ("hellaswag,mmlu", "unknown task 'mmlu': give one of hellaswag, arc_easy"),
        ("missing.jsonl", "task file missing.jsonl does not exist"),
        ("piqa:0", "task piqa:0: N must be 1 or more"),
        ("piqa,piqa:5", "task piqa is given twice"),
    ],
)
@pytest.mark.quick
def test_a_bad_task_name_ends_in_one_line(tmp_path, monkeypatch, capsys, tasks, message):
    code, out, err = run_main(monkeypatch, capsys, str(tmp_path), "--tasks", tasks)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: {message}")


@pytest.mark.parametrize("argv", [["--batch-tokens", "nan"], ["--batch-tok", "8"]])
@pytest.mark.quick
def test_a_bad_or_abbreviated_flag_ends_in_one_line(tmp_path, monkeypatch, capsys, argv):
    code, out, err = run_main(monkeypatch, capsys, str(tmp_path), "--tasks", "piqa", *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: ")


@pytest.mark.quick
def test_the_limit_takes_the_first_n_examples(tmp_path):
    [(name, limit)] = eval_tasks.parse_tasks(write_task(tmp_path / "code.jsonl", RECORDS) + ":2")
    task = eval_tasks.load_task(name, limit)
    assert task.name == "code" and [e.label for e in task.examples] == [0, 0]


# -------------------------------------------------------------------------------------------------
# Against lm-evaluation-harness itself


def test_every_log_likelihood_equals_lm_evals_on_the_hf_export(out_dir, tmp_path):
    huggingface = pytest.importorskip(
        "lm_eval.models.huggingface", reason="lm-eval is not installed (requirements-eval.txt)"
    )
    from lm_eval.api.instance import Instance

    from lib.checkpoints.finished_run import load_model
    from tools.export_hf import export

    hf_dir = tmp_path / "hf"
    export(str(out_dir), str(hf_dir))
    requests = [(r["context"], " " + c) for r in RECORDS for c in r["choices"]]
    requests.append(("The model reads the data and the loss goes down. " * 12, " def add"))
    lm = huggingface.HFLM(pretrained=str(hf_dir), device="cpu", dtype="float32", batch_size=4)
    instances = [Instance("loglikelihood", {}, request, i) for i, request in enumerate(requests)]
    theirs = lm.loglikelihood(instances, disable_tqdm=True)
    model, tokenizer = load_model(str(out_dir), "cpu", torch.float32)
    ours, truncated = evaluation.score_requests(model, tokenizer, requests, window=64)
    assert truncated == {len(requests) - 1}
    for (a, greedy_a), (b, greedy_b) in zip(ours, theirs, strict=True):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b


def test_hub_records_give_the_prompts_of_lm_evals_own_task_files():
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed")
    import ast
    import importlib.util
    from pathlib import Path

    import datasets
    import yaml
    from lm_eval.utils import apply_template

    folder = Path(lm_eval.__file__).parent / "tasks"

    def module(path: str):
        spec = importlib.util.spec_from_file_location(Path(path).stem, folder / path)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        return loaded

    def rendered(task_file: str, doc: dict) -> tuple[str, list[str] | None, str]:
        config = yaml.safe_load((folder / task_file).read_text())  # (no !function in these)
        choices = config.get("doc_to_choice")
        choices = ast.literal_eval(apply_template(choices, doc)) if choices else None
        target = config["doc_to_target"]
        target = doc[target] if target in doc else apply_template(target, doc)
        return apply_template(config["doc_to_text"], doc), choices, target

    hella = {"activity_label": "Baking", "ctx_a": "A man mixes [header] flour.", "ctx_b": "then he",
             "endings": ["bakes [title] it.", "sings  loudly."], "label": "1"}  # fmt: skip
    processed = module("hellaswag/utils.py").process_docs(datasets.Dataset.from_list([hella]))[0]
    example = eval_tasks.hellaswag(hella)
    assert example.requests == [(processed["query"], " " + c) for c in processed["choices"]]
    assert example.label == int(processed["label"])

    wino = {"sentence": "Tom gave Ann a book because _ was kind.", "option1": "Tom",
            "option2": "Ann", "answer": "2"}  # fmt: skip
    rules = module("winogrande/preprocess_winogrande.py")
    example = eval_tasks.winogrande(wino)
    ending = " " + rules.doc_to_target(wino)
    assert example.requests == [(c, ending) for c in rules.doc_to_choice(wino)]
    assert example.label == rules.doc_to_text(wino)

    arc = {"question": "Which is a liquid?", "answerKey": "C",
           "choices": {"text": ["ice", "steam", "water"], "label": ["A", "B", "C"]}}  # fmt: skip
    piqa = {"goal": "Open a jar", "sol1": "twist the lid", "sol2": "sing to it", "label": 0}
    for task_file, convert, doc in [("arc/arc_easy.yaml", eval_tasks.arc, arc),
                                    ("piqa/piqa.yaml", eval_tasks.piqa, piqa)]:  # fmt: skip
        text, choices, target = rendered(task_file, doc)
        example = convert(doc)
        assert example.requests == [(text, " " + c) for c in choices]
        assert example.label == int(target)
    lambada = {"text": "she looked at the map and opened the door"}
    text, _, target = rendered("lambada/lambada_openai.yaml", lambada)
    assert eval_tasks.lambada(lambada).requests == [(text, target)]
