"""Why a head's accuracy falls after depth 1: what each chained step is fed, measured on trained heads.

    python benchmarks/eagle3_diagnose.py RUN_DIR [RUN_DIR ...] [--recipe smollm2-135m] [--depth 3] [--samples 48]

Each RUN_DIR is a trained run of any head variant (its checkpoint says which, and which norm options an eagle3 head
has; its data and store are the val split it is measured on). Teacher-forced on the val store, with the head's own
chained forward, per depth j:

- `rms in`: the RMS of the hidden state step j is fed (g = fc(aux) at depth 1, the previous step's output after);
- `shared`: how much of that hidden state is one vector shared by every position: |mean over positions|^2 /
  mean |h|^2 (1.0 = every position fed the same vector, ~0 = no common part);
- `repeat`: how often step j's draft (argmax) is step j-1's draft again (a chain stuck on one token); and how
  often the target's own next tokens repeat that way (`target repeat`), the rate a head that is right would show;
- `acc`: the draft's argmax equals the target's full-vocabulary argmax (over every counted anchor: the figure the
  trainer's evaluation reports);
- `given`: `acc` at the anchors whose drafts at depths 1..j-1 were all right: what greedy decoding sees, since it
  reaches depth j only then (on self-distilled data the fed tokens are the target's own greedy ones, so this is the
  chain's acceptance at position j given position j-1, the conditional form of the engines' per-position counters);
- `chain`: the share of anchors whose drafts at depths 1..j are all right (the teacher-forced estimate of the
  acceptance at position j that vLLM and our engine count: accepted at j / drafting steps).

Every figure is over the positions the trainer counts at that depth (reply tokens whose target token exists).

Prints a table and writes benchmarks/results/eagle3_diagnose.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import command, machine  # noqa: E402


def measure(run_dir: Path, args) -> dict:
    from mtp_train.config import compose
    from mtp_train.model.checkpoint import read_head
    from mtp_train.model.frozen import FrozenTarget
    from mtp_train.model.head import HeadCache, chain_masks, shift_left
    from mtp_train.store.reader import StoreReader
    from mtp_train.train.data import head_inputs, length_batches, loader
    from mtp_train.train.loss import predicted_mask

    cfg = compose(args.recipe, [f"run_dir={run_dir}"])  # the head and its variant come from the checkpoint
    head, meta = read_head(cfg)
    head.eval()
    frozen = FrozenTarget.from_pretrained(cfg.target.path, dtype=torch.float32, device="cpu")
    draft = head.draft_lm_head(frozen.lm_head_weight)
    reader = StoreReader(run_dir / "store" / "val")
    n = len(reader)
    chosen = range(n) if args.samples >= n else [i * n // args.samples for i in range(args.samples)]
    D = args.depth
    sums = {k: torch.zeros(D, dtype=torch.float64) for k in ("sq", "count", "repeat", "pairs", "target_repeat",
                                                              "acc", "acc_n", "given", "given_n", "chain")}
    mean_vec = [torch.zeros(head.hidden_size, dtype=torch.float64) for _ in range(D)]
    with torch.no_grad():
        for batch in loader(reader, length_batches(reader.lengths, cfg.train.micro_batch, chosen),
                            aux=head.aux_layers):
            ids, lengths, hidden = batch["input_ids"], batch["lengths"], batch["hidden"]
            B, T = ids.shape
            pos = torch.arange(T)[None].expand(B, T)
            valid = pos < lengths[:, None]
            cache = HeadCache()
            h = head.fuse(head_inputs(batch))
            prev = None
            chain = torch.ones(B, T, dtype=torch.bool)  # the anchor's drafts right at every depth so far
            for j in range(D):
                # anchor i at depth j predicts x_{i+2+j}, read from the target's state at i+1+j (trained positions)
                ok = predicted_mask(batch["loss_mask"], lengths, j)
                x = h[ok].double()
                sums["sq"][j] += x.pow(2).mean(-1).sum()
                sums["count"][j] += x.shape[0]
                mean_vec[j] += x.sum(0)
                h = head(frozen.embed(shift_left(ids, 1 + j)), h, pos + 1 + j, chain_masks(valid, j, h.dtype), cache)
                d = draft.to_target(draft.logits(head.readout(h)).argmax(-1))
                target_next = shift_left(ids, 2 + j)
                y = shift_left(hidden, 1 + j)
                top = (y[ok] @ frozen.lm_head_weight.T).argmax(-1)
                right = torch.zeros(B, T, dtype=torch.bool)
                right[ok] = d[ok] == top
                sums["acc"][j] += right.sum()
                sums["acc_n"][j] += int(ok.sum())
                reached = chain & ok
                sums["given"][j] += (right & reached).sum()
                sums["given_n"][j] += int(reached.sum())
                chain = chain & right
                sums["chain"][j] += (chain & ok).sum()
                if prev is not None:
                    sums["repeat"][j] += (d[ok] == prev[ok]).sum()
                    sums["target_repeat"][j] += (target_next[ok] == shift_left(ids, 1 + j)[ok]).sum()
                    sums["pairs"][j] += int(ok.sum())
                prev = d
    rows = []
    for j in range(D):
        ms = sums["sq"][j] / sums["count"][j]
        mean = mean_vec[j] / sums["count"][j]
        rows.append({"depth": j + 1, "rms_in": float(ms.sqrt()), "shared": float(mean.pow(2).mean() / ms),
                     "repeat": float(sums["repeat"][j] / sums["pairs"][j]) if j else None,
                     "target_repeat": float(sums["target_repeat"][j] / sums["pairs"][j]) if j else None,
                     "acc": float(sums["acc"][j] / sums["acc_n"][j]),
                     "given": float(sums["given"][j] / sums["given_n"][j]) if sums["given_n"][j] else None,
                     "chain": float(sums["chain"][j] / sums["acc_n"][j])})
    options = {k: meta["head"].get(k, False) for k in ("norm_before_residual", "norm_before_fc", "norm_output")}
    return {"run_dir": str(run_dir), "step": meta["step"], "variant": meta["head"].get("variant"),
            "options": options, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "eagle3_diagnose.json")
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    results = [measure(r.resolve(), args) for r in args.runs]
    print(f"{'run':<28}{'head':<18}{'depth':>6}{'rms in':>9}{'shared':>8}{'repeat':>8}{'tgt rep':>8}{'acc':>7}"
          f"{'given':>7}{'chain':>7}")
    for r in results:
        tag = "+".join(k.removeprefix("norm_").replace("before_", "b") for k, v in r["options"].items() if v) or "none"
        tag = f"{r['variant']}:{tag}" if r["variant"] == "eagle3" else r["variant"]
        for row in r["rows"]:
            rep = "" if row["repeat"] is None else f"{row['repeat']:.3f}"
            trep = "" if row["target_repeat"] is None else f"{row['target_repeat']:.3f}"
            given = "" if row["given"] is None else f"{row['given']:.3f}"  # no anchor reached depth j
            print(f"{Path(r['run_dir']).name:<28}{tag:<18}{row['depth']:>6}{row['rms_in']:>9.2f}{row['shared']:>8.3f}"
                  f"{rep:>8}{trep:>8}{row['acc']:>7.3f}{given:>7}{row['chain']:>7.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": machine(torch.get_num_threads()),
                                    "command": command("eagle3_diagnose.py", args),
                                    "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
