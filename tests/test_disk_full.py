"""A full disk, for real: run_dir on a small tmpfs (mounted by the test; skipped where mounting is not
allowed). Prepare, precompute, train and export stop with an error naming the file and the bytes it needed,
nothing partial is left, every finished shard / the last checkpoint / the exports already written verify, and
after the filesystem grows the same command goes on to the bytes (data, store, export) and weights (train) of
an uninterrupted run. (One rank's full disk under torchrun: tests/test_distributed.py.)"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtp_train.files import DiskFull
from mtp_train.store import format as fmt
from mtp_train.store import precompute as pc
from mtp_train.train import checkpoint as ckpt
from mtp_train.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_store import _cfg, _digests, _make_data  # noqa: E402
from test_train import config, samples  # noqa: E402,F401
from windows import make_store  # noqa: E402


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.fixture
def small_fs(tmp_path):
    """mount(size_bytes) -> a fresh tmpfs of that size; grow(size_bytes) enlarges it in place."""
    where = tmp_path / "fs"
    where.mkdir()
    mounted = []

    def mount(size: int) -> Path:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or r.returncode}): needs root")
        mounted.append(where)
        return where

    def grow(size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True)

    yield mount, grow
    import gc

    gc.collect()  # the trainer's memory-mapped store files keep the filesystem busy until collected
    for w in mounted:
        if subprocess.run(["umount", str(w)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(w)], check=True)  # detached now, freed when the last file closes


def test_precompute_on_a_full_disk(tmp_path, tiny_dir, small_fs):
    mount, grow = small_fs
    clean = tmp_path / "clean"
    _make_data(clean, tiny_dir / "target")
    pc.run(_cfg(clean))
    shard = (clean / "store" / "train" / fmt.shard_name(0)).stat().st_size
    fs = mount(du(clean / "data") + int(2.5 * shard) + 64 * 1024)  # the data, and about two shards
    run_dir = fs / "run"
    shutil.copytree(clean / "data", run_dir / "data")
    with pytest.raises(DiskFull, match=r"no space left writing shard .*/store/train/shard-\d+\.safetensors: it needs "
                                       r"about [\d,]+ bytes, [\d,]+ are free there\. Nothing partial was left; every "
                                       r"finished shard is kept"):
        pc.run(_cfg(run_dir))
    split = run_dir / "store" / "train"
    done = sorted(split.glob("shard-*.safetensors"))
    assert done and not list(split.rglob("*.tmp")) and not (split / fmt.MANIFEST).exists()
    for f in done:  # each finished shard is whole: its record's digest
        rec = json.loads((split / fmt.PARTIAL / f.name.replace(".safetensors", ".json")).read_text())
        assert fmt.sha256_file(f) == rec["sha256"]
    grow(64 << 20)
    pc.run(_cfg(run_dir))
    assert _digests(run_dir) == _digests(clean)


def test_train_checkpoint_on_a_full_disk(tmp_path, samples, tiny_dir, small_fs):  # noqa: F811
    mount, grow = small_fs
    args = ("train.steps=6", "train.save_every=2", "train.depth=2", "train.lr=1e-3")
    clean = tmp_path / "clean"
    make_store(clean, samples, tiny_dir / "target")
    Trainer(config(clean, *args)).fit()
    one = du(clean / "checkpoints" / "step-000006")
    fs = mount(du(clean / "store") + int(1.5 * one))  # the store and one checkpoint, not two
    run_dir = fs / "run"
    make_store(run_dir, samples, tiny_dir / "target")
    with pytest.raises(DiskFull, match=r"no space left writing checkpoint .*step-000004\.tmp: it needs about [\d,]+ "
                                       r"bytes.* the last complete checkpoint \(.*step-000002\) is untouched"):
        Trainer(config(run_dir, *args)).fit()
    root = run_dir / "checkpoints"
    assert not list(root.glob("*.tmp")) and ckpt.latest(root).name == "step-000002"
    assert ckpt.verify(ckpt.latest(root)) == []
    grow(256 << 20)
    Trainer(config(run_dir, *args, "resume=true")).fit()
    a = ckpt.load_head_state(clean / "checkpoints" / "step-000006")
    b = ckpt.load_head_state(root / "step-000006")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_prepare_on_a_full_disk(tmp_path, small_fs):
    """The prepared data does not fit: a clear error, no `data.tmp` left, an earlier prepared dataset (here: none)
    untouched; with room, the same command writes what a run on a roomy disk writes."""
    from mtp_train.data import prepare as prep
    from mtp_train.config import compose

    mount, grow = small_fs
    limits = ["data.sources.0.limit=4", "data.sources.1.limit=40", "data.sources.2.limit=2", "data.sources.3.limit=8"]
    prep.run(compose("tiny", [f"run_dir={tmp_path / 'clean'}", *limits]))
    data = tmp_path / "clean" / "data"
    fs = mount(du(data) // 3)
    run_dir = fs / "run"
    with pytest.raises(DiskFull, match=r"no space left writing the prepared data .*/run/data\.tmp: it needs about "
                                       r"[\d,]+ bytes, [\d,]+ are free there\. Nothing partial was left; nothing was "
                                       r"written to .*/run/data\. Free space"):
        prep.run(compose("tiny", [f"run_dir={run_dir}", *limits]))
    assert sorted(p.name for p in run_dir.iterdir()) == []
    grow(64 << 20)
    prep.run(compose("tiny", [f"run_dir={run_dir}", *limits]))
    for f in sorted(data.rglob("*.arrow")):
        assert fmt.sha256_file(run_dir / "data" / f.relative_to(data)) == fmt.sha256_file(f), f.name


def test_export_on_a_full_disk(tmp_path, small_fs):
    """Room for the first of the two EAGLE exports, not the second: the first is kept whole (it reads back), the
    second leaves nothing behind; with room the rerun skips the first and writes the second as on a roomy disk."""
    from mtp_train.export.run import run as export
    from mtp_train.model.head import HeadConfig
    from test_export import saved_run, tiny_llama

    mount, grow = small_fs
    cfg, _, _ = saved_run(tmp_path / "clean", tiny_llama(), HeadConfig(variant="eagle1"))
    export(cfg)
    clean = tmp_path / "clean" / "run" / "export"
    first = du(clean / "eagle-vllm")
    fs = mount(du(tmp_path / "clean") - du(clean) + first + first // 2)
    cfg, _, _ = saved_run(fs, tiny_llama(), HeadConfig(variant="eagle1"))
    with pytest.raises(DiskFull, match=r"no space left writing export .*/run/export/eagle-sglang: it needs about "
                                       r"[\d,]+ bytes, [\d,]+ are free there\. Nothing partial was left; eagle-vllm "
                                       r"is written and intact; nothing was written to .*eagle-sglang\. Free space"):
        export(cfg)
    out = fs / "run" / "export"
    assert sorted(p.name for p in out.iterdir()) == ["eagle-vllm"]
    grow(64 << 20)
    export(cfg)
    for name in ("eagle-vllm", "eagle-sglang"):
        for f in ("model.safetensors", "config.json"):
            assert fmt.sha256_file(out / name / f) == fmt.sha256_file(clean / name / f), (name, f)


def test_hybrid_training_on_a_small_disk(tmp_path, tiny_dir, small_fs):
    """A hybrid run whose store does not fit stops before writing any shard, saying to set store.max_bytes;
    with store.max_bytes it trains to the end, the store within the budget and the rest online."""
    from test_features import _make_data as make_data

    mount, _ = small_fs
    ref = tmp_path / "ref"
    make_data(ref, tiny_dir / "target")
    pc.run(_cfg_features(ref, "store"))
    shards = [s["bytes"] for s in fmt.read_manifest(ref / "store" / "train")["shards"]]
    val = du(ref / "store" / "val")
    fs = mount(du(ref / "data") + val + sum(shards[:3]) + 3 * 2**20 + 256 * 1024)  # the data, val, ~3 shards
    run_dir = fs / "run"
    shutil.copytree(ref / "data", run_dir / "data")
    (tmp_path / "checkpoints").mkdir()
    (run_dir / "checkpoints").symlink_to(tmp_path / "checkpoints")  # the small disk is the store's alone
    with pytest.raises(DiskFull, match=r"train.features=hybrid: the \d+ train shard\(s\) to write in .*store/train need "
                                       r"about [\d,]+ bytes, [\d,]+ are free there; nothing was written. Set "
                                       r"store.max_bytes below"):
        Trainer(_cfg_features(run_dir, "hybrid"))
    assert not list((run_dir / "store" / "train").glob("shard-*"))
    budget = sum(shards[:3])
    Trainer(_cfg_features(run_dir, "hybrid", f"store.max_bytes={budget}")).fit()
    written = sorted(p.name for p in (run_dir / "store" / "train").glob("shard-*"))
    assert written == [fmt.shard_name(k) for k in range(3)]
    assert du(run_dir / "store" / "train") <= budget + 64 * 1024  # the shards, and small records


def _cfg_features(run_dir, features, *overrides):
    from mtp_train.config import compose
    from test_features import STORE, TRAIN

    return compose("tiny", [f"run_dir={run_dir}", *STORE, *TRAIN, f"train.features={features}", *overrides])


def test_regeneration_journal_on_a_full_disk(tmp_path, small_fs):
    """The journal's commit that hits the full disk is cut back to whole lines, the error names the journal and
    what is kept; after the filesystem grows the same command goes on from the journal to the dataset of an
    uninterrupted run."""
    from test_prepare import TWO_TURNS, _dataset_digest, _finish, _StubOpenAI, _write_jsonl

    mount, grow = small_fs
    source = _write_jsonl(tmp_path / "c.jsonl", TWO_TURNS)
    stub = _StubOpenAI(pad=1500)  # 12 replies of 1.5 kB: the journal outgrows 8 kB
    over = ["data.regenerate=true", "data.regen_concurrency=1", f"data.regenerate_server={stub.url}"]
    try:
        _finish(tmp_path / "clean", source, over)
        run_dir = mount(8192) / "run"
        with pytest.raises(DiskFull) as e:
            _finish(run_dir, source, over)
        journal = run_dir / "data" / "regenerate.jsonl"
        assert f"no space left writing the regeneration journal {journal}: it needs about" in str(e.value)
        assert "replies committed before are kept in" in str(e.value)
        raw = journal.read_bytes()
        assert raw.endswith(b"\n") and all(json.loads(line) for line in raw.split(b"\n")[:-1])  # whole lines
        kept = sum(len(json.loads(line)["replies"]) for line in raw.split(b"\n")[1:-1])
        assert 0 < kept < 12
        grow(1 << 20)
        m = _finish(run_dir, source, over)
    finally:
        stub.close()
    assert m["regenerate"]["turns_from_journal"] == kept
    assert _dataset_digest(run_dir / "data", journal=False) == _dataset_digest(tmp_path / "clean" / "data",
                                                                               journal=False)
