"""The tasks lib/extras/evaluation.py scores: six benchmarks read from the Hugging Face hub, as
lm-evaluation-harness's task files define them, and a user's own from a local file.

    tasks = [load_task(name, limit) for name, limit in parse_tasks("hellaswag:500,mine.jsonl")]

A hub task is read with `datasets` under its usual name (downloaded once, then from the cache;
HF_DATASETS_OFFLINE=1 reads the cache only). Each turns a record into an Example exactly as the
task's YAML in lm-eval does (lm_eval/tasks/<task>/): the same prompt, choices, gold index and
split (the test split where lm-eval uses it, else validation).

A local task is a .jsonl file (one JSON object a line), a .json file (a list of such objects,
or JSON lines) or a .parquet file, whose records have three fields:

    {"context": "Question: What do bees make?\\nAnswer:", "choices": ["honey", "milk"], "label": 0}

context: a string (may be empty); choices: a list of at least two non-empty strings; label:
the index of the right choice. Each choice is scored as the continuation " " + choice (the
target delimiter) after the context. The task is named after the file's stem (mine.jsonl:
"mine"). Any other fields are ignored; a record that breaks these rules stops the run with one
line naming the file, the record and what is wrong.

`NAME:N` evaluates the first N examples only (lm-eval's --limit).
"""

import json
import os
import re

from lib.extras.evaluation import TARGET_DELIMITER, Example, Task

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
FIELDS = ("context", "choices", "label")

# -------------------------------------------------------------------------------------------------
# The hub's tasks: lm-eval's prompt for each record


def hellaswag_text(text: str) -> str:
    """lm-eval's hellaswag preprocess: WikiHow's "[title]" marks and other brackets removed."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def choice_example(context: str, choices: list[str], label: int) -> Example:
    """Choices that share one context: continuations " " + choice; acc_norm divides by the
    choice's length."""
    requests = [(context, TARGET_DELIMITER + choice) for choice in choices]
    return Example(requests, label, [len(choice) for choice in choices])


def hellaswag(doc: dict) -> Example:
    context = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    query = hellaswag_text(doc["activity_label"] + ": " + context)
    return choice_example(query, [hellaswag_text(e) for e in doc["endings"]], int(doc["label"]))


def arc(doc: dict) -> Example:
    choices = doc["choices"]
    label = choices["label"].index(doc["answerKey"])
    return choice_example(f"Question: {doc['question']}\nAnswer:", list(choices["text"]), label)


def piqa(doc: dict) -> Example:
    return choice_example(
        f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]], int(doc["label"])
    )


def winogrande(doc: dict) -> Example:
    """The blank filled with each option is the context; what follows it, the continuation,
    is the same for both (lm-eval's "multiple input" form: only acc)."""
    sentence = doc["sentence"]
    blank = sentence.index("_")
    ending = TARGET_DELIMITER + sentence[blank + 1 :].strip()
    contexts = [sentence[:blank] + doc["option1"], sentence[:blank] + doc["option2"]]
    # lm-eval's completion_len is the length of each "choice", here each context
    return Example(
        [(c, ending) for c in contexts], {"1": 0, "2": 1}[doc["answer"]], [len(c) for c in contexts]
    )


def lambada(doc: dict) -> Example:
    """The text less its last word; the continuation " " + that word."""
    words = doc["text"].split(" ")
    return Example([(" ".join(words[:-1]), " " + words[-1])], 0, [len(words[-1])])


# name: (dataset path, its configuration, split, record -> Example, kind, acc_norm reported)
HUB_TASKS = {
    "hellaswag": ("Rowan/hellaswag", None, "validation", hellaswag, "choice", True),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test", arc, "choice", True),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test", arc, "choice", True),
    "piqa": ("baber/piqa", None, "validation", piqa, "choice", True),
    "winogrande": ("allenai/winogrande", "winogrande_xl", "validation", winogrande, "choice",
                   False),
    "lambada_openai": ("EleutherAI/lambada_openai", "default", "test", lambada, "last_word",
                       False),
}  # fmt: skip


def load_hub_task(name: str, limit: int | None = None) -> Task:
    """A hub task's first `limit` examples (all: None); ValueError if it cannot be read."""
    import datasets

    path, config, split, convert, kind, norm = HUB_TASKS[name]
    try:
        records = datasets.load_dataset(path, config, split=split)
    except Exception as e:  # noqa: BLE001 - offline and not cached, no such dataset, ...
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"task {name}: cannot read {path} ({reason}); it is downloaded once "
            f"with network access, then read from the cache"
        ) from e
    if limit is not None:
        records = records.select(range(min(limit, len(records))))
    return Task(name, [convert(doc) for doc in records], kind, norm)


# -------------------------------------------------------------------------------------------------
# A local task file


def read_records(path: str) -> list[tuple[str, object]]:
    """(where, record) of each record of a task file: where is "line N" or "record N"."""
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet

            rows = pyarrow.parquet.read_table(path).to_pylist()
            return [(f"record {i}", row) for i, row in enumerate(rows, 1)]
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"task file {path}: cannot read it ({e})") from e
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a file that is not parquet
        raise ValueError(f"task file {path}: not a parquet file ({e})") from e
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            return [(f"record {i}", r) for i, r in enumerate(json.loads(text), 1)]
        except json.JSONDecodeError as e:
            raise ValueError(f"task file {path}: not JSON ({e})") from e
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"task file {path} line {number}: not JSON ({e})") from e
    return records


def check_record(record) -> str | None:
    """What is wrong with a task file's record, or None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object with {', '.join(FIELDS)}"
    if missing := [name for name in FIELDS if name not in record]:
        return f"no field {', '.join(missing)} (a record has {', '.join(FIELDS)})"
    context, choices, label = (record[name] for name in FIELDS)
    if not isinstance(context, str):
        return f"context is a {type(context).__name__}, not a string"
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        return "choices is not a list of strings"
    if len(choices) < 2:
        return f"{len(choices)} choice(s); a question has two at least"
    if empty := [i for i, c in enumerate(choices) if not c.strip()]:
        return f"choice {empty[0]} is empty"
    if isinstance(label, bool) or not isinstance(label, int):
        return f"label {label!r} is not an integer"
    if not 0 <= label < len(choices):
        return f"label {label} is out of range: {len(choices)} choices, 0 to {len(choices) - 1}"
    return None


def load_file_task(path: str, limit: int | None = None) -> Task:
    """A local task file's first `limit` examples; ValueError naming the first bad record."""
    name = os.path.splitext(os.path.basename(path))[0]
    examples = []
    for where, record in read_records(path)[:limit]:
        if (problem := check_record(record)) is not None:
            raise ValueError(f"task file {path} {where}: {problem}")
        examples.append(choice_example(record["context"], record["choices"], record["label"]))
    if not examples:
        raise ValueError(f"task file {path} holds no examples")
    return Task(name, examples)


# -------------------------------------------------------------------------------------------------
# --tasks


def parse_tasks(text: str) -> list[tuple[str, int | None]]:
    """ "hellaswag:500,mine.jsonl" -> [("hellaswag", 500), ("mine.jsonl", None)]; ValueError
    for an unknown name, a missing file or a bad N, before anything is read."""
    specs = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, colon, number = item.rpartition(":")
        if not colon or not number.isdecimal():
            name, number = item, ""
        if number and int(number) < 1:
            raise ValueError(f"task {item}: N must be 1 or more")
        if name not in HUB_TASKS and not name.endswith(FILE_SUFFIXES):
            raise ValueError(
                f"unknown task {name!r}: give one of {', '.join(HUB_TASKS)}, or a "
                f"{'/'.join(FILE_SUFFIXES)} file"
            )
        if name not in HUB_TASKS and not os.path.isfile(name):
            raise ValueError(f"task file {name} does not exist")
        specs.append((name, int(number) if number else None))
    if not specs:
        raise ValueError("no tasks given")
    names = [task_name(name) for name, _ in specs]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"task {twice[0]} is given twice (a file's task is named by its stem)")
    return specs


def task_name(spec: str) -> str:
    return spec if spec in HUB_TASKS else os.path.splitext(os.path.basename(spec))[0]


def load_task(spec: str, limit: int | None = None) -> Task:
    """A hub task by name, or a local task file."""
    return load_hub_task(spec, limit) if spec in HUB_TASKS else load_file_task(spec, limit)
