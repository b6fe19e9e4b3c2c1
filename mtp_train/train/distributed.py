"""Everything that makes training run on more than one process, in one place (the head stays one-device code).

    train.strategy   auto | single | ddp | deepspeed
    train.zero_stage 1 | 2 | 3 (deepspeed)
    train.activation_checkpointing   recompute the head's MLP in backward

`auto` is `single` for one process, DeepSpeed ZeRO (`zero_stage`, 2 by default) for several processes on
GPUs, and DDP for several processes on CPUs. Under torchrun (WORLD_SIZE set) `process_group` starts the
process group: NCCL on GPUs, gloo on CPUs, one GPU per process (LOCAL_RANK).

Every strategy is used through one `Engine`: `forward(...)` the head's unrolled training forward,
`backward(loss)` once per micro-batch, `step()` once per optimizer step (gradient clipping, optimizer,
learning-rate scheduler, gradients cleared; returns the gradient norm before clipping),
`head_state_dict()` the full head weights (gathered from the ranks under ZeRO-3), `save(dir)` / `load(dir)`
the optimizer state the way the strategy keeps it.

Gradient scale. The trainer normalizes each micro-batch's loss by the counted positions of the whole
optimizer step (all micro-batches, all ranks), so the step's gradient is the gradient of the sum of
`backward`'s losses over micro-batches and ranks. DDP and DeepSpeed average gradients over ranks; the
engines multiply the loss by the world size to undo that average, and DeepSpeed's own division by the
accumulation steps is switched off (`scale_wrt_gas=False`). The gradient is then independent of how the
step's micro-batches are spread over ranks, which is what makes runs on 1 and N processes agree
(`tests/test_distributed.py`).

Precision. The head's weights and the optimizer state stay fp32 in every strategy; `train.precision=bf16`
runs the forward under torch autocast (the trainer's), not DeepSpeed's bf16 mode, so one precision scheme
serves all strategies.
"""

from __future__ import annotations

import functools
import importlib
import os
import pickle
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mtp_train.files import NO_SPACE, DiskFull
from mtp_train.model.head import DraftHead, unrolled
from mtp_train.model.target import resolve_device
from mtp_train.store.forward import Ranks  # torchrun's RANK / WORLD_SIZE / LOCAL_RANK, as precompute reads them
from mtp_train.train.checkpoint import load_state, save_state
from mtp_train.train.config import STRATEGIES, ZERO_STAGES

PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)  # a checkpoint save or a slow rank's evaluation, not a hang
# DeepSpeed ZeRO communication buckets, in elements (fp32 here). DeepSpeed's default of 5e8 would hold 2 GB
# per bucket; the largest head (~1 B parameters) needs no more than this to keep the links busy.
ZERO_BUCKET = 50_000_000
DEEPSPEED_DIR, DEEPSPEED_TAG = "deepspeed", "zero"  # inside a checkpoint: DeepSpeed's own engine checkpoint


def resolve_strategy(strategy: str, world: int, device: torch.device) -> str:
    """The strategy `auto` stands for, and a check that the others fit the launch."""
    if strategy not in STRATEGIES:
        raise ValueError(f"train.strategy={strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if strategy == "auto":
        if world == 1:
            return "single"
        return "deepspeed" if device.type == "cuda" else "ddp"
    if strategy == "single" and world > 1:
        raise ValueError(f"train.strategy=single, but torchrun started {world} processes: use train.strategy=auto, "
                         "ddp or deepspeed, or launch one process")
    return strategy


def device_for(name: str, ranks: Ranks) -> torch.device:
    """`target.device` for this process: under torchrun on GPUs, the GPU of its local rank."""
    device = resolve_device(name)
    if device.type != "cuda":
        return device
    if ranks.world > 1 and device.index is not None:
        raise ValueError(f"target.device={name} pins every process to one GPU; under torchrun use target.device=auto "
                         "(each process takes the GPU of its LOCAL_RANK)")
    index = device.index if device.index is not None else ranks.local_rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"local rank {ranks.local_rank} needs GPU {index}, but this node has "
                         f"{torch.cuda.device_count()}: launch at most that many processes per node")
    return torch.device("cuda", index)


@contextmanager
def process_group(device_name: str, strategy: str) -> Iterator[Ranks]:
    """Starts (and at the end destroys) the process group when torchrun launched this process or the strategy
    needs one; leaves an existing group alone. Yields this process's ranks."""
    ranks = Ranks.from_env()
    launched = "WORLD_SIZE" in os.environ
    if strategy in ("ddp", "deepspeed") and not launched and not torch.distributed.is_initialized():
        raise ValueError(f"train.strategy={strategy} needs a process group: launch with torchrun (e.g. "
                         "`torchrun --standalone --nproc_per_node=N -m mtp_train train ...`; N=1 works too)")
    start = launched and not torch.distributed.is_initialized()
    if start:
        device = device_for(device_name, ranks)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                             timeout=PROCESS_GROUP_TIMEOUT)
    if torch.distributed.is_initialized():
        ranks = Ranks(torch.distributed.get_rank(), torch.distributed.get_world_size(), ranks.local_rank)
    try:
        yield ranks
    finally:
        if start:
            torch.distributed.destroy_process_group()


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def barrier() -> None:
    if distributed():
        torch.distributed.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place; the tensor itself when there is one process)."""
    if distributed() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t)
    return t


def gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank ([obj] for one process)."""
    if not distributed():
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def agree(error: BaseException | None, what: str) -> None:
    """After a part of a collective job that a rank may fail alone (a write): every rank learns whether any
    failed, and all raise together: a rank its own error, the others the first failing rank's, as the same
    kind (a full disk stays `DiskFull`). Without it a rank that failed alone leaves the others waiting at the
    next collective until the process group times out."""
    if not distributed() or torch.distributed.get_world_size() == 1:
        if error is not None:
            raise error
        return
    told = gather_objects(None if error is None else  # (errno, the message without "[Errno n]")
                         (getattr(error, "errno", None), getattr(error, "strerror", None) or str(error)))
    if error is not None:
        raise error
    for rank, failure in enumerate(told):
        if failure is not None:
            code, text = failure
            message = f"rank {rank} failed {what}: {text}"
            if code in NO_SPACE:
                raise DiskFull(code, message)
            raise OSError(code, message) if code is not None else RuntimeError(message)


# --------------------------------------------------------------------------------- activation checkpointing


def checkpoint_module(module: nn.Module) -> None:
    """Recompute `module`'s forward in backward instead of keeping its activations. The module and its
    parameter names are unchanged (the forward is wrapped in place), so checkpoints and optimizers do not see
    the difference."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if module.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)

    module.forward = forward


def apply_activation_checkpointing(head: DraftHead) -> None:
    """Recompute each decoder layer's MLP in backward (its gate/up/down activations, 4 x intermediate size per
    token, are most of the layer's). The attention is not recomputed: it appends to the head's KV cache, which
    the unrolled chain's later steps read, and a recompute would append again."""
    for layer in [head.layer, *head.extra_layers]:
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            raise ValueError(f"train.activation_checkpointing: {type(layer).__name__} has no `mlp` to recompute")
        checkpoint_module(mlp)


# -------------------------------------------------------------------------------------------------- engines


class Unrolled(nn.Module):
    """The head's training forward (every unrolled depth) as one module call: DDP and DeepSpeed hook one
    forward per backward. The frozen embedding comes in as an argument, so it is never wrapped, broadcast
    or partitioned."""

    def __init__(self, head: DraftHead):
        super().__init__()
        self.head = head

    def forward(self, embed, hidden, input_ids, lengths, depth: int, detach_chain: bool = False) -> list[torch.Tensor]:
        return unrolled(self.head, embed, hidden, input_ids, lengths, depth, detach_chain)


@dataclass(frozen=True)
class EngineSettings:
    """What an engine needs from the run config (and what a checkpoint records about it)."""

    strategy: str  # single | ddp | deepspeed (resolved)
    zero_stage: int
    world: int
    grad_accum: int
    micro_batch: int
    max_grad_norm: float  # 0 = no clipping

    def layout(self) -> dict:
        """How this engine lays out its optimizer state on disk: a resume needs the same layout."""
        if self.strategy == "deepspeed":
            return {"strategy": "deepspeed", "zero_stage": self.zero_stage, "world": self.world}
        return {"strategy": "full", "world": self.world}  # single and ddp: one full optimizer state


class Engine:
    """One process (`single`): the base the other strategies change."""

    def __init__(self, head: DraftHead, optimizer: torch.optim.Optimizer, scheduler, settings: EngineSettings):
        self.head, self.optimizer, self.scheduler, self.settings = head, optimizer, scheduler, settings
        self.model: nn.Module = Unrolled(head)
        self._micro = 0  # backward calls since the last step

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank() if distributed() else 0

    def forward(self, embed, hidden, input_ids, lengths, depth: int, detach_chain: bool = False) -> list[torch.Tensor]:
        return self.model(embed, hidden, input_ids, lengths, depth, detach_chain)

    def forward_context(self):
        """Entered around each micro-batch's forward and backward."""
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self._micro += 1

    def _check_boundary(self) -> None:
        if self._micro != self.settings.grad_accum:
            raise RuntimeError(f"step() after {self._micro} backward calls; expected train.grad_accum="
                               f"{self.settings.grad_accum}")
        self._micro = 0

    def step(self) -> float:
        """Clip, optimizer and scheduler step, clear gradients; the gradient norm before clipping. A non-finite
        norm skips the update (the weights stay the last good ones) and is returned for the caller to stop."""
        self._check_boundary()
        limit = self.settings.max_grad_norm if self.settings.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.head.parameters(), limit)
        if torch.isfinite(norm):
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """The full head weights on rank 0 (an empty dict on the others). Every rank must call it."""
        return self.head.state_dict() if self.rank == 0 else {}

    def save(self, directory: Path) -> None:
        """The optimizer state into a checkpoint directory that is being written. Every rank must call it."""
        if self.rank == 0:
            save_state(directory, "optimizer", self.optimizer.state_dict())

    def load(self, directory: Path, head_state: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Weights (`head_state()` reads them) and optimizer state from a checkpoint (the scheduler is the
        trainer's)."""
        self.head.load_state_dict(head_state())
        self.optimizer.load_state_dict(load_state(directory, "optimizer"))


class DDPEngine(Engine):
    """torch DistributedDataParallel: gradients all-reduced in buckets during the last micro-batch's backward
    (the others accumulate locally under `no_sync`)."""

    def __init__(self, head, optimizer, scheduler, settings: EngineSettings, device: torch.device):
        super().__init__(head, optimizer, scheduler, settings)
        ids = [device.index] if device.type == "cuda" else None
        # gradients as views into DDP's buckets: no second copy of them (memory.py counts one)
        self.model = DistributedDataParallel(Unrolled(head), device_ids=ids, broadcast_buffers=False,
                                             gradient_as_bucket_view=True)

    def forward_context(self):
        last = self._micro == self.settings.grad_accum - 1
        return nullcontext() if last else self.model.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss * self.settings.world)  # DDP averages over ranks; the loss is already global


class DeepSpeedEngine(Engine):
    """DeepSpeed ZeRO stage 1, 2 or 3 with the run's AdamW and schedule. DeepSpeed runs the gradient
    accumulation (reduction at the last micro-batch), clipping and the optimizer step; checkpoints hold its own
    per-rank optimizer partitions under `deepspeed/`, beside the trainer's full `head.safetensors`."""

    def __init__(self, head, optimizer, scheduler, settings: EngineSettings, device: torch.device):
        super().__init__(head, optimizer, scheduler, settings)
        deepspeed = import_deepspeed(device)
        self.ds, *_ = deepspeed.initialize(model=Unrolled(head), optimizer=optimizer, config=self.config(),
                                           dist_init_required=False)
        self.model = self.ds

    def config(self) -> dict:
        s = self.settings
        zero = {"stage": s.zero_stage, "contiguous_gradients": True, "reduce_bucket_size": ZERO_BUCKET,
                "allgather_bucket_size": ZERO_BUCKET, "overlap_comm": torch.cuda.is_available()}
        if s.zero_stage == 3:
            zero.update({"stage3_prefetch_bucket_size": ZERO_BUCKET, "stage3_max_live_parameters": 2 * ZERO_BUCKET,
                         "stage3_param_persistence_threshold": 100_000})
        return {"train_micro_batch_size_per_gpu": s.micro_batch, "gradient_accumulation_steps": s.grad_accum,
                "train_batch_size": s.micro_batch * s.grad_accum * s.world, "gradient_clipping": s.max_grad_norm,
                "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 62,
                "wall_clock_breakdown": False}

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss * self.settings.world, scale_wrt_gas=False)
        self._micro += 1
        if self._micro < self.settings.grad_accum:
            self.ds.step()  # not an accumulation boundary: DeepSpeed only counts the micro-step

    def step(self) -> float:
        self._check_boundary()
        if not self.ds.is_gradient_accumulation_boundary():
            raise RuntimeError("DeepSpeed is not at a gradient accumulation boundary: the trainer and the engine "
                               "disagree on train.grad_accum")
        self.ds.step()  # the update is applied whatever the norm: a non-finite one still stops the run
        norm = self.ds.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        if torch.isfinite(torch.tensor(norm)):
            self.scheduler.step()
        return norm

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        if self.settings.zero_stage < 3:
            return super().head_state_dict()
        import deepspeed

        params = dict(self.head.named_parameters())
        out = {}
        for name, value in self.head.state_dict().items():  # ZeRO-3 placeholders: gather each parameter in turn
            if name in params:
                with deepspeed.zero.GatheredParameters([params[name]], modifier_rank=None):
                    if self.rank == 0:
                        out[name] = params[name].detach().to("cpu", copy=True)
            elif self.rank == 0:
                out[name] = value.detach().cpu()
        return out

    def save(self, directory: Path) -> None:
        self.ds.save_checkpoint(str(directory / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, save_latest=False)

    def load(self, directory: Path, head_state: Callable[[], dict[str, torch.Tensor]]) -> None:
        """DeepSpeed's own checkpoint holds each rank's weights and partition: `head.safetensors` is not read."""
        where = directory / DEEPSPEED_DIR
        if not (where / DEEPSPEED_TAG).is_dir():
            raise FileNotFoundError(f"{where / DEEPSPEED_TAG} is missing: {directory} was not written by DeepSpeed "
                                    "or is incomplete; resume from another checkpoint")
        check_deepspeed_files(where / DEEPSPEED_TAG, self.rank)
        path, _ = self.ds.load_checkpoint(str(where), tag=DEEPSPEED_TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=False)
        if path is None:
            raise ValueError(f"DeepSpeed could not load its checkpoint from {where}")


# what DeepSpeed's checkpoints hold besides tensors and plain values (found by listing their pickles' globals)
DEEPSPEED_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.zero.config.ZeroStageEnum",
                     "deepspeed.utils.tensor_fragment.fragment_address")


def check_deepspeed_files(where: Path, rank: int) -> None:
    """Refuse a DeepSpeed checkpoint file that would run code when DeepSpeed reads it.

    DeepSpeed reads its files with `torch.load(weights_only=False)`, a full unpickler. Before it does, each file
    this rank will read (its own partitions and the shared ones) is read here with `weights_only=True` and an
    allow-list of the three DeepSpeed classes its checkpoints hold (memory-mapped: tensors are not copied). A
    file that names any other global, as a planted pickle does to run code, is refused, unread by DeepSpeed; one
    that passes can only make DeepSpeed's own read build tensors, plain values and those three classes."""
    allowed = []
    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        allowed.append(getattr(importlib.import_module(module), attr))
    other_ranks = re.compile(r"_rank_(\d+)_")
    for f in sorted(where.rglob("*.pt")):
        m = other_ranks.search(f.name.replace("mp_rank", "mp"))
        if m and int(m.group(1)) != rank:
            continue  # another rank's partition: that rank checks it
        try:
            with torch.serialization.safe_globals(allowed):
                torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as e:
            raise ValueError(f"{f} holds more than tensors, plain values and DeepSpeed's own classes, so it is not "
                             "loaded: unpickling it would run code from whoever wrote it. Resume from another "
                             f"checkpoint or start a new run_dir. ({str(e).splitlines()[0]})") from None


def import_deepspeed(device: torch.device):
    """deepspeed, with its shared-memory CPU collective left unbuilt when training on CPUs.

    On CPUs DeepSpeed's communication backend compiles a shared-memory all-reduce op (1-2 minutes with g++ on
    first use) that only its inference all-reduce calls; training goes through torch.distributed (gloo), so
    the op is marked unavailable before the backend starts."""
    try:
        import deepspeed
    except ImportError as e:
        raise ValueError("train.strategy=deepspeed needs the deepspeed package (`pip install deepspeed`); "
                         "or use train.strategy=ddp") from e
    if device.type == "cpu":
        import deepspeed.ops

        compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
        if isinstance(compatible, dict):
            compatible["deepspeed_shm_comm"] = False
    return deepspeed


def build_engine(head: DraftHead, optimizer, scheduler, settings: EngineSettings, device: torch.device,
                 activation_checkpointing: bool = False) -> Engine:
    if activation_checkpointing and settings.strategy == "deepspeed" and settings.zero_stage == 3:
        raise ValueError("train.activation_checkpointing with DeepSpeed ZeRO-3 is not supported: ZeRO-3 gathers "
                         "the partitioned weights in module hooks, which the MLP's recompute in backward bypasses; "
                         "use train.zero_stage=2 (the head's weights are small beside its activations)")
    if settings.strategy != "single" and not distributed():
        raise ValueError(f"train.strategy={settings.strategy} needs a process group: launch with torchrun")
    if activation_checkpointing:
        apply_activation_checkpointing(head)
    if settings.strategy == "single":
        return Engine(head, optimizer, scheduler, settings)
    if settings.strategy == "ddp":
        return DDPEngine(head, optimizer, scheduler, settings, device)
    if settings.strategy == "deepspeed":
        if settings.zero_stage not in ZERO_STAGES:
            raise ValueError(f"train.zero_stage={settings.zero_stage}: expected 1, 2 or 3")
        return DeepSpeedEngine(head, optimizer, scheduler, settings, device)
    raise ValueError(f"train.strategy={settings.strategy!r}: expected single, ddp or deepspeed")
