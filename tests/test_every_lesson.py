"""Every lesson takes two short steps in one process: the quick tier's proof that nothing is
broken end to end (`python -m pytest -m quick`), in well under a minute.

Two steps of a tiny model, one process each (torchrun for the distributed lessons, as a user
starts them), with an evaluation and a checkpoint after each step. One process trains the same
weights on the same batch in every lesson (each weight is drawn from a seed of its own), so every
dense lesson logs train_dp.py's losses, and train_ep.py a mixture of experts' train_dp.py's
(LOSS_RTOL: summation order only). The full suite proves each lesson on several ranks
(tests/test_training.py and the strategy files).
"""

import json
import math

import pytest
from harness import DP, LESSONS, LOSS_RTOL, cmd, run_script

pytestmark = pytest.mark.quick

TWO_STEPS = {"max_steps": 2, "eval_interval": 1, "save_interval": 1, "warmup_steps": 1}
MOE = {"num_experts": 2, "experts_per_token": 1}


def losses(out_dir) -> list[tuple[str, float]]:
    """(name, value) of every loss metrics.jsonl logged, in order; all finite."""
    found = []
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for name in ("loss", "val_loss"):
            if name in record:
                assert record[name] is not None and math.isfinite(record[name]), record
                found.append((f"{name}@{record['step']}", record[name]))
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus, cache_dir):
    """train_dp.py's two steps: dense, and with experts (train_ep.py's model)."""

    def run(**overrides):
        out = tmp_path_factory.mktemp("dp")
        run_script(DP, cmd(corpus, cache_dir, out, **TWO_STEPS, **overrides))
        return losses(out)

    return {"dense": run(), "moe": run(**MOE)}


@pytest.mark.parametrize("lesson", LESSONS[1:])
def test_a_lesson_in_one_process_logs_train_dp_losses(lesson, reference, corpus, cache_dir,
                                                        tmp_path):  # fmt: skip
    extra = {**MOE, "ep": 1} if lesson == "train_ep.py" else {}
    proc = run_script(lesson, cmd(corpus, cache_dir, tmp_path, **TWO_STEPS, **extra), world=1,
                      torchrun=True)  # fmt: skip
    expected = reference["moe" if extra else "dense"]
    actual = losses(tmp_path)
    assert [name for name, _ in actual] == [name for name, _ in expected], proc.stdout[-2000:]
    for (name, value), (_, want) in zip(actual, expected, strict=True):
        assert value == pytest.approx(want, rel=LOSS_RTOL), name
    assert (tmp_path / "model.pt").is_file(), proc.stdout[-2000:]
