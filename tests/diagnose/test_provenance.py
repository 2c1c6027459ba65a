"""The replay's one rule, on small models: the culprit is the first op that wrote a NaN/Inf none of its inputs held
and whose value reaches the bad value (``core/provenance.py``, ``core/replay.py``).

Each line a test expects is found in this file by its text, never written as a number.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from lightning_numguard.diagnose.provenance import Provenance
from lightning_numguard.diagnose.replay import replay

SOURCE = Path(__file__).read_text().splitlines()


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(SOURCE, 1) if text in line and "line_of(" not in line)


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln(x))


class Root(nn.Module):
    """A model whose own forward does something between its submodules."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault
        self.emb = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.temperature = 0.0 if fault == "temperature" else 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if self.fault == "mul_nan":
            h = h * float("nan")  # FAULT mul_nan
        if self.fault == "temperature":
            h = h / self.temperature  # FAULT temperature
        for block in self.blocks:
            h = block(h)
        return h.pow(2).mean()


def test_a_nan_made_between_submodules_is_the_root_modules_op_not_the_layernorm_that_received_it():
    for fault, op in (("mul_nan", "mul"), ("temperature", "div")):
        model = Root(fault)
        result = replay(model, lambda model=model: model(torch.randn(2, 4)))
        assert (result.stage, result.op, result.op_module) == ("forward", op, None), result
        assert result.line == line_of(f"# FAULT {fault}")
        assert result.forward_module == "blocks.0.ln"  # the first module that showed it: it only received it


class TwoSites(nn.Module):
    """Two calls of ``div``: the attention's scaling (finite) and an MLP's 0/0 (the fault)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.mlp = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) / math.sqrt(4)  # a finite div
        h = self.mlp(scores)
        h = (h - h) / (h - h).abs().sum()  # FAULT second div
        return h.sum()


def test_two_call_sites_of_one_op_name_the_call_that_went_bad():
    model = TwoSites()
    result = replay(model, lambda: model(torch.randn(3, 4)))
    assert (result.op, result.line) == ("div", line_of("# FAULT second div"))
    assert [site["line"] for site in result.op_sites["div"]] == [line_of("# a finite div"), result.line]


class Causal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.qk(x)
        att = q @ q.transpose(-1, -2)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf"))  # the causal mask: deliberate
        return self.out(att.softmax(-1) @ q).sum()


def test_a_nan_weight_under_a_causal_mask_is_the_weight_not_the_mask():
    model = Causal()
    with torch.no_grad():
        model.qk.weight[0, 0] = float("nan")
    result = replay(model, lambda: model(torch.randn(2, 3, 4)))
    assert result.stage == "inputs" and result.leaf == {"source": "param", "name": "qk.weight"}
    assert "op" not in result.details()


def test_a_clean_causal_mask_and_a_discarded_log0_are_never_culprits():
    class Buckets(Causal):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(x.shape[1]).float()
            bucket = torch.log(pos)  # log(0) = -inf, then discarded (T5's relative-position buckets)
            bucket = torch.where(pos > 0, bucket, torch.zeros_like(bucket))
            return super().forward(x) + bucket.sum() * 0 + x.pow(0.5).sum()  # FAULT sqrt of negatives

    model = Buckets()
    result = replay(model, lambda: model(-torch.ones(2, 3, 4)))
    assert (result.op, result.line) == ("pow", line_of("# FAULT sqrt of negatives"))


def test_a_nan_written_by_a_forward_hook_is_the_write_at_its_line():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))

    def poison(module: nn.Module, args: object, out: torch.Tensor) -> None:
        out[0, 1] = float("nan")  # FAULT hook setitem

    model[0].register_forward_hook(poison)
    result = replay(model, lambda: model(torch.randn(2, 4)).sum())
    assert (result.stage, result.op, result.op_module) == ("forward", "__setitem__", "0"), result
    assert result.line == line_of("# FAULT hook setitem") and result.literal is True


def test_a_fully_masked_row_blames_the_softmax_and_says_the_row_was_masked():
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qk = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            att = (self.qk(x) @ x.transpose(-1, -2)).masked_fill(~keep[:, None, :], float("-inf"))
            return att.softmax(-1).sum()  # FAULT masked row

    model, keep = Masked(), torch.ones(2, 3, dtype=torch.bool)
    keep[1] = False
    result = replay(model, lambda: model(torch.randn(2, 3, 4), keep))
    assert (result.op, result.line, result.inf_in) == ("softmax", line_of("# FAULT masked row"), True)


def test_an_accidental_inf_that_a_later_op_turns_into_nan_is_the_inf_s_maker():
    class Overflow(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            big = x.exp()  # FAULT exp overflow
            return (big - big).sum()  # inf - inf = NaN: it only received the Inf

    model = Overflow()
    result = replay(model, lambda: model(torch.full((3,), 100.0)))
    assert (result.op, result.line) == ("exp", line_of("# FAULT exp overflow"))


def test_a_bad_batch_field_is_a_leaf_named_by_its_path():
    model = nn.Linear(4, 1)
    batch = {"x": torch.randn(2, 4)}
    batch["x"][0, 0] = float("nan")
    result = replay(model, lambda: model(batch["x"]).sum(), batch=batch)
    assert result.stage == "inputs" and result.leaf["source"] == "input" and "x" in result.leaf["name"]


def test_the_culprit_walk_stops_at_a_deliberate_inf():
    with Provenance([], dict) as trace:
        a = torch.zeros(3).masked_fill(torch.tensor([True, False, False]), float("-inf"))
        b = a - a  # -inf - -inf = NaN from a deliberate Inf: this op is the culprit
    nan_origin = trace.origin(b, "nan")
    assert nan_origin.op == "sub" and nan_origin.from_inf is not None and nan_origin.from_inf.deliberate
    assert Provenance.culprit(nan_origin) is nan_origin
