"""The inference engine validation and `mtp-train generate` run: target runner, drafters, sampling and the
speculative loop (DESIGN §6). It uses the model package and nothing from training."""

from mtp_train.inference.cache import SlotCache
from mtp_train.inference.drafters import Drafter, Features, HeadDrafter, LMDrafter, Proposal
from mtp_train.inference.runner import CausalLMRunner, left_pad, load_runner
from mtp_train.inference.sampling import (SamplingConfig, probabilities, sample, verify_greedy,
                                          verify_sampled)
from mtp_train.inference.speculative import DecodeStats, Generation, SpeculativeDecoder, generate
from mtp_train.inference.tree import DraftTree, TreeConfig, TreePath, verify_tree_greedy, verify_tree_sampled

__all__ = ["SlotCache", "Drafter", "Features", "HeadDrafter", "LMDrafter", "Proposal", "CausalLMRunner",
           "left_pad", "load_runner", "SamplingConfig", "probabilities", "sample", "verify_greedy",
           "verify_sampled", "DecodeStats", "Generation", "SpeculativeDecoder", "generate", "DraftTree", "TreeConfig",
           "TreePath", "verify_tree_greedy", "verify_tree_sampled"]
