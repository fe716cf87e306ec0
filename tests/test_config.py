"""--config FILE.toml, the settings record OUT_DIR/args.jsonl, and extending a run with a larger
--max-steps (lib/flags.py, resuming.resume_schedule).

The parsing tests run in-process or with --check (no training); three train_dp.py launches
make one run of 4 steps from a config file, extend it to 8 and refuse to shorten it.
"""

import argparse
import json

import pytest
import torch
from harness import DP, cmd, read_metrics, run_script, snapshot

from lib import flags, training
from lib.parallel import pipeline


def write(path, text: str):
    path.write_text(text)
    return str(path)


# -------------------------------------------------------------------------------------------------
# --config: parsing


@pytest.mark.quick
def test_config_values_are_used_and_the_command_line_wins(tmp_path):
    config = write(
        tmp_path / "run.toml",
        '# a run\nseq-length = 64\nbatch_size = 4\nlr = 1\ndata-mode = "pad"\n'
        'document_mask = true\ncompile = true\nmicro-batch-size = "2"\n',
    )
    parser = flags.build_parser("test")
    args = parser.parse_args(["--config", config, "--batch-size", "8", "--no-compile"])
    assert (args.seq_length, args.data_mode, args.document_mask) == (64, "pad", True)
    assert args.lr == 1.0 and isinstance(args.lr, float)  # through the flag's type: float
    assert args.micro_batch_size == 2  # through micro_batch_size_arg, as on the command line
    assert args.batch_size == 8 and args.compile is False  # the command line wins
    assert args.config == config and args.max_steps == 200  # the rest: the defaults
    # The parser is not changed: without --config, the defaults again.
    assert vars(parser.parse_args([])) == vars(flags.build_parser("test").parse_args([]))
    assert parser.parse_args([f"--config={config}"]).seq_length == 64


@pytest.mark.quick
def test_a_lesson_s_own_flags_come_from_the_file_too(tmp_path):
    parser = flags.build_parser("test", sharded=True)
    pipeline.add_flags(parser)  # train_pp.py's own flags
    config = write(tmp_path / "pp.toml", 'schedule = "gpipe"\nstages_per_rank = 3\n')
    args = parser.parse_args(["--config", config])
    assert (args.schedule, args.stages_per_rank) == ("gpipe", 3)


@pytest.mark.parametrize(
    "text, message",
    [
        ("seq-length = 64\nseq-lenght = 32\n", "line 2: seq-lenght: no such flag"),
        ("config = 'other.toml'\n", "line 1: config: no such flag"),
        ('max-steps = "many"\n', "line 1: max-steps: expected an integer >= 1, got 'many'"),
        ("max_steps = 8.5\n", "line 1: max_steps: expected an integer >= 1, got '8.5'"),
        ("lr = inf\n", "line 1: lr: expected a number > 0, got 'inf'"),
        ("lr = nan\n", "line 1: lr: expected a number > 0, got 'nan'"),
        ("min-lr-ratio = 2\n", "line 1: min-lr-ratio: expected a number in [0, 1], got '2'"),
        ("lr = true\n", "line 1: lr: expected a single value (a number or a string), got bool"),
        ('document-mask = "yes"\n', "line 1: document-mask: expected true or false, got 'yes'"),
        ('data-mode = "packed"\n', "line 1: data-mode: invalid choice: 'packed'"),
        (
            'micro-batch-size = "max"\n',
            "line 1: micro-batch-size: expected a positive integer or 'auto'",
        ),
        ("seq-length = 64\nseq_length = 32\n", "line 2: seq_length: given twice"),
        ("[model]\nname = 'tiny'\n", "line 1: model: expected a single value"),
        ("lr = 1e-3\nseed = \n", "not valid TOML: Invalid value (at line 2, column 8)"),
    ],
)
@pytest.mark.quick
def test_a_bad_config_is_refused_naming_the_file_line_and_key(tmp_path, text, message):
    config = write(tmp_path / "bad.toml", text)
    with pytest.raises(ValueError, match="^--config ") as error:
        flags.build_parser("test").parse_args(["--config", config])
    assert str(error.value).startswith(f"--config {config}"), error.value
    assert message in str(error.value), error.value
    assert "\n" not in str(error.value)


@pytest.mark.quick
def test_a_tool_without_config_refuses_the_flag_rather_than_reading_the_file(tmp_path):
    # Before: tools/memory_plan.py, tools/bench.py and tools/generate.py checked the file against
    # their flags, then refused a valid one as "unrecognized arguments"; a broken one was named as
    # if it counted.
    tool = flags.ArgumentParser(description="a tool")
    tool.add_argument("--seq-length", type=int, default=8)
    for text in ("seq-length = 64\n", "seq-length = 'x'\n"):
        config = write(tmp_path / "tool.toml", text)
        with pytest.raises(ValueError, match=f"^unrecognized arguments: --config {config}"):
            tool.parse_args(["--config", config])


@pytest.mark.parametrize("mistake", ["unknown key", "wrong type", "no file", "not toml"])
def test_a_lesson_refuses_a_bad_config_in_one_line_before_any_work(tmp_path, mistake):
    config = tmp_path / "run.toml"
    if mistake == "unknown key":
        config.write_text("max-steps = 4\nwarmup = 2\n")
        expect = f"--config {config}, line 2: warmup: no such flag"
    elif mistake == "wrong type":
        config.write_text("max-steps = 4\nlr = 'fast'\n")
        expect = f"--config {config}, line 2: lr: expected a number > 0, got 'fast'"
    elif mistake == "no file":
        expect = f"--config {config}: cannot read it (No such file or directory)"
    else:
        config.write_text("max-steps = 4\n[[oops\n")
        expect = f"--config {config}: not valid TOML"
    out = tmp_path / "out"
    argv = ["--data", str(tmp_path / "no-corpus"), "--out-dir", str(out), "--config", str(config)]
    proc = run_script(DP, [*argv, "--check"], expect_rc=2)
    assert proc.stderr.count("error: ") == 1 and expect in proc.stderr, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert not out.exists()


# -------------------------------------------------------------------------------------------------
# args.jsonl and extending a run: three launches


def lrs_of_schedule(max_steps: int) -> list[float]:
    """The learning rate of each step 1..max_steps under build_scheduler (BASE's lr, warmup)."""
    args = argparse.Namespace(
        lr=1e-3, min_lr_ratio=0.1, warmup_steps=2, max_steps=max_steps, weight_decay=0.1
    )
    optimizer = training.build_optimizer(torch.nn.Linear(2, 2), args, "cpu")
    scheduler = training.build_scheduler(optimizer, args)
    lrs = []
    for _ in range(max_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_a_run_records_its_settings_and_extends_with_a_larger_max_steps(
    corpus, cache_dir, tmp_path
):
    out = tmp_path / "out"
    # The config sets --max-steps (the command line leaves it out) and --seq-length, which the
    # command line sets again (to BASE's 32): the command line wins.
    config = write(tmp_path / "run.toml", "max-steps = 4\nseq_length = 16\nsave-interval = 2\n")
    argv = cmd(corpus, cache_dir, out, max_steps=None, save_interval=None)
    run_script(DP, [*argv, "--config", config])

    lines = (out / "args.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 1
    first = json.loads(lines[0])
    assert first["script"] == DP and first["start_step"] == 0 and first["world_size"] == 1
    assert "--config" in first["command"]
    resolved = first["args"]
    assert (resolved["max_steps"], resolved["seq_length"], resolved["save_interval"]) == (4, 32, 2)
    assert resolved["config"] == config and resolved["lr"] == 1e-3  # every flag is there
    assert set(resolved) == set(vars(flags.build_parser("test").parse_args([])))
    assert first["plan"] == {
        "model": "tiny", "tokenizer": None, "devices": 1, "micro_batch_size": 8,
        "accumulation": 1, "precision": "fp32", "attention": "sdpa", "grad_clip": 1.0,
    }  # fmt: skip
    train, _ = read_metrics(out)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    four, eight = lrs_of_schedule(4), lrs_of_schedule(8)
    assert [r["lr"] for r in train] == pytest.approx(four, rel=1e-12)

    # The finished run, with --max-steps 8 on the command line: it continues from step 4.
    proc = run_script(DP, [*argv, "--config", config, "--max-steps", "8"])
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout, proc.stdout[-4000:]
    train, _ = read_metrics(out)
    assert [r["step"] for r in train] == list(range(1, 9))
    lrs = [r["lr"] for r in train]
    assert lrs[:4] == pytest.approx(four, rel=1e-12)  # what steps 1-4 ran with
    assert lrs[4:] == pytest.approx(eight[4:], rel=1e-12)  # then the 8-step curve
    assert eight[4] > four[3]  # (the stretched cosine is higher than the old one's tail)
    assert (out / "checkpoints" / "step_0000008.pt").exists()
    lines_now = (out / "args.jsonl").read_text().splitlines(keepends=True)
    assert len(lines_now) == 2 and lines_now[0] == lines[0]  # the first record kept as it was
    second = json.loads(lines_now[1])
    assert second["start_step"] == 4 and second["args"]["max_steps"] == 8

    # Below the checkpoint's step: refused in one line, nothing changed.
    before = snapshot(out)
    proc = run_script(DP, [*argv, "--config", config, "--max-steps", "6"], expect_rc=2)
    assert proc.stderr.count("error: ") == 1, proc.stderr[-4000:]
    assert "the checkpoint is at step 8, past --max-steps 6" in proc.stderr, proc.stderr[-4000:]
    assert snapshot(out) == before
