import torch
from torch import nn

from lightning_numguard.detect.coverage import check_coverage, never_got_grad
from lightning_numguard.reporting.hints import coverage_problem


def model():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1))
    return m


def test_frozen_params_handed_to_the_optimizer_rcan_story():
    m = model()
    m[0].requires_grad_(False)
    opt = torch.optim.Adam(m.parameters())  # like `optim.Adam(netG.parameters())` in the seed post
    report = check_coverage(m, [opt])
    assert report.frozen_in_optimizer == ["0.weight", "0.bias"]
    ((code, names),) = report.problems()
    problem, hint = coverage_problem(code)
    assert "frozen" in problem and names == ["0.weight", "0.bias"] and "requires_grad" in hint


def test_trainable_params_in_no_optimizer():
    m = model()
    opt = torch.optim.SGD(m[0].parameters(), lr=0.1)
    report = check_coverage(m, [opt])
    assert report.not_in_optimizer == ["1.weight", "1.bias", "2.weight", "2.bias"]
    assert report.in_several_groups == []


def test_two_optimizers_sharing_a_param():
    m = model()
    a = torch.optim.SGD(m.parameters(), lr=0.1)
    b = torch.optim.SGD([m[2].weight], lr=0.1)
    assert check_coverage(m, [a, b]).in_several_groups == ["2.weight"]


def test_clean_coverage():
    m = model()
    report = check_coverage(m, [torch.optim.SGD(m.parameters(), lr=0.1)])
    assert report.problems() == []


def test_never_got_grad():
    m = model()
    m(torch.randn(1, 2))  # output unused: no backward
    out = m[0](torch.randn(1, 2)).sum()
    out.backward()
    assert never_got_grad(m, m.parameters()) == ["1.weight", "1.bias", "2.weight", "2.bias"]
