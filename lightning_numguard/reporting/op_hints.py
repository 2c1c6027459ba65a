"""The advice for each op :class:`~lightning_numguard.core.opguard.OpGuard` guards, by op name.

``OP_DOMAIN_HINTS[op]`` is the fix to suggest when an ``op_domain`` incident names ``op``
(one of ``lightning_numguard.core.opguard.GUARDED_OPS``).
"""

from __future__ import annotations

__all__ = ["OP_DOMAIN_HINTS"]

_INDEX_HINT = (
    "an index is negative or not smaller than the size of the indexed dimension: check the `dim` "
    "argument and how the index was computed (these ops do not wrap negative indices)"
)
_CLASS_HINT = (
    "a target class index is negative or not smaller than the number of classes C = input.size(1): "
    "make the output layer as wide as the label range (labels starting at 1, an extra background "
    "class) and mark padding with ignore_index (default -100)"
)
_EMBEDDING_HINT = (
    "a token id is negative or not smaller than num_embeddings: make the vocabulary size match the "
    "tokenizer (added special tokens, the padding id) or clamp out-of-vocabulary ids to an UNK id"
)

OP_DOMAIN_HINTS: dict[str, str] = {
    "binary_cross_entropy": (
        "use BCEWithLogitsLoss (it applies the sigmoid itself and is safe under autocast); "
        "or the input is already NaN/Inf upstream"
    ),
    "nll_loss": _CLASS_HINT,
    "cross_entropy": _CLASS_HINT,
    "embedding": _EMBEDDING_HINT,
    "embedding_bag": _EMBEDDING_HINT,
    "gather": _INDEX_HINT,
    "scatter": _INDEX_HINT,
    "scatter_add": _INDEX_HINT,
    "index_select": _INDEX_HINT,
    "one_hot": (
        "a label is negative or not smaller than num_classes: pass a num_classes that covers the label "
        "range and map ignore/padding labels (-100, -1) to a valid class before one_hot"
    ),
    "multinomial": (
        "the probabilities hold NaN/Inf or negative values, or a row is all zeros: sample from "
        "softmax(logits) (never negative), look for NaN upstream, and never mask out a whole row"
    ),
}
"""Op name -> one sentence of advice for an input outside that op's domain."""
