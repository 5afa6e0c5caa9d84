"""Multi-LoRA: many PEFT adapters over one base model, mixed in one batch.

- ``request``: ``LoRARequest`` (vLLM's name), what a request names its adapter by;
- ``config``: the engine's LoRA options (vLLM's names) and their checks;
- ``slots``: which adapter holds which device slot (the scheduler's, torch-free);
- ``adapter``: a PEFT adapter read from disk, checked against the model;
- ``layers``: the projections that add ``x @ A[slot].T @ B[slot].T`` per token;
- ``punica`` / ``punica_triton``: the batched shrink / expand (torch, Triton);
- ``manager``: the host cache of adapters and the copies into device slots.

This package's ``__init__`` imports nothing, so the torch-free parts stay so.
"""
