"""SpecForge's EAGLE-3 trainer (`specforge train`, 0.2.0) on a CPU, offline, in its own venv, with our adjustments
applied at run time (nothing of SpecForge is edited or copied):

    .venv-specforge/bin/python benchmarks/peers/run_specforge.py --peers PEERS.json --work DIR --record OUT.json \\
        [--steps 2 --batch 8] [--lr 2e-3 --warmup-steps 1 --ttt 7 --max-grad-norm 1.0] [-- DOTTED.OVERRIDES=...]

`--lr`, `--warmup-steps`, `--ttt` and `--max-grad-norm` left out leave SpecForge's own defaults (its
`TrainingConfig`: lr 1e-4, warm-up 1.5% of the steps, TTT length 7, gradient clipping 0.5); dotted overrides after
`--` go to `specforge train` as they are (e.g. `training.lk_loss_type=lambda`, its LK loss).

PEERS.json is what `benchmarks/peers/write.py` wrote (the features, the draft vocabulary, the target). DIR receives
the run's files: `run.yaml` (SpecForge's typed config, with our settings), `draft.json` (the draft config: the
target's shape, one layer, our draft vocabulary size; SpecForge's generated default has 32,000 draft tokens),
`target/` (the target's files linked, plus the weight index SpecForge's lm_head loader insists on) and `output/`.

Adjustments (each recorded in OUT.json with how often it ran):
- `specforge.modeling.target.target_head:TargetHead.from_pretrained` casts the target's lm_head to the run's
  `model.torch_dtype` (SpecForge fixes bfloat16, so an fp32 run, ours, fails on the dtype mismatch; bf16 matmuls
  are 20-30x slower than fp32 on this CPU);
- `specforge.algorithms.eagle3.model:LogSoftmaxLoss` is SpecForge's own pure-torch `_compute_loss`
  (`specforge.core.loss`, compiled with torch.compile on the first step) instead of its Triton kernel;
- files, not code: `target/*.index.json` (the lm_head loader reads only sharded checkpoints), `draft.json`
  (our draft vocabulary size), `model.lm_head_key: model.embed_tokens.weight` for a target with tied embeddings,
  `training.fsdp_sharding: NO_SHARD` (one gloo process), `training.attention_backend: sdpa`.
The record also holds each optimizer step's end time and real (unpadded) tokens. After training, `specforge
export --to hf` writes DIR/export-hf (what vLLM serves with method eagle3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adjust import Adjustments  # noqa: E402
from step_profile import profiled  # noqa: E402


def target_view(target: Path, out: Path) -> tuple[Path, bool]:
    """The target's files linked into `out`, with a weight index when the target has a single safetensors file;
    returns (the view, whether the embeddings are tied)."""
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        link = out / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    if not list(out.glob("*.index.json")):
        weights = sorted(p.name for p in target.glob("*.safetensors"))
        if len(weights) != 1:
            raise SystemExit(f"{target}: expected one safetensors file or an index, found {weights}")
        with safe_open(str(target / weights[0]), "pt") as f:
            index = {"metadata": {}, "weight_map": {k: weights[0] for k in f.keys()}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((target / "config.json").read_text())
    return out, bool(config.get("tie_word_embeddings"))


def draft_config(target: Path, draft_vocab: int, aux_layers: list[int], out: Path) -> Path:
    """The draft's config: the target's shape, one layer, our draft vocabulary, and the aux layers under the key
    vLLM reads (SpecForge keeps unknown keys through training and export)."""
    config = json.loads((target / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  draft_vocab_size=draft_vocab, tie_word_embeddings=False, use_cache=True,
                  eagle_aux_hidden_state_layer_ids=list(aux_layers))
    if config.get("pad_token_id") is None:
        config["pad_token_id"] = 0
    out.write_text(json.dumps(config, indent=1) + "\n")
    return out


def run_yaml(args, peers: dict, work: Path) -> Path:
    import yaml

    target, tied = target_view(Path(peers["target"]), work / "target")
    model = {"target_model_path": str(target), "draft_model_config": str(draft_config(target, peers["draft_vocab"], peers["aux_layers"],
                                                                                      work / "draft.json")),
             "vocab_mapping_path": peers["specforge"]["vocab_mapping"], "torch_dtype": args.dtype,
             "cache_dir": str(work / "cache")}
    if tied:
        model["lm_head_key"] = "model.embed_tokens.weight"
    config = {
        "model": model,
        "data": {"hidden_states_path": peers["specforge"]["train"], "max_length": args.max_length,
                 "dataloader_num_workers": 0, "cache_dir": str(work / "cache")},
        "training": {"max_steps": args.steps, "total_steps": args.steps, "batch_size": args.batch,
                     "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD", "log_interval": 1,
                     "norm_before_residual": args.norm_before_residual, "seed": args.seed, "num_epochs": args.epochs,
                     **{key: value for key, value in (  # left out: SpecForge's own default
                         ("learning_rate", args.lr), ("max_grad_norm", args.max_grad_norm), ("ttt_length", args.ttt),
                         ("warmup_ratio", None if args.warmup_steps is None else args.warmup_steps / args.steps))
                        if value is not None}},
        "output_dir": str(work / "output"),
    }
    path = work / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def adjust(adj: Adjustments, steps: list[dict]) -> None:
    import torch

    from specforge.modeling.target import target_head as th

    dtype_of_run: dict = {}

    def from_pretrained(orig):
        def load(*args, **kwargs):
            head = orig(*args, **kwargs)
            return head.to(dtype=dtype_of_run["dtype"])
        return load

    # a classmethod: replace the bound one on the class
    original = th.TargetHead.from_pretrained
    entry = adj.entries.setdefault("specforge.modeling.target.target_head:TargetHead.from_pretrained",
                                   {"why": "SpecForge loads the target's lm_head in bfloat16 whatever the run's dtype",
                                    "calls": 0})

    def patched(cls, *args, **kwargs):
        entry["calls"] += 1
        return from_pretrained(original)(*args, **kwargs)

    th.TargetHead.from_pretrained = classmethod(patched)
    adj.dtype_of_run = dtype_of_run

    from specforge.core import loss as core_loss

    class PureTorchLoss:
        @staticmethod
        def apply(logits, target_p, position_mask):
            return core_loss._compute_loss(logits, target_p, position_mask)

    adj.replace("specforge.algorithms.eagle3.model:LogSoftmaxLoss.apply",
                "the Triton log-softmax loss kernel has no CPU backend: SpecForge's pure-torch _compute_loss",
                lambda orig: PureTorchLoss.apply)

    from specforge.training import controller

    def step(orig):
        def train_step(self, batch, *args, **kwargs):
            out = orig(self, batch, *args, **kwargs)
            mask = getattr(batch, "tensors", {}).get("attention_mask")
            steps.append({"t": time.perf_counter(),
                          "tokens": int(mask.sum()) if isinstance(mask, torch.Tensor) else None})
            return out
        return train_step

    adj.replace("specforge.training.controller:TrainerCore.train_step",
                "records each step's end time and real tokens (timing only)", step)
    del controller


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--record", type=Path, required=True)
    ap.add_argument("--profile", nargs="+", metavar="OUT FIRST LAST", default=None,
                    help="OUT FIRST LAST [FIRST LAST ...]: profile those optimizer steps by category (step_profile.py) "
                    "into OUT")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=None, help="default: SpecForge's")
    ap.add_argument("--warmup-steps", type=int, default=None, help="default: SpecForge's warm-up ratio")
    ap.add_argument("--ttt", type=int, default=None, help="default: SpecForge's TTT length")
    ap.add_argument("--max-grad-norm", type=float, default=None, help="default: SpecForge's")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--norm-before-residual", action="store_true")
    ap.add_argument("overrides", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
    peers = json.loads(args.peers.read_text())
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    config = run_yaml(args, peers, work)
    adj = Adjustments()
    for name, why in [("target/*.index.json", "the lm_head loader reads only sharded checkpoints (an index)"),
                      ("draft.json", "SpecForge's generated draft config has 32,000 draft tokens; ours has "
                                     f"{peers['draft_vocab']}"),
                      ("training.fsdp_sharding=NO_SHARD", "one gloo process on a CPU"),
                      ("training.attention_backend=sdpa", "flex attention has no CPU backward")]:
        adj.note(name, why)
    if "lm_head_key" in config.read_text():
        adj.note("model.lm_head_key=model.embed_tokens.weight", "the target ties its embeddings (no lm_head.weight)")
    steps: list[dict] = []
    import torch

    adjust(adj, steps)
    adj.dtype_of_run["dtype"] = getattr(torch, args.dtype)
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    from specforge.cli import main as specforge

    start = time.perf_counter()
    try:
        with profiled("specforge", args.profile):
            rc = specforge(["train", "--config", str(config), *overrides])
        if rc == 0:
            rc = specforge(["export", "--to", "hf", "--checkpoint", str(work / "output" / "specforge-run-latest"),
                            "--draft-config", str(work / "draft.json"), "--output-dir", str(work / "export-hf"),
                            "--vocab-mapping", peers["specforge"]["vocab_mapping"],
                            "--embedding-source", str(work / "target")])
    finally:
        adj.write(args.record, {"config": str(config), "overrides": overrides,
                                "step_end_s": [s["t"] - start for s in steps],
                                "step_tokens": [s["tokens"] for s in steps]})
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
