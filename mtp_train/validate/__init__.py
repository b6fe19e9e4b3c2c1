"""`mtp-train validate` (run.py): how good the trained head is, measured with the code that serves it.

  config.py          `ValidateConfig`
  run.py             the stage: teacher-forced metrics, then decoding, then the report
  teacher_forced.py  the training objective's metrics on the val store
  decoding.py        real speculative decoding on held-out prompt sets, timed in rounds
  report.py          report.json, the printed table and the plots
  vllm.py            `validate.engine=vllm`: the decoding half run by vLLM on the head's export
"""
