"""train.features: online and hybrid training against store-then-train on the tiny target (fp32, CPU).

Online features reproduce a precomputed store's bit for bit (same data order, same states), so an online run
equals a store run, weights and losses; a hybrid run writes precompute's store byte for byte; both resume
exactly; a disk budget keeps the store within it; bad input keeps its messages."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtp_train.config import compose
from mtp_train.store import format as fmt
from mtp_train.store import precompute as pc
from mtp_train.store.reader import StoreMismatch, StoreReader
from mtp_train.train import checkpoint as ckpt
from mtp_train.train.features import open_splits
from mtp_train.train.trainer import Trainer
from test_store import _make_data as make_data
from test_train import killed_after, losses

# train shards of <= 203 tokens; forward batches of 2 samples of 64 padded tokens
STORE = ["store.shard_mb=0.2", "store.batch_tokens=128"]
TRAIN = ["target.device=cpu", "train.micro_batch=4", "train.steps=12", "train.warmup_steps=2", "train.eval_every=0",
         "train.log_every=1", "train.lr=2e-3", "train.depth=2", "train.save_every=0"]  # 9 steps per epoch


def _make_data(run_dir: Path, target: Path) -> None:
    """36 train and 8 val samples of random tokens, 3..60 long (test_store's)."""
    make_data(run_dir, target, n_train=36, n_val=8)


def _cfg(run_dir: Path, features: str, *overrides: str, recipe: str = "tiny"):
    return compose(recipe, [f"run_dir={run_dir}", *STORE, *TRAIN, f"train.features={features}", *overrides])


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_dir) -> Path:
    d = tmp_path_factory.mktemp("features") / "data-only"
    _make_data(d, tiny_dir / "target")
    return d


@pytest.fixture(scope="module")
def offline(tmp_path_factory, data) -> Path:
    """precompute, then train from the store: the reference run."""
    d = tmp_path_factory.mktemp("features") / "offline"
    shutil.copytree(data, d)
    pc.run(_cfg(d, "store"))
    Trainer(_cfg(d, "store")).fit()
    return d


def _fresh(tmp_path: Path, data: Path, name: str) -> Path:
    d = tmp_path / name
    shutil.copytree(data, d)
    return d


def _same_head(a: Path, b: Path, step: int = 12) -> None:
    wa = ckpt.load_head_state(a / "checkpoints" / f"step-{step:06d}")
    wb = ckpt.load_head_state(b / "checkpoints" / f"step-{step:06d}")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])]


def test_online_features_equal_the_store_sample_for_sample(offline, data, tmp_path):
    """The states an online source computes for any set of samples are the stored ones, bit for bit, whatever
    the samples that share their batch."""
    cfg = _cfg(_fresh(tmp_path, data, "online"), "online")
    train, _ = open_splits(cfg, torch.device("cpu"), 0, 1)
    reader = StoreReader(offline / "store" / "train")
    assert train.manifest["plan_hash"] == reader.manifest["plan_hash"]
    assert list(train.lengths) == list(reader.lengths)
    for group in ([0], [5, 1, 30], list(range(35, 7, -3))):
        for i, s in zip(group, train.fetch(group)):
            r = reader[i]
            assert all(torch.equal(s[k], r[k]) for k in r), (i, group)


def test_an_online_run_equals_the_store_run_bit_for_bit(offline, data, tmp_path):
    d = _fresh(tmp_path, data, "online")
    summary = Trainer(_cfg(d, "online")).fit()
    assert not (d / "store" / "train").exists()  # nothing written
    assert losses(d) == losses(offline)
    _same_head(d, offline)
    assert summary["final"]["d1/acc"] > summary["start"]["d1/acc"]
    # validate's teacher-forced metrics of the online run compute the val states themselves: the store's again
    from mtp_train.validate.teacher_forced import teacher_forced

    trainer = Trainer(_cfg(d, "online", "train.steps=12", "resume=true"))  # the trained head, from its checkpoint
    online = teacher_forced(_cfg(d, "online"), trainer.head, trainer.frozen, torch.device("cpu"), 2)
    stored = teacher_forced(_cfg(offline, "store"), trainer.head, trainer.frozen, torch.device("cpu"), 2)
    assert online == stored and online["val_samples"] == 8


def test_an_online_eagle3_run_equals_the_store_run(tiny_dir, data, tmp_path):
    """eagle3 reads three aux layers: computed online the same as stored."""
    args = ("train.steps=4", "train.depth=2", "head.draft_vocab=512")
    a, b = _fresh(tmp_path, data, "store"), _fresh(tmp_path, data, "online")
    pc.run(_cfg(a, "store", *args, recipe="tiny-eagle3"))
    Trainer(_cfg(a, "store", *args, recipe="tiny-eagle3")).fit()
    Trainer(_cfg(b, "online", *args, recipe="tiny-eagle3")).fit()
    assert losses(a) == losses(b)
    _same_head(a, b, step=4)


def test_an_online_run_resumes_exactly_mid_epoch(offline, data, tmp_path, monkeypatch):
    d = _fresh(tmp_path, data, "online")
    args = ("train.save_every=4",)
    killed_after(_cfg(d, "online", *args), 6, monkeypatch)
    resumed = Trainer(_cfg(d, "online", *args, "resume=true"))
    assert (resumed.step, resumed.epoch, resumed.consumed) == (4, 0, 4)
    resumed.fit()
    assert losses(d) == losses(offline)
    _same_head(d, offline)


def _shards(run_dir: Path) -> int:
    return len(fmt.read_manifest(run_dir / "store" / "train")["shards"])


def _shard_bytes(split: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(split.glob("shard-*.safetensors"))}


def _manifest_without_run(split: Path) -> dict:
    """The manifest less what says how and where it was made (timings; the run directory's paths)."""
    m = json.loads((split / "manifest.json").read_text())
    m.pop("run")
    for part in fmt.IDENTITY_KEYS:
        (m.get(part) or {}).pop("path", None)
    return m


def test_a_hybrid_run_writes_precompute_store_byte_for_byte(offline, data, tmp_path, capsys):
    """12 steps = 1 1/3 epochs: the first pass online writes the store; the rest reads it. The shards equal
    precompute's byte for byte, verify-store passes, and the run equals the store run."""
    from mtp_train.cli import main

    d = _fresh(tmp_path, data, "hybrid")
    Trainer(_cfg(d, "hybrid")).fit()
    for split in ("train", "val"):
        assert _shard_bytes(d / "store" / split) == _shard_bytes(offline / "store" / split)
        assert _manifest_without_run(d / "store" / split) == _manifest_without_run(offline / "store" / split)
        assert not (d / "store" / split / fmt.PARTIAL).exists()
    assert len(_shard_bytes(d / "store" / "train")) == _shards(offline) > 3
    assert main(["verify-store", str(d / "store" / "train")]) == 0
    assert losses(d) == losses(offline)
    _same_head(d, offline)
    # a store run on the hybrid's store: the same again
    shutil.rmtree(d / "checkpoints")
    (d / "metrics.jsonl").unlink()
    Trainer(_cfg(d, "store")).fit()
    _same_head(d, offline)


def test_hybrid_ending_inside_the_first_pass_completes_the_store(offline, data, tmp_path):
    d = _fresh(tmp_path, data, "hybrid-short")
    Trainer(_cfg(d, "hybrid", "train.steps=3")).fit()  # a third of an epoch
    assert _shard_bytes(d / "store" / "train") == _shard_bytes(offline / "store" / "train")


def test_a_killed_hybrid_run_resumes_with_what_it_had_written(offline, data, tmp_path, monkeypatch):
    """Killed in the first pass after a checkpoint: the resumed run keeps the rows recorded at the checkpoint
    (its record names them), ends with precompute's bytes and trains as the store run does."""
    d = _fresh(tmp_path, data, "hybrid-killed")
    args = ("train.save_every=4",)
    killed_after(_cfg(d, "hybrid", *args), 6, monkeypatch)
    split = d / "store" / "train"
    record = json.loads((split / fmt.PARTIAL / "hybrid-rank0.json").read_text())
    assert sum(len(v) for v in record["written"].values()) == 16  # 4 steps x 4 samples, at the checkpoint
    assert sorted(p.name for p in split.glob("*.tmp")) == [f"{fmt.shard_name(k)}.tmp" for k in range(_shards(offline))]
    Trainer(_cfg(d, "hybrid", *args, "resume=true")).fit()
    assert _shard_bytes(split) == _shard_bytes(offline / "store" / "train")
    assert losses(d) == losses(offline)
    _same_head(d, offline)


def test_a_disk_budget_keeps_the_first_shards_and_the_rest_online(offline, data, tmp_path, capsys):
    sizes = [s["bytes"] for s in fmt.read_manifest(offline / "store" / "train")["shards"]]
    budget = sum(sizes[:2]) + sizes[2] // 2  # two shards fit, the third does not
    d = _fresh(tmp_path, data, "hybrid-budget")
    Trainer(_cfg(d, "hybrid", f"store.max_bytes={budget}")).fit()
    assert f"holds 2 of {_shards(offline)} train shards" in capsys.readouterr().out
    split = d / "store" / "train"
    assert _shard_bytes(split) == {k: v for k, v in _shard_bytes(offline / "store" / "train").items()
                                   if k in ("shard-00000.safetensors", "shard-00001.safetensors")}
    assert sum(p.stat().st_size for p in split.iterdir() if p.is_file()) <= budget
    assert not (split / "manifest.json").exists() and not list(split.glob("*.tmp"))
    assert losses(d) == losses(offline)
    _same_head(d, offline)
    # precompute completes the hybrid's partial store into precompute's own
    pc.run(_cfg(d, "store"))
    assert _shard_bytes(split) == _shard_bytes(offline / "store" / "train")


def test_online_bad_input_keeps_its_messages(data, tmp_path, tiny_dir):
    # no prepared data
    with pytest.raises(FileNotFoundError, match="train.features=online reads the prepared data in .*mtp-train prepare"):
        Trainer(_cfg(tmp_path / "empty", "online"))
    # data tokenized with another tokenizer
    d = _fresh(tmp_path, data, "other-tok")
    m = json.loads((d / "data" / "manifest.json").read_text())
    m["tokenizer"]["sha256"] = "0" * 64
    (d / "data" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreMismatch, match="tokenized with .* rerun `mtp-train prepare`"):
        Trainer(_cfg(d, "online"))
    # hybrid over a store made with another config: refused, nothing changed
    d = _fresh(tmp_path, data, "other-store")
    pc.run(_cfg(d, "store", "store.dtype=bfloat16"))
    before = _shard_bytes(d / "store" / "train")
    with pytest.raises(StoreMismatch, match="store.overwrite=true"):
        Trainer(_cfg(d, "hybrid"))
    assert _shard_bytes(d / "store" / "train") == before
    with pytest.raises(ValueError, match="train.features='disk': expected one of store, online, hybrid"):
        _cfg(d, "disk")


def test_two_processes_online_follow_two_processes_on_the_store(offline, data, tmp_path):
    """torchrun, 2 processes, gloo DDP: online equals the store run at the same world size, bit for bit."""
    runs = {}
    for mode in ("store", "online"):
        d = _fresh(tmp_path, data, f"ddp-{mode}")
        if mode == "store":
            shutil.copytree(offline / "store", d / "store")
        args = [f"run_dir={d}", *STORE, *TRAIN, "train.micro_batch=2", f"train.features={mode}"]
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "-m", "mtp_train", "train", "recipe=tiny", *args], capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[mode] = d
    assert losses(runs["store"]) == losses(runs["online"])
    _same_head(runs["store"], runs["online"])
