import math

import pytest
import torch

from instruments.syncs import SyncCounter
from lightning_numguard.detect import checks

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
VALUES = [float("nan"), float("inf"), float("-inf")]


def reference(tensors):
    return [not bool(torch.isfinite(t).all()) for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", VALUES)
def test_norm_candidates_flag_every_nonfinite_tensor(dtype, value):
    tensors = [torch.randn(5, 3).to(dtype) for _ in range(4)] + [torch.randn(7).to(dtype)]
    tensors[2][1, 1] = value
    norms = checks.norm_candidates(tensors)
    assert norms.dtype == torch.float32
    assert (~torch.isfinite(norms)).tolist() == reference(tensors)
    assert bool((~torch.isfinite(norms)).any())
    assert checks.confirm_nonfinite(tensors) == reference(tensors)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clean_tensors_give_finite_norms(dtype):
    tensors = [torch.randn(16).to(dtype) for _ in range(3)]
    assert not bool((~torch.isfinite(checks.norm_candidates(tensors))).any())
    assert checks.confirm_nonfinite(tensors) == [False, False, False]


def test_large_finite_values_are_candidates_but_not_confirmed():
    # 1e30 in fp32 (and 6e4 in fp16) overflow an L2 norm: a candidate, never an incident.
    tensors = [torch.full((4,), 1e30), torch.full((4,), 6e4, dtype=torch.float16)]
    norms = checks.norm_candidates(tensors)
    assert not math.isfinite(norms[0].item())
    assert math.isfinite(norms[1].item())  # accumulated in float32
    assert checks.confirm_nonfinite(tensors) == [False, False]


def test_integer_empty_and_sparse_tensors():
    sparse = torch.sparse_coo_tensor([[0, 1]], [1.0, float("nan")], (3,), check_invariants=True)
    tensors = [torch.arange(3), torch.zeros(0), sparse, torch.randn(2)]
    norms = checks.norm_candidates(tensors)
    assert norms[0].item() == 0 and norms[1].item() == 0
    assert not math.isfinite(norms[2].item())
    assert checks.confirm_nonfinite(tensors) == [False, False, True, False]


def test_complex_tensors_are_checked():
    t = torch.tensor([1 + 1j, complex(float("nan"), 0)])
    assert checks.confirm_nonfinite([t]) == [True]
    assert not math.isfinite(checks.norm_candidates([t])[0].item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [*VALUES, 1e20, -3.0])
def test_max_abs_is_exact_and_propagates_nan(dtype, value):
    x = torch.zeros(10, dtype=dtype)
    y = torch.ones(3, dtype=dtype)
    if dtype in (torch.float16,) and abs(value) == 1e20:
        value = float("inf")  # not representable: becomes inf on cast
    x[4] = value
    got = checks.max_abs([x, y, torch.arange(4)]).tolist()
    expected = abs(x.double()).max().item() if not math.isnan(value) else float("nan")
    if math.isnan(expected):
        assert math.isnan(got[0])
    else:
        assert got[0] == pytest.approx(expected, rel=1e-2)
    assert got[1] == 1.0
    assert got[2] == 0.0


def test_tensor_stats():
    x = torch.tensor([[1.0, float("nan")], [float("inf"), -5.0], [float("-inf"), 2.0]])
    stats = checks.tensor_stats(x)
    assert stats["nan"] == 1 and stats["posinf"] == 1 and stats["neginf"] == 1
    assert stats["max_abs_finite"] == 5.0
    assert stats["first_bad_index"] == [[0, 1], [1, 0], [2, 0]]
    assert stats["shape"] == [3, 2]


def test_hot_path_never_syncs():
    tensors = [torch.randn(8) for _ in range(3)]
    tensors[1][0] = float("nan")
    with SyncCounter(copies_from_cpu=True) as counter, counter.step():
        flag = (~torch.isfinite(checks.norm_candidates(tensors))).any()
        checks.max_abs(tensors)
    assert counter.total == 0, counter.sites  # no host sync on the hot path
    assert bool(flag)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [*VALUES, 1e4, -7.0])
def test_hot_path_totals_agree_with_the_reference(dtype, value):
    tensors = [torch.randn(6).to(dtype), torch.zeros(3, 2).to(dtype), torch.arange(3)]
    tensors[1][1, 1] = value
    finite_ref = all(bool(torch.isfinite(t).all()) for t in tensors)
    total = checks.max_abs_total(tensors, torch.device("cpu"))
    assert math.isfinite(total.item()) == finite_ref
    if finite_ref:
        assert total.item() == pytest.approx(max(abs(value), tensors[0].abs().max().item()), rel=1e-2)
    norm = checks.norm_total(tensors[:2], torch.device("cpu"))
    assert math.isfinite(norm.item()) == finite_ref
    assert bool(~torch.isfinite(checks.norm_total(tensors[:2], torch.device("cpu")))) == (not finite_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_input_maxima_leave_out_the_dtypes_own_extreme_as_a_mask(dtype):
    """``finfo(dtype).min`` is an additive attention mask, not a fill value (issue 20); NaN and 1e20 still count."""
    mask = torch.tensor([0.0, torch.finfo(dtype).min], dtype=dtype)
    feats = torch.tensor([0.5, -2.0]).to(dtype)
    total, unmasked = checks.input_maxima([mask, feats, torch.arange(3)], torch.device("cpu"))
    assert total.item() == pytest.approx(min(torch.finfo(dtype).max, torch.finfo(torch.float32).max), rel=1e-2)
    assert unmasked.item() == 2.0
    assert checks.max_abs([mask, feats], masks_as_zero=True).tolist() == [0.0, 2.0]
    if dtype != torch.float16:  # float16 cannot hold 1e20
        feats[0] = 1e20
        assert checks.input_maxima([mask, feats], torch.device("cpu"))[1].item() == pytest.approx(1e20, rel=1e-2)
    feats[1] = float("nan")
    assert all(math.isnan(v.item()) for v in checks.input_maxima([mask, feats], torch.device("cpu")))


def test_totals_of_nothing_are_zero():
    assert checks.max_abs_total([torch.arange(2)], torch.device("cpu")).item() == 0.0
    assert checks.norm_total([], torch.device("cpu")).item() == 0.0


@pytest.mark.parametrize("rewritable", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [*VALUES, 1e4])
@pytest.mark.parametrize("where", ["large", "small"])
def test_cpu_total_sums_large_tensors_and_fuses_small_ones(rewritable, dtype, value, where):
    # one tensor takes the per-tensor sum path (>= CPU_SUM_MIN_NUMEL elements), the others the fused call
    large = torch.randn(checks.CPU_SUM_MIN_NUMEL).to(dtype)
    small = [torch.randn(5).to(dtype), torch.randn(2, 3).to(dtype)]
    (large if where == "large" else small[1])[1] = value
    tensors = [large, *small]
    before = [t.clone() for t in tensors]
    finite_ref = all(bool(torch.isfinite(t).all()) for t in tensors)
    total = checks.norm_total(tensors, torch.device("cpu"), rewritable=rewritable)
    assert total.dtype == torch.float32 and total.dim() == 0
    assert math.isfinite(total.item()) == finite_ref
    for t, b in zip(tensors, before):  # the rewriting check writes back the very same bits
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8))


def test_rewritable_total_keeps_signed_zeros_and_subnormals_bitwise():
    grads = [torch.tensor([-0.0, 1e-40, -1e-45, 3.0e38, 1.0])]
    before = grads[0].clone()
    assert math.isfinite(checks.norm_total(grads, torch.device("cpu"), rewritable=True).item())
    assert torch.equal(grads[0].view(torch.int32), before.view(torch.int32))


def test_cpu_total_of_huge_finite_values_is_only_a_candidate():
    # finite values whose float32 sum overflows: a candidate (confirmed exactly afterwards), never a proof
    tensors = [torch.full((checks.CPU_SUM_MIN_NUMEL,), 3.0e38)]
    assert not math.isfinite(checks.norm_total(tensors, torch.device("cpu")).item())
    assert checks.confirm_nonfinite(tensors) == [False]
    wide = [torch.full((checks.CPU_SUM_MIN_NUMEL,), 1e300, dtype=torch.float64)]
    assert checks.confirm_nonfinite(wide) == [False]


@pytest.mark.parametrize("numel", [1000, 1 << 20])  # in a core's cache, and beyond it
@pytest.mark.parametrize("value", [None, *VALUES, torch.finfo(torch.float32).min])
def test_input_maxima_are_exact_for_small_and_large_inputs(numel, value):
    x = torch.linspace(-3.0, 2.0, numel)
    if value is not None:
        x[numel // 2] = value
    total, unmasked = checks.input_maxima([x], torch.device("cpu"))
    expected = x.abs().max()  # NaN propagates

    def same(a: torch.Tensor, b: torch.Tensor) -> None:  # NaN where the other is NaN, else the same value
        assert bool(a.isnan()) == bool(b.isnan()), (a, b)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

    same(total, expected)
    if value == torch.finfo(torch.float32).min:  # a dtype extreme is a mask: not counted
        assert unmasked.item() == 2.0
    else:
        same(unmasked, total)
    hot = checks.unmasked_input_max([x], torch.device("cpu"))  # the step's one value: NaN for any non-finite input
    same(hot, unmasked if bool(unmasked.isfinite()) else torch.tensor(float("nan")))
    same(checks.max_abs_total([x], torch.device("cpu")), total)


def test_total_plan_groups_tensors_by_device_and_dtype_in_plan_order():
    like = [torch.zeros(4), torch.zeros(3, dtype=torch.float64), torch.zeros(checks.CPU_SUM_MIN_NUMEL), torch.zeros(2)]
    plan = checks.TotalPlan(like)
    fresh = [t + i for i, t in enumerate(like)]
    grouped = plan.grouped(fresh)
    assert [[t is f for t in g for f in fresh].count(True) for g in grouped] == [3, 1]
    assert grouped[0] == [fresh[2], fresh[0], fresh[3]] and grouped[1] == [fresh[1]]  # large first, then small


# ----------------------------------------------------------------------------- where in a batch tensor (issue 35)


def test_bad_positions_name_the_first_elements_and_samples():
    x = torch.zeros(8, 8)
    x[3, 7], x[5, 2], x[5, 4] = float("nan"), float("inf"), -float("inf")
    found = checks.bad_positions(x)
    assert found == {"positions": [[3, 7], [5, 2], [5, 4]], "samples": [3, 5], "bad_samples": 2, "samples_in_batch": 8}
    assert checks.bad_positions(x, limit=1)["positions"] == [[3, 7]]


def test_bad_positions_of_large_values_leave_masks_and_infinities_out():
    x = torch.zeros(4, 2, 3)
    x[1, 0, 2] = 1e20
    x[2, 1, 1] = torch.finfo(torch.float32).min  # an additive mask's fill: not a bad value
    x[3, 0, 0] = float("inf")  # non-finite: the other check's
    assert checks.bad_positions(x, at_least=1e18) == {
        "positions": [[1, 0, 2]],
        "samples": [1],
        "bad_samples": 1,
        "samples_in_batch": 4,
    }


def test_bad_positions_count_every_bad_sample_and_keep_the_first_few():
    x = torch.zeros(10, 5)
    x[:, 1] = float("nan")
    found = checks.bad_positions(x)
    assert found["samples"] == [0, 1, 2] and found["bad_samples"] == 10
    assert found["positions"] == [[0, 1], [1, 1], [2, 1]]


@pytest.mark.parametrize(
    "tensor", [torch.tensor(float("nan")), torch.zeros(3, dtype=torch.int64), torch.zeros(0, 4), torch.ones(4, 4)]
)
def test_bad_positions_of_what_has_none_is_empty(tensor):
    assert checks.bad_positions(tensor) == {}
