"""`mtp-train info`: a pre-flight look at a recipe's target (and draft LM) before any stage runs.

It reads the architecture the head will be derived from out of `config.json`, checks that the tokenizer
fits the model, and (unless `info.generate=false`) loads the model and decodes a prompt greedily, so a
wrong path, a mismatched tokenizer or a model that does not load shows up before hours of precompute.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mtp_train.model.config import InfoConfig
from mtp_train.model.target import TargetArch, check_draft_tokenizer, load_causal_lm, load_tokenizer

if TYPE_CHECKING:
    from mtp_train.config import RunConfig


def _check_tokenizer(tokenizer, arch: TargetArch, path: str, what: str) -> None:
    if len(tokenizer) > arch.vocab_size:
        raise ValueError(f"{what} tokenizer at {path} has {len(tokenizer)} tokens but the model's vocab_size is "
                         f"{arch.vocab_size}: the tokenizer does not belong to this model")


def _prompt_ids(tokenizer, cfg: InfoConfig) -> torch.Tensor:
    if cfg.chat and tokenizer.chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": cfg.prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    else:
        ids = tokenizer(cfg.prompt)["input_ids"]
    return torch.tensor([ids], dtype=torch.long)


@torch.inference_mode()
def greedy_sample(path: str, tokenizer, run: "RunConfig", what: str) -> dict:
    model = load_causal_lm(path, run.target, what)
    ids = _prompt_ids(tokenizer, run.info).to(model.device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=run.info.max_new_tokens,
                         do_sample=False, pad_token_id=tokenizer.pad_token_id)
    seconds = time.perf_counter() - t0
    new = out[0, ids.shape[1]:]
    return {"prompt_tokens": ids.shape[1], "new_tokens": new.numel(), "tokens_per_s": new.numel() / seconds,
            "parameters": sum(p.numel() for p in model.parameters()),
            "text": tokenizer.decode(new, skip_special_tokens=True)}


def run(cfg: "RunConfig") -> dict:
    models = {"target": cfg.target.path}
    if cfg.target.draft_path:
        models["draft"] = cfg.target.draft_path
    arch = TargetArch.from_pretrained(cfg.target.path)
    tokenizers = {what: load_tokenizer(path, what) for what, path in models.items()}
    _check_tokenizer(tokenizers["target"], arch, cfg.target.path, "target")
    if "draft" in models:
        check_draft_tokenizer(models["target"], models["draft"], tokenizers["target"], tokenizers["draft"])
    report: dict = {}
    for what, path in models.items():
        tokenizer = tokenizers[what]
        report[what] = {"path": str(Path(path).resolve()), "tokenizer_size": len(tokenizer),
                        "chat_template": bool(tokenizer.chat_template)}
        if what == "target":
            report[what]["architecture"] = arch.as_dict()
        if cfg.info.generate:
            report[what]["sample"] = greedy_sample(path, tokenizer, cfg, what)
    print(format_report(report))
    out = Path(cfg.run_dir) / "info.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return report


def format_report(report: dict) -> str:
    lines = []
    arch = report["target"].get("architecture")
    if arch:
        lines.append(f"target {report['target']['path']}")
        lines.append("  architecture the head is derived from (config.json):")
        for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "intermediate_size", "vocab_size", "rope_theta", "rms_norm_eps",
                    "max_position_embeddings", "tie_word_embeddings"):
            lines.append(f"    {key:<24} {arch[key]}")
        if arch.get("mla"):
            lines.append(f"    {'mla':<24} {arch['mla']}")
    for what, r in report.items():
        lines.append(f"{what}: tokenizer {r['tokenizer_size']} tokens, chat template: {'yes' if r['chat_template'] else 'no'}")
        s = r.get("sample")
        if s:
            lines.append(f"  {s['parameters'] / 1e6:.2f}M parameters; greedy {s['new_tokens']} tokens "
                         f"at {s['tokens_per_s']:.0f} tok/s:")
            lines += ["  | " + line for line in s["text"].splitlines() or [""]]
    return "\n".join(lines)
