"""Stopping cleanly when a cluster says so.

SIGTERM (what Slurm and Kubernetes send before SIGKILL) and SIGUSR1 (what `#SBATCH --signal=USR1@120` sends two
minutes before the time limit) ask a long stage to stop at its next safe point: `train` finishes the optimizer
step in flight, writes a checkpoint on every rank and exits; `precompute` finishes the shard in flight, keeps
every finished shard and exits; `prepare` finishes the batch of regenerated replies in flight (or the server
requests in flight) and commits it to its journal. All exit with EXIT_PREEMPTED (75, EX_TEMPFAIL: "try
again"), which tells a requeue that the same command resumes (`resume=true` for train; precompute and prepare
always resume). A second signal stops the process at once; checkpoints and shards become visible only when
complete (written under a temporary name, then renamed), journal commits are whole lines, so nothing partial
is left where a resume would read it.

A file `run_dir/STOP` asks `train` and `precompute` to stop the same way, without a signal: what a batch script
does when the signal reaches it rather than the stage's processes (`launch/slurm_multinode.sbatch`: under
torchrun the workers get a forwarded SIGTERM only as torchrun shuts down, 30 seconds before it kills them).
`train` removes the file once it has stopped; `precompute` removes a left-over one when it starts.

A signal may come at any moment, not only while a stage works through its steps or shards: while the target
loads, DeepSpeed initialises, the step-0 evaluation runs, the sources are read. So the command line installs
the handling first thing for `prepare`, `precompute` and `train` (each stage's `run` again, for callers in
Python), in the *at once* mode: while nothing of the stage's own is being written, a request raises Preempted
right where the main thread is, and the stage exits 75 at once. Around the parts that write (a step and its
checkpoint, a shard, a batch of regenerated replies and its journal commit, the dataset) the stage enters the
deferred mode: the request is recorded and honoured at the next safe point. A request once made stays made (a
deferred part entered later stops at its first safe point); a second one stops the process at once.

Under torchrun the exit status does not carry the 75 (torchrun exits 1 when a worker exits with anything but
0), so the command line's first process also writes `run_dir/PREEMPTED` (the message) when its stage stopped on
request; the next run of a stage removes it. `launch/slurm_multinode.sbatch` requeues on either.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_PREEMPTED = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOP_FILE = "STOP"  # `touch run_dir/STOP`: train / precompute stop as on a signal
# written by the command line when a stage stopped on request: under torchrun the exit status says only that
# a worker failed (torchrun exits 1 whatever its workers' codes), so a batch script reads this file instead
PREEMPTED_FILE = "PREEMPTED"


class Preempted(BaseException):
    """A stage stopped early on request, its finished work kept: rerun the same command to go on (the command
line exits with EXIT_PREEMPTED). A BaseException, as KeyboardInterrupt is: raised at once, it may surface inside
any code, and no `except Exception` on its way may turn a stop into another error."""


_active: list["StopRequests"] = []  # entered StopRequests, innermost last (the main thread's only)


class StopRequests:
    """While entered (in the main thread), SIGTERM / SIGUSR1 are requests to stop, not the end of the process.
    Deferred (the default): the request sets `requested` (the signal's name), which the stage reads at its safe
    points. `at_once`: the request raises Preempted where the main thread is (for the parts that write nothing
    that could be left half-done; `then` says what the rerun does). A request made while another StopRequests
    is entered is recorded in all of them; a second request restores the default action and re-sends itself.
    Elsewhere (another thread) it installs nothing and `requested` stays None."""

    def __init__(self, stage: str, at: str, speak: bool = True, at_once: bool = False,
                 then: str = "the same command goes on from there"):
        self.stage, self.at, self.speak, self.at_once, self.then = stage, at, speak, at_once, then
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if any(s.requested is not None for s in _active):  # the second request: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        name = signal.Signals(signum).name
        for s in _active:
            s.requested = name
        if self.at_once:
            raise Preempted(f"{self.stage}: stopped on request ({name}) {self.at}, at once: nothing was being "
                            f"written, what was finished is kept; {self.then}")
        if self.speak:
            print(f"\n{self.stage}: {name} received: stopping after the {self.at} in flight (send it again "
                  "to stop at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            self.requested = next((s.requested for s in _active if s.requested is not None), None)
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
            _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self in _active:
            _active.remove(self)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
