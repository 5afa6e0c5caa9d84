"""Neural-network building blocks: norms, rotary embeddings, attention backends, sampler."""
