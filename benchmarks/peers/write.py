"""Write the samples of one of our hidden-state stores in the offline formats of the peers' EAGLE-3 trainers, with
our draft vocabulary, so that speculators and SpecForge train on exactly what our trainer reads.

    python benchmarks/peers/write.py OUT recipe=NAME run_dir=DIR [OVERRIDES ...] [--limit N] [--val-limit N]

The recipe and overrides are the run's, as `mtp-train` takes them: a prepared and precomputed run with an
`eagle3` head whose store also holds layer L (the last decoder layer's output before the final norm:
`store.layers=[L]`, L = the target's number of layers); they name the target, the head's aux layers and the
draft vocabulary size. OUT receives

    speculators/            one `datasets.save_to_disk` folder: `input_ids`, `loss_mask`, `seq_len` (torch format),
                            the train split's samples first, then the val split's (speculators holds out the last
                            part: `train_data_ratio` in peers.json makes that part exactly our val split);
      hidden_states/hs_{i}.safetensors   `hidden_states` [T, k + 1, H] (the k aux layers' inputs, then layer L
                            before the final norm: speculators applies the verifier's norm itself), `token_ids` [T]
      d2t-{N}.npy, t2d-{N}.npy           our draft vocabulary (int64 offsets, bool mask), the names speculators
                            looks for in its data folder
    specforge/train/, specforge/val/     one `torch.save` file per sample, `sample_{i:06d}.ckpt`: `input_ids` [T],
                            `loss_mask` [T], `hidden_state` [1, T, H] (after the final norm: SpecForge applies the
                            lm_head to it directly), `aux_hidden_state` [1, T, k·H]; in the store's dtype (SpecForge
                            itself writes bfloat16; `run_specforge.py` lets it train in float32)
    specforge/vocab_mapping.pt           {"d2t", "t2d"}: the same draft vocabulary, SpecForge's file
    peers.json              what was written: counts, tokens, aux layers, dtypes, the vocabulary's size and source

Our store holds the final hidden state after the final norm (docs/design.md §5); RMSNorm drops each token's scale, so the
pre-norm state speculators wants cannot be derived from it: the store keeps it as layer L instead (precompute
catches the final norm's input, `mtp_train/model/target.py:hook_layer_inputs`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_settings(cfg) -> dict:
    """From a run config: the target, its layer count, the head's aux layers and draft vocabulary."""
    from transformers import AutoConfig

    from mtp_train.model.head import aux_layer_ids

    if cfg.head.variant != "eagle3":
        raise ValueError(f"recipe {cfg.recipe}: head.variant={cfg.head.variant}; the peers train EAGLE-3 heads: "
                         "pass head.variant=eagle3 (and the run's other head settings)")
    target = AutoConfig.from_pretrained(cfg.target.path)
    return {"target": str(Path(cfg.target.path).resolve()), "num_layers": target.num_hidden_layers,
            "vocab_size": target.vocab_size, "hidden_size": target.hidden_size,
            "aux_layers": aux_layer_ids(target, cfg.head), "draft_vocab": cfg.head.draft_vocab}


def open_split(run_dir: Path, split: str, settings: dict):
    """The store split, checked to hold the aux layers and layer L."""
    from mtp_train.store.reader import StoreReader

    reader = StoreReader(run_dir / "store" / split)
    L = settings["num_layers"]
    missing = [i for i in [*settings["aux_layers"], L] if i not in reader.layers]
    if missing:
        raise ValueError(f"store {reader.dir} holds layers {reader.layers}, not {missing}: the peers need the aux "
                         f"layers and layer {L} (the last layer's output before the final norm); precompute with "
                         f"store.layers=[{L}] into a run_dir of its own")
    return reader


def peer_sample(reader, i: int, settings: dict) -> dict[str, torch.Tensor]:
    """Sample i as both peers need it: ids, mask, aux [T, k·H], final (after the norm) and pre-norm [T, H]."""
    s = reader[i]
    slot = {layer: j for j, layer in enumerate(reader.layers)}
    aux = torch.cat([s["layers"][slot[a]] for a in settings["aux_layers"]], dim=-1)
    return {"input_ids": s["input_ids"], "loss_mask": s["loss_mask"], "aux": aux, "final": s["hidden"],
            "pre_norm": s["layers"][slot[settings["num_layers"]]]}


def vocab_mappings(run_dir: Path, settings: dict) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Our draft vocabulary as EAGLE-3's d2t [N] (target id = draft id + d2t) and t2d [V], counted from the train
    store exactly as our trainer counts it."""
    from mtp_train.store.reader import StoreReader
    from mtp_train.train.vocab import choose_draft_vocab

    vocab = choose_draft_vocab(StoreReader(run_dir / "store" / "train"), settings["draft_vocab"],
                               settings["vocab_size"])
    N = len(vocab.ids)
    t2d = torch.zeros(settings["vocab_size"], dtype=torch.bool)
    t2d[vocab.ids] = True
    return vocab.ids - torch.arange(N), t2d, vocab.summary()


def write_speculators(out: Path, samples, hs_dtype: torch.dtype) -> list[int]:
    """speculators' offline layout; returns the samples' lengths."""
    import datasets
    from safetensors.torch import save_file

    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i, s in enumerate(samples):
        hidden = torch.cat([s["aux"].unflatten(-1, (-1, s["pre_norm"].shape[-1])), s["pre_norm"][:, None]], dim=1)
        save_file({"hidden_states": hidden.to(hs_dtype).contiguous(), "token_ids": s["input_ids"].clone()},
                  str(hs_dir / f"hs_{i}.safetensors"))
        rows["input_ids"].append(s["input_ids"].tolist())
        rows["loss_mask"].append(s["loss_mask"].long().tolist())
        rows["seq_len"].append(len(s["input_ids"]))
    ds = datasets.Dataset.from_dict(rows)
    ds.set_format(type="torch")
    ds.save_to_disk(str(out))
    return rows["seq_len"]


def write_specforge(out: Path, samples, dtype: torch.dtype) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(samples):
        torch.save({"input_ids": s["input_ids"].clone(), "loss_mask": s["loss_mask"].long(),
                    "hidden_state": s["final"][None].to(dtype).contiguous(),
                    "aux_hidden_state": s["aux"][None].to(dtype).contiguous()},
                   out / f"sample_{i:06d}.ckpt")


def write(cfg, out: Path, limit: int | None = None, val_limit: int | None = None) -> dict:
    """Both peers' formats of the run `cfg` (a composed RunConfig) under `out`; returns peers.json's record."""
    run_dir = Path(cfg.run_dir)
    settings = run_settings(cfg)
    readers = {split: open_split(run_dir, split, settings) for split in ("train", "val")}
    counts = {"train": min(len(readers["train"]), limit or len(readers["train"])),
              "val": min(len(readers["val"]), val_limit or len(readers["val"]))}
    d2t, t2d, vocab_summary = vocab_mappings(run_dir, settings)

    def samples(split):
        return (peer_sample(readers[split], i, settings) for i in range(counts[split]))

    def both():
        yield from samples("train")
        yield from samples("val")

    spec_dir = out / "speculators"
    hs_dtype = torch.float32 if readers["train"].dtype == "float32" else torch.bfloat16
    lengths = write_speculators(spec_dir, both(), hs_dtype)
    np.save(spec_dir / f"d2t-{len(d2t)}.npy", d2t.numpy())
    np.save(spec_dir / f"t2d-{len(d2t)}.npy", t2d.numpy())
    for split in ("train", "val"):
        write_specforge(out / "specforge" / split, samples(split), hs_dtype)
    torch.save({"d2t": d2t, "t2d": t2d}, out / "specforge" / "vocab_mapping.pt")
    n = len(lengths)
    train_lengths = lengths[:counts["train"]]
    record = {"run_dir": str(run_dir.resolve()), **settings, "samples": counts,
              "tokens": {"train": sum(train_lengths), "val": sum(lengths[counts["train"]:])},
              "mean_train_length": sum(train_lengths) / max(1, len(train_lengths)),
              # int(n * ratio) == counts["train"]: speculators' held-out part is exactly our val split
              "train_data_ratio": (counts["train"] + 0.5) / n,
              "speculators": {"dir": str(spec_dir), "hidden_states_dtype": str(hs_dtype).removeprefix("torch."),
                              "slots": [f"input of layer {a}" for a in settings["aux_layers"]]
                              + [f"layer {settings['num_layers']} (before the final norm)"],
                              "d2t": str(spec_dir / f"d2t-{len(d2t)}.npy"), "t2d": str(spec_dir / f"t2d-{len(d2t)}.npy")},
              "specforge": {"train": str(out / "specforge" / "train"), "val": str(out / "specforge" / "val"),
                            "dtype": str(hs_dtype).removeprefix("torch."),
                            "vocab_mapping": str(out / "specforge" / "vocab_mapping.pt")},
              "draft_vocab_summary": vocab_summary}
    (out / "peers.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("overrides", nargs="+", help="recipe=NAME run_dir=DIR and the run's other overrides")
    ap.add_argument("--limit", type=int, default=None, help="the first N train samples only")
    ap.add_argument("--val-limit", type=int, default=None, help="the first N val samples only")
    args = ap.parse_args()
    from mtp_train.config import compose

    recipe = [o.split("=", 1)[1] for o in args.overrides if o.startswith("recipe=")]
    cfg = compose(recipe[-1] if recipe else "tiny", [o for o in args.overrides if not o.startswith("recipe=")])
    record = write(cfg, args.out, args.limit, args.val_limit)
    print(f"wrote {record['samples']} samples ({record['tokens']} tokens) for both peers under {args.out}; "
          f"{record['draft_vocab_summary']}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
