"""SpecForge 0.2.0 (in .venv-specforge, `make peers`) reads back what benchmarks/peers/write.py wrote from our
tiny-eagle3 store, with its own offline reader and normaliser, tensor for tensor; and trains 2 steps on it through
benchmarks/peers/run_specforge.py (every CPU adjustment of that launcher applied), then exports for vLLM."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("specforge", reason="SpecForge runs in its own venv: make peers")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_files import DIR, check_profile, draft_ids, manifests, store_samples  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def peers():
    return manifests()


@pytest.mark.parametrize("split", ["train", "val"])
def test_its_reader_reads_our_stores_samples(peers, split):
    """SpecForge's file listing keeps our sample order; its EAGLE-3 normaliser gives our aux layers' inputs as
    `hidden_state`, our final (post-norm) state as `target`, our ids, and our loss mask with the last position
    cleared (SpecForge's own rule: the last token has no next token)."""
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    manifest, peers = peers
    ours = store_samples(Path(manifest["store"]) / split)
    refs = OfflineManifestReader(peers["specforge"][split], ttt_length=7, max_len=4096).read()
    assert len(refs) == len(ours) == peers["samples"][split]
    for ref, s in zip(refs, ours):
        got = normalize_offline_sample(load_feature_file(ref.feature_store_uri.removeprefix("file://")), 4096)
        aux = torch.cat([s[f"layer_{a}"] for a in peers["aux_layers"]], dim=-1)
        assert torch.equal(got["hidden_state"][0], aux)
        assert torch.equal(got["target"][0], s["hidden"])
        assert torch.equal(got["input_ids"][0], s["input_ids"])
        mask = s["loss_mask"].clone()
        mask[-1] = False
        assert torch.equal(got["loss_mask"][0].bool(), mask)


def test_it_loads_our_draft_vocabulary(peers):
    manifest, peers = peers
    mapping = torch.load(peers["specforge"]["vocab_mapping"])
    ids = draft_ids(Path(manifest["store"]) / "train", peers["draft_vocab"], peers["vocab_size"])
    assert torch.equal(torch.arange(peers["draft_vocab"]) + mapping["d2t"], ids)
    assert torch.equal(torch.nonzero(mapping["t2d"])[:, 0], ids)


def two_steps(name: str) -> Path:
    """A fresh 2-step run in DIR/name (SpecForge would resume from what it finds there)."""
    work = DIR / name
    shutil.rmtree(work, ignore_errors=True)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers" / "run_specforge.py"),
                           "--peers", str(DIR / "data" / "peers.json"), "--work", str(work), "--record",
                           str(work / "record.json"), "--steps", "2", "--batch", "4", "--ttt", "3",
                           "--warmup-steps", "1"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work


def test_the_same_seed_trains_the_same_weights():
    """The protocol keeps a head's dev figures when a fresh machine of the same kind trains it again for its test
    figures: two runs of one seed give the same exported weights, bit for bit."""
    from safetensors.torch import load_file

    first, second = (load_file(str(two_steps(f"specforge-seed-{i}") / "export-hf" / "model.safetensors"))
                     for i in (1, 2))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_it_trains_two_steps_with_the_cpu_adjustments_and_exports(peers):
    from safetensors import safe_open

    _, peers = peers
    work = two_steps("specforge-2-steps")
    rec = json.loads((work / "record.json").read_text())
    replaced = {k: v for k, v in rec["adjustments"].items() if v["calls"] is not None}
    assert set(replaced) == {"specforge.modeling.target.target_head:TargetHead.from_pretrained",
                             "specforge.algorithms.eagle3.model:LogSoftmaxLoss.apply",
                             "specforge.training.controller:TrainerCore.train_step"}
    assert all(v["calls"] > 0 for v in replaced.values()), replaced
    assert replaced["specforge.algorithms.eagle3.model:LogSoftmaxLoss.apply"]["calls"] == 2 * 3  # steps x TTT
    assert len(rec["step_end_s"]) == 2 and all(t > 0 for t in rec["step_tokens"])
    notes = {k for k, v in rec["adjustments"].items() if v["calls"] is None}
    assert {"target/*.index.json", "draft.json", "training.fsdp_sharding=NO_SHARD"} <= notes
    assert (work / "target" / "model.safetensors.index.json").is_file()
    export = work / "export-hf"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == peers["draft_vocab"]
    assert config["eagle_aux_hidden_state_layer_ids"] == peers["aux_layers"]
    with safe_open(str(export / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        mapping = torch.load(peers["specforge"]["vocab_mapping"])
        assert torch.equal(f.get_tensor("d2t"), mapping["d2t"])
        assert f.get_tensor("lm_head.weight").shape[0] == peers["draft_vocab"]
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight"} <= keys


def test_its_steps_profiled_by_category(peers):
    """run_specforge.py --profile: every scope of step_profile.CATEGORIES["specforge"] resolves in 0.2.0 and its
    attention (the sdpa backend) and loss (the pure-torch loss, the target's probabilities and the lm_heads) are
    timed, forward and backward."""
    work = DIR / "specforge-profile"
    shutil.rmtree(work, ignore_errors=True)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers" / "run_specforge.py"),
                           "--peers", str(DIR / "data" / "peers.json"), "--work", str(work), "--record",
                           str(work / "record.json"), "--steps", "5", "--batch", "4", "--ttt", "3",
                           "--warmup-steps", "1", "--profile", str(work / "profile.json"), "2", "2", "4", "5"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_profile(work / "profile.json", "specforge", 5)
