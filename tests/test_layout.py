"""The layout the lessons rely on: every train_*.py is a lesson that stands alone, over library
modules, so that copying a lesson never means copying another lesson.

    a lesson (train_*.py) or a tool (bench.py, profile_step.py) imports no lesson;
    the modules of the repository root import each other without a cycle.
"""

import ast
from pathlib import Path

from harness import LESSONS, REPO


def root_imports() -> dict[str, set[str]]:
    """{module: the repository-root modules it imports}, for every .py file in the root."""
    modules = {path.stem: path for path in Path(REPO).glob("*.py")}
    imports = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
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
