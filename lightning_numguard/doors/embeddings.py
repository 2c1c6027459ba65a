"""The index check of ``nn.Embedding`` modules inside a ``torch.compile``d region, where the op guard cannot see.

The op guard (:mod:`~lightning_numguard.detect.opguard`) intercepts ``F.embedding`` in eager code; inside a compiled
graph the call is traced away and a token id past the vocabulary reaches the generated kernel, which dies
(``index out of bounds: 0 <= tmp2 < 128`` on the CPU, a device-side assert on a GPU). A forward pre-hook on each
``nn.Embedding``, registered before the first compiled call, is traced into the graph instead: it compares the ids
with ``[0, num_embeddings)`` on the device, replaces a bad id by ``padding_idx`` (else 0) as the op guard does, and
hands the comparison's flag and the ids out of the graph (attributes set in the hook: dynamo replays them after the
graph, no graph break, no recompile). After the forward pass they become the step's op records, read in its one
packed read; after a hit the op guard's own description names the module, the bad ids and the vocabulary size.

In eager code the hook does nothing (the op guard checks the same call there), nor in an evaluation pass (not
training, or gradients off), which keeps its own graph. torch and the standard library only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_numguard.detect.opguard import OpRecord

__all__ = ["EmbeddingChecks"]


class _Seen:
    """What one embedding's compiled calls of the forward pass in progress handed out (set inside the graph)."""

    def __init__(self) -> None:
        self.flag: torch.Tensor | None = None
        self.ids: torch.Tensor | None = None


class EmbeddingChecks:
    """The index check of every ``nn.Embedding`` under a module, for its compiled calls (see the module)."""

    def __init__(self, module: nn.Module) -> None:
        self.embeddings = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Embedding)]
        self._seen = {name: _Seen() for name, _ in self.embeddings}
        self._handles: list[Any] = []

    def attach(self) -> None:
        """Register the pre-hooks (before the first compiled call, so that they are traced in)."""
        self.detach()
        for name, emb in self.embeddings:
            self._handles.append(emb.register_forward_pre_hook(_hook(self._seen[name])))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def records(self) -> list[OpRecord]:
        """The op records of the compiled embedding calls since the last call (one per embedding that ran),
        in the op guard's form; the calls are forgotten (so the next graph entry finds what it was traced with)."""
        out = []
        for name, emb in self.embeddings:
            seen = self._seen[name]
            if seen.flag is None or seen.ids is None:
                continue
            rows = emb.num_embeddings
            out.append(OpRecord("embedding", name, seen.flag, seen.ids, f"index in [0, {rows})", 0.0, float(rows)))
            seen.flag = seen.ids = None
        return out


def _hook(seen: _Seen) -> Any:
    def check(module: nn.Embedding, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not (torch.compiler.is_compiling() and module.training and torch.is_grad_enabled()):
            return None  # eager: the op guard checks F.embedding itself; evaluation passes are left alone
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        ids = args[0]
        rows = module.num_embeddings
        bad = (ids < 0) | (ids >= rows)
        flag = bad.any()
        seen.flag = flag if seen.flag is None else seen.flag | flag  # an embedding called twice in one pass
        seen.ids = ids
        pad = module.padding_idx
        fill = pad if pad is not None and 0 <= pad < rows else 0
        return (ids.masked_fill(bad, fill), *args[1:])

    return check
