"""KVLanding's reservations under the router's ids and what lands for them (the
receiver thread's calls made by hand), with a real KVReceiver (its TCPStore on
localhost) on a CPU cache; no prefill node sends anything here."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from common.kv_transfer import SegmentHeader, TransferError, TransferState
from common.kv_transfer.checksum import chain, checksum
from common.kv_transfer.protocol import FLAG_TOKEN, FirstToken
from decode_node.kv_landing import KVLanding
from decode_node.stats import DecodeStats
from engine.kv_blocks import kv_unit_bytes, scatter_blocks
from engine.llm_engine import Reservation
from pdserve.redis_server import free_port

pytestmark = pytest.mark.timeout(60)

PEER = "prefill-0"


def _landing(verify: bool, dtype: torch.dtype = torch.float32) -> KVLanding:
    # What KVLanding reads of a model runner: a [2, layers, blocks, block_size,
    # heads, head_dim] cache, its head layout, one rank, the device.
    kv = torch.zeros(2, 2, 8, 4, 2, 4, dtype=dtype)
    runner = SimpleNamespace(
        kv_cache=kv,
        layout=SimpleNamespace(kv_heads=range(0, 2), num_kv_heads=2),
        tp=SimpleNamespace(size=1),
        device=torch.device("cpu"),
        scatter_kv=lambda index, data, layers, heads: scatter_blocks(
            kv, index, data, layers, heads
        ),
        gather_kv=lambda index, layers, heads: kv[:, layers[0] : layers[1], index][
            :, :, :, :, heads[0] : heads[1]
        ].contiguous(),
    )
    return KVLanding("decode-0", runner, "127.0.0.1", free_port(), DecodeStats(), 5.0, verify)


@pytest.fixture
def landing():
    landing = _landing(False)
    yield landing
    landing.close_receiver()


@pytest.fixture
def verifying():
    landing = _landing(True)
    yield landing
    landing.close_receiver()


def _awaiting(landing: KVLanding, reservation_id: int):
    """The receiver's entry for the id: None while awaited, a linger deadline after."""
    return landing.receiver._peers[PEER, 0].awaiting.get(reservation_id, "gone")


def _reservation() -> Reservation:
    return Reservation("r", [3, 4, 5], 1, 12)


def test_a_reservation_is_awaited_under_the_routers_id_and_lingers_once_closed(landing):
    async def main():
        epoch = landing.open("r", _reservation(), PEER, 1, 7)
        assert epoch == landing.receiver.epoch_of(PEER)
        assert _awaiting(landing, 7) is None  # the receiver reads the peer's stream for it
        landing.close(7)
        assert isinstance(_awaiting(landing, 7), float)  # lingers until its end header
        assert landing._pending == {}

    asyncio.run(main())


@pytest.mark.parametrize("rid", [0, -1, 1 << 63])
def test_an_id_outside_int64_above_zero_is_refused(landing, rid):
    async def main():
        with pytest.raises(ValueError, match="an int64 above 0"):
            landing.open("r", _reservation(), PEER, 1, rid)

    asyncio.run(main())


def test_an_id_in_use_is_refused_and_leaves_the_first_alone(landing):
    async def main():
        landing.open("r", _reservation(), PEER, 1, 7)
        with pytest.raises(ValueError, match="in use"):
            landing.open("s", _reservation(), PEER, 1, 7)
        assert landing._pending[7].request_id == "r"
        landing.close(7)

    asyncio.run(main())


def _land(landing: KVLanding, rid: int, token: FirstToken | None, data=None) -> list:
    """What the receiver's thread does with a group of one segment that carries
    the prompt's first token: its header, its one chunk, then the token."""
    unit = kv_unit_bytes(landing._runner.kv_cache)
    header = SegmentHeader(rid, 1, 3, 0, 2, 2, 0, 2, unit, flags=FLAG_TOKEN, cached_tokens=4)
    [seg] = landing.on_group(PEER, [header])
    [desc] = header.chunks()
    data = torch.ones(desc.units * unit, dtype=torch.uint8) if data is None else data
    landing.on_chunk(PEER, seg, desc, data, None)
    if token is not None:
        landing.on_first_token(PEER, seg, token)
    return [data]


def test_the_first_token_comes_once_the_kv_landed(landing):
    async def main():
        landing.open("r", _reservation(), PEER, 1, 7)
        first = landing.first_token(7)
        logprobs = (-0.5, 1, [42], [-0.5])
        _land(landing, 7, FirstToken(42, 4, logprobs))
        await landing.wait(7, 1)  # the KV, then the token
        assert landing._runner.kv_cache[:, :, 4:6].view(torch.uint8).eq(1).all()
        assert await asyncio.wait_for(first, 1) == FirstToken(42, 4, logprobs)
        landing.close(7)

    asyncio.run(main())


def test_a_token_before_the_rest_of_the_kv_waits_for_it(landing):
    """From a prefill node of several ranks, another rank's chunks may land after
    rank 0's token: the token is given once all of this rank's KV landed."""

    async def main():
        landing.open("r", _reservation(), PEER, 1, 7)
        unit = kv_unit_bytes(landing._runner.kv_cache)
        first_heads = SegmentHeader(7, 1, 3, 0, 2, 2, 0, 1, unit, flags=FLAG_TOKEN)
        other_heads = SegmentHeader(7, 1, 3, 0, 2, 2, 1, 2, unit)
        segs = landing.on_group(PEER, [first_heads, other_heads])
        for seg, header in zip(segs, (first_heads, other_heads), strict=True):
            [desc] = header.chunks()
            chunk = torch.ones(desc.units * unit, dtype=torch.uint8)
            landing.on_chunk(PEER, seg, desc, chunk, None)
            if header is first_heads:
                landing.on_first_token(PEER, seg, FirstToken(42, 0))
                await asyncio.sleep(0.01)
                assert not landing.first_token(7).done()  # half the heads still to come
        assert (await asyncio.wait_for(landing.first_token(7), 1)).token_id == 42
        landing.close(7)

    asyncio.run(main())


def test_a_prefill_node_that_sampled_no_token_fails_the_transfer(landing):
    async def main():
        landing.open("r", _reservation(), PEER, 1, 7)
        _land(landing, 7, FirstToken(-1, 0))
        # The request path raises for a token that will not come (remote_prefill.py).
        assert await asyncio.wait_for(landing.first_token(7), 1) is None
        assert landing._pending[7].state is TransferState.FAILED
        landing.close(7)

    asyncio.run(main())


def test_a_first_token_that_a_broken_channel_will_not_bring_is_given_up_on(landing):
    async def main():
        landing.open("r", _reservation(), PEER, 1, 7)
        _land(landing, 7, None)
        await landing.wait(7, 1)  # every chunk landed; the channel breaks before the token
        landing.on_peer_failed(PEER, TransferError("reset by peer"), 0)
        assert await asyncio.wait_for(landing.first_token(7), 1) is None
        assert landing.stats.transfer_failures == 0  # the KV had all come: nothing failed
        landing.close(7)

    asyncio.run(main())


def test_verify_compares_what_landed_with_the_end_headers_checksum(verifying):
    async def main():
        for rid, good in ((7, True), (8, False)):
            verifying.open("r", _reservation(), PEER, 1, rid)
            # Two layers of two blocks of 4 tokens, 2 heads of 4: as the prefill node gathered it.
            chunk = torch.randn(2, 2, 2, 4, 2, 4)
            _land(verifying, rid, FirstToken(42, 4), chunk.view(-1).view(torch.uint8))
            digest = chain([checksum(chunk)]) if good else b"\x01" * 16
            verifying.on_group(PEER, [SegmentHeader.end(rid, (0, 2), digest)])
            if good:
                await verifying.check(rid, 1)
            else:
                with pytest.raises(TransferError, match="differs from what"):
                    await verifying.check(rid, 1)
            verifying.close(rid)
        assert verifying.stats.checksum_mismatches == 1

    asyncio.run(main())


def test_an_fp8_cache_is_named_to_prefill_nodes_and_lands_one_byte_an_element():
    """The blocks' KVChannel says what the cache holds; a chunk is that many
    bytes (one per element), landed as they came and counted as wire bytes."""
    landing = _landing(False, torch.float8_e4m3fn)
    try:
        assert landing.kv_cache_dtype == "fp8_e4m3"
        assert _landing_name(torch.float32) == ""  # the model's dtype: nothing to say

        async def main():
            landing.open("r", _reservation(), PEER, 1, 7)
            data = torch.arange(2 * 2 * 2 * 4 * 2 * 4, dtype=torch.uint8)  # fp8 bit patterns
            [sent] = _land(landing, 7, FirstToken(42, 4, None), data)
            await landing.wait(7, 1)
            got = landing._runner.kv_cache[:, :, 4:6].contiguous().view(torch.uint8)
            assert torch.equal(got.flatten(), sent)
            assert landing.stats.bytes_received == sent.numel() == 256
            landing.close(7)

        asyncio.run(main())
    finally:
        landing.close_receiver()


def _landing_name(dtype: torch.dtype) -> str:
    landing = _landing(False, dtype)
    try:
        return landing.kv_cache_dtype
    finally:
        landing.close_receiver()
