"""The EAGLE-3 exports of an `eagle3` head, and loaders of ours that read them back the way each engine does.

Two directories (`format=eagle3`):

* `eagle3/`: the layout SpecForge writes and both engines read natively: `fc.weight`, `midlayer.*` (with
  `hidden_norm`), `norm.weight`, `lm_head.weight` [N, H], `d2t` (int64 [N], target id = draft id +
  d2t[draft id]), `t2d` (bool [V]); `config.json` the layers' Llama config (`num_hidden_layers` 1, or
  `head.num_layers`) with `architectures: [LlamaForCausalLMEagle3]`, `draft_vocab_size`, `target_hidden_size`,
  and the aux layers in both engines' conventions:
    - vLLM (`llama_eagle3.py`, the target's `aux_hidden_state_layers`) reads the top-level
      `eagle_aux_hidden_state_layer_ids` and captures the residual *entering* layer i: transformers'
      `hidden_states[i]`, our `head.aux_layers` as they are;
    - SGLang (`model_runner`, `set_eagle3_layers_to_capture`) reads `eagle_config.eagle_aux_hidden_state_layer_ids`
      and adds one before capturing before that layer: its id j is the *output* of layer j, `hidden_states[j + 1]`,
      so it is written as aux - 1.
* `eagle3-speculators/`: vLLM's speculators format (`speculators_model_type: eagle3`): the layer under
  `layers.0.*` (what the speculators converter writes; vLLM reads both), `transformer_layer_config`,
  `speculators_config` naming the verifier, the top-level aux ids (vLLM's convention), and
  `norm_before_residual` written explicitly: vLLM's speculators path takes it as true when it is absent, while
  this head (as SpecForge's and SGLang's) adds the un-normalised `g` to the attention output.

A head with more than one decoder layer (`head.num_layers` n > 1) writes its further layers under `layers.1` ..
`layers.{n-1}` (plain Llama layers, H wide) and `num_hidden_layers: n` in both directories: vLLM's `llama_eagle3`
builds and loads that many; SGLang's EAGLE-3 refuses any count but one, so such a head is exported for vLLM only.

The head's norm options (`head.norm_before_residual`; `head.norm_before_fc`: `input_norm.weight`, k·H wide;
`head.norm_output`: the chain feeds norm(z) back) are written in both directories for vLLM, which reads all three
in both formats. SGLang's EAGLE-3 layer has none of them: a head trained with any is exported for vLLM only
(`engines`), and the card says so.

`read_engine` reads a directory as one engine does (the ids in its convention, `d2t` as offsets, the norm options
with the engine's defaults) into a `DraftHead`; `check_engine_round_trip` runs it
and the trained head on the same target hidden states (every layer's, so a shifted layer id reads another
one) and compares the logits over the whole target vocabulary (so a wrong `d2t` puts them on other ids), at the
first step and at a second one fed the first's output.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mtp_train.export.config import EAGLE3, EAGLE3_SPECULATORS
from mtp_train.export.layouts import Layout
from mtp_train.export.write import WEIGHTS, save_weights
from mtp_train.files import write_json
from mtp_train.model.frozen import read_tensors
from mtp_train.model.head import DraftHead, HeadConfig, additive_mask, eagle3_layer_config

ENGINES = {EAGLE3: ("vllm", "sglang"), EAGLE3_SPECULATORS: ("vllm",)}
HEAD_KEYS = ("fc.", "input_norm.", "midlayer.", "layers.", "norm.", "lm_head.", "d2t", "t2d")
SPECULATIVE_TOKENS = 3  # speculators_config's default proposal (vLLM's `num_speculative_tokens` overrides it)


def norms(config: dict) -> dict[str, bool]:
    """The head's norm options as an export's config.json states them (vLLM's reading: a speculators config
    without norm_before_residual means true)."""
    speculators = "speculators_model_type" in config
    nested = config.get("eagle_config") or {}
    return {"norm_before_residual": bool(config.get("norm_before_residual", speculators)),
            "norm_before_fc": bool(nested.get("norm_before_fc", config.get("norm_before_fc", False))),
            "norm_output": bool(config.get("norm_output", False))}


def num_layers(config: dict) -> int:
    """The head's decoder layers as an export's config.json states them (the speculators format in its
    `transformer_layer_config`)."""
    layer = config.get("transformer_layer_config") or config
    return int(layer.get("num_hidden_layers", 1))


def engines(name: str, config: dict) -> tuple[str, ...]:
    """The engines that serve directory `name` with this config: SGLang only a one-layer head without any norm
    option."""
    if any(norms(config).values()) or num_layers(config) != 1:
        return tuple(e for e in ENGINES[name] if e != "sglang")
    return ENGINES[name]


def layer_fields(layer_config) -> dict:
    """The Llama config both layouts describe the head's layers with (`num_hidden_layers`: the head's)."""
    c = layer_config.to_dict()
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "attention_bias",
            "mlp_bias")
    rope = c.get("rope_parameters") or {}
    return {"model_type": "llama", **{k: c[k] for k in keep if k in c}, "num_hidden_layers": c["num_hidden_layers"],
            "vocab_size": c["vocab_size"], "rope_theta": rope.get("rope_theta"), "tie_word_embeddings": False}


def configs(head: DraftHead, target_config: dict, target_path: str, dtype: str) -> dict[str, dict]:
    """config.json of each directory."""
    layer = layer_fields(head.config)
    aux = list(head.aux_layers)
    common = {"draft_vocab_size": head.cfg.draft_vocab, "target_hidden_size": target_config["hidden_size"],
              "norm_before_residual": head.cfg.norm_before_residual, "norm_before_fc": head.cfg.norm_before_fc,
              "norm_output": head.cfg.norm_output}
    native = {**layer, "architectures": ["LlamaForCausalLMEagle3"], **common, "torch_dtype": dtype,
              "eagle_aux_hidden_state_layer_ids": aux,  # vLLM: the residual entering layer i
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux],  # SGLang: output of i-1
                               "use_aux_hidden_state": True, "norm_before_fc": head.cfg.norm_before_fc}}
    speculators = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                   "speculators_version": "0.1.0", **common, "eagle_aux_hidden_state_layer_ids": aux,
                   "torch_dtype": dtype, "transformer_layer_config": {**layer, "torch_dtype": dtype},
                   "speculators_config": {
                       "algorithm": "eagle3", "default_proposal_method": "greedy",
                       "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": SPECULATIVE_TOKENS,
                                             "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                       "verifier": {"name_or_path": target_path,
                                    "architectures": target_config.get("architectures", [])}}}
    return {EAGLE3: native, EAGLE3_SPECULATORS: speculators}


def layout(name: str, config: dict | None = None) -> Layout:
    """The directory's key names: the head's own, with the first layer under `layers.0.` in the speculators
    format (further layers are `layers.1.` ... in both)."""
    layer = "midlayer." if name == EAGLE3 else "layers.0."
    return Layout(name, {**{k: k for k in HEAD_KEYS if k != "midlayer."}, "midlayer.": layer}, config=config or {})


def write(out: Path, name: str, state: dict[str, torch.Tensor], config: dict, dtype: torch.dtype) -> None:
    save_weights({k: v if k in ("d2t", "t2d") else v.to(dtype) for k, v in layout(name).to_export(state).items()},
                 out / WEIGHTS)
    write_json(out / "config.json", config)


# -- reading an export as an engine does -------------------------------------------------------------------
def read_engine(out: Path, engine: str, target_config, drop: tuple[str, ...] = ()) -> DraftHead:
    """The head of an EAGLE-3 directory as `engine` (vllm / sglang) reads it, in its dtype: its aux layers as
    transformers' hidden_states indices, draft ids mapped by d2t as offsets, the norm options as config.json
    states them (`norms`; vLLM's speculators path takes an absent norm_before_residual as true). SGLang has none of
    the options: it reads them as false and leaves `input_norm.weight` unread. `drop`: key prefixes to leave
    unread (a peer's export may carry its copy of the target's embedding, `embed_tokens.`)."""
    config = json.loads((out / "config.json").read_text())
    speculators = "speculators_model_type" in config
    options = norms(config)
    if engine == "sglang":
        if speculators:
            raise ValueError(f"{out}: SGLang does not read the speculators format")
        if num_layers(config) != 1:
            raise ValueError(f"{out}: SGLang's EAGLE-3 serves one decoder layer, this head has {num_layers(config)}")
        ids = [j + 1 for j in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        options = {k: False for k in options}  # SGLang's layer has none of the options
    else:
        ids = list(config["eagle_aux_hidden_state_layer_ids"])
    layer = config["transformer_layer_config"] if speculators else config
    from safetensors import safe_open

    with safe_open(str(out / WEIGHTS), framework="pt") as f:
        keys = [k for k in f.keys() if not k.startswith(drop)] if drop else list(f.keys())
    try:
        state = layout(EAGLE3_SPECULATORS if speculators else EAGLE3).to_head(read_tensors(out, keys))
    except ValueError as e:
        raise ValueError(f"{out}: {e}; they are not part of an EAGLE-3 head ({engine} would drop them)") from None
    n = int(config["draft_vocab_size"])
    cfg = HeadConfig(variant="eagle3", draft_vocab=n, aux_layers=ids, num_layers=num_layers(config), **options)
    head = DraftHead(target_config, cfg)
    built = layer_fields(eagle3_layer_config(target_config, cfg))
    if layer.get("rope_theta") is None:  # transformers 5 configs (a peer's) may state it only in rope_parameters
        layer = {**layer, "rope_theta": (layer.get("rope_parameters") or {}).get("rope_theta")}
    wrong = {k: (layer.get(k), v) for k, v in built.items()
             if k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "rms_norm_eps", "rope_theta") and layer.get(k) != v}
    if wrong:
        raise ValueError(f"{out}/config.json describes another layer than the head's: "
                         + ", ".join(f"{k} {a} (the head: {b})" for k, (a, b) in wrong.items()))
    if engine == "sglang":
        state = {k: v for k, v in state.items() if not k.startswith("input_norm.")}
    d2t = state.pop("d2t").long()
    t2d = state.pop("t2d", None)
    target_ids = d2t + torch.arange(n)  # both engines: target id = draft id + d2t[draft id]
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= target_config.vocab_size:
        raise ValueError(f"{out}: d2t maps draft ids outside the target's vocabulary (d2t must hold offsets)")
    head.set_draft_vocab(target_ids)
    if t2d is not None and not torch.equal(t2d.bool(), head.t2d):
        raise ValueError(f"{out}: t2d does not mark the target ids d2t maps to")
    try:
        head.load_state_dict({**state, "d2t": head.d2t, "t2d": head.t2d})
    except RuntimeError as e:
        raise ValueError(f"{out} does not hold an eagle3 head of this shape: {' '.join(str(e).split())}") from None
    # in the exported dtype, as `write.read_back` returns heads (the comparison runs both sides in fp32)
    return head.to(state["fc.weight"].dtype).eval().requires_grad_(False)


def engine_logits(head: DraftHead, target_hidden: list[torch.Tensor], embeds: torch.Tensor) -> torch.Tensor:
    """Logits over the whole target vocabulary [2, T, V] (-inf outside the draft vocabulary) of the head's first
    step on target hidden states `target_hidden` (transformers' hidden_states: one [T, H] per index) and token
    embeddings [T, H], and of a second step fed the first step's output (what the chain feeds back: `norm_output`
    shows only there), as an engine computes them."""
    features = torch.cat([target_hidden[i] for i in head.aux_layers], dim=-1)[None]
    T = embeds.shape[0]
    mask = additive_mask(torch.ones(T, T, dtype=torch.bool).tril()[None, None], torch.float32)
    positions = torch.arange(1, T + 1)[None]
    with torch.no_grad():
        z1 = head(embeds[None], head.fuse(features), positions, mask)
        z2 = head(embeds.roll(-1, 0)[None], z1, positions + 1, mask)
        draft = torch.cat([head.readout(z1), head.readout(z2)]) @ head.lm_head.weight.T
    out = torch.full((2, T, head.t2d.shape[0]), float("-inf"))
    out[..., head.draft_ids] = draft
    return out


def check_engine_round_trip(reference: DraftHead, out: Path, name: str, target_config, tokens: int = 8) -> None:
    """Each engine's reading of `out` gives the trained head's logits exactly (fp32 on both sides; `reference`
    holds the trained weights rounded to the export dtype), on fixed random inputs."""
    g = torch.Generator().manual_seed(0)
    H, L = reference.hidden_size, target_config.num_hidden_layers
    target_hidden = list(torch.randn(L + 1, tokens, H, generator=g))
    embeds = torch.randn(tokens, H, generator=g)
    want = engine_logits(reference.float(), target_hidden, embeds)
    for engine in engines(name, json.loads((out / "config.json").read_text())):
        try:
            back = read_engine(out, engine, target_config)
        except (KeyError, ValueError) as e:
            raise ValueError(f"the {name} export in {out} cannot be read as {engine} reads it: {e}") from None
        got = engine_logits(back.float(), target_hidden, embeds)
        if not torch.equal(got, want):
            differ = (got != want).any(-1).sum(-1).tolist()
            raise ValueError(f"the {name} export in {out}, read as {engine} reads it, does not reproduce the trained "
                             f"head: logits differ at {differ[0]} of {tokens} positions of the first step and "
                             f"{differ[1]} of the second (aux layer ids, d2t or the norm options)")
