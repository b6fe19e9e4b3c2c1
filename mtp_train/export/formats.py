"""What each export format writes and the writing itself: the directories of a format (`layout_jobs`), each
staged, read back and checked against the trained head before it replaces anything, with its model card and
`export.json` (`write_format`). The export stage (`run.py`) and the vLLM validation (`mtp_train/validate/vllm.py`,
which serves the head's own export) both write through `export_head`.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
import yaml
from transformers import AutoConfig

from mtp_train import __version__
from mtp_train.export import eagle3, layouts
from mtp_train.export.card import CardInputs, model_card
from mtp_train.export.config import DTYPES, EAGLE, EAGLE3, HF_MTP, NEXTN, VLLM_MTP, ExportConfig
from mtp_train.export.engine_check import card_addendum
from mtp_train.export.layouts import VLLM_MTP_FAMILIES
from mtp_train.export.write import (CARD, EXPORT_JSON, WEIGHTS, check_replaceable, check_round_trip, is_up_to_date,
                                    listing, read_back, save_weights, staged, stitch)
from mtp_train.files import sha256_file, space_for, write_atomic, write_json
from mtp_train.model.checkpoint import read_head
from mtp_train.model.frozen import read_tensors
from mtp_train.model.head import DRAFT_VOCAB_BUFFERS
from mtp_train.model.target import check_model_dir, target_fingerprint


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


def layout_jobs(fmt: str, state: dict, target_dir: Path, target_config: dict, dtype: str, head=None) -> list[tuple]:
    """(directory name, layout, writer(tmp), exact) for each directory the format writes; `state` is the head's
    in fp32 (a folded bias is computed before rounding to `dtype`)."""
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


def export_command(recipe: str, run_dir: str, fmt: str, export: ExportConfig) -> str:
    """The `mtp-train export` command that writes this export, as its model card quotes it."""
    return " ".join([f"mtp-train export recipe={recipe} run_dir={run_dir} format={fmt}",
                     *([f"dtype={export.dtype}"] if export.dtype != "auto" else []),
                     *([f"checkpoint={export.checkpoint}"] if export.checkpoint else [])])


def export_head(run_config, root: Path) -> tuple[list[Path], CardInputs]:
    """Write the export directories of `run_config.export.format` under `root` -> (their paths, the card's
    inputs). `run_config` is the run's config: its run_dir, target, recipe and export settings are read."""
    e = run_config.export
    target_dir = check_model_dir(run_config.target.path)
    target_config = json.loads((target_dir / "config.json").read_text())
    head, meta = read_head(run_config, Path(e.checkpoint) if e.checkpoint else None)
    fmt = choose_format(e.format, meta["variant"], target_config.get("model_type"))
    dtype = export_dtype(e.dtype, target_config)
    # fp32; `head` becomes the reference: its weights rounded to `dtype`, computing in fp32. Only the EAGLE-3
    # layouts and vllm-mtp carry a draft vocabulary (the cards say so); the round trip compares ĥ, and the draft
    # ids where the layout carries them.
    state = {k: v for k, v in head.state_dict().items()
             if k not in DRAFT_VOCAB_BUFFERS or fmt in (EAGLE3, HF_MTP, VLLM_MTP)}
    head = head.to(getattr(torch, dtype)).float()
    command = export_command(run_config.recipe, run_config.run_dir, fmt, e)
    card = card_inputs(run_config.run_dir, command, run_config.recipe, Path(meta["checkpoint"]), meta, target_dir,
                       target_config, dtype)
    jobs = [(*job, (root / job[0]), identity(job[0], job[1], card))
            for job in layout_jobs(fmt, state, target_dir, target_config, dtype, head)]
    # every directory of the format is checked before any is written: never a new hf-mtp beside an old stitched one
    for _, _, _, _, out, ident in jobs:
        check_replaceable(out, ident, e.overwrite)
    written = []
    needed = sum(v.numel() for v in state.values()) * torch.finfo(getattr(torch, dtype)).bits // 8 + (1 << 20)
    for name, layout, write, exact, out, ident in jobs:
        written.append(out)
        write_directory(out, name, layout, write, exact, ident, head, fmt, card, needed, written[:-1], target_dir)
    return written, card


def card_inputs(run_dir: str, command: str, recipe: str, ckpt: Path, meta: dict, target_dir: Path,
                target_config: dict, dtype: str) -> CardInputs:
    """What the model cards say: the checkpoint's resolved config, the data manifest and the validation report
    (read from their files: export never runs a validation)."""
    resolved = (yaml.safe_load((ckpt / "config.yaml").read_text()) if (ckpt / "config.yaml").is_file() else None) or {}
    return CardInputs(recipe=resolved.get("recipe", recipe), run_dir=run_dir, command=command,
                      checkpoint=str(ckpt), meta=meta, target_path=str(target_dir.resolve()),
                      target_config=target_config, config_sha256=sha256_file(target_dir / "config.json"),
                      fingerprint=target_fingerprint(target_dir), dtype=dtype, train=resolved.get("train", {}),
                      manifest=_read_json(Path(run_dir) / "data" / "manifest.json"),
                      report=_read_json(Path(run_dir) / "validation" / "report.json"))


def identity(name: str, layout, card: CardInputs) -> str:
    """What a directory's weights are made from, hashed: the exporter's own version and layout tables too (a fixed
    layout is written again, not "up to date"); the card's figures (report, manifest) may change without it."""
    made_by = {"layout": name, "exporter": __version__, "renames": layout.renames,
               "target_tensors": layout.target_tensors, "config": layout.config}
    inputs = {"dtype": card.dtype, "head": sha256_file(Path(card.checkpoint) / "head.safetensors"),
              "meta": {k: v for k, v in card.meta.items() if k != "checkpoint"}, "target": card.fingerprint,
              "target_path": card.target_path}
    return hashlib.sha256(json.dumps({**made_by, **inputs}, sort_keys=True).encode()).hexdigest()


def write_directory(out: Path, name: str, layout, write, exact: bool, ident: str, head, fmt: str, card: CardInputs,
                    needed: int, done: list[Path], target_dir: Path) -> None:
    """One export directory: left as it is when up to date (its card refreshed), else staged, written, read back
    and checked against `head`, with its card and export.json, then moved into place."""
    if is_up_to_date(out, ident):
        text = model_card(name, out, listing(out), card) + card_addendum(out)
        if (out / CARD).is_file() and (out / CARD).read_text() == text:
            print(f"export: {out} is up to date (same checkpoint, target and dtype); nothing to do")
        else:  # same weights, newer figures (validation report, data manifest)
            write_atomic(out / CARD, text)
            print(f"export: {out} holds this head already; its model card is updated")
        return
    t0 = time.perf_counter()
    names = [p.name for p in done]
    kept = ((f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} written and intact; " if names else "")
            + (f"the earlier {out.name} is untouched" if out.exists() else f"nothing was written to {out}"))
    with space_for(out, needed, "export", kept), staged(out) as tmp:  # a full disk: staged removes tmp
        write(tmp)
        if fmt == EAGLE3:  # each engine's reading of the files: ids, offsets, norm placement
            eagle3.check_engine_round_trip(head, tmp, name, AutoConfig.from_pretrained(target_dir))
        else:
            check_round_trip(head, read_back(tmp, layout, card.meta["variant"]), exact, out)
        write_atomic(tmp / CARD, model_card(name, out, listing(tmp), card))
        write_json(tmp / EXPORT_JSON, {"identity": ident, "layout": name, "format": fmt, "dtype": card.dtype,
                                       "checkpoint": card.checkpoint, "step": card.meta["step"],
                                       "target_path": card.target_path, "target_fingerprint": card.fingerprint})
    own = sum(p.stat().st_size for p in out.iterdir() if not p.is_symlink())
    links = sum(p.is_symlink() for p in out.iterdir())
    print(f"export: wrote {out} ({own / 2**20:,.1f} MiB{f', {links} target files linked' if links else ''}; "
          f"read back and checked against the trained head) in {time.perf_counter() - t0:.1f} s")
