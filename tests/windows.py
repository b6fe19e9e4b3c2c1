"""Small hidden-state stores for the trainer tests: windows of stdlib code with the tiny target's final
hidden states (after its norm), written with the store's own writer."""

from pathlib import Path

import torch

from mtp_train.data.stdlib import list_files
from mtp_train.model.target import TargetConfig, load_causal_lm, load_tokenizer
from mtp_train.store.format import identity_for, write_split


def code_windows(target: Path, files: slice, T: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """n windows of T tokens (two per head-train file of `files`) -> (ids [n, T], hidden [n, T, H])."""
    tok = load_tokenizer(target)
    model = load_causal_lm(target, TargetConfig(path=str(target), dtype="float32", device="cpu"))
    ids = []
    for f in list_files("head-train")[files]:
        toks = tok(f.read(), add_special_tokens=False)["input_ids"]
        ids += [toks[k:k + T] for k in range(0, len(toks) - T, T * 3)][:2]
    ids = torch.tensor(ids[:n])
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]
    return ids, hidden


def make_store(run_dir: Path, samples: list[dict], target: Path, n_train: int = 48) -> Path:
    """samples[:n_train] -> run_dir/store/train, samples[48:] -> run_dir/store/val."""
    identity = identity_for(target)
    write_split(run_dir / "store" / "train", samples[:n_train], identity=identity)
    write_split(run_dir / "store" / "val", samples[48:], identity=identity)
    return run_dir


def layer_inputs(target: Path, ids: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """The residual stream entering decoder layers `layers` (transformers' hidden_states[i]) for windows
    ids [n, T] -> [n, len(layers), T, H]: what precompute stores with `store.layers`."""
    model = load_causal_lm(target, TargetConfig(path=str(target), dtype="float32", device="cpu"))
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    return torch.stack([states[i] for i in layers], dim=1)
