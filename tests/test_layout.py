"""The layout the lessons rely on: every train_*.py is a lesson that stands alone, over library
modules, so that copying a lesson never means copying another lesson.

    a lesson (train_*.py) or a tool (tools/bench.py, tools/profile_step.py) imports no lesson;
    the modules of the repository root import each other without a cycle.
"""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import LAUNCH_TIMEOUT, LESSONS, REPO, describe, launch_env


def root_imports(module_level: bool = False) -> dict[str, set[str]]:
    """{module: the repository-root modules it imports}, for every .py file in the root;
    module_level: only the imports at module level, what must be there for the module to import
    at all (an import inside a function waits until that function runs)."""
    modules = {path.stem: path for path in Path(REPO).glob("*.py")}
    imports = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        found = set()
        for node in tree.body if module_level else ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
        imports[name] = found & modules.keys() - {name}
    return imports


def test_every_lesson_is_in_the_repository_root_and_the_list():
    assert sorted(LESSONS) == sorted(p.name for p in Path(REPO).glob("train_*.py"))


def test_no_module_imports_a_lesson():
    lessons = {Path(lesson).stem for lesson in LESSONS} | {"bench", "profile_step"}
    offenders = {m: sorted(deps & lessons) for m, deps in root_imports().items() if deps & lessons}
    assert not offenders, f"these import a lesson or tool: {offenders}"


def test_the_root_modules_import_each_other_without_a_cycle():
    imports = root_imports()
    done, on_path = set(), []

    def visit(module: str) -> None:
        if module in on_path:
            cycle = on_path[on_path.index(module) :] + [module]
            raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
        if module in done:
            return
        on_path.append(module)
        for dep in sorted(imports[module]):
            visit(dep)
        on_path.pop()
        done.add(module)

    for module in sorted(imports):
        visit(module)


# The scripts a user runs, which no lesson or library module may need at import time.
TOOLS = {"generate", "export_hf", "plot_metrics", "memory_plan", "parity", "gpu_proof", "bench",
         "bench_loader", "bench_nanogpt", "profile_step"}  # fmt: skip
# Each lesson's neighbour: the lesson whose diff from it is its concept (README's table).
NEIGHBOURS = {"train_ddp.py": "train_dp.py", "train_zero1.py": "train_ddp.py",
              "train_fsdp.py": "train_zero1.py", "train_tp.py": "train_fsdp.py",
              "train_pp.py": "train_tp.py", "train_cp.py": "train_fsdp.py",
              "train_ep.py": "train_fsdp.py"}  # fmt: skip


def files_to_copy(lesson: str) -> set[str]:
    """What a learner copies to run `lesson` with its default flags: the lesson and every root
    module it imports at module level, transitively."""
    imports, todo, seen = root_imports(module_level=True), [Path(lesson).stem], {Path(lesson).stem}
    while todo:
        for dep in imports[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return {f"{name}.py" for name in seen}


def test_no_lesson_or_library_module_imports_a_tool_at_module_level():
    offenders = {
        m: sorted(deps & TOOLS) for m, deps in root_imports(module_level=True).items()
        if m not in TOOLS and deps & TOOLS
    }  # fmt: skip
    assert not offenders, f"these import a tool at module level: {offenders}"


def test_importing_train_dp_or_generate_does_not_load_torch_dynamo():
    # torch._dynamo takes ~1.2 s to import: a run pays it at AdamW's first step (torch.optim
    # imports it) or at --compile, but not tools/generate.py, nor a refused flag, at import time
    # (torch.compiler.set_stance, for one, imports it when called: training.sample_text).
    probe = "import sys, train_dp, generate; print('torch._dynamo' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=launch_env(),
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize("lesson", LESSONS)
def test_each_lesson_says_which_files_come_with_it_and_names_its_neighbour(lesson):
    docstring = ast.get_docstring(ast.parse((Path(REPO) / lesson).read_text()))
    missing = sorted(f for f in files_to_copy(lesson) - {lesson} if f not in docstring)
    assert not missing, f"{lesson}'s docstring does not name the files it imports: {missing}"
    if lesson in NEIGHBOURS:
        assert f"diff {NEIGHBOURS[lesson]} {lesson}" in docstring


def test_copying_a_lesson_takes_few_files_and_lines():
    # The layout's figures: a lesson copies the shared library and its own modules, no more, and
    # train_ddp.py with its files is at most 3,000 lines (comments, docstrings, blanks included).
    ddp = files_to_copy("train_ddp.py")
    assert len(ddp) <= 10
    assert sum(len((Path(REPO) / name).read_text().splitlines()) for name in ddp) <= 3000
    assert max(len(files_to_copy(lesson)) for lesson in LESSONS) <= 14


# -------------------------------------------------------------------------------------------------
# A learner's copy: the lesson and the files it names, alone in a folder, run with its defaults


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory) -> Path:
    """One --cache-dir for every copied lesson: the default corpus (the standard library) is
    tokenized by the first run and read from the cache by the others."""
    return tmp_path_factory.mktemp("stdlib_cache")


@pytest.mark.parametrize("lesson", LESSONS)
def test_a_lesson_copied_alone_with_its_files_trains_resumes_and_samples(
    lesson, tmp_path, stdlib_cache
):
    # Only the run's size is changed from the defaults (train_ep.py's needs experts): the default
    # corpus (so no lib/corpus.py), the default tokenizer training, evaluation, checkpoints, a
    # resume, the sample at the end and every figure logged each step (a mixture of experts'
    # routing).
    folder = tmp_path / "copy"
    folder.mkdir()
    for name in files_to_copy(lesson):
        shutil.copy(Path(REPO) / name, folder / name)
    env = launch_env(TOKENIZERS_PARALLELISM="true")  # one process: both cores tokenize
    env.pop("PYTHONPATH", None)  # the copy alone: nothing may come from the repository
    argv = ["--cache-dir", str(stdlib_cache), "--out-dir", str(tmp_path / "out"),
            "--vocab-size", "512", "--seq-length", "32", "--batch-size", "4", "--eval-batches",
            "1", "--log-interval", "1", "--eval-interval", "1", "--save-interval", "1",
            "--sample-tokens", "4"]  # fmt: skip
    argv += ["--num-experts", "2"] if lesson == "train_ep.py" else []  # its smallest model
    for steps, said in ((1, "sample:"), (2, "resumed from")):
        proc = subprocess.run(
            [sys.executable, lesson, *argv, "--max-steps", str(steps)], cwd=folder, env=env,
            capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
        )  # fmt: skip
        assert proc.returncode == 0, describe(proc, f"{lesson} copied alone: expected exit 0")
        assert said in proc.stdout, describe(proc, f"expected {said!r} in the output")
