"""Specification of bad input: every mistake ends in one short message, no traceback, exit code 2,
and leaves what already exists (an out-dir with a finished run and its checkpoints, the caches)
byte-identical.

Each test points a script at a copy of a finished run's out-dir (`existing_run`) and a shared
cache, makes one mistake, and checks all of that.
"""

import argparse
import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from harness import (
    DDP,
    DP,
    LAUNCH_TIMEOUT,
    REPO,
    build_args,
    cmd,
    launch_env,
    load_checkpoint,
    run_ddp_sh_env,
    run_script,
    script_command,
    snapshot,
)

import data
from lib import distributed, flags, model_config, training
from lib.checkpoints import resuming
from model import LlamaConfig


@pytest.fixture
def existing_run(trained, tmp_path) -> Path:
    out = tmp_path / "existing"
    shutil.copytree(trained(DP), out)
    return out


def assert_refused(script, argv, expect, out, cache_dir, world=1):
    """Run `script` with one mistake in argv: a clean refusal that changes nothing."""
    out_before = snapshot(out) if out.exists() else None
    cache_before = snapshot(cache_dir)
    proc = run_script(script, argv, world, expect_rc=None)
    output = proc.stdout + proc.stderr
    # torchrun reports a failed worker with an exit code of its own; a single process says 2.
    assert proc.returncode == 2 if world == 1 else proc.returncode != 0, output[-4000:]
    assert expect in proc.stderr, output[-4000:]
    assert proc.stderr.count("error: ") == 1, f"expected one message:\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr.split("error: ")[0], output[-4000:]
    assert (snapshot(out) if out.exists() else None) == out_before, "the out-dir changed"
    cache_after = snapshot(cache_dir)
    assert {k: cache_after.get(k) for k in cache_before} == cache_before, "a cache file changed"
    return proc


# -------------------------------------------------------------------------------------------------
# Data and tokenizer


def test_missing_data_is_refused(existing_run, corpus, cache_dir, tmp_path):
    argv = cmd(corpus, cache_dir, existing_run)
    argv[argv.index("--data") + 1] = str(tmp_path / "no-such-corpus" / "*.txt")
    assert_refused(DP, argv, "no .txt/.jsonl/.json/.parquet files found", existing_run, cache_dir)


def test_empty_data_is_refused(existing_run, corpus, cache_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("   \n\n")
    argv = cmd(empty, cache_dir, existing_run)
    assert_refused(DP, argv, "has no non-empty documents", existing_run, cache_dir)


@pytest.mark.parametrize("world", [1, 2])
def test_an_empty_data_file_is_refused(existing_run, cache_dir, tmp_path, world):
    # datasets' json reader cannot even start on an empty file (a StopIteration traceback).
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    argv = cmd(empty, cache_dir, existing_run)
    assert_refused(DP if world == 1 else DDP, argv, "the file is empty", existing_run, cache_dir,
                   world)  # fmt: skip


@pytest.mark.parametrize("world", [1, 2])
def test_a_malformed_json_line_is_refused_naming_the_file_and_line(
    existing_run, cache_dir, tmp_path, world
):
    jsonl = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": f"document {i} " * 20}) for i in range(8)]
    lines[5] = lines[5][:-2]  # cut off its closing quote and brace
    jsonl.write_text("\n".join(lines) + "\n")
    argv = cmd(jsonl, cache_dir, existing_run)
    assert_refused(DP if world == 1 else DDP, argv, f"{jsonl} line 6: invalid JSON", existing_run,
                   cache_dir, world)  # fmt: skip


@pytest.mark.parametrize("name", ["latin1.txt", "binary.jsonl"])
def test_a_file_that_is_not_utf8_is_refused_naming_the_file_line_and_byte(
    existing_run, cache_dir, tmp_path, name
):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / f"a{Path(name).suffix}").write_text('{"text": "fine"}\n' * 4)  # read first, fine
    bad = corpus / name
    if name.endswith(".txt"):
        bad.write_bytes("line one\ncaf\u00e9 in Latin-1\n".encode("latin-1"))
        expect = f"{bad} line 2 (byte 12) is not UTF-8 text"
    else:
        bad.write_bytes(b'{"text": "ok"}\n\x89PNG\r\n\x1a\n' + bytes(range(256)))  # an image
        expect = f"{bad} line 2 (byte 15) is not UTF-8 text"
    argv = cmd(corpus, cache_dir, existing_run)
    assert_refused(DP, argv, expect, existing_run, cache_dir)


def test_an_unreachable_hub_dataset_is_refused_saying_what_data_takes(existing_run, cache_dir):
    # The tests run offline (HF_HUB_OFFLINE=1): a name that is no local path goes to the hub.
    argv = cmd("someone/no-such-dataset", cache_dir, existing_run)
    proc = assert_refused(DP, argv, "no hub dataset of that name could be reached or found",
                          existing_run, cache_dir)  # fmt: skip
    assert "--data takes stdlib, a .txt/.jsonl/.json/.parquet file" in proc.stderr


def test_missing_text_column_is_refused_naming_the_columns(existing_run, cache_dir, tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"content": f"doc {i}"}) + "\n" for i in range(8)))
    argv = cmd(jsonl, cache_dir, existing_run)
    assert_refused(DP, argv, "has no column 'text'; its columns are ['content']", existing_run,
                   cache_dir)  # fmt: skip


def test_broken_tokenizer_json_is_refused(existing_run, corpus, cache_dir, tmp_path):
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"version": "1.0", "model": ')
    argv = cmd(corpus, cache_dir, existing_run) + ["--tokenizer", str(broken)]
    assert_refused(DP, argv, "could not read", existing_run, cache_dir)


# -------------------------------------------------------------------------------------------------
# Flags


def test_unknown_preset_is_refused_listing_the_valid_ones(existing_run, corpus, cache_dir):
    argv = cmd(corpus, cache_dir, existing_run, model="huge")
    assert_refused(DP, argv, "choose one of: tiny, small", existing_run, cache_dir)


def test_seq_length_beyond_the_models_positions_is_refused(existing_run, corpus, cache_dir):
    argv = cmd(corpus, cache_dir, existing_run, seq_length=4096)
    assert_refused(DP, argv, "exceeds the tiny model's max_position_embeddings", existing_run,
                   cache_dir)  # fmt: skip


def test_init_from_a_directory_without_a_finished_run_is_refused(
    existing_run, corpus, cache_dir, tmp_path
):
    argv = cmd(corpus, cache_dir, existing_run, model=None, vocab_size=None)
    argv += ["--init-from", str(tmp_path)]
    assert_refused(DP, argv, "no model.pt, config.json, tokenizer.json there", existing_run,
                   cache_dir)  # fmt: skip


def test_init_from_the_out_dir_itself_is_refused_however_it_is_spelled(out_dir, corpus, cache_dir):
    # It would resume from that run's checkpoints and ignore --init-from, or start fresh and
    # write its model.pt over the one it starts from: neither is what was asked.
    def plan(out: str):
        parser = flags.build_parser("test")
        argv = cmd(corpus, cache_dir, out, model=None, vocab_size=None, init_from=out_dir)
        return flags.run_settings(parser, parser.parse_args(argv), 1, torch.device("cpu"))

    for spelled in (out_dir, f"{out_dir}/", f"{out_dir}/../{out_dir.name}"):
        with pytest.raises(ValueError, match=f"--init-from {out_dir} is also the --out-dir"):
            plan(spelled)
    plan(f"{out_dir}-2")  # another out-dir: fine


def test_init_from_with_a_model_preset_is_refused(existing_run, trained, corpus, cache_dir):
    # The architecture comes from the finished run: a preset as well would contradict it.
    argv = cmd(corpus, cache_dir, existing_run) + ["--init-from", str(trained(DP))]
    argv += ["--num-layers", "8"]  # every flag that would contradict it is named
    assert_refused(DP, argv, "leave out --model, --vocab-size, --num-layers", existing_run,
                   cache_dir)  # fmt: skip


@pytest.mark.parametrize(
    "flag, value",
    [("lr", 0), ("lr", -1e-3), ("max_steps", 0), ("batch_size", 0), ("seq_length", -8),
     ("micro_batch_size", 0), ("vocab_size", 0), ("keep_checkpoints", 1)],
)  # fmt: skip
def test_non_positive_sizes_steps_and_rates_are_refused(
    existing_run, corpus, cache_dir, flag, value
):
    argv = cmd(corpus, cache_dir, existing_run, **{flag: value})
    assert_refused(DP, argv, f"--{flag.replace('_', '-')}", existing_run, cache_dir)


@pytest.mark.parametrize(
    "shape, message",
    [(dict(num_layers=0), "argument --num-layers: expected an integer >= 1, got '0'"),
     (dict(num_kv_heads=-2), "argument --num-kv-heads: expected an integer >= 1, got '-2'"),
     (dict(hidden_size=100), "--hidden-size 100 is not divisible by --num-heads 6 (the tiny "
                             "preset's)"),
     (dict(num_heads=5), "--hidden-size 192 (the tiny preset's) is not divisible by --num-heads 5"),
     (dict(num_heads=4, num_kv_heads=3), "--num-heads 4 is not divisible by --num-kv-heads 3"),
     (dict(model="small", num_kv_heads=5), "--num-heads 12 (the small preset's) is not divisible "
                                           "by --num-kv-heads 5"),
     (dict(hidden_size=180, num_heads=4), "--hidden-size 180 / --num-heads 4 = head_dim 45: "
                                          "rotary embeddings need an even head_dim")],
)  # fmt: skip
def test_a_model_shape_that_cannot_be_built_is_refused_naming_the_flags(
    corpus, cache_dir, shape, message
):
    # In-process: run_settings, before any data is read (what a launch shows is above).
    with pytest.raises(ValueError, match=re.escape(message)):
        build_args(corpus, cache_dir, **shape)


@pytest.mark.parametrize("flag", ["vocab_size", *model_config.SHAPE_FLAGS])
def test_init_from_with_a_vocab_size_or_a_shape_flag_is_refused(corpus, cache_dir, tmp_path, flag):
    # The finished run's config.json and tokenizer.json fix both: a flag as well would contradict.
    settings = {"model": None, "vocab_size": None, "init_from": tmp_path, flag: 300}
    with pytest.raises(ValueError, match=f"leave out --{flag.replace('_', '-')} \\(see --help\\)"):
        build_args(corpus, cache_dir, **settings)


@pytest.mark.parametrize(
    "flag, value, expect",
    [("lr", "inf", "expected a number > 0, got 'inf'"),
     ("lr", "nan", "expected a number > 0, got 'nan'"),
     ("min_lr_ratio", "2", "expected a number in [0, 1], got '2'"),
     ("min_lr_ratio", "-0.5", "expected a number in [0, 1], got '-0.5'"),
     ("val_fraction", "1", "expected a number in (0, 1), got '1'"),
     ("grad_clip", "nan", "expected a number >= 0, got 'nan'"),
     ("weight_decay", "-inf", "expected a number >= 0, got '-inf'"),
     ("warmup_steps", "-1", "expected an integer >= 0, got '-1'"),
     ("seed", "-1", "expected an integer in [0, 9223372036854775807], got '-1'"),
     ("num_workers", "-1", "expected an integer >= 0, got '-1'"),
     ("num_proc", "0", "expected an integer >= 1, got '0'"),
     ("eval_batches", "0", "expected an integer >= 1, got '0'"),
     ("sample_tokens", "-1", "expected an integer >= 0, got '-1'"),
     ("vocab_size", "100", "expected an integer in [259, 1048576], got '100'"),
     # (10^11 aborted tokenizers' trainer: a 56-line Rust backtrace, exit 134)
     ("vocab_size", "99999999999", "expected an integer in [259, 1048576], got '99999999999'"),
     ("max_steps", "1e3", "expected an integer >= 1, got '1e3'"),
     ("num_heads", "0", "expected an integer >= 1, got '0'"),
     ("num_experts", "-1", "expected an integer >= 0, got '-1'"),
     ("experts_per_token", "0", "expected an integer >= 1, got '0'"),
     ("router_aux_loss_coef", "nan", "expected a number >= 0, got 'nan'"),
     ("router_aux_loss_coef", "-0.5", "expected a number >= 0, got '-0.5'")],
)  # fmt: skip
@pytest.mark.quick
def test_a_number_out_of_range_or_not_finite_is_refused_as_it_is_parsed(flag, value, expect):
    # In argparse itself (flags.number_arg), so --check refuses it too, and a --config file's value.
    name = f"--{flag.replace('_', '-')}"
    with pytest.raises(ValueError, match=re.escape(f"argument {name}: {expect}")):
        flags.build_parser("test").parse_args([f"{name}={value}"])


@pytest.mark.quick
def test_every_number_flag_of_the_shared_parser_refuses_nan_and_inf():
    parser = flags.build_parser("test", distributed=True)
    typed = [action for action in parser._actions if action.type is not None]
    assert len(typed) >= 20  # every number flag has a type= that checks it
    for action in typed:
        for value in ("nan", "inf", "-inf"):
            with pytest.raises(argparse.ArgumentTypeError):
                action.type(value)


def test_an_infinite_lr_is_refused_by_check(existing_run, corpus, cache_dir):
    argv = cmd(corpus, cache_dir, existing_run) + ["--lr", "inf", "--check"]
    assert_refused(DP, argv, "error: argument --lr: expected a number > 0, got 'inf'",
                   existing_run, cache_dir)  # fmt: skip


@pytest.mark.parametrize("value", ["0", "-2", "two", ""])
def test_a_world_size_that_is_not_a_positive_integer_is_refused(
    monkeypatch, corpus, cache_dir, value
):
    monkeypatch.setenv("WORLD_SIZE", value)
    with pytest.raises(ValueError, match=f"WORLD_SIZE='{value}' in the environment is not a "
                                         f"positive integer"):  # fmt: skip
        build_args(corpus, cache_dir)


@pytest.mark.parametrize("value", ["0", "-2"])
def test_train_ddp_check_refuses_a_world_size_that_is_not_positive(tmp_path, value):
    # run_ddp.sh sets WORLD_SIZE for --check: 0 divided the batch by zero (a traceback) and -2
    # said that the flags were fine.
    out = tmp_path / "out"
    proc = subprocess.run(
        script_command(DDP, ["--out-dir", str(out), "--check"]), cwd=REPO,
        env=launch_env(WORLD_SIZE=value), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: WORLD_SIZE='{value}' in the environment is not a positive integer" in (
        proc.stderr
    )
    assert proc.stderr.count("error: ") == 1 and "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "name, value, world, accepted",
    [("RANK", "1", 2, True), ("LOCAL_RANK", "0", 1, True), ("RANK", "2", 2, False),
     ("RANK", "1", 1, False), ("LOCAL_RANK", "x", 2, False), ("RANK", "-1", 2, False),
     ("RANK", "", 2, False)],
)  # fmt: skip
@pytest.mark.quick
def test_a_rank_must_be_an_integer_below_the_world_size(monkeypatch, name, value, world, accepted):
    monkeypatch.setenv(name, value)
    if accepted:
        assert distributed.rank_from_env(name, world) == int(value)
        return
    with pytest.raises(ValueError, match=f"{name}='{value}' in the environment is not an integer "
                                         f"from 0 to WORLD_SIZE - 1 = {world - 1}"):  # fmt: skip
        distributed.rank_from_env(name, world)


@pytest.mark.parametrize(
    "script, env, said",
    [(DDP, {"RANK": "1"}, "rank 1: error: RANK='1' in the environment is not an integer from 0 "
                          "to WORLD_SIZE - 1 = 0"),
     (DDP, {"WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "error: LOCAL_RANK='x' in the environment"),
     (DP, {"WORLD_SIZE": "2"}, "error: train_dp.py is one process, not a torchrun worker "
                               "(WORLD_SIZE=2): start it with python, or use train_ddp.py")],
    ids=["rank_without_torchrun", "local_rank_not_a_number", "dp_under_torchrun"],
)  # fmt: skip
def test_a_rank_set_by_hand_is_refused_in_one_line_by_that_process(tmp_path, script, env, said):
    # Before: RANK=1 without torchrun exited 2 saying nothing (only rank 0 speaks, and no
    # torchrun gathered this rank's output), and LOCAL_RANK=x said "invalid literal for int()".
    # train_dp.py under torchrun: its processes raced for --out-dir, and the loser said the
    # directory was in use by another run.
    out = tmp_path / "out"
    proc = subprocess.run(
        script_command(script, ["--out-dir", str(out), "--check"]), cwd=REPO,
        env=launch_env(**env), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(said) and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.parametrize("value", ["x", "1"])
def test_a_one_process_script_checks_a_rank_left_in_the_environment(
    monkeypatch, corpus, cache_dir, value
):
    # Before: train_dp.py said "invalid literal for int()" for RANK=x, and with a RANK=1 left in
    # the shell it trained with every rank-0 line silenced.
    monkeypatch.setenv("RANK", value)
    with pytest.raises(ValueError, match=f"RANK='{value}' in the environment is not an integer "
                                         f"from 0 to WORLD_SIZE - 1 = 0"):  # fmt: skip
        build_args(corpus, cache_dir)


def test_an_abbreviated_flag_is_refused_not_read_as_a_longer_one(existing_run, corpus, cache_dir):
    # argparse's prefix matching would read --mode (no such flag) as --model.
    argv = cmd(corpus, cache_dir, existing_run) + ["--mode", "pad"]
    assert_refused(DP, argv, "unrecognized arguments: --mode pad", existing_run, cache_dir)


@pytest.mark.parametrize(
    "module",
    ["train_dp", "train_ddp", "train_zero1", "train_fsdp", "train_tp", "train_pp", "tools.bench",
     "tools.bench_loader", "tools.generate", "tools.export_hf", "tools.memory_plan",
     "tools.plot_metrics", "tools.profile_step", "tools.gpu_report", "tools.plot_scale"],
)  # fmt: skip
@pytest.mark.quick
def test_no_command_line_of_the_suite_accepts_abbreviated_flags(monkeypatch, module):
    class Parsed(Exception):
        pass

    def parse_args(parser, *args, **kwargs):  # stop main() at its parser, before any work
        raise Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(sys, "argv", [f"{module.replace('.', '/')}.py"])  # tools/bench.py
    with pytest.raises(Parsed) as parsed:
        importlib.import_module(module).main()
    assert parsed.value.args[0].allow_abbrev is False


@pytest.mark.parametrize(
    "module",
    ["train_dp", "train_ddp", "train_zero1", "train_fsdp", "train_tp", "train_pp", "train_cp",
     "train_ep", "tools.generate", "tools.memory_plan", "tools.bench", "tools.profile_step",
     "tools.parity", "tools.gpu_report"],
)  # fmt: skip
@pytest.mark.quick
def test_every_number_flag_of_every_script_refuses_nan_and_inf(monkeypatch, module):
    # The lessons' own flags too (--tp, --pp, --cp, --replicate, ...): stop main() at its parser.
    class Parsed(Exception):
        pass

    def parse_args(parser, *args, **kwargs):
        raise Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(sys, "argv", [f"{module.replace('.', '/')}.py"])  # tools/bench.py
    with pytest.raises(Parsed) as parsed:
        importlib.import_module(module).main()
    numbers = [
        action for action in parsed.value.args[0]._actions
        if action.type is not None and action.choices is None
        and action.type.__name__ in ("int", "float")
    ]  # fmt: skip
    assert numbers, "every script has number flags"
    for action in numbers:
        for value in ("nan", "inf", "-inf", "1e400"):
            with pytest.raises(argparse.ArgumentTypeError):
                action.type(value)


@pytest.mark.quick
def test_too_little_data_for_pack_mode_names_the_flag_that_exists():
    tokens = datasets.Dataset.from_dict({"input_ids": [[1, 5, 2]]})
    with pytest.raises(ValueError, match="too few for one window") as error:
        data.PretrainingDataset(tokens, seq_length=32, mode="pack")
    assert "--data-mode pad" in str(error.value)


@pytest.mark.quick
def test_warmup_beyond_max_steps_is_warned_about(corpus, cache_dir, capsys):
    # Warned, not refused: a quick `--max-steps 10` with the default warmup (20) is fine.
    build_args(corpus, cache_dir, max_steps=4, warmup_steps=10)
    assert "warning: --warmup-steps 10 is more than --max-steps 4" in capsys.readouterr().err
    build_args(corpus, cache_dir, max_steps=4, warmup_steps=4)
    assert "warning" not in capsys.readouterr().err


@pytest.mark.quick
def test_compile_on_a_cpu_without_a_cpp_compiler_is_refused(corpus, cache_dir, monkeypatch):
    # Inductor writes C++ for a CPU: without a compiler, torch.compile fails in the first step,
    # after the data is prepared, with a traceback. CXX names the compiler, as for Inductor.
    monkeypatch.setenv("CXX", str(cache_dir / "no-such-compiler"))
    with pytest.raises(ValueError, match="--compile on a CPU needs a C[+][+] compiler"):
        build_args(corpus, cache_dir, compile=True)
    build_args(corpus, cache_dir)  # without --compile, none is needed
    monkeypatch.setenv("CXX", sys.executable)  # an executable that exists stands for one
    build_args(corpus, cache_dir, compile=True)


def test_unknown_choice_is_one_message_not_a_usage_dump(existing_run, corpus, cache_dir):
    argv = cmd(corpus, cache_dir, existing_run, data_mode="zip")
    proc = assert_refused(DP, argv, "invalid choice: 'zip'", existing_run, cache_dir)
    assert "usage:" not in proc.stderr


# -------------------------------------------------------------------------------------------------
# Out-dir and resume


def test_a_cache_dir_that_cannot_be_written_is_refused_naming_it(existing_run, corpus, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    argv = cmd(corpus, a_file, existing_run)
    assert_refused(DP, argv, f"error: --cache-dir {a_file} cannot be created or written",
                   existing_run, a_file)  # fmt: skip


def test_out_dir_that_cannot_be_created_is_refused(corpus, cache_dir, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    argv = cmd(corpus, cache_dir, a_file / "out")
    assert_refused(DP, argv, "cannot be created or written", a_file, cache_dir)


def test_missing_resume_path_is_refused(existing_run, corpus, cache_dir, tmp_path):
    argv = cmd(corpus, cache_dir, existing_run, resume=tmp_path / "nope.pt")
    assert_refused(DP, argv, "no checkpoint file at", existing_run, cache_dir)


def test_resuming_a_checkpoint_of_another_model_is_refused(existing_run, corpus, cache_dir):
    argv = cmd(corpus, cache_dir, existing_run, model="small")  # same run, another size
    proc = assert_refused(DP, argv, "the checkpoint holds a model with config", existing_run,
                          cache_dir)  # fmt: skip
    # Only the fields that differ, and the flags that set them.
    assert "hidden_size 192 (now 768)" in proc.stderr and "vocab_size" not in proc.stderr
    assert "--model, shape flags (--num-layers, ...)" in proc.stderr


def test_resuming_with_another_tokenizer_is_refused(existing_run, corpus, cache_dir, tmp_path):
    # Same vocabulary size, so the model config matches: only the tokenizer itself differs.
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["[PAD]", "[BOT]", "[EOT]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    # The same documents reversed: plenty of text, and certainly other merges.
    other.train_from_iterator([p.read_text()[::-1] for p in corpus.glob("*.txt")], trainer)
    assert other.get_vocab_size() == 320
    path = tmp_path / "other.json"
    other.save(str(path))
    argv = cmd(corpus, cache_dir, existing_run) + ["--tokenizer", str(path)]
    assert_refused(DP, argv, "different tokenizer", existing_run, cache_dir)


def test_resuming_with_another_data_order_or_schedule_is_refused(existing_run, corpus, cache_dir):
    argv = cmd(corpus, cache_dir, existing_run, batch_size=16, warmup_steps=5, txt_split="line")
    proc = assert_refused(DP, argv, "the checkpoint was made with", existing_run, cache_dir)
    assert "--batch-size 8 (now 16)" in proc.stderr and "--warmup-steps 2 (now 5)" in proc.stderr
    assert "--txt-split 'auto' (now 'line')" in proc.stderr


def test_a_resume_compares_the_documents_not_how_data_spells_them(
    trained, corpus, cache_dir, tmp_path
):
    ckpt = load_checkpoint(trained(DP), 8)
    assert re.fullmatch("[0-9a-f]{64}", ckpt["corpus_sha256"])
    config = LlamaConfig(**ckpt["config"])
    tokenizer = data.load_tokenizer(str(trained(DP) / "tokenizer.json"))
    tokenizer.corpus_sha256 = ckpt["corpus_sha256"]  # as build_datasets sets it: the same data
    for spelled in (f"{corpus}//", f"{corpus}/../{corpus.name}", tmp_path / "a-copy"):
        args, _ = build_args(spelled, cache_dir)
        resuming.check_resumable(ckpt, config, args, tokenizer)
    tokenizer.corpus_sha256 = "0" * 64  # other documents, under the same --data
    args, _ = build_args(corpus, cache_dir)
    with pytest.raises(ValueError, match=f"--data {corpus} is not the data the checkpoint was "
                                         "trained on: its documents differ"):  # fmt: skip
        resuming.check_resumable(ckpt, config, args, tokenizer)
    # A checkpoint from before the fingerprint: --data is all it has, compared as one path.
    del ckpt["corpus_sha256"]
    args, _ = build_args(f"{corpus}//", cache_dir)
    resuming.check_resumable(ckpt, config, args, tokenizer)
    args, _ = build_args(tmp_path / "other", cache_dir)
    expect = f"made with --data '{corpus}' (now '{tmp_path / 'other'}')"
    with pytest.raises(ValueError, match=re.escape(expect)):
        resuming.check_resumable(ckpt, config, args, tokenizer)


def test_turning_the_document_mask_on_or_off_at_a_resume_is_refused(trained, corpus, cache_dir):
    # It changes what every token attends to: not the run an uninterrupted one would be.
    ckpt = load_checkpoint(trained(DP), 8)
    config = LlamaConfig(**ckpt["config"])
    tokenizer = data.load_tokenizer(str(trained(DP) / "tokenizer.json"))
    args, _ = build_args(corpus, cache_dir, document_mask=True)
    with pytest.raises(ValueError, match="made with --document-mask False \\(now True\\)"):
        resuming.check_resumable(ckpt, config, args, tokenizer)
    del ckpt["args"]["document_mask"]  # a checkpoint from before the flag: made without it
    with pytest.raises(ValueError, match="made with --document-mask False \\(now True\\)"):
        resuming.check_resumable(ckpt, config, args, tokenizer)
    args, _ = build_args(corpus, cache_dir, attention="sdpa")  # the kernel may change
    resuming.check_resumable(ckpt, config, args, tokenizer)


def test_a_resume_notes_that_init_from_is_not_used(trained, out_dir, corpus, cache_dir, capsys):
    # A run started with --init-from and restarted with the same command resumes (its own
    # checkpoint holds its weights), and says so.
    ckpt = load_checkpoint(trained(DP), 8)
    tokenizer = data.load_tokenizer(str(trained(DP) / "tokenizer.json"))
    args, _ = build_args(corpus, cache_dir, model=None, vocab_size=None, init_from=out_dir)
    resuming.check_resumable(ckpt, LlamaConfig(**ckpt["config"]), args, tokenizer)
    assert (
        f"note: --init-from {out_dir} is not used: the run resumes from its own checkpoint (at "
        f"step 8)" in capsys.readouterr().out
    )


def test_a_checkpoint_from_before_txt_split_counts_as_auto(trained, corpus, cache_dir):
    ckpt = load_checkpoint(trained(DP), 8)
    del ckpt["args"]["txt_split"]  # what checkpoints made before the flag hold
    config = LlamaConfig(**ckpt["config"])
    tokenizer = data.load_tokenizer(str(trained(DP) / "tokenizer.json"))
    args, _ = build_args(corpus, cache_dir)
    resuming.check_resumable(ckpt, config, args, tokenizer)  # auto: resumable
    args, _ = build_args(corpus, cache_dir, txt_split="paragraph")
    with pytest.raises(ValueError, match="--txt-split 'auto' \\(now 'paragraph'\\)"):
        resuming.check_resumable(ckpt, config, args, tokenizer)


def test_resuming_with_other_shape_flags_is_refused_naming_the_fields(trained, corpus, cache_dir):
    # In-process, as a lesson resumes: the model that build_model makes against the checkpoint's.
    ckpt = load_checkpoint(trained(DP), 8)
    tokenizer = data.load_tokenizer(str(trained(DP) / "tokenizer.json"))
    args, plan = build_args(corpus, cache_dir, num_layers=3, ffn_size=256)
    _, config = training.build_model(args, plan.model, tokenizer.get_vocab_size())
    expect = "intermediate_size 512 (now 256), num_hidden_layers 4 (now 3); resume with that run's"
    with pytest.raises(ValueError, match=re.escape(expect + " --model, shape flags")):
        resuming.check_resumable(ckpt, config, args, tokenizer)
    # Flags that make the checkpoint's own shape are no change: tiny has 4 layers.
    args, plan = build_args(corpus, cache_dir, num_layers=4)
    _, config = training.build_model(args, plan.model, tokenizer.get_vocab_size())
    resuming.check_resumable(ckpt, config, args, tokenizer)


def test_a_checkpoint_of_the_old_vocab_size_default_resumes_with_the_new_one(
    trained, corpus, cache_dir
):
    # Runs before the preset's default recorded --vocab-size 4096; tiny's own is 4096: the same
    # tokenizer (its cache key is the size) and model, so no reason to refuse the resume.
    ckpt = load_checkpoint(trained(DP), 8)
    ckpt["args"]["vocab_size"] = 4096
    args, _ = build_args(corpus, cache_dir, vocab_size=None)
    assert model_config.vocab_size(args) == ckpt["args"]["vocab_size"]
    tokenizer = data.load_tokenizer(str(trained(DP) / "tokenizer.json"))
    resuming.check_resumable(ckpt, LlamaConfig(**ckpt["config"]), args, tokenizer)


# -------------------------------------------------------------------------------------------------
# Distributed setup


def test_nccl_backend_without_cuda_is_refused(existing_run, corpus, cache_dir):
    argv = cmd(corpus, cache_dir, existing_run) + ["--backend", "nccl"]
    assert_refused(DDP, argv, "--backend nccl needs CUDA GPUs", existing_run, cache_dir)


@pytest.mark.quick
def test_more_processes_per_node_than_gpus_is_refused(monkeypatch):
    # No GPU here: pretend the node has one, and be the second process on it.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")  # (a local rank below the world size, as torchrun's)
    with pytest.raises(ValueError, match="local rank 1 has no GPU: this node has 1"):
        distributed.torchrun_rank()


@pytest.mark.parametrize("mistake", ["flag", "data"])
def test_under_torchrun_the_error_is_printed_once(existing_run, corpus, cache_dir, mistake):
    # A bad flag fails before the process group exists, bad data after it: rank 0 alone speaks.
    argv = cmd(corpus, cache_dir, existing_run, model="huge" if mistake == "flag" else "tiny")
    if mistake == "data":
        argv[argv.index("--data") + 1] = str(corpus / "missing" / "*.txt")
    assert_refused(DDP, argv, "error: ", existing_run, cache_dir, world=2)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"NPROC_PER_NODE": "abc"}, "NPROC_PER_NODE must be a positive integer, got 'abc'"),
        ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE must be a positive integer, got '0'"),
        ({"NNODES": "two"}, "NNODES must be a positive integer, got 'two'"),
        ({"NNODES": "2", "NODE_RANK": "2"},
         "NODE_RANK must be an integer from 0 to NNODES - 1 = 1, got '2'"),
        ({"NODE_RANK": "-1"}, "NODE_RANK must be an integer from 0 to NNODES - 1 = 0, got '-1'"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT must be an integer from 1 to 65535, got '70000'"),
        ({"MAX_RESTARTS": "1.5"}, "MAX_RESTARTS must be an integer >= 0, got '1.5'"),
        ({"SHUTDOWN_TIMEOUT": "0"}, "SHUTDOWN_TIMEOUT must be a positive integer, got '0'"),
    ],
    ids=["nproc_abc", "nproc_0", "nnodes", "node_rank", "node_rank_negative", "port",
         "max_restarts", "shutdown_timeout"],
)  # fmt: skip
def test_run_ddp_sh_refuses_a_bad_number_in_its_environment_in_one_line(tmp_path, env, expected):
    # Checked before bash's arithmetic ("NPROC_PER_NODE: unbound variable") or torchrun sees it.
    import subprocess

    from harness import REPO, run_ddp_sh_env

    proc = subprocess.run(["bash", str(REPO / "run_ddp.sh"), "--out-dir", str(tmp_path / "o")],
                          cwd=tmp_path, env=run_ddp_sh_env(**env), capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith(f"error: {expected}") and proc.stderr.count("\n") == 1, (
        proc.stderr
    )
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing was written


def fake_torchrun(folder: Path) -> dict:
    """A `torchrun` first on PATH that only notes that it was started (in folder/torchrun-ran),
    for run_ddp.sh: the environment of run_ddp_sh_env with it."""
    folder.mkdir()
    (folder / "torchrun").write_text(f'#!/bin/sh\necho "$@" >> {folder / "torchrun-ran"}\n')
    (folder / "torchrun").chmod(0o755)
    env = run_ddp_sh_env()
    return {**env, "PATH": f"{folder}:{env['PATH']}"}


@pytest.fixture
def held_port():
    """A port another job holds: listening on 127.0.0.1, as a rendezvous store would."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_run_ddp_sh_refuses_a_master_port_another_job_holds_before_starting_torchrun(
    tmp_path, held_port
):
    # Before: torchrun started and failed in a 40-line traceback (EADDRINUSE), exit code 1.
    env = {**fake_torchrun(tmp_path / "bin"), "MASTER_PORT": str(held_port)}
    proc = subprocess.run(["bash", str(REPO / "run_ddp.sh"), "--out-dir", str(tmp_path / "o")],
                          cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == (f"error: MASTER_PORT {held_port} is in use on this node: another job "
                           f"holds it (another run_ddp.sh or torchrun?); set MASTER_PORT to a "
                           f"free port\n")  # fmt: skip
    assert not (tmp_path / "bin" / "torchrun-ran").exists(), "torchrun was started"
    assert not (tmp_path / "o").exists()


def test_run_ddp_sh_leaves_the_master_port_to_the_master_node(tmp_path, held_port):
    # NODE_RANK 1 only connects to MASTER_ADDR:MASTER_PORT, which the master node holds: on a
    # machine of its own that port may be anything here (here: held by the "master").
    env = {**fake_torchrun(tmp_path / "bin"), "MASTER_PORT": str(held_port), "NNODES": "2",
           "NODE_RANK": "1", "NPROC_PER_NODE": "1"}  # fmt: skip
    proc = subprocess.run(["bash", str(REPO / "run_ddp.sh"), "--out-dir", str(tmp_path / "o")],
                          cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    started = (tmp_path / "bin" / "torchrun-ran").read_text()
    assert f"--rdzv-endpoint=127.0.0.1:{held_port}" in started, started


# -------------------------------------------------------------------------------------------------
# A flag that only matters with another, given without it


@pytest.mark.parametrize(
    "flags, expect",
    [(["--muon-lr", "0.1"], "--muon-lr applies only with --optimizer muon"),
     (["--sample-tokens", "0", "--sample-prompt", "x"],
      "--sample-prompt applies only with --sample-tokens above 0")],
    ids=["muon_lr", "sample_prompt"],
)  # fmt: skip
def test_a_flag_without_the_flag_it_needs_is_refused(
    existing_run, corpus, cache_dir, flags, expect
):
    # Once: --muon-lr with the default --optimizer adamw was silently ignored.
    argv = cmd(corpus, cache_dir, existing_run) + flags
    assert_refused(DP, argv, expect, existing_run, cache_dir)


def test_a_validation_split_too_small_for_one_window_names_val_fraction(corpus, cache_dir):
    # Once: "the tokenized dataset has N tokens ... use more data", of a large training file.
    args, _ = build_args(corpus, cache_dir, val_fraction=0.01, seq_length=1024)
    with pytest.raises(ValueError) as error:
        training.build_datasets(args, None)
    said = str(error.value)
    assert said.startswith("the validation split has") and "raise --val-fraction (0.01" in said
