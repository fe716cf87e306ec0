"""Specification of what docs/*.md quote a command printing: each quote is in its doc and in
what the code prints now, so that a doc cannot go on quoting a line, a label or a count that the
code no longer prints.

Each quote is produced by the library function (or tool) that prints it, in this process, as
cheaply as it can be: a summary line from flags.describe_run, a parameter count from
model.count_parameters, a table from tools/memory_plan.py, an error line through exits.run. A
measured figure (a time, a loss, a memory peak) belongs to the dated measurement that the doc
quotes: there the quoted line's shape is checked, every number in it standing for any number.
In a quote, `...` stands for text left out, and a placeholder the doc names (`step N`, `--data
X`) for the value the test gives.
"""

import json
import re
import signal
import subprocess
import sys

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer
from harness import REPO, build_args, run_ddp_sh_env

from lib import exits, flags, loop, metrics, model_config, training
from lib.checkpoints import resuming
from lib.checkpoints.one_file import Checkpoints
from lib.checkpoints.out_dir import TrainingState, lock_out_dir
from model import LlamaConfig, count_active_parameters, count_parameters
from tools import bench, parity

DOCS = REPO / "docs"
CPU = torch.device("cpu")
# A number as the scripts print one: 4,096, 0.8M, 3.00e-04, 9.3M, 1.24
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?[MB]?")


def doc(name: str) -> str:
    return (DOCS / name).read_text()


def one_line(text: str) -> str:
    """`text` with every run of white space (a quote wrapped over lines) one space."""
    return " ".join(text.split())


def quote(name: str, start: str) -> str:
    """The one inline quote (`...`) of docs/NAME that begins with `start`, on one line."""
    prose = re.sub(r"```.*?```", "", doc(name), flags=re.S)  # the code blocks left out
    found = [one_line(q) for q in re.findall(r"`([^`]+)`", prose)]
    found = [q for q in found if q.startswith(start)]
    assert len(found) == 1, f"docs/{name} quotes `{start}...` {len(found)} times"
    return found[0]


def block(name: str, first: str) -> list[str]:
    """The lines of the ``` (or ```text) block of docs/NAME whose first line begins with
    `first`."""
    blocks, lines = [], None
    for line in doc(name).splitlines():
        if line.startswith("```"):
            if lines is None:
                lines = [] if line in ("```", "```text") else ["(code)"]  # bash, python: not output
            else:
                blocks.append(lines)
                lines = None
        elif lines is not None:
            lines.append(line)
    found = [b for b in blocks if b and b[0].startswith(first)]
    assert len(found) == 1, f"docs/{name} has {len(found)} text blocks beginning {first!r}"
    return found[0]


def assert_prints(quoted: str, printed: str, **placeholders: str) -> None:
    """The quote is in what was printed (both on one line), `...` standing for any text and each
    placeholder (words of the quote, such as N) for the value given."""
    words = sorted(placeholders, key=len, reverse=True)
    parts = re.split("(" + "|".join([r"\.\.\.", *(rf"\b{re.escape(w)}\b" for w in words)]) + ")",
                     quoted)  # fmt: skip
    pattern = "".join(".*?" if part == "..." else re.escape(placeholders.get(part, part))
                      for part in parts)  # fmt: skip
    assert re.search(pattern, one_line(printed)), f"quoted: {quoted}\nprinted: {printed}"


def shape(line: str) -> str:
    """A line with every number replaced by #: what a measured line says, not its figures."""
    return NUMBER.sub("#", line)


def said(main, capsys) -> tuple[int, str]:
    """(exit code, stderr) of exits.run(main), as a script's __main__ runs it."""
    with pytest.raises(SystemExit) as ended:
        exits.run(main)
    return ended.value.code, capsys.readouterr().err


def summary(*argv: str) -> list[str]:
    """The start-up summary's lines (flags.describe_run) of `train_dp.py ARGV` on this CPU."""
    parser = flags.build_parser("train_dp.py")
    args = parser.parse_args(list(argv))
    run = flags.run_settings(parser, args, 1, CPU)
    return flags.describe_run(args, run, model_config.model_shape(args), CPU).splitlines()


# -------------------------------------------------------------------------------------------------
# docs/flags.md


def test_flags_md_quotes_the_refusal_of_a_number_out_of_its_range(capsys):
    parser = flags.build_parser("train_dp.py")
    code, err = said(lambda: parser.parse_args(["--min-lr-ratio", "2"]), capsys)
    assert code == 2
    assert_prints(quote("flags.md", "error: argument --min-lr-ratio"), err)


def test_flags_md_quotes_the_summary_of_a_reshaped_preset():
    assert_prints(
        quote("flags.md", "model: small with"), summary("--model", "small", "--num-layers", "6")[0]
    )


def test_flags_md_quotes_a_mixture_of_experts_total_and_active_parameters():
    # It said 5.24M (2.88M active): the counts of a 320-token vocabulary, not the default 4096.
    assert_prints(quote("flags.md", "model: tiny with --num-experts 4"),
                  summary("--num-experts", "4")[0])  # fmt: skip


# -------------------------------------------------------------------------------------------------
# docs/outputs.md: what `python train_dp.py` prints

RUN = "Downloading data"  # the first line of outputs.md's transcript of a run


def transcript() -> list[str]:
    """outputs.md's transcript of `python train_dp.py`, up to its sample (the model's text)."""
    lines = block("outputs.md", RUN)
    return lines[: lines.index("sample:") + 1]


def is_bar(line: str) -> bool:
    return bool(re.match(r"[^|]+: +(\d+%\||\d+ examples \[)", line))


def bar_labels(text: str) -> set[str]:
    """The labels of the progress bars in `text` (tqdm's lines, \\r between redraws)."""
    segments = re.split(r"[\r\n]", text)
    return {s.split(":")[0] for s in segments if is_bar(s)}


def test_outputs_md_quotes_the_start_up_summary_of_the_defaults():
    lines = transcript()
    for line in summary():
        assert line in lines, f"outputs.md's transcript lacks {line!r}"


def test_outputs_md_quotes_the_data_summary_as_describe_data_prints_it():
    args = flags.build_parser("train_dp.py").parse_args([])
    printed = training.describe_data(args, (100, 5000, 300), (2, 100, 4)).splitlines()
    quoted = [line for line in transcript() if line.startswith(("data:", "this run:"))]
    assert [shape(line) for line in quoted] == [shape(line) for line in printed]


def test_outputs_and_memory_md_quote_the_memory_line_as_build_memory_prints_it():
    printed = metrics.build_memory(torch.nn.Linear(4, 4), CPU)
    quoted = [line for line in transcript() if line.startswith("memory:")]
    quoted += block("memory.md", "memory:")
    assert len(quoted) == 2 and {shape(line) for line in quoted} == {shape(printed)}, quoted


def test_outputs_md_quotes_the_evaluations_as_log_validation_prints_them(tmp_path, capsys):
    metrics.Metrics(str(tmp_path), True, 0, False).log_validation(50, 6.1874, 2.2531)
    printed = capsys.readouterr().out.strip()
    quoted = [line for line in transcript() if " val loss " in line]
    assert quoted and {shape(line) for line in quoted} == {shape(printed)}


def test_outputs_md_quotes_the_progress_bars_the_data_pipeline_prints(corpus, tmp_path, capfd):
    # Before: `tokenizing:`, a label that had become `tokenizing documents:`.
    args, plan = build_args(corpus, tmp_path / "cache", seq_length=256)  # a first run: no cache
    training.build_datasets(args, plan.tokenizer)
    printed = bar_labels(capfd.readouterr().err)
    quoted = {line.split(":")[0] for line in transcript() if is_bar(line)}
    assert quoted == printed | {"train"}, f"quoted: {quoted}, printed: {printed}"
    assert "packing windows of 257 tokens" in printed  # quoted by data.md too
    assert quote("data.md", "packing windows of") == "packing windows of 257 tokens"
    assert quote("data.md", "tokenizing documents") in printed


def test_data_md_quotes_the_data_summary_of_the_tests_pad_mode_run(corpus, cache_dir, capsys):
    # The tests' corpus and settings (tests/harness.py's BASE) in pad mode: exactly reproducible.
    args, plan = build_args(corpus, cache_dir, data_mode="pad")
    training.build_datasets(args, plan.tokenizer)
    assert block("data.md", "data: ") == capsys.readouterr().out.splitlines()


def test_outputs_md_quotes_the_training_bar_as_the_loop_labels_and_fills_it(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "StopRequest", lambda device: None)  # no signal handlers here
    parser = flags.build_parser("train_dp.py")
    args = parser.parse_args(["--out-dir", str(tmp_path), "--vocab-size", "300"])
    run = flags.run_settings(parser, args, 1, CPU)
    model = tiny_model(300)
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainingState(model, optimizer, None, None, model.config, None)
    bar = loop.TrainingLoop(args, run, state, CPU, 0).bar
    figures = {"tokens_per_sec": 5765.0, "step_ms": 710.5, "mfu": None}
    bar.set_postfix(metrics.bar_postfix(4.733, 3e-4, figures))
    bar.close()
    (quoted,) = [line for line in transcript() if line.startswith(f"{bar.desc}: ")]
    assert shape(quoted).endswith(shape(f", {bar.postfix}]")), (quoted, bar.postfix)


def test_outputs_md_quotes_the_final_files_and_the_sample_as_the_run_prints_them(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # --out-dir out, the default
    (tmp_path / "out").mkdir()  # (made at start-up)
    args = flags.build_parser("train_dp.py").parse_args(["--sample-tokens", "4"])
    tokenizer = tiny_tokenizer(tmp_path / "cache")
    model = tiny_model(tokenizer.get_vocab_size())
    state = TrainingState(model, None, None, None, model.config, tokenizer)
    Checkpoints(args).finish(state, CPU)  # (one process: no torchrun)
    printed = capsys.readouterr().out.splitlines()
    assert transcript()[-2:] == printed[:2]  # saved ... to out, sample:


def test_outputs_md_quotes_the_note_of_a_sample_cut_at_the_models_context(out_dir, capsys):
    from tools import generate

    argv = ["--out-dir", str(out_dir), "--max-new-tokens", "100", "--temperature", "0"]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sys, "argv", ["tools/generate.py", *argv])
        exits.run(generate.main)  # the tiny model's context: 64 positions
    assert_prints(quote("outputs.md", "note: stopped at the model's context"),
                  capsys.readouterr().err, N="64")  # fmt: skip


# -------------------------------------------------------------------------------------------------
# docs/memory.md, docs/which-parallelism.md, docs/expert-parallel.md: counts and the plan


def test_memory_md_quotes_memory_plans_table(monkeypatch, capsys):
    from tools import memory_plan

    lines = block("memory.md", "memory per GPU:")
    argv = ("--model 7b --world-size 8 --gpu-memory 80 --micro-batch-size 1 "
            "--seq-length 2048").split()  # the doc's command  # fmt: skip
    assert f"python -m tools.memory_plan {' '.join(argv[:-2])} \\" in doc("memory.md")
    monkeypatch.setattr(sys, "argv", ["tools/memory_plan.py", *argv])
    exits.run(memory_plan.main)
    assert capsys.readouterr().out.splitlines() == lines


def test_memory_md_quotes_the_zero_papers_figure_1_as_memory_plan_computes_it(monkeypatch, capsys):
    from tools import memory_plan

    argv = "--params 7.5e9 --world-size 64 --precision paper --json".split()
    monkeypatch.setattr(sys, "argv", ["tools/memory_plan.py", *argv])
    exits.run(memory_plan.main)
    states = json.loads(capsys.readouterr().out)["strategies"]
    figures = [f"{states[s]['model_states_gb']:.1f}".removesuffix(".0")
               for s in ("ddp", "zero1", "zero2", "zero3")]  # fmt: skip
    text = one_line(doc("memory.md"))
    assert f"its published {' / '.join(figures)} GB" in text
    assert f"need {', '.join(figures[:3])} and {figures[3]} GB per GPU" in text


def billions(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n < 1e10 else f"{n / 1e9:.1f}B"


def test_memory_md_quotes_the_parameter_counts_of_the_big_models():
    text = one_line(re.sub(r"\n#", "\n", doc("memory.md")))  # comments in a bash block, too
    seven, seventy = (count_parameters(LlamaConfig.from_preset(m)) for m in ("7b", "70b"))
    assert f"Llama 2 7B ({billions(seven)} parameters)" in text
    assert f"Llama 2 70B ({billions(seventy)} parameters)" in text
    # 7b: ZeRO-3 over 8 ranks, 4 + 4 + 8 bytes per parameter; 70b: over 32.
    per_rank = seven / 8 * 1e-9
    assert (
        f"{4 * per_rank:.1f} GB of weight shards, {4 * per_rank:.1f} of gradients, "
        f"{8 * per_rank:.1f} of AdamW state: {16 * per_rank:.1f} GB of states"
    ) in text
    per_rank = seventy / 32
    assert (f"{billions(seventy)} / 32 = {billions(per_rank)} parameters: "
            f"{4 * per_rank * 1e-9:.1f} GB of weights, {4 * per_rank * 1e-9:.1f} of gradients, "
            f"{8 * per_rank * 1e-9:.1f} of AdamW state, {16 * per_rank * 1e-9:.1f} GB of "
            f"states") in text  # fmt: skip
    for model, embedding in (("7b", "0.5"), ("70b", "1.0")):
        config = LlamaConfig.from_preset(model)
        assert f"{config.vocab_size * config.hidden_size * 4 / 1e9:.1f}" == embedding
        assert f"(the embedding, {embedding} GB)" in text
    medium = count_parameters(LlamaConfig.from_preset("medium", vocab_size=320))
    assert f"{medium / 1e6:.0f}M parameters, {4 * medium / 1e9:.2f} GB in fp32" in text


def test_the_docs_quote_the_mixture_of_experts_preset_counts():
    config = LlamaConfig.from_preset("1b", num_local_experts=8)
    total, active = count_parameters(config), count_active_parameters(config)
    experts = 8 * config.num_hidden_layers * 3 * config.hidden_size * config.intermediate_size
    which = one_line(doc("which-parallelism.md"))
    assert (f"{billions(total)} parameters, {billions(active)} active per token, "
            f"{billions(experts)} of them in the experts") in which  # fmt: skip
    assert (f"a {total / 1e9:.1f}B model with {active / 1e9:.1f}B parameters active per token"
            in one_line(doc("expert-parallel.md")))  # fmt: skip


def plan(argv: str, monkeypatch, capsys) -> dict:
    """tools/memory_plan.py's plan for ARGV (its --json), in this process."""
    from tools import memory_plan

    monkeypatch.setattr(sys, "argv", ["tools/memory_plan.py", *argv.split(), "--json"])
    exits.run(memory_plan.main)
    return json.loads(capsys.readouterr().out)


# which-parallelism.md's worked cases: {the case's title: {memory_plan's flags: [(what the
# paragraph says, with {} for the figure, the strategy's row or None for the plan's own, the
# figure)]}}; the commands are the ones the doc gives under each case (and the interleaved one).
WORKED_CASES = {
    "Llama 2 7B on 8 × 80 GB, 4096 tokens.": {
        "--model 7b --world-size 8 --seq-length 4096": [
            ("DDP needs {:.0f} GB per GPU", "ddp", "total_gb"),
            ("ZeRO-1 {:.0f} GB (too tight)", "zero1", "total_gb"),
            ("ZeRO-3 needs {:.0f} GB", "zero3", "total_gb"),
            ("sends {:.0f} GB per GPU per step, overlapped", "zero3", "dp_comm_gb"),
        ],
        "--model 7b --world-size 8 --seq-length 4096 --tp 8": [
            ("tensor parallel over the 8 GPUs needs {:.0f} GB", "zero3", "total_gb"),
            ("sends {:.1f} GB, but waits", None, "tp_comm_gb"),
        ],
    },
    "Llama 2 7B on 4 nodes of 8 × 80 GB, 4096 tokens.": {
        "--model 7b --world-size 32 --seq-length 4096 --replicate 4": [
            ("ZeRO-3 over all 32 GPUs holds {:.1f} GB of states", "zero3", "model_states_gb"),
            ("all its {:.0f} GB per GPU per step", "zero3", "dp_comm_gb"),
            ("HSDP with 4 replicas of 8 holds {:.1f} GB", "hsdp", "model_states_gb"),
            ("({:.0f} GB with activations)", "hsdp", "total_gb"),
            ("only {:.0f} GB of them", None, "hsdp_across_groups_gb"),
        ],
    },
    "Llama 2 7B on 8 × 80 GB, 131,072 tokens (one sequence).": {
        "--model 7b --world-size 8 --seq-length 131072": [
            ("ZeRO-3 needs {:.0f} GB of activations per GPU", "zero3", "activations_gb"),
            ("{:.0f} GB with checkpointing:", "zero3", "activations_checkpointed_gb"),
            ("{:.0f} GB in all, no fit", "zero3", "total_checkpointed_gb"),
        ],
        "--model 7b --world-size 8 --seq-length 131072 --cp 8": [
            ("{:.0f} GB per GPU with checkpointing", "zero3", "total_checkpointed_gb"),
            ("{:.0f} GB of key/value traffic", None, "cp_comm_gb"),
        ],
        "--model 7b --world-size 8 --seq-length 131072 --tp 8 --sequence-parallel": [
            ("fits as well ({:.0f} GB too)", "zero3", "total_checkpointed_gb"),
            ("but sends {:.0f} GB, inside", None, "tp_comm_gb"),
        ],
        "--model 7b --world-size 8 --seq-length 131072 --tp 8": [
            ("TP 8 alone needs {:.0f} GB", "zero3", "total_checkpointed_gb"),
        ],
    },
    "Llama 2 70B on 64 × 80 GB (8 nodes of 8), 4096 tokens.": {
        "--model 70b --world-size 64 --seq-length 4096": [
            ("ZeRO-3 alone: {:.0f} GB of states", "zero3", "model_states_gb"),
            ("but {:.0f} GB of activations", "zero3", "activations_gb"),
            ("({:.0f} GB in all;", "zero3", "total_gb"),
            ("{:.0f} GB sent per GPU per step across the nodes", "zero3", "dp_comm_gb"),
        ],
        "--model 70b --world-size 64 --seq-length 4096 --tp 8 --pp 4 --micro-batches 16": [
            ("{:.0f} GB per GPU with ZeRO-3 over the 2 replicas", "zero3", "total_gb"),
            ("{:.0f} GB of tensor-parallel traffic", None, "tp_comm_gb"),
            ("only {:.0f} GB of pipeline", None, "pp_comm_gb"),
            ("{:.0f} GB of FSDP traffic", "zero3", "dp_comm_gb"),
            ("the bubble costs {:.0%} of each step", None, "bubble_fraction"),
        ],
        "--model 70b --world-size 64 --seq-length 4096 --tp 8 --pp 4 --micro-batches 16 "
        "--schedule interleaved": [
            ("({:.0%} interleaved with 2 stages per rank)", None, "bubble_fraction"),
        ],
    },
    "A mixture of experts on 8 × 80 GB, 4096 tokens.": {
        "--model 1b --num-experts 8 --world-size 8 --seq-length 4096": [
            ("{:.1f} GB of states and", "zero3", "model_states_gb"),
            ("{:.0f} GB in all, but", "zero3", "total_gb"),
            ("but {:.0f} GB sent per GPU per step", "zero3", "dp_comm_gb"),
        ],
        "--model 1b --num-experts 8 --world-size 8 --seq-length 4096 --ep 8": [
            ("the same {:.1f} GB of states", "zero3", "model_states_gb"),
            ("would need only {:.1f} GB", "ddp", "model_states_gb"),
            ("{:.0f} GB in all (each token", "zero3", "total_gb"),
            ("and {:.1f} GB of FSDP traffic", "zero3", "dp_comm_gb"),
            ("plus {:.1f} GB of all-to-all", None, "ep_comm_gb"),
        ],
    },
}


@pytest.mark.parametrize("case", list(WORKED_CASES), ids=lambda case: case.rstrip("."))
def test_which_parallelism_md_quotes_memory_plans_figures_for_its_worked_cases(
    case, monkeypatch, capsys
):
    (paragraph,) = [one_line(p) for p in doc("which-parallelism.md").split("\n\n")
                    if p.startswith(f"**{case}**")]  # fmt: skip
    for argv, figures in WORKED_CASES[case].items():
        planned = plan(argv, monkeypatch, capsys)
        for said_, strategy, field in figures:
            value = planned[field] if strategy is None else planned["strategies"][strategy][field]
            assert said_.format(value) in paragraph, f"{argv}: {field} {value}"


# -------------------------------------------------------------------------------------------------
# docs/parity.md and docs/speed.md: what the tools cover, and their tables


def test_parity_md_quotes_every_strategy_row_as_tools_parity_prints_it():
    lines = block("parity.md", "strategy ")
    assert lines[0] == parity.TABLE_HEADER
    names = []
    for line in lines[1:]:
        name, _, loss, weight, ok = line.split()[:5]
        routing = re.search(r"routing differs from step (\d+) on", line)
        result = {"max_loss_rel_diff": float(loss), "max_weight_abs_diff": float(weight),
                  "within_tolerance": ok == "yes",
                  "routing_differs_from_step": int(routing[1]) if routing else None}  # fmt: skip
        assert line == parity.table_row(name, result)
        names.append(name)
    assert names == [n for n in parity.STRATEGIES if n not in parity.REFERENCES]


def test_speed_md_names_the_strategies_tools_bench_times():
    listed = ", ".join(f"`{s}`" for s in bench.STRATEGIES)
    assert f"(`--strategies`: {listed})" in one_line(doc("speed.md"))


# -------------------------------------------------------------------------------------------------
# docs/troubleshooting.md: the lines a failure ends in


def test_troubleshooting_md_quotes_the_note_a_stop_signal_prints(capfd):
    handlers = {s: signal.getsignal(s) for s in exits.STOP_SIGNALS}
    try:
        loop.StopRequest(CPU)._handle(signal.SIGINT, None)  # as the signal would call it
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert_prints(quote("troubleshooting.md", "SIGINT received"), capfd.readouterr().err)


def test_troubleshooting_md_quotes_a_stopped_runs_last_line(capsys):
    def main():
        raise exits.Stopped(7, signal.SIGINT)

    with pytest.raises(SystemExit) as ended:
        exits.run(main)
    assert ended.value.code == 130
    quoted = quote("troubleshooting.md", "stopped at step N, checkpoint")
    assert_prints(quoted, capsys.readouterr().out, N="7")


def test_troubleshooting_md_quotes_a_second_signals_line(capsys):
    def main():
        raise KeyboardInterrupt

    code, err = said(main, capsys)
    assert code == 130
    assert_prints(quote("troubleshooting.md", "interrupted: stopped at once"), err)


def test_troubleshooting_md_quotes_the_refusal_of_an_out_dir_in_use(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from lib.checkpoints.out_dir import lock_out_dir; "
         "lock_out_dir(sys.argv[1]); print('locked', flush=True); sys.stdin.read()",
         str(tmp_path / "out")],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "locked\n"
        who = json.loads((tmp_path / "out" / ".lock").read_text())  # the holder's own record
        with pytest.raises(ValueError) as refused:
            lock_out_dir("out")
    finally:
        holder.communicate("")
    (quoted,) = block("troubleshooting.md", "error: --out-dir out is in use")
    # The doc's example holder, as the message names the real one.
    example = re.search(r"\(pid (\d+) on (\S+), started (.+?): (.+?)\);", quoted).groups()
    real = (str(who["pid"]), who["host"], who["started"], who["command"])
    assert_prints(quoted, f"error: {refused.value}", **dict(zip(example, real, strict=True)))


def test_troubleshooting_md_quotes_the_stop_when_no_checkpoint_can_be_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out" / "checkpoints").mkdir(parents=True)
    paths = []
    for step in (4, 8, 12):
        paths.append(f"out/checkpoints/step_{step:07d}.pt")
        (tmp_path / paths[-1]).write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError) as refused:
        resuming.newest_readable(paths)
    assert_prints(quote("troubleshooting.md", "error: none of the 3 checkpoints"),
                  f"error: {refused.value}")  # fmt: skip


def test_troubleshooting_md_quotes_the_refusal_of_other_data_at_a_resume():
    from types import SimpleNamespace

    from lib.checkpoints import resuming

    tokenizer = SimpleNamespace(corpus_sha256="b" * 64)
    args = SimpleNamespace(data="X", streaming=False)
    with pytest.raises(ValueError) as refused:
        resuming.check_same_data({"corpus_sha256": "a" * 64}, args, tokenizer)
    assert_prints(quote("troubleshooting.md", "error: --data X is not the data"),
                  f"error: {refused.value}", X="X")  # fmt: skip


def test_troubleshooting_md_quotes_a_tools_refusal_of_a_number(monkeypatch, capsys):
    from tools import generate

    monkeypatch.setattr(sys, "argv", ["tools/generate.py", "--temperature", "nan"])
    code, err = said(generate.main, capsys)
    assert code == 2
    assert_prints(quote("troubleshooting.md", "error: argument --temperature"), err)


def test_troubleshooting_md_quotes_export_hfs_refusals(tmp_path):
    from tools import export_hf

    (tmp_path / "hf").mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / "hf" / name).write_text("{not json")
    with pytest.raises(ValueError) as refused, export_hf.new_folder(str(tmp_path / "hf"), "DST"):
        pass
    assert_prints(quote("troubleshooting.md", "... is not empty (it holds"), str(refused.value))
    with pytest.raises(ValueError) as refused:
        export_hf.read_json(str(tmp_path / "hf" / "config.json"))
    assert_prints(quote("troubleshooting.md", "config.json is not a JSON file"), str(refused.value))
    with pytest.raises(ValueError) as refused:
        export_hf.hf_reader(tiny_model(300).config, str(tmp_path / "hf"))
    assert_prints(quote("troubleshooting.md", "cannot read model.safetensors"), str(refused.value))


def test_troubleshooting_md_quotes_plot_metrics_naming_a_bad_line(tmp_path):
    from tools import plot_metrics

    lines = [json.dumps({"step": step, "loss": 5.0}) for step in range(1, 12)]
    lines.append(json.dumps({"step": 12, "loss": "abc"}))  # line 12
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as refused:
        plot_metrics.read_metrics(str(tmp_path))
    assert_prints(quote("troubleshooting.md", "line 12:"), str(refused.value))


def test_troubleshooting_md_quotes_run_ddp_shs_refusal_of_a_bad_number(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "run_ddp.sh")], cwd=tmp_path,
                          env=run_ddp_sh_env(NPROC_PER_NODE="abc"), capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert_prints(quote("troubleshooting.md", "error: NPROC_PER_NODE"), proc.stderr)


@pytest.mark.parametrize(
    "error, start",
    [(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                             "capacity of 79.19 GiB of which 1.06 GiB is free."),
      "error: out of memory: CUDA"),
     (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                   "memory: you tried to allocate 4096 bytes. Error code 12 (Cannot allocate "
                   "memory)"),
      "you tried to allocate N bytes")],
    ids=["cuda", "cpu"],
)  # fmt: skip
def test_troubleshooting_md_quotes_the_out_of_memory_line(error, start, capsys):
    def main():
        raise error

    code, err = said(main, capsys)
    assert code == 1
    assert_prints(quote("troubleshooting.md", start), err, N="4096")
    assert_prints(quote("troubleshooting.md", "(a smaller --micro-batch-size"), err)


def test_a_quote_matches_only_what_the_code_prints():
    # The helpers themselves: a wildcard, a placeholder, and a changed word that fails.
    assert_prints("stopped at step N, ...; run", "stopped at step 12, saved; run it", N="12")
    with pytest.raises(AssertionError):
        assert_prints("stopped at step N", "halted at step 12", N="12")
    assert shape("loss=4.733, lr=3.00e-04, tok_s=5,765 of 9.3M") == "loss=#, lr=#, tok_s=# of #"


# -------------------------------------------------------------------------------------------------
# docs/scale.md: the predicted table, and the published rows


def test_scale_md_quotes_plot_scales_table():
    from tools import plot_scale

    table = plot_scale.markdown(plot_scale.rows())
    assert table in doc("scale.md")
    assert "python -m tools.plot_scale --png docs/scale.png" in one_line(doc("scale.md"))


def test_scale_md_quotes_each_published_rows_prediction():
    from published import PUBLISHED, predict, relative_errors

    text = doc("scale.md")
    for entry in PUBLISHED["rows"]:
        key = "mfu" if "mfu" in entry["published"] else "tokens_per_sec_per_gpu"
        shown = "{:.1%}" if key == "mfu" else "{:,.0f} tokens/s"
        error = relative_errors(entry)[key]
        line = (
            f"| {entry['name']} | {shown.format(entry['published'][key])} "
            f"| {shown.format(predict(entry)[key])} | {error:+.0%} "
            f"| {'miss' if entry['miss'] else 'hit'} |"
        )
        assert line in text, line


def plan_json(monkeypatch, capsys, argv: list[str]) -> dict:
    """tools/memory_plan.py's --json plan for `argv`, in this process (exit code 0 asserted)."""
    from tools import memory_plan

    monkeypatch.setattr(sys, "argv", ["tools/memory_plan.py", *argv, "--json"])
    exits.run(memory_plan.main)
    return json.loads(capsys.readouterr().out)


def test_scale_md_commands_plan_and_its_prose_quotes_their_figures(monkeypatch, capsys):
    text = one_line(doc("scale.md").replace("\\\n", " "))
    commands = re.findall(r"python -m tools\.memory_plan ([^`#]+?)(?:\s+#|`)", text)
    assert len(commands) >= 5, commands
    for argv in commands:  # each runs: its flags exist and its layout plans
        plan_json(monkeypatch, capsys, argv.split())
    # Megatron's 32B fed this suite's own traffic: the figures section 4 quotes.
    megatron = next(c for c in commands if "--hidden-size 7168" in c)
    ddp = plan_json(monkeypatch, capsys, megatron.split())["strategies"]["ddp"]
    assert f"gives {ddp['mfu']:.1%} (`ddp`)" in text
    assert f"{ddp['exposed_comm_s']:.2f} s of a {ddp['step_time_s']:.2f} s step" in text
    # torchtitan's compiled 8-GPU row (6,667 tokens/s) at the lower bound of its footnote's peak.
    titan = next(c for c in commands if "--matmul-efficiency 0.47" in c)
    zero3 = plan_json(monkeypatch, capsys, titan.split())["strategies"]["zero3"]
    assert f"predicts {zero3['tokens_per_sec_per_gpu']:,.0f} tokens/s, +10% over" in text
    assert round(zero3["tokens_per_sec_per_gpu"] / 6667 - 1, 2) == 0.10
