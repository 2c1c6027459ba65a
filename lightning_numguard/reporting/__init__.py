"""Everything the guard writes: messages, events.jsonl, TensorBoard and other loggers."""
