"""The block-hash spec (docs/architecture.md, version 2): router and nodes must agree bit for bit."""

from __future__ import annotations

import hashlib
import random
import re
import shutil
import struct
import sysconfig
from array import array

import pytest

from engine.block_hash import (
    BLOCK_HASH_VERSION,
    NATIVE_AVAILABLE,
    ROOT_HASH,
    BlockHasher,
    HasherCache,
    derive_key,
    hash_prompt_blocks,
    id_bounds,
    pack_tokens,
)


def spec_hashes(tokens: list[int], model_id: str, block_size: int, salt: str | None) -> list[bytes]:
    """An independent, literal reading of the spec (no shared code with the module)."""
    key = hashlib.blake2b(
        b"pdserve/block-hash/v1\0" + model_id.encode() + b"\0" + (salt or "").encode(),
        digest_size=32,
    ).digest()
    out, prev = [], bytes(16)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        data = prev + struct.pack(f"<{block_size}I", *block)
        prev = hashlib.blake2b(data, key=key, digest_size=16).digest()
        out.append(prev)
    return out


# The two implementations of the chain: the C extension and hashlib.
IMPLEMENTATIONS = [pytest.param(True, id="c"), pytest.param(False, id="hashlib")]


def test_the_c_chain_is_built_where_there_is_a_compiler():
    # Without it the router's hashing is about twice as slow
    # (docs/lab/2026-11-25-routing-decision-first-pass.md), silently: the install skips an extension it cannot compile.
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) here: hashlib computes the chain")
    assert NATIVE_AVAILABLE, "engine._block_hash is not built: rerun `make setup`"


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_pinned_digests_of_spec_version_1(native):
    # Changing any of these means router and nodes of different versions would
    # disagree: bump BLOCK_HASH_VERSION and the key domain together.
    assert BLOCK_HASH_VERSION == 2  # version 2 added extra keys; these digests stand
    hashes = BlockHasher("demo-model", 16, native=native).hash_blocks(list(range(32)))
    assert [h.hex() for h in hashes] == [
        "6de08888fb15dcdbfa6a769fd84687b9",
        "fbf0ddc097bbda69552e3601209017de",
    ]
    salted = BlockHasher("demo-model", 16, "tenant-a", native=native).hash_blocks(range(32))
    assert salted[0].hex() == "7d923532d8af32b4d5f409738f93c7f0"


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
@pytest.mark.parametrize("block_size", [1, 8, 16, 256])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_matches_literal_spec(block_size, salt, native):
    tokens = [(i * 7919) % 50000 for i in range(1000)]
    hasher = BlockHasher("m", block_size, salt, native=native)
    assert hasher.hash_blocks(tokens) == spec_hashes(tokens, "m", block_size, salt)


def test_c_and_hashlib_agree_on_every_shape():
    # Messages of one to several BLAKE2b blocks (block sizes up to 300 tokens),
    # ids over the whole uint32 range, any parent, long model ids and salts.
    rng = random.Random(0)
    for _ in range(300):
        block_size = rng.choice([1, 2, 7, 16, 27, 28, 29, 32, 33, 64, 100, 300])
        tokens = [rng.randrange(2**32) for _ in range(block_size * rng.randrange(0, 9) + 3)]
        model = "m" * rng.randrange(1, 200)
        salt = rng.choice([None, "", "t" * rng.randrange(1, 200)])
        parent = rng.choice([ROOT_HASH, rng.randbytes(16)])
        start = rng.randrange(0, 3)
        hashers = [BlockHasher(model, block_size, salt, native=n) for n in (True, False)]
        c, py = (h.hash_blocks(tokens, parent, start) for h in hashers)
        assert c == py


def test_only_full_blocks_are_hashed():
    hasher = BlockHasher("m", 16)
    assert len(hasher.hash_blocks(list(range(15)))) == 0
    assert len(hasher.hash_blocks(list(range(16)))) == 1
    assert len(hasher.hash_blocks(list(range(47)))) == 2


def test_chain_depends_on_the_whole_prefix():
    hasher = BlockHasher("m", 4)
    a = hasher.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8])
    b = hasher.hash_blocks([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1]  # same second block, different first block
    assert hasher.hash_blocks([5, 6, 7, 8]) != [a[1]]


def test_incremental_extension_equals_full_hash():
    hasher = BlockHasher("m", 8)
    tokens = list(range(100))
    full = hasher.hash_blocks(tokens)
    head = hasher.hash_blocks(tokens[:40])
    tail = hasher.hash_blocks(tokens, parent=head[-1], start_block=len(head))
    assert head + tail == full


def test_model_and_salt_separate_caches():
    tokens = list(range(32))
    base = hash_prompt_blocks(tokens, "model-a", 16)
    assert hash_prompt_blocks(tokens, "model-b", 16) != base
    assert hash_prompt_blocks(tokens, "model-a", 16, "t1") != base
    assert hash_prompt_blocks(tokens, "model-a", 16, "t1") != hash_prompt_blocks(
        tokens, "model-a", 16, "t2"
    )
    assert hash_prompt_blocks(tokens, "model-a", 16, "t1") == hash_prompt_blocks(
        tokens, "model-a", 16, "t1"
    )


def test_digests_are_16_bytes_and_root_is_zero():
    assert bytes(16) == ROOT_HASH
    assert all(len(h) == 16 for h in hash_prompt_blocks(list(range(64)), "m", 16))
    assert len(derive_key("m")) == 32


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["a"]])
def test_bad_token_ids_raise_value_error(bad):
    with pytest.raises(ValueError, match="token ids"):
        pack_tokens(bad)


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    ("bad", "shown"), [(-1, "-1"), (2**32, "4294967296"), (2**70, str(2**70)), (1.5, "1.5")]
)
def test_bad_token_ids_in_a_full_block_raise_the_same_value_error(native, bad, shown):
    # The C chain reads the ids itself; its message must be pack_tokens'.
    hasher = BlockHasher("m", 4, native=native)
    tokens = [1, 2, 3, 4, 5, bad, 7, 8, 9]
    with pytest.raises(ValueError, match=re.escape(f"in [0, 2**32); got {shown}")):
        hasher.hash_blocks(tokens)
    # Only full blocks are read: a bad id in the trailing partial block is ignored.
    assert hasher.hash_blocks(tokens[:4] + [bad]) == spec_hashes([1, 2, 3, 4], "m", 4, None)


class _Index:
    """An integer-like object that is not an int (numpy's integers are such)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_any_sequence_of_integers_hashes_like_a_list(native):
    # The router passes a list (or a protobuf repeated field), the engine a list
    # with a start block; bools and __index__ objects count as their values.
    hasher = BlockHasher("m", 4, native=native)
    ids = [(i * 7919) % 50000 for i in range(37)]
    expected = spec_hashes(ids, "m", 4, None)
    assert hasher.hash_blocks(tuple(ids)) == expected
    assert hasher.hash_blocks(array("I", ids)) == expected
    assert hasher.hash_blocks([_Index(i) for i in ids]) == expected
    assert hasher.hash_blocks([True, False] * 2) == spec_hashes([1, 0, 1, 0], "m", 4, None)
    assert hasher.hash_blocks(range(8)) == spec_hashes(list(range(8)), "m", 4, None)
    assert hasher.hash_blocks(ids, expected[2], 3) == expected[3:]
    assert hasher.hash_blocks(ids, expected[-1], 9) == []


def test_a_list_emptied_while_the_c_chain_reads_it_fails_cleanly():
    if not NATIVE_AVAILABLE:
        pytest.skip("engine._block_hash is not built")
    ids: list = list(range(8))

    class Clears:
        def __index__(self) -> int:
            ids.clear()
            return 0

    ids[1] = Clears()
    with pytest.raises(RuntimeError, match="changed while they were hashed"):
        BlockHasher("m", 4, native=True).hash_blocks(ids)


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_invalid_arguments(native):
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher("m", 0)
    with pytest.raises(ValueError, match="parent must be a 16-byte block hash"):
        BlockHasher("m", 4, native=native).hash_blocks(list(range(8)), parent=b"short")
    with pytest.raises(ValueError, match="model_id"):
        derive_key("")


def test_little_endian_layout():
    assert pack_tokens([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


class _Int(int):
    pass


@pytest.mark.parametrize(
    "ids",
    [
        [],
        [True, 2],
        [1, 2.0],
        [1, "2"],
        [1, _Int(3)],
        [1, 2**63],
        [-(2**63) - 1],
        "12",
        range(3),
        array("I", [1, 2]),
    ],
    ids=[
        "empty",
        "bool",
        "float",
        "str",
        "int-subclass",
        "over-long",
        "under-long",
        "str-seq",
        "range",
        "array",
    ],
)
def test_id_bounds_leave_anything_but_exact_ints_in_a_list_to_python(ids):
    assert id_bounds(ids) is None


def test_id_bounds_in_c_equal_min_and_max():
    if not NATIVE_AVAILABLE:
        pytest.skip("the C extension is not built here")
    rng = random.Random(7)
    edges = [0, 1, -1, 2**30 - 1, 2**30, -(2**30), 2**31, 2**62, 2**63 - 1, -(2**63)]
    cases = [edges, tuple(edges), [5], [2**63 - 1, -(2**63)]]
    cases += [
        [rng.randrange(-(2**40), 2**40) for _ in range(rng.randrange(1, 300))] for _ in range(50)
    ]
    cases += [[rng.randrange(128_256) for _ in range(2048)]]
    for ids in cases:
        assert id_bounds(ids) == (min(ids), max(ids)), ids


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_extra_keys_key_the_hash_and_leave_version_1_digests_alone(native):
    from engine.block_hash import canonical_extra_keys, derive_key, lora_extra_key

    tokens = list(range(32))
    base = BlockHasher("demo-model", 16, native=native).hash_blocks(tokens)
    assert base[0].hex() == "6de08888fb15dcdbfa6a769fd84687b9"  # as version 1
    lora_a = BlockHasher("demo-model", 16, native=native, extra_keys=[lora_extra_key("aa")])
    lora_b = BlockHasher("demo-model", 16, native=native, extra_keys=[lora_extra_key("bb")])
    a, b = lora_a.hash_blocks(tokens), lora_b.hash_blocks(tokens)
    assert len({base[0], a[0], b[0]}) == 3
    # The spec read literally: the keys sorted by name after the salt.
    extras = ["lora=aa", "kv_cache_dtype=fp8"]
    material = b"\0".join(
        [b"pdserve/block-hash/v1", b"demo-model", b"", b"kv_cache_dtype=fp8", b"lora=aa"]
    )
    assert (
        derive_key("demo-model", None, extras) == hashlib.blake2b(material, digest_size=32).digest()
    )
    assert canonical_extra_keys(extras) == ("kv_cache_dtype=fp8", "lora=aa")
    for bad in (["lora"], ["lora=a", "lora=b"], ["Lora=x"], ["lora=\0"]):
        with pytest.raises(ValueError, match="extra key"):
            canonical_extra_keys(bad)
    # The router's cache and the engine's give the same hasher per identity.
    cache = HasherCache("demo-model", 16)
    assert cache.get(None, ("lora=aa",)).hash_blocks(tokens) == a
    assert cache.get(None).hash_blocks(tokens) == base
