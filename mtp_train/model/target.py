"""The target model as the rest of the pipeline sees it: where it is, how to load it, and the architecture
numbers every later stage derives from its `config.json` (never copied into a recipe by hand)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mtp_train.model.cache import fetch_hint
from mtp_train.model.config import SUPPORTED_MODEL_TYPES, TargetConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the files that make a tokenizer (those present are hashed into its identity: `tokenizer_hash`)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "tokenizer.model")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}") from None


def resolve_device(name: str) -> torch.device:
    """The device `TargetConfig.device` names (its format is checked when the config is built)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"target.device={name!r} but no CUDA device is available; use target.device=cpu")
    return torch.device(name)


def check_model_dir(path: str | Path, what: str = "target") -> Path:
    """A model directory that exists and has a config.json, or an error that says which is missing."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"{what} directory not found: {p}{fetch_hint(p)}")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{what} directory {p} has no config.json (expected a Hugging Face model directory)")
    return p


@dataclass(frozen=True)
class TargetArch:
    """The numbers a draft head is built from, read off the target's config."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_parameters: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    mla: dict[str, int] | None = None  # DeepSeek-V2 multi-head latent attention fields

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "TargetArch":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{source}: model_type {model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")

        def need(key: str) -> Any:
            if key not in cfg or cfg[key] is None:
                raise ValueError(f"{source}: missing field {key!r} (needed to build the draft head)")
            return cfg[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):
            rope_theta = cfg["rope_parameters"].get("rope_theta")
        mla = None
        if model_type == "deepseek_v2":
            mla = {k: int(need(k)) for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")}
            mla["q_lora_rank"] = int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else 0
            head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        else:
            head_dim = int(cfg.get("head_dim") or hidden // heads)
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_parameters=dict(rope) if isinstance(rope, dict) else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mla=mla,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "TargetArch":
        p = check_model_dir(path)
        try:
            cfg = json.loads((p / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p / 'config.json'}: not valid JSON ({e})") from None
        return cls.from_dict(cfg, source=str(p / "config.json"))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def target_fingerprint(path: str | Path) -> str:
    """The target's identity without reading its weights: config.json, the weight index and the weight
    files' names and sizes."""
    p = check_model_dir(path)
    h = hashlib.sha256((p / "config.json").read_bytes())
    for f in sorted(p.glob("*.safetensors.index.json")) + sorted(p.glob("*.safetensors")):
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        if f.name.endswith(".json"):
            h.update(f.read_bytes())
    return h.hexdigest()


def tokenizer_hash(path: str | Path) -> str:
    """The tokenizer's identity: a digest of the `TOKENIZER_FILES` the directory holds, names and bytes."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = Path(path) / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def load_tokenizer(path: str | Path, what: str = "target"):
    p = check_model_dir(path, what)
    return AutoTokenizer.from_pretrained(p)


def load_causal_lm(path: str | Path, cfg: TargetConfig, what: str = "target") -> torch.nn.Module:
    """The whole causal LM, for generation and hidden-state extraction (not for the frozen head tensors,
    which are read by key)."""
    p = check_model_dir(path, what)
    try:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=torch_dtype(cfg.dtype),
                                                     attn_implementation=cfg.attn_implementation,
                                                     trust_remote_code=cfg.trust_remote_code,
                                                     device_map=str(resolve_device(cfg.device)))
    except OSError as e:  # missing or unreadable weight files
        raise FileNotFoundError(f"{what} at {p} could not be loaded: {str(e).splitlines()[0]}") from e
    return model.eval().requires_grad_(False)


def check_draft_tokenizer(target_path: str | Path, draft_path: str | Path, target_tokenizer=None,
                          draft_tokenizer=None) -> None:
    """A draft LM proposes target token ids and reads the target's: it must have the target's tokenizer."""
    target_tokenizer = target_tokenizer or load_tokenizer(target_path)
    draft_tokenizer = draft_tokenizer or load_tokenizer(draft_path, "draft")
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"draft tokenizer at {draft_path} differs from the target's at {target_path}: "
                         "a draft LM must share the target's tokenizer")


def hook_layer_inputs(decoder: torch.nn.Module, layers: list[int], into: dict[int, torch.Tensor], what: str = "store.layers"
                      ) -> list:
    """Forward pre-hooks that put the residual stream entering each decoder layer i of `layers` (transformers'
    `hidden_states[i]`) into `into[i]` at every forward; returns their handles (`.remove()` them). i = L, one past
    the last of L layers, is the last layer's output before the final norm (the norm's input; transformers'
    `hidden_states[L]` is after the norm). `what` names the setting in the errors."""
    blocks = getattr(decoder, "layers", None)
    if layers and not isinstance(blocks, torch.nn.ModuleList):
        raise ValueError(f"{what}: {type(decoder).__name__} has no `layers` list to capture from")
    bad = [i for i in layers if not 0 <= i <= len(blocks)]
    if bad:
        raise ValueError(f"{what} {bad} out of range: the target has {len(blocks)} decoder layers "
                         f"(0..{len(blocks) - 1}, and {len(blocks)} for the final norm's input)")
    norm = getattr(decoder, "norm", None)
    if len(blocks) in layers and not isinstance(norm, torch.nn.Module):
        raise ValueError(f"{what}: layer {len(blocks)} is the final norm's input, but {type(decoder).__name__} has "
                         "no `norm` module to capture it from")

    def catcher(i: int):
        def hook(module, args, kwargs):
            into[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    return [(blocks[i] if i < len(blocks) else norm).register_forward_pre_hook(catcher(i), with_kwargs=True)
            for i in layers]
