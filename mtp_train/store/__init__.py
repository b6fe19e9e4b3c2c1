"""The hidden-state store: the target's final hidden states over the prepared data, computed once
(`mtp-train precompute`) and read memory-mapped by training and validation.

  format.py      shard layout, storage dtypes (fp32 / bf16 / fp16 / fp8 + per-token scale), the shard plan,
                 the manifest and the run's identity (target, tokenizer, data); `write_split`
  reader.py      `StoreReader`: samples by index from memory-mapped shards
  verify.py      `mtp-train verify-store`: checksums and counts, naming any bad shard
  precompute.py  `StoreConfig` and the precompute stage (resumable, data-parallel under torchrun)
"""
