"""Hugging Face ``transformers`` models built from tiny random configs (no download), trained by a LightningModule
written the way the ``transformers`` docs show; faults come in through the data, a weight, a hook or a config value.

The faulty op of a library-side fault is read from the installed ``transformers`` source (:class:`LibrarySite`);
a fault written by this file ends with ``# FAULT: <tag>``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from instruments.diagnosis.real.harness import BAD_STEP, Leaf, LibrarySite, Marker, Row, fp16_autocast

VOCAB, SEQ, N, BATCH = 100, 8, 16, 4
BAD = BAD_STEP * BATCH + 1  # a sample of the batch of BAD_STEP


class HFModule(pl.LightningModule):
    """Wraps a ``transformers`` model as ``self.model``; ``inject(self)`` runs at ``BAD_STEP``'s batch start."""

    def __init__(self, model: nn.Module, inject: Callable[[HFModule], None] | None = None, loss: str = "") -> None:
        super().__init__()
        self.model, self.inject, self.loss_mode = model, inject, loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.loss_mode == "bce":
            logits = self.model(input_ids=batch["input_ids"]).logits
            return F.binary_cross_entropy(torch.sigmoid(logits), batch["targets"])
        if self.loss_mode == "weighted":  # per-token loss weights from the data
            logits = self.model(input_ids=batch["input_ids"]).logits[:, :-1]
            tokens = F.cross_entropy(logits.reshape(-1, VOCAB), batch["input_ids"][:, 1:].reshape(-1), reduction="none")
            return (tokens * batch["weight"][:, 1:].reshape(-1)).mean()
        return self.model(**batch).loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.inject is not None and self.global_step == BAD_STEP:
            with torch.no_grad():
                self.inject(self)
            self.inject = None

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def samples(**fields: Callable[[int], torch.Tensor]) -> DataLoader:
    """``N`` dict samples, each field made by ``make(i)``."""
    return DataLoader([{k: make(i) for k, make in fields.items()} for i in range(N)], batch_size=BATCH)


def tokens(i: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))


def _eager(config: Any) -> Any:
    config._attn_implementation = "eager"  # the explicit ops of the attention, as on a CPU without SDPA
    return config


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(_eager(cfg))


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(_eager(cfg))


def bert(masked_lm: bool = False, num_labels: int = 1) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, num_labels=num_labels)  # fmt: skip
    return BertForMaskedLM(_eager(cfg)) if masked_lm else BertForSequenceClassification(_eager(cfg))


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                   feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    return T5ForConditionalGeneration(_eager(cfg))


def nan_hook(module: nn.Module, inputs: Any, out: torch.Tensor) -> None:
    """A debugging hook left in: it marks one activation by writing into the module's output in place."""
    out[0, 0] = float("nan")  # FAULT: hook-write


def _hook(name: str) -> Callable[[HFModule], None]:
    def inject(m: HFModule) -> None:
        m.get_submodule(name).register_forward_hook(nan_hook)

    return inject


def _nan_param(name: str) -> Callable[[HFModule], None]:
    def inject(m: HFModule) -> None:
        m.get_parameter(name)[0, 0] = float("nan")  # FAULT: nan-param

    return inject


def _fill(name: str, value: float) -> Callable[[HFModule], None]:
    def inject(m: HFModule) -> None:
        m.get_parameter(name).fill_(value)  # a weight that grew to a large, still finite value

    return inject


def _scale(name: str, factor: float) -> Callable[[HFModule], None]:
    def inject(m: HFModule) -> None:
        m.get_parameter(name).mul_(factor)

    return inject


def _poison(field: str, make: Callable[[int], torch.Tensor], at: int = BAD) -> Callable[[int], torch.Tensor]:
    """``make``, with a NaN in sample ``at`` (a corrupt record in the data)."""

    def sample(i: int) -> torch.Tensor:
        value = make(i).clone()
        if i == at:
            value.view(-1)[0] = float("nan")  # FAULT: nan-batch
        return value

    return sample


def _embeds(i: int) -> torch.Tensor:
    return torch.randn(SEQ, 32, generator=torch.Generator().manual_seed(i))  # features from an upstream encoder


def _out_of_vocab(i: int) -> torch.Tensor:
    t = tokens(i)
    if i == BAD:
        t[2] = VOCAB  # one id past the vocabulary (a tokenizer bigger than the model's config)
    return t


def _lm(make: Callable[[], nn.Module], inject: Any = None, loss: str = "") -> Callable[[], HFModule]:
    return lambda: HFModule(make(), inject, loss)


def _rows() -> list[Row]:
    from transformers.models.bert.modeling_bert import BertForMaskedLM
    from transformers.models.gpt2.modeling_gpt2 import GPT2Model
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.t5.modeling_t5 import T5DenseActDense

    f = __file__
    lm = samples(input_ids=tokens, labels=tokens)
    t5_embeds = samples(inputs_embeds=_poison("inputs_embeds", _embeds), labels=tokens)
    wo = "model.encoder.block.1.layer.1.DenseReluDense.wo"
    wo_site = LibrarySite(T5DenseActDense, "hidden_states = self.wo(hidden_states)", wo)
    fp16 = "fp16 autocast on CPU (MixedPrecision plugin, GradScaler)"
    up = "model.model.layers.0.mlp.up_proj"
    return [
        Row("llama_fp16_up_proj", "HF LlamaForCausalLM", "fp16 overflow in the MLP's `up_proj` (its weight grew x1e6)",
            lambda: (_lm(llama, _scale(f"{up}.weight", 1e6))(), lm), "nonfinite_output", "linear",
            LibrarySite(LlamaMLP, "self.up_proj(x)", up), f, trainer=fp16_autocast(), note=fp16),
        Row("llama_nan_weight", "HF LlamaForCausalLM", "a NaN weight in the second layer's `q_proj` (causal mask)",
            lambda: (_lm(llama, _nan_param("model.model.layers.1.self_attn.q_proj.weight"))(), lm),
            "nonfinite_param", None, Leaf("model.model.layers.1.self_attn.q_proj.weight", "nan-param"), f),
        Row("gpt2_embedding_index", "HF GPT2LMHeadModel", "a token id past the vocabulary in the data",
            lambda: (_lm(gpt2)(), samples(input_ids=_out_of_vocab, labels=tokens)), "op_domain", "embedding",
            LibrarySite(GPT2Model, "inputs_embeds = self.wte(input_ids)", "model.transformer.wte"), f),
        Row("gpt2_hook_write", "HF GPT2LMHeadModel", "a forward hook writes NaN into block 0's MLP output in place",
            lambda: (_lm(gpt2, _hook("model.transformer.h.0.mlp"))(), lm), "nonfinite_output", "__setitem__",
            Marker("hook-write", hooked="model.transformer.h.0.mlp"), f),
        Row("gpt2_accumulation", "HF GPT2LMHeadModel", "NaN in the second micro-batch's loss weights",
            lambda: (_lm(gpt2, loss="weighted")(),
                     samples(input_ids=tokens, weight=_poison("weight", lambda i: torch.ones(SEQ), 3 * BATCH))),
            "nonfinite_input", None, Leaf("batch['weight']", "nan-batch"), f,
            trainer={"accumulate_grad_batches": 2}, note="accumulate_grad_batches=2", batch_idx=3),
        Row("bert_labels_nan", "HF BertForSequenceClassification", "NaN in a regression label (batch field)",
            lambda: (_lm(bert)(), samples(input_ids=tokens, labels=_poison("labels", lambda i: torch.randn(())))),
            "nonfinite_input", None, Leaf("batch['labels']", "nan-batch"), f),
        Row("bert_bce_upstream", "HF BertForSequenceClassification", "BCE fed an upstream NaN (pooler weight)",
            lambda: (_lm(lambda: bert(num_labels=3), _nan_param("model.bert.pooler.dense.weight"), "bce")(),
                     samples(input_ids=tokens, targets=lambda i: (tokens(i)[:3] % 2).float())),
            "nonfinite_param", None, Leaf("model.bert.pooler.dense.weight", "nan-param"), f),
        Row("bert_mlm_label_range", "HF BertForMaskedLM", "an MLM label past the vocabulary (cross_entropy)",
            lambda: (_lm(lambda: bert(masked_lm=True))(), samples(input_ids=tokens, labels=_out_of_vocab)),
            "op_domain", "cross_entropy",
            LibrarySite(BertForMaskedLM, "masked_lm_loss = loss_fct(prediction_scores.view", "model"), f),
        Row("t5_embeds_nan", "HF T5ForConditionalGeneration", "NaN in `inputs_embeds` (log(0) of T5's buckets: no culprit)",
            lambda: (_lm(t5)(), t5_embeds), "nonfinite_input", None, Leaf("batch['inputs_embeds']", "nan-batch"), f),
        Row("t5_embeds_nan_fp16", "HF T5ForConditionalGeneration", "NaN in `inputs_embeds`, fp16 autocast",
            lambda: (_lm(t5)(), t5_embeds), "nonfinite_input", None, Leaf("batch['inputs_embeds']", "nan-batch"), f,
            trainer=fp16_autocast(), note=fp16),
        Row("t5_wo_fp32", "HF T5ForConditionalGeneration", "overflow in block 1's `DenseReluDense.wo` (weights 1e38)",
            lambda: (_lm(t5, _fill(f"{wo}.weight", 1e38))(), lm), "nonfinite_output", "linear", wo_site, f),
        Row("t5_wo_fp16", "HF T5ForConditionalGeneration", "fp16 overflow in block 1's `DenseReluDense.wo` (weights 1e4)",
            lambda: (_lm(t5, _fill(f"{wo}.weight", 1e4))(), lm), "nonfinite_output", "linear", wo_site, f,
            trainer=fp16_autocast(), note=fp16),
    ]  # fmt: skip


ROWS = _rows()
