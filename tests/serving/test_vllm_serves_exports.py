"""vLLM (its CPU build, in its own venv: `make test-serving`) serves every export layout it reads, greedy
output token for token its own target-only output, and drafts what our validation says it drafts.

Reads only files that `tests/serving/prepare.py` wrote with mtp_train's venv (MTP_SERVING_DIR/manifest.json and
the export directories): no mtp_train import here, as for a user who serves our files. Each vLLM run is a
subprocess (`mtp_train/inference/vllm_run.py`, run as a file): vLLM starts its engine in spawned processes and keeps global
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
VLLM_RUN = ROOT / "mtp_train" / "inference" / "vllm_run.py"  # a file run with this venv's Python: no mtp_train import
MANIFEST = json.loads((DIR / "manifest.json").read_text())
TOLERANCE = 0.03  # per-position acceptance, absolute: the same greedy math in both engines
CASES = {c["case"]: c for c in MANIFEST["cases"]}
# What vLLM 0.32's CPU build gets wrong or cannot do, per case. The tests still run these, record what vLLM did
# and xfail; they fail the day a vLLM does it right, so that this table (and the model card) is updated.
TARGET_MISMATCH = {  # the DeepSeek cases share the target: vLLM decodes it otherwise than we do, whatever the draft
    **{case: "vLLM's CPU MLA backend (CPU_MLA, its docstring: reference quality; asked for on every "
                      "x86 CPU, as AMX_MLA, vLLM's pick where the CPU has AMX, refuses fp32 weights) decodes a "
                      "DeepSeek-V2 target otherwise than transformers, from the first token on "
                      "(benchmarks/RESULTS.md, serving)" for case in ("deepseek-nextn", "deepseek-eagle")},
}
EXPECTED_FAILURES = {  # case: (vLLM's error must contain, why)
    "deepseek-nextn": ("Unsupported speculative method", "vLLM 0.32 serves DeepSeek MTP layers only from the target's own checkpoint: a "
                      "deepseek_v2 draft is not mapped to its MTP model and DeepSeekMTP reads the target's config "
                      "(num_nextn_predict_layers, MoE past first_k_dense_replace), where our dense head is not"),
    # on an x86 CPU with AMX only: the draft's MLA attention takes vLLM's AMX backend whatever --attention-backend
    # says, and that backend refuses fp32 weights (in bf16 vLLM loads and runs the draft: benchmarks/RESULTS.md)
    "deepseek-eagle": ("expect weight to be bfloat16", "vLLM 0.32's CPU build builds the draft's MLA attention with "
                       "its AMX backend on AMX CPUs (the target's follows --attention-backend CPU_MLA), which "
                       "refuses the fp32 weights the comparison with our engine needs"),
}
AMX_ONLY = {"deepseek-eagle"}  # expected failures of AMX processors; elsewhere the case runs


def vllm(name: str, case: dict, *spec: str, options: tuple = ()) -> dict:
    """vLLM's run of the case's prompts (the target alone without `spec`), once per manifest (prepare.py
    removes the results of an earlier one; a run that failed is tried again)."""
    out = DIR / f"vllm-{name}.json"
    if not out.exists() or "error" in json.loads(out.read_text()):
        prompts = DIR / f"prompts-{case['case']}.json"
        prompts.write_text(json.dumps(case["prompts"]))
        # the engine core in this process (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0): on the tiny target the same
        # tokens and spec-decode counters, greedy, a third of the start-up time (no spawned engine and worker
        # importing vLLM again). The cases with their own options (the DeepSeek target on CPU_MLA) keep vLLM's
        # spawned engine: CPU_MLA decodes that target one way there and another in process, each deterministic,
        # neither transformers' (0/4 prompts, from the first token; AMD EPYC, 2026-12-07)
        in_process = "0" if not case.get("vllm_options") else "1"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", in_process)}
        options = (*options, *case.get("vllm_options", ()))  # the case's own (the DeepSeek target's backend)
        args = [case["target"], str(prompts), str(out), *spec, "--max-tokens", str(case["new_tokens"]), *options]
        script = VLLM_RUN
        with open(DIR / f"vllm-{name}.log", "w") as log:
            subprocess.run([sys.executable, str(script), *args], env=env, timeout=1800, stdout=log,
                           stderr=subprocess.STDOUT)
    assert out.exists(), f"{VLLM_RUN} wrote nothing: see {DIR / f'vllm-{name}.log'}"
    return json.loads(out.read_text())


def target_only(case: dict) -> dict:
    return vllm("target-" + Path(case["target"]).name, case)


def record(case: str, entry: dict) -> None:
    path = DIR / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[case] = entry
    path.write_text(json.dumps(results, indent=1) + "\n")


def _cut(tokens: list[int], stop: list[int]) -> list[int]:
    """vLLM's output through the first stop token, as ours is."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[:i + 1]
    return tokens


# one case per target: those of one target share its prompts and its target-only run
BY_TARGET = {Path(c["target"]).name: c["case"] for c in reversed(MANIFEST["cases"])}


@pytest.mark.parametrize("case", sorted(BY_TARGET.values()))
def test_vllm_target_alone_agrees_with_ours(case):
    c = CASES[case]
    base = target_only(c)
    assert "error" not in base, f"vLLM could not run the target {c['target']}: {base['error']}"
    ours = c["ours"]["target_only_tokens"]
    same = sum(a == _cut(b, c["ours"]["stop_tokens"]) for a, b in zip(ours, base["tokens"]))
    first = sum(a[:1] == b[:1] for a, b in zip(ours, base["tokens"]))
    record(f"target {Path(c['target']).name}", {"prompts": len(ours), "identical_to_ours": same,
                                                "first_token_identical": first, "seconds": base["seconds"]})
    if case in TARGET_MISMATCH:
        assert same < len(ours), f"vLLM now decodes {c['target']} as we do: update TARGET_MISMATCH"
        pytest.xfail(f"{TARGET_MISMATCH[case]}: {same}/{len(ours)} prompts identical")
    assert same == len(ours), f"{case}: vLLM's target-only output is ours on {same}/{len(ours)} prompts"


@pytest.mark.parametrize("case", [c for c in CASES if "mutation" not in CASES[c]])
def test_vllm_serves_the_export_greedy_identical_and_drafts_as_we_do(case):
    c = CASES[case]
    base = target_only(c)
    spec = vllm(case, c, c["method"], c["draft"], str(c["k"]))
    if "error" in spec:
        record(case, {"method": c["method"], "draft": c["draft"], "k": c["k"], "vllm_error": spec["error"]})
        log = DIR / f"vllm-{case}.log"  # vLLM's engine reports its root cause in the log, not the exception
        said = spec["error"] + (log.read_text(errors="replace") if log.is_file() else "")
        if case in EXPECTED_FAILURES and EXPECTED_FAILURES[case][0] in said:
            pytest.xfail(f"{EXPECTED_FAILURES[case][1]} (vLLM: {spec['error'][:300]})")
        pytest.fail(f"vLLM could not serve {c['draft']}: {spec['error']} (log: {DIR / f'vllm-{case}.log'})")
    identical = sum(a == b for a, b in zip(spec["tokens"], base["tokens"]))
    steps, accepted = spec["steps"], spec["accepted_per_position"]
    ours = c["ours"]
    theirs_rate = [a / steps for a in accepted]
    ours_rate = [a / ours["steps"] for a in ours["accepted_per_position"]]
    record(case, {"method": c["method"], "draft": c["draft"], "k": c["k"], "prompts": len(base["tokens"]),
                  "greedy_identical": identical, "vllm_steps": steps, "vllm_accepted_per_position": accepted,
                  "ours_steps": ours["steps"], "ours_accepted_per_position": ours["accepted_per_position"],
                  "vllm_acceptance": theirs_rate, "ours_acceptance": ours_rate, "seconds": spec["seconds"],
                  "target_seconds": base["seconds"]})
    assert case not in EXPECTED_FAILURES or case in AMX_ONLY, \
        f"vLLM now serves {case}: update EXPECTED_FAILURES and the model card"
    if case in TARGET_MISMATCH:  # our figures are on another decoding of the target: nothing to compare them with
        pytest.xfail(f"{TARGET_MISMATCH[case]}; vLLM served the draft: {identical}/{len(base['tokens'])} prompts "
                     f"identical to its target alone, acceptance {theirs_rate} (ours on our decoding {ours_rate})")
    assert identical == len(base["tokens"]), f"{case}: {identical}/{len(base['tokens'])} prompts identical"
    assert all(abs(a - b) <= TOLERANCE for a, b in zip(theirs_rate, ours_rate)), \
        f"{case}: acceptance by position vLLM {theirs_rate} against ours {ours_rate}"


@pytest.mark.parametrize("case", [c for c in CASES if "mutation" in CASES[c]])
def test_a_head_served_with_a_convention_error_loses_its_acceptance(case):
    """The vllm-mtp head with a mistake a loader can make (`mutation`): vLLM still decodes greedy-identically
    (rejection keeps the output the target's), but the head's first-position acceptance falls below half of
    ours, so the acceptance comparison above would catch such a mistake."""
    c = CASES[case]
    base = target_only(c)
    spec = vllm(case, c, c["method"], c["draft"], str(c["k"]))
    assert "error" not in spec, spec.get("error")
    identical = sum(a == b for a, b in zip(spec["tokens"], base["tokens"]))
    theirs, ours = [a / spec["steps"] for a in spec["accepted_per_position"]], rates(c["ours"])
    record(case, {"mutation": c["mutation"], "greedy_identical": identical, "vllm_acceptance": theirs,
                  "ours_acceptance": ours})
    assert identical == len(base["tokens"])
    assert theirs[0] < ours[0] / 2, f"{c['mutation']}: vLLM still accepts {theirs} against our unmutated {ours}"


def rates(run: dict) -> list[float]:
    return [a / run["steps"] for a in run["accepted_per_position"]] if run["steps"] else []


SAMPLED_TOLERANCE = 0.15  # seeded sampling differs between the engines: ~0.05 of binomial noise per side here


@pytest.mark.parametrize("case", [c for c in CASES if "sampled" in CASES[c]["ours"] and "mutation" not in CASES[c]])
def test_vllm_serves_the_export_sampled(case):
    """T = 1 with the head: vLLM decodes every prompt, and its acceptance by position is ours at T = 1 up to
    sampling noise (the two engines draw other random numbers, so the figures are not equal). vLLM drafts as
    we do here (`draft_sample_method: probabilistic`: drafts sampled from the head, accepted with min(1, p/q));
    its default drafts the argmax and accepts it with the target's probability, which accepts less."""
    c = CASES[case]
    t = c["ours"]["sampled"]["temperature"]
    run = vllm(f"{case}-t{t:g}", c, c["method"], c["draft"], str(c["k"]),
               options=("--temperature", str(t), "--seed", "0", "--draft-sample-method", "probabilistic"))
    assert "error" not in run, f"vLLM could not sample with {c['draft']}: {run['error']}"
    theirs, ours = rates(run), rates(c["ours"]["sampled"])
    record(f"{case} T={t:g}", {"prompts": len(run["tokens"]), "vllm_acceptance": theirs, "ours_acceptance": ours,
                               "vllm_steps": run["steps"], "ours_steps": c["ours"]["sampled"]["steps"],
                               "seconds": run["seconds"]})
    assert len(run["tokens"]) == len(c["prompts"]) and all(run["tokens"])
    close = all(abs(a - b) <= SAMPLED_TOLERANCE for a, b in zip(theirs, ours))
    if not cpu_expands_float_tensors():  # vLLM's sampled figures mean nothing then, close to ours or not
        pytest.xfail(f"vLLM 0.32's CPU build keeps almost no drafts when sampling at T = {t:g} (vLLM {theirs}, ours "
                     f"{ours}), for every speculative method: {EXPAND_BUG} (test_vllm_cpu_expands_per_request_"
                     "temperatures)")
    assert close


EXPAND_BUG = ("its rejection sampler expands the per-request temperatures to per-token ones with `expand_kernel`, "
              "whose CPU replacement (vllm/utils/cpu_triton_utils.py `_expand_kernel_impl`) runs on int64 copies "
              "of a float output and input and never writes the result back, so the target's logits are divided "
              "by uninitialised memory and p_target(draft) is ~0")


def cpu_expands_float_tensors() -> bool:
    """Whether vLLM's `expand_batch_to_tokens` (what its rejection sampler scales the target's logits with)
    expands float per-request values to per-token ones correctly on this platform."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    import torch

    if current_platform.device_type == "cpu":
        current_platform.register_triton_kernel_overrides()
    values = torch.tensor([1.0, 0.7], dtype=torch.float32)
    out = rejection_sampler.expand_batch_to_tokens(values, torch.tensor([2, 3], dtype=torch.int32), 3,
                                                   replace_from=-1, replace_to=1)
    return torch.allclose(out, torch.tensor([1.0, 1.0, 0.7]))


def test_vllm_cpu_expands_per_request_temperatures():
    """The cause of vLLM's CPU build accepting ~no drafts at T > 0, with our plugin's head and with vLLM's own
    EAGLE head alike (benchmarks/RESULTS.md, serving): the expansion of [1.0, 0.7] over requests of 2 and 1
    draft tokens must be [1.0, 1.0, 0.7]. xfail while vLLM gets it wrong; the day it is fixed this passes and the
    sampled check above asserts the acceptance agreement instead of recording its miss."""
    if not cpu_expands_float_tensors():
        pytest.xfail(EXPAND_BUG)


def test_engine_check_command_quotes_vllm_in_the_model_card():
    """`python -m mtp_train.export.engine_check` (our venv) with this venv's vLLM, on the eagle-vllm run: exit 0,
    the figures this file measured for the case, and the table in the export's model card."""
    if "engine_check" not in MANIFEST:
        pytest.skip("the smoke manifest (prepare.py --smoke) has no engine_check case")
    check = MANIFEST["engine_check"]
    done = subprocess.run([check["python"], "-m", "mtp_train.export.engine_check", "--vllm-python", sys.executable,
                           "--k", str(check["k"]), "--prompts", str(check["prompts"]), "--new-tokens",
                           str(check["new_tokens"]), *check["args"]], cwd=ROOT, capture_output=True, text=True,
                          timeout=3600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    export = Path(check["export"])
    result = json.loads((export / "engine_check.json").read_text())
    ours = CASES[check["case"]]["ours"]
    assert result["ours_accepted_per_position"] == ours["accepted_per_position"]
    assert result["vllm_greedy_identical"] == result["prompts"] == len(CASES[check["case"]]["prompts"])
    card = (export / "README.md").read_text()
    assert "## In vLLM, beside our validation" in card and f"| 1 | {result['ours_acceptance'][0]:.3f} |" in card
    record("engine_check", {k: result[k] for k in ("ours_acceptance", "vllm_acceptance", "max_gap", "vllm_version")})


def test_validate_decodes_in_vllm():
    """`mtp-train validate ... validate.engine=vllm` (our venv) with this venv's vLLM at tensor_parallel_size 1
    on the vllm-mtp run: exit 0, vLLM's rows in the report's schema, greedy-identical at every k, and at k = 3
    (the case's k) acceptance by position within TOLERANCE of our engine's on the same prompts."""
    if "validate_vllm" not in MANIFEST:
        pytest.skip("the smoke manifest (prepare.py --smoke) has no validate_vllm case")
    check = MANIFEST["validate_vllm"]
    report_path = Path(check["run_dir"]) / "validation" / "report.json"
    report_path.unlink(missing_ok=True)
    done = subprocess.run([check["python"], "-m", "mtp_train.cli", "validate", *check["args"],
                           f"validate.vllm_python={sys.executable}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=3600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    c = CASES[check["case"]]
    rows = {e["k"]: e for e in report["decoding"]}
    assert sorted(rows) == list(range(1, c["k"] + 1))
    assert all(e["engine"] == "vllm" and e["greedy_identical"] for e in rows.values()), \
        [(e["k"], e["greedy_identical_prompts"]) for e in rows.values()]
    assert report["decoding_settings"]["tensor_parallel_size"] == 1
    ours_rate = rates(c["ours"])
    theirs = rows[c["k"]]["acceptance_by_position"]
    record("validate_vllm", {"vllm_acceptance": theirs, "ours_acceptance": ours_rate,
                             "tau_by_k": {k: e["tau"] for k, e in rows.items()},
                             "speedup_by_k": {k: e["speedup"] for k, e in rows.items()}})
    assert all(abs(a - b) <= TOLERANCE for a, b in zip(theirs, ours_rate)), (theirs, ours_rate)


def test_regenerate_through_a_vllm_server():
    """`data.regenerate_server` against `vllm serve` on 127.0.0.1 serving the tiny target: prepare (our CLI, our
    venv) regenerates the same 56 conversations the in-process engine did; greedy, the datasets agree."""
    import socket
    import time
    import urllib.request

    if "regenerate" not in MANIFEST:
        pytest.skip("the smoke manifest (prepare.py --smoke) has no regeneration case")
    regen = MANIFEST["regenerate"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(DIR / "vllm-serve.log", "w")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                               regen["target"], "--served-model-name", "tiny-target", "--host", "127.0.0.1",
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


def test_regenerate_offline_through_vllm():
    """`data.regen_engine=vllm`: prepare (our CLI, our venv) runs this venv's vLLM offline as its worker
    (inference/vllm_worker.py, fp32, chunks of 16) on the same 56 conversations the in-process engine did; greedy,
    the datasets agree."""
    import time

    if "regenerate" not in MANIFEST:
        pytest.skip("the smoke manifest (prepare.py --smoke) has no regeneration case")
    regen = MANIFEST["regenerate"]
    run_dir = DIR / "regen-vllm-offline"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    env = {**os.environ, "MTP_TRAIN_VLLM_PYTHON": sys.executable}
    t0 = time.perf_counter()
    subprocess.run([regen["mtp_train"], "prepare", "recipe=tiny", f"run_dir={run_dir}", "target.device=cpu",
                    *regen["overrides"], "data.regen_engine=vllm", "data.regen_dtype=float32", "data.regen_chunk=16",
                    "data.regen_batch_size=16"], check=True, timeout=1200, env=env)
    seconds = time.perf_counter() - t0
    same = json.loads(subprocess.run([regen["python"], str(ROOT / "tests" / "serving" / "same_replies.py"),
                                      regen["ours"], str(run_dir / "data")], check=True, capture_output=True,
                                     text=True).stdout)
    ours, theirs = same["regenerate"]
    record("regenerate_offline", {"ours": ours, "vllm": theirs, "prepare_seconds": seconds,
                                  **{k: v for k, v in same.items() if k != "regenerate"}})
    assert theirs["engine_choice"]["engine"] == "vllm" and theirs["engine_choice"]["dtype"] == "float32"
    assert theirs["turns"] == ours["turns"] and theirs["turns_from_journal"] == 0
    for split in ("train", "val"):
        if split in same:
            assert same[split]["samples"] == same[split]["other"]
            assert same[split]["identical"] >= 0.9 * same[split]["samples"], same
