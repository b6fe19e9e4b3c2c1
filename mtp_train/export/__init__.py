"""`mtp-train export` (run.py): the trained head in the layouts serving engines load (docs/design.md, section 7).

  config.py        `ExportConfig` and the layouts' names
  run.py           the stage: pick the layout, write it, read it back, write the model card
  layouts.py       key names and config fields per layout; write.py, eagle3.py: the writers and readers
  card.py          the model card (reads the validation report file)
  engine_check.py  serves an export in vLLM beside our engine (vllm_run.py runs in vLLM's venv)
"""
