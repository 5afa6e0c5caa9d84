"""A node's numerics as its registration spells them, and the block-hash keys
they give (docs/architecture.md, "Block hashes").

A node registers what it computes in (``weight_dtype``: its weight
quantization's name where it has one, else the model's dtype) and what its KV
cache stores (``kv_cache_dtype``: ``fp8_e4m3`` or the model's dtype). Both its
engine and every router turn those two values into the node's block-hash
extra keys through engine/block_hash.py ``numerics_extra_keys``, so a router
computes for each node the digests that node publishes. Torch-free: the
router reads it on every routing decision.
"""

from __future__ import annotations

from common.cluster.route_script import NUMERICS_TAG_SEPARATOR
from common.cluster.state import NodeInfo
from engine.block_hash import ExtraKeys, numerics_extra_keys
from engine.kv_cache_dtype import pairing_refusal
from engine.quantization.scheme import SUPPORTED_QUANTIZATION, Quantization


def registered_weight_dtype(quantization: Quantization | None, model_dtype: str) -> str:
    """NodeInfo.weight_dtype of an engine: its quantization method (pdctl shows
    ``fp8``), else the model's dtype name."""
    return quantization.value if quantization else model_dtype


def registered_quantization(weight_dtype: str) -> str | None:
    """The quantization a registered ``weight_dtype`` names (None: a model dtype,
    or a node that does not say)."""
    return weight_dtype if weight_dtype in SUPPORTED_QUANTIZATION else None


def node_numerics_keys(node: NodeInfo) -> ExtraKeys:
    """The numerics extra keys of every block ``node``'s engine hashes."""
    return numerics_extra_keys(registered_quantization(node.weight_dtype), node.kv_cache_dtype)


def numerics_tag(weight_dtype: str, kv_cache_dtype: str) -> str:
    """What the routing script matches a node by: its two registered fields,
    joined as the script joins them (common/cluster/route_script.py)."""
    return f"{weight_dtype}{NUMERICS_TAG_SEPARATOR}{kv_cache_dtype}"


def node_numerics_tag(node: NodeInfo) -> str:
    return numerics_tag(node.weight_dtype, node.kv_cache_dtype)


def node_pairing_refusal(prefill: NodeInfo, decode: NodeInfo) -> str:
    """Why ``prefill`` may not feed ``decode``, or "" when it may.

    The weights must match: the decode node keys the blocks it receives by
    its own numerics (its block hashes), so blocks a bf16 prefill node
    computed would pass for FP8-weight blocks on an FP8 decode node, and the
    reverse. The KV caches follow engine/kv_cache_dtype.py's rule (a model-dtype
    prefill node may feed an FP8 cache, quantizing on the way)."""
    weights, theirs = prefill.weight_dtype, decode.weight_dtype
    if weights and theirs and weights != theirs:
        return (
            f"its weights are {weights} and the decode node's {theirs}: a decode node "
            "takes KV only from a prefill node of the same weights (--quantization and "
            "--dtype alike)"
        )
    return pairing_refusal(prefill.kv_cache_dtype, decode.kv_cache_dtype)
