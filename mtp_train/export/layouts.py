"""Serving layouts: the trained head's state dict renamed onto the keys, and its config onto the
`config.json` fields, that each loader reads. One rename table per layout serves both directions (export,
and reading an export back into `DraftHead` to check it), like a state-dict adapter.

The key names follow the loaders' own code (read, not guessed):

* `hf-mtp` (`mtp` heads): transformers 5.x `MtpModel` (transformers/modeling_layers.py `MtpModel`,
  `get_mtp_weights_regex`, `get_weight_conversions`; transformers/conversion_mapping.py `"MtpModel"`):
  the head is MTP layer N = `num_hidden_layers`, `model.layers.N.{enorm,hnorm,eh_proj,post_norm}.weight`
  and the decoder layer's weights directly under `model.layers.N.`; `config.json` gains `num_mtp_layers`
  (read by generation/candidate_generator.py `MTPCandidateGenerator`) and, where the target lists
  `layer_types`, the `mtp_layer_types` that configuration_utils.py `get_mtp_config` requires.
* `eagle` (`eagle1` heads on Llama targets), two directories because the loaders disagree on `fc.bias`:
  vLLM (vllm/model_executor/models/llama_eagle.py `EagleLlamaForCausalLM`; architecture named as in
  vllm/transformers_utils/configs/eagle.py `EAGLEConfig`) reads `fc.weight` (its `fc` has no bias) and
  `layers.0.*` without `input_layernorm`; SGLang (python/sglang/srt/models/llama_eagle.py
  `LlamaForCausalLMEagle`) reads the same keys plus `fc.bias` (its `fc` always has one). Both take
  embeddings and `lm_head` from the target.
* `deepseek-nextn` (`mtp` heads on DeepSeek targets): vLLM's vllm/model_executor/models/deepseek_mtp.py
  (`DeepSeekMTP.load_weights`, `_rewrite_spec_layer_name`) and deepseek_v2.py
  (`get_spec_layer_idx_from_weight_name`): `model.layers.N.{enorm,hnorm,eh_proj}`,
  `model.layers.N.shared_head.norm` (our `post_norm`), `model.layers.N.shared_head.head` and
  `model.layers.N.embed_tokens` (copies of the target's `lm_head` and embedding, as in DeepSeek-V3's own
  checkpoint), the decoder layer under `model.layers.N.`; `num_nextn_predict_layers` in `config.json`.
  vLLM 0.32 itself does not serve such a directory beside a DeepSeek-V2 target (`make test-serving` records
  why: it reads MTP layers from the target's own checkpoint and config, and builds them MoE); the keys are
  those of DeepSeek-V3's checkpoints, which it and SGLang do load.
* `deepseek-eagle` (`mtp` heads on DeepSeek targets, written beside `deepseek-nextn`): vLLM's own EAGLE head for
  DeepSeek (vllm/model_executor/models/deepseek_eagle.py, architecture `EagleDeepSeekMTPModel`, method `eagle`):
  `enorm`, `hnorm`, `fc` (our `eh_proj`), one `DeepseekV2DecoderLayer` under `layers.0.` (the index in its
  module list; the layer itself is built with the prefix `layers.N`, N = the target's layer count), `norm` (our
  `post_norm`), whose output is both what the shared lm_head reads and the next step's hidden state, as in our
  drafter. `DeepseekV2DecoderLayer` builds an MoE MLP when `n_routed_experts` is set and N >=
  `first_k_dense_replace`; this directory's config sets `first_k_dense_replace` to N + 1, so the layer is dense,
  as the head is.
* `vllm-mtp` (`mtp` heads on Llama / Qwen2 / Qwen3 targets): the head under its own names (`enorm`, `hnorm`,
  `eh_proj`, `mtp_block.*`, `post_norm`, and `d2t` with a draft vocabulary), read by our vLLM plugin
  (serving/vllm_plugin, `EagleMtpHeadForCausalLM`, speculative method `eagle`); `config.json` is the target's
  with that architecture, one layer, and `draft_vocab_size` when the head has a draft vocabulary. vLLM's EAGLE
  config keeps an architecture whose name starts with `Eagle` (vllm/transformers_utils/configs/eagle.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtp_train.export.config import DEEPSEEK_EAGLE, EAGLE, HF_MTP, NEXTN, VLLM_MTP

VLLM_MTP_ARCH = "EagleMtpHeadForCausalLM"  # serving/vllm_plugin/mtp_train_vllm/__init__.py: ARCHITECTURE
VLLM_MTP_FAMILIES = ("llama", "qwen2", "qwen3")  # the decoder layers the plugin builds
MTP_PARTS = ("enorm", "hnorm", "eh_proj", "post_norm")


@dataclass(frozen=True)
class Layout:
    """How one export directory names the head: head-key prefix -> export-key prefix, the target tensors it
    carries besides the head (export key -> target key), and the config.json fields it sets."""

    name: str
    renames: dict[str, str]
    target_tensors: dict[str, str] = field(default_factory=dict)
    config: dict = field(default_factory=dict)

    def to_export(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_rename(k, self.renames, k): v for k, v in state.items()}

    def to_head(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        back = {v: k for k, v in self.renames.items()}
        return {_rename(k, back, k): v for k, v in tensors.items() if k not in self.target_tensors}

    def owns(self, key: str) -> bool:
        """Whether an export key belongs to this layout (the rest of a stitched directory is the target's)."""
        return any(key.startswith(p) for p in self.renames.values())


def _rename(key: str, table: dict[str, str], what: str) -> str:
    prefix = max((p for p in table if key.startswith(p)), key=len, default=None)
    if prefix is None:
        raise ValueError(f"tensor {what!r} has none of the prefixes this layout maps ({', '.join(table)})")
    return table[prefix] + key[len(prefix):]


def mtp_layer(n: int) -> str:
    return f"model.layers.{n}."


def built_config(target_config: dict) -> dict:
    """The config as transformers builds it from config.json (fields its class fills in included)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in target_config.items() if k != "model_type"}
    return AutoConfig.for_model(target_config["model_type"], **fields).to_dict()


def hf_mtp(target_config: dict) -> Layout:
    n = target_config["num_hidden_layers"]
    p = mtp_layer(n)
    extra = {"num_mtp_layers": 1, "num_nextn_predict_layers": 1}
    if built_config(target_config).get("layer_types"):  # get_mtp_config refuses layer_types without
        extra["mtp_layer_types"] = ["full_attention"]  # mtp_layer_types (Qwen2/3 configs fill layer_types in)
    return Layout(HF_MTP, {**{f"{part}.": f"{p}{part}." for part in MTP_PARTS}, "mtp_block.": p},
                  config=extra)


def nextn(target_config: dict) -> Layout:
    n = target_config["num_hidden_layers"]
    p = mtp_layer(n)
    renames = {**{f"{part}.": f"{p}{part}." for part in MTP_PARTS[:3]}, "post_norm.": f"{p}shared_head.norm.",
               "mtp_block.": p}
    shared = {f"{p}embed_tokens.weight": "model.embed_tokens.weight",
              f"{p}shared_head.head.weight": "lm_head.weight"}
    # vLLM builds layer N with DeepseekV2DecoderLayer, which is MoE when N >= first_k_dense_replace; the
    # head's MLP is dense, so this directory's config makes layer N dense (the target's config is untouched).
    config = {"num_nextn_predict_layers": 1, "n_predict": 1, "first_k_dense_replace": n + 1,
              "architectures": ["DeepSeekMTPModel"]}
    return Layout(NEXTN, renames, shared, config)


def deepseek_eagle(target_config: dict) -> Layout:
    """vLLM's `EagleDeepSeekMTPModel` (deepseek_eagle.py): the head as an EAGLE draft of a DeepSeek target."""
    n = target_config["num_hidden_layers"]
    renames = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "fc.", "post_norm.": "norm.",
               "mtp_block.": "layers.0."}  # its nn.ModuleList's index; the layer's own prefix (MoE or not) is N
    config = {"architectures": ["EagleDeepSeekMTPModel"], "num_hidden_layers": 1, "first_k_dense_replace": n + 1}
    return Layout(DEEPSEEK_EAGLE, renames, config=config)


def vllm_mtp(target_config: dict, draft_vocab: int = 0) -> Layout:
    """Our plugin's layout: the head's own key names; `d2t` (offsets) when it drafts over a draft vocabulary."""
    config = {"architectures": [VLLM_MTP_ARCH], "num_hidden_layers": 1}
    if built_config(target_config).get("layer_types"):
        config["layer_types"] = ["full_attention"]  # one layer; the head attends without a sliding window
    if draft_vocab:
        config["draft_vocab_size"] = draft_vocab
    renames = {**{f"{part}.": f"{part}." for part in MTP_PARTS}, "mtp_block.": "mtp_block."}
    return Layout(VLLM_MTP, {**renames, **({"d2t": "d2t"} if draft_vocab else {})}, config=config)


def eagle(target_config: dict, engine: str, attention_bias: bool = False) -> Layout:
    arch = {"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}[engine]
    config = {"num_hidden_layers": 1, "architectures": [arch]}
    if attention_bias:
        config["attention_bias"] = True
    return Layout(f"{EAGLE}-{engine}", {"fc.": "fc.", "mtp_block.": "layers.0."}, config=config)


def fold_fc_bias(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An eagle1 state dict without `fc.bias` that computes the same function, for vLLM's bias-free `fc`.

    The layer has no input norm, so fc's bias b reaches the attention projections and the residual as is:
    q/k/v(u + b) = q/k/v(u) + W_{q,k,v} b (rotary comes after the projection), and the residual's + b is
    carried by o_proj's bias. Needs `attention_bias` in the config (vLLM's Llama layer then gives q, k, v and
    o a bias each)."""
    out = dict(state)
    b = out.pop("fc.bias")
    for name in ("q_proj", "k_proj", "v_proj"):
        w = out[f"mtp_block.self_attn.{name}.weight"]
        key = f"mtp_block.self_attn.{name}.bias"
        out[key] = out.get(key, torch.zeros(w.shape[0], dtype=w.dtype)) + w @ b
    key = "mtp_block.self_attn.o_proj.bias"
    out[key] = out.get(key, torch.zeros_like(b)) + b
    return out


def exported_config(target_config: dict, layout: Layout, dtype: str) -> dict:
    """The target's config.json with the layout's fields; the dtype under the key the target uses
    (`torch_dtype` in configs written before transformers 5)."""
    key = "torch_dtype" if "torch_dtype" in target_config else "dtype"
    return {**target_config, **layout.config, key: dtype}
