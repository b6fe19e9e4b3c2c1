"""vLLM as a second engine: `vllm_run.py` (a script that imports nothing of ours) run with the Python of a venv that
has vLLM, on token-id prompts, the target alone or with a draft directory vLLM serves. The export's engine check and
validation with `validate.engine=vllm` both decode through `run_vllm`. Regeneration (`data.regen_engine=vllm`) keeps
one vLLM running through `VllmWorker` (`vllm_worker.py`): chunks of prompts in, each chunk's tokens out as it
finishes. (Not named vllm.py: `vllm_run.py` runs as a file, so its folder comes first on its path and would shadow
vLLM itself.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

# export layout -> vLLM's speculative method for it
METHODS = {"vllm-mtp": "eagle", "eagle-vllm": "eagle", "eagle3": "eagle3", "eagle3-speculators": "eagle3",
           "deepseek-eagle": "eagle", "deepseek-nextn": "mtp"}


VLLM_RUN = Path(__file__).with_name("vllm_run.py")  # run as a file with vLLM's Python
VLLM_WORKER = Path(__file__).with_name("vllm_worker.py")  # likewise
VLLM_PYTHON_ENV = "MTP_TRAIN_VLLM_PYTHON"
VLLM_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"  # `make .venv-vllm/.vllm-installed` builds it
KV_CACHE_GB = "4"  # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE) unless the environment sets it
# the worker's settings of vLLM's CPU build unless the environment sets them: no core kept back for the front end
# (vLLM keeps one by default; the offline worker's front end idles while vLLM decodes, and on 2 cores the one kept
# back is half the machine: 1.6-1.8x the tokens/s without it, SmolLM2-135M bf16, 64 prompts)
WORKER_ENV = {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GB, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def find_vllm_python() -> str | None:
    """The Python of a venv with vLLM: $MTP_TRAIN_VLLM_PYTHON, else the repository's .venv-vllm; None when neither
    is there."""
    for c in (os.environ.get(VLLM_PYTHON_ENV, ""), str(VLLM_VENV / "bin" / "python")):
        if c and Path(c).is_file():
            return c
    return None


def probe_vllm(python: str, timeout: float = 300) -> dict:
    """{"vllm_version", "device"} of the vLLM that `python` imports (`vllm_worker.py --probe`: seconds, no model
    loaded), or {"error": why it does not}."""
    try:
        done = subprocess.run([python, str(VLLM_WORKER), "--probe"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"exit {done.returncode}: {' '.join(done.stderr.split()[-60:])}"}


def run_vllm(python: str, target: str, prompts: list[list[int]], out: Path, new_tokens: int, dtype: str,
             spec: tuple[str, str, int] | None = None, options: tuple[str, ...] = (), timeout: float = 1800) -> dict:
    """`vllm_run.py` with vLLM's Python (and its further `options`); its JSON (with `error` when vLLM could not
    do it). vLLM's output goes to `out` with `.log` for `.json`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)  # never an earlier run's figures
    log = out.with_suffix(".log")
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=out.parent, delete=False) as f:
        json.dump(prompts, f)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    length = max(len(p) for p in prompts) + new_tokens + (spec[2] if spec else 0) + 8
    cmd = [python, str(VLLM_RUN), target, f.name, str(out), *(map(str, spec) if spec else ()),
           "--max-tokens", str(new_tokens), "--dtype", dtype, "--max-model-len", str(max(1024, length)), *options]
    try:
        with open(log, "w") as stream:
            done = subprocess.run(cmd, env=env, stdout=stream, stderr=subprocess.STDOUT, timeout=timeout)
    finally:
        os.unlink(f.name)
    if not out.is_file():
        raise RuntimeError(f"{' '.join(cmd)} wrote no result (exit {done.returncode}): see {log}")
    return json.loads(out.read_text())


class VllmWorkerError(RuntimeError):
    """The vLLM worker failed to start or to decode, or died: the message says which and where its log is."""


class VllmWorker:
    """`vllm_worker.py` run with vLLM's Python and kept running: `generate` sends one chunk of prompts and returns
    its output tokens when vLLM has finished them all. vLLM's output goes to `log`. The worker leads its own process
    group, so a signal meant for the caller (a terminal's Ctrl-C, a launcher's SIGTERM to the group) leaves it to
    the caller; `close()` ends it, vLLM's engine processes with it, and it ends itself when the caller dies."""

    def __init__(self, python: str, target: str, log: Path, dtype: str, max_model_len: int, max_num_seqs: int,
                 options: tuple[str, ...] = ()):
        self.log, self.chunks = log, 0
        self.command = [python, str(VLLM_WORKER), target, "--dtype", dtype, "--max-model-len", str(max_model_len),
                        "--max-num-seqs", str(max_num_seqs), *options]
        env = {**WORKER_ENV, **os.environ}
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as stream:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stream,
                                         text=True, env=env, start_new_session=True)
        try:
            ready = self._read("start")
        except BaseException:
            self.close(wait=0)
            raise
        self.version, self.device = ready["vllm_version"], ready["device"]

    def _read(self, what: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise VllmWorkerError(f"vLLM ({' '.join(self.command)}) exited ({self.proc.wait()}) before it could "
                                  f"{what}: see {self.log}")
        message = json.loads(line)
        if "error" in message:
            raise VllmWorkerError(f"vLLM could not {what}: {message['error']} (log: {self.log})")
        return message

    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float, seeds: list[int] | None,
                 stop: list[int]) -> tuple[list[list[int]], float]:
        """(the output tokens of each prompt, a stop token included where one ended it; vLLM's seconds)."""
        self.chunks += 1
        what = f"decode chunk {self.chunks} ({len(prompts)} prompts)"
        try:
            self.proc.stdin.write(json.dumps({"chunk": self.chunks, "prompts": prompts, "max_tokens": max_tokens,
                                              "temperature": temperature, "seeds": seeds, "stop": stop}) + "\n")
            self.proc.stdin.flush()
        except OSError:  # it died: _read says how
            pass
        out = self._read(what)
        if out.get("chunk") != self.chunks or len(out.get("tokens", ())) != len(prompts):
            raise VllmWorkerError(f"vLLM answered {what} with chunk {out.get('chunk')} of "
                                  f"{len(out.get('tokens', ()))} outputs (log: {self.log})")
        return out["tokens"], float(out["seconds"])

    def close(self, wait: float = 60) -> None:
        """End of input: the worker exits; killed (its whole group) after `wait` seconds."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of its group is left
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
