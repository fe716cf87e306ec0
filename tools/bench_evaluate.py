"""tools/evaluate.py's scores against lm-evaluation-harness's, on the same model and examples.

    pip install -r requirements-eval.txt                  # lm-eval: this comparison only
    python -m tools.export_hf out hf_model                # the model, as lm-eval loads it
    python -m tools.bench_evaluate hf_model --tasks mine.jsonl,hellaswag:200
    python -m tools.bench_evaluate --write-code-task assign.jsonl   # a local task, no download

For each task, every (context, continuation) request is scored twice in this process, in fp32 on
the CPU (or --device): by lm-eval's HFLM.loglikelihood (transformers' LlamaForCausalLM, its own
batching, --batch-size requests a forward) and by lib/extras/evaluation.py's score_requests
(this suite's model, read through --from-hf's conversion, --batch-tokens a forward, contexts
shared). Printed per task: the largest difference of a request's log-likelihood, whether the
greedy flags agree, how many examples' acc and acc_norm answers agree, and the seconds per
example of each (the better of --repeats timings, the model loaded once). Nothing is asserted:
a measurement (tests/test_evaluate.py holds the 1e-4 bound on a tiny model).

--write-code-task FILE writes a multiple-choice task in tools/evaluate.py's schema from Python
code this suite never trains on (torch's own .py files, not the standard library): the right-hand
side of an assignment, among four, three taken from other files' assignments (chance 0.25).
"""

import json
import os
import random
import re
import time

import torch

from lib import exits, flags
from lib.checkpoints.finished_run import load_model
from lib.extras import eval_tasks, evaluation
from tools.evaluate import run_dir
from tools.generate import device_arg


def lm_eval_scores(lm, requests: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    """lm-eval's (log-likelihood, is_greedy) of each request, through its public loglikelihood."""
    from lm_eval.api.instance import Instance

    instances = [
        Instance(request_type="loglikelihood", doc={}, arguments=request, idx=i)
        for i, request in enumerate(requests)
    ]
    return lm.loglikelihood(instances, disable_tqdm=True)


def answers(task, scores) -> list[tuple[int, int]]:
    """Each example's (acc answer, acc_norm answer) from the requests' scores, in order."""
    out, start = [], 0
    for example in task.examples:
        lls = [ll for ll, _ in scores[start : start + len(example.requests)]]
        start += len(example.requests)
        normed = [ll / n for ll, n in zip(lls, example.lengths, strict=True)]
        out.append((evaluation.first_max(lls), evaluation.first_max(normed)))
    return out


def timed(fn, repeats: int):
    """(fn()'s value, the best wall time of `repeats` calls)."""
    best, value = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - start)
    return value, best


ASSIGNMENT = re.compile(r"(\s*[A-Za-z_][\w.]* =) (\S.{2,60})")  # "    x = value", one line


def write_code_task(path: str, examples: int = 200, seed: int = 0) -> None:
    """`examples` questions: the 5 lines before an assignment and its "name =" are the context,
    the value and three others' values the choices (the value of the same line in torch's
    sources, in path order, for any machine with this torch)."""
    root = os.path.dirname(torch.__file__)
    paths = sorted(
        os.path.join(d, f) for d, _, names in os.walk(root) for f in names if f.endswith(".py")
    )
    found = []  # (context, value)
    for source in paths:
        with open(source, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines[5:], 5):
            if (match := ASSIGNMENT.fullmatch(line)) and "#" not in line:
                found.append(("\n".join(lines[i - 5 : i] + [match.group(1)]), match.group(2)))
    rng = random.Random(seed)
    chosen = rng.sample(range(len(found)), examples)
    with open(path, "w", encoding="utf-8") as f:
        for i in chosen:
            context, value = found[i]
            others = [v for _, v in rng.sample(found, 6) if v != value][:3]
            choices = [value, *others]
            rng.shuffle(choices)
            record = {"context": context, "choices": choices, "label": choices.index(value)}
            f.write(json.dumps(record) + "\n")


def main() -> None:
    p = flags.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=flags.HelpFormatter
    )
    p.add_argument("hf_dir", metavar="HF_DIR", nargs="?", help="a HF Llama directory (an export)")
    p.add_argument("--tasks", help="as tools/evaluate.py's --tasks")
    p.add_argument("--write-code-task", metavar="FILE", help="write the code task, and stop")
    p.add_argument(
        "--batch-size",
        type=flags.number_arg(int, 1),
        default=16,
        help="lm-eval's requests per forward",
    )
    p.add_argument(
        "--batch-tokens",
        type=flags.number_arg(int, 1),
        default=4096,
        help="this suite's padded tokens per forward",
    )
    p.add_argument(
        "--repeats",
        type=flags.number_arg(int, 1),
        default=2,
        help="timings of each; the best is kept",
    )
    p.add_argument("--device", type=device_arg, default=torch.device("cpu"), help="cpu, cuda, ...")
    args = p.parse_args()
    if args.write_code_task:
        write_code_task(args.write_code_task)
        print(f"wrote {args.write_code_task}")
        return
    if not (args.hf_dir and args.tasks):
        p.error("give HF_DIR and --tasks (or --write-code-task FILE)")
    try:
        from lm_eval.models.huggingface import HFLM
    except ImportError as e:
        raise ValueError(
            f"lm-eval is not installed ({e}): pip install -r requirements-eval.txt"
        ) from e

    tasks = [eval_tasks.load_task(spec, n) for spec, n in eval_tasks.parse_tasks(args.tasks)]
    lm = HFLM(
        pretrained=args.hf_dir, device=str(args.device), dtype="float32", batch_size=args.batch_size
    )
    with run_dir(args.hf_dir) as out_dir:
        model, tokenizer = load_model(out_dir, args.device, torch.float32)
    window = model.config.max_position_embeddings
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}")
    for task in tasks:
        requests = [request for example in task.examples for request in example.requests]
        theirs, their_time = timed(lambda r=requests: lm_eval_scores(lm, r), args.repeats)
        score = lambda r=requests: evaluation.score_requests(
            model, tokenizer, r, window, batch_tokens=args.batch_tokens, device=args.device
        )
        (ours, _), our_time = timed(score, args.repeats)
        difference = max(abs(a[0] - b[0]) for a, b in zip(ours, theirs, strict=True))
        greedy = sum(a[1] == b[1] for a, b in zip(ours, theirs, strict=True))
        ours_a, theirs_a = answers(task, ours), answers(task, theirs)
        n = len(task.examples)
        same_acc = sum(a[0] == b[0] for a, b in zip(ours_a, theirs_a, strict=True))
        same_norm = sum(a[1] == b[1] for a, b in zip(ours_a, theirs_a, strict=True))
        print(
            f"{task.name}: {n} examples, {len(requests)} requests; largest log-likelihood "
            f"difference {difference:.2e}; greedy flags agree {greedy}/{len(requests)}; acc "
            f"answers agree {same_acc}/{n}, acc_norm {same_norm}/{n}; seconds per example: "
            f"lm-eval {their_time / n:.4f}, this suite {our_time / n:.4f}"
        )


if __name__ == "__main__":
    exits.run(main)
