from collections import namedtuple
from dataclasses import dataclass

import torch

from lightning_numguard.core.tree import floating_leaves, tensor_leaves

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
