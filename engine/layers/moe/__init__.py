"""Mixture-of-experts layers: routing, the fused Triton experts and their torch reference."""
