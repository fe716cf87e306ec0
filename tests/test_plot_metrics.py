"""Specification of tools/plot_metrics.py: read metrics.jsonl as the training scripts write it,
plot it.

Reading needs only the standard library and is always tested; drawing is tested where
matplotlib is installed (`pip install -r requirements-plot.txt`).
"""

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools import plot_metrics

REPO = Path(__file__).resolve().parents[1]


def write_metrics(out_dir: Path, steps: int = 20, mfu: bool = False, eval_every: int = 10) -> Path:
    """A metrics.jsonl in the training scripts' format: train lines, and eval lines."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, "loss": 6.0 - 0.1 * step, "lr": 1e-3, "tokens_per_sec": 7000.0,
                  "grad_norm": 1.0}  # fmt: skip
        if mfu:
            record["mfu"] = 0.3
        lines.append(record)
        if step % eval_every == 0:
            lines.append({"step": step, "val_loss": 6.5 - 0.1 * step, "val_ppl": 100.0})
    (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return out_dir


def test_read_metrics_separates_train_and_evaluation_lines(tmp_path):
    train, evals = plot_metrics.read_metrics(str(write_metrics(tmp_path / "run")))
    assert [r["step"] for r in train] == list(range(1, 21))
    assert [r["step"] for r in evals] == [10, 20]
    assert all("loss" in r for r in train) and all("val_loss" in r for r in evals)


def test_read_metrics_keeps_the_last_line_of_a_repeated_step_and_skips_a_cut_last_line(tmp_path):
    # A run resumed from its step-10 checkpoint after logging step 12 logs 11 and 12 again; a
    # kill mid-write leaves half a line at the end.
    out = write_metrics(tmp_path / "run", steps=12, eval_every=100)
    again = [{"step": s, "loss": 1.0, "lr": 1e-3, "tokens_per_sec": 1.0} for s in (11, 12, 13)]
    with open(out / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in again) + '{"step": 14, "lo')
    train, _ = plot_metrics.read_metrics(str(out))
    assert [r["step"] for r in train] == list(range(1, 14))
    assert [r["loss"] for r in train[-3:]] == [1.0, 1.0, 1.0]


def test_read_metrics_of_a_directory_without_metrics_names_the_file(tmp_path):
    with pytest.raises(ValueError, match="metrics.jsonl"):
        plot_metrics.read_metrics(str(tmp_path))


def test_runs_are_labelled_by_directory_name_and_by_path_when_names_clash():
    assert plot_metrics.run_labels(["a/dp", "a/ddp/"]) == ["dp", "ddp"]
    assert plot_metrics.run_labels(["a/out", "b/out"]) == ["a/out", "b/out"]


def test_a_run_named_twice_is_refused(tmp_path, monkeypatch):
    run = write_metrics(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["tools/plot_metrics.py", "run", str(run)])
    with pytest.raises(ValueError, match=re.escape(f"run and {run} are the same run")):
        plot_metrics.main()


def test_without_matplotlib_plotting_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(SystemExit, match="requirements-plot.txt"):
        plot_metrics.load_pyplot()


def test_cli_overlays_runs_into_a_png_even_when_no_mfu_was_logged(tmp_path):
    pytest.importorskip("matplotlib")
    dp = write_metrics(tmp_path / "dp")
    ddp = write_metrics(tmp_path / "ddp", steps=30, mfu=True)
    output = tmp_path / "both.png"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.plot_metrics", str(dp), str(ddp), "--output", str(output)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert output.read_bytes().startswith(b"\x89PNG") and output.stat().st_size > 10_000

    # One run, no MFU anywhere: the default output lands in its out-dir.
    proc = subprocess.run([sys.executable, "-m", "tools.plot_metrics", str(dp)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (dp / "metrics.png").read_bytes().startswith(b"\x89PNG")


def test_cli_reports_a_missing_run_in_one_line_with_exit_code_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tools.plot_metrics", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.plot_metrics", *argv],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def assert_one_line_error(proc: subprocess.CompletedProcess, *expected: str) -> None:
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    for text in expected:
        assert text in proc.stderr, proc.stderr


def test_cli_refuses_an_output_in_a_missing_folder_or_a_folder_in_one_line(tmp_path):
    run = write_metrics(tmp_path / "run")
    missing = tmp_path / "missing_dir" / "x.png"
    assert_one_line_error(run_cli(str(run), "--output", str(missing)),
                          f"--output {missing}: there is no folder")  # fmt: skip
    assert not missing.parent.exists()
    assert_one_line_error(run_cli(str(run), "--output", str(run)), f"--output {run} is a folder")


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"step": 3, "loss": "abc"}', "\"loss\" is 'abc', not a number"),
        ('{"step": 3, "loss": 1.0, "lr": [1]}', '"lr" is [1], not a number'),
        ('{"step": 3, "val_loss": true}', '"val_loss" is True, not a number'),
        ('{"step": "3", "loss": 1.0}', "\"step\" is '3', not an integer"),
        ('{"loss": 1.0}', '"step" is None, not an integer'),
        ("[1, 2]", "a JSON list, not an object"),
    ],
)
def test_a_metrics_line_that_no_training_script_writes_is_named(tmp_path, line, expected):
    run = write_metrics(tmp_path / "run", steps=2)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(line + "\n" + json.dumps({"step": 4, "loss": 1.0}) + "\n")
    path = run / "metrics.jsonl"
    with pytest.raises(ValueError, match="line 3") as error:  # after the 2 train lines
        plot_metrics.read_metrics(str(run))
    assert str(error.value).startswith(f"{path}, line 3: {expected}")
    assert_one_line_error(run_cli(str(run)), f"{path}, line 3: {expected}")
    assert not (run / "metrics.png").exists()


def test_null_values_are_gaps_not_errors(tmp_path):
    # lib/metrics.py writes a NaN or infinite value as null.
    run = write_metrics(tmp_path / "run", steps=2)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "loss": None, "lr": 1e-3, "mfu": None}) + "\n")
    train, _ = plot_metrics.read_metrics(str(run))
    assert [r["step"] for r in train] == [1, 2, 3]


def test_a_failed_write_keeps_the_earlier_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    run = write_metrics(tmp_path / "run")
    output = run / "metrics.png"
    output.write_bytes(b"the earlier plot")
    runs = {"run": plot_metrics.read_metrics(str(run))}
    plt = plot_metrics.load_pyplot()

    def disk_full(self, path, **kwargs):
        with open(path, "wb") as f:
            f.write(b"half a PN")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(plt.Figure, "savefig", disk_full)
    with pytest.raises(ValueError, match="No space left on device"):
        plot_metrics.plot(runs, str(output))
    assert output.read_bytes() == b"the earlier plot"
    assert {p.name for p in run.iterdir()} == {"metrics.jsonl", "metrics.png"}
    monkeypatch.undo()
    # A format matplotlib cannot write: one line, nothing written.
    assert_one_line_error(run_cli(str(run), "--output", str(run / "x.xyz")),
                          "--output", "Format 'xyz' is not supported")  # fmt: skip
    assert {p.name for p in run.iterdir()} == {"metrics.jsonl", "metrics.png"}


def test_an_unknown_flag_is_one_line_without_the_usage_block(tmp_path):
    assert_one_line_error(run_cli(str(tmp_path), "--out-dir", "x"), "unrecognized arguments")


def test_a_muon_runs_learning_rate_is_plotted_beside_adamws(tmp_path, monkeypatch):
    # Once: only "lr" (AdamW's) was drawn; --optimizer muon logs Muon's as muon_lr.
    pytest.importorskip("matplotlib")
    out = write_metrics(tmp_path / "muon")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if "lr" in record:
            record["muon_lr"] = 0.02
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    drawn = drawn_labels(monkeypatch)
    plot_metrics.plot({"muon": plot_metrics.read_metrics(str(out))}, str(tmp_path / "p.png"))
    assert "muon Muon" in drawn, drawn


def test_zero_shot_tasks_get_a_panel_of_their_own(tmp_path, monkeypatch):
    # --eval-tasks logs TASK_acc and TASK_acc_norm with each evaluation: acc_norm is drawn where
    # the task has it, acc where it has none.
    pytest.importorskip("matplotlib")
    out = write_metrics(tmp_path / "tasks")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if "val_loss" in record:
            record.update(hellaswag_acc=0.25, hellaswag_acc_norm=0.3, winogrande_acc=0.5)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    drawn = drawn_labels(monkeypatch)
    plot_metrics.plot({"run": plot_metrics.read_metrics(str(out))}, str(tmp_path / "p.png"))
    assert {"run hellaswag_acc_norm", "run winogrande_acc"} <= set(drawn), drawn
    assert "run hellaswag_acc" not in drawn


def test_a_task_figure_that_is_not_a_number_is_named(tmp_path):
    out = write_metrics(tmp_path / "bad")
    with (out / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 30, "val_loss": 1.0, "piqa_acc": "high"}) + "\n")
    with pytest.raises(ValueError, match="\"piqa_acc\" is 'high', not a number"):
        plot_metrics.read_metrics(str(out))


def drawn_labels(monkeypatch) -> list:
    """The label of each line matplotlib draws from now on (its Axes.plot, recording them)."""
    import matplotlib.axes

    drawn, real = [], matplotlib.axes.Axes.plot

    def plot(self, *args, **kwargs):
        drawn.append(kwargs.get("label"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    return drawn
