"""The decode node: reserves KV, has it filled by a prefill node, decodes and streams."""
