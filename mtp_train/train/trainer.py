"""The trainer: one for every head variant. `mtp-train train` calls `run(cfg)`.

Reads `run_dir/store/{train,val}` (made by precompute from this run's target and tokenizer; another store
is refused), or with `train.features=online|hybrid` has its own frozen target compute the features
(`features.py`), builds the head from the target's config.json and its frozen E / W / final norm read by key,
and fits it with AdamW, linear warm-up + cosine decay (`optim.py`), gradient clipping and accumulation, fp32 or
bf16 autocast, optionally keeping a weight average (`average.py`). Validation (`evaluate.py`) every `eval_every`
steps and at the start (the untrained head, for comparison) and the end. Checkpoints every `save_every` steps
resume exactly (`resume=true`; `resume.py`).

Under torchrun the same code runs on every rank: each reads its own micro-batches (`data.rank_batches`), the
strategy (`distributed.py`: DDP or DeepSpeed ZeRO) combines the gradients, the logged metrics are sums over
all ranks (all-reduced) divided by global counts, and rank 0 alone logs and writes checkpoints (each rank
adds its optimizer partition under DeepSpeed). Each micro-batch's loss is normalized by the counted
positions of the whole optimizer step (`loss.head_loss(norm=...)`), so every counted position weighs the
same and N processes follow the trajectory of one process with N times the accumulation.

With `head.draft_vocab=N` every rank counts the draft vocabulary from the train store (`vocab.py`) and sets it
in the head before training (so every checkpoint carries it); rank 0 writes `run_dir/draft_vocab.json` and
prints its coverage. A resume with another draft vocabulary is refused.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoConfig

from mtp_train.config import RunConfig, to_yaml
from mtp_train.model.config import HeadConfig
from mtp_train.model.frozen import FrozenTarget, read_tensors
from mtp_train.model.head import DraftHead, load_target_layer, target_layer_keys
from mtp_train.preempt import STOP_FILE, Preempted, StopRequests
from mtp_train.train import average
from mtp_train.train import checkpoint as ckpt
from mtp_train.train import distributed as dist
from mtp_train.train import subnormals
from mtp_train.train.data import Collate, head_inputs, length_batches, loader, rank_batches, steps_per_epoch
from mtp_train.train.evaluate import add_weighted, autocast_for, averages, evaluate, format_eval, metric_names
from mtp_train.train.features import open_splits
from mtp_train.train.log import MetricsLogger
from mtp_train.train.loss import TargetStats, counted_positions, head_loss
from mtp_train.train.memory import estimate_memory, online_bytes
from mtp_train.train.optim import build_optimizer, build_scheduler
from mtp_train.train.resume import Checkpointing
from mtp_train.train.vocab import DRAFT_VOCAB_JSON, choose_draft_vocab, write_record


class TrainingDiverged(ValueError):
    pass


def feature_noise(x: torch.Tensor, amplitude: float, hidden_size: int, seed: int, step: int, rank: int,
                  micro: int) -> torch.Tensor:
    """`x` [..., k·hidden_size] plus uniform noise in [-a·m, a·m], m the median |x| of each position's state (of
    each of its k states: an eagle3 head reads k aux layers side by side), drawn from a generator seeded by (run
    seed, optimizer step, rank, micro-batch within the step): the same draws on a resumed run as on an
    uninterrupted one, and independent of the global RNG (which the rest of training consumes as before)."""
    key = ((seed * 1_000_003 + step) * 1_009 + rank) * 257 + micro
    g = torch.Generator(device=x.device).manual_seed(key % (2 ** 63))  # drawn where x is: no host copy per batch
    states = x.unflatten(-1, (-1, hidden_size))
    scale = states.detach().abs().median(dim=-1, keepdim=True).values.float() * amplitude
    noise = torch.rand(states.shape, generator=g, device=x.device, dtype=torch.float32).mul_(2).sub_(1).mul_(scale)
    return x + noise.flatten(-2).to(x.dtype)


def init_head_weights(head: DraftHead, std: float) -> None:
    """Linear weights ~ N(0, std) (the target's initializer_range), biases 0; norms stay at 1."""
    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)


def build_head(target_path: str, head_cfg: HeadConfig, device, seed: int,
               frozen_dtype: torch.dtype = torch.float32) -> tuple[DraftHead, FrozenTarget, object]:
    """The head (seeded init, post_norm from the target's final norm) and the frozen target tensors, both
    on `device`. The frozen tensors are kept in `frozen_dtype` (bf16 halves them: 2 GB each at 70B)."""
    target_config = AutoConfig.from_pretrained(target_path)
    torch.manual_seed(seed)
    head = DraftHead(target_config, head_cfg)
    init_head_weights(head, getattr(target_config, "initializer_range", 0.02))
    frozen = FrozenTarget.from_pretrained(target_path, dtype=frozen_dtype, device="cpu")
    head.init_from_target(frozen)
    if head_cfg.init_fc >= 0:
        head.init_fc_identity(head_cfg.init_fc)
    if head_cfg.init_layer >= 0:
        keys = target_layer_keys(head, head_cfg.init_layer, target_config.num_hidden_layers)
        missing = load_target_layer(head, read_tensors(target_path, sorted(set(keys.values()))), keys)
        if missing:
            raise ValueError(f"head.init_layer={head_cfg.init_layer}: {target_path} has no "
                             f"{', '.join(keys[m] for m in missing)} for the head's {', '.join(missing)} "
                             "(a layer of another shape, e.g. a mixture of experts): choose a layer the head's "
                             "decoder layer matches, or -1 for a random start")
    return head.to(device), frozen.to(device), target_config


class Trainer(Checkpointing):
    """Under torchrun every rank builds one, with its `rank`, the `world` size and its `local_rank` (its GPU),
    inside a started process group (`run` starts it). Saving and resuming are `Checkpointing`'s (resume.py)."""

    def __init__(self, cfg: RunConfig, *, rank: int = 0, world: int = 1, local_rank: int = 0):
        self.cfg, self.tc, self.rank, self.world = cfg, cfg.train, rank, world
        self.say = print if rank == 0 else (lambda *a, **k: None)
        self.run_dir = Path(cfg.run_dir)
        self.device = dist.device_for(cfg.target.device, dist.Ranks(rank, world, local_rank))
        self.strategy = dist.resolve_strategy(self.tc.strategy, world, self.device)
        self._check_settings()
        self.train_store, self.val_store = open_splits(cfg, self.device, rank, world, self.say)  # train/features.py
        self.seed = cfg.seed if self.tc.seed is None else self.tc.seed
        self._build_head()
        self._prepare_loss()
        self._plan_steps()
        self._build_engine()
        self._start_position()
        if cfg.resume:
            self._resume()  # resume.py
        elif ckpt.checkpoints(self.ckpt_root) or (self.ckpt_root / ckpt.LATEST).exists():
            raise ValueError(f"{self.ckpt_root} already holds checkpoints: pass resume=true to continue that run, "
                             "or use another run_dir")
        self._open_log()

    # -- setting up --------------------------------------------------------------------------------------
    def _check_settings(self) -> None:
        """Settings that do not go together, refused before anything is loaded (and before any engine)."""
        tc = self.tc
        if tc.ema_decay and self.strategy == "deepspeed" and tc.zero_stage == 3:
            raise ValueError(f"train.ema_decay={tc.ema_decay} needs every rank to hold the whole head, which "
                             "ZeRO-3 partitions: use train.zero_stage=1 or 2 (the head is small), or "
                             "train.ema_decay=0")
        if self.cfg.head.variant == "eagle3" and tc.loss.w_feat:
            raise ValueError(f"train.loss.w_feat={tc.loss.w_feat}: an eagle3 head is trained on the "
                             "distribution alone (its output is not an estimate of the target's hidden state); "
                             "set train.loss.w_feat=0")
        if tc.precision == "bf16" and self.device.type == "cpu":
            self.say("train: bf16 autocast on CPU is 20-30x slower than fp32 here; use train.precision=fp32 on CPUs")

    def _build_head(self) -> None:
        """The seeded head and the frozen target tensors (`build_head`), checked against the train store, with
        the draft vocabulary counted from the train store (head.draft_vocab > 0; every rank alike)."""
        cfg = self.cfg
        frozen_dtype = torch.bfloat16 if self.tc.precision == "bf16" else torch.float32
        self.head, self.frozen, self.target_config = build_head(cfg.target.path, cfg.head, self.device, self.seed,
                                                                frozen_dtype)
        if self.head.hidden_size != self.train_store.hidden_size:
            raise ValueError(f"store {self.train_store.dir.parent / 'train'} holds hidden size "
                             f"{self.train_store.hidden_size}, the target {cfg.target.path} has {self.head.hidden_size}")
        self.draft_vocab = None
        if cfg.head.draft_vocab:
            self.draft_vocab = choose_draft_vocab(self.train_store, cfg.head.draft_vocab, self.target_config.vocab_size)
            self.head.set_draft_vocab(self.draft_vocab.ids, self.frozen.lm_head_weight)

    def _prepare_loss(self) -> None:
        """The metrics the loss reports, the target's statistics it keeps per split, and a check that both
        splits hold the layers the head reads (an eagle3 head's aux layers)."""
        self.metric_names = metric_names(self.head, self.tc.loss)
        # the target's full-vocabulary argmax / logsumexp per sample, kept across epochs (store features only:
        # online ones are recomputed on every visit, so their stats are too)
        self.target_stats = {
            split: TargetStats(self.frozen.lm_head_weight, self.tc.loss.temperature, self.tc.loss.chunk_tokens,
                               0.0 if getattr(reader, "in_process", False) else self.tc.target_stats_cache_mb)
            for split, reader in (("train", self.train_store), ("val", self.val_store))}
        for reader in (self.train_store, self.val_store):
            Collate(reader, self.head.aux_layers)

    def _plan_steps(self) -> None:
        """Optimizer steps per epoch and in all (`train.steps`, or `train.epochs` passes)."""
        tc, world = self.tc, self.world
        self.steps_per_epoch = steps_per_epoch(len(self.train_store), tc.micro_batch, world, tc.grad_accum)
        if self.steps_per_epoch == 0:
            raise ValueError(f"{len(self.train_store)} training samples make no full step of "
                             f"train.micro_batch={tc.micro_batch} x train.grad_accum={tc.grad_accum} x {world} "
                             "ranks; lower them or prepare more data")
        self.total_steps = tc.steps or max(1, round(tc.epochs * self.steps_per_epoch))

    def _build_engine(self) -> None:
        """The optimizer and schedule (optim.py), the memory estimate, and the strategy's engine around them."""
        tc = self.tc
        self.optimizer = build_optimizer(self.head, tc)
        self.scheduler = build_scheduler(self.optimizer, tc, self.total_steps)
        self.engine_settings = dist.EngineSettings(self.strategy, tc.zero_stage, self.world, tc.grad_accum,
                                                   tc.micro_batch, tc.max_grad_norm)
        self.memory = self.memory_estimate()
        self.n_params = sum(p.numel() for p in self.head.parameters())  # before ZeRO-3 partitions them
        self.engine = dist.build_engine(self.head, self.optimizer, self.scheduler, self.engine_settings, self.device,
                                        tc.activation_checkpointing)

    def _start_position(self) -> None:
        """Step 0 at the data's start, no stop request, and the weight average at the initial weights."""
        self.config_yaml = to_yaml(self.cfg)
        self.step, self.epoch, self.consumed = 0, 0, 0  # optimizer steps; data position (epoch, micro-batches)
        self.autocast = autocast_for(self.tc.precision, self.device)
        self.ckpt_root = ckpt.checkpoint_root(self.run_dir)
        self.resumed_from, self.resumed_step = None, None
        self.stop_requests: StopRequests | None = None  # set while fit runs
        self.stop_reason: str | None = None  # this rank's stop request (a signal, run_dir/STOP), read each step
        self.stop_agreed = False
        self.ema = None  # train.ema_decay > 0: the weight average, name -> fp32 tensor beside its parameter
        if self.tc.ema_decay:
            self.ema = average.start_average(self.head)

    def _open_log(self) -> None:
        """The metrics log (rank 0 writes it), and the draft vocabulary's record."""
        self.log = MetricsLogger(self.run_dir, enabled=self.rank == 0, wandb_project=self.tc.wandb_project,
                                 wandb_name=self.tc.wandb_name or self.cfg.run_dir, config=asdict(self.cfg),
                                 resume=self.resumed_from is not None, resume_step=self.step)
        if self.draft_vocab is not None and self.rank == 0:
            write_record(self.run_dir, self.draft_vocab)

    def memory_estimate(self):
        """The per-GPU memory estimate for this run (from the target's config and the longest train sample)."""
        seq = int(max(self.train_store.lengths)) if len(self.train_store) else 1
        return estimate_memory(self.target_config, self.tc, seq, self.world, self.strategy, self.cfg.head,
                               online_target=online_bytes(self.cfg))

    # -- the loop ----------------------------------------------------------------------------------------
    def val_batches(self, full: bool) -> list[list[int]]:
        """All val micro-batches (every val sample once, in length order: little padding); rank r takes
        every world-th."""
        batches = length_batches(self.val_store.lengths, self.tc.micro_batch)
        if self.tc.eval_batches and not full:
            batches = batches[:: max(1, len(batches) // self.tc.eval_batches)][: self.tc.eval_batches]
        return batches

    def validate(self, full: bool = True) -> dict[str, float]:
        """The metrics on the val split (with the weight average when there is one), logged and returned."""
        batches = self.val_batches(full)
        steps = filler = None
        aux = self.head.aux_layers
        if self.strategy == "deepspeed" and self.tc.zero_stage == 3 and batches:  # equal forward counts
            steps, filler = math.ceil(len(batches) / self.world), Collate(self.val_store, aux)(batches[0])
        with self.averaged_weights():
            m = evaluate(self.head, self.frozen, loader(self.val_store, batches[self.rank::self.world], aux=aux),
                         self.tc.depth, self.tc.loss, self.device, self.autocast, steps=steps, filler=filler,
                         stats=self.target_stats["val"])
        self.log.log({f"val/{k}": v for k, v in m.items()}, self.step,
                     console=f"val step {self.step}: {format_eval(m, self.tc.depth)}")
        return m

    @contextmanager
    def averaged_weights(self):
        """With train.ema_decay: the head holds the weight average inside, its trained weights again after."""
        with average.averaged_weights(self.head, self.ema):
            yield

    def update_average(self) -> None:
        """After optimizer step `self.step`: the weight average moves towards the trained weights
        (`average.update_average`)."""
        average.update_average(self.ema, self.head, self.tc.ema_decay, self.step)

    def micro_batches(self):
        """This rank's micro-batches from the current data position on, across epochs, forever."""
        tc = self.tc
        while True:
            batches = rank_batches(self.train_store.lengths, tc.micro_batch, self.seed, self.epoch,
                                   self.rank, self.world, tc.grad_accum, tc.bucket)
            for batch in loader(self.train_store, batches[self.consumed:], tc.num_workers, self.head.aux_layers):
                self.consumed += 1
                yield batch
            self.epoch, self.consumed = self.epoch + 1, 0
            self.train_store.end_of_pass()  # hybrid: the first pass has written the store

    def train_step(self, micro) -> dict[str, float]:
        """One optimizer step over grad_accum micro-batches on every rank; returns the step's metrics, averaged
        over all ranks' counted positions (`loss` is the step's loss, `tokens` all ranks' tokens)."""
        tc = self.tc
        batches, where = [], []  # on the host until used; their data positions (epoch, micro-batch)
        for _ in range(tc.grad_accum):
            batches.append(next(micro))
            where.append((self.epoch, self.consumed - 1))
        local = torch.tensor([counted_positions(b["loss_mask"], b["lengths"], tc.depth) for b in batches],
                             dtype=torch.float64).sum(0)
        norm = [int(n) for n in dist.all_reduce_sum(local.to(self.device)).cpu()]  # the whole step's counts
        names = self.metric_names
        sums = torch.zeros(tc.depth, 1 + len(names), dtype=torch.float64)
        loss_sum, tokens, bad = 0.0, 0, []
        draft = self.head.draft_lm_head(self.frozen.lm_head_weight)
        for i, batch in enumerate(batches):
            batch = {k: v.to(self.device) for k, v in batch.items()}
            inputs = head_inputs(batch)  # batch["hidden"] stays the clean label of the feature loss
            if tc.feature_noise:
                inputs = feature_noise(inputs, tc.feature_noise, self.head.hidden_size, self.seed, self.step,
                                       self.rank, i)
            with self.engine.forward_context():
                with self.autocast():
                    outs = self.engine.forward(self.frozen.embed, inputs, batch["input_ids"],
                                               batch["lengths"], tc.depth, tc.detach_chain)
                loss, m = head_loss([o.float() for o in outs], batch["hidden"], batch["loss_mask"], batch["lengths"],
                                    self.frozen.lm_head_weight, tc.loss, norm=norm, draft=draft,
                                    stats=self.target_stats["train"], index=batch["index"])
                if not torch.isfinite(loss):
                    bad.append(where[i])
                self.engine.backward(loss)  # every rank makes the same calls, whatever its loss
            loss_sum += m["loss"]
            tokens += int(batch["lengths"].sum())
            add_weighted(sums, m, tc.depth, names)
        self.stop_reason = (self.stop_requests.requested if self.stop_requests is not None else None) or \
            (f"run_dir/{STOP_FILE}" if self.rank == 0 and (self.run_dir / STOP_FILE).exists() else None)
        scalars = torch.tensor([loss_sum, tokens, len(bad), float(self.stop_reason is not None)], dtype=torch.float64)
        reduced = dist.all_reduce_sum(torch.cat([sums.flatten(), scalars]).to(self.device)).cpu()
        sums, (loss_sum, tokens, n_bad, n_stop) = reduced[:-4].view_as(sums), reduced[-4:].tolist()
        self.stop_agreed = n_stop > 0  # a stop request on any rank: every rank stops after this same step
        if n_bad:
            at = ", ".join(f"epoch {e} micro-batch {k}" for e, k in bad) if bad else "on another rank"
            raise TrainingDiverged(
                f"loss is not finite at step {self.step + 1} ({int(n_bad)} micro-batch(es): {at}); the last good "
                f"checkpoint is {ckpt.latest(self.ckpt_root) or 'none (none was saved yet)'}. "
                "Check the store (mtp-train verify-store) or lower train.lr")
        grad_norm = self.engine.step()
        if not math.isfinite(grad_norm):
            last = ckpt.latest(self.ckpt_root)
            raise TrainingDiverged(f"gradient norm is {grad_norm} at step {self.step + 1}; the last good "
                                   f"checkpoint is {last or 'none'}")
        self.step += 1
        if self.ema is not None:
            self.update_average()
        out = averages(sums, tc.depth, names)
        out.update({"loss": loss_sum, "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0],
                    "tokens": int(tokens)})
        return out

    def fit(self) -> dict:
        with subnormals.flushed(self.tc.flush_denormals and self.device.type == "cpu"):
            return self._fit()

    def _fit(self) -> dict:
        tc = self.tc
        n_params = self.n_params
        strategy = self.strategy + (f" ZeRO-{tc.zero_stage}" if self.strategy == "deepspeed" else "")
        layer = self.cfg.head.init_layer
        start = f", its layer from the target's layer {layer}" if layer >= 0 else ""
        if self.cfg.head.init_fc >= 0:
            start += f", fc the identity on aux layer {self.cfg.head.init_fc}"
        self.say(f"train: head {self.cfg.head.variant} ({n_params:,} trainable parameters{start}), depth {tc.depth}, "
                 f"{len(self.train_store):,} train samples, {self.steps_per_epoch} steps/epoch, "
                 f"{self.total_steps} steps, lr {tc.lr}, {tc.precision} on {self.device}, {strategy} x {self.world}"
                 + (", activation checkpointing" if tc.activation_checkpointing else ""))
        device_bytes = torch.cuda.get_device_properties(self.device).total_memory \
            if self.device.type == "cuda" else None
        self.say("train: " + self.memory.format(device_bytes, f"{strategy} x {self.world}"))
        if self.draft_vocab is not None:
            self.say(f"train: {self.draft_vocab.summary()}; recorded in {self.run_dir / DRAFT_VOCAB_JSON}")
        start = self.validate() if self.step == 0 else None
        micro = self.micro_batches()
        bar = tqdm(total=self.total_steps, initial=self.step, disable=self.rank != 0, desc="train",
                   dynamic_ncols=True)
        t0 = time.perf_counter()
        with StopRequests("train", "optimizer step", speak=self.rank == 0) as self.stop_requests:
            try:
                final, path, last = self._loop(micro, bar, t0)
            finally:
                bar.close()
                self.log.close()
        summary = {"steps": self.step, "final": final, "start": start, "checkpoint": str(path) if path else None,
                   "last_train": last}
        self.say(format_summary(summary, tc.depth))
        return summary

    def _loop(self, micro, bar, t0: float) -> tuple[dict, Path | None, dict]:
        """Optimizer steps to the end, with logging, evaluations, checkpoints and stop requests; then the final
        evaluation and checkpoint. -> (final metrics, checkpoint path, last step's metrics)."""
        tc = self.tc
        tokens, last = 0, {}
        while self.step < self.total_steps:
            m = self.train_step(micro)
            tokens += m["tokens"]
            rate = tokens / max(1e-9, time.perf_counter() - t0)
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m.get('d1/acc', 0):.3f}", tok_s=f"{rate:,.0f}")
            if self.step % tc.log_every == 0 or self.step == self.total_steps:
                self.log.log({**{f"train/{k}": v for k, v in m.items()}, "epoch": self.epoch,
                              "tokens_per_s": rate}, self.step)
            if tc.eval_every and self.step % tc.eval_every == 0 and self.step < self.total_steps:
                self.validate(full=False)
            if self.stop_agreed and self.step < self.total_steps:
                path = self.save()
                if self.rank == 0:
                    (self.run_dir / STOP_FILE).unlink(missing_ok=True)  # honoured: the resumed run goes on
                raise Preempted(f"train: stopped on request ({self.stop_reason or 'on another rank'}) after step "
                                f"{self.step} of {self.total_steps}; checkpoint {path}. The same command with "
                                "resume=true goes on from there")
            if tc.save_every and self.step % tc.save_every == 0 and self.step < self.total_steps:
                self.save()
            last = m
        bar.close()
        self.train_store.end_of_pass()  # hybrid: training ended inside the first pass; the store is completed
        return self.validate(), self.save(), last


def format_summary(s: dict, depth: int) -> str:
    lines = [f"train: {s['steps']} steps; checkpoint {s['checkpoint']}",
             f"  {'depth':<6}{'val acc':>10}{'accept':>10}{'(untrained acc':>16}{'accept)':>9}"]
    for k in range(1, depth + 1):
        f, st = s["final"], s["start"] or {}
        before = (f"{st[f'd{k}/acc']:>16.3f}{st[f'd{k}/accept']:>9.3f}" if f"d{k}/acc" in st else "")
        lines.append(f"  {k:<6}{f.get(f'd{k}/acc', 0):>10.3f}{f.get(f'd{k}/accept', 0):>10.3f}{before}")
    return "\n".join(lines)


def run(cfg: RunConfig) -> dict:
    """`mtp-train train`: one process, or every rank under torchrun (the process group is started here). A stop
    request before step 1 (the target loading, DeepSpeed initialising, the step-0 evaluation) stops it at once."""
    with StopRequests("train", "outside an optimizer step (start-up: loading, initialising, the step-0 evaluation)",
                      at_once=True, then="the same command with resume=true goes on"):
        with dist.process_group(cfg.target.device, cfg.train.strategy) as ranks:
            return Trainer(cfg, rank=ranks.rank, world=ranks.world, local_rank=ranks.local_rank).fit()
