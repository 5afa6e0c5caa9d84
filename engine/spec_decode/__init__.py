"""Speculative decoding: proposals checked by one target forward per step.

Torch-free at import: the config, the n-gram proposer and the acceptance
bookkeeping are host work; the runner's side (engine/spec_decode/verify_rows.py)
imports torch itself.
"""

from engine.spec_decode.config import SpeculativeConfig, SpeculativeMethod

__all__ = ["SpeculativeConfig", "SpeculativeMethod"]
