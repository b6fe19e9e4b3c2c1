"""`mtp-train export`: the trained head in the layouts serving engines load (DESIGN §7).

    mtp-train export recipe=tiny run_dir=runs/demo [format=auto|hf-mtp|vllm-mtp|eagle|eagle3|deepseek-nextn]
                     [checkpoint=DIR] [dtype=auto|bf16|fp16|fp32] [overwrite=true]

| format           | head, target           | writes under run_dir/export/                                    |
|------------------|------------------------|-----------------------------------------------------------------|
| `hf-mtp`         | `mtp`, Llama / Qwen    | `hf-mtp/` (the head alone as MTP layer N) and `hf-mtp-stitched/` |
|                  |                        | (the target, linked, plus the head: transformers `use_mtp=True`) |
| `eagle`          | `eagle1`, Llama        | `eagle-vllm/` and `eagle-sglang/` (the engines' EAGLE-1 loaders) |
| `deepseek-nextn` | `mtp`, DeepSeek-V2     | `deepseek-nextn/` (DeepSeek-V3's NextN keys) and `deepseek-eagle/` (vLLM's `EagleDeepSeekMTPModel`) |
| `eagle3`         | `eagle3`, any          | `eagle3/` (vLLM's and SGLang's EAGLE-3 loaders) and               |
|                  |                        | `eagle3-speculators/` (vLLM's speculators format); `eagle3.py`   |
| `vllm-mtp`       | `mtp`, Llama / Qwen    | `vllm-mtp/` (vLLM with our plugin, serving/vllm_plugin: method   |
|                  |                        | `eagle`); also written by `hf-mtp` (and `auto`) for these targets |

`auto` picks the one that fits the head and the target. Key names and config fields per layout, and the
loader files they follow, are in `layouts.py`. Every directory is read back into a `DraftHead` and must
reproduce the trained head's output before it replaces anything, and gets a model card (`card.py`).

A head trained with a draft vocabulary (`head.draft_vocab`) is exported without it except in the EAGLE-3
layouts and `vllm-mtp` (`d2t`, applied by the plugin's compute_logits): the others have none (their engines draft with the target's full lm_head), so `d2t` / `t2d` are left
out and the card says so. The EAGLE-3 directories are read back by loaders that follow each engine
(`eagle3.read_engine`) and must give the trained head's logits over the target vocabulary exactly.

`engine_check.py` serves an export in vLLM (its own venv) beside our engine on the run's held-out prompts and
adds the side-by-side acceptance to the card (`python -m mtp_train.export.engine_check --help`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mtp_train import __version__
from mtp_train.export.eagle3 import EAGLE3
from mtp_train.export.layouts import EAGLE, HF_MTP, NEXTN, VLLM_MTP, VLLM_MTP_FAMILIES

if TYPE_CHECKING:
    from mtp_train.config import RunConfig

FORMATS = ("auto", HF_MTP, VLLM_MTP, EAGLE, EAGLE3, NEXTN)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class ExportConfig:
    format: str = "auto"  # auto | hf-mtp | vllm-mtp | eagle | eagle3 | deepseek-nextn (auto: what fits head, target)
    checkpoint: str | None = None  # a checkpoint directory (run_dir/checkpoints/step-N); none: the latest
    dtype: str = "auto"  # auto (the target's config.json dtype) | bf16 | fp16 | fp32
    overwrite: bool = False  # replace export directories made from other inputs

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"export.format={self.format!r}: expected one of {', '.join(FORMATS)}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"export.dtype={self.dtype!r}: expected auto, {', '.join(DTYPES)}")


def choose_format(requested: str, variant: str, model_type: str) -> str:
    """The format to write, or an error that says why this head or target cannot have the one asked for."""
    fmt = requested
    if fmt == "auto":
        fmt = EAGLE if variant == "eagle1" else EAGLE3 if variant == "eagle3" else \
            NEXTN if model_type == "deepseek_v2" else HF_MTP
    if (fmt == EAGLE3) != (variant == "eagle3"):
        raise ValueError(f"format={fmt} is for {'eagle3' if fmt == EAGLE3 else 'mtp and eagle1'} heads; this head is "
                         f"{variant!r}: use format={'eagle3' if variant == 'eagle3' else 'auto'}")
    if fmt == EAGLE and variant != "eagle1":
        raise ValueError("format=eagle is for eagle1 heads; this head is `mtp`, and its maths differ: it normalises "
                         "the embedding and the hidden state before eh_proj (enorm, hnorm), keeps its layer's input "
                         "norm and normalises its output (post_norm), while EAGLE-1 loaders compute fc([E x; h]) "
                         "into a layer without input norm and no final norm. Use format=hf-mtp, or train with "
                         "head.variant=eagle1")
    if fmt in (HF_MTP, NEXTN, VLLM_MTP) and variant != "mtp":
        hint = "use format=eagle" if model_type == "llama" else \
            (f"no layout here serves an eagle1 head on a {model_type!r} target (eagle is Llama-only): train with "
             "head.variant=mtp")
        raise ValueError(f"format={fmt} is for mtp heads (enorm, hnorm, eh_proj, post_norm); this head is "
                         f"{variant!r}: {hint}")
    if fmt == NEXTN and model_type != "deepseek_v2":
        raise ValueError(f"format=deepseek-nextn is the MTP layout of DeepSeek models (vLLM's DeepSeekMTPModel); "
                         f"this target is {model_type!r}: use format=hf-mtp")
    if fmt == HF_MTP and model_type == "deepseek_v2":
        raise ValueError("format=hf-mtp cannot carry this head: transformers builds the MTP layers of DeepSeek "
                         "models with the MoE MLP (get_mtp_config sets first_k_dense_replace=0) and this head's MLP "
                         "is dense; use format=deepseek-nextn (vLLM)")
    if fmt == VLLM_MTP and model_type not in VLLM_MTP_FAMILIES:
        hint = "use format=deepseek-nextn" if model_type == "deepseek_v2" else "use format=hf-mtp"
        raise ValueError(f"format=vllm-mtp is read by our vLLM plugin, which builds the head's layer for "
                         f"{', '.join(VLLM_MTP_FAMILIES)} targets; this target is {model_type!r}: {hint}")
    if fmt == EAGLE and model_type != "llama":
        raise ValueError(f"format=eagle writes the EAGLE-1 layout of vLLM's and SGLang's Llama loaders "
                         f"(llama_eagle.py); this target is {model_type!r}")
    return fmt


def export_dtype(requested: str, target_config: dict) -> str:
    """bfloat16 / float16 / float32: as asked, or the dtype the target's config.json names (float32 when it
    names none)."""
    if requested != "auto":
        return DTYPES[requested]
    named = target_config.get("dtype") or target_config.get("torch_dtype") or "float32"
    return named if named in DTYPES.values() else "float32"


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _jobs(fmt: str, state: dict, target_dir: Path, target_config: dict, dtype: str, head=None) -> list[tuple]:
    """(directory name, layout, writer(tmp), exact) for each directory the format writes; `state` is the head's
    in fp32 (a folded bias is computed before rounding to `dtype`)."""
    import torch

    from mtp_train.export import layouts
    from mtp_train.export.write import WEIGHTS, save_weights, stitch
    from mtp_train.files import write_json
    from mtp_train.model.frozen import read_tensors
    from mtp_train.model.head import DRAFT_VOCAB_BUFFERS

    def cast(tensors: dict) -> dict:
        return {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}

    def plain(layout, tensors: dict):
        def write(tmp: Path) -> None:
            save_weights(cast(tensors), tmp / WEIGHTS)
            write_json(tmp / "config.json", layouts.exported_config(target_config, layout, dtype))
        return write

    def vllm_mtp():  # our vLLM plugin's layout, d2t included (int64: not cast)
        layout = layouts.vllm_mtp(target_config, int(state["d2t"].numel()) if "d2t" in state else 0)
        tensors = layout.to_export({k: v for k, v in state.items() if k != "t2d"})

        def write(tmp: Path) -> None:
            save_weights({k: v if k == "d2t" else v.to(getattr(torch, dtype)) for k, v in tensors.items()},
                         tmp / WEIGHTS)
            write_json(tmp / "config.json", layouts.exported_config(target_config, layout, dtype))
        return (VLLM_MTP, layout, write, True)

    if fmt == VLLM_MTP:
        return [vllm_mtp()]
    if fmt == HF_MTP:
        layout = layouts.hf_mtp(target_config)
        tensors = layout.to_export({k: v for k, v in state.items() if k not in DRAFT_VOCAB_BUFFERS})
        # the stitched config keeps the target's dtype: it is the dtype the whole model loads in (`dtype="auto"`),
        # and transformers casts the MTP layer to the main model's dtype anyway
        config = {**target_config, **layout.config}
        return [("hf-mtp", layout, plain(layout, tensors), True),
                ("hf-mtp-stitched", layout, lambda tmp: stitch(tmp, target_dir, cast(tensors), config), True),
                *([vllm_mtp()] if target_config.get("model_type") in VLLM_MTP_FAMILIES else [])]
    if fmt == EAGLE:
        folded = "fc.bias" in state
        vllm = layouts.eagle(target_config, "vllm", attention_bias=folded)
        sglang = layouts.eagle(target_config, "sglang")
        biased = state if folded else {**state, "fc.bias": torch.zeros(state["fc.weight"].shape[0],
                                                                       dtype=state["fc.weight"].dtype)}
        return [("eagle-vllm", vllm, plain(vllm, vllm.to_export(layouts.fold_fc_bias(state) if folded else state)),
                 not folded),
                ("eagle-sglang", sglang, plain(sglang, sglang.to_export(biased)), True)]
    if fmt == EAGLE3:
        from mtp_train.export import eagle3

        made = eagle3.configs(head, target_config, str(target_dir.resolve()), dtype)
        return [(name, eagle3.layout(name, made[name]),
                 lambda tmp, name=name: eagle3.write(tmp, name, state, made[name], getattr(torch, dtype)), True)
                for name in (eagle3.EAGLE3, eagle3.EAGLE3_SPECULATORS)]
    layout = layouts.nextn(target_config)
    shared = read_tensors(target_dir, sorted(set(layout.target_tensors.values())))
    embed = shared["model.embed_tokens.weight"]
    tensors = {**layout.to_export(state),
               **{k: shared.get(src, embed) for k, src in layout.target_tensors.items()}}
    eagle = layouts.deepseek_eagle(target_config)  # what vLLM serves (method eagle), beside the NextN keys
    return [(NEXTN, layout, plain(layout, tensors), True),
            (layouts.DEEPSEEK_EAGLE, eagle, plain(eagle, eagle.to_export(state)), True)]


def run(cfg: "RunConfig", root: Path | None = None) -> list[Path]:
    """Write the export directories of `cfg.export.format` under `root` (default `run_dir/export`); returns
    their paths."""
    import torch
    import yaml

    from mtp_train.export.card import CardInputs, model_card
    from mtp_train.export.engine_check import card_addendum
    from mtp_train.export.write import (CARD, EXPORT_JSON, check_replaceable, check_round_trip, is_up_to_date,
                                        listing, read_back, staged)
    from mtp_train.files import space_for, write_atomic, write_json
    from mtp_train.model.checkpoint import read_head
    from mtp_train.model.head import DRAFT_VOCAB_BUFFERS
    from mtp_train.model.target import check_model_dir, target_fingerprint
    from mtp_train.files import sha256_file

    e, run_dir = cfg.export, Path(cfg.run_dir)
    target_dir = check_model_dir(cfg.target.path)
    target_config = json.loads((target_dir / "config.json").read_text())
    head, meta = read_head(cfg, Path(e.checkpoint) if e.checkpoint else None)
    fmt = choose_format(e.format, meta["variant"], target_config.get("model_type"))
    dtype = export_dtype(e.dtype, target_config)
    # fp32; `head` becomes the reference: its weights rounded to `dtype`, computing in fp32. Only the EAGLE-3
    # layouts and vllm-mtp carry a draft vocabulary (the cards say so); the round trip compares ĥ, and the draft
    # ids where the layout carries them.
    state = {k: v for k, v in head.state_dict().items()
             if k not in DRAFT_VOCAB_BUFFERS or fmt in (EAGLE3, HF_MTP, VLLM_MTP)}
    head = head.to(getattr(torch, dtype)).float()
    ckpt = Path(meta["checkpoint"])
    report_path, manifest_path = run_dir / "validation" / "report.json", run_dir / "data" / "manifest.json"
    fingerprint = target_fingerprint(target_dir)
    # what the weights are made from; the card's figures (report, manifest) may change without a new export
    inputs = {"dtype": dtype, "head": sha256_file(ckpt / "head.safetensors"),
              "meta": {k: v for k, v in meta.items() if k != "checkpoint"}, "target": fingerprint,
              "target_path": str(target_dir.resolve())}
    resolved = (yaml.safe_load((ckpt / "config.yaml").read_text()) if (ckpt / "config.yaml").is_file() else None) or {}
    command = " ".join([f"mtp-train export recipe={cfg.recipe} run_dir={cfg.run_dir} format={fmt}",
                        *([f"dtype={e.dtype}"] if e.dtype != "auto" else []),
                        *([f"checkpoint={e.checkpoint}"] if e.checkpoint else [])])
    card = CardInputs(recipe=resolved.get("recipe", cfg.recipe), run_dir=cfg.run_dir, command=command,
                      checkpoint=str(ckpt), meta=meta, target_path=str(target_dir.resolve()),
                      target_config=target_config,
                      config_sha256=sha256_file(target_dir / "config.json"), fingerprint=fingerprint, dtype=dtype,
                      train=resolved.get("train", {}), manifest=_read_json(manifest_path),
                      report=_read_json(report_path))
    jobs = []
    for name, layout, write, exact in _jobs(fmt, state, target_dir, target_config, dtype, head):
        out = (root or run_dir / "export") / name
        # the exporter's own version and layout tables too: a fixed layout is written again, not "up to date"
        made_by = {"layout": name, "exporter": __version__, "renames": layout.renames,
                   "target_tensors": layout.target_tensors, "config": layout.config}
        identity = hashlib.sha256(json.dumps({**made_by, **inputs}, sort_keys=True).encode()).hexdigest()
        jobs.append((name, layout, write, exact, out, identity))
    # every directory of the format is checked before any is written: never a new hf-mtp beside an old stitched one
    for name, _, _, _, out, identity in jobs:
        check_replaceable(out, identity, e.overwrite)
    written = []
    needed = sum(v.numel() for v in state.values()) * torch.finfo(getattr(torch, dtype)).bits // 8 + (1 << 20)
    for name, layout, write, exact, out, identity in jobs:
        written.append(out)
        if is_up_to_date(out, identity):
            text = model_card(name, out, listing(out), card) + card_addendum(out)
            if (out / CARD).is_file() and (out / CARD).read_text() == text:
                print(f"export: {out} is up to date (same checkpoint, target and dtype); nothing to do")
            else:  # same weights, newer figures (validation report, data manifest)
                write_atomic(out / CARD, text)
                print(f"export: {out} holds this head already; its model card is updated")
            continue
        t0 = time.perf_counter()
        done = [p.name for p in written[:-1]]
        kept = ((f"{', '.join(done)} {'is' if len(done) == 1 else 'are'} written and intact; " if done else "")
                + (f"the earlier {out.name} is untouched" if out.exists() else f"nothing was written to {out}"))
        with space_for(out, needed, "export", kept), staged(out) as tmp:  # a full disk: staged removes tmp
            write(tmp)
            if fmt == EAGLE3:  # each engine's reading of the files: ids, offsets, norm placement
                from transformers import AutoConfig

                from mtp_train.export.eagle3 import check_engine_round_trip

                check_engine_round_trip(head, tmp, name, AutoConfig.from_pretrained(target_dir))
            else:
                check_round_trip(head, read_back(tmp, layout, meta["variant"]), exact, out)
            write_atomic(tmp / CARD, model_card(name, out, listing(tmp), card))
            write_json(tmp / EXPORT_JSON, {"identity": identity, "layout": name, "format": fmt, "dtype": dtype,
                                           "checkpoint": str(ckpt), "step": meta["step"],
                                           "target_path": str(target_dir.resolve()), "target_fingerprint": fingerprint})
        own = sum(p.stat().st_size for p in out.iterdir() if not p.is_symlink())
        links = sum(p.is_symlink() for p in out.iterdir())
        print(f"export: wrote {out} ({own / 2**20:,.1f} MiB{f', {links} target files linked' if links else ''}; "
              f"read back and checked against the trained head) in {time.perf_counter() - t0:.1f} s")
    if card.report:
        from mtp_train.validate import format_table

        print(format_table(card.report))
    else:
        print(f"export: no validation report in {report_path.parent} (run mtp-train validate); the model cards "
              "say so")
    return written
