"""Runs several `mtp-train train` commands in one torchrun launch (tests/test_distributed.py starts it).

    torchrun --standalone --nproc_per_node=2 tests/dist_worker.py SPEC.json RESULTS.json

SPEC.json is a list of runs, each {"name", "args": [CLI arguments after `train`], "die_at": step or null}.
The process group is started once here; each run goes through the real command line (`cli.main`) and the
trainer's `run`, which find the group started and use it. `die_at` kills the run (every rank, before the
optimizer step that would reach that step) the way an interrupted job dies, so a later run can resume it.
Rank 0 writes {name: exit code} to RESULTS.json. Starting the processes and DeepSpeed once for all runs
keeps the test fast.
"""

import json
import sys
import time

import torch


class Killed(BaseException):
    """Not an Exception: the command line's error handling must not catch it."""


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
        try:
            codes[run["name"]] = cli(["train", *run["args"]])
        except Killed:
            codes[run["name"]] = "killed"
        finally:
            Trainer.train_step = real_step
        torch.distributed.barrier()
        print(f"dist_worker: {run['name']} -> {codes[run['name']]} ({time.perf_counter() - t0:.1f} s)", flush=True)
    if torch.distributed.get_rank() == 0:
        with open(results, "w") as f:
            json.dump(codes, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
