"""Which engine writes the regenerated replies (`data.regen_engine`) and in which dtype (`data.regen_dtype`), and
the vLLM one: vLLM's CPU (or GPU) build run offline in its own venv (`inference/vllm_worker.py`), fed the round's
prompts in chunks of `data.regen_chunk`, each chunk's replies committed to the journal as it comes back.

The choice, made once per prepare and written (with its reason) to the log, the journal's header and the manifest:
`ours` or `vllm` as set; `auto` takes vLLM when its Python is found ($MTP_TRAIN_VLLM_PYTHON, else the repository's
.venv-vllm), imports, and runs on the device our engine would use (its CPU build for a CPU target), else ours. The
dtype: as set; `auto` gives either engine bf16 on a GPU or on a CPU with AMX (`amx_bf16` / `amx_tile` among
/proc/cpuinfo's flags: bf16 matrix products run on its tile units), fp32 elsewhere (bf16 without AMX is slower than
fp32). On a 2-core AMX Xeon, SmolLM2-135M, our engine decodes 1.7-1.9x faster in bf16 than in fp32 (batches of 16
and 32), its prefills of 1,000-token prompts 1.6-2.5x. A journal already there is continued with the engine and
dtype that wrote it (auto). Only the replies' text comes from that dtype: the store is computed later in the
recipe's dtype.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mtp_train.inference.load import eos_ids
from mtp_train.inference.vllm_engine import VLLM_PYTHON_ENV, VLLM_VENV, VllmWorker, find_vllm_python, probe_vllm
from mtp_train.preempt import Preempted, StopRequests

if TYPE_CHECKING:
    from mtp_train.config import RunConfig


@dataclass
class EngineChoice:
    engine: str  # ours | vllm | server
    dtype: str  # the replies are decoded in it
    reason: str
    python: str | None = None  # vLLM's
    vllm: dict = field(default_factory=dict)  # its probe: vllm_version, device

    def describe(self) -> dict:
        """As the journal's header and the manifest record it."""
        return {"engine": self.engine, "dtype": self.dtype, "reason": self.reason,
                **({"python": self.python, **self.vllm} if self.engine == "vllm" else {})}


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of the first processor of this /proc/cpuinfo text (none without a `flags` line)."""
    for line in cpuinfo.splitlines():
        if line.split(":")[0].strip() == "flags":
            return set(line.partition(":")[2].split())
    return set()


def has_amx(cpuinfo: str) -> bool:
    """Whether the processor of this /proc/cpuinfo text has AMX (Intel's tile matrix units): `amx_bf16` or `amx_tile`
    among its flags."""
    return bool({"amx_bf16", "amx_tile"} & cpu_flags(cpuinfo))


def read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no AMX known
        return ""


def regen_dtype(setting: str, device: str, cpuinfo: str) -> tuple[str, str]:
    """(the dtype the replies are decoded in, why)."""
    if setting != "auto":
        return setting, f"data.regen_dtype={setting}"
    if device == "cuda":
        return "bfloat16", "a CUDA GPU"
    if has_amx(cpuinfo):
        return "bfloat16", "the CPU has AMX (amx_bf16 / amx_tile in /proc/cpuinfo)"
    return "float32", "the CPU has no AMX (bf16 is slower than fp32 there)"


def choose_engine(setting: str, device: str, recorded: str | None = None, find=find_vllm_python,
                  probe=probe_vllm) -> tuple[str, str, str | None, dict]:
    """(ours | vllm, why, vLLM's Python, its probe) for data.regen_engine=`setting` with the target on `device`
    (cpu | cuda); `recorded`: the engine of a journal already there (auto goes on with it)."""
    if setting == "ours":
        return "ours", "data.regen_engine=ours", None, {}
    where = f"${VLLM_PYTHON_ENV} or {VLLM_VENV}"
    if setting == "auto" and recorded == "ours":
        return "ours", "auto: the journal there was written by our engine", None, {}
    python = find()
    if python is None:
        if setting == "vllm":
            raise FileNotFoundError(f"data.regen_engine=vllm needs vLLM's Python: set ${VLLM_PYTHON_ENV}=/path/to/venv"
                                    f"/bin/python, or build {VLLM_VENV} (make .venv-vllm/.vllm-installed)")
        return "ours", f"auto: no vLLM Python ({where}: none there)", None, {}
    info = probe(python)
    if "error" in info:
        if setting == "vllm":
            raise RuntimeError(f"data.regen_engine=vllm: vLLM at {python} does not import: {info['error']}")
        return "ours", f"auto: vLLM at {python} does not import ({info['error'][:200]})", None, {}
    if setting == "auto" and info.get("device") != device and recorded != "vllm":
        return "ours", (f"auto: vLLM at {python} runs on {info.get('device')}, the target on {device} "
                        "(our engine)"), None, {}
    why = "data.regen_engine=vllm" if setting == "vllm" else (
        "auto: the journal there was written by vLLM" if recorded == "vllm" else
        f"auto: vLLM {info.get('vllm_version')} found at {python}, on {info.get('device')} as the target")
    return "vllm", why, python, info


def choose(data, device: str, target_dtype: str, recorded: dict | None = None, cpuinfo: str | None = None,
           find=find_vllm_python, probe=probe_vllm) -> EngineChoice:
    """The engine and dtype of this prepare's regeneration (`data`: its DataConfig; `recorded`: the engine and dtype
    of a journal already there, {"engine": ours | vllm | server, "dtype": ...})."""
    if data.regenerate_server:
        return EngineChoice("server", target_dtype, f"data.regenerate_server={data.regenerate_server}")
    recorded = recorded or {}
    engine, why, python, info = choose_engine(data.regen_engine, device, recorded.get("engine"), find, probe)
    if data.regen_dtype == "auto" and recorded.get("engine") == engine and recorded.get("dtype"):
        dtype, dtype_why = recorded["dtype"], "auto: the journal there was decoded in it"
    else:
        dtype, dtype_why = regen_dtype(data.regen_dtype, device, read_cpuinfo() if cpuinfo is None else cpuinfo)
    return EngineChoice(engine, dtype, f"{why}; {dtype}: {dtype_why}", python, info)


def reply_seed(seed: int, round_: int, conversation: int) -> int:
    """The sampling seed of one vLLM request: the run's seed, the round and the conversation (not where a run
    started, nor the chunk)."""
    digest = hashlib.sha256(f"{seed}:{round_}:c{conversation}".encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1


def chunks(prompts: list[list[int]], skip, size: int) -> list[list[int]]:
    """The indices of the prompts not in `skip` (a predicate on an index), longest first (similar lengths in a
    batch), in chunks of `size`."""
    order = [j for j in sorted(range(len(prompts)), key=lambda j: (-len(prompts[j]), j)) if not skip(j)]
    return [order[a:a + size] for a in range(0, len(order), size)]


def commit_replies(journal, round_: int, turns: list, replies: list[list[int]], tokenizer, bar, requests,
                   what: str) -> None:
    """Replies that finished together (token ids, stop token removed) into the journal at once, the progress bar
    moved on; a stop request then ends prepare with `what` committed."""
    journal.commit(round_, [(*t, tokenizer.decode(r, skip_special_tokens=True), len(r)) for t, r in zip(turns, replies)])
    bar(len(turns), sum(map(len, replies)))
    if requests.requested:
        raise Preempted(stopped(requests, journal, what))


def stopped(requests: StopRequests, journal, what: str) -> str:
    return (f"prepare: stopped on request ({requests.requested}) after {what}; {len(journal.replies)} regenerated "
            f"replies are committed to {journal.path}: the same command goes on from there")


def vllm_rounds(cfg: "RunConfig", tokenizer, choice: EngineChoice, closing: ExitStack):
    """vLLM (`VllmWorker`, started here, stopped by `closing`): reply_round(...) sending the round's prompts in
    chunks, each chunk's replies committed as it comes back."""
    from transformers import GenerationConfig

    data = cfg.data
    try:
        generation = GenerationConfig.from_pretrained(cfg.target.path)
    except OSError:  # no generation_config.json
        generation = None
    stop = sorted(eos_ids(tokenizer, generation))
    if not stop:
        raise ValueError(f"the target at {cfg.target.path} names no end-of-sequence token (tokenizer eos_token, "
                         "generation_config.json eos_token_id): regenerated replies would never end")
    positions = json.loads((Path(cfg.target.path) / "config.json").read_text()).get("max_position_embeddings")
    max_model_len = min(positions or 1 << 30, data.max_length + data.regen_max_new_tokens)
    longest = min(data.max_length, max_model_len - 1)  # longer prompts: an empty reply, not sent
    log = Path(cfg.run_dir) / "regenerate-vllm.log"  # not in data/: that is replaced when the dataset is written
    print(f"regenerate: starting vLLM ({choice.python}, {choice.dtype}, max_num_seqs {data.regen_batch_size}); its "
          f"log: {log}")
    worker = VllmWorker(choice.python, cfg.target.path, log, choice.dtype, max_model_len, data.regen_batch_size)
    closing.push(lambda kind, *_: worker.close(wait=10 if kind else 60))  # on an error or a stop: soon killed

    def reply_round(k, todo, prompts, done, journal, requests, bar):
        long = [j for j, p in enumerate(prompts) if todo[j] not in done and len(p) > longest]
        if long:
            journal.commit(k, [(*todo[j], "", 0) for j in long])
            bar(len(long), 0)
        for chunk in chunks(prompts, lambda j: todo[j] in done or len(prompts[j]) > longest, data.regen_chunk):
            seeds = [reply_seed(cfg.seed, k, todo[j][0]) for j in chunk] if data.regen_temperature > 0 else None
            tokens, _ = worker.generate([prompts[j] for j in chunk], data.regen_max_new_tokens,
                                        data.regen_temperature, seeds, stop)
            replies = [t[:-1] if t and t[-1] in stop else t for t in tokens]
            commit_replies(journal, k, [todo[j] for j in chunk], replies, tokenizer, bar, requests,
                           "the chunk in flight")

    return reply_round
