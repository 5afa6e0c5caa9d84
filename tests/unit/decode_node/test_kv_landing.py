"""KVLanding's ids for Prefills sent before their reservation (``expect``, then
``open`` with that id, or ``close`` without it), with a real KVReceiver (its
TCPStore on localhost) on a CPU cache; no prefill node sends anything here."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from common.kv_transfer import TransferError
from decode_node.kv_landing import KVLanding
from decode_node.stats import DecodeStats
from engine.llm_engine import Reservation
from pdserve.redis_server import free_port

pytestmark = pytest.mark.timeout(60)

PEER = "prefill-0"


@pytest.fixture
def landing():
    # What KVLanding reads of a model runner: a [2, layers, blocks, block_size,
    # heads, head_dim] cache, its head layout, one rank, the device.
    runner = SimpleNamespace(
        kv_cache=torch.zeros(2, 2, 8, 4, 2, 4),
        layout=SimpleNamespace(kv_heads=range(0, 2), num_kv_heads=2),
        tp=SimpleNamespace(size=1),
        device=torch.device("cpu"),
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
