"""Regeneration's engines (`data.regen_engine`, `data.regen_dtype`, mtp_train/data/regen_engines.py): the choice of
engine and dtype, the vLLM worker's chunk protocol, a journal refused across engines and dtypes, and a prepare
through vLLM killed and stopped mid-round that goes on from its journal. vLLM itself is not needed: a fake `vllm`
package (LLM.generate answers a fixed function of each prompt and its seed) stands in for it under the real
`inference/vllm_worker.py`, run by a "vLLM Python" that puts the fake first on its path. vLLM itself regenerates
in tests/serving."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mtp_train.config import compose
from mtp_train.data import prepare as prep
from mtp_train.data.regen_engines import choose, choose_engine, has_amx, regen_dtype, reply_seed
from mtp_train.data.sources import SourceConfig
from mtp_train.inference.vllm_engine import VllmWorker, VllmWorkerError

ROOT = Path(__file__).resolve().parents[1]
SAPPHIRE = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\nflags\t\t: fpu sse2 avx512f avx512_bf16 "
            "amx_bf16 avx512_fp16 amx_tile amx_int8\n\nprocessor\t: 1\nflags\t\t: fpu sse2 amx_tile\n")
EPYC = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 sha_ni\n"

FAKE_VLLM = {
    "__init__.py": '''
        import json, os, time
        __version__ = os.environ.get("FAKE_VLLM_VERSION", "0.0-fake")

        def _log(record):
            if os.environ.get("FAKE_VLLM_LOG"):
                with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
                    f.write(json.dumps(record) + "\\n")

        def reply(prompt, max_tokens, stop, seed):
            """2..6 tokens from the prompt (and the seed when sampled), then the first stop token; cut at max_tokens."""
            n = 2 + (sum(prompt) + (seed or 0)) % 5
            return ([10 + (sum(prompt) * 7 + 3 * j + (seed or 0)) % 40 for j in range(n)] + stop[:1])[:max_tokens]

        class SamplingParams:
            def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False, stop_token_ids=None, seed=None):
                self.temperature, self.max_tokens, self.stop, self.seed = temperature, max_tokens, stop_token_ids, seed

        class _Output:
            def __init__(self, token_ids):
                self.token_ids = token_ids

        class _Request:
            def __init__(self, token_ids):
                self.outputs = [_Output(token_ids)]

        class LLM:
            def __init__(self, model, dtype="float32", max_model_len=1024, enforce_eager=False, max_num_seqs=None):
                _log({"pid": os.getpid(), "model": model, "dtype": dtype, "max_model_len": max_model_len,
                      "max_num_seqs": max_num_seqs})
                if os.environ.get("FAKE_VLLM_FAIL_START"):
                    raise ValueError("the fake cannot start")
                self.chunks = 0

            def generate(self, prompts, params, use_tqdm=True):
                self.chunks += 1
                _log({"chunk": self.chunks, "prompts": [p["prompt_token_ids"] for p in prompts],
                      "seeds": [p.seed for p in params]})
                if os.environ.get("FAKE_VLLM_FAIL_CHUNK") == str(self.chunks):
                    raise RuntimeError("the fake cannot decode")
                if os.environ.get("FAKE_VLLM_DIE_CHUNK") == str(self.chunks):
                    os._exit(9)
                time.sleep(float(os.environ.get("FAKE_VLLM_DELAY", "0")))
                if self.chunks >= int(os.environ.get("FAKE_VLLM_HOLD_FROM") or 1 << 30):
                    time.sleep(300)  # a chunk that takes long: only a kill ends it
                return [_Request(reply(p["prompt_token_ids"], s.max_tokens, s.stop, s.seed if s.temperature > 0
                                       else None)) for p, s in zip(prompts, params)]
    ''',
    "inputs.py": '''
        def TokensPrompt(prompt_token_ids):
            return {"prompt_token_ids": prompt_token_ids}
    ''',
    "platforms.py": '''
        import os

        class _Platform:
            device_type = os.environ.get("FAKE_VLLM_DEVICE", "cpu")

        current_platform = _Platform()
    ''',
}


@pytest.fixture()
def fake_vllm(tmp_path, monkeypatch):
    """The path of a "vLLM Python" whose `vllm` is the fake; $MTP_TRAIN_VLLM_PYTHON names it, and the fake logs its
    start and every chunk to the returned log file."""
    package = tmp_path / "fake" / "vllm"
    package.mkdir(parents=True)
    for name, text in FAKE_VLLM.items():
        (package / name).write_text(textwrap.dedent(text))
    python = tmp_path / "fake-vllm-python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={package.parent} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    log = tmp_path / "fake-vllm.jsonl"
    monkeypatch.setenv("MTP_TRAIN_VLLM_PYTHON", str(python))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    return python, log


def _logged(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def _fake_reply(prompt, max_tokens, stop, seed):
    n = 2 + (sum(prompt) + (seed or 0)) % 5
    return ([10 + (sum(prompt) * 7 + 3 * j + (seed or 0)) % 40 for j in range(n)] + stop[:1])[:max_tokens]


# -- the choice ------------------------------------------------------------------------------------------------------

def test_amx_is_read_from_the_cpuinfo_flags_and_decides_the_dtype():
    assert has_amx(SAPPHIRE) and not has_amx(EPYC) and not has_amx("") and not has_amx("amx_bf16\n")
    assert regen_dtype("auto", "cpu", SAPPHIRE) == ("bfloat16", "the CPU has AMX (amx_bf16 / amx_tile in "
                                                    "/proc/cpuinfo)")
    assert regen_dtype("auto", "cpu", EPYC) == ("float32", "the CPU has no AMX (bf16 is slower than fp32 there)")
    assert regen_dtype("auto", "cuda", EPYC) == ("bfloat16", "a CUDA GPU")
    assert regen_dtype("float32", "cpu", SAPPHIRE) == ("float32", "data.regen_dtype=float32")
    assert regen_dtype("bfloat16", "cpu", EPYC) == ("bfloat16", "data.regen_dtype=bfloat16")


def test_auto_takes_vllm_only_when_it_is_found_imports_and_runs_on_the_targets_device():
    works = lambda python: {"vllm_version": "0.32.0", "device": "cpu"}  # noqa: E731
    engine, why, python, info = choose_engine("auto", "cpu", find=lambda: "/v/bin/python", probe=works)
    assert (engine, python, info["vllm_version"]) == ("vllm", "/v/bin/python", "0.32.0") and "0.32.0" in why
    engine, why, *_ = choose_engine("auto", "cpu", find=lambda: None, probe=works)
    assert engine == "ours" and "no vLLM Python" in why and "MTP_TRAIN_VLLM_PYTHON" in why
    broken = lambda python: {"error": "ModuleNotFoundError: No module named 'vllm'"}  # noqa: E731
    engine, why, *_ = choose_engine("auto", "cpu", find=lambda: "/v/bin/python", probe=broken)
    assert engine == "ours" and "does not import (ModuleNotFoundError" in why
    engine, why, *_ = choose_engine("auto", "cuda", find=lambda: "/v/bin/python", probe=works)
    assert engine == "ours" and "runs on cpu, the target on cuda" in why
    # a journal already there is continued by the engine that wrote it
    assert choose_engine("auto", "cpu", "ours", find=lambda: "/v/bin/python", probe=works)[0] == "ours"
    assert choose_engine("auto", "cuda", "vllm", find=lambda: "/v/bin/python", probe=works)[0] == "vllm"
    assert choose_engine("ours", "cpu", find=lambda: "/v/bin/python", probe=works)[:2] == ("ours",
                                                                                          "data.regen_engine=ours")
    with pytest.raises(FileNotFoundError, match=r"data.regen_engine=vllm needs vLLM's Python: set \$MTP_TRAIN_VLLM"):
        choose_engine("vllm", "cpu", find=lambda: None, probe=works)
    with pytest.raises(RuntimeError, match=r"vLLM at /v/bin/python does not import: ModuleNotFoundError"):
        choose_engine("vllm", "cpu", find=lambda: "/v/bin/python", probe=broken)


def test_the_choice_with_the_fake_vllm_and_its_reason(fake_vllm, monkeypatch):
    data = compose("tiny", ["data.regen_engine=auto", "data.regen_dtype=auto"]).data
    c = choose(data, "cpu", "float32", cpuinfo=SAPPHIRE)  # the probe runs the real vllm_worker.py --probe
    assert (c.engine, c.dtype, c.python, c.vllm) == ("vllm", "bfloat16", str(fake_vllm[0]),
                                                    {"vllm_version": "0.0-fake", "device": "cpu"})
    assert c.reason == ("auto: vLLM 0.0-fake found at {}, on cpu as the target; bfloat16: the CPU has AMX "
                        "(amx_bf16 / amx_tile in /proc/cpuinfo)".format(fake_vllm[0]))
    assert choose(data, "cpu", "float32", cpuinfo=EPYC).dtype == "float32"
    # a journal already there: its engine and dtype go on, whatever auto would pick now
    c = choose(data, "cpu", "float32", {"engine": "ours", "dtype": "float32"}, cpuinfo=SAPPHIRE)
    assert (c.engine, c.dtype) == ("ours", "float32") and c.reason.endswith("float32: auto: the journal there was "
                                                                            "decoded in it")
    assert choose(data, "cpu", "float32", {"engine": "vllm", "dtype": "float32"}, cpuinfo=SAPPHIRE).dtype == "float32"
    monkeypatch.setenv("FAKE_VLLM_DEVICE", "cuda")
    c = choose(data, "cpu", "float32", cpuinfo=EPYC).describe()
    assert (c["engine"], c["dtype"]) == ("ours", "float32") and "runs on cuda, the target on cpu" in c["reason"]


def test_engine_settings_are_checked_and_enter_the_config_hash_only_when_they_matter():
    with pytest.raises(ValueError, match=r"data.regen_engine='fast' \(one of auto, ours, vllm\)"):
        compose("tiny", ["data.regen_engine=fast"])
    with pytest.raises(ValueError, match=r"data.regen_chunk=0 \(>= 1\)"):
        compose("tiny", ["data.regen_chunk=0"])
    h = lambda *o: prep.config_hash(compose("tiny", list(o)), [])  # noqa: E731
    assert h("data.regen_engine=vllm") == h("data.regen_engine=auto") == h("data.regen_dtype=bfloat16")
    assert h("data.regenerate=true", "data.regen_engine=auto", "data.regen_chunk=256") != \
        h("data.regenerate=true", "data.regen_engine=vllm") != h("data.regenerate=true", "data.regen_chunk=8")


# -- the worker's protocol -------------------------------------------------------------------------------------------

def test_the_worker_decodes_chunk_by_chunk_and_says_why_it_failed(fake_vllm, tmp_path, tiny_dir, monkeypatch):
    python, log = fake_vllm
    target = str(tiny_dir / "target")
    w = VllmWorker(str(python), target, tmp_path / "w.log", "bfloat16", 300, 4)
    try:
        assert (w.version, w.device) == ("0.0-fake", "cpu")
        tokens, seconds = w.generate([[3, 4, 5], [9]], 16, 0.0, None, [1, 5])
        assert tokens == [_fake_reply([3, 4, 5], 16, [1, 5], None), _fake_reply([9], 16, [1, 5], None)]
        assert w.generate([[9]], 3, 0.8, [77], [1])[0] == [_fake_reply([9], 3, [1], 77)] and seconds >= 0
        start, first, second = _logged(log)
        assert (start["dtype"], start["max_model_len"], start["max_num_seqs"]) == ("bfloat16", 300, 4)
        assert first["prompts"] == [[3, 4, 5], [9]] and first["seeds"] == [None, None] and second["seeds"] == [77]
    finally:
        w.close()
    assert w.proc.returncode == 0
    monkeypatch.setenv("FAKE_VLLM_FAIL_CHUNK", "1")
    w = VllmWorker(str(python), target, tmp_path / "w.log", "float32", 300, 4)
    with pytest.raises(VllmWorkerError, match=rf"vLLM could not decode chunk 1 \(1 prompts\): RuntimeError: the "
                                              rf"fake cannot decode \(log: {tmp_path / 'w.log'}\)"):
        w.generate([[9]], 4, 0.0, None, [1])
    w.close()
    monkeypatch.setenv("FAKE_VLLM_FAIL_CHUNK", "")
    monkeypatch.setenv("FAKE_VLLM_DIE_CHUNK", "2")
    w = VllmWorker(str(python), target, tmp_path / "w.log", "float32", 300, 4)
    w.generate([[9]], 4, 0.0, None, [1])
    with pytest.raises(VllmWorkerError, match=r"exited \(9\) before it could decode chunk 2"):
        w.generate([[9]], 4, 0.0, None, [1])
    w.close()
    monkeypatch.setenv("FAKE_VLLM_FAIL_START", "1")
    with pytest.raises(VllmWorkerError, match=r"vLLM could not start: ValueError: the fake cannot start"):
        VllmWorker(str(python), target, tmp_path / "w.log", "float32", 300, 4)


# -- prepare through vLLM --------------------------------------------------------------------------------------------

CONVS = [{"messages": [{"role": "user", "content": f"Write `def f{i}(x)`." + " x" * (3 * i)},
                       {"role": "assistant", "content": "OLD1"}, {"role": "user", "content": "Again."},
                       {"role": "assistant", "content": "OLD2"}]} for i in range(6)]
VLLM = ["data.regenerate=true", "data.regen_engine=vllm", "data.regen_chunk=2", "data.regen_batch_size=3",
        "data.regen_max_new_tokens=5", "data.regen_temperature=0.8"]


def _source(tmp_path: Path, convs=CONVS) -> Path:
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    return path


def _prepare(run_dir: Path, source: Path, *overrides: str) -> dict:
    cfg = compose("tiny", [f"run_dir={run_dir}", "data.regen_dtype=float32", *overrides])
    cfg.data.sources = [SourceConfig(path=str(source), split="train")]
    return prep.run(cfg)


def _digest(data_dir: Path) -> dict:
    """The dataset's files, and the journal's replies (its lines group them by the chunks of each run)."""
    files = {str(p.relative_to(data_dir)): p.read_bytes() for p in sorted(data_dir.rglob("*"))
             if p.is_file() and p.name not in ("manifest.json", "regenerate.jsonl")}
    lines = (data_dir / "regenerate.jsonl").read_text().splitlines()
    return {**files, "replies": sorted((c["round"], *r) for c in map(json.loads, lines[1:]) for r in c["replies"])}


def test_prepare_through_vllm_sends_chunks_commits_them_and_records_the_engine(fake_vllm, tmp_path, tiny_dir):
    from transformers import AutoTokenizer

    python, log = fake_vllm
    tok = AutoTokenizer.from_pretrained(tiny_dir / "target")
    # one conversation whose prompt is longer than data.max_length: an empty reply, never sent
    long = {"messages": [{"role": "user", "content": "y " * 400}, {"role": "assistant", "content": "OLD"}]}
    source = _source(tmp_path, [*CONVS, long])
    m = _prepare(tmp_path / "a", source, *VLLM)
    choice = m["regenerate"]["engine_choice"]
    assert (choice["engine"], choice["dtype"], choice["vllm_version"]) == ("vllm", "float32", "0.0-fake")
    assert choice["reason"].startswith("data.regen_engine=vllm; float32: data.regen_dtype=float32")
    assert m["regenerate"]["engine"] == "vLLM 0.0-fake offline (float32)" and m["regenerate"]["turns"] == 13
    lines = (tmp_path / "a" / "data" / "regenerate.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    assert header["identity"]["engine"] == {"vllm": "0.0-fake", "dtype": "float32", "max_num_seqs": 3, "chunk": 2}
    assert header["engine_choice"] == choice and header["identity"]["target"]["dtype"] == "float32"
    start, *chunks = _logged(log)
    assert (start["max_num_seqs"], start["max_model_len"]) == (3, 256 + 5)
    # round 0: 6 prompts in 3 chunks of 2, longest first; round 1: likewise; the long one is never sent
    sent = [p for c in chunks for p in c["prompts"]]
    assert [len(c["prompts"]) for c in chunks] == [2, 2, 2, 2, 2, 2] and max(map(len, sent)) <= 256
    assert [len(p) for p in sent[:6]] == sorted((len(p) for p in sent[:6]), reverse=True)
    # each commit is one chunk (after the long prompt's empty reply), each reply the fake's with its seed
    commits = [json.loads(line) for line in lines[1:]]
    assert [len(c["replies"]) for c in commits] == [1, 2, 2, 2, 2, 2, 2]
    assert commits[0]["replies"] == [[6, 1, "", 0]]
    stop = sorted({1, 5, tok.eos_token_id})
    for c, chunk in zip(commits[1:], chunks):
        for (i, t, text, n), prompt, seed in zip(c["replies"], chunk["prompts"], chunk["seeds"]):
            assert seed == reply_seed(m["seed"], c["round"], i)
            want = _fake_reply(prompt, 5, stop, seed)
            want = want[:-1] if want[-1] in stop else want
            assert (text, n) == (tok.decode(want, skip_special_tokens=True), len(want))
    # the manifest's hash of the token ids: the same for the same tokens, another for others
    again = _prepare(tmp_path / "b", source, *VLLM)
    assert again["token_ids_sha256"] == m["token_ids_sha256"] and len(m["token_ids_sha256"]) == 64
    other = _prepare(tmp_path / "c", source, *VLLM, "seed=1")
    assert other["token_ids_sha256"] != m["token_ids_sha256"]


def test_a_journal_from_another_engine_or_dtype_is_refused(fake_vllm, tmp_path):
    """Our engine's journal, then vLLM; a vLLM fp32 journal, then vLLM bf16: refused, naming both sides, the journal
    untouched (each time as if the run that wrote it was killed before the dataset was written)."""
    source = _source(tmp_path, CONVS[:2])
    run_dir, journal = tmp_path / "run", tmp_path / "run" / "data" / "regenerate.jsonl"
    short = ["data.regenerate=true", "data.regen_max_new_tokens=3"]
    _prepare(run_dir, source, *short, "data.regen_engine=ours")
    (run_dir / "data" / "manifest.json").unlink()
    written = journal.read_bytes()
    vllm = r'\{"chunk": 256, "dtype": "float32", "max_num_seqs": 8, "vllm": "0.0-fake"\}'
    with pytest.raises(ValueError, match=rf"holds replies regenerated for other inputs or settings: engine: "
                                         rf'"mtp_train.inference" there, {vllm} here'):
        _prepare(run_dir, source, *short, "data.regen_engine=vllm")
    assert journal.read_bytes() == written
    journal.unlink()
    _prepare(run_dir, source, *short, "data.regen_engine=vllm")
    (run_dir / "data" / "manifest.json").unlink()
    written = journal.read_bytes()
    assert json.loads(written.split(b"\n")[0])["engine_choice"]["engine"] == "vllm"
    with pytest.raises(ValueError, match=r"target: .*float32\) there, .*bfloat16\) here; engine: .*\"dtype\": "
                                         r"\"float32\".* there, .*\"dtype\": \"bfloat16\".* here"):
        _prepare(run_dir, source, *short, "data.regen_engine=vllm", "data.regen_dtype=bfloat16")
    with pytest.raises(ValueError, match=rf"engine: {vllm} there, \"mtp_train.inference\" here"):
        _prepare(run_dir, source, *short, "data.regen_engine=ours")
    assert journal.read_bytes() == written


# -- killed and stopped through the chunk protocol ------------------------------------------------------------------

def _replies(run_dir: Path) -> int:
    path = run_dir / "data" / "regenerate.jsonl"
    lines = path.read_bytes().split(b"\n")[1:-1] if path.is_file() else []
    return sum(len(json.loads(line)["replies"]) for line in lines)


def _interrupted(run_dir: Path, source: Path, sig: int, at: int, log: Path, **fake: str) -> tuple[int, str, int, int]:
    """A real `mtp-train prepare` through the fake vLLM (`fake`: its settings) sent `sig` once `at` replies are
    committed -> (exit status, stderr, replies committed when it ended, the worker's pid)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **fake}
    proc = subprocess.Popen([sys.executable, "-m", "mtp_train.cli", "prepare", f"run_dir={run_dir}",
                             f"data.sources=[{{path: {source}, split: train}}]", "data.regen_dtype=float32", *VLLM],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while _replies(run_dir) < at:
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < 240, "no replies committed in 240 s"
        time.sleep(0.02)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    pid = [r["pid"] for r in _logged(log) if "pid" in r][-1]
    return proc.returncode, err, _replies(run_dir), pid


def _gone(pid: int, within: float = 10.0) -> bool:
    """Whether process `pid` has ended (a zombie nobody reaped counts as ended) within `within` seconds."""
    t0 = time.time()
    while time.time() - t0 < within:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.1)
    return False


def test_prepare_through_vllm_killed_and_stopped_goes_on_from_its_journal(fake_vllm, tmp_path):
    """SIGKILL mid-round: the worker ends itself with its parent, the committed chunks stay; started again, SIGTERM:
    the chunk in flight is finished and committed, exit 75; then the rest: the dataset (sampled replies) equals an
    uninterrupted run's, byte for byte: each request's seed is its conversation's, wherever a chunk starts."""
    _, log = fake_vllm
    source = _source(tmp_path)
    _prepare(tmp_path / "clean", source, *VLLM)
    run_dir = tmp_path / "run"
    # killed while the second chunk takes minutes: the worker must not finish it
    rc, _, killed, pid = _interrupted(run_dir, source, signal.SIGKILL, 2, log, FAKE_VLLM_HOLD_FROM="2")
    assert rc == -signal.SIGKILL and killed == 2
    assert _gone(pid), "the vLLM worker outlived the prepare that was killed"
    rc, err, stopped, pid = _interrupted(run_dir, source, signal.SIGTERM, killed + 2, log, FAKE_VLLM_DELAY="0.4")
    assert rc == 75, err
    assert "SIGTERM received: stopping after the chunk of replies in flight" in err
    assert f"stopped on request (SIGTERM) after the chunk in flight; {stopped} regenerated replies are committed" in err
    assert killed + 2 <= stopped < 12 and stopped % 2 == 0 and _gone(pid)
    m = _prepare(run_dir, source, *VLLM)
    assert m["regenerate"]["turns_from_journal"] == stopped
    assert _digest(run_dir / "data") == _digest(tmp_path / "clean" / "data")
