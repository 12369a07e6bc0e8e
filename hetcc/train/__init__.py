"""Training a compiled pipeline: the per-rank API, the built-in loop, data, metrics and checkpoints, on top
of the runtime's execution (``hetcc.runtime``: transport, ops, executor, process groups)."""
