"""Exports of a trained checkpoint: sentence-transformers folders (`st_export.py`; `st_standard.py` for stock modules,
`st_prompted.py` the module shipped with a prompt model) and PEFT prefix-tuning adapters (`peft_export.py`,
`peft_plan.py`; `peft_loader.py` is shipped in each adapter and imports only transformers and peft)."""
