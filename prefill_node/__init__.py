"""The prefill node: computes prompts and pushes their KV to decode nodes."""
