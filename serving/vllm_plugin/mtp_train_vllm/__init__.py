"""vLLM plugin: mtp_train's `mtp` draft head as a draft architecture for speculative method `eagle`.

    pip install --no-deps ./serving/vllm_plugin   # into vLLM's environment (it needs vllm and torch only)
    vllm serve TARGET \\
        --speculative-config '{"method": "eagle", "model": "runs/x/export/vllm-mtp", "num_speculative_tokens": 3}'

vLLM loads `vllm.general_plugins` entry points in every process it starts; `register` adds the architecture that
the `vllm-mtp` export's config.json names. Its name starts with `Eagle`, so vLLM's EAGLE config keeps it as is
(vllm/transformers_utils/configs/eagle.py) and its EAGLE proposer drives the head. Registering twice is harmless
(vLLM loads plugins more than once per process tree).
"""

ARCHITECTURE = "EagleMtpHeadForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "mtp_train_vllm.model:EagleMtpHeadForCausalLM")
