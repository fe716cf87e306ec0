"""The published step times the step-time model is held against (tests/data/
published_step_times.json), and the model's prediction for each: tests/test_step_time.py asserts
them, tests/test_docs.py holds docs/scale.md's validation table to them."""

import json
import math
from pathlib import Path

from lib.extras import step_time
from lib.extras.comm_formulas import row, step_rows
from lib.extras.memory_formulas import STAGES, Workload, stage_parameters
from lib.extras.step_time import GPUS, Cluster
from lib.parallel.layout import Layout
from model import LlamaConfig

PUBLISHED = json.loads((Path(__file__).parent / "data" / "published_step_times.json").read_text())


def predict(entry: dict) -> dict:
    """The model's prediction for one published row, with the one set of default assumptions."""
    if "preset" in entry:
        config = LlamaConfig.from_preset(entry["preset"])
    else:
        config = LlamaConfig(**entry["config"])
    stage = STAGES[entry["strategy"]]
    layout = Layout(**entry["layout"], zero_stage=stage)
    workload = Workload(**entry["workload"])
    rows = step_rows(config, layout, workload)
    comm = entry.get("comm", {})
    if comm.get("gradients") == "bf16 reduce-scatter and all-gather":
        rows = distributed_optimizer_rows(rows, config, layout)
    cluster = Cluster(GPUS[entry["gpu"]])
    overlap_tp = comm.get("overlap_tp", False)
    return step_time.step_time(
        config, layout, workload, cluster, rows, entry["recompute"], overlap_tp
    )


def distributed_optimizer_rows(rows: list[dict], config: LlamaConfig, layout: Layout) -> list:
    """What Megatron-LM sends, from the lessons' rows: their model-parallel rows (TP, the
    pipeline) kept, their data-parallel ones replaced by Megatron's distributed optimizer's: the
    gradients reduce-scattered in bf16 and the updated weights all-gathered in bf16 (its default
    grad_reduce_in_fp32=False) over the dp group, in buckets, both behind the backward
    (--overlap-grad-reduce; --overlap-param-gather hides the gather under the next forward: here,
    conservatively, under the same last backward as DDP's buckets). The row's strategy is zero1:
    the optimizer states sharded, and the rows classed as DDP's."""
    model_parallel = {"tp", "pp", "cp", "ep"}
    kept = [r for r in rows if r["group"] in model_parallel and r["op"] != "broadcast"]
    weights = 2 * max(stage_parameters(config, layout.tp, layout.pp))  # bf16 bytes, one GPU
    calls = math.ceil(weights / step_time.DDP_BUCKET_BYTES)
    dp = [row(op, "dp", layout.dp, calls, weights) for op in ("reduce_scatter", "all_gather")]
    return kept + (dp if layout.dp > 1 else [])


def relative_errors(entry: dict) -> dict:
    """{figure: prediction / published - 1} for each figure the row publishes."""
    predicted = predict(entry)
    return {k: predicted[k] / v - 1 for k, v in entry["published"].items()}
