"""A fast slice of the false-spike table (``benchmarks/spike_table.py``, ``docs/reference.md#spikes``).

The table is recorded from real clients and scored by the callback's own ``SpikeGuard``; here one client's row is
recomputed whole and compared with the published one, and the first 320 steps of issue 33's GPT-2 (width 64, a batch
of 2) are checked for false spikes, for the three injected faults and for a batch 1000x at the step the statistics
before issue 33 flagged.
"""

from __future__ import annotations

import pytest
import torch

from instruments import spike_table as st


def _published_row(client: str) -> list[str]:
    text = st.DOC.read_text()
    table = text[text.index(st.BEGIN) : text.index(st.END)]
    (line,) = [line for line in table.splitlines() if line.startswith(f"| {client} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_published_row_of_lightnings_boring_model_is_what_the_script_measures():
    torch.set_num_threads(1)
    recorded = st.record(st.CLIENTS["pl-boring-model"], 4000)
    row = st.score("pl-boring-model", recorded)
    measured = [row["client"], str(row["batch"]), str(row["steps"]), str(row["false"]), row["top"]]
    measured += [row[fault] for fault in st.FAULTS] + [row["sweep"]]
    assert measured == _published_row("pl-boring-model")
    assert row["false"] == 0 and row["batch x1000"] == "step +0" and row["grad x1000"] == "step +0"


def test_issue_33s_gpt2_raises_no_false_spike_and_its_faults_are_caught():
    pytest.importorskip("transformers")
    torch.set_num_threads(1)
    client = st.CLIENTS["hf-gpt2-64"]
    recorded = st.record(client, 320, planned=4000)  # the table's run, its first 320 steps
    series = recorded["series"]
    assert st.flagged(series) == []  # the statistics before issue 33 flagged step 85 (z 11.0)
    assert series[85][1] > 3 * sorted(v for _, v in series[21:85])[32]  # the clean jump: over 3x the median
    row = st.score("hf-gpt2-64", recorded)
    assert [row[fault] for fault in st.FAULTS] == _published_row("hf-gpt2-64")[5:8]
    assert row["batch x1000"] == "step +0" and row["grad x1000"] == "step +0"
    # a batch 1000x (its loss and so its gradient norm) at that same step, in the young window, is caught there
    bad = [*series[:85], (series[85][0] * 1000, series[85][1] * 1000), *series[86:]]
    assert st.flagged(bad) == [85]
