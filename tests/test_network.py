"""Specification of the network interface the launch scripts give gloo on several nodes.

gloo carries the CPU tensors, and --async-save's own group even under NCCL. Left to itself it
binds the address the node's host name resolves to, which on a cluster may be one the other
nodes cannot reach: its connections hang. run_ddp.sh (which slurm_ddp.sbatch runs on every node)
sets GLOO_SOCKET_IFNAME on every node: NCCL_SOCKET_IFNAME's interface, else the one that reaches
MASTER_ADDR, and a value the user gave is kept. A `torchrun` first on PATH prints what it was
given instead of starting anything; MASTER_ADDR 127.0.0.1 is reached through the loopback.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO, run_ddp_sh_env

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="interface names of Linux")
LOOPBACK = "lo"


def fake_bin(folder: Path) -> Path:
    """torchrun, scontrol and srun, as far as the scripts use them: torchrun prints gloo's and
    NCCL's interfaces; srun runs its command as the task of node 1."""
    folder.mkdir()
    programs = {
        "torchrun": 'echo "gloo=$GLOO_SOCKET_IFNAME nccl=$NCCL_SOCKET_IFNAME"',
        "scontrol": "echo 127.0.0.1",  # `scontrol show hostnames`: the first node
        "srun": 'while [ "${1#-}" != "$1" ]; do shift; done; SLURM_NODEID=1 exec "$@"',
    }
    for name, body in programs.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return folder


def interfaces(command: list[str], tmp_path: Path, **env) -> str:
    """The line the fake torchrun printed: gloo's and NCCL's interfaces."""
    base = run_ddp_sh_env()
    env = {**base, "PATH": f"{fake_bin(tmp_path / 'bin')}:{base['PATH']}", **env}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.setdefault(name, "")  # (a value the test machine's environment set: not ours)
        if not env[name]:
            del env[name]
    proc = subprocess.run([*command, "--out-dir", str(tmp_path / "o")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def second_node(**env) -> dict:
    return dict(NNODES="2", NODE_RANK="1", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", **env)


def test_run_ddp_sh_on_several_nodes_gives_gloo_the_interface_that_reaches_the_master(tmp_path):
    printed = interfaces(["bash", str(REPO / "run_ddp.sh")], tmp_path, **second_node())
    assert printed == f"gloo={LOOPBACK} nccl=", printed  # NCCL keeps its own choice


@pytest.mark.parametrize(
    "given, expected",
    [
        ({"NCCL_SOCKET_IFNAME": LOOPBACK}, f"gloo={LOOPBACK} nccl={LOOPBACK}"),  # NCCL's, one name
        ({"NCCL_SOCKET_IFNAME": "^docker,veth"}, f"gloo={LOOPBACK} nccl=^docker,veth"),  # a rule
        (
            {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": LOOPBACK},
            f"gloo=eth7 nccl={LOOPBACK}",
        ),
    ],
    ids=["nccl-interface", "nccl-exclusion", "gloo-given"],
)
def test_gloos_interface_follows_nccls_and_a_given_one_is_kept(tmp_path, given, expected):
    printed = interfaces(["bash", str(REPO / "run_ddp.sh")], tmp_path, **second_node(**given))
    assert printed == expected


def test_slurm_ddp_sbatch_gives_gloo_an_interface_on_every_node(tmp_path):
    # The task of node 1 (not the first node, whose address is MASTER_ADDR) under srun.
    slurm = dict(SLURM_SUBMIT_DIR=str(REPO), SLURM_JOB_NODELIST="node[1-2]", SLURM_NNODES="2",
                 SLURM_GPUS_ON_NODE="1", SLURM_JOB_ID="53")  # fmt: skip
    printed = interfaces(["bash", str(REPO / "slurm_ddp.sbatch")], tmp_path, **slurm)
    assert printed == f"gloo={LOOPBACK} nccl=", printed
