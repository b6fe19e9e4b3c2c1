"""The hidden-state store: the target's final hidden states over the prepared data, computed once
(`mtp-train precompute`) and read memory-mapped by training and validation.

  config.py      `StoreConfig` (`store.*`), no torch
  format.py      the on-disk layout: shard files and their writers, the shard plan, the manifest; `write_split`
  dtypes.py      the storage dtypes (fp32 / bf16 / fp16 / fp8 + per-token scale): `encode`, `decode`
  identity.py    the run's identity a store records and is checked against (target, tokenizer, data)
  reader.py      `StoreReader`: samples by index from memory-mapped shards
  verify.py      `mtp-train verify-store`: checksums and counts, naming any bad shard
  forward.py     the target's forward over prepared samples: the hidden states precompute and online features use
  precompute.py  the precompute stage (resumable, data-parallel under torchrun)
"""
