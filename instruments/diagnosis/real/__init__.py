"""Diagnosis scenarios on model code the project did not write (Hugging Face, Lightning's demos) and on user-style
code: every row of ``docs/diagnosis.md``'s real-model table. ``ROWS`` run in one process; ``FSDP2_ROW`` is launched
(2 gloo processes, ``fsdp2_script.py``)."""

from __future__ import annotations

from instruments.diagnosis.real import hf, lightning_examples, user_code
from instruments.diagnosis.real.fsdp2_script import ROW as FSDP2_ROW

ROWS = [*user_code.ROWS, *hf.ROWS, *lightning_examples.ROWS]

__all__ = ["FSDP2_ROW", "ROWS"]
