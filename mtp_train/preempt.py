"""Stopping cleanly when a cluster says so.

SIGTERM (what Slurm and Kubernetes send before SIGKILL) and SIGUSR1 (what `#SBATCH --signal=USR1@120` sends two
minutes before the time limit) ask a long stage to stop at its next safe point: `train` finishes the optimizer
step in flight, writes a checkpoint on every rank and exits; `precompute` finishes the shard in flight, keeps
every finished shard and exits. Both exit with EXIT_PREEMPTED (75, EX_TEMPFAIL: "try again"), which tells a
requeue that the same command resumes (`resume=true` for train; precompute always resumes). A second signal
stops the process at once; checkpoints and shards become visible only when complete (written under a
temporary name, then renamed), so nothing partial is left where a resume would read it.

A file `run_dir/STOP` asks `train` and `precompute` to stop the same way, without a signal: what a batch script
does when the signal reaches it rather than the stage's processes (`launch/slurm_multinode.sbatch`: under
torchrun the workers get a forwarded SIGTERM only as torchrun shuts down, 30 seconds before it kills them).
`train` removes the file once it has stopped; `precompute` removes a left-over one when it starts.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_PREEMPTED = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOP_FILE = "STOP"  # `touch run_dir/STOP`: train / precompute stop as on a signal


class Preempted(Exception):
    """A stage stopped early on request, its finished work kept: rerun the same command to go on (the command
line exits with EXIT_PREEMPTED)."""


class StopRequests:
    """While entered (in the main thread), SIGTERM / SIGUSR1 set `requested` (the signal's name) instead of
    killing the process; a second one restores the default action and re-sends itself. Elsewhere (another
    thread) it installs nothing and `requested` stays None."""

    def __init__(self, stage: str, at: str, speak: bool = True):
        self.stage, self.at, self.speak = stage, at, speak
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:  # the second request: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested = signal.Signals(signum).name
        if self.speak:
            print(f"\n{self.stage}: {self.requested} received: stopping after the {self.at} in flight (send it again "
                  "to stop at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
