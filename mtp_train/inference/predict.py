"""What speculative decoding with a head would give on a GPU it has not run on: a roofline time model of one
forward, and the speed-up it predicts from the acceptance validation measured.

One forward of a model over `n` new tokens per row, batch `b`, `c` tokens already cached per row, costs

    t = max(bytes / bandwidth, flops / matmul rate) + fixed + per_layer x layers

* bytes: every decoder-layer weight once (for a mixture of experts, the experts the b·n tokens are expected to
  touch: E·(1 − (1 − k/E)^(b·n))), the output projection's rows once, and the KV cache read by attention
  (b · layers · (c + n) · the layer's K and V widths), at the run's dtype;
* flops: 2 · M · (the weights a token multiplies, the output rows included) with M = b·n rounded up to the
  device's matmul tile (**assumption**: a verification of k + 1 tokens at batch 1 costs a full 64-row tile, the
  padding effect the write-up describes; it only shows once compute binds), plus attention's 4 · b · n · (c + n)
  · layers · heads · head_dim;
* fixed and per_layer: what a forward costs whatever its size — the host launching kernels. Eager PyTorch pays
  it per operation (measured: `H200-eager`, our runner on an H200, and the `cpu` probe); a serving engine with
  CUDA graphs pays little (**assumption**, not measured here: 0.3 ms + 0.03 ms per layer).

A speculative step with a chain of k drafts runs the head k times (the catch-up over the ~τ tokens accepted last
step, which yields the first draft, then k − 1 single-token steps) and one target forward over k + 1 tokens; it
emits τ(k) tokens per row. So, per row,

    speed-up(k, b) = τ(k) · T(b, 1) / (T(b, k + 1) + H(b, τ) + (k − 1) · H(b, 1))

A tree (SGLang's steps, topk, num_draft_tokens = N) runs the head's catch-up and then steps − 1 forwards over the
topk frontier nodes, and verifies N tokens in one target forward:

    speed-up(tree, b) = τ(tree) · T(b, 1) / (T(b, N) + H(b, τ) + (steps − 1) · H(b, topk))

with T the target's forward and H the head's (one decoder layer, its input projection, its output rows: the
draft vocabulary's or the whole lm_head). τ is what validation measured (per row: batch size does not change
which drafts a row accepts). The context c is the prompt length plus half the generated tokens.

Device profiles: datasheet bandwidth and dense bf16 rate times the fractions our H200 probe reached
(`benchmarks/gpu_forward_time.py`: copy 4,242 of 4,800 GB/s = 0.88, GEMM 782 of 989 TFLOP/s = 0.79), for
H100-SXM, H200, A100-80GB and L40S; `cpu` is measured on the spot (`measure_cpu`): a read-bandwidth probe, a
matmul probe and the forward of a 1- and a 4-layer random Llama through our runner for the per-forward and
per-layer costs. `benchmarks/predictor.py` checks the model against measurements.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from mtp_train.inference.config import H200_EAGER, PROFILES, DeviceProfile, SamplingConfig, tree_label
from mtp_train.inference.runner import CausalLMRunner
from mtp_train.inference.speculative import SpeculativeDecoder
from mtp_train.model.head import DraftHead

BATCHES = (1, 4, 16, 64)


def runner_profile(device: torch.device, dtype: torch.dtype) -> DeviceProfile | None:
    """The profile of the machine our (eager) runner decodes on: `cpu` measured now; a known GPU's datasheet
    with the eager overheads measured on the H200; None for a GPU it does not know."""
    if device.type == "cpu":
        return measure_cpu(dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    for key, base in (("H100", "H100-SXM"), ("H200", "H200"), ("A100", "A100-80GB"), ("L40S", "L40S")):
        if key in name:
            p = PROFILES[base]
            return replace(p, name=f"{base}-eager", fixed_ms=H200_EAGER["fixed_ms"],
                           per_layer_ms=H200_EAGER["per_layer_ms"], source=p.source.split(";")[0]
                           + "; overhead measured: our eager runner on an H200")
    return None


def profile(name: str) -> DeviceProfile:
    if name == "cpu":
        return measure_cpu()
    if name not in PROFILES:
        raise ValueError(f"unknown device profile {name!r}: expected cpu or one of {', '.join(PROFILES)}")
    return PROFILES[name]


# -- what a model reads and computes ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelCost:
    """Per-forward sizes of a decoder: what `forward_ms` needs, counted from the module itself."""

    layers: int
    dense_params: int  # decoder-layer weights every token multiplies (all layers)
    expert_params: int  # routed-expert weights, all layers (0 for a dense model)
    experts: int  # routed experts per layer (0 for a dense model)
    experts_per_token: int
    output_rows: int  # rows of the output projection read per forward
    hidden: int
    kv_width: int  # K + V entries per token and layer
    attn_width: int  # heads x head_dim of the queries

    def params_touched(self, tokens: int) -> float:
        """Weights read by a forward over `tokens` tokens (the experts they are expected to reach)."""
        if not self.experts:
            return self.dense_params + self.output_rows * self.hidden
        touched = self.experts * (1 - (1 - self.experts_per_token / self.experts) ** tokens)
        return self.dense_params + self.expert_params * touched / self.experts + self.output_rows * self.hidden

    def params_per_token(self) -> float:
        share = self.experts_per_token / self.experts if self.experts else 0.0
        return self.dense_params + self.expert_params * share + self.output_rows * self.hidden


def _kv_width(config) -> int:
    heads = config.num_attention_heads
    if getattr(config, "kv_lora_rank", None):  # MLA as transformers caches it: full K and V per head
        return heads * (config.qk_nope_head_dim + config.qk_rope_head_dim) + heads * config.v_head_dim
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * getattr(config, "num_key_value_heads", heads) * head_dim


def _attn_width(config) -> int:
    heads = config.num_attention_heads
    if getattr(config, "kv_lora_rank", None):
        return heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
    return heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)


def _matmul_params(module: nn.Module) -> tuple[int, int, int]:
    """(dense, routed-expert, experts per layer) weights of the matrices in `module` (norms left out)."""
    dense = experts = 0
    per_layer = 0
    for name, p in module.named_parameters():
        if p.dim() < 2:
            continue
        if ".experts." in f".{name}":
            experts += p.numel()
            idx = name.split("experts.")[1].split(".")[0]
            per_layer = max(per_layer, int(idx) + 1 if idx.isdigit() else p.shape[0])
        else:
            dense += p.numel()
    return dense, experts, per_layer


def target_cost(config) -> ModelCost:
    """The target's sizes, from its config (the model is built on the meta device: no weights)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dense, experts, n_experts = _matmul_params(model.base_model.layers)
    return ModelCost(config.num_hidden_layers, dense, experts, n_experts,
                     getattr(config, "num_experts_per_tok", 0) or 0 if n_experts else 0, config.vocab_size,
                     config.hidden_size, _kv_width(config), _attn_width(config))


def head_cost(target_config, head_cfg) -> ModelCost:
    """A draft head's sizes: its layer and input projection, and the output rows it drafts over."""
    with torch.device("meta"):
        head = DraftHead(target_config, head_cfg)
    own_head = getattr(head, "lm_head", None)
    dense = sum(p.numel() for n, p in head.named_parameters() if p.dim() >= 2 and not n.startswith("lm_head."))
    rows = head_cfg.draft_vocab or target_config.vocab_size
    if own_head is not None:
        rows = own_head.weight.shape[0]
    return ModelCost(1, dense, 0, 0, 0, rows, target_config.hidden_size, _kv_width(head.config),
                     _attn_width(head.config))


def forward_ms(cost: ModelCost, device: DeviceProfile, batch: int, new: int, context: int,
               bytes_per_param: float, kv_bytes: float | None = None) -> float:
    """Milliseconds of one forward over `new` tokens per row at batch `batch` with `context` cached per row."""
    kv_bytes = bytes_per_param if kv_bytes is None else kv_bytes
    tokens = batch * new
    memory = cost.params_touched(tokens) * bytes_per_param + \
        batch * cost.layers * (context + new) * cost.kv_width * kv_bytes
    rows = math.ceil(tokens / device.tile) * device.tile
    flops = 2 * rows * cost.params_per_token() + 4 * tokens * (context + new) * cost.layers * cost.attn_width
    roof = max(memory / (device.bandwidth_gb_s * 1e9), flops / (device.tflops * 1e12))
    return roof * 1e3 + device.fixed_ms + device.per_layer_ms * cost.layers


# -- speed-ups ---------------------------------------------------------------------------------------------------
def speculative_ms(target: ModelCost, head: ModelCost, device: DeviceProfile, batch: int, k: int, tau: float,
                   context: int, bytes_per_param: float) -> float:
    """One chain step: the head k times (a catch-up over ~tau tokens, then k - 1 single steps) and the target
    over k + 1 tokens."""
    catch_up = max(1, round(tau))
    return (forward_ms(target, device, batch, k + 1, context, bytes_per_param)
            + forward_ms(head, device, batch, catch_up, context, bytes_per_param)
            + (k - 1) * forward_ms(head, device, batch, 1, context, bytes_per_param))


def tree_ms(target: ModelCost, head: ModelCost, device: DeviceProfile, batch: int, tree: tuple[int, int, int],
            tau: float, context: int, bytes_per_param: float) -> float:
    """One tree step, `tree` = (steps, topk, num_draft_tokens): the head's catch-up (~tau tokens, it yields depth
    1), then steps - 1 head forwards over the topk frontier nodes, and the target over num_draft_tokens tokens."""
    steps, topk, n = tree
    catch_up = max(1, round(tau))
    return (forward_ms(target, device, batch, n, context, bytes_per_param)
            + forward_ms(head, device, batch, catch_up, context, bytes_per_param)
            + (steps - 1) * forward_ms(head, device, batch, topk, context, bytes_per_param))


def predict_speedup(target: ModelCost, head: ModelCost, device: DeviceProfile, batch: int, k: int, tau: float,
                    context: int, bytes_per_param: float, tree: tuple[int, int, int] | None = None,
                    overhead: "StepOverhead | None" = None) -> dict:
    """The speed-up of a chain of k drafts, or with `tree` of that draft tree, that emits tau tokens per step;
    with `overhead`, each step (the target-only one too) also pays what the engine costs beyond its forwards."""
    plain = forward_ms(target, device, batch, 1, context, bytes_per_param)
    step = (tree_ms(target, head, device, batch, tree, tau, context, bytes_per_param) if tree else
            speculative_ms(target, head, device, batch, k, tau, context, bytes_per_param))
    if overhead is not None:
        plain += overhead.plain_ms
        step += overhead.spec_ms(tree[0], tree[2]) if tree else overhead.spec_ms(k)
    return {"batch": batch, "k": k, "tree": list(tree) if tree else None, "tau": tau, "target_ms": plain,
            "step_ms": step, "tokens_per_s": batch * 1e3 / plain, "speculative_tokens_per_s": batch * tau * 1e3 / step,
            "speedup": tau * plain / step}


def serving_table(target: ModelCost, head: ModelCost, device: DeviceProfile, taus: dict[int, float], context: int,
                  bytes_per_param: float = 2.0, batches=BATCHES, trees: dict[tuple, float] | None = None) -> list[dict]:
    """Per batch size: predicted tokens/s without speculation, the speed-up with each measured k (and each
    measured tree, (steps, topk, num_draft_tokens) -> tau), and the best setting."""
    out = []
    for b in batches:
        rows = [predict_speedup(target, head, device, b, k, t, context, bytes_per_param) for k, t in sorted(taus.items())]
        tree_rows = [predict_speedup(target, head, device, b, tree[0], t, context, bytes_per_param, tree)
                     for tree, t in (trees or {}).items()]
        best = max(rows + tree_rows, key=lambda r: r["speedup"])
        out.append({"batch": b, "target_only_tokens_per_s": (rows or tree_rows)[0]["tokens_per_s"],
                    "speedup_by_k": {r["k"]: r["speedup"] for r in rows},
                    "speedup_by_tree": {tree_label(r["tree"]): r["speedup"] for r in tree_rows},
                    "best_k": best["k"] if best["tree"] is None else None,
                    "best": tree_label(best["tree"]) if best["tree"] else f"k={best['k']}",
                    "best_speedup": best["speedup"]})
    return out


# -- the cpu profile, measured on the spot -------------------------------------------------------------------------
def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def _overheads(dtype: torch.dtype) -> tuple[float, float]:
    """(fixed, per-layer) ms of a decode forward through our runner, from random 1- and 4-layer Llamas small
    enough that their weights cost nothing."""
    times = {}
    for layers in (1, 4):
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=layers, vocab_size=256, attn_implementation="sdpa")
        runner = CausalLMRunner(LlamaForCausalLM(config).to(dtype).eval())
        cache = runner.new_cache(1)
        runner.forward(cache, torch.zeros(1, 16, dtype=torch.long), torch.ones(1, 16, dtype=torch.bool), logits_last=1)
        one = torch.ones(1, 1, dtype=torch.bool)
        ids = torch.zeros(1, 1, dtype=torch.long)

        def step():
            runner.forward(cache, ids, one)
            cache.keep(torch.tensor([16]))

        times[layers] = _median_ms(step, 30)
    per_layer = max(0.0, (times[4] - times[1]) / 3)
    return max(0.0, times[1] - per_layer), per_layer


def measure_cpu(dtype: torch.dtype = torch.float32) -> DeviceProfile:
    """This machine's profile: read bandwidth (sum over 256 MiB), matmul rate (64 x 2048 by 2048 x 2048, the shape
    of a short verification), and the runner's fixed and per-layer costs."""
    x = torch.ones(64 << 20, dtype=torch.float32)
    bandwidth = x.numel() * 4 / (_median_ms(lambda: x.sum(), 5) / 1e3) / 1e9
    del x
    a, w = torch.randn(64, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    tflops = 2 * 64 * 2048 * 2048 / (_median_ms(lambda: a @ w, 10) / 1e3) / 1e12
    fixed, per_layer = _overheads(dtype)
    return DeviceProfile("cpu", bandwidth, tflops, fixed, per_layer, 1,
                         f"measured here: {torch.get_num_threads()} threads, {str(dtype).removeprefix('torch.')}")


# -- the engine's cost beyond the forwards, measured on the spot ---------------------------------------------------
@dataclass(frozen=True)
class StepOverhead:
    """What one decoding step costs on this machine beyond the forwards `forward_ms` models: for a
    speculative step the verification's bookkeeping, the head's cache and sampling, Python between the
    forwards (and whatever the roofline misses about these small forwards); measured, not modelled."""

    plain_ms: float  # a target-only step
    step_ms: float  # a speculative step with one draft (k = 1)
    per_draft_ms: float  # each further draft (a chain's k - 1 single steps, a tree's steps - 1 depths)
    steps_timed: int = 0
    measured_ms: tuple[float, ...] = ()  # the median step itself at k = 0, 1, 2, ... (what a k = 1 step costs in
    # target steps: measured_ms[1] / measured_ms[0])
    by_k: tuple[float, ...] = ()  # the overhead measured at each k = 0, 1, 2, ... timed (by_k[0] = plain_ms): a
    # CPU's BLAS makes a verification of n tokens cost more than the roofline's one read of the weights once n
    # passes 2-3 (benchmarks/RESULTS.md `step_cost`), which only a step timed at that k shows

    def spec_ms(self, k: int, verified: int | None = None) -> float:
        """The overhead of a step with k drafts (a chain), or `verified` tokens checked per target forward with
        k head steps (a tree): measured at the chain that verifies as many tokens, plus `per_draft_ms` for
        each head step more or less than that chain has; extrapolated past the largest k timed."""
        n = k if verified is None else verified - 1
        if 0 < n < len(self.by_k):
            base = self.by_k[n]
        elif len(self.by_k) > 2:
            base = self.by_k[-1] + self.per_draft_ms * (n - len(self.by_k) + 1)
        else:
            base = self.step_ms + self.per_draft_ms * (n - 1)
        return base + self.per_draft_ms * (k - n)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def modelled_step_ms(target: ModelCost, head: ModelCost, device: DeviceProfile, batch: int, k: int, catch_up: int,
                     context: int, bytes_per_param: float) -> float:
    """The forwards of one step as `forward_ms` models them: the target over k + 1 tokens (1 for k = 0), and
    for k >= 1 the head over the `catch_up` tokens accepted last step and k - 1 single tokens."""
    ms = forward_ms(target, device, batch, k + 1, context, bytes_per_param)
    if k:
        ms += (forward_ms(head, device, batch, max(1, catch_up), context, bytes_per_param)
               + (k - 1) * forward_ms(head, device, batch, 1, context, bytes_per_param))
    return ms


def overhead_from_timings(timings: dict[int, list[tuple[float, int]]], target: ModelCost, head: ModelCost,
                          device: DeviceProfile, batch: int, context: int, bytes_per_param: float) -> StepOverhead:
    """`timings`: k (0 = target only, 1, 2) -> [(measured ms of one step, tokens the head caught up over)]. Each
    step's overhead is its time less its modelled forwards (`modelled_step_ms`), the median per k; a further
    draft costs the difference between k = 2 and k = 1 (never less than nothing)."""
    med = {k: _median([ms - modelled_step_ms(target, head, device, batch, k, c, context, bytes_per_param)
                       for ms, c in rows]) for k, rows in timings.items() if rows}
    if 0 not in med or 1 not in med:
        raise ValueError("overhead_from_timings needs timed steps at k = 0 and k = 1")
    timed = sorted(k for k in timings if timings[k])
    if timed != list(range(len(timed))):
        raise ValueError(f"overhead_from_timings needs timed steps at k = 0, 1, 2, ... without gaps; got {timed}")
    return StepOverhead(med[0], med[1], max(0.0, med[2] - med[1]) if 2 in med else 0.0,
                        sum(len(r) for r in timings.values()),
                        tuple(_median([ms for ms, _ in timings[k]]) for k in timed),
                        tuple(med[k] for k in timed))


@torch.inference_mode()
def time_steps(target, drafter, prompts: list[list[int]], k: int, steps: int) -> list[tuple[float, int]]:
    """(ms, catch-up tokens) of `steps` greedy decoding steps through the real loop (k = 0: the target alone),
    after the first one (whose catch-up runs over the whole prompt). No stop tokens: every row runs on."""
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda *a: None)
    dec = SpeculativeDecoder(target, prompts, drafter=drafter if k else None, k=max(k, 1), sampling=SamplingConfig(),
                             max_new_tokens=(steps + 2) * (k + 1) + 1)
    dec.step()
    out = []
    for _ in range(steps):
        catch_up = int(dec.features.valid.sum(1).max()) if dec.features is not None else 0
        sync()
        t0 = time.perf_counter()
        dec.step()
        sync()
        out.append(((time.perf_counter() - t0) * 1e3, catch_up))
    return out


def measure_overhead(target, drafter, prompts: list[list[int]], target_c: ModelCost, head_c: ModelCost,
                     device: DeviceProfile, bytes_per_param: float, steps: int = 12, repeats: int = 3,
                     max_k: int = 2) -> StepOverhead:
    """This engine's per-step overhead on `prompts` (one batch): `steps` timed steps at each k = 0 .. max_k
    (at least 2), `repeats` times in turn (so a load change touches every k alike), after a warm-up."""
    max_k = max(2, max_k)
    for k in range(1, max_k + 1):  # warm-up: first calls allocate (and probe the projections' forms) at every k
        time_steps(target, drafter, prompts, k, 2)
    timings: dict[int, list[tuple[float, int]]] = {k: [] for k in range(max_k + 1)}
    for _ in range(repeats):
        for k in timings:
            timings[k] += time_steps(target, drafter, prompts, k, steps)
    context = int(sum(map(len, prompts)) / len(prompts)) + steps
    return overhead_from_timings(timings, target_c, head_c, device, len(prompts), context, bytes_per_param)


# -- what validate reports -------------------------------------------------------------------------------------------
def validation_prediction(target_config, head_cfg, entries: list[dict], mean_context: float, device: DeviceProfile,
                          bytes_per_param: float, batch: int, serving: str = "H100-SXM",
                          overhead: StepOverhead | None = None) -> dict:
    """Beside each measured greedy/sampled chain row: the speed-up the model predicts on `device` (the machine
    validate ran on) with this engine's measured per-step `overhead`; and the predicted serving table on the
    `serving` profile in bf16 for b in BATCHES, from the greedy τ of the head (no overhead: another engine)."""
    target, head = target_cost(target_config), head_cost(target_config, head_cfg)
    context = int(mean_context)
    checks = []
    for e in entries:
        if e["drafter"] != "head" or device is None:
            continue
        tree = tuple(e["tree"]) if e.get("tree") else None
        p = predict_speedup(target, head, device, batch, e["k"], e["tau"], context, bytes_per_param, tree, overhead)
        checks.append({"k": e["k"], "tree": e.get("tree"), "temperature": e["temperature"], "tau": e["tau"],
                       "measured": e["speedup"], "predicted": p["speedup"], "error": p["speedup"] / e["speedup"] - 1})
    greedy = [e for e in entries if e["drafter"] == "head" and e["temperature"] == 0]
    chains = {e["k"]: e["tau"] for e in greedy if not e.get("tree")}
    trees = {tuple(e["tree"]): e["tau"] for e in greedy if e.get("tree")}
    out = {"device": asdict(device) if device else None, "context": context, "checks": checks,
           "overhead": asdict(overhead) if overhead else None}
    if greedy:
        out["serving"] = {"profile": asdict(PROFILES[serving]), "dtype": "bfloat16",
                          "table": serving_table(target, head, PROFILES[serving], chains, context, 2.0, trees=trees)}
    return out


