"""``core.syncs.SyncCounter``: what it counts, when, and who caused it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from instruments.syncs import SyncCounter
from tests.test_engine_imports import _run

METHODS = SyncCounter.READS + SyncCounter.COPIES


def _foreign_reader(package: str):
    """A function whose frames belong to module ``package.mod`` and that calls ``read()``."""
    namespace: dict = {"__name__": f"{package}.mod"}
    exec(compile("def call(read):\n    return read()\n", f"<{package}>", "exec"), namespace)
    return namespace["call"]


def test_counts_an_item_inside_a_step_window() -> None:
    t = torch.arange(3.0)
    with SyncCounter(package=__name__) as counter, counter.step():
        assert t.sum().item() == 3.0
    assert counter.step_total == [1]
    assert counter.step_caused == [1]
    assert counter.step_on_device == [0]
    assert counter.total == counter.caused == 1
    [(site, n)] = counter.sites.items()
    assert n == 1
    assert site.startswith(f"step | item | caused | {__name__}:")
    assert site.endswith("test_counts_an_item_inside_a_step_window")


@pytest.mark.parametrize(
    ("name", "read"),
    [
        ("item", lambda t: t.item()),
        ("tolist", lambda t: t.tolist()),
        ("__bool__", lambda t: bool(t)),
        ("__float__", lambda t: float(t)),
        ("__int__", lambda t: int(t)),
        ("__index__", lambda t: [0, 1, 2][t]),
        ("numpy", lambda t: t.numpy()),
        ("__repr__", lambda t: f"{t!r}"),
    ],
)
def test_every_read_method_counts(name, read) -> None:
    t = torch.tensor(1)
    with SyncCounter(package=__name__) as counter, counter.step():
        read(t)
    assert counter.step_total == [1]
    assert [key.split(" | ")[1] for key in counter.sites] == [name]


def test_nothing_counts_when_not_installed_or_outside_a_window() -> None:
    t = torch.ones(2)
    counter = SyncCounter()
    with counter.step():
        t.sum().item()  # not installed
    assert counter.step_total == [0]
    with counter:
        t.sum().item()  # installed, no window open
        with counter.step():
            pass
        t.tolist()  # window closed again
    assert counter.step_total == [0, 0]
    assert counter.outside_total == 0
    assert not counter.sites


def test_count_outside_totals_the_calls_between_windows() -> None:
    t = torch.ones(2)
    with SyncCounter(package=__name__, count_outside=True) as counter:
        t.tolist()
        with counter.step():
            t.sum().item()
        bool(t.any())
    assert counter.step_total == [1]
    assert (counter.outside_total, counter.outside_caused) == (2, 2)


def test_windows_count_per_step() -> None:
    t = torch.ones(2)
    with SyncCounter() as counter:
        for reads in (2, 0, 1):
            counter.step_started()
            for _ in range(reads):
                t.sum().item()
            counter.step_ended()
    assert counter.step_total == [2, 0, 1]
    assert counter.total == 3


def test_a_read_inside_a_counted_read_counts_once() -> None:
    t = torch.ones(2, 2)
    calls: list[str] = []
    original = torch.Tensor.tolist
    with SyncCounter() as counter, counter.step():

        def nested_tolist(self):
            calls.append("outer")
            self.sum().item()  # a read inside this read
            return original(self)

        wrapped = counter._wrap("tolist", nested_tolist)
        assert wrapped(t) == [[1.0, 1.0], [1.0, 1.0]]
        repr(t)  # formatting reads every value through item(): one read
        str(t)
    assert calls == ["outer"]
    assert counter.step_total == [3]
    assert [key.split(" | ")[1] for key in counter.sites] == ["tolist", "__repr__", "__repr__"]


def test_attribution_by_package_prefix_anywhere_on_the_stack() -> None:
    t = torch.ones(2)
    call = _foreign_reader("otherpkg")
    for package, expected in [
        ("otherpkg", [1]),  # the direct caller
        (__name__, [1]),  # a frame further up the stack: still caused
        (__name__.rpartition(".")[0], [1]),  # a parent package prefix
        ("otherpk", [0]),  # a prefix of the name but not of a module path
        ("unrelated", [0]),
    ]:
        with SyncCounter(package=package) as counter, counter.step():
            call(lambda: t.sum().item())
        assert counter.step_total == [1], package
        assert counter.step_caused == expected, package


def test_the_counter_module_itself_never_causes_a_read() -> None:
    t = torch.ones(2)
    with SyncCounter(package="lightning_numguard") as counter, counter.step():
        t.sum().item()
    assert counter.step_total == [1]
    assert counter.step_caused == [0]
    [site] = counter.sites
    assert "| other | tests.test_syncs:" in site


def test_uninstall_restores_the_original_methods() -> None:
    own = {name: torch.Tensor.__dict__.get(name) for name in METHODS}
    seen = {name: getattr(torch.Tensor, name) for name in METHODS}
    counter = SyncCounter()
    with counter:
        assert counter.installed
        assert all(getattr(torch.Tensor, name) is not seen[name] for name in METHODS)
    assert not counter.installed
    assert {name: torch.Tensor.__dict__.get(name) for name in METHODS} == own
    assert all(getattr(torch.Tensor, name) is seen[name] for name in METHODS)
    counter.uninstall()  # a second uninstall changes nothing
    assert all(getattr(torch.Tensor, name) is seen[name] for name in METHODS)


def test_uninstall_on_an_exception_and_one_counter_at_a_time() -> None:
    seen = torch.Tensor.item
    first = SyncCounter()
    with pytest.raises(ZeroDivisionError), first:
        with pytest.raises(RuntimeError, match="already installed"):
            SyncCounter().install()
        1 / 0  # noqa: B018
    assert torch.Tensor.item is seen
    assert not first.installed


def test_copies_of_cpu_tensors_do_not_count() -> None:
    t = torch.ones(2)
    with SyncCounter() as counter, counter.step():
        t.cpu()
        t.to("cpu")
        t.to(torch.device("cpu"), torch.float64)
        t.to(torch.float16)
    assert counter.step_total == [0]


def test_copies_from_cpu_counts_them_for_a_cpu_stand_in() -> None:
    t = torch.ones(2)
    with SyncCounter(copies_from_cpu=True) as counter, counter.step():
        t.cpu()
        t.to("cpu")  # the working device of a CPU-only run: still no copy
        t.to(torch.float16)
    assert counter.step_total == [1]
    assert [key.split(" | ")[1] for key in counter.sites] == ["cpu"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_copies_from_a_gpu_count_and_are_on_device() -> None:
    t = torch.ones(2, device="cuda")
    with SyncCounter() as counter, counter.step():
        t.cpu()
        t.to("cpu")
        t.to("cuda")
        t.sum().item()
    assert counter.step_total == [3]
    assert counter.step_on_device == [3]


def test_wrapped_methods_return_what_the_originals_return() -> None:
    t = torch.tensor([1.5, 2.5])
    with SyncCounter():
        assert t.tolist() == [1.5, 2.5]
        assert isinstance(t.numpy(), np.ndarray)
        assert t[0].item() == 1.5
        assert t.to(torch.float64).dtype == torch.float64
        assert t.cpu() is t


@pytest.mark.parametrize("package", ["", ".x", "x."])
def test_package_must_be_a_module_name(package: str) -> None:
    with pytest.raises(ValueError, match="`package` must be a module name"):
        SyncCounter(package=package)


def test_imports_without_lightning() -> None:
    result = _run(
        "import sys\nimport instruments.syncs\n"
        "print('LEAKED', sorted(m for m in sys.modules if m.partition('.')[0] in "
        "('pytorch_lightning', 'lightning', 'lightning_fabric')))\n"
    )
    assert result.returncode == 0, result.stderr
    assert "LEAKED []" in result.stdout
