"""speculators' EAGLE-3 trainer (`speculators train`, 0.9.0) on a CPU, in its own venv, with our adjustments applied
at run time (nothing of speculators is edited or copied):

    .venv-speculators/bin/python benchmarks/peers/run_speculators.py --record OUT.json -- SPECULATORS_TRAIN_ARGS...

Adjustments (each recorded in OUT.json with how often it ran):
- `speculators.train.trainer:get_local_rank` returns the CPU device: the trainer moves the model and every batch
  to `local_rank`, an accelerator index (0 would mean cuda:0);
- `torch.accelerator.synchronize` is a no-op when there is no accelerator: the trainer's step timer calls it
  (twice per logged step) to time GPU work;
- `speculators.train.trainer.Trainer.__init__`: the autocast device type is `cpu` when there is no accelerator
  (speculators falls back to "cuda");
- with --muon-fp32-gemms (side_by_side.py passes it on a CPU without AMX), `torch.optim._muon:
  _zeropower_via_newtonschulz`, the Newton-Schulz iterations of its default optimizer Muon, keeps their bf16 values
  between products but computes each product by fp32 GEMMs (muon_cpu.newton_schulz): a CPU without bf16 matrix
  units runs torch's bf16 GEMMs 39-49x slower (RESULTS `peers`);
- flags the caller passes (checked here): `--draft-attn-impl sdpa` (flex attention has no CPU backward),
  `--loss-implementation eager` (the fused loss needs Triton), `--mask-token-id N` (the tokenizer names none).
The record also holds each optimizer step's end time and real (unpadded) tokens (its validation batches left out:
a run over several epochs validates between them), for tokens/s, and the spans
spent in its per-epoch checkpointing and validation (`outside_s`), which tokens/s leaves out as ours leaves out
its evaluations.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adjust import Adjustments  # noqa: E402
from muon_cpu import MUON_ADJUSTMENT, newton_schulz  # noqa: E402
from step_profile import profiled  # noqa: E402

REQUIRED_FLAGS = {"--draft-attn-impl": "sdpa", "--loss-implementation": "eager"}


def check_flags(argv: list[str]) -> None:
    for flag, value in REQUIRED_FLAGS.items():
        if flag not in argv or argv[argv.index(flag) + 1] != value:
            raise SystemExit(f"run_speculators.py: pass {flag} {value} on a CPU")
    if "--mask-token-id" not in argv:
        raise SystemExit("run_speculators.py: pass --mask-token-id N (a token id the draft masks with)")


def adjust(adj: Adjustments, steps: list[dict], tokens: list[int], outside: list[list[float]],
           muon_fp32_gemms: bool = False) -> None:
    import torch

    cpu = torch.device("cpu")
    adj.replace("speculators.train.trainer:get_local_rank",
                "the trainer moves the model and batches to the local rank, an accelerator index", lambda orig: (
                    lambda: cpu))
    adj.replace("torch:accelerator.synchronize", "the step timer synchronizes an accelerator; there is none",
                lambda orig: (lambda *a, **k: None if torch.accelerator.current_accelerator() is None
                              else orig(*a, **k)))
    if muon_fp32_gemms:
        adj.replace(MUON_ADJUSTMENT,
                    "Muon's bf16 Newton-Schulz products computed by fp32 GEMMs and rounded to bf16: this CPU has no "
                    "bf16 matrix units, where torch's bf16 GEMMs take 39-49x the time", lambda orig: (
                        lambda grad, coefficients, steps, eps: newton_schulz(grad, steps, eps, coefficients,
                                                                             between=torch.bfloat16)))
    from speculators.train import trainer as tr

    def init(orig):
        def __init__(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            if torch.accelerator.current_accelerator() is None:
                self.device_type = "cpu"
        return __init__

    adj.replace("speculators.train.trainer:Trainer.__init__",
                "autocast's device type falls back to cuda without an accelerator", init)

    def step(orig):  # times each optimizer step (all optimizers of one step: one call per optimizer)
        def _optimizers_step(self):
            orig(self)
            now = time.perf_counter()
            steps.append({"t": now})
        return _optimizers_step

    adj.replace("speculators.train.trainer:Trainer._optimizers_step", "records each step's end time (timing only)",
                step)

    validating = []  # not empty while a validation epoch runs: its batches' tokens are no training step's

    def span(orig, validation=False):  # the time between steps that is not training: checkpoints and validation
        def timed(self, *args, **kwargs):
            t0 = time.perf_counter()
            if validation:
                validating.append(True)
            try:
                return orig(self, *args, **kwargs)
            finally:
                if validation:
                    validating.pop()
                outside.append([t0, time.perf_counter()])
        return timed

    for name in ("maybe_save_checkpoint", "val_epoch", "maybe_update_best"):
        adj.replace(f"speculators.train.trainer:Trainer.{name}",
                    "records the span it takes between training steps (timing only)",
                    lambda orig, v=name == "val_epoch": span(orig, v))
    del tr

    def collate(orig):  # each packed training batch's real (unpadded) tokens, in order (num_workers 0: in process)
        def __call__(self, batch):
            out = orig(self, batch)
            if not validating:
                tokens.append(int((out["document_ids"] != -1).sum()))
            return out
        return __call__

    adj.replace("speculators.train.data:CollateFn.__call__", "records each batch's real tokens (timing only)", collate)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", type=Path, required=True)
    ap.add_argument("--profile", nargs="+", metavar="OUT FIRST LAST", default=None,
                    help="OUT FIRST LAST [FIRST LAST ...]: profile those optimizer steps by category (step_profile.py) "
                    "into OUT")
    ap.add_argument("--muon-fp32-gemms", action="store_true", help="Muon's bf16 Newton-Schulz products by fp32 GEMMs "
                    "(a CPU without bf16 matrix units)")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    ns = ap.parse_args()
    argv = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    check_flags(argv)
    adj = Adjustments()
    for flag, value in REQUIRED_FLAGS.items():
        adj.note(f"{flag} {value}", {"--draft-attn-impl": "flex attention has no CPU backward",
                                     "--loss-implementation": "the fused loss needs Triton"}[flag])
    adj.note("--mask-token-id", "the verifier's tokenizer names no mask token")
    steps: list[dict] = []
    tokens: list[int] = []  # each training batch's (validation batches left out)
    outside: list[list[float]] = []
    adjust(adj, steps, tokens, outside, ns.muon_fp32_gemms)
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    start = time.perf_counter()
    try:
        with profiled("speculators", ns.profile):
            train(TrainConfig.resolve(argv))
    finally:
        ends = [s["t"] - start for s in steps]
        adj.write(ns.record, {"argv": argv, "step_end_s": ends, "step_tokens": tokens[:len(ends)],
                              "outside_s": [[a - start, b - start] for a, b in outside]})


if __name__ == "__main__":
    main()
