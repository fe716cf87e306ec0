"""Shared fixtures, and how many tests `-n auto` runs side by side.

The training tests share one corpus, one cache and the runs that several of them compare against
(`trained`, `shared_run`): each run made once for the whole test run. Under `-n auto` each
pytest-xdist worker is a session of its own, with a cache of its own; the corpus and the runs
are made by the first worker that needs them, while any other waits on a lock (`once`). The tests
of what reads a run's outputs (tools/generate.py, tools/export_hf.py) need no training: an out-dir
is model.pt + config.json + tokenizer.json, and `save_final` (lib/checkpoints/model_pt.py) writes
exactly what the training scripts write (`make_out_dir`, `out_dir`, built in-process in well under
a second).
"""

import fcntl
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import datasets
import pytest
import torch
from harness import build_args, cmd, run_script, write_corpus

import data
from lib import training
from lib.checkpoints.model_pt import save_final
from model import LlamaConfig, LlamaForPretraining

# -------------------------------------------------------------------------------------------------
# `-n auto` (pytest-xdist): how many tests run side by side


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: no error where it is not installed
def pytest_xdist_auto_num_workers(config) -> int | None:
    """A worker per core this process may use, and no more than memory holds: a test's
    processes (its worker, torchrun, up to 4 ranks and their DataLoader workers) take up to
    ~4 GiB together. PYTEST_XDIST_AUTO_NUM_WORKERS, where set, decides instead (None: xdist's
    own hook reads it)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:  # Linux: the memory available now
        meminfo = Path("/proc/meminfo").read_text().split()
        gib = int(meminfo[meminfo.index("MemAvailable:") + 1]) / 2**20  # given in KiB
    except (OSError, ValueError):
        return cores or 1
    return max(1, min(cores or 1, int(gib // 4)))


# -------------------------------------------------------------------------------------------------
# Training runs


def shared_root(tmp_path_factory) -> Path:
    """A folder that every xdist worker of this test run sees: a worker's basetemp is a folder
    in the run's (popen-gw0, ...). Without xdist, in the session's basetemp."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    return root


def once(root: Path, name: str, build: Callable[[Path], str]) -> tuple[Path, str]:
    """(root/name, the text build returned): build(root/name) run once for the whole test run.
    The first worker to get here builds, while any other waits on the lock (flock: released when
    its file is closed, also by a worker that dies); a build that failed is tried again."""
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
            folder.mkdir()
            done.write_text(build(folder))
        return folder, done.read_text()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return once(shared_root(tmp_path_factory), "corpus", lambda f: str(write_corpus(f)))[0]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory, corpus) -> Path:
    """The tokenizer and tokenized-data cache, filled once here for both data modes. Each xdist
    worker has its own: a test that checks that a refused run leaves the cache unchanged must
    not see another worker's temporary files come and go."""
    cache = tmp_path_factory.mktemp("cache")
    for mode in ("pack", "pad"):
        args, plan = build_args(corpus, cache, data_mode=mode)
        training.build_datasets(args, plan.tokenizer)
    return cache


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory, cache_dir):
    """shared_run(script, argv, world=1) -> (out-dir, stdout) of `script` run with argv(out-dir),
    made once for the whole test run (`once`). Callers must not write into the out-dir: copy what
    they need to change.

    The run names the cache of the worker that made it; another worker's cache holds the same
    tokens (the same corpus, tokenizer and flags), so the key leaves the cache's path out."""
    root, runs = shared_root(tmp_path_factory), {}

    def get(script: str, argv: Callable[[Path], list[str]], world: int = 1) -> tuple[Path, str]:
        command = [str(a).replace(str(cache_dir), "CACHE") for a in argv(Path("OUT"))]
        digest = hashlib.sha256(repr((script, world, command)).encode()).hexdigest()[:16]
        key = f"{Path(script).stem}_w{world}_{digest}"
        if key not in runs:
            runs[key] = once(root, key, lambda out: run_script(script, argv(out), world).stdout)
        return runs[key]

    return get


@pytest.fixture(scope="session")
def trained(shared_run, corpus, cache_dir):
    """trained(script, world=1, **overrides) -> the out-dir of that run (shared_run's)."""

    def get(script: str, world: int = 1, **overrides) -> Path:
        return shared_run(script, lambda out: cmd(corpus, cache_dir, out, **overrides), world)[0]

    return get


# -------------------------------------------------------------------------------------------------
# A run's outputs, without training

TEXTS = [
    "def add(x, y):\n    return x + y\n",
    "The model reads the data and the loss goes down.\n",
    "class Rank:\n    def step(self):\n        return self.batch\n",
] * 4


def tiny_tokenizer(cache_dir):
    """A byte-level BPE of ~300 tokens with [PAD], [BOT], [EOT] = 0, 1, 2, as data.py trains."""
    return data.get_tokenizer(datasets.Dataset.from_dict({"text": TEXTS}), 300, str(cache_dir))


def tiny_model(
    vocab_size: int,
    tie: bool = False,
    seed: int = 0,
    width: int = 32,
    context: int = 64,
    std: float = 0.3,
) -> LlamaForPretraining:
    """A 2-layer model whose every parameter, norms included, is random and large.

    Large weights make the next token depend strongly on every earlier token and position (a
    fresh std-0.02 model is nearly a bigram model), and random norm gains make a swapped
    attention_norm / ffn_norm visible in any comparison.
    """
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=context,
        rope_theta=500000.0, tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForPretraining(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(std=std)
            else:  # RMSNorm gains
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
    return model.eval()


@pytest.fixture(scope="session")
def make_out_dir(tmp_path_factory):
    """make_out_dir(tie=False) -> a directory with model.pt, config.json and tokenizer.json."""
    cache = tmp_path_factory.mktemp("tokenizer_cache")

    def make(tie: bool = False):
        out = tmp_path_factory.mktemp("out_tied" if tie else "out")
        tokenizer = tiny_tokenizer(cache)
        model = tiny_model(tokenizer.get_vocab_size(), tie=tie)
        save_final(str(out), model, model.config, tokenizer)
        return out

    return make


@pytest.fixture(scope="session")
def out_dir(make_out_dir):
    """One shared out-dir; tests must not write into it."""
    return make_out_dir()
