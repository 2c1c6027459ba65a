"""Fine-tuning a Hugging Face model with the guard: bf16-mixed, padded batches with attention masks.

A BERT-style classifier built from a config object (tiny and randomly initialised: no download; for a real run,
``AutoModelForSequenceClassification.from_pretrained(name)``), trained on sequences of different lengths padded
to the longest of their batch. The attention mask turns padded keys into the dtype's most negative value before
the softmax: a large finite value by design, which the guard must not report (the masks, the bf16 autocast and
the guard's checks of every watched block's output, the loss and the gradients run together here). At step
``--bad-step`` one sample's token embeddings are made NaN through a forward hook, as a corrupted input or a
broken layer would: the guard names the embedding module and rolls back. Runs as written::

    python examples/hf_finetune.py          # 120 steps
    python examples/hf_finetune.py --fast   # 8 steps (the test suite runs this)
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForSequenceClassification

from lightning_numguard import NumGuardCallback

PAD = 0


class Sentences(Dataset):
    """Random token sequences of 6 to 32 tokens; the label says whether token 7 occurs."""

    def __init__(self, n: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = int(torch.randint(6, 33, (1,), generator=g))
            ids = torch.randint(1, vocab, (length,), generator=g)
            self.items.append((ids, int((ids == 7).any())))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


def collate(items: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence of the batch; the mask is 1 on tokens and 0 on padding."""
    width = max(len(ids) for ids, _ in items)
    input_ids = torch.full((len(items), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, (ids, _) in enumerate(items):
        input_ids[row, : len(ids)] = ids
        mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": torch.tensor([y for _, y in items])}


class Classifier(pl.LightningModule):
    def __init__(self, bad_step: int | None = None) -> None:
        super().__init__()
        config = BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, num_labels=2, attn_implementation="eager",
        )  # fmt: skip
        self.model = BertForSequenceClassification(config)
        self.bad_step = bad_step
        self.model.bert.embeddings.word_embeddings.register_forward_hook(self._poison)

    def _poison(self, module: Any, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if self.training and self.global_step == self.bad_step:
            out = out.clone()
            out[0] = float("nan")  # one sample's embeddings: a corrupted input
            return out
        return None

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="8 steps (the test suite's run)")
    parser.add_argument("--bad-step", type=int, default=5, help="the step whose embeddings go NaN (-1: none)")
    parser.add_argument("--dir", default=None, help="output folder (default: a new temporary folder)")
    args = parser.parse_args()
    folder = args.dir or tempfile.mkdtemp(prefix="numguard-hf-")  # never the working directory
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    steps = 8 if args.fast else 120
    data = DataLoader(Sentences(16 * steps, 100), batch_size=16, collate_fn=collate)
    guard = NumGuardCallback(action="rollback", snapshot_every_n_steps=4, watch={"depth": 3})
    trainer = pl.Trainer(
        accelerator="cpu",
        precision="bf16-mixed",
        max_steps=steps,
        callbacks=[guard],
        default_root_dir=folder,
        enable_checkpointing=False,
        enable_progress_bar=not args.fast,
        enable_model_summary=False,
        log_every_n_steps=4,
    )
    trainer.fit(Classifier(None if args.bad_step < 0 else args.bad_step), data)
    for e in guard.events:
        print(f"step {e['step']}: {e['kind']} in {e['where'][:2]} -> {e['action']}")
    print(f"counters: {guard.counters}")
    print(f"files in: {folder}")


if __name__ == "__main__":
    main()
