"""Training on several processes: two CPU processes under torchrun (gloo) with DDP and with DeepSpeed ZeRO-1/2/3
follow the loss trajectory of one process with the same global batch; checkpoints resume exactly at the same
world size, hold the full head under every ZeRO stage, and are refused under another strategy. Plus the
pieces on their own: the loss normalization, the data split, the strategy choice, activation checkpointing.

Tolerance. The processes compute the same micro-batches as the one process; only the order of additions
differs (gradients summed across ranks, DeepSpeed's flat fp32 partitions, another thread count), which
moves fp32 results in their last bits, and Adam carries that drift. Measured over these 5 steps (loss
18.0 -> 12.5): per-step losses within 1e-7 relative, gradient norms within 2e-6, final weights within
2e-6 absolute. The tests allow RTOL = 1e-5 on the logged scalars and 1e-5 absolute (+ 1e-4 relative) on the
weights; a wrong gradient scale, a missed all-reduce or a rank's metrics logged alone are off by percents.
A resumed run equals the uninterrupted one exactly.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from mtp_train.config import compose
from mtp_train.model.head import DraftHead, unrolled
from mtp_train.train import checkpoint as ckpt
from mtp_train.train import distributed as dist
from mtp_train.train.data import rank_batches
from mtp_train.train.loss import LossConfig, counted_positions, head_loss
from mtp_train.train.trainer import Trainer
from windows import code_windows, make_store

ROOT = Path(__file__).resolve().parents[1]
RTOL = 1e-5
T = 40
COMMON = ["train.micro_batch=4", "train.depth=2", "train.steps=5", "train.lr=2e-3", "train.warmup_steps=2",
          "train.max_grad_norm=0.5", "train.eval_every=0", "train.log_every=1", "train.save_every=3"]


@pytest.fixture(scope="module")
def samples(tiny_dir):
    """64 windows of stdlib code (48 train, 16 val) with the tiny target's hidden states; lengths 25..40 and
    between 2 and 14 untrained leading positions, so micro-batches count different numbers of positions."""
    ids, hidden = code_windows(tiny_dir / "target", slice(40, 80), T)
    out = []
    for i in range(len(ids)):
        n = T - (i * 7) % 16
        mask = torch.ones(n, dtype=torch.int8)
        mask[: 2 + (i * 5) % 13] = 0
        out.append({"hidden": hidden[i, :n].clone(), "input_ids": ids[i, :n].clone(), "loss_mask": mask})
    return out


def rows(run_dir: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        assert not ("train/loss" in r and "train/loss" in out.get(r["step"], {})), f"step {r['step']} logged twice"
        out.setdefault(r["step"], {}).update(r)
    return out


def assert_same_trajectory(got: Path, ref: Path, exact: bool = False) -> None:
    a, b = rows(got), rows(ref)
    assert sorted(s for s in a if "train/loss" in a[s]) == list(range(1, 6))
    for s in range(1, 6):
        for key in ("train/loss", "train/grad_norm", "train/d1/ce", "train/d2/ce", "train/d1/feat", "train/lr"):
            if exact:
                assert a[s][key] == b[s][key], (got.name, s, key)
            else:
                assert a[s][key] == pytest.approx(b[s][key], rel=RTOL), (got.name, s, key, a[s][key], b[s][key])
        for key in ("train/tokens", "train/d1/n", "train/d2/n"):
            assert a[s][key] == b[s][key], (got.name, s, key)
    for key in ("val/d1/ce", "val/d2/ce", "val/d1/accept", "val/d1/n"):
        assert a[5][key] == pytest.approx(b[5][key], rel=0 if exact else RTOL), (got.name, key)
    wa = ckpt.load_head_state(got / "checkpoints" / "step-000005")
    wb = ckpt.load_head_state(ref / "checkpoints" / "step-000005")
    assert wa.keys() == wb.keys()
    for k in wb:
        assert wa[k].shape == wb[k].shape, (got.name, k)  # the full head, whatever the ZeRO stage
        if exact:
            assert torch.equal(wa[k], wb[k]), (got.name, k)
        else:
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5, msg=f"{got.name}: {k}")


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory, samples, tiny_dir):
    """One process (grad_accum 4) and, in one torchrun launch of two processes (grad_accum 2 each: the same
    global batch), DDP, ZeRO-1, ZeRO-2, ZeRO-3, a ZeRO-2 run killed after its step-3 checkpoint and resumed,
    and a resume of that run under DDP (refused)."""
    base = tmp_path_factory.mktemp("dist")
    target = tiny_dir / "target"
    single = make_store(base / "single", samples, target)
    Trainer(compose("tiny", [f"run_dir={single}", *COMMON, "train.grad_accum=4"])).fit()
    runs = {"ddp": ["train.strategy=ddp"], "zero1": ["train.strategy=deepspeed", "train.zero_stage=1"],
            "zero2": ["train.strategy=deepspeed", "train.zero_stage=2"],
            "zero3": ["train.strategy=deepspeed", "train.zero_stage=3"]}
    spec = [{"name": name, "args": [f"run_dir={make_store(base / name, samples, target)}", *COMMON,
                                    "train.grad_accum=2", *extra]} for name, extra in runs.items()]
    resumed = make_store(base / "zero2-resumed", samples, target)
    z2 = [f"run_dir={resumed}", *COMMON, "train.grad_accum=2", "train.strategy=deepspeed", "train.zero_stage=2"]
    spec += [{"name": "zero2-killed", "args": z2, "die_at": 5},
             {"name": "zero2-resumed", "args": [*z2, "resume=true"]},
             {"name": "ddp-resume-refused", "args": [f"run_dir={base / 'zero2'}", *COMMON, "train.grad_accum=2",
                                                     "train.strategy=ddp", "resume=true", "train.steps=6"]}]
    for at, rank in (("space", 1), ("write", 0)):  # one rank's disk full at the step-5 checkpoint, then a rerun
        ddp = [f"run_dir={make_store(base / f'full-{at}', samples, target)}", *COMMON, "train.grad_accum=2",
               "train.strategy=ddp"]
        spec += [{"name": f"full-{at}", "args": ddp, "full_disk": {"rank": rank, "step": 5, "at": at}},
                 {"name": f"full-{at}-rerun", "args": [*ddp, "resume=true"]}]
    (base / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),  # two processes, one thread each
           "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist_worker.py"), str(base / "spec.json"), str(base / "results.json")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    print("\n".join(line for line in out.stdout.splitlines() if line.startswith("dist_worker:")))
    return base, json.loads((base / "results.json").read_text()), out


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3"])
def test_two_processes_follow_one(two_process_runs, name):
    base, codes, _ = two_process_runs
    assert codes[name] == 0
    assert_same_trajectory(base / name, base / "single")
    if name.startswith("zero"):  # DeepSpeed's per-rank optimizer partitions beside the full head
        step = base / name / "checkpoints" / "step-000005"
        assert len(list((step / dist.DEEPSPEED_DIR / dist.DEEPSPEED_TAG).glob("*optim_states.pt"))) == 2
        assert not (step / "optimizer.pt").exists()


def test_rank_zero_alone_speaks(two_process_runs):
    _, _, out = two_process_runs
    assert out.stdout.count("train: head mtp") == 10  # the runs that started training; the refused one did not
    assert out.stdout.count("memory per GPU (estimate, deepspeed ZeRO-3 x 2)") == 1
    assert "ddp x 2" in out.stdout


def test_deepspeed_resumes_exactly_at_the_same_world_size(two_process_runs):
    base, codes, _ = two_process_runs
    assert codes["zero2-killed"] == "killed" and codes["zero2-resumed"] == 0
    assert_same_trajectory(base / "zero2-resumed", base / "zero2", exact=True)


def test_resume_under_another_strategy_is_refused(two_process_runs):
    base, codes, out = two_process_runs
    assert codes["ddp-resume-refused"] == 1
    assert "holds its optimizer state as DeepSpeed ZeRO-2 partitions over 2 process(es)" in out.stderr
    assert "Resume with the checkpoint's train.strategy, train.zero_stage" in out.stderr


@pytest.mark.parametrize("at,rank", [("space", 1), ("write", 0)])
def test_a_full_disk_on_one_rank_stops_every_rank(two_process_runs, at, rank):
    """One rank runs out of space at the step-5 checkpoint (rank 1 in the space check every rank makes first;
    rank 0 while writing the checkpoint's files): both ranks stop with that error instead of the other one
    waiting at the next collective, nothing partial is left, step 3 stays the intact latest checkpoint, and
    the rerun with resume=true ends exactly where the uninterrupted run does."""
    base, codes, out = two_process_runs
    name = f"full-{at}"
    assert codes[name] == 1 and codes[f"{name}/rank1"] == 1
    other = 1 - rank
    where = "its space check" if at == "space" else "writing the checkpoint"
    assert re.search(rf"error: \[Errno 28\] rank {rank} failed {where}: no space left writing checkpoint "
                     rf"\S+/{name}/checkpoints/step-000005\.tmp: it needs about [\d,]+ bytes", out.stderr), other
    assert re.search(rf"error: \[Errno 28\] no space left writing checkpoint \S+/{name}/checkpoints/"
                     r"step-000005\.tmp: .* the last complete checkpoint \(\S+step-000003\) is untouched", out.stderr)
    assert codes[f"{name}-rerun"] == 0
    assert re.search(rf"train: resumed from \S*/{name}/checkpoints/step-000003 \(step 3", out.stdout)
    root = base / name / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000003", "step-000005"]
    assert ckpt.newest_intact(root, say=lambda m: None) == root / "step-000005"
    assert_same_trajectory(base / name, base / "ddp", exact=True)


class Planted:
    """What a planted pickle does: run code while it is read."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_pickle_in_a_deepspeed_partition_is_never_run(two_process_runs, tmp_path):
    """DeepSpeed unpickles its partitions in full; the allow-list check before it passes DeepSpeed's real files
    (ZeRO-1/2/3: `test_two_processes_follow_one` resumes none, so here directly) and refuses a partition that
    names another global, without running it; only the rank that reads a partition checks it."""
    base, _, _ = two_process_runs
    for name in ("zero1", "zero2", "zero3"):
        for rank in (0, 1):
            dist.check_deepspeed_files(base / name / "checkpoints" / "step-000005" / dist.DEEPSPEED_DIR
                                       / dist.DEEPSPEED_TAG, rank)
    step = tmp_path / "step-000005"
    shutil.copytree(base / "zero2" / "checkpoints" / "step-000005", step)
    zero = step / dist.DEEPSPEED_DIR / dist.DEEPSPEED_TAG
    victim = zero / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    marker = tmp_path / "it-ran"
    torch.save({"optimizer_state_dict": Planted(marker), "ds_version": "0.19.0"}, victim)
    dist.check_deepspeed_files(zero, 0)  # rank 0 does not read rank 1's partition
    with pytest.raises(ValueError, match=rf"{victim.name} holds more than tensors, plain values and DeepSpeed's own "
                                         r"classes, so it is not loaded: unpickling it would run code"):
        dist.check_deepspeed_files(zero, 1)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------ the pieces


def _tiny_head(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=50, head_dim=8)
    return DraftHead(config), torch.nn.Embedding(50, 32).requires_grad_(False), torch.randn(50, 32) * 0.3


def _batch(gen, B, T):
    lengths = torch.randint(T // 2, T + 1, (B,), generator=gen)
    mask = (torch.rand(B, T, generator=gen) < 0.6) & (torch.arange(T)[None] < lengths[:, None])
    return {"hidden": torch.randn(B, T, 32, generator=gen), "input_ids": torch.randint(0, 50, (B, T), generator=gen),
            "loss_mask": mask, "lengths": lengths}


def _grads(head, embed, W, batches, norm):
    head.zero_grad()
    for b in batches:
        outs = unrolled(head, embed, b["hidden"], b["input_ids"], b["lengths"], 2)
        loss, _ = head_loss(outs, b["hidden"], b["loss_mask"], b["lengths"], W, LossConfig(chunk_tokens=7),
                            norm=norm(b))
        (loss if norm(b) is not None else loss / len(batches)).backward()
    return torch.cat([p.grad.flatten() for p in head.parameters()])


def test_global_count_normalization_makes_the_split_irrelevant():
    """The gradient of micro-batches normalized by the step's global counts equals that of the whole batch in
    one forward, although the micro-batches count different numbers of positions; the mean of per-micro-batch
    means (the alternative) does not."""
    gen = torch.Generator().manual_seed(0)
    head, embed, W = _tiny_head()
    parts = [_batch(gen, 2, 12) for _ in range(3)]
    whole = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    counts = [counted_positions(p["loss_mask"], p["lengths"], 2) for p in parts]
    assert len({c[0] for c in counts}) > 1  # the micro-batches differ in what they count
    total = [sum(c[j] for c in counts) for j in range(2)]
    ref = _grads(head, embed, W, [whole], lambda b: None)
    split = _grads(head, embed, W, parts, lambda b: total)
    torch.testing.assert_close(split, ref, rtol=1e-5, atol=1e-7)
    mean_of_means = _grads(head, embed, W, parts, lambda b: None)
    assert (mean_of_means - ref).norm() > 1e-3 * ref.norm()


def test_ranks_split_each_step_without_overlap_or_loss():
    """Over the ranks, a step holds exactly the micro-batches one process takes with world x grad_accum."""
    lengths = [int(x) for x in torch.randint(5, 90, (203,), generator=torch.Generator().manual_seed(1))]
    world, accum, mb = 3, 2, 4
    one = rank_batches(lengths, mb, 7, 0, 0, 1, world * accum)
    ranks = [rank_batches(lengths, mb, 7, 0, r, world, accum) for r in range(world)]
    assert len({len(r) for r in ranks}) == 1
    for s in range(len(ranks[0]) // accum):
        got = sorted(i for r in ranks for b in r[s * accum:(s + 1) * accum] for i in b)
        want = sorted(i for b in one[s * world * accum:(s + 1) * world * accum] for i in b)
        assert got == want and len(set(got)) == len(got)


def test_strategy_choice_and_launch_checks():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert dist.resolve_strategy("auto", 1, gpu) == "single"
    assert dist.resolve_strategy("auto", 8, gpu) == "deepspeed"
    assert dist.resolve_strategy("auto", 2, cpu) == "ddp"
    with pytest.raises(ValueError, match="train.strategy=single, but torchrun started 2 processes"):
        dist.resolve_strategy("single", 2, cpu)
    with pytest.raises(ValueError, match="launch with torchrun"):
        with dist.process_group("cpu", "deepspeed"):
            pass
    head = DraftHead(LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 num_hidden_layers=1, vocab_size=64, head_dim=8))
    zero3 = dist.EngineSettings("deepspeed", 3, 2, 1, 4, 1.0)
    with pytest.raises(ValueError, match="activation_checkpointing with DeepSpeed ZeRO-3 is not supported"):
        dist.build_engine(head, None, None, zero3, cpu, activation_checkpointing=True)
    with pytest.raises(ValueError, match=r"train.zero_stage=4: expected 1, 2 or 3"):
        compose("tiny", ["run_dir=r", "train.zero_stage=4"])
    with pytest.raises(ValueError, match=r"train.strategy='fsdp'"):
        compose("tiny", ["run_dir=r", "train.strategy=fsdp"])


def _saved_bytes(head, embed, W, batch) -> int:
    params = {p.untyped_storage().data_ptr() for p in head.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = unrolled(head, embed, batch["hidden"], batch["input_ids"], batch["lengths"], 2)
        loss, _ = head_loss(outs, batch["hidden"], batch["loss_mask"], batch["lengths"], W, LossConfig())
    loss.backward()
    return sum(seen.values())


def test_activation_checkpointing_keeps_gradients_and_frees_the_mlp():
    gen = torch.Generator().manual_seed(3)
    batch = _batch(gen, 3, 16)
    plain, embed, W = _tiny_head()
    checkpointed, _, _ = _tiny_head()
    dist.apply_activation_checkpointing(checkpointed)
    assert plain.state_dict().keys() == checkpointed.state_dict().keys()  # checkpoints do not change
    kept = _saved_bytes(plain, embed, W, batch), _saved_bytes(checkpointed, embed, W, batch)
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    # the MLP's gate, up, act and product (4 x 64 per position and step) are no longer kept
    assert kept[0] - kept[1] >= 2 * 3 * 16 * (4 * 64 - 32) * 4 * 0.9
