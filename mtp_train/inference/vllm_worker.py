"""vLLM kept running for a stream of work: prompts (token ids) come in chunks on stdin, each chunk's output tokens
leave on stdout as one JSON line, so the caller commits each chunk as it finishes (regeneration with
`data.regen_engine=vllm`). Runs with vLLM's own Python; imports nothing of mtp_train (as `vllm_run.py`).

    python mtp_train/inference/vllm_worker.py TARGET [--dtype float32] [--max-model-len 1024] [--max-num-seqs N]
        [--eager]
    python mtp_train/inference/vllm_worker.py --probe

The protocol, one JSON object per line:
  stdout  {"ready": true, "vllm_version": V, "device": D}          once vLLM has loaded the target
  stdin   {"chunk": ID, "prompts": [[id, ...], ...], "max_tokens": N, "temperature": T, "seeds": [S, ...] | null,
           "stop": [id, ...]}
  stdout  {"chunk": ID, "tokens": [[id, ...], ...], "seconds": S}   the output tokens, in the prompts' order
  stdout  {"error": "Type: message"}                                vLLM failed to start or to decode; exit 1
The end of stdin ends the worker (exit 0). vLLM's own output, and anything else printed, goes to stderr: stdout
is the protocol's alone. The worker leads its own process group (the caller starts it so) and kills that group,
vLLM's engine processes with it, when its parent is gone (checked every second): a killed caller leaves no vLLM
running. --probe imports vLLM and prints {"vllm_version", "device"} (or {"error"}, exit 1)."""
import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback


def _reply(channel, message: dict) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def _orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _platform() -> dict:
    import vllm
    from vllm.platforms import current_platform

    return {"vllm_version": vllm.__version__, "device": current_platform.device_type}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", nargs="?")
    ap.add_argument("--probe", action="store_true", help="import vLLM, print its version and device, exit")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, help="vLLM's batch limit")
    ap.add_argument("--eager", action="store_true", help="vLLM's enforce_eager (no compiled graphs)")
    args = ap.parse_args()
    channel = os.fdopen(os.dup(1), "w")  # the protocol's; vLLM's prints go to stderr from here on
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if args.probe or not args.target:
        try:
            _reply(channel, _platform())
        except Exception as e:  # noqa: BLE001 - the caller reads why
            _reply(channel, {"error": f"{type(e).__name__}: {' '.join(str(e).split())}"})
            raise SystemExit(1)
        return
    threading.Thread(target=_orphaned, args=(os.getppid(),), daemon=True).start()
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=args.target, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=args.eager,
                  **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}))
        _reply(channel, {"ready": True, **_platform()})
        for line in sys.stdin:
            work = json.loads(line)
            t, seeds = float(work["temperature"]), work.get("seeds") or [None] * len(work["prompts"])
            params = [SamplingParams(temperature=t, max_tokens=int(work["max_tokens"]), ignore_eos=False,
                                     stop_token_ids=list(work.get("stop") or []), seed=s if t > 0 else None)
                      for s in seeds]
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in work["prompts"]], params, use_tqdm=False)
            _reply(channel, {"chunk": work["chunk"], "tokens": [list(r.outputs[0].token_ids) for r in out],
                             "seconds": time.perf_counter() - t0})
    except Exception as e:  # noqa: BLE001 - the caller reads why
        traceback.print_exc()
        _reply(channel, {"error": f"{type(e).__name__}: {' '.join(str(e).split())}"})
        raise SystemExit(1)


if __name__ == "__main__":
    main()
