"""Writing export directories and checking them.

A directory is built under `.NAME.tmp` beside its final place and renamed when complete, so a reader never
sees half an export. `export.json` in it records what made its weights (layout, dtype, checkpoint, target): an
export made from the same inputs is left alone (only its model card follows a newer validation report or
data manifest); a different non-empty directory is replaced only with `overwrite`.
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

from mtp_train.export.layouts import Layout
from mtp_train.files import replace_dir, write_json
from mtp_train.model.frozen import read_tensors, weight_map
from mtp_train.model.head import DraftHead, HeadConfig, additive_mask

EXPORT_JSON, CARD = "export.json", "README.md"
ENGINE_CHECK = "engine_check.json"  # export/engine_check.py: vLLM beside our engine, quoted in the card
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
HEAD_SHARD = "model-mtp.safetensors"  # the head's shard in a stitched directory


def is_up_to_date(out: Path, identity: str) -> bool:
    """True when `out` holds an export made from the same inputs (its `export.json` has this identity)."""
    try:
        return json.loads((out / EXPORT_JSON).read_text()).get("identity") == identity
    except (OSError, ValueError):
        return False


def check_replaceable(out: Path, identity: str, overwrite: bool) -> None:
    """Refuse to replace a non-empty `out` that holds another export (or none), unless `overwrite`."""
    if not is_up_to_date(out, identity) and out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is not empty and holds another export (another checkpoint, dtype or target, or an "
                         "older exporter, or not an export); pass overwrite=true to replace it, or move it away "
                         "(nothing was written)")


@contextmanager
def staged(out: Path):
    """Yield an empty temporary directory; on success it replaces `out` (`check_replaceable` first)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, out)


def save_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def listing(out: Path) -> list[tuple[str, int]]:
    """(name, bytes) of an export directory's files, links marked, for its card (not the card itself)."""
    return sorted((p.name + (" (link)" if p.is_symlink() else ""), p.stat().st_size)
                  for p in out.iterdir() if p.name not in (CARD, EXPORT_JSON, ENGINE_CHECK))


def stitch(out: Path, target_dir: Path, head_tensors: dict[str, torch.Tensor], config: dict) -> None:
    """`out` becomes the target directory with the head added: every entry of the target linked (its weight
    files are never copied), the head as a new shard, config.json and the weight index rewritten.

    A single-file target is linked as `target-model.safetensors`: next to a `model.safetensors`,
    transformers would load that file alone and never read the index that names the head's shard."""
    target_dir = target_dir.resolve()
    mapping = weight_map(target_dir)  # tensor -> file, from the index or the files themselves
    clash = sorted(set(mapping) & set(head_tensors))
    if clash:
        raise ValueError(f"target {target_dir} already has tensors the head would add ({clash[0]}, ...): it "
                         "carries MTP layers of its own; export the head alone (hf-mtp) instead")
    names = {f.name: f"target-{f.name}" if f.name == WEIGHTS else f.name for f in set(mapping.values())}
    if HEAD_SHARD in names.values():
        raise ValueError(f"target {target_dir} already has a file named {HEAD_SHARD}")
    for entry in sorted(target_dir.iterdir()):
        if entry.name in ("config.json", INDEX, EXPORT_JSON) or entry.name.startswith("."):
            continue
        if entry.name == CARD:  # the export writes its own card: the target's is linked beside it, read-only
            (out / f"target-{CARD}").symlink_to(entry)
            continue
        (out / names.get(entry.name, entry.name)).symlink_to(entry)
    save_weights(head_tensors, out / HEAD_SHARD)
    total = sum(f.stat().st_size for f in set(mapping.values())) + (out / HEAD_SHARD).stat().st_size
    weight_map_out = {k: names[f.name] for k, f in mapping.items()} | {k: HEAD_SHARD for k in head_tensors}
    write_json(out / INDEX, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map_out.items()))})
    write_json(out / "config.json", config)


def read_back(out: Path, layout: Layout, variant: str) -> DraftHead:
    """The head an export directory holds, as a `DraftHead` in the exported dtype (strict: a missing or
    unexpected tensor fails)."""
    from transformers import AutoConfig

    keys = [k for k in weight_map(out) if layout.owns(k) and k not in layout.target_tensors]
    tensors = read_tensors(out, keys)
    state = layout.to_head(tensors)
    dtype = next(v.dtype for v in tensors.values() if v.is_floating_point())
    config = AutoConfig.from_pretrained(out)
    # a draft vocabulary as vLLM reads it: `d2t` offsets (target id = draft id + d2t), sized by draft_vocab_size
    n = int(state["d2t"].numel()) if "d2t" in state else 0
    if n != (getattr(config, "draft_vocab_size", None) or 0):
        raise ValueError(f"{out}: config.json's draft_vocab_size is {getattr(config, 'draft_vocab_size', None)} "
                         f"but the weights hold {'a d2t of ' + str(n) if n else 'no d2t'}")
    head = DraftHead(config, HeadConfig(variant=variant, fc_bias="fc.bias" in state, draft_vocab=n))
    if n:
        head.set_draft_vocab(state.pop("d2t").long() + torch.arange(n))
        state.update(d2t=head.d2t, t2d=head.t2d)
    try:
        head.load_state_dict(state)
    except RuntimeError as e:  # missing or unexpected tensors, wrong shapes
        raise ValueError(f"{out} does not hold a {variant} head of this shape: {' '.join(str(e).split())}") from None
    return head.to(dtype).eval().requires_grad_(False)


def head_outputs(head: DraftHead, tokens: int = 8, seed: int = 0) -> torch.Tensor:
    """ĥ for fixed random inputs (token embeddings and hidden states of RMS ~1) at positions 1..tokens."""
    p = next(head.parameters())
    g = torch.Generator().manual_seed(seed)
    embeds, hidden = torch.randn(2, 1, tokens, head.hidden_size, generator=g).to(p.dtype)
    pos = torch.arange(1, tokens + 1)[None]
    mask = additive_mask(torch.ones(tokens, tokens, dtype=torch.bool).tril()[None, None], p.dtype)
    with torch.no_grad():
        return head(embeds, hidden, pos, mask)


def check_round_trip(reference: DraftHead, back: DraftHead, exact: bool, where: Path) -> None:
    """The exported head computes what the trained one does, both run in fp32 (`reference`: the trained
    weights rounded to the export dtype): bit for bit when the export holds the same numbers; within 0.1% of
    the output's scale when the layout rearranged them (a folded bias: its rounding and summation order
    move outputs by ~1e-5 of their scale in bf16, a missing or misplaced term by far more)."""
    if back.cfg.draft_vocab and not torch.equal(back.draft_ids, reference.draft_ids):
        raise ValueError(f"the export in {where} maps draft ids to other target ids than the trained head (d2t)")
    want, got = head_outputs(reference), head_outputs(back.float())
    tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-3, "atol": 1e-3 * want.abs().max().item()}
    try:
        torch.testing.assert_close(got, want, **tolerance)
    except AssertionError as e:
        raise ValueError(f"the export in {where} does not reproduce the trained head: {str(e).splitlines()[0]}") \
            from None
