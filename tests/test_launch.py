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
        "scontrol": 'if [[ "$1" == requeue ]]; then echo "scontrol $*"; else printf "node-a\\nnode-b\\n"; fi',
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
                         "--rdzv_backend=c10d", "--rdzv_endpoint=node-a:29500", "-m", "mtp_train", "train",
                         "resume=true", *ARGS]  # a requeued job resumes
    lines = run("slurm_multinode.sbatch", stand_ins, STAGE="precompute", GPUS_PER_PROCESS="2", **slurm)
    assert "--nproc_per_node=4" in lines and lines[-4:] == ["store.gpus_per_process=2", *ARGS]


# how the stage ends once run_dir/STOP exists: exit 75 (one process), or as torchrun ends when its workers exit
# 75 (it exits 1; mtp-train's first process wrote run_dir/PREEMPTED), or failing for another reason
ENDINGS = {"exit 75": ("exit 75", 75), "torchrun": ('echo stopped > "$d/PREEMPTED"; exit 1', 75),
           "failed": ("exit 1", 1)}


@pytest.mark.parametrize("ending", ENDINGS)
def test_slurm_time_limit_notice_stops_the_stage_and_requeues(stand_ins, tmp_path, ending):
    """Slurm's USR1 reaches the batch script: it creates run_dir/STOP, the stage (a stand-in that waits for it)
    stops as mtp-train does when it stops with its work kept, and the script requeues the job; a stage that
    failed is not requeued. A PREEMPTED file left by an earlier run does not count."""
    import signal
    import time

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "PREEMPTED").write_text("an earlier run's\n")
    stage = tmp_path / "bin" / "fake-stage"
    stage.write_text('#!/usr/bin/env bash\nfor a in "$@"; do [[ "$a" == run_dir=* ]] && d=${a#run_dir=}; done\n'
                     'touch "$d/started"; while [[ ! -e "$d/STOP" ]]; do sleep 0.05; done; '
                     f"{ENDINGS[ending][0]}\n")
    stage.chmod(0o755)
    env = {**stand_ins, "PYTHON": "fake-stage", "SLURM_JOB_NODELIST": "node-a", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_JOB_ID": "77"}
    proc = subprocess.Popen([str(LAUNCH / "slurm_multinode.sbatch"), "recipe=tiny", f"run_dir={run_dir}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not (run_dir / "started").exists():
        assert proc.poll() is None and time.time() - t0 < 30, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == ENDINGS[ending][1], err
    assert "asking train to stop after its current step or shard" in out
    requeued = "requeueing job 77" in out and "scontrol requeue 77" in out
    assert requeued == (ending != "failed")
    no_dir = subprocess.run([str(LAUNCH / "slurm_multinode.sbatch"), "recipe=tiny"], env=env, capture_output=True,
                            text=True)
    assert no_dir.returncode == 2 and "pass run_dir=" in no_dir.stderr


def test_torchrun_exits_1_when_its_workers_exit_75(tmp_path):
    """Why the Slurm script reads run_dir/PREEMPTED: torchrun does not pass its workers' 75 on."""
    import sys

    script = tmp_path / "stop.py"
    script.write_text("import sys\nsys.exit(75)\n")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                           str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "exitcode  : 75" in done.stderr
