"""Specification of tools/bench.py: one row per strategy with its tokens/s, step time, MFU, memory
and ratio to the plain single-process step, a line on the data pipeline, the same figures in --json,
and a clean refusal of bad input.

tools/bench.py is launched as a user would (`python -m tools.bench`, and torchrun with 2 gloo ranks)
on the training tests' corpus, with the tiny preset and a few steps: these tests hold what it
reports and that the figures agree with each other, not how fast this machine is.
"""

import json
import re
import subprocess
import sys

import pytest
import torch
from harness import REPO, launch_env, run_script

from lib import model_config
from tools import bench

BENCH = "tools/bench.py"
TINY = {"model": "tiny", "seq_length": 32, "micro_batch_size": 4, "steps": 3, "warmup": 1,
        "vocab_size": 320, "num_workers": 0}  # fmt: skip
MEASURED = [s for s in bench.STRATEGIES if s != "dp"]  # no GPU here: dp is skipped


def bench_argv(corpus, cache, json_path, **overrides) -> list[str]:
    argv = ["--data", str(corpus), "--cache-dir", str(cache), "--json", str(json_path)]
    for name, value in {**TINY, **overrides}.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


@pytest.fixture(scope="module")
def benched(tmp_path_factory, corpus):
    """benched(world) -> (stdout, report of --json) of tools/bench.py with every strategy, run
    once."""
    cache = tmp_path_factory.mktemp("bench_cache")
    runs = {}

    def get(world: int):
        if world not in runs:
            path = tmp_path_factory.mktemp(f"bench_w{world}") / "bench.json"
            proc = run_script(BENCH, bench_argv(corpus, cache, path), world)
            runs[world] = proc.stdout, json.loads(path.read_text())
        return runs[world]

    return get


def table(stdout: str) -> dict[str, list[str]]:
    """The printed table's rows, by strategy: the cells after the strategy's name."""
    rows = [line.strip("|").split("|") for line in stdout.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[2:]}


def number(cell: str) -> float:
    return float(cell.replace(",", ""))


# -------------------------------------------------------------------------------------------------
# One process: the wrappers at world size 1 against the plain step


def test_every_strategy_gets_a_row_with_positive_tokens_per_sec(benched):
    stdout, _ = benched(1)
    rows = table(stdout)
    assert list(rows) == list(bench.STRATEGIES)
    for strategy in MEASURED:
        tokens_per_sec, step_ms, mfu, memory, vs_single = rows[strategy]
        assert number(tokens_per_sec) > 0 and number(step_ms) > 0 and number(vs_single) > 0
        assert mfu == "-" and memory == "-"  # a CPU has no known peak and no GPU memory
    assert rows["dp"][0] == "skipped: needs >1 GPU"


def test_ratios_are_each_strategys_rate_over_singles(benched):
    stdout, report = benched(1)
    results = {r["strategy"]: r for r in report["results"]}
    single = results["single"]["tokens_per_sec"]
    for strategy in MEASURED:
        r = results[strategy]
        assert r["vs_single"] == pytest.approx(r["tokens_per_sec"] / single, rel=1e-12)
        # One step's tokens (micro-batch x sequence) in one step's time: the same rate.
        tokens_per_step = TINY["micro_batch_size"] * TINY["seq_length"]
        assert r["tokens_per_sec"] * r["step_ms"] / 1000 == pytest.approx(tokens_per_step)
        assert r["mfu"] is None and r["peak_memory_gb"] is None
        # The printed row shows the JSON's figures.
        assert table(stdout)[strategy][0] == f"{r['tokens_per_sec']:,.0f}"
    assert results["single"]["vs_single"] == 1.0
    assert results["dp"]["skipped"] and results["dp"]["tokens_per_sec"] is None


def test_the_data_pipeline_line_compares_the_loader_with_the_fastest_step(benched):
    stdout, report = benched(1)
    d = report["data"]
    rates = {r["strategy"]: r["tokens_per_sec"] for r in report["results"] if not r["skipped"]}
    assert d["consumed_by"] == max(rates, key=rates.get)
    assert d["consumed_tokens_per_sec"] == max(rates.values())
    assert d["tokens_per_sec"] > 0
    assert d["ratio"] == pytest.approx(d["tokens_per_sec"] / d["consumed_tokens_per_sec"])
    line = next(ln for ln in stdout.splitlines() if ln.startswith("data pipeline:"))
    assert f"delivers {d['tokens_per_sec']:,.0f} tokens/s" in line
    assert line.endswith(f"consumes {d['consumed_tokens_per_sec']:,.0f}: {d['ratio']:,.1f}x")
    assert ("would starve" in stdout) == (d["ratio"] < bench.AHEAD)
    assert "the GPU would starve" not in stdout  # (a CPU run: once, "the GPU" all the same)


def test_a_slow_loader_is_said_of_the_device_the_run_has():
    report = {"device_type": "cpu"}
    assert bench.starving(report) == "CPU's training steps"
    assert bench.starving({**report, "device_type": "cuda"}) == "GPU"


def test_the_output_names_torch_the_device_the_date_and_the_command(benched):
    stdout, report = benched(1)
    assert report["torch"] in stdout and report["device"] in stdout and report["date"] in stdout
    # The tests' launcher sets OMP_NUM_THREADS=1 (harness.launch_env): a CPU figure depends on it.
    command = r"^command: OMP_NUM_THREADS=1 python -m tools\.bench --data .* --steps 3 --warmup 1 "
    assert re.search(command, stdout, re.M)
    assert report["world_size"] == 1 and report["settings"]["precision"] == "fp32"


# -------------------------------------------------------------------------------------------------
# torchrun: scaling efficiency


def test_under_torchrun_every_rank_measures_and_ratios_are_scaling_efficiency(benched):
    stdout, report = benched(2)
    assert report["world_size"] == 2
    assert report["command"].startswith("torchrun --standalone --nproc_per_node=2 -m tools.bench ")
    results = {r["strategy"]: r for r in report["results"]}
    for strategy in MEASURED:
        r = results[strategy]
        assert r["tokens_per_sec"] > 0
        assert r["vs_single"] == pytest.approx(
            r["tokens_per_sec"] / results["single"]["tokens_per_sec"], rel=1e-12
        )
    assert "scaling efficiency" in stdout
    assert table(stdout)["dp"][0] == "skipped: needs one process, not torchrun"


# -------------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_is_one_message_and_exit_code_2_with_nothing_written(corpus, tmp_path):
    path = tmp_path / "bench.json"
    argv = bench_argv(corpus, tmp_path, path, strategies="single,tp")
    proc = run_script(BENCH, argv, expect_rc=2)
    assert "error: --strategies: unknown 'tp'; choose from single, dp, ddp" in proc.stderr
    assert proc.stderr.count("error: ") == 1 and "Traceback" not in proc.stderr
    assert not path.exists()


@pytest.mark.parametrize(
    "flag, value, message",
    [("steps", 0, "argument --steps: expected an integer >= 1, got '0'"),
     ("micro_batch_size", -1, "argument --micro-batch-size: expected an integer >= 1, got '-1'"),
     ("warmup", -1, "argument --warmup: expected an integer >= 0, got '-1'"),
     ("vocab_size", 0, "argument --vocab-size: expected an integer in [259, 1048576], got '0'")],
)  # fmt: skip
def test_bad_numbers_are_refused_as_they_are_parsed(corpus, tmp_path, flag, value, message):
    parser = bench.build_parser()
    with pytest.raises(ValueError, match=re.escape(message)):
        parser.parse_args(bench_argv(corpus, tmp_path, tmp_path / "b.json", **{flag: value}))


@pytest.mark.parametrize(
    "flag, value, message",
    [("strategies", ",", "--strategies: no strategy given"),
     ("seq_length", 4096, "--seq-length 4096 exceeds the tiny model's max_position_embeddings"),
     ("model", "huge", "--model: unknown model preset 'huge'"),
     ("hidden_size", 100, "--hidden-size 100 is not divisible by --num-heads 6 (the tiny "
                          "preset's)"),
     ("json", "/no/such/dir/bench.json", "--json /no/such/dir/bench.json: there is no folder "
                                         "/no/such/dir"),
     ("json", "/", "--json / is a folder; name the file to write in it")],  # (a traceback, late)
)  # fmt: skip
def test_bad_flags_are_refused_before_any_work(corpus, tmp_path, flag, value, message):
    # What the subprocess above shows for one flag, checked in-process for the others.
    parser = bench.build_parser()
    args = parser.parse_args(bench_argv(corpus, tmp_path, tmp_path / "b.json", **{flag: value}))
    with pytest.raises(ValueError, match=re.escape(message)):
        bench.check_args(parser, args)


def test_compile_on_a_cpu_without_a_cpp_compiler_is_refused_before_any_work(
    corpus, tmp_path, monkeypatch
):
    # Inductor writes C++ for a CPU: without a compiler, the first timed step ended in a traceback.
    parser = bench.build_parser()
    args = parser.parse_args(bench_argv(corpus, tmp_path, tmp_path / "b.json") + ["--compile"])
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(ValueError, match=r"--compile on a CPU needs a C\+\+ compiler \(/"):
        bench.check_args(parser, args)
    monkeypatch.setenv("CXX", sys.executable)  # an executable that exists stands for one
    assert bench.check_args(parser, args) == list(bench.STRATEGIES)


def test_a_json_file_that_cannot_be_written_is_one_line_after_the_table(corpus, tmp_path):
    # /proc/x passes the early check (its folder exists) and fails only when written, at the end.
    argv = bench_argv(corpus, tmp_path / "cache", "/proc/x", strategies="single")
    proc = run_script(BENCH, argv, expect_rc=2)
    assert "| single " in proc.stdout  # the results are out
    assert (
        proc.stderr.splitlines()[-1]
        == "error: --json /proc/x: could not write it (No such file or directory)"
    )
    assert "Traceback" not in proc.stderr, proc.stderr


def test_strategies_run_in_a_fixed_order_with_single_first(corpus, tmp_path):
    parser = bench.build_parser()
    args = parser.parse_args(
        bench_argv(corpus, tmp_path, tmp_path / "b.json", strategies="fsdp,ddp")
    )
    assert bench.check_args(parser, args) == ["single", "ddp", "fsdp"]


def test_bf16_on_a_cpu_that_cannot_run_it_is_refused(monkeypatch):
    def no_bf16_kernels(*args, **kwargs):
        raise RuntimeError("no bf16 kernels")

    monkeypatch.setattr(torch, "autocast", no_bf16_kernels)
    with pytest.raises(ValueError, match="this CPU cannot run bf16 .*; use fp32"):
        bench.check_precision("bf16", torch.device("cpu"))
    assert bench.check_precision("auto", torch.device("cpu")) == "fp32"


# -------------------------------------------------------------------------------------------------
# tools/bench_nanogpt.py: its preparation and parsing (the runs themselves need nanoGPT: not a test)


def test_the_character_corpus_is_written_in_nanogpts_format_and_as_a_one_char_tokenizer(tmp_path):
    import pickle

    import numpy as np

    from data import load_tokenizer
    from tools import bench_nanogpt

    train, val = "def f(x):\n    return x\n", "print('hi')\n"
    chars = sorted(set(train + val))
    bench_nanogpt.write_nanogpt_data(train, val, chars, tmp_path / "data")
    meta = pickle.loads((tmp_path / "data" / "meta.pkl").read_bytes())
    assert meta["vocab_size"] == len(chars) and meta["itos"] == dict(enumerate(chars))
    for name, text in (("train", train), ("val", val)):
        ids = np.fromfile(tmp_path / "data" / f"{name}.bin", dtype=np.uint16)
        assert "".join(meta["itos"][i] for i in ids) == text
    bench_nanogpt.char_tokenizer(chars).save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer.json"))
    ids = tokenizer.encode(train)
    assert len(ids) == len(train) and tokenizer.decode(ids) == train  # one token per character
    assert tokenizer.get_vocab_size() == len(chars) + 3  # and [PAD] [BOT] [EOT]


def test_the_stdlib_corpus_is_ascii_and_stops_at_its_size():
    from tools import bench_nanogpt

    docs = bench_nanogpt.stdlib_documents(200_000)
    assert docs and all(doc.isascii() for doc in docs)
    assert sum(map(len, docs)) - len(docs[-1]) < 200_000  # the last document crossed the line


def test_nanogpts_step_times_leave_out_its_evaluation_iterations():
    from tools import bench_nanogpt

    output = "\n".join([
        "step 0: train loss 4.3000, val loss 4.4000",
        "iter 0: loss 4.3674, time 2832.57ms, mfu -100.00%",
        "iter 1: loss 4.3299, time 30.00ms, mfu -100.00%",
        "iter 2: loss 4.2661, time 40.00ms, mfu -100.00%",
        "step 250: train loss 2.2996, val loss 2.4720",
        "iter 250: loss 2.2519, time 900.00ms, mfu 0.03%",
        "iter 251: loss 2.2519, time 50.00ms, mfu 0.03%",
    ])  # fmt: skip
    figures = bench_nanogpt.nanogpt_figures(output)
    assert figures == {"step_ms": 40.0, "val_loss": 2.472}


def test_the_suites_figures_come_from_metrics_jsonl(tmp_path):
    import json

    from tools import bench_nanogpt

    records = [{"step": 10, "loss": 3.0, "step_ms": 30.0}, {"step": 20, "step_ms": 50.0},
               {"step": 20, "val_loss": 2.5}, {"step": 30, "step_ms": 40.0},
               {"step": 30, "val_loss": 2.25}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert bench_nanogpt.suite_figures(tmp_path) == {"step_ms": 40.0, "val_loss": 2.25}


def test_the_printed_command_keeps_every_setting_that_steers_the_cpu_runtime():
    from tools import bench_nanogpt

    environ = {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "10000", "MALLOC_ARENA_MAX": "2",
               "ATEN_CPU_CAPABILITY": "avx2", "KMP_BLOCKTIME": "0", "HOME": "/root",
               "PATH": "/usr/bin", "OMPX_UNRELATED": "x"}  # fmt: skip
    assert bench_nanogpt.runtime_settings(environ) == [
        "ATEN_CPU_CAPABILITY=avx2", "GOMP_SPINCOUNT=10000", "KMP_BLOCKTIME=0",
        "MALLOC_ARENA_MAX=2", "OMP_NUM_THREADS=1",
    ]  # fmt: skip


def test_compile_flags_reach_the_runs_and_nanogpts_comes_after_its_recipes_false(tmp_path):
    from tools import bench_nanogpt

    prep = {"suite_argv": ["--data", "c.jsonl"]}
    plain = bench_nanogpt.suite_command(prep, tmp_path, 5)
    assert "--compile" not in plain
    assert bench_nanogpt.suite_command(prep, tmp_path, 5, compile=True) == [*plain, "--compile"]
    nano = bench_nanogpt.nanogpt_command(tmp_path, tmp_path / "out", 5)
    assert "--compile=False" in nano and "--compile=True" not in nano
    # nanoGPT's configurator applies --key=value in order: the last one wins.
    compiled = bench_nanogpt.nanogpt_command(tmp_path, tmp_path / "out", 5, compile=True)
    assert compiled == [*nano, "--compile=True"]


def test_held_out_windows_cover_the_text_once_as_targets():
    from tools import bench_nanogpt

    x, y = bench_nanogpt.held_out_windows(list(range(10)), 4)  # two whole windows of 5
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert y.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]


def test_bench_nanogpt_refuses_a_directory_without_nanogpt(tmp_path):
    proc = run_script("tools/bench_nanogpt.py", ["--nanogpt", str(tmp_path)], expect_rc=2)
    assert "no train.py and model.py there" in proc.stderr


def fake_nanogpt(root, train_py: str = "", without: str | None = None):
    """A folder laid out as a nanoGPT checkout (train.py, model.py, configurator.py,
    config/train_shakespeare_char.py), train.py's code `train_py`; `without`: one left out."""
    files = {"train.py": train_py, "model.py": "", "configurator.py": "",
             "config/train_shakespeare_char.py": ""}  # fmt: skip
    for name, text in files.items():
        if name != without:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
    return root


def bench_nanogpt_on(nanogpt, work, *flags) -> tuple[int, str]:
    """tools/bench_nanogpt.py on the folder `nanogpt`, its side of the runs only (--only nanogpt:
    no train_dp.py run), one round of one step on a small corpus: (its exit code, the last line
    of its stderr, which must be the only one that says an error: no traceback)."""
    argv = ["--nanogpt", str(nanogpt), "--work-dir", str(work), "--only", "nanogpt",
            "--rounds", "1", "--max-steps", "1", "--corpus-chars", "20000", *flags]  # fmt: skip
    proc = run_script("tools/bench_nanogpt.py", argv, expect_rc=None)
    assert "Traceback" not in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr
    assert proc.stderr.endswith("\n"), proc.stderr
    return proc.returncode, proc.stderr.splitlines()[-1]


def test_bench_nanogpt_refuses_a_checkout_without_configurator_py_before_any_work(tmp_path):
    # Before: a FileNotFoundError traceback, after the corpus was prepared.
    nanogpt = fake_nanogpt(tmp_path / "nanoGPT", without="configurator.py")
    code, said = bench_nanogpt_on(nanogpt, tmp_path / "work")
    assert code == 2
    assert said == (f"error: --nanogpt {nanogpt}: no configurator.py there (its train.py reads "
                    f"it): not a nanoGPT checkout")  # fmt: skip
    assert not (tmp_path / "work").exists()


def test_bench_nanogpt_refuses_a_train_py_that_prints_no_iterations(tmp_path):
    # Before: a TypeError traceback, formatting the missing step time.
    nanogpt = fake_nanogpt(tmp_path / "nanoGPT", train_py="")
    code, said = bench_nanogpt_on(nanogpt, tmp_path / "work")
    log = tmp_path / "work" / "nanogpt_0.log"
    assert code == 2
    assert said == (f"error: --nanogpt {nanogpt}: its train.py printed no 'iter N: loss L, time "
                    f"T ms' line (its output: {log}): not nanoGPT's train.py")  # fmt: skip
    assert log.exists()


def test_bench_nanogpt_says_how_a_failed_nanogpt_run_ended_with_its_last_line(tmp_path):
    # Before: a RuntimeError traceback with the log's last 2000 characters.
    train_py = "import sys\nprint('loading')\nsys.exit('ValueError: no such dataset bench_char')\n"
    nanogpt = fake_nanogpt(tmp_path / "nanoGPT", train_py=train_py)
    code, said = bench_nanogpt_on(nanogpt, tmp_path / "work")
    log = tmp_path / "work" / "nanogpt_0.log"
    assert code == 1
    assert said == (f"error: nanoGPT's train.py (from --nanogpt {nanogpt}) failed with exit code "
                    f"1: ValueError: no such dataset bench_char (its output: {log})")  # fmt: skip
    assert "loading" in log.read_text()  # the whole output kept


def test_bench_nanogpt_gives_the_exit_code_of_a_failed_run_that_printed_nothing(tmp_path):
    nanogpt = fake_nanogpt(tmp_path / "nanoGPT", train_py="import os\nos._exit(7)\n")
    code, said = bench_nanogpt_on(nanogpt, tmp_path / "work")
    log = tmp_path / "work" / "nanogpt_0.log"
    assert code == 1
    assert said == (f"error: nanoGPT's train.py (from --nanogpt {nanogpt}) failed with exit code "
                    f"7 and no output ({log})")  # fmt: skip


def test_bench_nanogpt_reports_the_rounds_that_finished_before_a_failed_one(tmp_path):
    # Its first run prints nanoGPT's lines; the second fails (train.py runs in --work-dir).
    train_py = ("import os, sys\n"
                "if os.path.exists('ran'):\n"
                "    sys.exit('RuntimeError: the second run fails')\n"
                "open('ran', 'w').close()\n"
                "print('iter 0: loss 4.3674, time 2832.57ms, mfu -100.00%')\n"
                "print('iter 1: loss 4.3299, time 30.00ms, mfu -100.00%')\n")  # fmt: skip
    nanogpt = fake_nanogpt(tmp_path / "nanoGPT", train_py=train_py)
    argv = ["--nanogpt", str(nanogpt), "--work-dir", str(tmp_path / "work"), "--only", "nanogpt",
            "--rounds", "2", "--max-steps", "1", "--corpus-chars", "20000"]  # fmt: skip
    proc = run_script("tools/bench_nanogpt.py", argv, expect_rc=1)
    assert "|     1 | nanogpt |" in proc.stdout and "30.00 |" in proc.stdout, proc.stdout
    assert "|     2 |" not in proc.stdout, proc.stdout
    assert proc.stderr.splitlines()[-1].endswith(
        f"failed with exit code 1: RuntimeError: the second run fails (its output: "
        f"{tmp_path / 'work' / 'nanogpt_1.log'})"
    ), proc.stderr


def test_the_step_alone_is_timed_against_nanogpts_model_from_its_checkout(tmp_path):
    # A stand-in for nanoGPT's model.py, with its interface: GPTConfig, GPT(config),
    # model(idx, targets) -> (logits, loss) and configure_optimizers(...).
    from tools import bench_nanogpt

    (tmp_path / "model.py").write_text(
        "import dataclasses, torch\n"
        "@dataclasses.dataclass\n"
        "class GPTConfig:\n"
        "    block_size: int; vocab_size: int; n_layer: int; n_head: int; n_embd: int\n"
        "    dropout: float; bias: bool\n"
        "class GPT(torch.nn.Module):\n"
        "    def __init__(self, config):\n"
        "        super().__init__()\n"
        "        self.emb = torch.nn.Embedding(config.vocab_size, config.vocab_size)\n"
        "    def forward(self, idx, targets):\n"
        "        logits = self.emb(idx)\n"
        "        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1),\n"
        "                                                         targets.flatten())\n"
        "    def configure_optimizers(self, weight_decay, lr, betas, device_type):\n"
        "        print('using fused AdamW: False')\n"
        "        return torch.optim.AdamW(self.parameters(), lr=lr, betas=betas)\n"
    )
    times = bench_nanogpt.compare_steps("nanogpt", 96, rounds=2, steps=1, nanogpt=tmp_path)
    assert set(times) == {(name, clock) for name in ("this suite", "nanogpt")
                          for clock in ("wall", "cpu")}  # fmt: skip
    assert all(len(t) == 2 and min(t) > 0 for t in times.values())


def test_timing_nanogpts_step_needs_its_checkout():
    proc = subprocess.run([sys.executable, "-m", "tools.bench_nanogpt", "--step"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    said = "error: --step times nanoGPT's step: pass --nanogpt DIR too (see --help)\n"
    assert proc.stderr == said  # one line, no usage block


@pytest.mark.parametrize(
    "flags, message",
    [(["--batch-size", "0"], "error: argument --batch-size: expected an integer >= 1, got '0'"),
     (["--data", "/no/such/corpus"], "error: --data '/no/such/corpus': no .txt/.jsonl")],
)  # fmt: skip
def test_bench_loader_refuses_bad_input_in_one_line(tmp_path, flags, message):
    # Before: a traceback for each (its own argparse types, and no exits.run).
    tool = [sys.executable, "-m", "tools.bench_loader"]
    command = [*tool, "--bench", "--cache-dir", str(tmp_path), *flags]
    proc = subprocess.run(command, cwd=REPO, env=launch_env(), capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith(message), proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


# -------------------------------------------------------------------------------------------------
# --matmuls: the planner's matmul efficiency, measured


def test_matmul_shapes_are_a_tensor_parallel_ranks_layers_and_lm_head():
    from tools import bench_matmuls

    config = model_config.preset_config(bench.build_parser().parse_args([]), "tiny")
    d, ffn, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * 32
    assert config.head_dim == 32  # tiny: 192 wide, 6 heads
    shapes = {name: rest for name, *rest in bench_matmuls.shapes(config, tp=2)}
    layers = config.num_hidden_layers
    assert shapes["wq"] == [layers, d, d // 2] and shapes["wo"] == [layers, d // 2, d]
    assert shapes["wk wv"] == [2 * layers, d, kv // 2]
    assert shapes["w1 w3"] == [2 * layers, d, ffn // 2] and shapes["w2"] == [layers, ffn // 2, d]
    assert shapes["lm_head"] == [1, d, config.vocab_size // 2]


@pytest.mark.quick
def test_bench_matmuls_times_the_models_shapes_and_says_why_no_efficiency_on_cpu(
    monkeypatch, capsys, tmp_path
):
    argv = "--matmuls --model tiny --seq-length 16 --micro-batch-size 2 --steps 1 --warmup 1"
    out_json = tmp_path / "matmuls.json"
    monkeypatch.setattr(sys, "argv", ["tools/bench.py", *argv.split(), "--json", str(out_json)])
    bench.main()
    out = capsys.readouterr().out
    m = json.loads(out_json.read_text())
    assert [r["name"] for r in m["shapes"]] == ["wq", "wk wv", "wo", "w1 w3", "w2", "lm_head"]
    assert all(r["rate"] > 0 for r in m["shapes"]) and m["flops_per_sec"] > 0
    # A CPU, or a GPU of unknown peak: no efficiency; else the fraction and the planner's flag.
    if m["peak_flops"] is None:
        assert m["efficiency"] is None and "no known bf16 peak for this device" in out
    else:
        assert m["efficiency"] == pytest.approx(m["flops_per_sec"] / m["peak_flops"])
        assert "(python -m tools.memory_plan --matmul-efficiency" in out
