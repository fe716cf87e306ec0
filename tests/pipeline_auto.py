"""Run under torchrun with 2 CPU ranks: train_pp.py's --micro-batch-size auto (lib/parallel/
pipeline.py's measured) on simulated GPU memory counters, then one training step with the size
it chose, against a pipeline built directly for that size. Prints one JSON line per rank and
case (tests/test_perf_options.py reads them).

    python -m torch.distributed.run --nproc_per_node=2 tests/pipeline_auto.py
    python -m torch.distributed.run --nproc_per_node=2 tests/pipeline_auto.py \
        --lesson TOTAL_MEMORY TRAIN_PP_FLAGS...   # train_pp.py itself on the simulated GPU

The cases: --pp 2 with 1f1b (2 stages) and interleaved 1F1B (4 stages, 2 per rank), the tiny
model (4 layers) at --seq-length 16. What each rank's "GPU" holds at its peak is simulated, as
tests/test_perf_options.py's simulated_gpu fixture does on one process: BASE bytes plus PER_ROW
bytes for each sequence of the largest micro-batch a stage of this rank ran since the counters
were reset. Rank 1 needs twice rank 0's memory per sequence (it holds the last stage, whose
logits are the largest activations), so the largest peak of all ranks, not a rank's own, decides.

A collective that one rank did not join times out after 60 s (gloo): a disagreement fails
instead of hanging.
"""

import datetime
import json
import os
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage

from lib import flags, training
from lib.checkpoints.out_dir import TrainingState
from lib.exits import end_process
from lib.extras import auto_batch
from lib.parallel import pipeline
from model import IGNORE_INDEX, LlamaConfig, LlamaForPretraining

BASE, PER_ROW = 1000, {0: 100, 1: 200}  # simulated bytes
# (schedule, --batch-size, total "GPU" memory). The budget is 0.9 of the memory.
CASES = [
    # Budget 2000: rank 1's peaks 1200, 1400, 1800 for 1, 2, 4 sequences; 8 would need 2600 on
    # rank 1 (rank 0 alone: 1800, and would take 8). 16 (1 micro-batch < 2 stages) is refused.
    ("1f1b", 16, 2223),
    # Plenty: every size that 1f1b takes fits, up to 8; 16 would, but 1f1b cannot take it.
    ("1f1b", 16, 10**6),
    # 10 sequences: 5 micro-batches of 2 are not rounds of 2 (5 // --pp 2): 2 is refused;
    # 1, 5 and 10 (1 micro-batch) are taken.
    ("interleaved", 10, 10**6),
]
VOCAB, SEQ = 320, 16
rank, cpu = int(os.environ["RANK"]), torch.device("cpu")

# ---- simulated GPU memory counters -------------------------------------------------------------
rows_since_reset: list[int] = []  # the rows of each stage forward since the last reset
probed: list[int] = []  # the micro-batch of each probe, as the counters saw it
stage_forward = pipeline.StageModel.forward


def counted_forward(self, h, attn_mask=None):
    rows_since_reset.append(h.size(0))
    return stage_forward(self, h, attn_mask)


def peak(device) -> int:
    probed.append(max(rows_since_reset))
    return BASE + PER_ROW[rank] * max(rows_since_reset)


def simulate_gpu(total_memory: int) -> None:
    """torch.cuda's memory counters answered by the simulation, and this CPU taken for a GPU."""
    torch.cuda.get_device_properties = lambda device: SimpleNamespace(total_memory=total_memory)
    torch.cuda.empty_cache = lambda: None
    torch.cuda.reset_peak_memory_stats = lambda device: rows_since_reset.clear()
    torch.cuda.max_memory_reserved = peak
    torch.cuda.memory_reserved = lambda device: BASE  # what the model and optimizer hold
    auto_batch.check_device = lambda parser: None
    pipeline.StageModel.forward = counted_forward


def pipeline_parts(args, layout):
    """A rank's stages of the tiny model, sharded with FSDP as train_pp.py shards them (over
    the one data-parallel rank here), the RankModel over them, and AdamW: the same initial
    weights every time (seed 0)."""
    torch.manual_seed(0)
    config = LlamaConfig.from_preset("tiny", vocab_size=VOCAB)
    stage_models = pipeline.build_stages(LlamaForPretraining(config), layout, "fp32")
    for stage_model in stage_models:
        for layer in stage_model.layers.values():
            fully_shard(layer, mesh=layout.fsdp_mesh)
        fully_shard(stage_model, mesh=layout.fsdp_mesh)
    model = pipeline.RankModel(stage_models)
    optimizer = training.build_optimizer(model, args, "cpu")
    return stage_models, TrainingState(model, optimizer, None, None, config, None)


def train_step(stage_models, layout, schedule_name: str, m: int, batch):
    """One training step's schedule run, as train_pp.py builds and runs it: the last stage's
    loss sum and this rank's gradients by parameter name."""
    num_stages = layout.pp * layout.stages_per_rank
    pp_rank, pp_group = layout.mesh.get_local_rank("pp"), layout.mesh["pp"].get_group()
    stages = [PipelineStage(s, s.index, num_stages, cpu, group=pp_group) for s in stage_models]
    loss_fn = pipeline.PipelineLoss()
    runs = stages if schedule_name == "interleaved" else stages[0]
    Schedule = pipeline.SCHEDULES[schedule_name]
    schedule = Schedule(runs, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    x, y = batch
    loss_fn.scale, losses = 1 / (y != IGNORE_INDEX).sum(), []
    inputs = (x,) if pp_rank == 0 else ()
    target = y if pp_rank == layout.pp - 1 else None
    schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
    grads = {
        name: p.grad.full_tensor()
        for s in stage_models
        for name, p in s.named_parameters()
        if p.grad is not None
    }
    return pipeline.joined(losses, cpu), grads


def run_case(schedule_name: str, batch_size: int, total_memory: int) -> dict:
    simulate_gpu(total_memory)
    parser = flags.build_parser("test", sharded=True)
    pipeline.add_flags(parser)
    argv = ["--pp", "2", "--schedule", schedule_name, "--batch-size", str(batch_size)]
    argv += ["--seq-length", str(SEQ), "--vocab-size", str(VOCAB), "--micro-batch-size", "auto"]
    args = parser.parse_args(argv)
    layout = pipeline.setup(parser, args, dist.get_world_size(), cpu)
    settings = pipeline.run_settings(parser, args, layout, cpu)
    stage_models, state = pipeline_parts(args, layout)
    probed.clear()
    rng = torch.get_rng_state()
    weights = {k: v.full_tensor().clone() for k, v in state.model.state_dict().items()}
    settings, layout = pipeline.measured(settings, args, layout, state, lambda x: None, cpu)
    after = state.model.state_dict()
    result = dict(
        case=f"{schedule_name} {batch_size} {total_memory}",
        rank=rank,
        chose=settings.micro_batch_size,
        accumulation=settings.accumulation,
        layout=[layout.micro_batches, layout.micro_batch_size],
        probed=list(probed),
        rng_kept=torch.equal(torch.get_rng_state(), rng),
        grads_left=sum(p.grad is not None for p in state.model.parameters()),
        weights_kept=all(torch.equal(after[k].full_tensor(), w) for k, w in weights.items()),
    )
    # One step with the size chosen, then with a pipeline that never probed, built for it.
    ids = torch.randint(VOCAB, (batch_size, SEQ + 1), generator=torch.Generator().manual_seed(1))
    batch = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # (as a step's batches are)
    m = settings.accumulation
    loss, grads = train_step(stage_models, layout, schedule_name, m, batch)
    direct_models, _ = pipeline_parts(args, layout)
    direct_loss, direct_grads = train_step(direct_models, layout, schedule_name, m, batch)
    result["same_loss"] = torch.equal(loss, direct_loss)
    result["same_grads"] = grads.keys() == direct_grads.keys() and all(
        torch.equal(g, direct_grads[k]) for k, g in grads.items()
    )
    result["grads_compared"] = len(grads)
    return result


if sys.argv[1:2] == ["--lesson"]:  # train_pp.py as a user runs it, on the simulated GPU
    simulate_gpu(int(sys.argv[2]))
    sys.argv = ["train_pp.py", *sys.argv[3:]]
    runpy.run_path(str(Path(__file__).parents[1] / "train_pp.py"), run_name="__main__")
else:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    for case in CASES:
        print(json.dumps(run_case(*case)) + "\n", end="", flush=True)  # one write per line
    dist.destroy_process_group()
    end_process(0)  # no interpreter teardown: it can abort after a group (lib/exits.py)
