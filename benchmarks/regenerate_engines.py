"""Regeneration's engines side by side (`data.regen_engine`): our in-process engine against vLLM run offline as
prepare runs it (`inference/vllm_worker.py`), on the same chat prompts, in interleaved rounds on one machine.

    .venv/bin/python benchmarks/regenerate_engines.py [--recipe smollm2-135m] [--prompts 64] [--new-tokens 96]
        [--rounds 3] [--ours 16 32 64] [--vllm 32 64] [--dtypes float32 bfloat16] [--ours-dtypes float32 bfloat16]
        [--eager] [--server 64]
        [--vllm-python PATH] [--vllm-env VLLM_CPU_NUM_OF_RESERVED_CPU=0] [--out FILE.json]

The prompts: the system and user turns of the recipe target's function-writing conversations (the standard
library's validation files, two per file), through the target's chat template; greedy, at most --new-tokens new
tokens, the target's end-of-sequence tokens stop a reply. Each round runs every engine once, in the same order:
ours at each dtype and batch size (`decode_batches`, the target loaded once per dtype), then vLLM at each dtype
and max_num_seqs (one start each, not timed, then a warm-up chunk, then all prompts as one timed chunk; the
worker's environment as prepare's, `VllmWorker`), then, with --server, `vllm serve` (fp32, eager) with --server
requests in flight. bf16 (either engine) only where the CPU has AMX unless --dtypes / --ours-dtypes name it.
Prints a table (generated tokens per second, median over rounds; the ratio over ours at the first dtype and batch
size; the spread over rounds, max / min - 1) and how many replies agree token for token between that first
configuration and each other, with the positions of the first divergence; writes JSON (default
benchmarks/results/regenerate_engines.json) with the processor, the load average before and after, the commands.
Exits 1 when an engine returns another number of replies than prompts asked.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
from transformers import GenerationConfig

from mtp_train.config import compose
from mtp_train.data.regen_engines import has_amx, read_cpuinfo
from mtp_train.data.regenerate import Server, batch_order, decode_batches
from mtp_train.data.stdlib import function_conversations, list_files
from mtp_train.inference.load import eos_ids, stop_tokens
from mtp_train.inference.runner import load_runner
from mtp_train.inference.vllm_engine import VllmWorker, find_vllm_python
from mtp_train.model.target import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for f in list_files("validation"):
        for j, conv in enumerate(function_conversations(f.read(), max_chars=2000)):
            if j == 2:
                break
            out.append(list(tokenizer.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=True,
                                                          return_dict=False)))
        if len(out) >= n:
            return out[:n]
    raise SystemExit(f"only {len(out)} prompts in the validation files; ask for fewer (--prompts)")


def processor() -> str:
    for line in read_cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def cut(tokens: list[int], stop: set[int]) -> list[int]:
    """A reply up to, not with, its first stop token."""
    return next((tokens[:i] for i, t in enumerate(tokens) if t in stop), tokens)


def divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two replies differ (None when they are the same)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    first = [divergence(a, b) for a, b in zip(reference, other)]
    differ = sorted(d for d in first if d is not None)
    return {"identical": sum(d is None for d in first), "of": len(first),
            "fraction": round(sum(d is None for d in first) / max(1, len(first)), 3),
            "first_divergence": differ, "median_first_divergence": statistics.median(differ) if differ else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ours", type=int, nargs="*", default=[16, 32, 64], help="our engine's batch sizes")
    ap.add_argument("--vllm", type=int, nargs="*", default=[32, 64], help="vLLM's max_num_seqs")
    ap.add_argument("--dtypes", nargs="+", help="vLLM's dtypes (default: float32, and bfloat16 where AMX)")
    ap.add_argument("--ours-dtypes", nargs="+", help="our engine's dtypes (default: as --dtypes)")
    ap.add_argument("--eager", action="store_true", help="vLLM without compiled graphs (enforce_eager)")
    ap.add_argument("--server", type=int, help="also `vllm serve` (fp32) with this many requests in flight")
    ap.add_argument("--vllm-python", help="default: $MTP_TRAIN_VLLM_PYTHON, else .venv-vllm")
    ap.add_argument("--vllm-env", nargs="*", default=[], help="KEY=VALUE for vLLM's processes")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "regenerate_engines.json")
    args = ap.parse_args()
    load_before = os.getloadavg()
    amx = has_amx(read_cpuinfo())
    dtypes = args.dtypes or (["float32", "bfloat16"] if amx else ["float32"])
    ours_dtypes = args.ours_dtypes or dtypes
    python = args.vllm_python or find_vllm_python()
    if args.vllm and python is None:
        raise SystemExit("no vLLM Python: pass --vllm-python, set $MTP_TRAIN_VLLM_PYTHON, or build .venv-vllm "
                         "(make .venv-vllm/.vllm-installed); --vllm with no sizes leaves vLLM out")
    os.environ.update(kv.split("=", 1) for kv in args.vllm_env)
    cfg = compose(args.recipe, ["run_dir=/tmp/unused", "target.device=cpu", "target.dtype=float32"])
    target = cfg.target.path
    tokenizer = load_tokenizer(target)
    prompts = chat_prompts(tokenizer, args.prompts)
    try:
        generation = GenerationConfig.from_pretrained(target)
    except OSError:
        generation = None
    stop = eos_ids(tokenizer, generation)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "regenerate_engines"
    print(f"{args.recipe}: {len(prompts)} prompts ({sum(map(len, prompts)) / len(prompts):.0f} tokens on average), "
          f"greedy, <= {args.new_tokens} new tokens; {processor()}, AMX {amx}; vLLM dtypes {dtypes}", flush=True)

    runners = {d: load_runner(target, replace(cfg.target, dtype=d)) for d in ours_dtypes}
    for runner in runners.values():
        assert stop_tokens(tokenizer, runner) == stop, "our engine and vLLM would stop at other tokens"
        next(decode_batches(runner, prompts[:4], [[0, 1, 2, 3]], max_new_tokens=8, temperature=0.0, stop=stop,
                            seeds=[0]))  # warm-up

    def ours(dtype: str, batch: int) -> tuple[list[list[int]], float]:
        runner, batches = runners[dtype], batch_order(prompts, batch)
        replies: list = [None] * len(prompts)
        t0 = time.perf_counter()
        for chunk, out in decode_batches(runner, prompts, batches, max_new_tokens=args.new_tokens, temperature=0.0,
                                         stop=stop, seeds=[0] * len(batches)):
            for i, r in zip(chunk, out):
                replies[i] = r
        return replies, time.perf_counter() - t0

    commands = {}

    def vllm(dtype: str, seqs: int) -> tuple[list[list[int]], float]:
        longest = max(map(len, prompts)) + args.new_tokens + 8
        w = VllmWorker(python, target, work / f"vllm-{dtype}-{seqs}.log", dtype, max(1024, longest), seqs,
                       ("--eager",) if args.eager else ())
        commands[f"vllm {dtype} {seqs}"] = " ".join(w.command)
        try:
            w.generate(prompts[:8], 8, 0.0, None, sorted(stop))  # warm-up
            t0 = time.perf_counter()
            tokens, _ = w.generate(prompts, args.new_tokens, 0.0, None, sorted(stop))
            seconds = time.perf_counter() - t0
        finally:
            w.close()
        return [cut(t, stop) for t in tokens], seconds

    def server(concurrency: int) -> tuple[list[list[int]], float]:
        from regenerate_server import serve

        proc, url = serve(python, target, work / "vllm-serve.log")
        commands["vllm serve"] = " ".join(proc.args)
        try:
            client = Server(url, "", 600.0, 0)
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(lambda p: client.complete(p, 8, 0.0, 0, "warm-up"), prompts[:8]))
                t0 = time.perf_counter()
                out = list(pool.map(lambda p: client.complete(p, args.new_tokens, 0.0, 0, "a prompt"), prompts))
                seconds = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(timeout=120)
        # the server answers text and a token count: stand-in token lists of that length (no agreement figures)
        return [[-1] * n for _, n in out], seconds

    engines = [(f"ours {d} x{b}", lambda d=d, b=b: ours(d, b)) for d in ours_dtypes for b in args.ours]
    engines += [(f"vLLM {d} x{s}", lambda d=d, s=s: vllm(d, s)) for d in dtypes for s in args.vllm]
    if args.server:
        engines.append((f"vLLM serve fp32 c{args.server}", lambda: server(args.server)))
    runs: dict[str, list[dict]] = {name: [] for name, _ in engines}
    outputs: dict[str, list[list[list[int]]]] = {name: [] for name, _ in engines}
    wrong = []
    for r in range(args.rounds):
        for name, run in engines:
            replies, seconds = run()
            tokens = sum(len(x or ()) for x in replies)
            if len(replies) != len(prompts) or any(x is None for x in replies):
                wrong.append(f"{name}, round {r + 1}: {len(replies)} replies to {len(prompts)} prompts")
            runs[name].append({"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": tokens / seconds})
            outputs[name].append(replies)
            print(f"round {r + 1}: {name}: {tokens} tokens in {seconds:.1f}s = {tokens / seconds:.1f} tok/s",
                  flush=True)

    base = statistics.median(x["tokens_per_s"] for x in runs[engines[0][0]])
    rows = {}
    reference = outputs[engines[0][0]][0]
    for name, _ in engines:
        rates = [x["tokens_per_s"] for x in runs[name]]
        median = statistics.median(rates)
        rows[name] = {"tokens_per_s": round(median, 1), "ratio": round(median / base, 2),
                      "spread": round(max(rates) / min(rates) - 1, 3), "rounds": runs[name]}
        if "serve" not in name:
            rows[name]["agreement_with_" + engines[0][0].replace(" ", "_")] = agreement(reference, outputs[name][0])
            rows[name]["identical_over_rounds"] = all(o == outputs[name][0] for o in outputs[name][1:])
    print(f"\n| engine | tokens/s | x over {engines[0][0]} | spread over rounds | replies identical to "
          f"{engines[0][0]} | first divergence (median) | same every round |\n|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        a = next((v for k, v in row.items() if k.startswith("agreement_with_")), None)
        print(f"| {name} | {row['tokens_per_s']:.1f} | {row['ratio']:.2f} | {100 * row['spread']:.1f}% | "
              + (f"{a['identical']}/{a['of']} | {a['median_first_divergence']} | {row['identical_over_rounds']} |"
                 if a else "- | - | - |"))
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "processor": processor(), "amx": amx, "cpus": os.cpu_count(),
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "torch": torch.__version__, "command": " ".join(["benchmarks/regenerate_engines.py", *sys.argv[1:]]),
              "commands": commands,
              "recipe": args.recipe, "target": target, "prompts": len(prompts), "new_tokens": args.new_tokens,
              "rounds": args.rounds, "vllm_env": args.vllm_env, "eager": args.eager, "engines": rows, "errors": wrong}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    if wrong:
        print("FAILED: " + "; ".join(wrong), file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
