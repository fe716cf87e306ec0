"""The layout the lessons rely on: every train_*.py is a lesson that stands alone, over library
modules, so that copying a lesson never means copying another lesson.

    a lesson (train_*.py) or a tool (tools/bench.py, tools/profile_step.py) imports no lesson;
    the repository's modules (the root's, lib/'s and tools/') import each other without a cycle.

A module is named as Python imports it: `train_dp` and `model` at the root, `lib.flags` in the
library package, `tools.bench` in the tools package, and `lib` and `tools` the packages themselves
(their __init__.py).
"""

import ast
import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import LAUNCH_TIMEOUT, LESSONS, REPO, describe, launch_env

PACKAGES = ("lib", "tools")


def repository_modules() -> dict[str, Path]:
    """{module name: its file}: the root's .py files, and lib/'s and tools/' with their packages."""
    modules = {path.stem: path for path in Path(REPO).glob("*.py")}
    for package in PACKAGES:
        for path in (Path(REPO) / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
    return modules


def imported_modules(node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The repository modules an import statement loads: `from lib import flags` and
    `from lib.flags import x` load lib.flags, and either loads the package lib first."""
    if isinstance(node, ast.Import):
        names = {alias.name for alias in node.names}
    elif node.module and node.level == 0:
        names = {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    else:
        return set()
    found = set()
    for name in names:
        parts = name.split(".")
        # every prefix is imported: the package, then the module in it
        found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return found & known


def root_imports(module_level: bool = False) -> dict[str, set[str]]:
    """{module: the repository modules it imports}, for every module of the root, lib/ and
    tools/; module_level: only the imports at module level, what must be there for the module to
    import at all (an import inside a function waits until that function runs)."""
    modules = repository_modules()
    imports = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        found = set()
        for node in tree.body if module_level else ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found |= imported_modules(node, modules.keys())
        imports[name] = found - {name}
    return imports


def test_every_lesson_is_in_the_repository_root_and_the_list():
    assert sorted(LESSONS) == sorted(p.name for p in Path(REPO).glob("train_*.py"))


def test_no_module_imports_a_lesson():
    lessons = {Path(lesson).stem for lesson in LESSONS} | {"tools.bench", "tools.profile_step"}
    offenders = {m: sorted(deps & lessons) for m, deps in root_imports().items() if deps & lessons}
    assert not offenders, f"these import a lesson or tool: {offenders}"


def test_the_modules_import_each_other_without_a_cycle():
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


# The scripts a user runs (tools/, with its package), which no lesson or library module may need
# at import time.
TOOLS = {name for name in repository_modules() if name.split(".")[0] == "tools"}
# Each lesson's neighbour: the lesson whose diff from it is its concept (README's table).
NEIGHBOURS = {"train_ddp.py": "train_dp.py", "train_zero1.py": "train_ddp.py",
              "train_fsdp.py": "train_zero1.py", "train_tp.py": "train_fsdp.py",
              "train_pp.py": "train_tp.py", "train_cp.py": "train_fsdp.py",
              "train_ep.py": "train_fsdp.py"}  # fmt: skip


def files_to_copy(lesson: str) -> set[str]:
    """What a learner copies to run `lesson` with its default flags: the lesson and every module
    it imports at module level, transitively, as paths from the repository root (lib/flags.py,
    with lib/__init__.py: the copy keeps the lib/ folder)."""
    imports, todo, seen = root_imports(module_level=True), [Path(lesson).stem], {Path(lesson).stem}
    while todo:
        for dep in imports[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    modules = repository_modules()
    return {modules[name].relative_to(REPO).as_posix() for name in seen}


def package_markers(files: set[str]) -> set[str]:
    """The packages' __init__.py among files: a one-line docstring each (test below), no code."""
    return {name for name in files if Path(name).name == "__init__.py"}


def test_no_lesson_or_library_module_imports_a_tool_at_module_level():
    assert {"tools.generate", "tools.bench", "tools.memory_plan"} <= TOOLS  # the folder is read
    offenders = {
        m: sorted(deps & TOOLS) for m, deps in root_imports(module_level=True).items()
        if m not in TOOLS and deps & TOOLS
    }  # fmt: skip
    assert not offenders, f"these import a tool at module level: {offenders}"


@pytest.mark.parametrize("package", [*PACKAGES, "lib/parallel", "lib/extras"])
def test_a_package_init_holds_only_its_docstring(package):
    # A lesson's copy takes lib/__init__.py for the package alone: it must run nothing.
    tree = ast.parse((Path(REPO) / package / "__init__.py").read_text())
    assert ast.get_docstring(tree) and len(tree.body) == 1


def test_importing_a_lesson_or_generate_loads_no_heavy_module_it_may_not_need():
    # torch._dynamo takes ~1.2 s to import: a run pays it at AdamW's first step (torch.optim
    # imports it) or at --compile, but not tools/generate.py, nor a refused flag, at import time
    # (torch.compiler.set_stance, for one, imports it when called: sampling.sample_text). So
    # with datasets (1.7 s: where documents are read) and torch.distributed.tensor (1.3 s: where
    # a lesson shards).
    heavy = ["torch._dynamo", "datasets", "torch.distributed.tensor"]
    probe = (f"import sys, train_ddp, tools.generate; "
             f"print([m for m in {heavy} if m in sys.modules])")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=launch_env(),
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


# What a learner copies with any lesson, as every lesson's docstring says: the three modules of
# the root and the library folder, whole.
COPIED_WITH_A_LESSON = ("model.py", "data.py", "masks.py", "lib/")


def copy_of(lesson: str) -> set[str]:
    """The files of a lesson's copy: the lesson, the root's three modules, every file of lib/."""
    library = {p.relative_to(REPO).as_posix() for p in (Path(REPO) / "lib").rglob("*.py")}
    return {lesson, "model.py", "data.py", "masks.py"} | library


@pytest.mark.parametrize("lesson", LESSONS)
def test_each_lesson_says_which_files_come_with_it_and_names_its_neighbour(lesson):
    docstring = ast.get_docstring(ast.parse((Path(REPO) / lesson).read_text()))
    missing = [name for name in COPIED_WITH_A_LESSON if name not in docstring]
    assert not missing, f"{lesson}'s docstring does not say to copy {missing}"
    # Its copy holds everything it imports, at module level or for an optional feature.
    imports = root_imports()
    todo, needed = [Path(lesson).stem], {Path(lesson).stem}
    while todo:
        for dep in imports[todo.pop()] - needed:
            needed.add(dep)
            todo.append(dep)
    modules = repository_modules()
    files = {modules[name].relative_to(REPO).as_posix() for name in needed}
    assert files <= copy_of(lesson), f"{lesson} imports {sorted(files - copy_of(lesson))}"
    if lesson in NEIGHBOURS:
        assert f"diff {NEIGHBOURS[lesson]} {lesson}" in docstring


def test_copying_a_lesson_takes_few_files_and_lines():
    # The layout's figures: a lesson copies the shared library and its own modules, no more, and
    # train_ddp.py with its files is at most 3,750 lines (comments, docstrings, blanks included).
    # It was 3,000 before the ranks' waits on a group of their own, the checksums of every file a
    # run reads back and the interruptible saves came into the core (3,443 lines with them), then
    # 3,500 before the caches' checks (lib/checkpoints/files.py's end: 3,634 lines with them), then
    # 3,700 before the hooks of --eval-tasks and --comm-ledger (3,713 with them, after the final
    # files' code left for lib/checkpoints/model_pt.py, read at the end); the layout's target is
    # 2,500, which moving more of the core behind its flags would have to meet.
    # The counts are of modules: a package's __init__.py, its docstring alone, is not one.
    def modules(lesson: str) -> set[str]:
        return files_to_copy(lesson) - package_markers(files_to_copy(lesson))

    ddp = modules("train_ddp.py")
    # The lesson, model.py, data.py and 10 of lib/'s (3 of them lib/checkpoints/'s: out_dir.py,
    # files.py and one_file.py).
    assert len(ddp) <= 13
    assert sum(len((Path(REPO) / name).read_text().splitlines()) for name in ddp) <= 3750
    assert max(len(modules(lesson)) for lesson in LESSONS) <= 17


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
    # corpus (so no lib/extras/corpus.py), the default tokenizer training, evaluation,
    # checkpoints, a resume, the sample at the end and every figure logged each step (a mixture
    # of experts' routing).
    folder = tmp_path / "copy"
    folder.mkdir()
    for name in copy_of(lesson):  # what its docstring says to copy; lib/ keeps its folder
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
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


def reading_set(lesson: str) -> tuple[list[str], int]:
    """What a learner reads to follow `lesson` from its start: the lesson and every module it
    imports at module level, transitively (files_to_copy, the packages' one-line __init__.py
    aside), the lesson first; and their lines, comments and blanks included."""
    files = sorted(files_to_copy(lesson) - package_markers(files_to_copy(lesson)))
    files.sort(key=lambda f: (f != lesson, "/" in f, f.count("/"), f))
    return files, sum(len((Path(REPO) / f).read_text().splitlines()) for f in files)


@functools.cache
def core() -> list[str]:
    """The files every lesson reads (README.md names them once)."""
    sets = [set(reading_set(lesson)[0]) for lesson in LESSONS]
    return sorted(set.intersection(*sets), key=lambda f: ("/" in f, f.count("/"), f))


def reading_set_row(lesson: str) -> str:
    """README.md's row for `lesson`: its own modules beside the core, and the files and lines of
    the whole set, rounded to the hundred."""
    files, lines = reading_set(lesson)
    own = ", ".join(f"`{f}`" for f in files[1:] if f not in core()) or "(the core alone)"
    return f"| `{lesson}` | {own} | {len(files)} files, about {round(lines, -2):,} lines |"


@pytest.mark.parametrize("lesson", LESSONS)
def test_the_readme_names_each_lessons_reading_set(lesson):
    # What a learner reads to follow a lesson, as README.md says it: the core, the same files
    # beside it, and their lines to the nearest hundred (reading_set_row prints the current row).
    readme = (Path(REPO) / "README.md").read_text()
    assert ", ".join(f"`{f}`" for f in core()) in readme, f"the core is now {core()}"
    row = reading_set_row(lesson)
    assert readme.count(row) == 1, f"README.md's row, once, is now:\n{row}"
