"""The training stage's settings (`train.*`, `train.loss.*`). Plain dataclasses and constants, no torch:
`mtp_train.config` composes them into the run config."""

from __future__ import annotations

from dataclasses import dataclass, field

STRATEGIES = ("auto", "single", "ddp", "deepspeed")  # train.strategy
ZERO_STAGES = (1, 2, 3)  # train.zero_stage
FEATURES = ("store", "online", "hybrid")  # train.features: where the target's features come from (features.py)
OUT_OF_VOCAB = ("drop", "renormalise")  # train.loss.out_of_vocab


@dataclass
class LossConfig:
    w_feat: float = 0.1  # SmoothL1 on the hidden state (EAGLE's regression term)
    w_logit: float = 1.0  # CE against the target's own distribution
    temperature: float = 1.0  # of the target distribution p
    gamma: float = 0.8  # depth j weighs gamma**j
    chunk_tokens: int = 1024  # positions per softmax chunk (peak memory ~ chunk_tokens x vocab x 4 bytes x 4)
    # LK loss (arXiv 2602.23881, its negative log-acceptance form): a row's distribution term is
    # (1 - w) · CE(q, p) + w · (-log α), α = Σ_x min(p_full(x), q(x)), the expected acceptance of the draft
    # token at T = 1; 0 is the soft cross-entropy alone, 1 the acceptance alone
    accept_weight: float = 0.0
    # over a draft vocabulary, the positions whose target argmax is outside it: "drop" (no distribution term; EAGLE-3's
    # and SpecForge's choice) or "renormalise" (the term against the target renormalised over the draft vocabulary,
    # like every other position; speculators' choice). Either way they stay in the denominator and the metrics
    out_of_vocab: str = "drop"
    # GRIFFIN's token-alignable training (arXiv 2502.11018): with k > 0 an anchor's row at depth j >= 2 has no term
    # (feature or distribution) unless the draft's top-k at each earlier depth held the target's argmax, i.e. unless
    # decoding that keeps k candidates a step could have reached it (1: a chain under greedy verification; GRIFFIN
    # trains with 3 for trees). Rows it drops stay in the denominator and in the metrics; `d{k}/reached` is the
    # share of a depth's rows that count. 0: every row counts (EAGLE-3's TTT)
    align_topk: int = 0
    # HASS's harmonized objective distillation (arXiv 2408.15766): each row's distribution term adds
    # topk_weight · (-Σ_{x in the target's top-`topk`} p(x) log q(x)), so the tokens that decide acceptance weigh more
    # than the tail the full CE also fits. 0 is off; HASS uses K = 10
    topk_weight: float = 0.0
    topk: int = 10

    def __post_init__(self) -> None:
        if self.w_feat < 0 or self.w_logit < 0 or self.w_feat + self.w_logit == 0:
            raise ValueError(f"loss.w_feat={self.w_feat}, loss.w_logit={self.w_logit}: both must be >= 0, "
                             "not both 0")
        if self.temperature <= 0:
            raise ValueError(f"loss.temperature={self.temperature}: must be > 0")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"loss.gamma={self.gamma}: must be in (0, 1]")
        if self.chunk_tokens < 1:
            raise ValueError(f"loss.chunk_tokens={self.chunk_tokens}: must be >= 1")
        if not 0 <= self.accept_weight <= 1:
            raise ValueError(f"loss.accept_weight={self.accept_weight}: must be in [0, 1]")
        if self.out_of_vocab not in OUT_OF_VOCAB:
            raise ValueError(f"loss.out_of_vocab={self.out_of_vocab!r}: must be one of {', '.join(OUT_OF_VOCAB)}")
        if self.topk_weight < 0 or self.topk < 1:
            raise ValueError(f"loss.topk_weight={self.topk_weight}, loss.topk={self.topk}: must be >= 0 and >= 1")
        if self.align_topk < 0:
            raise ValueError(f"loss.align_topk={self.align_topk}: must be >= 0 (0 is off)")



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
        if self.strategy not in STRATEGIES:
            raise ValueError(f"train.strategy={self.strategy!r}: expected one of {', '.join(STRATEGIES)}")
        if self.features not in FEATURES:
            raise ValueError(f"train.features={self.features!r}: expected one of {', '.join(FEATURES)}")
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"train.zero_stage={self.zero_stage}: expected 1, 2 or 3 "
                             "(used by train.strategy=deepspeed)")
