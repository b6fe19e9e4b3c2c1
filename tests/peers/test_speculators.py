"""speculators 0.9.0 (in .venv-speculators, `make peers`) reads back what benchmarks/peers/write.py wrote from our
tiny-eagle3 store, with its own loader, tensor for tensor; and trains 2 steps on it through
benchmarks/peers/run_speculators.py, every CPU adjustment of that launcher applied."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("speculators", reason="speculators runs in its own venv: make peers")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_files import DIR, check_profile, draft_ids, final_norm, manifests, rms_norm, store_samples  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def peers():
    return manifests()


def dataset(peers, split):
    from speculators.train.data import ArrowDataset

    return ArrowDataset(max_len=4096, datapath=peers["speculators"]["dir"], on_missing="raise",
                        train_ratio=peers["train_data_ratio"], split=split, hidden_states_dtype=torch.float32)


@pytest.mark.parametrize("split", ["train", "val"])
def test_its_loader_reads_our_stores_samples(peers, split):
    """ids, masks, the aux layers' inputs and the last layer's pre-norm output, exactly; speculators' held-out
    part is our val split; its verifier norm over the last slot gives our stored final (post-norm) state."""
    manifest, peers = peers
    ours = store_samples(Path(manifest["store"]) / split)
    ds = dataset(peers, split)
    assert len(ds) == len(ours) == peers["samples"][split]
    weight, eps = final_norm(Path(peers["target"]))
    L = peers["num_layers"]
    for i, s in enumerate(ours):
        got = ds[i]
        assert torch.equal(got["input_ids"], s["input_ids"])
        assert torch.equal(got["loss_mask"].bool(), s["loss_mask"])
        aux = torch.cat([s[f"layer_{a}"] for a in peers["aux_layers"]], dim=-1)
        assert torch.equal(got["hidden_states"], aux)
        assert torch.equal(got["verifier_last_hidden_states"], s[f"layer_{L}"])
        torch.testing.assert_close(rms_norm(got["verifier_last_hidden_states"], weight, eps), s["hidden"],
                                   atol=2e-5, rtol=1e-5)


def test_it_loads_our_draft_vocabulary(peers):
    from speculators.train.cli import _load_mappings

    manifest, peers = peers
    d2t, t2d, n = _load_mappings(peers["speculators"]["d2t"], peers["speculators"]["t2d"], peers["draft_vocab"])
    ids = draft_ids(Path(manifest["store"]) / "train", peers["draft_vocab"], peers["vocab_size"])
    assert n == peers["draft_vocab"] and t2d.dtype == torch.bool and int(t2d.sum()) == n
    assert torch.equal(torch.arange(n) + d2t, ids) and torch.equal(torch.nonzero(t2d)[:, 0], ids)


def train_args(peers, out: Path, steps: int) -> list[str]:
    """speculators train matched to our tiny-eagle3 settings (AdamW, cosine, TTT with 0.8 per step, one
    full-attention layer, our architecture's norms), CPU flags included."""
    return ["--verifier-name-or-path", peers["target"], "--data-path", peers["speculators"]["dir"],
            "--save-path", str(out / "checkpoints"), "--log-dir", str(out / "logs"),
            "--draft-vocab-size", str(peers["draft_vocab"]), "--d2t-path", peers["speculators"]["d2t"],
            "--t2d-path", peers["speculators"]["t2d"], "--target-layer-ids", *map(str, peers["aux_layers"]),
            "--num-layers", "1", "--full-attention-indices", "0", "--hidden-states-dtype", "float32",
            "--total-seq-len", "1024", "--optimizer", "adamw", "--lr", "2e-3", "--scheduler-type", "cosine",
            "--scheduler-warmup-steps", "1", "--scheduler-total-steps", str(steps), "--ttt-steps", "3",
            "--ttt-step-loss-decay", "0.8", "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output",
            "--max-steps", str(steps), "--epochs", "1", "--num-workers", "0",
            "--train-data-ratio", str(peers["train_data_ratio"]), "--seed", "0",
            "--mask-token-id", "2", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]


def two_steps(peers: dict, name: str, optimizer: str = "adamw", launcher: tuple[str, ...] = ()) -> Path:
    """A fresh 2-step run in DIR/name (`launcher`: run_speculators.py's own flags): speculators resumes from
    checkpoints it finds there, and its checkpoint loader pins memory, which needs an accelerator."""
    out = DIR / name
    shutil.rmtree(out, ignore_errors=True)
    args = train_args(peers, out, 2)
    args[args.index("--optimizer") + 1] = optimizer
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers" / "run_speculators.py"), "--record",
                           str(out / "record.json"), *launcher, "--", *args], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_the_same_seed_trains_the_same_weights(peers):
    """The protocol keeps a head's dev figures when a fresh machine of the same kind trains it again for its test
    figures: two runs of one seed give the same weights, bit for bit (with its default optimizer, Muon, as the
    protocol's best configuration trains)."""
    from safetensors.torch import load_file

    _, peers = peers
    first, second = (load_file(str(two_steps(peers, f"speculators-seed-{i}", "muon") / "checkpoints" /
                                   "checkpoint_best" / "model.safetensors")) for i in (1, 2))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_muons_bf16_products_by_fp32_gemms_train_the_weights_of_torchs_bf16_ones(peers):
    """--muon-fp32-gemms (side_by_side.py passes it on a CPU without AMX) replaces torch.optim.Muon's Newton-Schulz
    iterations, once per Muon weight and step, and trains the weights torch's bf16 iterations train, bf16's
    summation order apart."""
    from safetensors.torch import load_file

    _, peers = peers
    runs = {flags: two_steps(peers, f"speculators-muon{'-'.join(flags)}", "muon", flags)
            for flags in ((), ("--muon-fp32-gemms",))}
    rec = json.loads((runs[("--muon-fp32-gemms",)] / "record.json").read_text())
    weights = [load_file(str(out / "checkpoints" / "checkpoint_best" / "model.safetensors")) for out in runs.values()]
    native, gemms = weights
    assert native.keys() == gemms.keys()
    calls = rec["adjustments"]["torch.optim._muon:_zeropower_via_newtonschulz"]["calls"]
    assert calls > 0 and calls % 2 == 0, calls  # every Muon weight, at each of the 2 steps
    assert "torch.optim._muon:_zeropower_via_newtonschulz" not in json.loads(
        (runs[()] / "record.json").read_text())["adjustments"]
    for k in native:
        a, b = native[k].float(), gemms[k].float()
        assert (a - b).norm() <= 1e-3 * a.norm() + 1e-6, (k, float((a - b).norm() / a.norm()))


def test_it_trains_two_steps_with_the_cpu_adjustments(peers):
    from safetensors import safe_open

    _, peers = peers
    out = two_steps(peers, "speculators-2-steps")
    rec = json.loads((out / "record.json").read_text())
    replaced = {k: v for k, v in rec["adjustments"].items() if v["calls"] is not None}
    assert set(replaced) == {"speculators.train.trainer:get_local_rank", "torch:accelerator.synchronize",
                             "speculators.train.trainer:Trainer.__init__",
                             "speculators.train.trainer:Trainer._optimizers_step",
                             "speculators.train.data:CollateFn.__call__",
                             *(f"speculators.train.trainer:Trainer.{n}" for n in
                               ("maybe_save_checkpoint", "val_epoch", "maybe_update_best"))}
    assert all(v["calls"] > 0 for v in replaced.values()), replaced
    assert len(rec["step_end_s"]) == 2 and len(rec["step_tokens"]) == 2 and all(0 < t <= 1024 for t in rec["step_tokens"])
    assert rec["outside_s"] and all(a <= b for a, b in rec["outside_s"])
    assert rec["outside_s"][0][0] >= rec["step_end_s"][-1]  # the epoch's checkpoint and validation follow its steps
    ckpt = out / "checkpoints" / "checkpoint_best"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["draft_vocab_size"] == peers["draft_vocab"]
    assert config["eagle_aux_hidden_state_layer_ids"] == peers["aux_layers"]
    assert not config["norm_before_residual"] and not config["norm_before_fc"]
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        d2t = f.get_tensor("d2t")
        assert all(torch.isfinite(f.get_tensor(k).float()).all() for k in f.keys())
    import numpy as np

    assert torch.equal(d2t, torch.from_numpy(np.load(peers["speculators"]["d2t"])))


def test_its_steps_profiled_by_category(peers):
    """run_speculators.py --profile: every scope of step_profile.CATEGORIES["speculators"] resolves in 0.9.0 and
    its attention (the sdpa fallback and its dense mask) and loss (the eager loss and the lm_heads) are timed,
    forward and backward."""
    _, peers = peers
    out = DIR / "speculators-profile"
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers" / "run_speculators.py"), "--record",
                           str(out / "record.json"), "--profile", str(out / "profile.json"), "2", "2", "4", "5",
                           "--", *train_args(peers, out, 5)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_profile(out / "profile.json", "speculators", 5)
