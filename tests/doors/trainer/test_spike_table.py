"""A fast slice of the false-spike table (``benchmarks/spike_table.py``, ``docs/reference.md#spikes``).

The table is recorded from real clients and scored by the callback's own ``SpikeGuard``; here one client's row is
recomputed whole and compared with the published one, and the first 400 steps of a Hugging Face GPT-2 client are
checked for false spikes and for the two injected faults.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import spike_table as st


def _published_row(client: str) -> list[str]:
    text = st.DOC.read_text()
    table = text[text.index(st.BEGIN) : text.index(st.END)]
    (line,) = [line for line in table.splitlines() if line.startswith(f"| {client} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_published_row_of_lightnings_boring_model_is_what_the_script_measures():
    torch.set_num_threads(1)
    recorded = st.record(st.CLIENTS["pl-boring-model"], 4000)
    row = st.score("pl-boring-model", recorded)
    measured = [row["client"], str(row["batch"]), str(row["steps"]), str(row["false"])]
    measured += [row["batch x1000"], row["lr x100"]]
    assert measured == _published_row("pl-boring-model")
    assert row["false"] == 0 and row["batch x1000"] == "step +0"


def test_a_tiny_hugging_face_gpt2_raises_no_false_spike_and_its_faults_are_caught():
    pytest.importorskip("transformers")
    torch.set_num_threads(1)
    recorded = st.record(st.CLIENTS["hf-gpt2"], 400, planned=4000)  # the table's run, its first 400 steps
    row = st.score("hf-gpt2", recorded)
    published = _published_row("hf-gpt2")
    assert row["false"] == 0
    assert (row["batch x1000"], row["lr x100"]) == (published[4], published[5])
