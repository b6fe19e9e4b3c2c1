"""The trainer: one for every head variant. `mtp-train train` calls `run(cfg)`.

Reads `run_dir/store/{train,val}` (made by precompute from this run's target and tokenizer; another store
is refused), or with `train.features=online|hybrid` has its own frozen target compute the features
(`features.py`), builds the head from the target's config.json and its frozen E / W / final norm read by key,
and fits it with AdamW, linear warm-up + cosine decay, gradient clipping and accumulation, fp32 or bf16
autocast. Validation every `eval_every` steps and at the start (the untrained head, for comparison) and
the end. Checkpoints every `save_every` steps resume exactly (`resume=true`).

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

import functools
import math
import shutil
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from mtp_train.files import check_space, space_for
from mtp_train.model.frozen import FrozenTarget, read_tensors
from mtp_train.preempt import STOP_FILE, Preempted, StopRequests
from mtp_train.model.head import DraftHead, load_target_layer, target_layer_keys, unrolled
from mtp_train.train import checkpoint as ckpt
from mtp_train.train import distributed as dist
from mtp_train.train.features import FEATURES, open_splits
from mtp_train.train.data import Collate, head_inputs, length_batches, loader, rank_batches, steps_per_epoch
from mtp_train.train import subnormals
from mtp_train.train.log import MetricsLogger
from mtp_train.train.loss import LossConfig, TargetStats, counted_positions, head_loss
from mtp_train.train.vocab import DRAFT_VOCAB_JSON, choose_draft_vocab, write_record

PRECISIONS = ("fp32", "bf16")


@dataclass
class TrainConfig:
    depth: int | None = None  # unrolled draft steps per anchor; unset: the head variant's default (model/head.py
    #   DEFAULT_DEPTH: 7 for eagle3, its training-time test; 1, single-token MTP, for mtp and eagle1)
    seed: int | None = None  # head init and data order; None = the run's seed (which also shapes prepare)
    micro_batch: int = 8  # samples per rank per forward
    grad_accum: int = 1
    detach_chain: bool = False  # no gradient through the state a step hands the next (model/head.py `unrolled`)
    feature_noise: float = 0.0  # training forwards only: uniform noise in [-a·m, a·m] added to the target features
    #   the head's first step reads, m the median |x| of each position's state (eagle3: of each aux layer's), so one
    #   a fits every layer and target whatever its massive activations; EAGLE-1's augmentation (absolute there).
    #   0 = off (`feature_noise` below)
    ema_decay: float = 0.0  # > 0: an exponential moving average of the head's weights (at step t each step's decay is
    #   min(ema_decay, (1 + t) / (10 + t))) is what evaluations measure and checkpoints' head.safetensors hold, so
    #   validate, export and serving use it; the trained weights go on in trainer_state for the resume. 0 = off
    steps: int = 0  # optimizer steps; 0 = `epochs` passes over the data
    epochs: float = 1.0
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    max_grad_norm: float = 1.0  # 0 disables clipping
    precision: str = "fp32"  # fp32 | bf16 (autocast; weights and optimizer stay fp32)
    eval_every: int = 100  # steps; 0 = only at start and end
    eval_batches: int = 0  # val micro-batches per periodic evaluation (0 = all); start and end use all
    save_every: int = 200  # steps; 0 = only at the end
    keep_checkpoints: int = 2
    log_every: int = 10
    num_workers: int = 0  # DataLoader workers reading the store
    bucket: int = 32  # micro-batches per length-sorting window
    wandb_project: str = ""  # empty: no wandb (metrics.jsonl and the console always)
    wandb_name: str = ""
    strategy: str = "auto"  # auto | single | ddp | deepspeed (auto: one process single; GPUs deepspeed; CPUs ddp)
    zero_stage: int = 2  # DeepSpeed ZeRO stage 1 | 2 | 3
    activation_checkpointing: bool = False  # recompute the decoder layer's MLP in backward
    features: str = "store"  # store | online | hybrid: where the target's features come from (train/features.py)
    flush_denormals: bool = True  # CPU training: subnormal floats flushed to zero on every thread (train/subnormals.py)
    target_stats_cache_mb: float = 1024.0  # per split and rank: the target's argmax / logsumexp per sample, kept
    #   after its first visit (8 bytes a token; store features only; 0 = recompute every visit; loss.TargetStats)
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        for name in ("depth", "micro_batch", "grad_accum", "log_every", "bucket"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)}: must be >= 1")
        for name in ("steps", "warmup_steps", "eval_every", "eval_batches", "save_every", "num_workers",
                     "target_stats_cache_mb", "feature_noise"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}={getattr(self, name)}: must be >= 0")
        if self.steps == 0 and self.epochs <= 0:
            raise ValueError("train.steps=0 needs train.epochs > 0")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"train.ema_decay={self.ema_decay}: must be in [0, 1) (0 = no weight average)")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.lr={self.lr} must be > 0 and train.min_lr_ratio={self.min_lr_ratio} in [0, 1]")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision={self.precision!r}: expected one of {', '.join(PRECISIONS)}")
        if len(self.betas) != 2:
            raise ValueError(f"train.betas={self.betas}: expected two numbers")
        if self.strategy not in dist.STRATEGIES:
            raise ValueError(f"train.strategy={self.strategy!r}: expected one of {', '.join(dist.STRATEGIES)}")
        if self.features not in FEATURES:
            raise ValueError(f"train.features={self.features!r}: expected one of {', '.join(FEATURES)}")
        if self.zero_stage not in dist.ZERO_STAGES:
            raise ValueError(f"train.zero_stage={self.zero_stage}: expected 1, 2 or 3 "
                             "(used by train.strategy=deepspeed)")


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


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def init_head_weights(head: DraftHead, std: float) -> None:
    """Linear weights ~ N(0, std) (the target's initializer_range), biases 0; norms stay at 1."""
    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)


def build_head(target_path: str, head_cfg, device, seed: int,
               frozen_dtype: torch.dtype = torch.float32) -> tuple[DraftHead, FrozenTarget, object]:
    """The head (seeded init, post_norm from the target's final norm) and the frozen target tensors, both
    on `device`. The frozen tensors are kept in `frozen_dtype` (bf16 halves them: 2 GB each at 70B)."""
    from transformers import AutoConfig

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


METRICS = ("feat", "ce", "acc", "accept")  # per depth, averaged over counted positions
DRAFT_VOCAB_METRICS = METRICS + ("in_vocab",)  # with a draft vocabulary (head.draft_vocab > 0)


def metric_names(head: DraftHead, loss: LossConfig | None = None) -> tuple[str, ...]:
    """The per-depth metrics the trainer logs: `in_vocab` with a draft vocabulary, `reached` with
    `train.loss.align_topk`."""
    names = DRAFT_VOCAB_METRICS if head.cfg.draft_vocab else METRICS
    return names + ("reached",) if loss is not None and loss.align_topk else names


def _add_weighted(sums: torch.Tensor, m: dict, depth: int, names: tuple[str, ...] = METRICS) -> None:
    """sums[k-1] += [n, feat·n, ce·n, acc·n, accept·n(, in_vocab·n)] of depth k from one batch's `head_loss`
    metrics."""
    for k in range(1, depth + 1):
        n = m[f"d{k}/n"]
        sums[k - 1, 0] += n
        for i, key in enumerate(names, start=1):
            sums[k - 1, i] += m.get(f"d{k}/{key}", 0.0) * n


def _averages(sums: torch.Tensor, depth: int, names: tuple[str, ...] = METRICS) -> dict[str, float]:
    out: dict[str, float] = {}
    for k in range(1, depth + 1):
        n = int(sums[k - 1, 0])
        if n:
            out.update({f"d{k}/{key}": float(sums[k - 1, i] / n) for i, key in enumerate(names, start=1)})
        out[f"d{k}/n"] = n
    return out


def autocast_for(precision: str, device: torch.device):
    """`train.precision` as a context factory: bf16 autocast around the forward, or nothing for fp32."""
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext


def evaluate(head: DraftHead, frozen: FrozenTarget, batches, depth: int, loss_cfg: LossConfig, device,
             autocast, steps: int | None = None, filler=None, stats: TargetStats | None = None) -> dict[str, float]:
    """Teacher-forced validation metrics, weighted by counted positions over all batches of all ranks.

    `steps`: forward passes to make; past the end of this rank's batches `filler` (a batch) is computed and
    not counted (ZeRO-3 gathers parameters in every forward, so every rank must make the same number).
    `stats`: the val split's `TargetStats` (the trainer keeps one across its evaluations)."""
    names = metric_names(head, loss_cfg)
    sums = torch.zeros(depth, 1 + len(names), dtype=torch.float64)
    was_training = head.training
    head.eval()
    done = 0
    with torch.no_grad():
        draft = head.draft_lm_head(frozen.lm_head_weight)
        for batch in batches:
            _evaluate_batch(head, frozen, draft, batch, depth, loss_cfg, device, autocast, sums, names, stats)
            done += 1
        while steps is not None and done < steps:
            _evaluate_batch(head, frozen, draft, filler, depth, loss_cfg, device, autocast, None, names, stats)
            done += 1
    head.train(was_training)
    return _averages(dist.all_reduce_sum(sums.to(device)).cpu(), depth, names)


def _evaluate_batch(head, frozen, draft, batch, depth, loss_cfg, device, autocast, sums, names, stats=None) -> None:
    batch = {k: v.to(device) for k, v in batch.items()}
    with autocast():
        outs = unrolled(head, frozen.embed, head_inputs(batch), batch["input_ids"], batch["lengths"], depth)
    _, m = head_loss([o.float() for o in outs], batch["hidden"], batch["loss_mask"], batch["lengths"],
                     frozen.lm_head_weight, loss_cfg, draft=draft, stats=stats, index=batch.get("index"))
    if sums is not None:
        _add_weighted(sums, m, depth, names)


def format_eval(m: dict, depth: int) -> str:
    return "  ".join(f"d{k} acc {m.get(f'd{k}/acc', 0):.3f} accept {m.get(f'd{k}/accept', 0):.3f}"
                     + (f" in_vocab {m[f'd{k}/in_vocab']:.3f}" if f"d{k}/in_vocab" in m else "")
                     for k in range(1, depth + 1))


class Trainer:
    """Under torchrun every rank builds one, with its `rank`, the `world` size and its `local_rank` (its GPU),
    inside a started process group (`run` starts it)."""

    def __init__(self, cfg, *, rank: int = 0, world: int = 1, local_rank: int = 0):
        from mtp_train.config import to_yaml
        from mtp_train.store.reader import StoreReader

        self.cfg, self.tc, self.rank, self.world = cfg, cfg.train, rank, world
        self.say = print if rank == 0 else (lambda *a, **k: None)
        self.run_dir = Path(cfg.run_dir)
        self.device = dist.device_for(cfg.target.device, dist.Ranks(rank, world, local_rank))
        self.strategy = dist.resolve_strategy(self.tc.strategy, world, self.device)
        if self.tc.ema_decay and self.strategy == "deepspeed" and self.tc.zero_stage == 3:  # before any engine
            raise ValueError(f"train.ema_decay={self.tc.ema_decay} needs every rank to hold the whole head, which "
                             "ZeRO-3 partitions: use train.zero_stage=1 or 2 (the head is small), or "
                             "train.ema_decay=0")
        if cfg.head.variant == "eagle3" and self.tc.loss.w_feat:
            raise ValueError(f"train.loss.w_feat={self.tc.loss.w_feat}: an eagle3 head is trained on the "
                             "distribution alone (its output is not an estimate of the target's hidden state); "
                             "set train.loss.w_feat=0")
        if self.tc.precision == "bf16" and self.device.type == "cpu":
            self.say("train: bf16 autocast on CPU is 20-30x slower than fp32 here; use train.precision=fp32 on CPUs")
        self.train_store, self.val_store = open_splits(cfg, self.device, rank, world, self.say)  # train/features.py
        store = self.train_store.dir.parent
        self.seed = cfg.seed if self.tc.seed is None else self.tc.seed
        frozen_dtype = torch.bfloat16 if self.tc.precision == "bf16" else torch.float32
        self.head, self.frozen, self.target_config = build_head(cfg.target.path, cfg.head, self.device, self.seed,
                                                                frozen_dtype)
        if self.head.hidden_size != self.train_store.hidden_size:
            raise ValueError(f"store {store / 'train'} holds hidden size {self.train_store.hidden_size}, the target "
                             f"{cfg.target.path} has {self.head.hidden_size}")
        self.draft_vocab = None  # head.draft_vocab > 0: counted from the train store (every rank alike)
        if cfg.head.draft_vocab:
            self.draft_vocab = choose_draft_vocab(self.train_store, cfg.head.draft_vocab, self.target_config.vocab_size)
            self.head.set_draft_vocab(self.draft_vocab.ids, self.frozen.lm_head_weight)
        self.metric_names = metric_names(self.head, self.tc.loss)
        # the target's full-vocabulary argmax / logsumexp per sample, kept across epochs (store features only:
        # online ones are recomputed on every visit, so their stats are too)
        self.target_stats = {
            split: TargetStats(self.frozen.lm_head_weight, self.tc.loss.temperature, self.tc.loss.chunk_tokens,
                               0.0 if getattr(reader, "in_process", False) else self.tc.target_stats_cache_mb)
            for split, reader in (("train", self.train_store), ("val", self.val_store))}
        for reader in (self.train_store, self.val_store):  # a store without the layers an eagle3 head reads
            Collate(reader, self.head.aux_layers)
        tc = self.tc
        self.steps_per_epoch = steps_per_epoch(len(self.train_store), tc.micro_batch, world, tc.grad_accum)
        if self.steps_per_epoch == 0:
            raise ValueError(f"{len(self.train_store)} training samples make no full step of "
                             f"train.micro_batch={tc.micro_batch} x train.grad_accum={tc.grad_accum} x {world} "
                             "ranks; lower them or prepare more data")
        self.total_steps = tc.steps or max(1, round(tc.epochs * self.steps_per_epoch))
        decay = [p for n, p in self.head.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.head.named_parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=tc.lr, betas=tuple(tc.betas), eps=1e-8)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_lambda(s, tc.warmup_steps, self.total_steps, tc.min_lr_ratio))
        self.engine_settings = dist.EngineSettings(self.strategy, tc.zero_stage, world, tc.grad_accum, tc.micro_batch,
                                                   tc.max_grad_norm)
        self.memory = self.memory_estimate()
        self.n_params = sum(p.numel() for p in self.head.parameters())  # before ZeRO-3 partitions them
        self.engine = dist.build_engine(self.head, self.optimizer, self.scheduler, self.engine_settings, self.device,
                                        tc.activation_checkpointing)
        self.config_yaml = to_yaml(cfg)
        self.step, self.epoch, self.consumed = 0, 0, 0  # optimizer steps; data position (epoch, micro-batches)
        self.autocast = autocast_for(tc.precision, self.device)
        self.ckpt_root = ckpt.checkpoint_root(self.run_dir)
        self.resumed_from, self.resumed_step = None, None
        self.stop_requests: StopRequests | None = None  # set while fit runs
        self.stop_reason: str | None = None  # this rank's stop request (a signal, run_dir/STOP), read each step
        self.stop_agreed = False
        self.ema = None  # train.ema_decay > 0: the weight average, name -> fp32 tensor beside its parameter
        if tc.ema_decay:
            self.ema = {n: p.detach().float().clone() for n, p in self.head.named_parameters()}
        if cfg.resume:
            self._resume()
        elif ckpt.checkpoints(self.ckpt_root) or (self.ckpt_root / ckpt.LATEST).exists():
            raise ValueError(f"{self.ckpt_root} already holds checkpoints: pass resume=true to continue that run, "
                             "or use another run_dir")
        resumed = self.resumed_from is not None
        self.log = MetricsLogger(self.run_dir, enabled=rank == 0, wandb_project=tc.wandb_project,
                                 wandb_name=tc.wandb_name or cfg.run_dir, config=_plain(cfg), resume=resumed,
                                 resume_step=self.step)
        if self.draft_vocab is not None and rank == 0:
            write_record(self.run_dir, self.draft_vocab)

    # -- checkpoints -------------------------------------------------------------------------------------
    def head_meta(self) -> dict:
        from mtp_train.model.target import target_fingerprint

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
                state = {"step": self.step, "epoch": self.epoch, "consumed": self.consumed,
                         "scheduler": self.scheduler.state_dict(), "total_steps": self.total_steps,
                         "data": self.data_settings(), "engine": self.engine_settings.layout()}
                weights = head_state
                if self.ema is not None:  # head.safetensors: the average; the trained weights for the resume
                    state["live_head"] = {n: head_state[n] for n in self.ema}
                    weights = {**head_state, **{n: v.to(head_state[n].dtype) for n, v in self.ema.items()}}
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

    def _resume(self) -> None:
        from mtp_train.model.target import target_fingerprint

        path = self._intact_checkpoint()
        if path is None:
            self.say(f"train: resume=true but {self.ckpt_root} holds no checkpoint; starting from step 0")
            return
        meta = ckpt.load_meta(path)
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
        self._check_draft_vocab(path, meta)
        state = ckpt.load_trainer_state(path)
        saved, now = state.get("data", {}), self.data_settings()
        changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
        if changed:
            what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
            raise ValueError(f"checkpoint {path} was saved with other data settings ({what}): its data position "
                             "would point at other samples. Resume with the same settings, or start a new run_dir")
        layout = state.get("engine", {"strategy": "full", "world": saved.get("world", 1)})
        if layout != self.engine_settings.layout():
            raise ValueError(f"checkpoint {path} holds its optimizer state as {_describe(layout)}; this run keeps it "
                             f"as {_describe(self.engine_settings.layout())}. Resume with the checkpoint's "
                             "train.strategy, train.zero_stage and number of processes, or start a new run_dir")
        if state["total_steps"] != self.total_steps:
            self.say(f"train: the checkpoint's run planned {state['total_steps']} steps, this one {self.total_steps}: "
                     "the learning-rate schedule follows the new total from here")
        later = [p.name for p in ckpt.checkpoints(self.ckpt_root) if ckpt.step_of(p) > state["step"]]
        if later:
            self.say(f"train: {', '.join(later)} come after {path.name}, which `latest` names; this run replaces "
                     "them as it reaches their steps")
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

    def _check_draft_vocab(self, path: Path, meta: dict) -> None:
        """A resume keeps the checkpoint's draft vocabulary: the same size, and the same ids as this run counts."""
        saved, mine = meta["head"].get("draft_vocab", 0), self.cfg.head.draft_vocab
        if saved != mine:
            raise ValueError(f"checkpoint {path} was trained with head.draft_vocab={saved}; this run has "
                             f"head.draft_vocab={mine}: resume with head.draft_vocab={saved}, or use another run_dir")
        if mine:
            from safetensors import safe_open

            with safe_open(str(path / "head.safetensors"), framework="pt") as f:
                same = torch.equal(f.get_tensor("d2t"), self.head.d2t.cpu())
            if not same:
                raise ValueError(f"checkpoint {path} drafts over another vocabulary than the {mine} tokens counted "
                                 f"now from {self.train_store.dir}: the train store changed since; use another run_dir")

    def memory_estimate(self):
        """The per-GPU memory estimate for this run (from the target's config and the longest train sample)."""
        from mtp_train.train.memory import estimate_memory, online_bytes

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
        if self.ema is None:
            yield
            return
        params = dict(self.head.named_parameters())
        trained = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self.ema[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(trained[n])

    def update_average(self) -> None:
        """After optimizer step t (`self.step`): ema <- d·ema + (1 - d)·w, d = min(ema_decay, (1 + t) / (10 + t))
        (the ramp lets the average leave the untrained start quickly; later steps approach the set decay)."""
        d = min(self.tc.ema_decay, (1 + self.step) / (10 + self.step))
        with torch.no_grad():
            for n, p in self.head.named_parameters():
                self.ema[n].mul_(d).add_(p.detach().float(), alpha=1 - d)

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
            _add_weighted(sums, m, tc.depth, names)
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
        out = _averages(sums, tc.depth, names)
        out.update({"loss": loss_sum, "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0],
                    "tokens": int(tokens)})
        return out

    def fit(self) -> dict:
        with subnormals.flushed(self.tc.flush_denormals and self.device.type == "cpu"):
            return self._fit()

    def _fit(self) -> dict:
        from tqdm import tqdm

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


def _plain(cfg) -> dict:
    return asdict(cfg)


def _describe(layout: dict) -> str:
    if layout.get("strategy") == "deepspeed":
        return f"DeepSpeed ZeRO-{layout['zero_stage']} partitions over {layout['world']} process(es)"
    return f"one full optimizer state (single process or DDP over {layout['world']} process(es))"


def run(cfg) -> dict:
    """`mtp-train train`: one process, or every rank under torchrun (the process group is started here). A stop
    request before step 1 (the target loading, DeepSpeed initialising, the step-0 evaluation) stops it at once."""
    with StopRequests("train", "outside an optimizer step (start-up: loading, initialising, the step-0 evaluation)",
                      at_once=True, then="the same command with resume=true goes on"):
        with dist.process_group(cfg.target.device, cfg.train.strategy) as ranks:
            return Trainer(cfg, rank=ranks.rank, world=ranks.world, local_rank=ranks.local_rank).fit()
