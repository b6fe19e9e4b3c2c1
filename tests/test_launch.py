"""The launch scripts: valid shell (shellcheck when installed, else `bash -n`), and the torchrun / srun
command lines they build, with a stand-in for python, nvidia-smi, scontrol and srun that prints its
arguments (no GPU, no Slurm)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[1] / "launch"
SCRIPTS = sorted(p for p in LAUNCH.iterdir() if p.suffix in (".sh", ".sbatch"))
ARGS = ["recipe=llama3.1-70b", "target.path=/models/Llama (ft)", "run_dir=runs/70b"]


def test_scripts_are_valid_shell():
    assert {p.name for p in SCRIPTS} >= {"train_single_node.sh", "precompute_single_node.sh",
                                         "slurm_multinode.sbatch", "pipeline.sh"}
    for p in SCRIPTS:
        assert os.access(p, os.X_OK), f"{p} is not executable"
        subprocess.run(["bash", "-n", str(p)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", *map(str, SCRIPTS)], check=True)


@pytest.fixture
def stand_ins(tmp_path):
    """A bin/ directory first on PATH: `echo-args` prints one argument per line; nvidia-smi lists 4 GPUs;
    scontrol names two hosts; srun runs its command after its own options."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "echo-args": 'printf "%s\\n" "$@"',
        "nvidia-smi": 'for i in 0 1 2 3; do echo "GPU $i: NVIDIA H100"; done',
        "scontrol": 'printf "node-a\\nnode-b\\n"',
        "srun": 'while [[ "$1" == --* ]]; do shift; done; exec "$@"',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": "echo-args"}
    return env


def run(script: str, env: dict, **extra) -> list[str]:
    out = subprocess.run([str(LAUNCH / script), *ARGS], env={**env, **extra}, capture_output=True, text=True,
                         check=True)
    return out.stdout.splitlines()


def test_train_single_node_runs_one_process_per_gpu(stand_ins):
    assert run("train_single_node.sh", stand_ins) == [
        "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m", "mtp_train", "train", *ARGS]
    assert "--nproc_per_node=2" in run("train_single_node.sh", stand_ins, NPROC="2")


def test_precompute_single_node_spreads_a_large_target(stand_ins):
    assert run("precompute_single_node.sh", stand_ins, GPUS_PER_PROCESS="2") == [
        "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "mtp_train", "precompute",
        "store.gpus_per_process=2", *ARGS]
    bad = subprocess.run([str(LAUNCH / "precompute_single_node.sh"), *ARGS], capture_output=True, text=True,
                         env={**stand_ins, "GPUS_PER_PROCESS": "3"})
    assert bad.returncode == 2 and "GPUS=4 is not a multiple of GPUS_PER_PROCESS=3" in bad.stderr


def test_slurm_rendezvous_on_the_first_node(stand_ins):
    slurm = {"SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "77"}
    lines = run("slurm_multinode.sbatch", stand_ins, **slurm)
    assert lines[0] == "mtp-train train: 2 node(s) x 8 process(es), rendezvous node-a:29500"
    assert lines[1:] == ["-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=8", "--rdzv_id=77",
                         "--rdzv_backend=c10d", "--rdzv_endpoint=node-a:29500", "-m", "mtp_train", "train", *ARGS]
    lines = run("slurm_multinode.sbatch", stand_ins, STAGE="precompute", GPUS_PER_PROCESS="2", **slurm)
    assert "--nproc_per_node=4" in lines and lines[-4:] == ["store.gpus_per_process=2", *ARGS]
