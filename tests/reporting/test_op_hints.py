"""Each op the guard names as a culprit gets its own advice, worded from what the guard measured (issue 35, part 1).

One real ``Trainer`` fit per row, with ``NumGuardCallback()`` and a tiny model whose fault fires at global step
``BAD`` (step 0 runs clean): the fault is the one line ending with ``# FAULT: <row name>`` in this file. The guard's
root-cause event must name the row's kind and op at that line, and its message must end with the row's advice:
the words it must hold (among them the numbers the fault put there: the exponent, the frames, the label), and the
words it must not (the generic "zero std / sqrt of 0" advice, BCE advice after a division).
"""

from __future__ import annotations

import math
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from instruments.diagnosis.real.harness import marker_line
from lightning_numguard import NumGuardCallback
from lightning_numguard.reporting.hints import KIND_HINTS, event_hint
from tests.helpers import quiet_trainer

BAD = 1  #: the global step (and batch) of every fault
WIDTH = 8  #: features per sample
BATCH = 4
FLOAT32_MAX = torch.finfo(torch.float32).max
EXP_LIMIT = f"{math.log(FLOAT32_MAX):.3g}"  # where exp overflows float32: 88.7

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Step = Callable[["Net", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Net(pl.LightningModule):
    """One linear layer; the row's ``step`` is its ``training_step`` (the user's code, faulty line included)."""

    def __init__(self, step: Step, grow: float = 1.0) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.step, self.grow = step, grow

    @property
    def bad(self) -> bool:
        """The step where a fault in the code (rather than in the data) fires."""
        return self.global_step == BAD

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self.step(self, *batch)

    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> None:
        if self.bad and self.grow != 1.0:
            with torch.no_grad():
                self.fc.weight.mul_(self.grow)  # weights that grew large: finite, but past float16's range

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _regress(net: Net, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(net.fc(h).sum(-1), y)


# ----------------------------------------------------------------------------------------- the faulty user code


def exp_overflow(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return _regress(net, torch.exp(x), y)  # FAULT: exp_overflow


def expm1_overflow(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return _regress(net, torch.expm1(x), y)  # FAULT: expm1_overflow


def pow_overflow(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return _regress(net, x.pow(16), y)  # FAULT: pow_overflow


def pow_negative_base(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return _regress(net, x.pow(1.5), y)  # FAULT: pow_negative_base


def log_of_zero(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return _regress(net, torch.log(x), y)  # FAULT: log_of_zero


def log_of_negative(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return _regress(net, x.log(), y)  # FAULT: log_of_negative


def log2_of_zero(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return _regress(net, torch.log2(x), y)  # FAULT: log2_of_zero


def log1p_of_minus_one(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return _regress(net, torch.log1p(x), y)  # FAULT: log1p_of_minus_one


def div_by_empty_mask(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    keep = (x > 0).float()  # a masked mean: the positive features of each sample
    mean = (x * keep).sum(-1, keepdim=True) / keep.sum(-1, keepdim=True)  # FAULT: div_by_empty_mask
    return _regress(net, x - mean, y)


def div_by_zero_std(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    h = (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)  # FAULT: div_by_zero_std
    return _regress(net, h, y)


def div_in_the_loss(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    pred, scale = net.fc(x).sum(-1), x[:, 0].abs().min()  # a scale read from the batch
    return F.mse_loss(pred / scale, y)  # FAULT: div_in_the_loss


def sqrt_of_rounding(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    std = torch.sqrt((x * x).mean(-1, keepdim=True) - mu * mu)  # FAULT: sqrt_of_rounding
    return _regress(net, (x - mu) / (std + 1e-5), y)


def sqrt_distance_backward(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    a, b = net.fc(x[0::2]), net.fc(x[1::2])  # two views of each pair
    distance = (a - b).pow(2).sum(-1).sqrt()  # FAULT: sqrt_distance_backward
    return distance.mean()


def pow_fractional_backward(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    a, b = net.fc(x[0::2]), net.fc(x[1::2])
    spread = (a - b).abs().pow(0.5)  # FAULT: pow_fractional_backward
    return spread.mean()


def rsqrt_of_zero(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))  # FAULT: rsqrt_of_zero
    return _regress(net, h, y)


def std_of_one_sample(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    h = (x - x.mean(0)) / (x.std(0) + 1e-5)  # FAULT: std_of_one_sample
    return _regress(net, h, y)


def var_of_one_sample(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    h = (x - x.mean(0)) / torch.sqrt(x.var(0) + 1e-5)  # FAULT: var_of_one_sample
    return _regress(net, h, y)


def acos_of_rounding(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    a, b = x[0::2], x[1::2]
    cosine = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    angle = torch.acos(cosine)  # FAULT: acos_of_rounding
    return (net.fc(x).sum(-1).mean() - angle.mean()) ** 2


def asin_outside(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return _regress(net, torch.asin(x), y)  # FAULT: asin_outside


def atanh_of_one(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return _regress(net, torch.atanh(x), y)  # FAULT: atanh_of_one


def acos_backward(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    a, b = net.fc(x[0::2]), net.fc(x[1::2])  # two views of each pair
    cosine = (a * b).sum(-1) / torch.sqrt((a * a).sum(-1) * (b * b).sum(-1))  # exactly 1 for equal views
    angle = torch.acos(cosine.clamp(-1, 1))  # FAULT: acos_backward
    return angle.mean()


def _masked_scores(net: Net, x: torch.Tensor) -> torch.Tensor:
    keep = x > -1.5  # positions to attend to; a row of the bad batch keeps none
    return net.fc(x).masked_fill(~keep, float("-inf"))


def softmax_of_masked_row(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    weights = F.softmax(_masked_scores(net, x), dim=-1)  # FAULT: softmax_of_masked_row
    return F.mse_loss((weights * x).sum(-1), y)


def log_softmax_of_masked_row(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    logp = F.log_softmax(_masked_scores(net, x), dim=-1)  # FAULT: log_softmax_of_masked_row
    return -logp[:, 0].mean()


FRAMES, CLASSES = 4, 2  # fc's 8 outputs are 4 frames of 2 classes (blank and one label)


def ctc_target_too_long(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    log_probs = net.fc(x).view(-1, FRAMES, CLASSES).transpose(0, 1).log_softmax(-1)
    frames = torch.full((x.size(0),), FRAMES, dtype=torch.long)
    targets = torch.ones(x.size(0), int(t.max()), dtype=torch.long)  # the label, t times over
    return F.ctc_loss(log_probs, targets, frames, t)  # FAULT: ctc_target_too_long


def ctc_concatenated_targets(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    log_probs = net.fc(x).view(-1, FRAMES, CLASSES).transpose(0, 1).log_softmax(-1)
    frames = torch.full((x.size(0),), FRAMES, dtype=torch.long)
    targets = torch.ones(int(t.sum()), dtype=torch.long)  # every sample's labels, one after the other
    ctc = nn.CTCLoss()
    return ctc(log_probs, targets, frames, t)  # FAULT: ctc_concatenated_targets


def kl_div_log_target(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    teacher = F.log_softmax(x, -1) if net.bad else F.softmax(x, -1)  # log-probabilities passed as probabilities
    return F.kl_div(F.log_softmax(net.fc(x), -1), teacher, reduction="batchmean")  # FAULT: kl_div_log_target


def kl_div_of_log_zero(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    masked = x > 1.5  # positions the student may not predict; the teacher puts no mass there
    student = F.log_softmax(net.fc(x).masked_fill(masked, float("-inf")), -1)
    teacher = F.softmax(x, -1).masked_fill(masked, 0.0)
    return F.kl_div(student, teacher, reduction="batchmean")  # FAULT: kl_div_of_log_zero


IGNORE = -100


def cross_entropy_all_ignored(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net.fc(x), t, ignore_index=IGNORE)  # FAULT: cross_entropy_all_ignored


def bce_without_sigmoid(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    logits = net.fc(x)[:, 0]
    prob = logits if net.bad else torch.sigmoid(logits)  # the sigmoid left out
    return F.binary_cross_entropy(prob, (y > 0).float())  # FAULT: bce_without_sigmoid


def bce_of_upstream_nan(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    prob = torch.sigmoid(net.fc(x)[:, 0] + torch.log(x[:, 1]))  # a log-feature offset: NaN for a negative one
    return F.binary_cross_entropy(prob, (y > 0).float())  # FAULT: bce_of_upstream_nan


VOCAB = WIDTH


def embedding_out_of_range(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    rows = F.embedding(t, net.fc.weight)  # FAULT: embedding_out_of_range
    return F.mse_loss(rows.sum(-1), y)


def nll_loss_out_of_range(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(F.log_softmax(net.fc(x), -1), t)  # FAULT: nll_loss_out_of_range


def linear_fp16_overflow(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    h = net.fc(x)  # FAULT: linear_fp16_overflow
    return F.mse_loss(h.float().sum(-1), y)


def matmul_fp16_overflow(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    q = net.fc(x)
    scores = q @ q.transpose(0, 1)  # FAULT: matmul_fp16_overflow
    return F.mse_loss(scores.float().softmax(-1).sum(-1), y)


def op_without_advice(net: Net, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return _regress(net, torch.lgamma(x), y)  # FAULT: op_without_advice


# ----------------------------------------------------------------------------------------- the data


def _fill(value: float, row: int = 0, col: int | None = 0) -> Callable[[torch.Tensor], None]:
    """``x`` of the bad batch gets ``value`` at one place (a whole row when ``col`` is ``None``)."""

    def poison(x: torch.Tensor) -> None:
        if col is None:
            x[row] = value
        else:
            x[row, col] = value

    return poison


@dataclass(frozen=True)
class Data:
    """The batches: ``x`` (samples x WIDTH), ``y`` and integer labels ``t``; the bad batch poisoned."""

    samples: int = 2 * BATCH
    low: float | None = None  # the features drawn uniformly from [low, high) rather than normally
    high: float = 1.0
    x: Callable[[torch.Tensor], object] | None = None
    labels: tuple[int, int] = (0, WIDTH)  # the label range drawn
    bad_labels: Callable[[torch.Tensor], None] | None = None

    def loader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        if self.low is None:
            x = torch.randn(self.samples, WIDTH, generator=g)
        else:
            x = self.low + (self.high - self.low) * torch.rand(self.samples, WIDTH, generator=g)
        t = torch.randint(*self.labels, (self.samples,), generator=g)
        bad = slice(BAD * BATCH, (BAD + 1) * BATCH)
        if self.x is not None:
            self.x(x[bad])
        if self.bad_labels is not None:
            self.bad_labels(t[bad])
        return DataLoader(TensorDataset(x, torch.randn(self.samples, generator=g), t), batch_size=BATCH)


def _labels(value: int, where: slice = slice(None)) -> Callable[[torch.Tensor], None]:
    def poison(t: torch.Tensor) -> None:
        t[where] = value

    return poison


def _fp16() -> dict[str, Any]:
    """Real float16 autocast on CPU with a GradScaler (``precision="16-mixed"`` becomes bf16 on CPU)."""
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}


def _rounds_past_one() -> tuple[torch.Tensor, float]:
    """The first random vector whose cosine with itself, computed by hand in float32, rounds above 1; that cosine."""
    g = torch.Generator().manual_seed(0)
    for _ in range(1000):
        a = torch.randn(1, WIDTH, generator=g)
        cosine = float(((a * a).sum(-1) / (a.norm(dim=-1) * a.norm(dim=-1))).item())
        if cosine > 1:
            return a, cosine
    raise LookupError("no vector of 1000 rounds past 1")


ROUNDS_PAST_ONE, COSINE = _rounds_past_one()


# ----------------------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Row:
    step: Step
    kind: str
    op: str  # the op (or autograd node) the guard must name, at the row's ``# FAULT`` line
    words: tuple[str, ...]  # what the advice must say
    data: Data = Data()
    never: tuple[str, ...] = ()  # what it must not say
    trainer: Callable[[], dict[str, Any]] = dict
    grow: float = 1.0  # the factor fc's weights grow by at step BAD

    @property
    def name(self) -> str:
        return self.step.__name__


OUT, LOSS, GRAD, DOMAIN = "nonfinite_output", "nonfinite_loss", "nonfinite_grad", "op_domain"
GENERIC = ("look in this module", "add an eps or clamp")  # the one advice every op used to get
FRAMES_NEEDED = 2 * (FRAMES + 1) - 1  # a target of FRAMES + 1 equal labels: one frame each, a blank between
ROWS = [
    Row(exp_overflow, OUT, "exp", ("the exponent reached 1146", f"float32 above {EXP_LIMIT}", "clamp", "log space",
        "logsumexp"), Data(x=_fill(1146.0)), never=GENERIC),
    Row(expm1_overflow, OUT, "expm1", ("the exponent reached 200", f"above {EXP_LIMIT}", "log space"),
        Data(x=_fill(200.0)), never=GENERIC),
    Row(pow_overflow, OUT, "pow", ("`pow` overflowed float32", "|x| = 1000", "log space"), Data(x=_fill(1e3)),
        never=GENERIC),
    Row(pow_negative_base, OUT, "pow", ("negative base (-0.25)", "fractional power", "clamp the base"),
        Data(low=0.5, high=2.0, x=_fill(-0.25)), never=GENERIC),
    Row(log_of_zero, OUT, "log", ("`log` of 0 is -inf", "clamp_min", "log_softmax", "torch.xlogy"),
        Data(low=0.5, high=2.0, x=_fill(0.0)), never=GENERIC),
    Row(log_of_negative, OUT, "log", ("below 0 is NaN", "-0.25", "clamp_min"), Data(low=0.5, high=2.0,
        x=_fill(-0.25)), never=GENERIC),
    Row(log2_of_zero, OUT, "log2", ("`log2` of 0 is -inf", "clamp_min"), Data(low=0.5, high=2.0, x=_fill(0.0))),
    Row(log1p_of_minus_one, OUT, "log1p", ("`log1p` of -1 is -inf", "clamp_min(-1 + eps)"),
        Data(low=-0.5, high=1.0, x=_fill(-1.0))),
    Row(div_by_empty_mask, OUT, "div", ("a sum of 0 (an empty mask", "(0/0)", "eps"), Data(low=0.1, high=1.0, x=_fill(-1.0, col=None)),
        never=GENERIC),
    Row(div_by_zero_std, OUT, "div", ("a zero std (a constant row", "eps"), Data(x=_fill(0.3, col=None)),
        never=GENERIC),
    Row(div_in_the_loss, LOSS, "div", ("a divisor held 0", "eps"), Data(x=_fill(0.0)),
        never=("BCEWithLogitsLoss", "numerically stable form")),
    Row(sqrt_of_rounding, OUT, "sqrt", ("negative value", "rounding", "clamp before the root"),
        Data(x=_fill(0.1, col=None)), never=GENERIC),
    Row(sqrt_distance_backward, GRAD, "SqrtBackward0", ("distance", "eps inside the root", "torch.sqrt(x + eps)"),
        Data(x=lambda x: x[1].copy_(x[0])), never=("x.var(",)),
    Row(pow_fractional_backward, GRAD, "PowBackward0", ("p < 1", "infinite gradient at x = 0", "eps"),
        Data(x=lambda x: x[1].copy_(x[0]))),
    Row(rsqrt_of_zero, OUT, "rsqrt", ("`rsqrt` of 0 is Inf", "rsqrt(v + eps)"), Data(x=_fill(0.0, col=None)),
        never=GENERIC),
    Row(std_of_one_sample, OUT, "std", ("over 1 value", "correction=0", "drop_last=True"),
        Data(samples=BATCH + 1), never=GENERIC),
    Row(var_of_one_sample, OUT, "var", ("over 1 value", "correction=0", "drop_last=True"), Data(samples=BATCH + 1)),
    Row(acos_of_rounding, LOSS, "acos", (f"reached {COSINE:.9g}", "outside [-1, 1]", "1 - eps"),
        Data(x=lambda x: x[0:2].copy_(ROUNDS_PAST_ONE.expand(2, -1))), never=GENERIC),
    Row(asin_outside, OUT, "asin", ("reached 1.5", "outside [-1, 1]", "clamp"), Data(low=-0.9, high=0.9,
        x=_fill(1.5))),
    Row(atanh_of_one, OUT, "atanh", ("`atanh` of ±1", "1 - eps"), Data(low=-0.9, high=0.9, x=_fill(1.0))),
    Row(acos_backward, GRAD, "AcosBackward0", ("infinite at ±1", "1 - eps"), Data(x=lambda x: x[1].copy_(x[0]))),
    Row(softmax_of_masked_row, LOSS, "softmax", ("fully masked", "finfo"), Data(low=-1.0, x=_fill(-2.0, col=None)),
        never=GENERIC),
    Row(log_softmax_of_masked_row, LOSS, "log_softmax", ("fully masked", "finfo"),
        Data(low=-1.0, x=_fill(-2.0, col=None))),
    Row(ctc_target_too_long, LOSS, "ctc_loss", (f"one needs {FRAMES_NEEDED}, it has {FRAMES}", "zero_infinity=True",
        "longer than their input frames"), Data(labels=(1, 3), bad_labels=_labels(FRAMES + 1, slice(0, 1))),
        never=("numerically stable form",)),
    Row(ctc_concatenated_targets, LOSS, "ctc_loss", (f"one needs {FRAMES_NEEDED}, it has {FRAMES}",
        "zero_infinity=True"), Data(labels=(1, 3), bad_labels=_labels(FRAMES + 1, slice(2, 3)))),
    Row(kl_div_log_target, LOSS, "kl_div", ("target of `kl_div` holds negative values", "log_target=True")),
    Row(kl_div_of_log_zero, LOSS, "kl_div", ("holds -inf", "log_softmax"), Data(low=-1.0, x=_fill(2.0))),
    Row(cross_entropy_all_ignored, LOSS, "cross_entropy", (f"ignore_index ({IGNORE})", "every label", "0/0"),
        Data(bad_labels=_labels(IGNORE)), never=("numerically stable form",)),
    Row(bce_without_sigmoid, DOMAIN, "binary_cross_entropy", ("outside [0, 1]", "no sigmoid", "BCEWithLogitsLoss")),
    Row(bce_of_upstream_nan, DOMAIN, "binary_cross_entropy", ("input was NaN", "made upstream", "BCEWithLogitsLoss"),
        Data(low=0.5, high=2.0, x=_fill(-1.0, col=1)), never=("no sigmoid",)),
    Row(embedding_out_of_range, DOMAIN, "embedding", (f"a token id of {VOCAB + 4}", "num_embeddings"),
        Data(bad_labels=_labels(VOCAB + 4, slice(0, 1)))),
    Row(nll_loss_out_of_range, DOMAIN, "nll_loss", (f"a target of {WIDTH}", "ignore_index"),
        Data(bad_labels=_labels(WIDTH, slice(0, 1)))),
    Row(linear_fp16_overflow, OUT, "linear", ("overflowed float16", "float32", "bf16"),
        Data(x=_fill(2.0, col=None)), trainer=_fp16, grow=1e5, never=GENERIC),
    Row(matmul_fp16_overflow, LOSS, "matmul", ("overflowed float16", "q / sqrt(d)", "bf16"),
        Data(x=_fill(1e3, col=None)), trainer=_fp16, never=GENERIC),
]  # fmt: skip


def _fit(row: Row) -> dict[str, Any]:
    """``row``'s fit with ``NumGuardCallback()``; its root-cause event (coverage advice left aside)."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard = NumGuardCallback(dirpath=os.path.join(root, "ng"))
        trainer = quiet_trainer([guard], max_steps=BAD + 1, default_root_dir=root, **row.trainer())
        trainer.fit(Net(row.step, row.grow), row.data.loader())
    roots = [e for e in guard.events if e.get("root_cause", True) and e["kind"] != "optimizer_coverage"]
    assert roots, f"{row.name}: the guard recorded no incident"
    return roots[0]


@pytest.mark.parametrize("row", [pytest.param(r, id=r.name) for r in ROWS])
def test_each_op_gets_its_own_advice(row: Row) -> None:
    event = _fit(row)
    line = marker_line(__file__, row.name)
    named = (event["kind"], event["step"], event.get("op"), event.get("source"))
    assert named == (row.kind, BAD, row.op, f"{__file__}:{line}"), event["message"]
    hint = event_hint(event["kind"], event["details"])
    assert event["message"].endswith(hint)
    missing = [w for w in row.words if w not in hint]
    assert not missing, f"{row.name}: {missing} not in {hint!r}"
    said = [w for w in row.never if w in hint]
    assert not said, f"{row.name}: {said} in {hint!r}"
    assert hint != KIND_HINTS[row.kind]


def test_an_op_without_an_entry_gets_the_kinds_advice() -> None:
    """``lgamma(0)`` is Inf, and no entry speaks of it: the kind's hint, the generic one, is the advice."""
    row = Row(op_without_advice, OUT, "lgamma", (), Data(low=0.5, high=2.0, x=_fill(0.0)))
    event = _fit(row)
    assert (event["kind"], event["op"]) == (OUT, "lgamma")
    assert event_hint(OUT, event["details"]) == KIND_HINTS[OUT]
    assert event["message"].endswith(KIND_HINTS[OUT])
