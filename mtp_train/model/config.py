"""The model's settings: the frozen target (`target.*`), the draft head (`head.*`) and the pre-flight look at the
target (`info.*`). Plain dataclasses and constants, no torch: `mtp_train.config` composes them into the run config.
"""

from __future__ import annotations

import json
import re
from dataclasses import MISSING, dataclass, field, fields

DTYPE_NAMES = ("float32", "bfloat16", "float16")
# Families whose decoder layer the head reuses. Matched on `model_type` exactly, never by substring.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "deepseek_v2")
ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3", "eager")


@dataclass
class TargetConfig:
    """The frozen target (and optional draft LM) a run is built on."""

    path: str = "???"  # HF directory: config.json, safetensors weights, tokenizer
    draft_path: str | None = None  # a separate small causal LM with the same tokenizer (draft-target scheme)
    dtype: str = "float32"  # float32 | bfloat16 | float16: fp32 on CPU, bf16 on GPUs
    device: str = "auto"  # auto (the GPU when there is one, else the CPU) | cpu | cuda | cuda:N
    attn_implementation: str = "sdpa"  # sdpa | flash_attention_2 | flash_attention_3 | eager
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"target.dtype={self.dtype!r}; expected one of {', '.join(DTYPE_NAMES)}")
        if self.device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"target.device={self.device!r}; expected auto, cpu, cuda or cuda:N")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"target.attn_implementation={self.attn_implementation!r}; expected one of "
                             f"{', '.join(ATTN_IMPLEMENTATIONS)}")


VARIANTS = ("mtp", "eagle1", "eagle3")


# train.depth when the recipe leaves it unset: EAGLE-3 trains with its training-time test, 7 steps deep; the others
# train the single next-token step unless a recipe asks for more.
DEFAULT_DEPTH = {"mtp": 1, "eagle1": 1, "eagle3": 7}


def override_literal(value) -> str:
    """A config value as an override writes it (`true`, `-1`, `[2,15]`)."""
    return json.dumps(value, separators=(",", ":"))


# the HeadConfig fields only an eagle3 head reads; another variant refuses them set away from their defaults
EAGLE3_ONLY = ("norm_before_residual", "norm_before_fc", "norm_output", "aux_layers", "init_fc", "num_layers")


@dataclass
class HeadConfig:
    variant: str = "mtp"  # mtp | eagle1
    fc_bias: bool = True  # eagle1's fc has a bias in the original EAGLE; mtp's eh_proj never does
    attn_implementation: str = "sdpa"  # sdpa | eager (the head always passes an explicit mask)
    draft_vocab: int = 0  # draft over the N most frequent trained tokens of the train split; 0 = the full vocabulary
    # eagle3: the target layers i whose input residual (transformers' hidden_states[i]) is fused, ascending;
    # empty = (2, L//2, L-3) for an L-layer target
    aux_layers: list[int] = field(default_factory=list)
    # eagle3: the residual is hidden_norm(g) instead of g (vLLM speculators' option; SpecForge and SGLang: false)
    norm_before_residual: bool = False
    # eagle3: one RMSNorm (`input_norm`, k·H wide) over the fused target features before fc (speculators' and
    # vLLM's `norm_before_fc`; SpecForge and SGLang: false)
    norm_before_fc: bool = False
    # eagle3: the chain feeds norm(z) back as the next step's g instead of z (speculators' and vLLM's
    # `norm_output`; SpecForge and SGLang: false); the lm_head reads norm(z) either way
    norm_output: bool = False
    # the head's decoder layer starts from the target's decoder layer `init_layer` (0..L-1; its attention, MLP and
    # norms, read from the target's safetensors) instead of N(0, initializer_range); -1 = that random start. An
    # eagle3 layer's q, k, v read 2H: the target's weights go to the feature half, the token half stays random.
    init_layer: int = -1
    # eagle3: fc starts as the identity on the block of target layer `init_fc` (one of the aux layers) and zero on
    # the others, so the head's layer first reads that target residual as it is; -1 = random N(0, initializer_range)
    init_fc: int = -1
    # eagle3 with init_layer: the token half [:, :H] of q, k, v starts `random` (N(0, initializer_range)) or `zero`
    # (the layer then starts as the target's layer on the features alone)
    init_token_half: str = "random"
    # eagle3: decoder layers in the head. 1 = EAGLE-3's single `midlayer` (every engine); n > 1 adds plain Llama
    # decoder layers `layers.1 .. layers.{n-1}` after it (H wide, as vLLM's llama_eagle3 builds them; vLLM only).
    # With init_layer i they start from the target's layers i+1 .. i+n-1.
    num_layers: int = 1

    def __post_init__(self) -> None:
        if self.draft_vocab < 0:
            raise ValueError(f"head.draft_vocab={self.draft_vocab}: must be >= 0 (0 drafts over the full vocabulary)")
        if self.variant not in VARIANTS:
            raise ValueError(f"head.variant={self.variant!r}: expected one of {', '.join(VARIANTS)}")
        if self.variant == "eagle3" and not self.draft_vocab:
            raise ValueError("head.variant=eagle3 trains its own lm_head over a draft vocabulary: set "
                             "head.draft_vocab=N (EAGLE-3 uses 32000 for Llama 3's 128k tokens)")
        if self.variant != "eagle3":  # every eagle3-only setting in one message, with the overrides that reset them
            default = {f.name: f.default_factory() if f.default is MISSING else f.default for f in fields(HeadConfig)}
            given = [(f"head.{n}={override_literal(getattr(self, n))}", f"head.{n}={override_literal(default[n])}")
                     for n in EAGLE3_ONLY if getattr(self, n) != default[n]]
            if given:
                raise ValueError(f"{', '.join(g for g, _ in given)}: for head.variant=eagle3 only (this head is "
                                 f"{self.variant}); add {' '.join(r for _, r in given)}")
        if self.init_layer < -1:
            raise ValueError(f"head.init_layer={self.init_layer}: expected -1 (random start) or a target layer "
                             "index 0..L-1")
        if self.init_fc < -1:
            raise ValueError(f"head.init_fc={self.init_fc}: expected -1 (random start) or one of the aux layers")
        if self.num_layers < 1:
            raise ValueError(f"head.num_layers={self.num_layers}: expected 1 (EAGLE-3's single layer) or more")
        if self.init_token_half not in ("random", "zero"):
            raise ValueError(f"head.init_token_half={self.init_token_half!r}: expected random or zero")
        if self.init_token_half == "zero" and (self.variant != "eagle3" or self.init_layer < 0):
            raise ValueError("head.init_token_half=zero is for head.variant=eagle3 with head.init_layer=i (it zeroes "
                             "the token half of the q, k, v that start from the target's layer i)")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"head.attn_implementation={self.attn_implementation!r}: expected sdpa or eager "
                             "(the head's training-time attention pattern needs an explicit mask)")


@dataclass
class InfoConfig:
    generate: bool = True  # load the weights and decode the prompt (turn off for targets too big for this host)
    prompt: str = "Write `def is_palindrome(text)`.\n\nReturn True if text reads the same backwards."
    chat: bool = True  # wrap the prompt in the tokenizer's chat template when it has one
    max_new_tokens: int = 48
