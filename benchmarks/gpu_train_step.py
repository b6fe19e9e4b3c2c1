"""The training step of a Llama-3.1-8B-shaped head on one GPU: tokens/s, MFU and peak memory against the
memory estimate.

The step is the trainer's own (the `mtp` head's unrolled forward under bf16 autocast, `head_loss` normalized
by the step's counted positions, `Engine.backward` / `Engine.step`: clipping, AdamW, schedule), on random
frozen tensors (E, W in bf16, vocabulary 128256) and random hidden states shaped like a store's micro-batch;
the architecture comes from tests/fixtures/configs/llama3.1-8b/config.json and the settings from the
`llama3.1-8b` recipe (micro-batch 8 x 2048 tokens, depth 3), so no weights are needed.

    python benchmarks/gpu_train_step.py                     # 10 warm-up + 50 timed steps on cuda:0
    python benchmarks/gpu_train_step.py --activation-checkpointing --micro-batch 16
    python benchmarks/gpu_train_step.py --online              # train.features=online: the target's forward too

With --online every step first computes the micro-batch's hidden states with a randomly initialised target of
the same architecture (bf16, on the same GPU) through precompute's forward (`store.precompute.sample_states`,
the trainer's online path), as `train.features=online` does; tokens/s against the offline step is what online
training costs per epoch on a GPU.

MFU counts model FLOPs per counted position and unrolled step: 6 x the head's matmul parameters (forward and
backward), 6 x V x H for the loss (target logits, draft logits, the gradient through the frozen W; no
gradient for W itself), 6 x (query width) x T/2 for causal attention; recomputation is not counted. Peak
memory is torch.cuda.max_memory_allocated (and reserved) over the timed steps. Writes
benchmarks/results/gpu_train_step.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_train_step.json"
RESULTS_ONLINE = ROOT / "benchmarks" / "results" / "gpu_train_step_online.json"
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}  # dense bf16 FLOP/s


def peak_flops(name: str, override: float | None) -> float | None:
    if override:
        return override * 1e12
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "tests" / "fixtures" / "configs" / "llama3.1-8b"))
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not H100/H200/A100")
    p.add_argument("--online", action="store_true", help="compute the hidden states with the target every step")
    p.add_argument("--device", default="cuda:0", help="cpu only to smoke-test the script (no memory figures)")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu_train_step.py needs a CUDA GPU (or --device cpu for a smoke test)")

    from mtp_train.config import compose
    from mtp_train.model.frozen import FrozenTarget
    from mtp_train.train import distributed as dist
    from mtp_train.train.loss import counted_positions, head_loss
    from mtp_train.train.memory import estimate_memory, load_target_config
    from mtp_train.train.optim import lr_lambda
    from mtp_train.train.trainer import init_head_weights

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    cfg = compose("llama3.1-8b", [f"target.path={args.config}", "run_dir=unused",
                                  f"train.micro_batch={args.micro_batch}", f"train.depth={args.depth}",
                                  f"data.max_length={args.seq}",
                                  f"train.activation_checkpointing={str(args.activation_checkpointing).lower()}"])
    tc = cfg.train
    config = load_target_config(args.config)
    H, V = config.hidden_size, config.vocab_size
    torch.manual_seed(0)
    from mtp_train.model.head import DraftHead

    head = DraftHead(config, cfg.head)
    init_head_weights(head, config.initializer_range)
    head = head.to(device)
    frozen = FrozenTarget(torch.randn(V, H, dtype=torch.bfloat16) * 0.02,
                          torch.randn(V, H, dtype=torch.bfloat16) * 0.02).to(device)
    n_params = sum(p.numel() for p in head.parameters())
    matmul = sum(m.weight.numel() for m in head.modules() if isinstance(m, torch.nn.Linear))
    opt = torch.optim.AdamW(head.parameters(), lr=tc.lr, betas=tuple(tc.betas), fused=cuda)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, tc.warmup_steps, 10_000, tc.min_lr_ratio))
    settings = dist.EngineSettings("single", tc.zero_stage, 1, 1, tc.micro_batch, tc.max_grad_norm)
    engine = dist.build_engine(head, opt, sched, settings, device, tc.activation_checkpointing)
    target_states = None
    if args.online:  # a random target of the same shape: its forward costs what the real one's does
        from transformers import AutoModel

        from mtp_train.store.forward import HiddenStates, sample_states
        from mtp_train.train.memory import online_target_bytes

        with torch.device(device):
            decoder = AutoModel.from_config(config, dtype=torch.bfloat16).eval().requires_grad_(False)
        hs = HiddenStates(decoder, [])

        def target_states(ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, H] float32
            flat = ids.flatten().cpu()
            offsets = torch.arange(0, flat.numel() + 1, ids.shape[1])
            out = torch.empty(flat.numel(), H, device=device)
            for rows, states, _ in sample_states(hs, flat, offsets, cfg.store.batch_tokens, cfg.store.pad_multiple):
                out[rows.to(device)] = states[0].float()
            return out.view(*ids.shape, H)
    estimate = estimate_memory(config, tc, args.seq, 1, "single", cfg.head,
                               online_target=online_target_bytes(config, 2, cfg.store.batch_tokens, 1)
                               if args.online else 0)

    B, T = args.micro_batch, args.seq
    gen = torch.Generator(device=device.type).manual_seed(0)
    batch = {"hidden": torch.randn(B, T, H, device=device, generator=gen),
             "input_ids": torch.randint(0, V, (B, T), device=device, generator=gen),
             "loss_mask": torch.ones(B, T, dtype=torch.bool, device=device),
             "lengths": torch.full((B,), T, device=device)}
    norm = counted_positions(batch["loss_mask"], batch["lengths"], tc.depth)

    def step() -> float:
        if target_states is not None:
            batch["hidden"] = target_states(batch["input_ids"])
        with torch.autocast(device.type, dtype=torch.bfloat16):
            outs = engine.forward(frozen.embed, batch["hidden"], batch["input_ids"], batch["lengths"], tc.depth)
        loss, _ = head_loss([o.float() for o in outs], batch["hidden"], batch["loss_mask"], batch["lengths"],
                            frozen.lm_head_weight, tc.loss, norm=norm)
        engine.backward(loss)
        engine.step()
        return loss.item()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses = [step() for _ in range(args.steps)]
    sync()
    seconds = time.perf_counter() - t0
    tokens = B * T * args.steps
    counted = sum(norm) * args.steps
    flops = counted * (6 * matmul + 6 * V * H + 6 * head.config.num_attention_heads
                       * getattr(head.config, "head_dim", H // head.config.num_attention_heads) * T / 2)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = peak_flops(name, args.peak_tflops)
    result = {"gpu": name, "torch": torch.__version__, "config": args.config, "head_params": n_params,
              "online": args.online, "micro_batch": B, "seq": T, "depth": tc.depth, "activation_checkpointing": tc.activation_checkpointing,
              "steps": args.steps, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
              "step_ms": round(1000 * seconds / args.steps, 2), "model_tflops": round(flops / seconds / 1e12, 1),
              "mfu": round(flops / seconds / peak, 4) if peak else None,
              "peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
              "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2) if cuda else None,
              "estimate_gib": round(estimate.total / 2**30, 2),
              "estimate_without_overhead_gib": round((estimate.total - estimate.overhead) / 2**30, 2),
              "loss_first_last": [round(losses[0], 4), round(losses[-1], 4)]}
    print(estimate.format(torch.cuda.get_device_properties(device).total_memory if cuda else None, "single x 1"))
    print(json.dumps(result, indent=2))
    if cuda:
        out = RESULTS_ONLINE if args.online else RESULTS
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
