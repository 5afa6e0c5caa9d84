"""KVLanding's ids for Prefills sent before their reservation (``expect``, then
``open`` with that id, or ``close`` without it), with a real KVReceiver (its
TCPStore on localhost) on a CPU cache; no prefill node sends anything here."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from common.kv_transfer import SegmentHeader, TransferError
from common.kv_transfer.protocol import FLAG_TOKEN
from decode_node.kv_landing import KVLanding
from decode_node.stats import DecodeStats
from engine.kv_blocks import kv_unit_bytes, scatter_blocks
from engine.llm_engine import Reservation
from pdserve.redis_server import free_port
from proto import internal_pb2

pytestmark = pytest.mark.timeout(60)

PEER = "prefill-0"


@pytest.fixture
def landing():
    # What KVLanding reads of a model runner: a [2, layers, blocks, block_size,
    # heads, head_dim] cache, its head layout, one rank, the device.
    kv = torch.zeros(2, 2, 8, 4, 2, 4)
    runner = SimpleNamespace(
        kv_cache=kv,
        layout=SimpleNamespace(kv_heads=range(0, 2), num_kv_heads=2),
        tp=SimpleNamespace(size=1),
        device=torch.device("cpu"),
        scatter_kv=lambda index, data, layers, heads: scatter_blocks(
            kv, index, data, layers, heads
        ),
    )
    landing = KVLanding("decode-0", runner, "127.0.0.1", free_port(), DecodeStats(), 5.0, False)
    yield landing
    landing.close_receiver()


def _awaiting(landing: KVLanding, reservation_id: int):
    """The receiver's entry for the id: None while awaited, a linger deadline after."""
    return landing.receiver._peers[PEER, 0].awaiting.get(reservation_id, "gone")


def _reservation() -> Reservation:
    return Reservation("r", [3, 4, 5], 1, 12)


def test_an_id_given_before_the_reservation_is_awaited_then_opened_under_the_same_id(landing):
    async def main():
        rid, epoch = landing.expect(PEER)
        assert _awaiting(landing, rid) is None  # the receiver reads the peer's stream for it
        assert landing.open("r", _reservation(), PEER, 1, rid) == (rid, epoch)
        assert landing._expected == {} and rid in landing._pending
        landing.close(rid)
        assert isinstance(_awaiting(landing, rid), float)  # lingers until its end header

    asyncio.run(main())


def test_an_id_never_opened_lingers_for_its_end_header_and_expires_nothing(landing):
    async def main():
        rid, _ = landing.expect(PEER)
        # Its Prefill failed before the reservation: no token to wait for, the
        # request path raises the reply's error (not a KeyError).
        assert landing.first_token(rid) is None
        landing.expire(rid)  # a Prefill that timed out before the reservation
        assert landing.stats.leases_expired == 0
        landing.close(rid)  # the decode node had no room: the Prefill was cancelled
        assert landing._expected == {} and landing._pending == {}
        assert isinstance(_awaiting(landing, rid), float)

    asyncio.run(main())


def test_a_channel_that_failed_before_the_reservation_refuses_the_id(landing):
    async def main():
        rid, epoch = landing.expect(PEER)
        landing.reset_peer(PEER)  # another request's Prefill broke: a new epoch
        assert landing.receiver.epoch_of(PEER) == epoch + 1
        with pytest.raises(TransferError, match="failed since the Prefill went"):
            landing.open("r", _reservation(), PEER, 1, rid)
        assert landing._expected == {} and landing._pending == {}
        landing.close(rid)  # the request path's finally: nothing left to do

    asyncio.run(main())


def test_an_epochs_header_framing_is_what_its_peer_said_at_its_first_reservation(landing):
    """A Prefill's destination names the headers' framing of its channel epoch:
    a block where the peer's session said it frames them so when the epoch's
    first reservation was expected, a message each otherwise, till a new epoch."""

    async def main():
        def destination(epoch: int) -> internal_pb2.KVDestination:
            d = internal_pb2.KVDestination()
            landing.name_channel(d, PEER, epoch)
            assert d.channel_epoch == epoch
            return d

        # Nothing known of the peer (no session, a --prefill-streams call node).
        rid, epoch = landing.expect(PEER)
        assert destination(epoch).header_block is False
        landing.frames_blocks(PEER, True)  # its session opened meanwhile
        rid2, _ = landing.expect(PEER)
        assert destination(epoch).header_block is False  # fixed for this epoch
        landing.reset_peer(PEER)  # the session broke: a new epoch
        rid3, epoch3 = landing.open("r", _reservation(), PEER, 1)
        assert epoch3 == epoch + 1 and destination(epoch3).header_block is True
        landing.frames_blocks(PEER, False)  # a node of an older release took its place
        assert destination(epoch3).header_block is True  # still this epoch's
        for r in (rid, rid2, rid3):
            landing.close(r)

    asyncio.run(main())


def _land_with_token(landing: KVLanding, rid: int, token_id: int) -> None:
    """What the receiver's thread does with a group of one segment that carries
    the prompt's first token: its header, its one chunk, then the token."""
    unit = kv_unit_bytes(landing._runner.kv_cache)
    header = SegmentHeader(rid, 1, 3, 0, 2, 2, 0, 2, unit, flags=FLAG_TOKEN, cached_tokens=4)
    [seg] = landing.on_group(PEER, [header])
    [desc] = header.chunks()
    landing.on_chunk(PEER, seg, desc, torch.ones(desc.units * unit, dtype=torch.uint8), None)
    landing.on_first_token(PEER, seg, token_id)


def test_a_first_token_behind_the_kv_comes_with_its_cache_hit_and_verify_checks_it(landing):
    async def main():
        rid, _ = landing.open("r", _reservation(), PEER, first_token=True)
        first = landing.first_token(rid)
        _land_with_token(landing, rid, 42)
        await landing.wait(rid, 1)  # the KV, then the token
        assert landing._runner.kv_cache[:, :, 4:6].view(torch.uint8).eq(1).all()
        assert await asyncio.wait_for(first, 1) == (42, 4)
        assert landing.stats.kv_first_tokens == 1
        await landing.check_token(rid, 42, 4, 1)  # --verify-kv: the reply's, so fine
        with pytest.raises(TransferError, match=r"\(42, 4\) are not the reply's \(41, 4\)"):
            await landing.check_token(rid, 41, 4, 1)
        assert landing.stats.checksum_mismatches == 1
        landing.close(rid)
        # A prefill node that had no token to send (-1): the reply's is taken.
        rid, _ = landing.open("r", _reservation(), PEER, first_token=True)
        _land_with_token(landing, rid, -1)
        assert await asyncio.wait_for(landing.first_token(rid), 1) is None
        await landing.check_token(rid, 41, 4, 1)  # nothing to check
        assert landing.stats.kv_first_tokens == 1
        landing.close(rid)
        # Not asked for: no future, nothing taken (an older decode node never sees the flag).
        rid, _ = landing.open("r", _reservation(), PEER)
        assert landing.first_token(rid) is None
        landing.close(rid)

    asyncio.run(main())


def test_a_first_token_that_a_broken_channel_will_not_bring_is_given_up_on(landing):
    async def main():
        rid, _ = landing.open("r", _reservation(), PEER, first_token=True)
        unit = kv_unit_bytes(landing._runner.kv_cache)
        header = SegmentHeader(rid, 1, 3, 0, 2, 2, 0, 2, unit, flags=FLAG_TOKEN)
        [seg] = landing.on_group(PEER, [header])
        [desc] = header.chunks()
        landing.on_chunk(PEER, seg, desc, torch.ones(desc.units * unit, dtype=torch.uint8), None)
        await landing.wait(rid, 1)  # every chunk landed; the channel breaks before the token
        landing.on_peer_failed(PEER, TransferError("reset by peer"), 0)
        assert await asyncio.wait_for(landing.first_token(rid), 1) is None
        await landing.check_token(rid, 41, 0, 1)  # --verify-kv does not wait for it
        assert landing.stats.transfer_failures == 0  # the KV had all come: nothing failed
        landing.close(rid)

    asyncio.run(main())
