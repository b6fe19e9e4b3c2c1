"""mtp_train's `mtp` head in vLLM: the draft model vLLM's EAGLE proposer runs (method `eagle`).

    u   = eh_proj([enorm(E[x_{i+1}]); hnorm(h_i)])      2H -> H, no bias, embedding first
    z   = decoder layer(u)                              the target family's own vLLM layer, input norm kept
    ĥ   = post_norm(z)                                  what compute_logits reads AND the next step's h

The proposer calls `forward(input_ids, positions, hidden_states)` with the target's final (post-norm) hidden
states on the first step and this model's own second output afterwards, and `compute_logits` on the first
output; the embedding and lm_head are the target's (the export carries neither: vLLM shares them). With a draft
vocabulary (`draft_vocab_size` in config.json, `d2t` in the weights: target id = draft id + d2t[draft id]) the
logits outside it are -inf, which is what the trained head's `W[draft_ids] ĥ` drafts from.

Weights are read under the export's own names (`mtp_train`'s `vllm-mtp` layout): `enorm.weight`,
`hnorm.weight`, `eh_proj.weight`, `mtp_block.*` (the decoder layer, as transformers names it), `post_norm.weight`,
`d2t`. The decoder layer's projections are vLLM's tensor-parallel linears (q/k/v and gate/up stacked as its
loaders stack them); eh_proj is replicated, as in vLLM's own EAGLE heads.
"""

# no `from __future__ import annotations`: vLLM's support_torch_compile reads the forward's tensor annotations
from collections.abc import Iterable

import torch
from torch import nn

from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import SupportsEagle
from vllm.model_executor.models.utils import get_draft_quant_config, maybe_prefix

# export key fragment -> (vLLM parameter fragment, shard id): vLLM fuses these projections
STACKED = ((".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"), (".v_proj.", ".qkv_proj.", "v"),
           (".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1))
FAMILIES = ("llama", "qwen2", "qwen3")


def decoder_layer(vllm_config: VllmConfig, config, prefix: str) -> nn.Module:
    """The target family's vLLM decoder layer (both norms), quantised as the draft is."""
    family = config.model_type
    quant = get_draft_quant_config(vllm_config)
    if family == "llama":
        from vllm.model_executor.models.llama import LlamaDecoderLayer

        class DraftLlamaDecoderLayer(LlamaDecoderLayer):
            def get_quant_config(self, vllm_config):
                return quant

        return DraftLlamaDecoderLayer(vllm_config, prefix=prefix, config=config)
    if family == "qwen2":
        from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer

        return Qwen2DecoderLayer(config, vllm_config.cache_config, quant, prefix=prefix)
    if family == "qwen3":
        from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer

        return Qwen3DecoderLayer(config, vllm_config.cache_config, quant, prefix=prefix)
    raise ValueError(f"EagleMtpHeadForCausalLM: the draft's config.json has model_type {family!r}; this plugin "
                     f"builds the head's layer for {', '.join(FAMILIES)} targets (export it from such a target)")


@support_torch_compile
class MtpHeadModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", start_layer_id: int = 0) -> None:
        super().__init__()
        config = vllm_config.speculative_config.draft_model_config.hf_config
        family = getattr(config, "model", None) or config  # EAGLEConfig wraps the export's own config
        H, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, H, prefix=maybe_prefix(prefix, "embed_tokens"))
        self.enorm = RMSNorm(H, eps=eps)
        self.hnorm = RMSNorm(H, eps=eps)
        self.eh_proj = ReplicatedLinear(2 * H, H, bias=False, params_dtype=vllm_config.model_config.dtype,
                                        quant_config=get_draft_quant_config(vllm_config),
                                        prefix=maybe_prefix(prefix, "eh_proj"), return_bias=False)
        # the layer's attention is named after the target's layers, so its KV cache is its own
        self.mtp_block = decoder_layer(vllm_config, family, maybe_prefix(prefix, f"layers.{start_layer_id}"))
        self.post_norm = RMSNorm(H, eps=eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed_tokens(input_ids)
        u = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden_states)], dim=-1))
        z, residual = self.mtp_block(positions, u, None)
        out, _ = self.post_norm(z, residual)  # post_norm(z + residual): the layer's output, normalised
        return out, out


class EagleMtpHeadForCausalLM(nn.Module, SupportsEagle):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = config = vllm_config.speculative_config.draft_model_config.hf_config
        target_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        self.model = MtpHeadModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                                  start_layer_id=target_layers)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(config.vocab_size, scale=getattr(config, "logit_scale", 1.0))
        n = getattr(config, "draft_vocab_size", None)
        self.draft_vocab_size = n if n and n != config.vocab_size else None
        if self.draft_vocab_size:  # filled by load_weights from the export's d2t
            self.d2t = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.long), requires_grad=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if inputs_embeds is not None:
            raise NotImplementedError("EagleMtpHeadForCausalLM drafts from token ids (no multimodal inputs)")
        return self.model(input_ids, positions, hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.lm_head, hidden_states)
        if logits is None or not self.draft_vocab_size:
            return logits
        ids = self.d2t + torch.arange(self.draft_vocab_size, device=logits.device)
        out = torch.full_like(logits, float("-inf"))
        out[:, ids] = logits[:, ids]
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "t2d":  # the mask d2t implies; not needed here
                continue
            target = name if name == "d2t" else "model." + name
            shard = None
            for part, fused, shard_id in STACKED:
                if part in target and "model.mtp_block." in target:
                    target, shard = target.replace(part, fused), shard_id
                    break
            if target not in params:
                raise ValueError(f"the draft's weights hold {name!r}, which EagleMtpHeadForCausalLM has no place for "
                                 f"(its parameters: {', '.join(sorted(params))}): is this an mtp_train vllm-mtp "
                                 "export of this target's family?")
            param = params[target]
            if shard is None:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
            loaded.add(target)
        # the embedding and lm_head are the target's (the proposer shares them after loading)
        missing = sorted(k for k in params if k not in loaded and not k.startswith(("model.embed_tokens.", "lm_head.")))
        if missing:
            raise ValueError(f"the draft's weights lack {', '.join(missing)}: not a complete vllm-mtp export")
        return loaded | {k for k in params if k.startswith(("model.embed_tokens.", "lm_head."))}
