"""vLLM (its CPU build, in its own venv: `make test-serving`) serves every export layout it reads, greedy
output token for token its own target-only output, and drafts what our validation says it drafts.

Reads only files that `tests/serving/prepare.py` wrote with mtp_train's venv (MTP_SERVING_DIR/manifest.json and
the export directories): no mtp_train import here, as for a user who serves our files. Each vLLM run is a
subprocess (`benchmarks/vllm_generate.py`): vLLM starts its engine in spawned processes and keeps global
state, so one LLM per process. Writes MTP_SERVING_DIR/results.json (the figures for RESULTS.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM runs in its own venv: make test-serving")
DIR = Path(os.environ.get("MTP_SERVING_DIR", ""))
if not (DIR / "manifest.json").is_file():
    pytest.skip("MTP_SERVING_DIR/manifest.json missing: run tests/serving/prepare.py first (make test-serving)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = json.loads((DIR / "manifest.json").read_text())
TOLERANCE = 0.03  # per-position acceptance, absolute: the same greedy math in both engines


def vllm(name: str, *spec: str) -> dict:
    out = DIR / f"vllm-{name}.json"
    if not out.exists():
        prompts = DIR / "prompts.json"
        prompts.write_text(json.dumps(MANIFEST["prompts"]))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_generate.py"), MANIFEST["target"],
                        str(prompts), str(out), *spec, "--max-tokens", str(MANIFEST["new_tokens"])],
                       check=True, env=env, timeout=900)
    return json.loads(out.read_text())


def per_position(metrics: dict, k: int) -> tuple[int, list[int]]:
    """(verification steps, accepted drafts at positions 1..k) from vLLM's spec-decode counters."""
    drafts = accepted = None
    for name, value in metrics.items():
        if name.endswith("spec_decode_num_drafts"):
            drafts = int(float(value if not isinstance(value, list) else value[0]))
        if name.endswith("spec_decode_num_accepted_tokens_per_pos"):
            accepted = [int(float(v)) for v in value]
    assert drafts is not None and accepted is not None, f"vLLM's metrics lack the spec-decode counters: {metrics}"
    return drafts, (accepted + [0] * k)[:k]


def record(case: str, entry: dict) -> None:
    path = DIR / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[case] = entry
    path.write_text(json.dumps(results, indent=1) + "\n")


def test_target_alone_agrees_with_ours():
    base = vllm("target")
    ours = MANIFEST["cases"][0]["ours"]["target_only_tokens"]
    same = sum(a == _cut(b, MANIFEST["cases"][0]["ours"]["stop_tokens"]) for a, b in zip(ours, base["tokens"]))
    record("target", {"prompts": len(ours), "identical_to_ours": same, "seconds": base["seconds"]})
    assert same == len(ours)


def _cut(tokens: list[int], stop: list[int]) -> list[int]:
    """vLLM's output through the first stop token, as ours is."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[:i + 1]
    return tokens


@pytest.mark.parametrize("case", [c["case"] for c in MANIFEST["cases"]])
def test_vllm_serves_the_export_greedy_identical_and_drafts_as_we_do(case):
    c = next(c for c in MANIFEST["cases"] if c["case"] == case)
    base = vllm("target")
    spec = vllm(case, c["method"], c["draft"], str(c["k"]))
    identical = sum(a == b for a, b in zip(spec["tokens"], base["tokens"]))
    steps, accepted = per_position(spec["metrics"], c["k"])
    ours = c["ours"]
    theirs_rate = [a / steps for a in accepted]
    ours_rate = [a / ours["steps"] for a in ours["accepted_per_position"]]
    record(case, {"method": c["method"], "draft": c["draft"], "k": c["k"], "prompts": len(base["tokens"]),
                  "greedy_identical": identical, "vllm_steps": steps, "vllm_accepted_per_position": accepted,
                  "ours_steps": ours["steps"], "ours_accepted_per_position": ours["accepted_per_position"],
                  "vllm_acceptance": theirs_rate, "ours_acceptance": ours_rate, "seconds": spec["seconds"],
                  "target_seconds": base["seconds"]})
    assert identical == len(base["tokens"]), f"{case}: {identical}/{len(base['tokens'])} prompts identical"
    assert all(abs(a - b) <= TOLERANCE for a, b in zip(theirs_rate, ours_rate)), \
        f"{case}: acceptance by position vLLM {theirs_rate} against ours {ours_rate}"


def test_regenerate_through_a_vllm_server():
    """`data.regenerate_server` against `vllm serve` on 127.0.0.1 serving the tiny target: prepare (our CLI, our
    venv) regenerates the same 48 conversations the in-process engine did; greedy, the datasets agree."""
    import socket
    import time
    import urllib.request

    regen = MANIFEST["regenerate"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(DIR / "vllm-serve.log", "w")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                               MANIFEST["target"], "--served-model-name", "tiny-target", "--host", "127.0.0.1",
                               "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len",
                               "1024"], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 600
        while True:
            assert server.poll() is None, f"vllm serve exited {server.returncode}: see {DIR / 'vllm-serve.log'}"
            try:
                urllib.request.urlopen(url + "/models", timeout=5)
                break
            except OSError:
                assert time.time() < deadline, "vllm serve did not answer within 600 s"
                time.sleep(3)
        run_dir = DIR / "regen-vllm"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        t0 = time.perf_counter()
        subprocess.run([regen["mtp_train"], "prepare", "recipe=tiny", f"run_dir={run_dir}", "target.device=cpu",
                        *regen["overrides"], f"data.regenerate_server={url}", "data.regen_concurrency=16"],
                       check=True, timeout=1200)
        seconds = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(timeout=60)
    same = json.loads(subprocess.run([regen["python"], str(ROOT / "tests" / "serving" / "same_replies.py"),
                                      regen["ours"], str(run_dir / "data")], check=True, capture_output=True,
                                     text=True).stdout)
    ours, theirs = same["regenerate"]
    record("regenerate", {"ours": ours, "vllm": theirs, "prepare_seconds": seconds,
                          **{k: v for k, v in same.items() if k != "regenerate"}})
    assert theirs["engine"] == f"server {url} (model tiny-target)" and theirs["turns"] == ours["turns"]
    for split in ("train", "val"):
        if split in same:
            assert same[split]["samples"] == same[split]["other"]
            assert same[split]["identical"] >= 0.9 * same[split]["samples"], same
