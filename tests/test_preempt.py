"""Preemption with real signals sent to a real `mtp-train` process: SIGTERM during `train` finishes the step,
writes a checkpoint and exits 75, and the resumed run ends bit-identical to an uninterrupted one; a second
signal stops it at once with nothing partial visible."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mtp_train.preempt import EXIT_PREEMPTED
from mtp_train.train import checkpoint as ckpt
from mtp_train.train.trainer import Trainer
from test_train import config, samples  # noqa: F401  (the module-scoped store samples)
from windows import make_store

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["train.steps=16", "train.save_every=0", "train.depth=2", "train.lr=1e-3"]


def start_train(run_dir: Path, *extra: str) -> subprocess.Popen:
    overrides = ["train.micro_batch=8", "train.warmup_steps=2", "train.eval_every=0", "train.log_every=1", *ARGS]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "PYTHONUNBUFFERED": "1"}  # as in-process
    return subprocess.Popen([sys.executable, "-m", "mtp_train.cli", "train", "recipe=tiny", f"run_dir={run_dir}",
                             *overrides, *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float = 120) -> None:
    metrics, t0 = run_dir / "metrics.jsonl", time.time()
    while time.time() - t0 < timeout:
        if metrics.is_file() and any(json.loads(r).get("step", 0) >= step and "train/loss" in json.loads(r)
                                     for r in metrics.read_text().splitlines() if r.strip()):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise TimeoutError(f"no step {step} logged in {timeout}s")


def test_sigterm_checkpoints_and_the_resume_is_exact(tmp_path, samples, tiny_dir):  # noqa: F811
    clean, stopped = tmp_path / "clean", tmp_path / "stopped"
    for d in (clean, stopped):
        make_store(d, samples, tiny_dir / "target")
    proc = start_train(stopped)
    wait_for_step(stopped, proc, 2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "SIGTERM received: stopping after the optimizer step in flight" in err
    assert "train: stopped on request (SIGTERM) after step" in err and "resume=true goes on from there" in err
    step = ckpt.step_of(ckpt.latest(stopped / "checkpoints"))
    assert 2 <= step < 16 and ckpt.verify(ckpt.latest(stopped / "checkpoints")) == []
    assert not list((stopped / "checkpoints").glob("*.tmp")) and (stopped / ".lock").read_text() == ""

    proc = start_train(stopped, "resume=true")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert f"resumed from {stopped / 'checkpoints' / f'step-{step:06d}'}" in out
    Trainer(config(clean, *ARGS)).fit()  # the same run, uninterrupted, in this process
    a = ckpt.load_head_state(clean / "checkpoints" / "step-000016")
    b = ckpt.load_head_state(stopped / "checkpoints" / "step-000016")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_second_signal_stops_at_once_leaving_nothing_partial(tmp_path, samples, tiny_dir):  # noqa: F811
    make_store(tmp_path, samples, tiny_dir / "target")
    proc = start_train(tmp_path, "train.save_every=1")  # a checkpoint every step: the second signal lands in one
    wait_for_step(tmp_path, proc, 2)
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.01)
    proc.send_signal(signal.SIGUSR1)
    proc.communicate(timeout=120)
    assert proc.returncode in (-signal.SIGUSR1, EXIT_PREEMPTED)  # at once, or (rarely) the first stop was faster
    root = tmp_path / "checkpoints"
    for path in ckpt.checkpoints(root):  # whatever became visible is complete
        assert ckpt.verify(path) == [], path
    assert ckpt.verify(ckpt.latest(root)) == []


def test_a_stop_file_stops_training_like_a_signal(tmp_path, samples, tiny_dir):  # noqa: F811
    from mtp_train.preempt import Preempted

    make_store(tmp_path, samples, tiny_dir / "target")
    (tmp_path / "STOP").touch()
    with pytest.raises(Preempted, match=r"stopped on request \(run_dir/STOP\) after step 1 of 16"):
        Trainer(config(tmp_path, *ARGS)).fit()
    assert ckpt.latest(tmp_path / "checkpoints").name == "step-000001" and not (tmp_path / "STOP").exists()
    assert Trainer(config(tmp_path, *ARGS, "resume=true")).step == 1


@pytest.mark.parametrize("at", ["mtp_train.train.trainer:build_head",  # the target's tensors load
                                "mtp_train.train.distributed:build_engine",  # DDP / DeepSpeed initialise
                                "mtp_train.train.trainer:Trainer.validate"])  # the step-0 evaluation
def test_sigterm_during_start_up_exits_75_with_nothing_written(tmp_path, samples, tiny_dir, at):  # noqa: F811
    """Before step 1 a stop request ends train at once (not with the default handler's 143); no checkpoint, no
    training step, the lock released; the same command with resume=true then trains from step 0."""
    from stops import signalled_run

    make_store(tmp_path, samples, tiny_dir / "target")
    args = ["train", "recipe=tiny", f"run_dir={tmp_path}", "train.micro_batch=8", "train.eval_every=0", *ARGS]
    done = signalled_run(args, at)
    assert f"stops: signalling in {at}" in done.stderr
    assert done.returncode == EXIT_PREEMPTED, done.stderr
    assert "train: stopped on request (SIGTERM) outside an optimizer step (start-up: loading, initialising, the " \
           "step-0 evaluation), at once: nothing was being written" in done.stderr
    assert "the same command with resume=true goes on" in done.stderr
    assert not (tmp_path / "checkpoints").exists() and (tmp_path / ".lock").read_text() == ""
    metrics = tmp_path / "metrics.jsonl"
    assert not metrics.exists() or not any("train/loss" in r for r in metrics.read_text().splitlines())
    t = Trainer(config(tmp_path, *ARGS, "train.steps=2", "resume=true"))
    assert t.step == 0 and t.fit()["steps"] == 2


def test_sigterm_as_soon_as_train_starts_exits_75(tmp_path, samples, tiny_dir):  # noqa: F811
    """A signal sent from outside the moment the process speaks (it is still importing and loading)."""
    make_store(tmp_path, samples, tiny_dir / "target")
    proc = start_train(tmp_path)
    assert "mtp-train train: recipe tiny" in proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "train: stopped on request (SIGTERM)" in err and not (tmp_path / "checkpoints").exists()
