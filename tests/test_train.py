"""The trainer on small stores made from the tiny target: it learns, leaves the frozen tensors alone,
resumes exactly, stops on NaN keeping the last good checkpoint, and refuses another target's store."""

import json

import pytest
import torch

from mtp_train.config import compose
from mtp_train.model.frozen import FrozenTarget
from mtp_train.store.format import identity_for, write_split
from mtp_train.train import checkpoint as ckpt
from mtp_train.train.trainer import Trainer, TrainingDiverged, feature_noise
from windows import code_windows, make_store

T = 48


@pytest.fixture(scope="module")
def samples(tiny_dir):
    """64 windows of T tokens of head-train stdlib code with the tiny target's hidden states after its norm;
    the first 48 train, the last 16 validate. Tokens of the first 8 positions are not trainable."""
    ids, hidden = code_windows(tiny_dir / "target", slice(0, 40), T)
    out = []
    for i in range(len(ids)):
        n = T - (i % 5) * 3  # different lengths: padded batches
        mask = torch.ones(n, dtype=torch.int8)
        mask[:8] = 0
        out.append({"hidden": hidden[i, :n].clone(), "input_ids": ids[i, :n].clone(), "loss_mask": mask})
    return out


def config(run_dir, *overrides):
    return compose("tiny", [f"run_dir={run_dir}", "train.micro_batch=8", "train.warmup_steps=2",
                            "train.eval_every=0", "train.log_every=1", *overrides])


@pytest.fixture
def run_dir(tmp_path, samples, tiny_dir):
    make_store(tmp_path, samples, tiny_dir / "target")
    return tmp_path


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.mark.parametrize("variant", ["mtp", "eagle1"])
def test_training_beats_the_untrained_head(run_dir, variant):
    cfg = config(run_dir, f"head.variant={variant}", "train.steps=36", "train.lr=2e-3", "train.depth=2")
    summary = Trainer(cfg).fit()
    start, final = summary["start"], summary["final"]
    assert final["d1/acc"] > start["d1/acc"] + 0.15
    assert final["d1/accept"] > start["d1/accept"] + 0.15
    assert final["d2/acc"] > start["d2/acc"] + 0.05
    assert final["d1/ce"] < start["d1/ce"]
    # the checkpoint holds the head's own weights only
    path = ckpt.latest(run_dir / "checkpoints")
    state = ckpt.load_head_state(path)
    assert not any("embed" in k or "lm_head" in k for k in state)
    head_keys = {"mtp": "eh_proj.weight", "eagle1": "fc.weight"}[variant]
    assert head_keys in state
    meta = ckpt.load_meta(path)
    assert meta["variant"] == variant and meta["step"] == 36


def test_frozen_tensors_untouched_by_steps(run_dir, tiny_dir):
    trainer = Trainer(config(run_dir, "train.steps=3", "train.lr=1e-2", "train.save_every=0"))
    before = {k: v.clone() for k, v in trainer.frozen.state_dict().items()}
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in optimized for p in trainer.frozen.parameters())
    trainer.fit()
    for k, v in trainer.frozen.state_dict().items():
        assert torch.equal(v, before[k]), k
    on_disk = FrozenTarget.from_pretrained(tiny_dir / "target")
    assert torch.equal(trainer.frozen.embed_tokens.weight, on_disk.embed_tokens.weight)


def killed_after(cfg, step: int, monkeypatch) -> None:
    """Train `cfg` and kill it (KeyboardInterrupt) once `step` optimizer steps are done."""
    real_step = Trainer.train_step

    def dies(self, micro):
        if self.step == step:
            raise KeyboardInterrupt("killed")
        return real_step(self, micro)

    monkeypatch.setattr(Trainer, "train_step", dies)
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg).fit()
    monkeypatch.setattr(Trainer, "train_step", real_step)


@pytest.mark.parametrize("save_every,position,extra", [(4, (4, 0, 8), ()), (5, (5, 0, 10), ()),
                                                      (4, (4, 0, 8), ("train.feature_noise=0.3", "train.ema_decay=0.9"))])
def test_resume_is_exact(tmp_path, samples, tiny_dir, monkeypatch, save_every, position, extra):
    """Killed before step 7 (steps after the checkpoint already logged), resumed from the checkpoint
    mid-epoch or at the epoch's end: the losses of every step and the final weights equal those of an
    uninterrupted run, bit for bit (with `train.feature_noise` and `train.ema_decay` too: the same noise after the
    resume, the same average and trained weights)."""
    args = ("train.steps=8", f"train.save_every={save_every}", "train.grad_accum=2", "train.micro_batch=4", "train.depth=2",
            "train.lr=1e-3", *extra)
    clean, broken = tmp_path / "clean", tmp_path / "broken"
    for d in (clean, broken):
        make_store(d, samples, tiny_dir / "target", n_train=40)  # 10 micro-batches: epochs roll over
    Trainer(config(clean, *args)).fit()
    killed_after(config(broken, *args), 6, monkeypatch)  # steps 5 and 6 run and are logged after the checkpoint
    assert (broken / "checkpoints" / "latest").read_text().strip() == f"step-{save_every:06d}"
    resumed = Trainer(config(broken, *args, "resume=true"))
    assert (resumed.step, resumed.epoch, resumed.consumed) == position  # an epoch is 5 steps here
    resumed.fit()
    a, b = losses(clean), losses(broken)
    assert [a[s] for s in range(1, 9)] == [b[s] for s in range(1, 9)]
    wa = ckpt.load_head_state(clean / "checkpoints" / "step-000008")
    wb = ckpt.load_head_state(broken / "checkpoints" / "step-000008")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    la = ckpt.load_trainer_state(clean / "checkpoints" / "step-000008").get("live_head")
    lb = ckpt.load_trainer_state(broken / "checkpoints" / "step-000008").get("live_head")
    assert (la is None) == (lb is None) == (not extra)
    assert la is None or all(torch.equal(la[k], lb[k]) for k in la)


def test_weight_average_is_what_evaluations_and_checkpoints_hold(run_dir, monkeypatch):
    """`train.ema_decay=d`: after each step t the average moves to the trained weights by 1 - min(d, (1+t)/(10+t));
    evaluations measure it, head.safetensors holds it (what validate and export read), trainer_state keeps the
    trained weights, and the head trains on from the trained weights, not the average."""
    trainer = Trainer(config(run_dir, "train.steps=4", "train.lr=1e-2", "train.save_every=0", "train.ema_decay=0.3"))
    after = []
    real = Trainer.update_average

    def record(self):
        after.append({n: p.detach().clone() for n, p in self.head.named_parameters()})
        real(self)

    monkeypatch.setattr(Trainer, "update_average", record)
    trainer.fit()
    # recompute from the start: the average begins at the initial weights (the seeded init)
    fresh = run_dir / "fresh"
    fresh.mkdir()
    (fresh / "store").symlink_to(run_dir / "store")
    start = {n: p.detach().clone() for n, p in Trainer(config(fresh, "train.steps=4")).head.named_parameters()}
    avg = {n: v.clone() for n, v in start.items()}
    for t, w in enumerate(after, start=1):
        d = min(0.3, (1 + t) / (10 + t))  # the cap from step 3
        for n in avg:
            avg[n].mul_(d).add_(w[n], alpha=1 - d)
    assert len(after) == 4
    assert all(torch.equal(trainer.ema[n], avg[n]) for n in avg)
    path = ckpt.latest(run_dir / "checkpoints")
    saved, live = ckpt.load_head_state(path), ckpt.load_trainer_state(path)["live_head"]
    assert all(torch.equal(saved[n], avg[n]) for n in avg)  # the checkpoint's head is the average
    trained = dict(trainer.head.named_parameters())
    assert all(torch.equal(live[n], trained[n].detach()) for n in avg)  # the head went on with its trained weights
    assert not torch.equal(live["eh_proj.weight"], saved["eh_proj.weight"])
    assert ckpt.load_meta(path)["ema_decay"] == 0.3
    # an evaluation measures the average: the same numbers as the head loaded with it by hand, not the trained ones
    measured = trainer.validate()
    assert all(torch.equal(p.detach(), live[n]) for n, p in trainer.head.named_parameters())  # put back after
    trainer.ema = None
    on_trained = trainer.validate()
    trainer.head.load_state_dict(saved)
    assert measured == trainer.validate() and measured != on_trained


def test_resume_across_a_weight_average_switched_on_or_off(run_dir, capsys):
    """An averaged run resumed without the average goes on from its trained weights (never the average that
    head.safetensors holds); a plain run resumed with one starts the average from its weights. Both say so."""
    args = ("train.steps=6", "train.lr=1e-2", "train.save_every=3")
    Trainer(config(run_dir, *args, "train.ema_decay=0.5", "train.steps=3")).fit()
    path = ckpt.latest(run_dir / "checkpoints")
    live, average = ckpt.load_trainer_state(path)["live_head"], ckpt.load_head_state(path)
    plain = Trainer(config(run_dir, *args, "resume=true"))
    assert plain.ema is None and all(torch.equal(p.detach(), live[n]) for n, p in plain.head.named_parameters())
    assert "goes on from its trained weights, without a weight average" in capsys.readouterr().out
    plain.fit()
    again = Trainer(config(run_dir, *args, "train.steps=8", "train.ema_decay=0.5", "resume=true"))
    trained = ckpt.load_head_state(ckpt.latest(run_dir / "checkpoints"))
    assert all(torch.equal(again.ema[n], trained[n]) for n in again.ema)  # the plain run's weights
    assert "the weight average starts from its weights" in capsys.readouterr().out
    assert not torch.equal(live["eh_proj.weight"], average["eh_proj.weight"])


def test_a_weight_average_is_refused_under_zero3_before_anything_is_built(tmp_path):
    """ZeRO-3 partitions the head, so no rank could hold the average: refused at once, before a store is opened or
    DeepSpeed started (the run_dir here holds no store at all), naming the stages that work."""
    with pytest.raises(ValueError, match=r"train.ema_decay=0.9 .*ZeRO-3.*train.zero_stage=1 or 2"):
        Trainer(config(tmp_path, "train.ema_decay=0.9", "train.strategy=deepspeed", "train.zero_stage=3"))
    assert not (tmp_path / "checkpoints").exists()


def test_feature_noise_is_relative_bounded_seeded_and_leaves_the_global_rng_alone():
    """Each position's state (each of an eagle3 input's k states) gets noise within a x its median |x|: a state
    of 1s and 300s (a massive activation) gets +-a, one 4 times larger +-4a; the same key draws the same noise."""
    H = 16
    state = torch.ones(H)
    state[3] = 300.0
    x = torch.stack([state, 4 * state]).repeat(4, 50, 1, 1).flatten(-2)  # [4, 50, 2·H]: two states a position
    torch.manual_seed(7)
    before = torch.get_rng_state()
    a = feature_noise(x, 0.25, H, seed=3, step=5, rank=0, micro=1) - x
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(a, feature_noise(x, 0.25, H, seed=3, step=5, rank=0, micro=1) - x)
    first, second = a[..., :H], a[..., H:]
    assert 0.24 < float(first.abs().max()) <= 0.25 + 1e-6 and 0.96 < float(second.abs().max()) <= 1.0 + 1e-5
    assert abs(float(a.mean())) < 0.02
    for other in ({"seed": 4}, {"step": 6}, {"rank": 1}, {"micro": 0}):
        key = {"seed": 3, "step": 5, "rank": 0, "micro": 1, **other}
        assert not torch.equal(a, feature_noise(x, 0.25, H, **key) - x), other


def test_feature_noise_perturbs_the_training_inputs_only(run_dir, monkeypatch):
    """`train.feature_noise=a`: each training forward reads the store's features plus noise within a x the median
    |x| of each position's state, other
    noise on every micro-batch and step; the batch itself (the feature loss's label: this tiny recipe is an `mtp`
    head, whose input is also its label) stays clean, and evaluation reads clean features."""
    args = ("train.steps=2", "train.grad_accum=2", "train.micro_batch=4", "train.save_every=0")
    trainer = Trainer(config(run_dir, *args, "train.feature_noise=0.25"))
    assert trainer.cfg.head.variant == "mtp"
    # evaluation reads clean features: the same untrained head (same seed) measures the same without noise
    assert trainer.validate() == Trainer(config(run_dir, *args)).validate()
    seen, batches = [], []
    forward, micro = trainer.engine.forward, trainer.micro_batches

    def spy(embed, hidden, *rest):
        seen.append(hidden.detach().clone())
        return forward(embed, hidden, *rest)

    def kept():
        for b in micro():
            batches.append((b, b["hidden"].clone()))
            yield b

    monkeypatch.setattr(trainer.engine, "forward", spy)
    monkeypatch.setattr(trainer, "micro_batches", kept)
    trainer.fit()
    assert len(seen) == len(batches) == 4  # 2 steps x 2 micro-batches; evaluation does not go through it
    diffs = []
    for x, (b, clean) in zip(seen, batches):
        assert torch.equal(b["hidden"], clean)  # the label was not touched
        diffs.append(x - clean)
        bound = 0.25 * clean.abs().median(dim=-1, keepdim=True).values
        real = torch.arange(clean.shape[1])[None] < b["lengths"][:, None]  # padding (zeros) gets none
        assert torch.equal(diffs[-1][~real], torch.zeros_like(diffs[-1][~real]))
        ratio = diffs[-1][real] / bound[real]
        assert float(ratio.abs().max()) <= 1 + 1e-4 and float(ratio.abs().max()) > 0.95
        assert abs(float(ratio.mean())) < 0.02 and 0.45 < float(ratio.abs().mean()) < 0.55  # uniform: mean |u| 1/2
    assert not torch.equal(diffs[0][:, :8], diffs[2][:, :8])  # step 1 and step 2 draw other noise


def test_resume_falls_back_past_a_damaged_checkpoint(tmp_path, samples, tiny_dir, capsys):
    """The newest checkpoint is damaged (a flipped byte in its optimizer state): the resume names it, starts
    from the one before, and ends where an uninterrupted run ends, bit for bit. With every checkpoint damaged
    it stops instead of starting from step 0."""
    args = ("train.steps=8", "train.save_every=4", "train.keep_checkpoints=2", "train.depth=2", "train.lr=1e-3")
    clean, damaged = tmp_path / "clean", tmp_path / "damaged"
    for d in (clean, damaged):
        make_store(d, samples, tiny_dir / "target")
    Trainer(config(clean, *args)).fit()
    Trainer(config(damaged, *args)).fit()  # checkpoints of steps 4 and 8
    opt = damaged / "checkpoints" / "step-000008" / "optimizer.safetensors"
    data = bytearray(opt.read_bytes())
    data[len(data) // 2] ^= 0x10
    opt.write_bytes(bytes(data))
    capsys.readouterr()
    resumed = Trainer(config(damaged, *args, "resume=true"))
    said = capsys.readouterr().out
    assert "step-000008: optimizer.safetensors does not match its sha256" in said and "Resuming from step-000004" in said
    assert resumed.step == 4
    resumed.fit()
    wa = ckpt.load_head_state(clean / "checkpoints" / "step-000008")
    wb = ckpt.load_head_state(damaged / "checkpoints" / "step-000008")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    for step in ckpt.checkpoints(damaged / "checkpoints"):
        (step / "head.json").unlink()
    with pytest.raises(ValueError, match="no intact checkpoint .*head.json is missing"):
        Trainer(config(damaged, *args, "resume=true"))


def test_resume_of_another_run_is_refused_naming_both_sides(run_dir):
    Trainer(config(run_dir, "train.steps=1")).fit()
    with pytest.raises(ValueError, match="belongs to another run .*head variant: mtp there, eagle1 here"):
        Trainer(config(run_dir, "train.steps=2", "head.variant=eagle1", "resume=true"))
    meta_path = ckpt.latest(run_dir / "checkpoints") / "head.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(meta | {"store_plan_hash": "0" * 64, "recipe": "llama3.1-8b"}))
    ckpt.write_checksums(meta_path.parent)  # as if another run had written it
    with pytest.raises(ValueError, match="recipe: llama3.1-8b there, tiny here; store: a train store with plan 0{64} "
                                         "there, .*store/train here"):
        Trainer(config(run_dir, "train.steps=2", "resume=true"))


def test_existing_checkpoints_need_resume(run_dir):
    Trainer(config(run_dir, "train.steps=1")).fit()
    with pytest.raises(ValueError, match="resume=true"):
        Trainer(config(run_dir, "train.steps=1"))
    (run_dir / "checkpoints" / "latest").unlink()  # a step-* directory alone is enough to refuse
    with pytest.raises(ValueError, match="resume=true"):
        Trainer(config(run_dir, "train.steps=1"))


def test_resume_with_other_data_settings_is_refused(run_dir):
    Trainer(config(run_dir, "train.steps=2")).fit()
    with pytest.raises(ValueError, match=r"other data settings \(micro_batch 8 -> 4\)"):
        Trainer(config(run_dir, "train.steps=4", "train.micro_batch=4", "resume=true"))


def test_a_batch_with_nothing_to_train_on_is_a_zero_step(run_dir, samples, tiny_dir, tmp_path):
    """Samples whose loss mask is all zero give a zero loss and zero gradients, not an error."""
    masked = [{**s, "loss_mask": torch.zeros_like(s["loss_mask"])} for s in samples]
    make_store(tmp_path / "masked", masked, tiny_dir / "target")
    summary = Trainer(config(tmp_path / "masked", "train.steps=1")).fit()
    assert summary["last_train"]["loss"] == 0.0 and summary["last_train"]["d1/n"] == 0


def test_nan_stops_and_keeps_last_good_checkpoint(tmp_path, samples, tiny_dir):
    bad = [dict(s) for s in samples]
    for s in bad[:48]:
        s["hidden"] = s["hidden"].clone()
        s["hidden"][10] = float("inf")  # every training sample: the step after the first checkpoint fails
    make_store(tmp_path, samples, tiny_dir / "target")
    Trainer(config(tmp_path, "train.steps=2")).fit()
    good = ckpt.latest(tmp_path / "checkpoints")
    weights = ckpt.load_head_state(good)
    make_store_bad = tmp_path / "bad"
    make_store(make_store_bad, bad, tiny_dir / "target")
    with pytest.raises(TrainingDiverged, match=r"at step 1 .*last good checkpoint is none"):
        Trainer(config(make_store_bad, "train.steps=2")).fit()
    # a diverging resumed run names and keeps the last good checkpoint
    import shutil

    shutil.copytree(tmp_path / "checkpoints", make_store_bad / "checkpoints", dirs_exist_ok=True)
    with pytest.raises(TrainingDiverged, match=r"at step 3 .*step-000002"):
        Trainer(config(make_store_bad, "train.steps=4", "resume=true")).fit()
    assert ckpt.latest(make_store_bad / "checkpoints").name == "step-000002"
    kept = ckpt.load_head_state(make_store_bad / "checkpoints" / "step-000002")
    assert all(torch.equal(weights[k], kept[k]) for k in weights)


def test_store_of_another_target_is_refused(tmp_path, samples, tiny_dir):
    other = tiny_dir / "draft"  # another model directory: another fingerprint
    identity = identity_for(other, tokenizer_path=tiny_dir / "target")
    write_split(tmp_path / "store" / "train", samples[:48], identity=identity)
    write_split(tmp_path / "store" / "val", samples[48:], identity=identity)
    with pytest.raises(ValueError, match=r"made from target .*draft.*this run's target is .*target"):
        Trainer(config(tmp_path))


def test_missing_store_says_run_precompute(tmp_path):
    with pytest.raises(FileNotFoundError, match="mtp-train precompute"):
        Trainer(config(tmp_path))


def test_bf16_autocast_and_offline_wandb(run_dir, monkeypatch):
    """bf16 autocast (the GPU setting; frozen tensors kept in bf16) takes finite steps, and a wandb project
    logs offline without a key, beside metrics.jsonl."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = config(run_dir, "train.steps=2", "train.micro_batch=4", "train.precision=bf16",
                 "train.wandb_project=mtp-test", "train.wandb_name=bf16-smoke")
    trainer = Trainer(cfg)
    assert trainer.frozen.lm_head_weight.dtype == torch.bfloat16
    summary = trainer.fit()
    assert all(torch.isfinite(torch.tensor(v)) for v in summary["final"].values())
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline wandb run written"
    assert losses(run_dir).keys() == {1, 2}


def test_cli_prepare_precompute_train(tmp_path, tiny_dir, capsys):
    """The stages chained from the command line on a small recipe: the trained head beats the untrained one
    on val, metrics.jsonl and a complete checkpoint are written; then the pipeline finds prepare and
    precompute up to date, resumes training, validates and exports."""
    from mtp_train.cli import main

    recipe = tmp_path / "small.yaml"
    recipe.write_text(f"""
defaults: [run_schema, _self_]
target: {{path: {tiny_dir / 'target'}, dtype: float32}}
data:
  max_length: 96
  sources:
    - {{path: head-train, format: stdlib_chat, split: train, limit: 96}}
    - {{path: validation, format: stdlib_chat, split: val, limit: 24}}
train: {{steps: 12, micro_batch: 8, lr: 3.0e-3, warmup_steps: 2, save_every: 6, eval_every: 0}}
""")
    run_dir = tmp_path / "run"
    args = [f"recipe={recipe}", f"run_dir={run_dir}"]
    for stage in ("prepare", "precompute", "train"):
        assert main([stage, *args]) == 0, stage
    out = capsys.readouterr().out
    assert "train: 12 steps" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in rows if "val/d1/acc" in r]
    assert vals[0]["step"] == 0 and vals[-1]["step"] == 12
    assert vals[-1]["val/d1/acc"] > vals[0]["val/d1/acc"] + 0.1
    assert ckpt.latest(run_dir / "checkpoints").name == "step-000012"
    small_validate = ["validate.num_prompts=2", "validate.max_new_tokens=8", "validate.max_k=1",
                      "validate.temperatures=[0]"]
    capsys.readouterr()
    assert main(["pipeline", *args, "resume=true", "train.steps=14", *small_validate]) == 0
    assert ckpt.latest(run_dir / "checkpoints").name == "step-000014"  # up to date; train resumed to 14
    assert (run_dir / "validation" / "report.json").is_file()
    assert (run_dir / "export" / "hf-mtp" / "model.safetensors").is_file()


@pytest.mark.parametrize("flush", [True, False])
def test_training_flushes_subnormals_on_every_thread_and_restores_them(run_dir, monkeypatch, flush):
    """train.flush_denormals: while fit runs, subnormal float32s read as zero in a product spread over the
    thread pool (every thread's register, not the main thread's alone); after it, and with the option off,
    they are IEEE subnormals again everywhere."""
    tiny = torch.full((1 << 21,), 1e-39)  # large enough to be split over the intra-op threads

    def survivors() -> int:
        return int((tiny * 1.0 != 0).sum())

    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    torch.set_flush_denormal(False)
    seen = []
    real_step = Trainer.train_step

    def step(self, micro):
        seen.append(survivors())
        return real_step(self, micro)

    monkeypatch.setattr(Trainer, "train_step", step)
    assert survivors() == tiny.numel()
    Trainer(config(run_dir, "train.steps=2", f"train.flush_denormals={str(flush).lower()}")).fit()
    assert seen == [0 if flush else tiny.numel()] * 2
    assert survivors() == tiny.numel()
