"""Session fixtures of the training tests: one corpus, one cache, and the reference runs that
several tests compare against (each made once per session)."""

from pathlib import Path

import pytest
from harness import build_args, cli, run_script, write_corpus

import common

# Session fixtures: one corpus, one cache, and the reference runs several tests compare against


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory, corpus) -> Path:
    """The tokenizer and tokenized-data cache, filled once here for both data modes."""
    cache = tmp_path_factory.mktemp("cache")
    for mode in ("pack", "pad"):
        common.build_datasets(build_args(corpus, cache, data_mode=mode))
    return cache


@pytest.fixture(scope="session")
def trained(tmp_path_factory, corpus, cache_dir):
    """trained(script, world=1, **overrides) -> the out-dir of that run, made once per session.

    Callers must not write into the returned directory: copy what they need to change.
    """
    runs: dict[tuple, Path] = {}

    def get(script: str, world: int = 1, **overrides) -> Path:
        key = (script, world, tuple(sorted(overrides.items())))
        if key not in runs:
            out = tmp_path_factory.mktemp(f"{Path(script).stem}_w{world}")
            run_script(script, cli(corpus, cache_dir, out, **overrides), world)
            runs[key] = out
        return runs[key]

    return get
