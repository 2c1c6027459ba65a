from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.doors.trainer.launches import Launch, launch


@pytest.fixture(scope="session")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Launch]:
    """``launched(world)``: the one launch of every multi-process Trainer fit of ``world`` ranks (``launches.py``)."""
    done: dict[int, Launch] = {}

    def get(world: int) -> Launch:
        if world not in done:
            done[world] = launch(tmp_path_factory.mktemp(f"launch{world}"), world)
        return done[world]

    return get
