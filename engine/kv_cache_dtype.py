"""``kv_cache_dtype``: what the KV cache stores (vLLM's option and spellings).

Torch-free: the engine's config parses it, and the router reads a node's
registration (its KV dtype) without importing torch. ``auto`` stores the
model's dtype; ``fp8`` and ``fp8_e4m3`` (the same format, as in vLLM) store
float8 e4m3 with a per-layer scale each for K and V (docs/engine.md, "FP8 KV
cache").
"""

from __future__ import annotations

import enum

# The name a quantized cache goes by on the wire, in the registry and in block
# hashes: ``fp8`` and ``fp8_e4m3`` hold the same bits, so they must agree.
FP8_E4M3_NAME = "fp8_e4m3"


class KVCacheDType(enum.Enum):
    AUTO = "auto"  # the model's dtype
    FP8 = "fp8"  # vLLM's alias of fp8_e4m3
    FP8_E4M3 = "fp8_e4m3"

    @property
    def is_fp8(self) -> bool:
        return self is not KVCacheDType.AUTO


def storage_name(kv_dtype: KVCacheDType, model_dtype: str) -> str:
    """What a cache of ``kv_dtype`` holds, by one name per format: the model's
    dtype name (``bfloat16``...) for ``auto``, ``fp8_e4m3`` for FP8."""
    return FP8_E4M3_NAME if kv_dtype.is_fp8 else model_dtype


def pairing_refusal(prefill_kv: str, decode_kv: str) -> str:
    """Why a prefill node whose cache stores ``prefill_kv`` may not feed a decode
    node storing ``decode_kv`` (``storage_name``s; "": a node that does not
    say), or "" when it may.

    KV travels in the decode node's cache dtype. A prefill node holding the
    model's dtype may feed an FP8 decode node: it quantizes each chunk on the
    way with the checkpoint's scales (prefill_node/kv_stream.py), so the wire
    carries half the bytes. The reverse would hand a bf16 cache numbers FP8
    already rounded, and is refused; routers pair nodes by this rule."""
    if not prefill_kv or not decode_kv or prefill_kv == decode_kv:
        return ""
    if decode_kv == FP8_E4M3_NAME:
        return ""  # quantized on the way
    if prefill_kv == FP8_E4M3_NAME:
        return (
            f"its KV cache is {FP8_E4M3_NAME} and the decode node's {decode_kv}: FP8 KV "
            f"cannot feed a {decode_kv} cache (run the prefill node with --kv-cache-dtype "
            "auto, or the decode node with --kv-cache-dtype fp8)"
        )
    return f"its KV cache is {prefill_kv} and the decode node's {decode_kv}"
