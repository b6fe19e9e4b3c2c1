"""The model: the frozen target and the draft head trained on it, below every stage (it imports none of them).

  config.py      `TargetConfig`, `HeadConfig` and the variants, `InfoConfig`: settings only, no torch
  target.py      the target: where it is, its tokenizer, loading it, the architecture numbers of its config
  frozen.py      the target tensors a head shares but never trains (embedding, lm_head, final norm), read by key
  head.py        `DraftHead` (variants mtp, eagle1, eagle3), its KV cache and the unrolled training forward
  eagle3.py      EAGLE-3's own parts: the target layers it reads, its layer's config, its decoder layer
  checkpoint.py  a trained head read back from a checkpoint directory
  cache.py       where fetched pretrained targets live on this machine
"""
