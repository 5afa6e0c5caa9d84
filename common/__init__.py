"""What the router and both node kinds share: the node runtime, Redis cluster
state, wire conversion, gRPC/TLS/auth helpers, reliability bookkeeping, the KV
transfer and metrics.

It builds on ``engine`` and imports nothing from ``router``, ``prefill_node``,
``decode_node`` or ``pdserve`` (docs/architecture.md, "Layout").
"""
