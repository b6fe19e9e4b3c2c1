"""Runs several `mtp-train train` commands in one torchrun launch (tests/test_distributed.py starts it).

    torchrun --standalone --nproc_per_node=2 tests/dist_worker.py SPEC.json RESULTS.json

SPEC.json is a list of runs, each {"name", "args": [CLI arguments after `train`], "die_at": step or null,
"full_disk": {"rank": r, "step": s, "at": "space" | "write"} or null}.
The process group is started once here; each run goes through the real command line (`cli.main`) and the
trainer's `run`, which find the group started and use it. `die_at` kills the run (every rank, before the
optimizer step that would reach that step) the way an interrupted job dies, so a later run can resume it.
`full_disk` makes one rank's file system full for the checkpoint of step s: "space", it reports no free bytes
(the check every rank makes before a checkpoint); "write", rank 0's write of the checkpoint files fails with
ENOSPC as the OS reports it. Rank 0 writes {name: exit code} to RESULTS.json, and {name/rank1: ...} for
rank 1's. Starting the processes and DeepSpeed once for all runs
keeps the test fast.
"""

import errno
import json
import os
import sys
import time

import torch


class Killed(BaseException):
    """Not an Exception: the command line's error handling must not catch it."""


def full_disk(spec: dict | None):
    """Make this rank's disk look full as `spec` says; returns what undoes it."""
    from mtp_train import files
    from mtp_train.train import checkpoint

    if spec is None or spec["rank"] != torch.distributed.get_rank():
        return lambda: None
    name = f"step-{spec['step']:06d}"
    if spec["at"] == "space":
        real = files._free_bytes
        files._free_bytes = lambda path: 0 if name in str(path) else real(path)
        return lambda: setattr(files, "_free_bytes", real)
    real = checkpoint.write

    def write(tmp, *args, **kwargs):
        if name not in tmp.name:
            return real(tmp, *args, **kwargs)
        (tmp / "head.safetensors").write_bytes(b"\0" * 100)  # a partial file, as a write cut short leaves
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "head.safetensors"))

    checkpoint.write = write
    return lambda: setattr(checkpoint, "write", real)


def main() -> None:
    spec, results = json.loads(open(sys.argv[1]).read()), sys.argv[2]
    torch.distributed.init_process_group("gloo")
    from mtp_train.cli import main as cli
    from mtp_train.train.trainer import Trainer

    real_step = Trainer.train_step
    codes = {}
    for run in spec:
        t0 = time.perf_counter()
        die_at = run.get("die_at")

        def train_step(self, micro, die_at=die_at):
            if die_at is not None and self.step + 1 == die_at:
                raise Killed(f"killed before step {die_at}")
            return real_step(self, micro)

        Trainer.train_step = train_step
        undo = full_disk(run.get("full_disk"))
        try:
            codes[run["name"]] = cli(["train", *run["args"]])
        except Killed:
            codes[run["name"]] = "killed"
        finally:
            Trainer.train_step = real_step
            undo()
        torch.distributed.barrier()
        print(f"dist_worker: {run['name']} -> {codes[run['name']]} ({time.perf_counter() - t0:.1f} s)", flush=True)
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, codes)
    if torch.distributed.get_rank() == 0:
        with open(results, "w") as f:
            json.dump({**everyone[0], **{f"{name}/rank1": code for name, code in everyone[1].items()}}, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every run's exit code is gathered and written above. Leave without the interpreter's teardown: after ten
    # trainings and their DeepSpeed engines in one process, a native thread's destructor there has aborted a rank
    # ("terminate called without an active exception", exit -6) once on a fresh clone, failing a launch whose runs
    # had all ended as expected.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
