"""The target tensors a head shares but never trains: token embedding E, lm_head W and the final norm.

They are read by key from the target's safetensors (through `model.safetensors.index.json` when the
checkpoint is sharded), never by loading the whole target: for a 70B target that is ~4 GB instead of
~140 GB. Tied embeddings (no `lm_head.weight`, or `tie_word_embeddings`) reuse E as W.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mtp_train.model.target import check_model_dir

EMBED_KEY, LM_HEAD_KEY, NORM_KEY = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"


def weight_map(path: str | Path) -> dict[str, Path]:
    """tensor name -> safetensors file, for a single-file or an index-sharded checkpoint."""
    p = check_model_dir(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a safetensors index (no 'weight_map'): {e}") from e
        return {k: p / v for k, v in mapping.items()}
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {p} (the head reads the target's embedding and "
                                "lm_head from them; convert .bin checkpoints with transformers' save_pretrained)")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: f for k in sf.keys()})
    return out


def read_tensors(path: str | Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors only; keys absent from the checkpoint are absent from the result."""
    mapping = weight_map(path)
    by_file: dict[Path, list[str]] = {}
    for k in keys:
        if k in mapping:
            by_file.setdefault(mapping[k], []).append(k)
    out = {}
    for f, names in by_file.items():
        if not f.is_file():
            raise FileNotFoundError(f"{f} (named by the target's weight index for {names[0]}) does not exist")
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: sf.get_tensor(k) for k in names})
    return out


FEW_ROWS = 16  # up to this many rows a CPU projection may stream its weight; past it (a prefill) BLAS's GEMM is right
PROJECTION_ENV = "MTP_TRAIN_PROJECTION"  # probe (default) | stream | gemm: pins the form of every few-row projection
FORMS = ("stream", "gemm")
ONE_ROW_FORMS = ("stream", "pair")  # one row: a matrix-vector product, or the row twice as a 2-column product
PROBE_BYTES = 64 << 20  # the probe times this many bytes of weights per form, more than a core's L2 holds
_chosen: dict[tuple[int, int, int, torch.dtype], str] = {}  # (out, in, rows, dtype) -> form, once per process


def _stream(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight @ flat.T).T


def _gemm(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(flat, weight)


def _pair(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # one row as two columns: some BLAS builds run a 2-column product at twice the speed of their matrix-vector
    # one (the AMD EPYC machine: SmolLM2's lm_head 4.1 against 10.5 ms); the copy's column is dropped
    return (weight @ torch.cat([flat, flat]).T)[:, :1].T


_FNS = {"stream": _stream, "gemm": _gemm, "pair": _pair}


def probe_form(out_features: int, in_features: int, rows: int, dtype: torch.dtype, repeats: int = 5,
               timer=time.perf_counter) -> tuple[str, dict[str, float]]:
    """Which form computes `rows` rows of an [out, in] projection faster on this CPU: `(form, {form: fastest
    seconds per weight})`, of `FORMS` (one row: of `ONE_ROW_FORMS`). Both forms read copies of the weight that
    together exceed the L2 cache (decoding streams every layer's weights from memory, not from cache), in turns,
    `repeats` times; the fastest turn of each counts, as another process on the machine can only slow a turn
    down."""
    elem = torch.empty((), dtype=dtype).element_size()
    copies = max(1, min(64, PROBE_BYTES // (out_features * in_features * elem)))
    weights = [torch.full((out_features, in_features), 0.01, dtype=dtype) for _ in range(copies)]
    x = torch.full((rows, in_features), 0.01, dtype=dtype)
    forms = ONE_ROW_FORMS if rows == 1 else FORMS
    times: dict[str, list[float]] = {f: [] for f in forms}
    for _ in range(repeats):
        for form in forms:
            start = timer()
            for w in weights:
                _FNS[form](x, w)
            times[form].append((timer() - start) / copies)
    fastest = {f: min(t) for f, t in times.items()}
    return min(forms, key=lambda f: (fastest[f], f != "stream")), fastest


def projection_form(out_features: int, in_features: int, rows: int, dtype: torch.dtype) -> str:
    """The form `project` uses on a CPU for `rows` rows: what `probe_form` measured faster on this machine (once
    per shape, row count and dtype in a process; one row: `stream` or `pair`, 2 to FEW_ROWS rows: `stream` or
    `gemm`), unless $MTP_TRAIN_PROJECTION pins it (one row then streams: a matrix-vector product)."""
    pinned = os.environ.get(PROJECTION_ENV, "probe")
    if pinned not in (*FORMS, "probe"):
        raise ValueError(f"${PROJECTION_ENV}={pinned!r}: must be one of probe, {', '.join(FORMS)}")
    if pinned != "probe":
        return "stream" if rows == 1 else pinned
    key = (out_features, in_features, rows, dtype)
    if key not in _chosen:
        _chosen[key] = probe_form(*key)[0]
    return _chosen[key]


def project(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`h @ weight.T (+ bias)` for the few rows decoding has ([..., H] -> [..., V]).

    On a CPU, for up to FEW_ROWS rows, it takes the faster of two forms on this machine (`projection_form`):
    `(weight @ h.T).T` streams the weight once like a matrix-vector product, while BLAS's `h @ weight.T` may
    first pack the whole weight. Which wins depends on the processor: on the AMD EPYC machine packing made 2-16
    rows 2-3.5x one row at SmolLM2's lm_head (benchmarks/lm_head_rows.py), on the Intel Xeon one the streamed
    form made 2 rows 2.6-3x one row and BLAS's 1.03x (benchmarks/RESULTS.md `step_cost`). One row, plain
    decoding's, is a matrix-vector product or (`pair`) the row twice as a 2-column product, which on the
    2026-12-04 AMD EPYC machine made the target-alone step 1.8x faster. GPUs and longer inputs get the plain form."""
    flat = h.reshape(-1, h.shape[-1])
    if h.device.type != "cpu" or flat.shape[0] > FEW_ROWS:
        return torch.nn.functional.linear(h, weight, bias)
    form = projection_form(weight.shape[0], weight.shape[1], flat.shape[0], weight.dtype)
    out = _FNS[form](flat, weight).reshape(*h.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


class FrozenTarget(nn.Module):
    """E, W and the final norm weight, frozen. `embed(ids)` and `logits(h)` are all the head needs."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None,
                 final_norm: torch.Tensor | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        tied = lm_head_weight is None or lm_head_weight is embed_weight
        self.tied = tied
        self.lm_head_weight = self.embed_tokens.weight if tied else nn.Parameter(lm_head_weight, requires_grad=False)
        self.register_buffer("final_norm", final_norm, persistent=False)
        self.requires_grad_(False)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> "FrozenTarget":
        p = check_model_dir(path)
        config = json.loads((p / "config.json").read_text())
        t = read_tensors(p, [EMBED_KEY, LM_HEAD_KEY, NORM_KEY])
        if EMBED_KEY not in t:
            raise ValueError(f"target at {p} has no {EMBED_KEY!r} in its safetensors; the head needs the "
                             "target's token embedding")
        tied = config.get("tie_word_embeddings", False) or LM_HEAD_KEY not in t
        to = dict(dtype=dtype, device=device)
        return cls(t[EMBED_KEY].to(**to), None if tied else t[LM_HEAD_KEY].to(**to),
                   t[NORM_KEY].to(**to) if NORM_KEY in t else None)

    @property
    def vocab_size(self) -> int:
        return self.lm_head_weight.shape[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, H]
        return self.embed_tokens(ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        return h @ self.lm_head_weight.T
