"""The hidden-state store: precompute against an independent HF forward (padded batches, extra layers),
resume after a kill, verify-store, identity and config mismatches, the memory-mapped reader, storage
dtypes, and two ranks under torchrun (gloo)."""

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM

from mtp_train.cli import main
from mtp_train.config import compose
from mtp_train.data import prepare as prep
from mtp_train.data.chat import Tokenized
from mtp_train.store import format as fmt
from mtp_train.store import forward as fwd
from mtp_train.store import precompute as pc
from mtp_train.store.config import StoreConfig
from mtp_train.store.reader import StoreMismatch, StoreReader

LAYERS = [0, 3]  # extra layers stored by the reference run: the embeddings' output and the last layer's input
SETTINGS = ["store.shard_mb=0.45", "store.batch_tokens=160", f"store.layers={LAYERS}"]  # 153 tokens/shard


def _samples(gen: torch.Generator, n: int) -> list[Tokenized]:
    """Random token ids of lengths 3..60, so batches mix lengths and are padded."""
    out = []
    for _ in range(n):
        t = int(torch.randint(3, 61, (1,), generator=gen))
        mask = (torch.rand(t, generator=gen) < 0.7).long().tolist()
        out.append(Tokenized(torch.randint(3, 8000, (t,), generator=gen).tolist(), mask))
    return out


def _make_data(run_dir: Path, target: Path, n_train: int = 28, n_val: int = 6) -> None:
    gen = torch.Generator().manual_seed(0)
    splits = {"train": _samples(gen, n_train), "val": _samples(gen, n_val)}
    manifest = {"tokenizer": {"path": str(target), "sha256": prep.tokenizer_hash(target)},
                "splits": {k: prep.split_stats(v) for k, v in splits.items()}}
    prep.write(run_dir / "data", splits, manifest)


def _cfg(run_dir: Path, *overrides: str):
    return compose("tiny", [f"run_dir={run_dir}", *SETTINGS, *overrides])


def _shards(split_dir: Path) -> dict[str, tuple[int, int]]:
    """file -> (inode, mtime_ns) of every shard."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(split_dir.glob("shard-*.safetensors"))}


def _digests(run_dir: Path) -> dict[str, list[str]]:
    return {s: [x["sha256"] for x in fmt.read_manifest(run_dir / "store" / s)["shards"]] for s in pc.SPLITS}


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tiny_dir) -> Path:
    """A run_dir with a small prepared dataset and the store of one uninterrupted precompute."""
    run_dir = tmp_path_factory.mktemp("clean")
    _make_data(run_dir, tiny_dir / "target")
    pc.run(_cfg(run_dir))
    return run_dir


@pytest.fixture
def copy(clean, tmp_path) -> Path:
    shutil.copytree(clean, tmp_path / "run")
    return tmp_path / "run"


def test_stored_states_equal_an_unbatched_hf_forward(clean, tiny_dir):
    import datasets

    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "target", dtype=torch.float32).eval()
    for split in pc.SPLITS:
        data = datasets.load_from_disk(str(clean / "data" / split))
        reader = StoreReader(clean / "store" / split)
        m = reader.manifest
        assert len(reader) == len(data) and m["totals"]["shards"] == len(m["shards"])
        assert reader.layers == LAYERS and reader.hidden_size == 256 and m["dtype"] == "float32"
        for i, row in enumerate(data):
            ids = torch.tensor([row["input_ids"]])
            with torch.no_grad():
                ref = model(ids, output_hidden_states=True).hidden_states  # one sample, no padding
            got = reader[i]
            assert torch.equal(got["input_ids"], ids[0]) and got["input_ids"].dtype == torch.long
            assert torch.equal(got["loss_mask"], torch.tensor(row["loss_mask"]).bool())
            torch.testing.assert_close(got["hidden"], ref[-1][0], atol=2e-5, rtol=1e-5)
            assert got["layers"].shape == (len(LAYERS), ids.shape[1], 256)
            for j, layer in enumerate(LAYERS):
                torch.testing.assert_close(got["layers"][j], ref[layer][0], atol=2e-5, rtol=1e-5)
    train = fmt.read_manifest(clean / "store" / "train")
    assert train["totals"]["shards"] >= 4 and train["run"]["padding"] > 0  # several shards, padded batches
    assert not (clean / "store" / "train" / fmt.PARTIAL).exists()


def test_a_killed_run_resumes_to_the_same_bytes_without_rewriting_finished_shards(tmp_path, clean, tiny_dir,
                                                                                    monkeypatch):
    run_dir = tmp_path / "run"
    _make_data(run_dir, tiny_dir / "target")
    monkeypatch.setenv(pc.FAIL_AFTER_ENV, "2")
    with pytest.raises(RuntimeError, match="stopping after 2 shard"):
        pc.run(_cfg(run_dir))
    monkeypatch.delenv(pc.FAIL_AFTER_ENV)
    split = run_dir / "store" / "train"
    finished = _shards(split)
    assert list(finished) == [fmt.shard_name(0), fmt.shard_name(1)] and not (split / fmt.MANIFEST).exists()
    with pytest.raises(ValueError, match="unfinished store"):
        StoreReader(split)
    (split / fmt.shard_name(2)).write_bytes(b"half a shard")  # killed mid-write of shard 2, without its record
    (split / (fmt.shard_name(3) + ".tmp")).write_bytes(b"partial")
    manifests = pc.run(_cfg(run_dir))
    assert {k: v for k, v in _shards(split).items() if k in finished} == finished  # not rewritten
    assert _digests(run_dir) == _digests(clean)  # byte for byte the uninterrupted run's shards
    assert manifests["train"]["run"]["shards_resumed"] == 2 and not list(split.glob("*.tmp"))


def test_sigterm_keeps_finished_shards_and_the_rerun_ends_byte_identical(tmp_path, clean, tiny_dir):
    """A real SIGTERM to a real `mtp-train precompute`: the shard in flight is finished, every finished one kept
    (no manifest yet, nothing partial), exit 75; the same command then completes to the uninterrupted bytes."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from mtp_train.preempt import EXIT_PREEMPTED

    run_dir = tmp_path / "run"
    _make_data(run_dir, tiny_dir / "target")
    cmd = [sys.executable, "-m", "mtp_train.cli", "precompute", "recipe=tiny", f"run_dir={run_dir}", *SETTINGS]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), pc.PAUSE_ENV: "0.5"}  # as in-process
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    split = run_dir / "store" / "train"
    t0 = time.time()
    while not (split / fmt.PARTIAL / "shard-00000.json").is_file():
        assert proc.poll() is None and time.time() - t0 < 120, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "precompute: stopped on request (SIGTERM)" in err and "the same command goes on" in err
    kept = _shards(split)
    assert 1 <= len(kept) < len(_digests(clean)["train"]) and not (split / fmt.MANIFEST).exists()
    assert not list(split.glob("*.tmp"))
    done = subprocess.run(cmd, env={**env, pc.PAUSE_ENV: ""}, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert {k: v for k, v in _shards(split).items() if k in kept} == kept  # not rewritten
    assert _digests(run_dir) == _digests(clean)


def test_a_rerun_is_a_no_op_and_a_lost_shard_is_redone(copy, capsys):
    before = _shards(copy / "store" / "train")
    pc.run(_cfg(copy))
    assert "is up to date" in capsys.readouterr().out and _shards(copy / "store" / "train") == before
    (copy / "store" / "train" / fmt.shard_name(1)).unlink()
    m = pc.run(_cfg(copy))["train"]
    assert m["run"]["shards_computed"] == 1 and m["run"]["shards_resumed"] == len(before) - 1
    after = _shards(copy / "store" / "train")
    assert {k: v for k, v in after.items() if k != fmt.shard_name(1)} == \
        {k: v for k, v in before.items() if k != fmt.shard_name(1)}
    assert main(["verify-store", str(copy / "store")]) == 0


def test_verify_store_names_a_flipped_byte(copy, capsys):
    assert main(["verify-store", str(copy / "store")]) == 0
    assert "OK (2 split(s)" in capsys.readouterr().out
    shard = copy / "store" / "train" / fmt.shard_name(2)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    for where in (copy / "store", copy / "store" / "train"):
        assert main(["verify-store", str(where)]) == 1
        out = capsys.readouterr().out
        assert f"BAD  train/{fmt.shard_name(2)}: sha256" in out and f"OK   train/{fmt.shard_name(1)}" in out
        assert out.count("BAD  ") == 1
    assert main(["verify-store", str(copy / "data")]) == 1
    assert "holds no store" in capsys.readouterr().err


def _other_model_dir(tiny_dir: Path, dst: Path, edit: str) -> Path:
    shutil.copytree(tiny_dir / "target", dst)
    name = {"config": "config.json", "tokenizer": "tokenizer_config.json"}[edit]
    obj = json.loads((dst / name).read_text())
    obj["edited_for_test"] = True
    (dst / name).write_text(json.dumps(obj))
    return dst


def test_another_target_tokenizer_or_dataset_is_refused_naming_both_sides(copy, tmp_path, tiny_dir):
    reader = StoreReader(copy / "store" / "train")
    ours = str((tiny_dir / "target").resolve())
    reader.check_identity(target_path=tiny_dir / "target", tokenizer_path=tiny_dir / "target",
                          data_manifest=copy / "data" / "manifest.json")
    other_target = _other_model_dir(tiny_dir, tmp_path / "other_target", "config")
    with pytest.raises(StoreMismatch, match=rf"made from target {ours} \(fingerprint \w+\), this run's target is "
                                            rf"{other_target} \(fingerprint \w+\)"):
        reader.check_identity(target_path=other_target)
    with pytest.raises(StoreMismatch, match=rf"made from target {ours} .*this run's target is {other_target}"):
        pc.run(_cfg(copy, f"target.path={other_target}"))
    other_tok = _other_model_dir(tiny_dir, tmp_path / "other_tok", "tokenizer")
    with pytest.raises(StoreMismatch, match=rf"made from tokenizer {ours} \(sha256 \w+\), this run's tokenizer is "
                                            rf"{other_tok}"):
        reader.check_identity(tokenizer_path=other_tok)
    with pytest.raises(StoreMismatch, match=rf"data in {copy / 'data'} was tokenized with {ours}.*this run's "
                                            rf"tokenizer is {other_tok}"):
        pc.run(_cfg(copy, f"target.path={other_tok}"))
    before = _digests(copy)
    manifest = copy / "data" / "manifest.json"
    old = str(manifest.resolve())
    moved = tmp_path / "elsewhere" / "manifest.json"  # the same bytes elsewhere still match
    moved.parent.mkdir()
    shutil.copy(manifest, moved)
    reader.check_identity(data_manifest=moved)
    manifest.write_text(manifest.read_text().replace('"splits"', '"edited": 1, "splits"'))
    with pytest.raises(StoreMismatch, match=rf"made from data \S+ \(sha256 \w+\), this run's data is {old} \(sha256"):
        reader.check_identity(data_manifest=manifest)
    with pytest.raises(StoreMismatch, match=r"made from data .*Nothing was changed: pass store.overwrite=true"):
        pc.run(_cfg(copy))
    assert _digests(copy) == before


def test_another_store_config_is_refused_then_replaced_with_overwrite(copy):
    before = _shards(copy / "store" / "train")
    with pytest.raises(StoreMismatch, match=r"dtype float32 -> bfloat16 \(store.dtype\); layers \[0, 3\] -> \[\] "
                                            r"\(store.layers\)"):
        pc.run(_cfg(copy, "store.dtype=bfloat16", "store.layers=[]"))
    with pytest.raises(StoreMismatch, match=r"shard_tokens 153 -> 306 \(store.shard_mb\)"):
        pc.run(_cfg(copy, "store.shard_mb=0.9"))
    assert _shards(copy / "store" / "train") == before  # nothing touched
    m = pc.run(_cfg(copy, "store.dtype=bfloat16", "store.overwrite=true"))["train"]
    assert m["dtype"] == "bfloat16" and m["bytes_per_token"] == 3 * 2 * 256 + 5
    assert main(["verify-store", str(copy / "store")]) == 0


def test_two_ranks_under_torchrun_write_the_same_store(clean, tmp_path, tiny_dir):
    run_dir = tmp_path / "run"
    _make_data(run_dir, tiny_dir / "target")
    # the clean run's thread count: another one may sum in another order and change the last bits
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "mtp_train",
           "precompute", f"run_dir={run_dir}", *SETTINGS]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert _digests(run_dir) == _digests(clean)
    m = fmt.read_manifest(run_dir / "store" / "train")
    assert m["run"]["world_size"] == 2 and out.stdout.count("mtp-train precompute: recipe") == 1  # rank 0 speaks


def _mapped_bytes(path: Path) -> int:
    """Bytes of `path` resident in this process's memory maps (Linux /proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    return sum(int(next(x for x in lines[k + 1:] if x.startswith("Rss:")).split()[1]) * 1024
               for k, line in enumerate(lines) if line.endswith(str(path)))


def test_reader_maps_only_the_rows_it_reads(tmp_path):
    gen = torch.Generator().manual_seed(1)
    lengths = [int(x) for x in torch.randint(50, 400, (200,), generator=gen)]
    samples = [{"hidden": torch.randn(t, 256, generator=gen), "input_ids": torch.randint(0, 9, (t,), generator=gen),
                "loss_mask": torch.rand(t, generator=gen) < 0.5} for t in lengths]
    m = fmt.write_split(tmp_path / "s", samples, identity=fmt.identity_for(), shard_mb=64)
    assert m["totals"]["shards"] == 1 and m["totals"]["bytes"] > 40e6  # one shard of ~46 MB
    reader = StoreReader(tmp_path / "s")
    i = 117
    got = reader[i]
    if Path("/proc/self/smaps").is_file():
        # the sample's rows and what the kernel maps around them (up to a 2 MB folio), not the whole file
        assert 0 < _mapped_bytes(tmp_path / "s" / fmt.shard_name(0)) < m["totals"]["bytes"] / 8
    assert torch.equal(got["hidden"], samples[i]["hidden"]) and torch.equal(got["input_ids"], samples[i]["input_ids"])
    assert torch.equal(got["loss_mask"], samples[i]["loss_mask"]) and "layers" not in got
    assert reader.lengths.tolist() == lengths and len(reader) == 200
    assert torch.equal(reader[-1]["hidden"], samples[-1]["hidden"])
    clone = pickle.loads(pickle.dumps(reader))  # what a DataLoader worker gets: no maps, reopened on use
    assert len(pickle.dumps(reader)) < 1 << 20 and torch.equal(clone[5]["hidden"], samples[5]["hidden"])
    with pytest.raises(IndexError):
        reader[200]


@pytest.mark.parametrize("dtype, bound", [("float32", 0.0), ("bfloat16", 2**-8), ("float16", 2**-11),
                                          ("float8_e4m3", 2**-4)])
def test_storage_dtype_round_trip(tmp_path, dtype, bound):
    gen = torch.Generator().manual_seed(2)
    # tokens whose magnitudes differ by 1000x: a per-token scale keeps each one's relative error small
    x = torch.randn(300, 64, generator=gen) * torch.logspace(-2, 1, 300)[:, None]
    back = fmt.decode(*fmt.encode(x, dtype))
    per_token = (back - x).norm(dim=1) / x.norm(dim=1)  # relative error of each token's vector
    assert per_token.max() <= bound and back.dtype == torch.float32
    if dtype == "float8_e4m3":
        assert 0.01 < per_token.mean() < 0.04  # 3 mantissa bits: about 2-3%
    layers = torch.randn(2, 300, 64, generator=gen)
    samples = [{"hidden": x[a:a + 100], "input_ids": torch.arange(100), "loss_mask": torch.ones(100, dtype=torch.bool),
                "layers": layers[:, a:a + 100]} for a in (0, 100, 200)]
    shard_mb = 100 * fmt.bytes_per_token(dtype, 64, 2) / 2**20  # 100 tokens: one sample per shard
    fmt.write_split(tmp_path / "s", samples, identity=fmt.identity_for(), dtype=dtype, layers=[1, 5], shard_mb=shard_mb)
    reader = StoreReader(tmp_path / "s")
    assert reader.manifest["totals"]["shards"] == 3 and reader.layers == [1, 5]
    torch.testing.assert_close(reader[1]["hidden"], back[100:200], rtol=0, atol=0)
    raw = safetensors.torch.load_file(tmp_path / "s" / fmt.shard_name(1))  # safetensors' own reader agrees
    data, scale = fmt.encode(x[100:200], dtype)
    assert torch.equal(raw["hidden"].view(torch.uint8), data.view(torch.uint8)) and raw["hidden"].dtype == data.dtype
    assert scale is None or torch.equal(raw["scale"], scale)
    torch.testing.assert_close(reader[2]["layers"], fmt.decode(*fmt.encode(layers[:, 200:].reshape(200, 64), dtype))
                               .reshape(2, 100, 64), rtol=0, atol=0)
    assert (tmp_path / "s" / fmt.shard_name(0)).stat().st_size // 100 == pytest.approx(
        fmt.bytes_per_token(dtype, 64, 2), abs=30)  # header and offsets are the rest


def test_config_validation_and_placement():
    for bad, message in [({"dtype": "int8"}, "store.dtype='int8'"), ({"layers": [2, 2]}, "distinct"),
                         ({"shard_mb": 0}, "shard_mb"), ({"batch_tokens": 0}, "batch_tokens"),
                         ({"gpus_per_process": 0}, "gpus_per_process")]:
        with pytest.raises(ValueError, match=message):
            StoreConfig(**bad)
    assert StoreConfig().storage_dtype("bfloat16") == "bfloat16"
    assert StoreConfig(dtype="float8_e4m3").storage_dtype("bfloat16") == "float8_e4m3"
    assert fwd.gpu_indices(1, 4, 8) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="needs GPUs 4..7, but this node has 6"):
        fwd.gpu_indices(1, 4, 6)
    cfg = compose("tiny", ["run_dir=x", "store.gpus_per_process=2", "target.device=cpu"])
    with pytest.raises(ValueError, match="needs GPUs; the target runs on the CPU"):
        fwd.placement(cfg.target, cfg.store, fwd.Ranks())


def test_layer_out_of_range_and_missing_data(tmp_path, tiny_dir, capsys):
    assert main(["precompute", f"run_dir={tmp_path}"]) == 1
    assert f"data manifest not found: {tmp_path / 'data' / 'manifest.json'}" in capsys.readouterr().err
    _make_data(tmp_path, tiny_dir / "target", n_train=2, n_val=1)
    with pytest.raises(ValueError, match=r"store.layers \[5\] out of range: the target has 4 decoder layers \(0..3, "
                                         r"and 4 for the final norm's input\)"):
        pc.run(_cfg(tmp_path, "store.layers=[1,5]"))


def test_layer_L_is_the_last_layers_output_before_the_final_norm(tmp_path, tiny_dir):
    """store.layers=[4] on the 4-layer target keeps what speculators trains on: the last decoder layer's output,
    caught independently here by a forward hook on that layer; the final norm of it is the stored `hidden`."""
    import datasets

    _make_data(tmp_path, tiny_dir / "target", n_train=3, n_val=1)
    pc.run(_cfg(tmp_path, "store.layers=[4]"))
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "target", dtype=torch.float32).eval()
    caught = []
    model.model.layers[3].register_forward_hook(lambda m, args, out: caught.append(out[0] if isinstance(out, tuple)
                                                                                   else out))
    reader = StoreReader(tmp_path / "store" / "train")
    assert reader.layers == [4]
    for i, row in enumerate(datasets.load_from_disk(str(tmp_path / "data" / "train"))):
        with torch.no_grad():
            model(torch.tensor([row["input_ids"]]))
        got = reader[i]
        torch.testing.assert_close(got["layers"][0], caught[-1][0], atol=2e-5, rtol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(model.model.norm(got["layers"][0]), got["hidden"], atol=2e-5, rtol=1e-5)
        assert (got["layers"][0] - got["hidden"]).abs().max() > 0.1  # not the normed state again


def test_length_batches_and_plan():
    lengths = [5, 50, 0, 20, 49, 7, 300]
    batches = fwd.length_batches(lengths, 100)  # no padding multiple: a batch holds samples of one length
    assert sorted(j for b in batches for j in b) == [0, 1, 3, 4, 5, 6]  # every non-empty sample once
    assert batches == [[6], [1], [4], [3], [5], [0]]  # longest first; over-budget samples alone
    # padded to multiples of 16: 50 and 49 -> 64 share a batch, 5 and 7 -> 16 too; 20 -> 32 alone
    batches = fwd.length_batches(lengths, 130, multiple=16)
    assert batches == [[6], [1, 4], [3], [5, 0]]
    assert all(len(b) * fwd.padded_length(lengths[b[0]], 16) <= 130 for b in batches[1:])
    assert fwd.length_batches([64, 60, 64, 1], 128, multiple=64) == [[0, 2], [1, 3]]  # all padded to 64
    assert fmt.plan_shards([5, 50, 0, 20, 49, 7, 300], 60) == [(0, 3), (3, 4), (4, 6), (6, 7)]
    assert fmt.plan_shards([], 10) == []


def test_sigterm_while_the_target_loads_exits_75(tmp_path, tiny_dir):
    """A stop request before the first shard (the target loading) ends precompute at once with 75, the plan
    recorded and no shard; the same command then completes."""
    from stops import signalled_run

    from mtp_train.preempt import EXIT_PREEMPTED

    run_dir = tmp_path / "run"
    _make_data(run_dir, tiny_dir / "target")
    args = ["precompute", "recipe=tiny", f"run_dir={run_dir}", *SETTINGS]
    done = signalled_run(args, "mtp_train.store.precompute:load_decoder")
    assert done.returncode == EXIT_PREEMPTED, done.stderr
    assert "precompute: stopped on request (SIGTERM) outside a shard (start-up: planning, loading the target), at " \
           "once: nothing was being written" in done.stderr
    split = run_dir / "store" / "train"
    assert not _shards(split) and not (split / fmt.MANIFEST).exists() and not list(split.glob("*.tmp"))
    assert set(pc.run(compose("tiny", [f"run_dir={run_dir}", *SETTINGS]))) == {"train", "val"}
