"""The trainer's checkpoints: what a checkpoint of a training run holds, writing one from every rank, and a
resume that refuses another run's checkpoint and restores the state it saved exactly (weights, optimizer,
scheduler, data position, RNG states, the weight average). The files themselves are `checkpoint.py`'s.

`Checkpointing` is the `Trainer`'s part that does it: it reads the trainer's run (cfg, tc, rank, world, say,
seed), its head and target (head, target_config, draft_vocab, ema), its data (train_store), its optimization
(engine, engine_settings, scheduler, total_steps), its position (step, epoch, consumed) and its checkpoint
directory (ckpt_root, config_yaml, resumed_from, resumed_step).
"""

from __future__ import annotations

import functools
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open

from mtp_train.files import check_space, space_for
from mtp_train.model.target import target_fingerprint
from mtp_train.train import checkpoint as ckpt
from mtp_train.train import distributed as dist


def describe_layout(layout: dict) -> str:
    """How a checkpoint keeps its optimizer state (`EngineSettings.layout()`), in words."""
    if layout.get("strategy") == "deepspeed":
        return f"DeepSpeed ZeRO-{layout['zero_stage']} partitions over {layout['world']} process(es)"
    return f"one full optimizer state (single process or DDP over {layout['world']} process(es))"


class Checkpointing:
    """Saving the trainer's state as checkpoints and resuming from them (module docstring)."""

    def head_meta(self) -> dict:
        return {"variant": self.cfg.head.variant, "head": asdict(self.cfg.head),
                "target_path": str(Path(self.cfg.target.path).resolve()),
                "target_fingerprint": target_fingerprint(self.cfg.target.path),
                "target_config": self.target_config.to_dict(), "step": self.step,
                "depth": self.tc.depth, "recipe": self.cfg.recipe,
                "store_plan_hash": self.train_store.manifest["plan_hash"],
                **({"draft_vocab_coverage": self.draft_vocab.coverage} if self.draft_vocab is not None else {}),
                **({"ema_decay": self.tc.ema_decay} if self.ema is not None else {})}

    def data_settings(self) -> dict:
        """What the data position means: a resume with other values would read other samples."""
        tc = self.tc
        return {"micro_batch": tc.micro_batch, "grad_accum": tc.grad_accum, "bucket": tc.bucket, "seed": self.seed,
                "world": self.world, "train_samples": len(self.train_store)}

    # -- saving ------------------------------------------------------------------------------------------
    def save(self) -> Path | None:
        """A checkpoint of the current step. Every rank calls it: under DeepSpeed each writes its optimizer
        partition and ZeRO-3 gathers the head; rank 0 writes the rest and makes it visible. Returns the
        checkpoint's path on rank 0, None on the others.

        A write that fails on one rank (a full disk) stops every rank with that rank's error (`dist.agree` after
        each part that writes), and rank 0 removes the partial directory. With several processes every rank
        first checks that the file system has room for the whole checkpoint: DeepSpeed writes each rank's
        partition inside its own collectives, where a rank that failed alone could not tell the others."""
        if self.resumed_from is not None and self.step == self.resumed_step:
            return self.resumed_from if self.rank == 0 else None  # nothing trained since: that checkpoint is this state
        tmp = self.ckpt_root / f"step-{self.step:06d}.tmp"
        params = list(self.head.parameters())
        # weights as they are + fp32 Adam moments + an fp32 master copy (DeepSpeed under bf16): an upper bound
        needed = sum(p.numel() * (p.element_size() + 12) for p in params)
        pointer = self.ckpt_root / ckpt.LATEST
        last = self.ckpt_root / pointer.read_text().strip() if pointer.is_file() else None
        kept = f"the last complete checkpoint ({last or 'none yet'}) is untouched"

        def attempt(write) -> BaseException | None:
            try:
                with space_for(tmp, needed, "checkpoint", kept, partial=[tmp]):
                    write()
            except Exception as e:
                return e
            return None

        path = None
        self.train_store.checkpoint()  # hybrid: the store's rows written so far are on disk and recorded
        try:
            if self.world > 1:
                dist.agree(attempt(lambda: check_space(tmp, needed, "checkpoint", kept)), "its space check")
            if self.rank == 0:
                ckpt.begin(self.ckpt_root, self.step)
            dist.barrier()  # the directory exists before any rank writes into it
            dist.agree(attempt(lambda: self.engine.save(tmp)), "writing its optimizer state")
            head_state = self.engine.head_state_dict()
            rngs = dist.gather_objects(ckpt.rng_state())

            def rest() -> None:
                nonlocal path
                weights, state = self._saved_state(head_state)
                ckpt.write(tmp, self.step, weights, self.head_meta(), state, self.config_yaml,
                           rng=rngs[0] if self.world == 1 else rngs)
                path = ckpt.commit(self.ckpt_root, self.step, keep=self.tc.keep_checkpoints)

            # every rank's part is written; no rank moves on (or exits) before the checkpoint is complete
            dist.agree(attempt(rest) if self.rank == 0 else None, "writing the checkpoint")
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # never a partial checkpoint left behind
            raise
        return path

    def _saved_state(self, head_state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
        """(head.safetensors' weights, trainer_state) of a checkpoint of the current step: with a weight average
        the file holds the average, and trainer_state the trained weights the resume goes on from."""
        state = {"step": self.step, "epoch": self.epoch, "consumed": self.consumed,
                 "scheduler": self.scheduler.state_dict(), "total_steps": self.total_steps,
                 "data": self.data_settings(), "engine": self.engine_settings.layout()}
        weights = head_state
        if self.ema is not None:
            state["live_head"] = {n: head_state[n] for n in self.ema}
            weights = {**head_state, **{n: v.to(head_state[n].dtype) for n, v in self.ema.items()}}
        return weights, state

    # -- resuming ----------------------------------------------------------------------------------------
    def _resume(self) -> None:
        """resume=true: the newest intact checkpoint's state, after checking that it is this run's."""
        path = self._intact_checkpoint()
        if path is None:
            self.say(f"train: resume=true but {self.ckpt_root} holds no checkpoint; starting from step 0")
            return
        meta = ckpt.load_meta(path)
        self._check_same_run(path, meta)
        self._check_draft_vocab(path, meta)
        state = ckpt.load_trainer_state(path)
        self._check_same_settings(path, state)
        self._say_what_changed(path, state)
        self._restore(path, meta, state)
        self.resumed_from, self.resumed_step = path, self.step
        self.say(f"train: resumed from {path} (step {self.step}, epoch {self.epoch}, micro-batch {self.consumed})")

    def _intact_checkpoint(self) -> Path | None:
        """`ckpt.newest_intact`, run on rank 0 (it reads every file) and agreed by every rank."""
        found, error = None, None
        if self.rank == 0:
            try:
                found = ckpt.newest_intact(self.ckpt_root, self.say)
            except ValueError as e:
                error = str(e)
        found, error = dist.gather_objects((found, error))[0]
        if error:
            raise ValueError(error)
        return found

    def _check_same_run(self, path: Path, meta: dict) -> None:
        """The checkpoint was trained on this target, head variant, recipe and train store."""
        mine = {"target": (target_fingerprint(self.cfg.target.path), self.cfg.target.path),
                "head variant": (self.cfg.head.variant, self.cfg.head.variant),
                "recipe": (self.cfg.recipe, self.cfg.recipe),
                "store": (self.train_store.manifest["plan_hash"], str(self.train_store.dir))}
        saved = {"target": (meta["target_fingerprint"], meta["target_path"]),
                 "head variant": (meta["variant"], meta["variant"]),
                 "recipe": (meta.get("recipe"), meta.get("recipe")),  # absent in checkpoints of earlier versions
                 "store": (meta.get("store_plan_hash"), f"a train store with plan {meta.get('store_plan_hash')}")}
        differ = [f"{what}: {saved[what][1]} there, {mine[what][1]} here" for what in mine
                  if saved[what][0] is not None and saved[what][0] != mine[what][0]]
        if differ:
            raise ValueError(f"checkpoint {path} belongs to another run ({'; '.join(differ)}): use another run_dir, "
                             "or resume with what it was trained with")

    def _check_draft_vocab(self, path: Path, meta: dict) -> None:
        """A resume keeps the checkpoint's draft vocabulary: the same size, and the same ids as this run counts."""
        saved, mine = meta["head"].get("draft_vocab", 0), self.cfg.head.draft_vocab
        if saved != mine:
            raise ValueError(f"checkpoint {path} was trained with head.draft_vocab={saved}; this run has "
                             f"head.draft_vocab={mine}: resume with head.draft_vocab={saved}, or use another run_dir")
        if mine:
            with safe_open(str(path / "head.safetensors"), framework="pt") as f:
                same = torch.equal(f.get_tensor("d2t"), self.head.d2t.cpu())
            if not same:
                raise ValueError(f"checkpoint {path} drafts over another vocabulary than the {mine} tokens counted "
                                 f"now from {self.train_store.dir}: the train store changed since; use another run_dir")

    def _check_same_settings(self, path: Path, state: dict) -> None:
        """The data settings (which samples the data position points at) and the optimizer state's layout (the
        strategy, ZeRO stage and number of processes) are the checkpoint's."""
        saved, now = state.get("data", {}), self.data_settings()
        changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
        if changed:
            what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
            raise ValueError(f"checkpoint {path} was saved with other data settings ({what}): its data position "
                             "would point at other samples. Resume with the same settings, or start a new run_dir")
        layout = state.get("engine", {"strategy": "full", "world": saved.get("world", 1)})
        if layout != self.engine_settings.layout():
            raise ValueError(f"checkpoint {path} holds its optimizer state as {describe_layout(layout)}; this run "
                             f"keeps it as {describe_layout(self.engine_settings.layout())}. Resume with the "
                             "checkpoint's train.strategy, train.zero_stage and number of processes, or start a new "
                             "run_dir")

    def _say_what_changed(self, path: Path, state: dict) -> None:
        """What a resume may change, said: the planned number of steps, and later checkpoints it will replace."""
        if state["total_steps"] != self.total_steps:
            self.say(f"train: the checkpoint's run planned {state['total_steps']} steps, this one {self.total_steps}: "
                     "the learning-rate schedule follows the new total from here")
        later = [p.name for p in ckpt.checkpoints(self.ckpt_root) if ckpt.step_of(p) > state["step"]]
        if later:
            self.say(f"train: {', '.join(later)} come after {path.name}, which `latest` names; this run replaces "
                     "them as it reaches their steps")

    def _restore(self, path: Path, meta: dict, state: dict) -> None:
        """The checkpoint's weights (the trained ones, not the average), optimizer, weight average, scheduler, data
        position and this rank's RNG states."""
        live = state.get("live_head")  # trained with train.ema_decay: head.safetensors holds the average
        saved = functools.cache(lambda: ckpt.load_head_state(path))  # read once, and only if needed
        self.engine.load(path, lambda: {**saved(), **(live or {})})
        if self.ema is not None:
            if live is None:
                self.say(f"train: {path.name} was trained without train.ema_decay: the weight average starts from "
                         "its weights")
            self.ema = {n: saved()[n].float().to(v.device).clone() for n, v in self.ema.items()}
        elif live is not None:
            self.say(f"train: {path.name} was trained with train.ema_decay={meta.get('ema_decay')}: this run goes on "
                     "from its trained weights, without a weight average")
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.consumed = state["step"], state["epoch"], state["consumed"]
        rng = state["rng"]
        ckpt.set_rng_state(rng[self.rank] if isinstance(rng, list) else rng)
