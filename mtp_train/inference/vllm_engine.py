"""vLLM as a second engine: `vllm_run.py` (a script that imports nothing of ours) run with the Python of a venv that
has vLLM, on token-id prompts, the target alone or with a draft directory vLLM serves. The export's engine check and
validation with `validate.engine=vllm` both decode through `run_vllm`. (Not named vllm.py: `vllm_run.py` runs as a
file, so its folder comes first on its path and would shadow vLLM itself.)
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

# export layout -> vLLM's speculative method for it
METHODS = {"vllm-mtp": "eagle", "eagle-vllm": "eagle", "eagle3": "eagle3", "eagle3-speculators": "eagle3",
           "deepseek-eagle": "eagle", "deepseek-nextn": "mtp"}


VLLM_RUN = Path(__file__).with_name("vllm_run.py")  # run as a file with vLLM's Python


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
