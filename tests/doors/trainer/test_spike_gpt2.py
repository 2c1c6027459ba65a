"""Issue 33: no false spike on a clean small-batch Hugging Face GPT-2 run, and a batch 1000x still caught at its step.

The reported run: a tiny random GPT-2 (``GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128)``, built from its
config, no download) at a batch of 2, AdamW under a 100-step linear warm-up and a cosine decay, with
``NumGuardCallback(spike_action="skip")`` at its defaults. At seed 121 its clean gradient norm at step 83 is 4x its
window's median; the statistics before issue 33 (median and upper-half MAD, at least 5 % of the median) scored it
11.5 against the default sigma 10 and skipped the step.
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from instruments.spike_table import markov_tokens, schedule
from lightning_numguard import NumGuardCallback
from tests.helpers import spike_window, trainer

pytest.importorskip("transformers")

SEED, STEP, STEPS, BATCH = 121, 83, 90, 2
SPIKE_KINDS = ("loss_spike", "grad_norm_spike")


class TinyGPT2(pl.LightningModule):
    """The reported run; ``fault`` multiplies step ``STEP``'s loss (``"loss x1000"``) or gradients (``"grad x1000"``)
    by 1000."""

    def __init__(self, fault: str | None = None) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(SEED)
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=64, n_layer=2, n_head=2))
        self.fault = fault

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = self.model(input_ids=x, labels=x).loss
        if self.global_step == STEP and self.fault == "loss x1000":
            loss = loss * 1000.0
        return loss

    def on_after_backward(self) -> None:
        if self.global_step == STEP and self.fault == "grad x1000":
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(1000.0)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(4000, warmup=100))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit(tmp_path: Any, fault: str | None) -> NumGuardCallback:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.cat([markov_tokens(g, BATCH) for _ in range(100)])
    guard = NumGuardCallback(dirpath=str(tmp_path / "ng"), spike_action="skip", emit_warnings=False)
    trainer(tmp_path, [guard], max_steps=STEPS).fit(
        TinyGPT2(fault), DataLoader(TensorDataset(tokens), batch_size=BATCH)
    )
    return guard


@pytest.mark.slow
def test_the_reported_gpt2_run_skips_no_clean_step(tmp_path):
    guard = _fit(tmp_path, None)
    assert [e for e in guard.events if e["kind"] in SPIKE_KINDS] == []
    assert guard.counters["spikes"] == 0 and guard.counters["skipped_steps"] == 0
    window = spike_window(guard)
    assert window is not None and window.valid() == [STEPS, STEPS]  # judged from step 16 on
    norms = window.state_dict()["values"][1][:STEPS].tolist()
    before = norms[STEP - 64 : STEP]
    assert norms[STEP] > 3.5 * statistics.median(before)  # the clean jump is there, and it is not a spike


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "kind"), [("loss x1000", "loss_spike"), ("grad x1000", "grad_norm_spike")])
def test_in_the_same_run_a_step_1000x_is_still_caught_at_its_step(tmp_path, fault, kind):
    guard = _fit(tmp_path, fault)
    spikes = [(e["kind"], e["step"], e["action"]) for e in guard.events if e["kind"] in SPIKE_KINDS]
    assert (kind, STEP, "skip") in spikes
    assert {step for _, step, _ in spikes} == {STEP}, spikes
    assert guard.counters["spikes"] == 1 and guard.counters["skipped_steps"] == 1
