"""`mtp-train validate`: how good the trained head is, measured two ways with the code that serves it.

1. Teacher-forced, on the val store: the training objective and its metrics with the same head forward
   (`model.head.unrolled`) and loss (`train.loss.head_loss` through `train.evaluate`): the loss
   terms, top-1 agreement with the target's argmax and expected acceptance Σ min(p, q) per depth.
2. Real speculative decoding (`mtp_train.inference`) on held-out prompts (the run's prepared val split:
   conversations cut where the assistant's turn starts, else the first half of a document): τ, acceptance by
   position, greedy identity and the speed-up over the target alone, timed in rounds (decoding.py says how).

The prompts come in sets (`validate.prompts`): the recipe's own val split, MT-bench's questions, or any JSONL
of conversations (`mtp_train/data/prompt_sets.py`); each set gets its own rounds, table, per-category figures
and prediction.

Writes `run_dir/validation/report.json`, two plots beside it, and prints a table. The steps: teacher_forced.py,
decoding.py (our engine) or vllm.py (`validate.engine=vllm`), report.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mtp_train.data.prompt_sets import PromptSet
from mtp_train.files import sha256_file
from mtp_train.inference.drafters import HeadDrafter
from mtp_train.inference.load import check_drafter, load_draft, load_head_module, stop_tokens
from mtp_train.inference.runner import CausalLMRunner, load_runner
from mtp_train.model.frozen import FrozenTarget
from mtp_train.model.target import load_tokenizer, resolve_device
from mtp_train.validate import vllm
from mtp_train.validate.config import ValidateConfig
from mtp_train.validate.disjoint import check_disjoint
from mtp_train.validate.decoding import SpeedModel, decoding, decoding_settings, load_prompts
from mtp_train.validate.report import write_report
from mtp_train.validate.teacher_forced import teacher_forced

if TYPE_CHECKING:
    from mtp_train.config import RunConfig

SECTION_KEYS = ("name", "decoding", "tree_decoding", "target_only", "decoding_settings")  # the first set's, at the top


def run(cfg: "RunConfig") -> dict:
    v = cfg.validate
    t0 = time.perf_counter()
    check_drafter(cfg, "head")  # before loading any weights: no checkpoint -> "run mtp-train train first"
    names = [d for d in v.drafters if d == "head" or cfg.target.draft_path]
    if "draft" in v.drafters and not cfg.target.draft_path:
        print("validate: target.draft_path is not set, so the draft LM is not compared")
    tokenizer = load_tokenizer(cfg.target.path) if v.num_prompts else None
    sets = prompt_sets(v, Path(cfg.run_dir) / "data", tokenizer)
    if sets:  # refuse dev prompts the head was trained on
        check_disjoint(Path(cfg.run_dir) / "data", tokenizer, sets, [])
    prompts = [p for s in sets for p in s.prompts]
    if not v.teacher_forced and not prompts:
        raise ValueError("nothing to validate: validate.teacher_forced=false and validate.num_prompts=0")
    in_vllm = v.engine == "vllm" and bool(prompts)
    python = vllm.python_for(v, names) if in_vllm else None  # before any weights are loaded
    # real decoding needs the whole target on one device (unless vLLM decodes); the teacher-forced metrics only
    # its E and W
    target = load_runner(cfg.target.path, cfg.target) if prompts and not in_vllm else None
    device = target.device if target is not None else resolve_device(cfg.target.device)
    head, meta = load_head_module(cfg, device, torch.float32)  # fp32 as trained; decoding casts it below
    report = empty_report(meta)
    if v.teacher_forced:
        report.update(teacher_forced_on(cfg, head, target, device))
    if in_vllm:
        sections, keys = vllm.decode_sets(cfg, meta["variant"], sets, python), SECTION_KEYS
    elif prompts:
        sections, keys = decode_sets(cfg, target, head, names, sets, tokenizer), (*SECTION_KEYS, "prediction")
    if prompts:
        report.update({key: sections[0].get(key) for key in keys})
        report["prompt_sets"] = sections  # every set; the first one's figures are also at the top level
    report["config"] = asdict(v)
    report["seconds"] = time.perf_counter() - t0
    write_report(report, Path(cfg.run_dir) / "validation", v.plots)
    return report


def prompt_sets(v: ValidateConfig, data_dir: Path, tokenizer, role: str = "dev", whole: bool = False
                ) -> list[PromptSet]:
    """The dev sets (`validate.prompts`) or the test sets (`validate.test_prompts`), rendered for the target (the
    run's own held-out prompts come from its prepared data in `data_dir`); no dev set without decoding, unless
    `whole` (every prompt of every dev set: what the test report checks its prompts against)."""
    names, n = (v.prompts, v.num_prompts) if role == "dev" else (v.test_prompts, v.test_num_prompts)
    if role == "dev" and not n and not whole:
        return []
    if whole:  # the recipe set is the val split, which the check reads as it is
        names = [x for x in names if x != "recipe"]
    sets = [load_prompts(spec, data_dir, tokenizer, n, v.max_prompt_tokens, role) for spec in names]
    for s in sets:
        if not s.prompts:
            raise ValueError(f"validate prompt set {s.name}: no held-out prompt in {s.line}: no conversation's "
                             f"assistant turn starts within validate.max_prompt_tokens={v.max_prompt_tokens} tokens "
                             "and no document has 4 tokens; raise validate.max_prompt_tokens, or set "
                             "validate.num_prompts=0")
        if n and len(s.prompts) < n:
            print(f"validate: only {len(s.prompts)} held-out prompts of the {n} asked for ({s.line})")
    return sets


def empty_report(meta: dict) -> dict:
    return {"head": {"checkpoint": meta["checkpoint"], "variant": meta["variant"], "step": meta["step"],
                     "depth": meta.get("depth"), "sha256": sha256_file(Path(meta["checkpoint"]) / "head.safetensors")},
            "val_loss": None, "loss_terms_by_depth": [], "accuracy_by_depth": [],
            "expected_acceptance_by_depth": [], "decoding": [], "tree_decoding": [], "target_only": []}


def teacher_forced_on(cfg: "RunConfig", head: torch.nn.Module, target: CausalLMRunner | None,
                      device: torch.device) -> dict:
    """The teacher-forced metrics, with the frozen E and W in the training precision's dtype."""
    frozen_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    if target is not None:  # share the loaded target's tensors (a cast copy only if dtypes differ)
        frozen = FrozenTarget(target.model.get_input_embeddings().weight.to(frozen_dtype),
                              target.lm_head.weight.to(frozen_dtype))
    else:
        frozen = FrozenTarget.from_pretrained(cfg.target.path, frozen_dtype, device)
    return teacher_forced(cfg, head, frozen, device, cfg.validate.depth or cfg.validate.max_k)


def decode_sets(cfg: "RunConfig", target: CausalLMRunner, head: torch.nn.Module, names: list[str], sets: list,
                tokenizer) -> list[dict]:
    """Our engine decodes every prompt set: one report section each, with the speed model's prediction."""
    v = cfg.validate
    drafters = {"head": HeadDrafter(head.to(target.dtype), target.model.get_input_embeddings(), target.lm_head)} \
        if "head" in names else {}
    if "draft" in names:
        drafters["draft"] = load_draft(cfg, target, tokenizer)
    stop = stop_tokens(tokenizer, target)
    speed = SpeedModel(cfg, target, drafters["head"], sets[0].prompts[:v.batch_size]) \
        if v.predict and "head" in drafters else None
    sections = []
    for ps in sets:
        spec, set_prompts, categories, source = ps.name, ps.prompts, ps.categories, ps.line
        print(f"validate: prompt set {spec}: {source}")
        settings = {**decoding_settings(v, cfg.target.dtype, source, set_prompts), "device": str(target.device),
                    "torch_threads": torch.get_num_threads()}
        context = settings["mean_prompt_tokens"] + v.max_new_tokens / 2
        entries, tree_entries, baselines = decoding(
            cfg, target, drafters, set_prompts, stop, categories=categories,
            predict=(lambda e, c=context: speed.row(e, c)) if speed and speed.profile else None)
        section = {"name": spec, "decoding": entries, "tree_decoding": tree_entries, "target_only": baselines,
                   "decoding_settings": settings}
        if speed is not None:
            section["prediction"] = speed.report(entries + tree_entries, context)
        sections.append(section)
    return sections
