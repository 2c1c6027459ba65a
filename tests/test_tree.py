from collections import namedtuple
from dataclasses import dataclass

import torch

from lightning_numguard.tree import clone_tree, floating_leaves, tensor_leaves, tensors

Pair = namedtuple("Pair", ["image", "label"])


@dataclass
class Sample:
    pixels: torch.Tensor
    name: str


def test_paths_of_nested_containers():
    batch = {
        "x": torch.zeros(2),
        "pair": Pair(torch.ones(1), torch.tensor([1])),
        "list": [torch.zeros(1), "text", None, 3],
        "sample": Sample(torch.ones(2), "a"),
    }
    paths = [p for p, _ in tensor_leaves(batch)]
    assert paths == [
        "batch['x']",
        "batch['pair'].image",
        "batch['pair'].label",
        "batch['list'][0]",
        "batch['sample'].pixels",
    ]


def test_floating_leaves_skip_integers_strings_and_ids():
    batch = (torch.zeros(2), torch.arange(3), ["id-1", "id-2"], torch.tensor([True]))
    assert [p for p, _ in floating_leaves(batch)] == ["batch[0]"]


def test_a_flat_batch_of_tensors_takes_the_short_path_and_names_its_leaves_as_the_walk_does():
    flat = [torch.zeros(2), torch.arange(3), torch.zeros(1, dtype=torch.complex64), torch.ones(1, dtype=torch.float64)]
    for batch in (tuple(flat), flat):
        assert [p for p, _ in floating_leaves(batch)] == ["batch[0]", "batch[2]", "batch[3]"]
        assert [t for _, t in floating_leaves(batch)] == [flat[0], flat[2], flat[3]]
    nested = (torch.zeros(1), [torch.ones(1)])  # not flat: the walk
    assert [p for p, _ in floating_leaves(nested, "out")] == ["out[0]", "out[1][0]"]
    assert [p for p, _ in floating_leaves(Pair(torch.zeros(1), torch.ones(1)))] == ["batch.image", "batch.label"]
    assert floating_leaves(()) == []


def test_a_plain_tensor_and_non_containers():
    assert [p for p, _ in floating_leaves(torch.zeros(1))] == ["batch"]
    assert floating_leaves("just a string") == []
    assert floating_leaves(b"bytes") == []
    assert floating_leaves(None) == []


def test_self_referencing_structure_terminates():
    lst: list = [torch.zeros(1)]
    lst.append(lst)
    paths = [p for p, _ in tensor_leaves(lst)]
    assert paths[0] == "batch[0]"
    assert len(paths) <= 40


def test_clone_tree_into_an_earlier_copy_reuses_its_storage_bitwise_for_every_dtype():
    w = torch.nn.Parameter(torch.randn(3, 2))
    state = {
        "w": w,
        "step": torch.tensor(7.0),
        "mask": torch.tensor([True, False]),
        "idx": torch.arange(4),
        "half": torch.randn(5).half(),
        "nested": [torch.randn(2), {"lr": 0.1}],
    }
    first = clone_tree(state)
    ptrs = [t.data_ptr() for t in tensors(first)]
    with torch.no_grad():
        w.mul_(2)
        w[0, 0] = float("nan")
    state["mask"][1] = True
    state["idx"][0] = -5
    again = clone_tree(state, into=first)
    assert [t.data_ptr() for t in tensors(again)] == ptrs  # written in place, no new storage
    for a, b in zip(tensors(again), tensors(state)):
        assert a.dtype == b.dtype and torch.equal(
            a.reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)
        )
    assert not again["w"].requires_grad  # a copy, outside autograd
    assert again["nested"][1] == {"lr": 0.1} and again["nested"][1] is not state["nested"][1]
    # a shape that changed gets new storage
    state["nested"][0] = torch.randn(3)
    third = clone_tree(state, into=again)
    assert third["nested"][0].shape == (3,) and torch.equal(third["nested"][0], state["nested"][0])
