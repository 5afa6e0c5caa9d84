"""Tensor parallelism: which rank holds which shard (layout), the ranks' process
groups (group), rank 0's per-step hand-off to the others (handoff), and the
worker processes of ranks 1..t-1 (workers). ``layout`` is torch-free."""
