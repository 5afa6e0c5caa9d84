"""Chained block hashes: the one implementation the router and the nodes share.

Spec, version 2 (docs/architecture.md, "Block hashes"). Router and nodes must agree bit for bit,
so anything that changes a digest bumps ``BLOCK_HASH_VERSION``.

- A block is ``block_size`` consecutive token ids; only full blocks are hashed.
- ``h_0`` is 16 zero bytes; ``h_i = BLAKE2b-128(key, h_{i-1} || tokens_i)`` where
  ``tokens_i`` is the block's ids as little-endian uint32.
- ``key = BLAKE2b-256("pdserve/block-hash/v1" 0x00 model_id 0x00 cache_salt
  [0x00 extra_key]...)``: keyed by the model identity and the request's
  optional ``cache_salt``, so two tenants with different salts never share a
  hash (and so never a cache hit, which would leak timing). The key is derived
  because BLAKE2b keys are limited to 64 bytes and model ids are not.
- ``extra_key``s (version 2) name whatever else changes the numbers a block's
  KV holds, each ``name=value``, sorted by name, each name at most once: the
  request's LoRA adapter (``lora=<adapter digest>``, ``lora_extra_key``);
  the engine's weight quantization (``quantization=fp8``,
  ``quantization_extra_key``); an FP8 KV cache (``kv_cache_dtype=fp8_e4m3``,
  ``kv_cache_dtype_extra_key``). A request with none hashes exactly as
  version 1 did, so base-model blocks of an unquantized engine keep their
  digests.
- An engine's numerics keys come from ``numerics_extra_keys(quantization,
  kv_cache_dtype)`` alone: the engine applies it to its config, the router to
  each node's registration (``weight_dtype``, ``kv_cache_dtype``:
  common/cluster/numerics.py). Every node publishes the hashes its own
  engine computes, and the router looks each node's hit up in the hashes of
  that node's numerics, whatever its role: in a bf16 prefill node feeding an
  FP8 decode node, the prefill node's hit is counted in plain hashes and the
  decode node's in its FP8 ones (it keys the blocks that land in its cache
  with its own numerics).

Hashes are hints: whoever finds a hash in its cache still verifies the block's
tokens before reusing it. Nothing here uses Python's ``hash()``, which is salted
per process.

The chain runs in C (``engine/_block_hash.c``, built with the package) where it
was built: the spec makes it sequential, and in Python each block costs four
method calls around one BLAKE2b compression, a large share of a routing
decision for a long prompt (docs/lab/2026-11-21-routing-workload-and-decision.md).
The C call reads the token ids straight from the caller's list, validating
them as ``pack_tokens`` does: packing the ids with ``array('I')`` first cost
a third as much as the hashing itself
(docs/lab/2026-11-25-routing-decision-second-pass.md). Without the extension
(no C compiler at install, or one built from an older source) hashlib computes
the same digests; the tests check that both agree with a literal reading of
the spec.
"""

from __future__ import annotations

import hashlib
import re
import sys
from array import array
from collections.abc import Sequence

from engine.kv_cache_dtype import FP8_E4M3_NAME

try:
    import engine._block_hash as _native
except ImportError:  # installed without a C compiler: hashlib gives the same digests
    _native = None
if not hasattr(_native, "chain_ids"):  # an extension built from an older source
    _native = None
_id_bounds = getattr(_native, "id_bounds", None)
# Whether ``id_bounds`` runs in C (the benchmarks record it).
ID_BOUNDS_NATIVE = _id_bounds is not None

BLOCK_HASH_VERSION = 2
DIGEST_SIZE = 16
ROOT_HASH = bytes(DIGEST_SIZE)
MAX_TOKEN_ID = 2**32 - 1
# Whether the C chain is built (the benchmarks record it).
NATIVE_AVAILABLE = _native is not None
_KEY_DOMAIN = b"pdserve/block-hash/v1"


def id_bounds(ids: Sequence[int]) -> tuple[int, int] | None:
    """(min, max) of a non-empty list or tuple of exact ints, in one pass in C
    (the extension builds it beside the chain: engine/_block_hash.c); None for
    anything else, or without the extension: the caller then checks the ids
    in Python (engine/input_processor.py), which walks the list several times
    (docs/lab/2026-11-27-prefill-node-step-vs-local.md)."""
    return _id_bounds(ids) if _id_bounds is not None else None


_EXTRA_KEY = re.compile(r"([a-z][a-z0-9_]*)=([^\x00]+)")
# The extra key of a LoRA adapter (engine/lora/adapter.py: its digest).
LORA_KEY_NAME = "lora"
ExtraKeys = tuple[str, ...]


def lora_extra_key(adapter_digest: str) -> str:
    """The extra key of a request under an adapter: its content digest, not its
    name or ``lora_int_id`` (docs/engine.md, "LoRA adapters")."""
    return f"{LORA_KEY_NAME}={adapter_digest}"


# The extra key of an engine whose weights are quantized (engine/quantization/).
QUANTIZATION_KEY_NAME = "quantization"


def quantization_extra_key(method: str) -> str:
    """The extra key of every block an engine quantized by ``method`` (vLLM's
    ``quantization`` value, e.g. ``fp8``) computes: its KV differs from the
    unquantized model's."""
    return f"{QUANTIZATION_KEY_NAME}={method}"


# The extra key of a KV cache whose numbers differ from the model dtype's
# (``kv_cache_dtype=fp8_e4m3``); a cache in the model's dtype adds none, so
# its blocks keep their digests.
KV_CACHE_DTYPE_KEY_NAME = "kv_cache_dtype"


def kv_cache_dtype_extra_key(stored: str) -> str:
    """The extra key of every block a cache storing ``stored`` (``fp8_e4m3``)
    holds; a cache in the model's dtype adds none, so its blocks keep their
    digests."""
    return f"{KV_CACHE_DTYPE_KEY_NAME}={stored}"


def numerics_extra_keys(quantization: str | None, kv_cache_dtype: str) -> ExtraKeys:
    """The extra keys an engine's numerics add to every block it computes: its
    weight quantization (vLLM's ``quantization`` value; None or "" for none)
    and what its KV cache stores (``engine/kv_cache_dtype.py``'s
    ``storage_name``: ``fp8_e4m3`` adds a key, the model's dtype none). The one
    mapping: the engine keys its own blocks with it, and the router derives
    each node's keys from the same two values in its registration
    (common/cluster/numerics.py), so both compute the same digests."""
    keys = [quantization_extra_key(quantization)] if quantization else []
    if kv_cache_dtype == FP8_E4M3_NAME:
        keys.append(kv_cache_dtype_extra_key(kv_cache_dtype))
    return canonical_extra_keys(keys)


def canonical_extra_keys(extra_keys: Sequence[str] = ()) -> ExtraKeys:
    """``extra_keys`` checked and sorted by name (the order the spec fixes)."""
    names = {}
    for key in extra_keys:
        match = _EXTRA_KEY.fullmatch(key) if isinstance(key, str) else None
        if match is None:
            raise ValueError(f"a block-hash extra key must be 'name=value'; got {key!r}")
        if match[1] in names:
            raise ValueError(f"block-hash extra key {match[1]!r} given twice")
        names[match[1]] = key
    return tuple(names[n] for n in sorted(names))


def derive_key(
    model_id: str, cache_salt: str | None = None, extra_keys: Sequence[str] = ()
) -> bytes:
    """The 32-byte BLAKE2b key for one model, one (optional) tenant salt and
    the block identity's extra keys."""
    if not model_id:
        raise ValueError("model_id must be a non-empty string")
    parts = [_KEY_DOMAIN, model_id.encode(), (cache_salt or "").encode()]
    parts += [k.encode() for k in canonical_extra_keys(extra_keys)]
    return hashlib.blake2b(b"\0".join(parts), digest_size=32).digest()


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; a clear error for ids out of range."""
    try:
        packed = array("I", token_ids)
    except (OverflowError, TypeError) as e:
        bad = next(
            (t for t in token_ids if not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID),
            None,
        )
        raise ValueError(f"token ids must be integers in [0, 2**32); got {bad!r}") from e
    if packed.itemsize != 4:  # pragma: no cover - no mainstream platform has this
        raise RuntimeError("array('I') is not 4 bytes wide on this platform")
    if sys.byteorder == "big":  # pragma: no cover - x86 and ARM are little-endian
        packed.byteswap()
    return packed.tobytes()


class BlockHasher:
    """Computes the chained hashes of full blocks for one (model, salt, extra
    keys, block size)."""

    __slots__ = ("_base", "_key", "_native", "block_size")

    def __init__(
        self,
        model_id: str,
        block_size: int,
        cache_salt: str | None = None,
        native: bool | None = None,
        extra_keys: Sequence[str] = (),
    ) -> None:
        """``native``: None uses the C chain where it is built; False always hashlib
        (tests and benchmarks compare the two); True insists on the C chain."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if native and _native is None:
            raise RuntimeError(
                "engine._block_hash is not built (no C compiler at install?): "
                "reinstall the package where one is available, or pass native=None"
            )
        self.block_size = block_size
        self._key = derive_key(model_id, cache_salt, extra_keys)
        self._native = _native if native is not False else None
        # A keyed BLAKE2b object is set up once; copying it per block is much
        # cheaper than re-deriving the keyed state for every block.
        self._base = hashlib.blake2b(key=self._key, digest_size=DIGEST_SIZE)

    def hash_blocks(
        self, token_ids: Sequence[int], parent: bytes = ROOT_HASH, start_block: int = 0
    ) -> list[bytes]:
        """Hashes of the full blocks of ``token_ids`` from block ``start_block`` on.

        ``parent`` is the hash of block ``start_block - 1`` (``ROOT_HASH`` for
        block 0), so a caller can extend a chain as a sequence grows without
        rehashing its prefix. A trailing partial block is ignored.
        """
        bs = self.block_size
        num_full = len(token_ids) // bs
        if start_block >= num_full:
            return []
        if len(parent) != DIGEST_SIZE:
            raise ValueError(f"parent must be a {DIGEST_SIZE}-byte block hash, got {len(parent)}")
        if self._native is not None:
            return self._native.chain_ids(self._key, parent, token_ids, bs, start_block)
        data = pack_tokens(token_ids[start_block * bs : num_full * bs])
        step = bs * 4
        hashes: list[bytes] = []
        prev = parent
        base = self._base
        for off in range(0, len(data), step):
            h = base.copy()
            h.update(prev)
            h.update(data[off : off + step])
            prev = h.digest()
            hashes.append(prev)
        return hashes


def hash_prompt_blocks(
    token_ids: Sequence[int],
    model_id: str,
    block_size: int,
    cache_salt: str | None = None,
    extra_keys: Sequence[str] = (),
) -> list[bytes]:
    """Convenience: all full-block hashes of a prompt (what the router looks up)."""
    hasher = BlockHasher(model_id, block_size, cache_salt, extra_keys=extra_keys)
    return hasher.hash_blocks(token_ids)


MAX_CACHED_HASHERS = 256


class HasherCache:
    """The block hasher of each (tenant salt, extra keys), the most recently
    used ones only (salts are per tenant, so unbounded); the router and the
    engine both keep one."""

    def __init__(self, model_id: str, block_size: int, capacity: int = MAX_CACHED_HASHERS):
        self.model_id = model_id
        self.block_size = block_size
        self.capacity = capacity
        self._hashers: dict[tuple[str | None, ExtraKeys], BlockHasher] = {}

    def get(self, cache_salt: str | None, extra_keys: ExtraKeys = ()) -> BlockHasher:
        key = (cache_salt or None, extra_keys)
        hasher = self._hashers.pop(key, None)
        if hasher is None:
            hasher = BlockHasher(self.model_id, self.block_size, key[0], extra_keys=extra_keys)
        self._hashers[key] = hasher
        if len(self._hashers) > self.capacity:
            del self._hashers[next(iter(self._hashers))]
        return hasher

    def __len__(self) -> int:
        return len(self._hashers)
