"""The inference engine that validation, `mtp-train generate` and regeneration run (docs/design.md, section 6): the
target runner, drafters, sampling, draft trees and the speculative loop, and the speed model. It uses the model
package and nothing from training.

  config.py       sampling, tree and `generate.*` settings; the speed model's device profiles (no torch)
  runner.py       the target (or a draft LM) with its KV cache; drafters.py: the head and a draft LM as drafters
  cache.py        that KV cache (`SlotCache`): a batch's rows grow and are cut back by different amounts
  sampling.py     logits to tokens, greedy and sampled verification; tree.py: draft trees and their verification
  speculative.py  the speculative loop (`generate`); load.py: build the runner and drafter a run names
  predict.py      the speed model: a head's speed-up predicted from costs and acceptance
  vllm_engine.py  vLLM as a second engine (`run_vllm`), through vllm_run.py: a script run with vLLM's own Python
"""
