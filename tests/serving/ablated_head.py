"""Run with vLLM's Python (the plugin installed): `vllm_run.py` serving a `vllm-mtp` export through a copy of the
plugin's head with one thing broken on purpose, to show that `make test-serving` would see it:

- `no-post-norm`: post_norm deleted; the logits and the next step's state are the layer's raw output;
- `prenorm-feedback`: the logits read post_norm's output (as they should) but the next draft step is fed the
  state before post_norm.

    python tests/serving/ablated_head.py MODE DRAFT_DIR WORK_DIR -- TARGET PROMPTS.json OUT.json K [vllm_run options]

The ablated class is registered in this process under another architecture name (a copy of DRAFT_DIR in
WORK_DIR names it; the weights are linked), and vLLM's engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the registration is the one it sees.
"""

import json
import os
import runpy
import shutil
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
MODES = ("no-post-norm", "prenorm-feedback")
ARCH = "EagleMtpHeadAblatedForCausalLM"


def ablated(mode: str):
    import torch
    from mtp_train_vllm.model import EagleMtpHeadForCausalLM

    class Ablated(EagleMtpHeadForCausalLM):
        def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
            m = self.model
            u = m.eh_proj(torch.cat([m.enorm(m.embed_tokens(input_ids)), m.hnorm(hidden_states)], dim=-1))
            z, residual = m.mtp_block(positions, u, None)
            raw = z + residual  # the layer's output before post_norm
            if mode == "no-post-norm":
                return raw, raw
            return m.post_norm(raw), raw

    return Ablated


def main() -> None:
    mode, draft, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    if mode not in MODES or sys.argv[4] != "--":
        raise SystemExit(__doc__)
    target, prompts, out, k, *options = sys.argv[5:]
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCH, ablated(mode))
    copy = work / f"vllm-mtp-{mode}"
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir(parents=True)
    for f in draft.iterdir():
        if f.name != "config.json":
            (copy / f.name).symlink_to(f.resolve())
    config = json.loads((draft / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "architectures": [ARCH]}))
    run = Path(__file__).resolve().parents[2] / "mtp_train" / "export" / "vllm_run.py"
    sys.argv = [str(run), target, prompts, out, "eagle", str(copy), k, *options]
    runpy.run_path(str(run), run_name="__main__")


if __name__ == "__main__":
    main()
