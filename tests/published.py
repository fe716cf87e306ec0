"""The published step times the step-time model is held against (tests/data/
published_step_times.json), and the model's prediction for each: tests/test_step_time.py asserts
them, tests/test_docs.py holds docs/scale.md's validation table to them."""

import json
from pathlib import Path

from lib.extras import step_time
from lib.extras.memory_formulas import Workload
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
    stage = step_time.STAGES[entry["strategy"]]
    layout = Layout(**entry["layout"], zero_stage=stage)
    workload = Workload(**entry["workload"])
    rows = step_time.formula_rows(config, layout, workload)
    comm = entry.get("comm", {})
    if comm.get("gradients") == "bf16 reduce-scatter and all-gather":
        rows = distributed_optimizer_rows(rows)
    cluster = Cluster(GPUS[entry["gpu"]])
    overlap_tp = comm.get("overlap_tp", False)
    return step_time.step_time(
        config, layout, workload, cluster, rows, entry["recompute"], overlap_tp
    )


def distributed_optimizer_rows(rows: list[dict]) -> list[dict]:
    """What Megatron-LM's distributed optimizer sends in place of DDP's fp32 all-reduce: the
    gradients reduce-scattered in bf16, the updated weights all-gathered in bf16 (its default
    grad_reduce_in_fp32=False), both behind the backward (--overlap-grad-reduce, and
    --overlap-param-gather, which hides the gather under the next forward: here, conservatively,
    under the same last backward as DDP's buckets). The row's strategy is zero1 (the optimizer
    states sharded): the gather replaces ZeroRedundancyOptimizer's broadcasts."""
    out = []
    for r in rows:
        if r["op"] == "broadcast":
            continue
        if r["op"] == "all_reduce" and r["group"] == "dp":
            half = r["bytes"] / 2  # the fp32 gradients' bytes, in bf16
            out.append({**r, "op": "reduce_scatter", "bytes": half})
            out.append({**r, "op": "all_gather", "bytes": half})
        else:
            out.append(r)
    return out


def relative_errors(entry: dict) -> dict:
    """{figure: prediction / published - 1} for each figure the row publishes."""
    predicted = predict(entry)
    return {k: predicted[k] / v - 1 for k, v in entry["published"].items()}
