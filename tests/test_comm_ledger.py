"""Specification of the communication ledger (--comm-ledger, lib/extras/comm_ledger.py) and of the
formulas held against it (lib/extras/comm_formulas.py's step_rows): what every lesson asks of its
process groups in one training step, measured on CPU ranks (gloo), equals the formula's rows for
its layout, on every rank: the same operations on the same groups, exactly as many calls, exactly
as many bytes (expert parallelism's all-to-alls: within the row's named tolerance on one rank, and
exactly summed over the ranks, since their share of the pairs depends on the router).

Each case is one launch of 3 steps (the ledger records the third) of the tiny model, 2 or 4 ranks.
"""

import dataclasses
import json
import random
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
from harness import REPO, cmd, launch_env, run_script

from lib.extras import comm_formulas, memory
from lib.extras.comm_formulas import step_rows, wire_bytes
from lib.extras.memory_formulas import Workload
from lib.parallel.layout import Layout
from model import LlamaConfig

# BASE's global batch: 8 sequences of 32 tokens; the ledger records the run's third step.
BATCH, SEQ, STEPS = 8, 32, 3
QUIET = dict(max_steps=STEPS, log_interval=100, eval_interval=100, save_interval=100)


@dataclass(frozen=True)
class Case:
    """A lesson's run: its script, ranks and flags, and the Layout and Workload they make (dp:
    the ranks that split the batch; m: micro-batches per rank, the pipeline's or accumulation)."""

    script: str
    world: int
    flags: list = field(default_factory=list)
    layout: dict = field(default_factory=dict)
    m: int = 1
    precision: str = "fp32"
    optimizer: str = "adamw"
    overrides: dict = field(default_factory=dict)


CASES = {
    "ddp": Case("train_ddp.py", 2, layout=dict(zero_stage=0)),
    # Wide enough that DDP's bucket count depends on where the embedding's gradient goes: last,
    # as backward makes it ready (2 buckets); first, with lm_head's, would give 3 (the corpus's
    # tokenizer stops at 505 tokens: a 1.5 MB embedding).
    "ddp-buckets": Case(
        "train_ddp.py",
        2,
        layout=dict(zero_stage=0),
        overrides=dict(hidden_size=768, ffn_size=2048, num_layers=1, vocab_size=4096),
    ),
    "zero1": Case("train_zero1.py", 2, layout=dict(zero_stage=1)),
    "fsdp-zero3-bf16": Case("train_fsdp.py", 2, precision="bf16"),
    "hsdp-zero2-accumulation": Case(
        "train_fsdp.py",
        4,
        ["--replicate", "2", "--zero-stage", "2", "--micro-batch-size", "1"],
        dict(replicate=2, zero_stage=2),
        m=2,
    ),
    "tp-sequence-parallel-fp16": Case(
        "train_tp.py",
        2,
        ["--tp", "2", "--sequence-parallel"],
        dict(tp=2, sequence_parallel=True),
        precision="fp16",
    ),
    "tp-fsdp-sequence-parallel-bf16": Case(
        "train_tp.py",
        4,
        ["--tp", "2", "--sequence-parallel"],
        dict(tp=2, sequence_parallel=True),
        precision="bf16",
    ),
    "tp-hsdp": Case("train_tp.py", 4, ["--tp", "2", "--replicate", "2"], dict(tp=2, replicate=2)),
    "pp-gpipe-bf16": Case(
        "train_pp.py",
        2,
        ["--pp", "2", "--schedule", "gpipe"],
        dict(pp=2, schedule="gpipe"),
        m=8,
        precision="bf16",
    ),
    "pp-1f1b-fsdp-fp16": Case("train_pp.py", 4, ["--pp", "2"], dict(pp=2), m=4, precision="fp16"),
    "pp-interleaved-tp": Case(
        "train_pp.py",
        4,
        ["--pp", "2", "--tp", "2", "--schedule", "interleaved"],
        dict(pp=2, tp=2, schedule="interleaved", stages_per_rank=2),
        m=8,
    ),
    "cp": Case("train_cp.py", 2, ["--cp", "2"], dict(cp=2)),
    "cp-fsdp-bf16": Case("train_cp.py", 4, ["--cp", "2"], dict(cp=2), precision="bf16"),
    "ep-fsdp": Case("train_ep.py", 4, ["--ep", "2", "--num-experts", "4"], dict(ep=2)),
    "ddp-muon": Case("train_ddp.py", 2, layout=dict(zero_stage=0), optimizer="muon"),
    "hsdp-muon": Case(
        "train_fsdp.py", 4, ["--replicate", "2"], dict(replicate=2), optimizer="muon"
    ),
}


def layout_and_workload(case: Case) -> tuple[Layout, Workload]:
    """The Layout and Workload the formulas take for this run."""
    fields = dict(case.layout)
    split = fields.get("tp", 1) * fields.get("pp", 1) * fields.get("cp", 1)
    dp = case.world // split
    layout = Layout(world_size=case.world, dp=dp, **fields)
    rows = BATCH // dp // case.m  # sequences per micro-batch on one rank
    workload = Workload(rows, SEQ, case.m, case.precision, optimizer=case.optimizer)
    return layout, workload


def measured(case: Case, corpus, cache_dir, out) -> list[dict]:
    """Every rank's rows of the run's ledger."""
    flags = case.flags + ["--comm-ledger", "--precision", case.precision]
    flags += ["--optimizer", case.optimizer] if case.optimizer != "adamw" else []
    argv = cmd(corpus, cache_dir, out, **QUIET, **case.overrides) + flags
    proc = run_script(case.script, argv, world=case.world)
    assert "communication ledger of step 3" in proc.stdout, proc.stdout
    return json.loads((out / "comm_ledger.json").read_text())


def key(row: dict) -> tuple:
    return row["op"], row["group"], row["group_size"]


@pytest.mark.parametrize("name", list(CASES))
def test_the_ledger_of_a_lesson_equals_the_formula_on_every_rank(name, corpus, cache_dir, tmp_path):
    case = CASES[name]
    out = tmp_path / "out"
    rows = measured(case, corpus, cache_dir, out)
    config = LlamaConfig(**json.loads((out / "config.json").read_text()))
    layout, workload = layout_and_workload(case)
    sums = {}  # (op, group, size) -> [measured, formula] bytes over the ranks, tolerated rows
    for rank in range(case.world):
        got = {key(r): r for r in rows if r["rank"] == rank}
        want = {key(r): r for r in step_rows(config, layout, workload, rank, device="cpu")}
        assert sorted(got) == sorted(want), f"rank {rank}: {got} != {want}"
        for k, expected in want.items():
            assert got[k]["calls"] == expected["calls"], (rank, k, got[k], expected)
            tolerance = expected.get("tolerance", 0)
            assert abs(got[k]["bytes"] - expected["bytes"]) <= tolerance, (rank, k, got[k])
            if tolerance:
                total = sums.setdefault(k, [0, 0])
                total[0] += got[k]["bytes"]
                total[1] += expected["bytes"]
    for k, (got_total, want_total) in sums.items():
        assert got_total == want_total, (k, got_total, want_total)  # every pair counted once
    if name.startswith("ep"):
        assert sums, "an expert-parallel step has its all-to-alls"


def test_the_recorder_counts_known_collectives_with_their_buffers_bytes():
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "tests/ledger_collectives.py"],
        cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["op"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    expect = {  # (calls, bytes) of tests/ledger_collectives.py's collectives
        "all_reduce": (3, 40 + 24 + 16),  # dist's (fp32, fp64) and a functional one
        "all_gather": (1, 80),  # its output
        "reduce_scatter": (1, 40),  # its input
        "all_to_all": (1, 40),
        "broadcast": (1, 40),
        "send": (1, 40),
        "recv": (1, 40),
    }
    assert {op: (r["calls"], r["bytes"]) for op, r in rows.items()} == expect
    assert {(r["group"], r["group_size"]) for r in rows.values()} == {("world", 2)}


def test_train_dp_writes_an_empty_ledger_and_says_why_and_a_resumed_run_records_its_own(
    corpus, cache_dir, tmp_path
):
    out = tmp_path / "out"
    argv = cmd(corpus, cache_dir, out, **QUIET) + ["--comm-ledger"]
    proc = run_script("train_dp.py", argv)
    assert "no process group" in proc.stdout, proc.stdout
    assert json.loads((out / "comm_ledger.json").read_text()) == []
    # Extended from its last checkpoint (step 3), a run records its own third step, or refuses.
    argv = cmd(corpus, cache_dir, out, **(QUIET | dict(max_steps=4))) + ["--comm-ledger"]
    proc = run_script("train_dp.py", argv, expect_rc=1)
    assert "--max-steps must be at least 6 (resumed at step 3), got 4" in proc.stderr


@pytest.mark.quick
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-steps", "2"], "--max-steps must be at least 3"),
        (["--compile"], "leave out --compile"),
    ],
)
def test_comm_ledger_refuses_a_run_it_cannot_record(flags, message, tmp_path):
    argv = ["--out-dir", str(tmp_path / "out"), "--check", "--comm-ledger", *flags]
    proc = run_script("train_fsdp.py", argv, expect_rc=2)
    assert message in proc.stderr, proc.stderr


# -------------------------------------------------------------------------------------------------
# The planner's traffic figures (lib/extras/memory.py) are these rows on the wire

# The mesh dimension each group of these layouts crosses, by the ledger's name of it: the
# data-parallel ranks (HSDP's shard group, a tensor-parallel layout's dp group), HSDP's replicas,
# and each model-parallel dimension.
DIMENSION = {"world": "dp", "dp": "dp", "shard": "dp", "replicate+shard": "dp"}
DIMENSION |= {d: d for d in ("replicate", "tp", "pp", "cp", "ep")}


def sent_by_group(config, layout, workload) -> list[dict]:
    """{dimension: wire_bytes} of step_rows' rows, by the dimension their group's name says, on
    every pipeline stage (its rank 0 of each pp rank)."""
    stages = []
    for pp_rank in range(layout.pp):
        rows = step_rows(config, layout, workload, rank=pp_rank * layout.world_size // layout.pp)
        sent = dict.fromkeys(set(DIMENSION.values()), 0.0)
        for r in rows:
            sent[DIMENSION[r["group"]]] += wire_bytes([r])
        stages.append(sent)
    return stages


@pytest.mark.quick
@pytest.mark.parametrize(
    "preset, layout, experts",
    [
        ("7b", Layout(64, 64, replicate=8), 0),
        ("7b", Layout(64, 4, tp=8, pp=2, replicate=2, sequence_parallel=True), 0),
        ("7b", Layout(32, 4, pp=8, schedule="interleaved", stages_per_rank=2), 0),
        ("7b", Layout(16, 2, cp=8), 0),
        ("1b", Layout(16, 16, ep=8), 8),
    ],
    ids=["hsdp", "tp-pp-hsdp", "pp-interleaved", "cp", "ep"],
)
def test_the_planners_traffic_is_the_formulas_rows_on_the_wire_by_the_group_they_cross(
    preset, layout, experts
):
    # Every traffic figure of the plan, each strategy's dp comm (HSDP's across its groups too) and
    # each model-parallel dimension's, is wire_bytes of the step's rows on that dimension's
    # groups, the most any pipeline stage sends (every stage counted here; uneven: 30 layers).
    config = LlamaConfig.from_preset(preset, num_local_experts=experts, num_hidden_layers=30)
    workload = Workload(1, 4096, 8, "bf16")
    p = memory.plan(config, layout, workload)
    for name, plan_row in p["strategies"].items():
        stages = sent_by_group(config, memory.strategy_layout(name, layout), workload)
        dp = max(s["dp"] + s["replicate"] for s in stages)
        assert plan_row["dp_comm_gb"] * 1e9 == pytest.approx(dp, rel=1e-12), name
    stages = sent_by_group(config, layout, workload)
    for dim, key in [("tp", "tp_comm_gb"), ("pp", "pp_comm_gb"), ("cp", "cp_comm_gb")]:
        assert p[key] * 1e9 == pytest.approx(max(s[dim] for s in stages), rel=1e-12), dim
    across = max(s["replicate"] for s in stages)
    assert (p["hsdp_across_groups_gb"] or 0) * 1e9 == pytest.approx(across, rel=1e-12)
    assert (p["ep_comm_gb"] or 0) * 1e9 == pytest.approx(max(s["ep"] for s in stages), rel=1e-12)


@pytest.mark.quick
def test_the_planners_dimensions_stay_apart_where_one_group_spans_every_rank():
    # CP over all 8 ranks: FSDP's collectives (dp x cp ranks) and CP's run on the same group,
    # which the ledger names "cp"; the plan still tells them apart: together they are that
    # group's rows, and CP's alone are its keys' and values' all-gathers and reduce-scatters.
    config = LlamaConfig.from_preset("7b")
    layout, workload = Layout(8, 1, cp=8), Workload(1, 4096, 2, "bf16")
    p = memory.plan(config, layout, workload)
    rows = step_rows(config, layout, workload)
    assert {r["group"] for r in rows} == {"cp"}
    both = p["strategies"]["zero3"]["dp_comm_gb"] + p["cp_comm_gb"]
    assert both * 1e9 == pytest.approx(wire_bytes(rows), rel=1e-12)
    kv = 2 * 4096 * 4096 * 2  # keys and values of the whole sequence, bf16, per layer
    cp = 2 * 7 / 8 * kv * 32 * 2  # all-gathered and reduce-scattered, 32 layers, 2 micro-batches
    assert p["cp_comm_gb"] * 1e9 == pytest.approx(cp, rel=1e-12)


# -------------------------------------------------------------------------------------------------
# Any depth: every decoder layer is alike, so step_rows counts one and multiplies


def buckets_one_at_a_time(sizes: list[int]) -> int:
    """DDP's buckets filled gradient by gradient: the reducer's rule, as written in torch."""
    count, current, limit = 0, 0, comm_formulas.FIRST_BUCKET_BYTES
    for size in sizes:
        current += size
        if current >= limit:
            count, current, limit = count + 1, 0, comm_formulas.BUCKET_BYTES
    return count + (current > 0)


@pytest.mark.quick
def test_ddps_buckets_over_repeated_layers_are_those_filled_one_gradient_at_a_time():
    # The closed form jumps from bucket to bucket and skips whole periods of identical layers:
    # layers far smaller and far larger than a bucket, sizes of zero, and the 1 MiB first bucket
    # closing inside the layers.
    mib, rng = 2**20, random.Random(0)
    for _ in range(300):
        scale = rng.choice([100, mib // 10, mib, 10 * mib, 60 * mib])
        root = [rng.randint(0, scale) for _ in range(rng.randint(0, 3))]
        layer = [rng.choice([0, rng.randint(1, scale)]) for _ in range(rng.randint(1, 9))]
        layers = rng.randint(0, 2000)
        want = buckets_one_at_a_time(root + layer * layers)
        assert comm_formulas.ddp_buckets([(root, 1), (layer, layers)]) == want, (root, layer)


@pytest.mark.quick
@pytest.mark.parametrize(
    "layout",
    [Layout(8, 8, zero_stage=1), Layout(8, 8, replicate=2), Layout(8, 2, tp=2, pp=2)],
    ids=["zero1", "hsdp", "tp-pp"],
)
def test_a_model_of_10_to_the_30_layers_has_rows_in_proportion_to_its_layers(layout):
    # Two depths L and 2L (on a pipeline, per stage): what grows with the layers doubles, the
    # rest (the root's, the loss's) stays; so the rows of 2L less those of L are L layers' worth,
    # exactly, at L = 10^6 and 10^30 alike. (DDP's bucket count is the test above's.)
    config = LlamaConfig.from_preset("7b")
    workload = Workload(1, 4096, 4, "bf16")
    small, huge = 10**6, 10**30

    def rows(layers: int) -> dict:
        deep = dataclasses.replace(config, num_hidden_layers=layers)
        return {key(r): r for r in step_rows(deep, layout, workload)}

    a, b, c, d = rows(small), rows(2 * small), rows(huge), rows(2 * huge)
    assert a.keys() == b.keys() == c.keys() == d.keys()
    buckets = ("all_reduce", "world", 8)
    for k in a:
        for part in ("calls", "bytes") if k != buckets else ("bytes",):
            assert (d[k][part] - c[k][part]) * small == (b[k][part] - a[k][part]) * huge, (k, part)
    assert any(b[k]["bytes"] > a[k]["bytes"] for k in a)  # (some rows grow with the layers)
