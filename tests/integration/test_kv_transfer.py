"""The KV stream over real gloo channels between real processes.

A sender process plays a prefill node's streamer from a script (groups of
segments, chunks in wire order, end headers); the receiver here collects what
lands. What travels is what the nodes send: segment headers and chunk bytes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from common.kv_transfer import (
    DeadlinePassed,
    Destination,
    KVReceiver,
    KVSender,
    OutgoingSegment,
    SegmentHeader,
    TransferError,
    TransferTicket,
    wire_order,
)
from common.kv_transfer.protocol import (
    FLAG_LOGPROBS,
    FLAG_TOKEN,
    HEADER_BLOCK,
    first_token_words,
    token_order,
)
from pdserve.redis_server import free_port

pytestmark = pytest.mark.timeout(300)

UNIT = 64  # bytes per block x layer x head in these scripts
CONNECT_S = 1.0  # the receiver's rendezvous bound here


def chunk_bytes(rid: int, desc) -> torch.Tensor:
    g = torch.Generator().manual_seed(rid * 1_000_003 + desc.layer_start * 1009 + desc.block_start)
    return torch.randint(0, 256, (desc.units * UNIT,), generator=g, dtype=torch.uint8)


def first_token_of(rid: int) -> int:
    return rid * 10 + 7


def segment(rid, b0, b1, layers=(0, 4), per_chunk=2, heads=(0, 2)) -> SegmentHeader:
    return SegmentHeader(rid, b0, b1, *layers, per_chunk, *heads, UNIT)


def sender_main(port, epochs, script, results, exit_after_chunks=None) -> None:
    """Run ``script``: ("group", [(header, cancelled), ...]) or ("end", rid)."""
    sender = KVSender("prefill-a", torch.device("cpu"), timeout_s=10)
    results.put("ready")  # torch is imported: the receiver's rendezvous clock may start
    epoch = epochs.get(timeout=60)
    dest = Destination("decode-a", "127.0.0.1", port, epoch)
    tickets: dict[int, TransferTicket] = {}
    # Each reservation's last chunk in the script settles its ticket.
    last_of: dict[int, tuple[int, int]] = {}
    for g, (kind, arg) in enumerate(script):
        if kind == "group":
            headers = [h for h, _ in arg]
            for n, (i, _) in enumerate(wire_order(headers)):
                last_of[headers[i].reservation_id] = (g, n)
    sent = 0
    for g, (kind, arg) in enumerate(script):
        if kind == "end":
            sender.end(dest, arg)
            continue
        segments = []
        for header, cancelled in arg:
            ticket = tickets.setdefault(
                header.reservation_id,
                TransferTicket(str(header.reservation_id), dest, time.monotonic() + 30, False),
            )
            if cancelled:
                ticket.cancel()
            segments.append(OutgoingSegment(header, ticket, final=True))
        group = sender.open_group(dest, segments)
        headers = [s.header for s in segments]
        order = wire_order(headers)
        for n, (i, desc) in enumerate(order):
            last = last_of[headers[i].reservation_id] == (g, n)
            data = chunk_bytes(headers[i].reservation_id, desc)
            sender.send_chunk(group, segments[i], desc, data, None, time.monotonic(), last)
            sent += 1
            if exit_after_chunks is not None and sent == exit_after_chunks:
                time.sleep(1.0)  # let it leave, then die mid-group
                os._exit(0)
        for i in token_order(headers):  # the first tokens it announced, after its chunks
            token = torch.tensor([first_token_of(headers[i].reservation_id)])
            k = headers[i].top_logprobs
            logprobs = None
            if headers[i].has_logprobs:
                best = torch.arange(k) + 1000
                logprobs = (torch.tensor(-0.5), torch.tensor(2), best, -best.double() / 1e4)
            words = first_token_words(token, logprobs)
            sender.send_chunk(group, segments[i], None, words, None, time.monotonic(), False)
    out = {}
    for rid, t in tickets.items():
        try:
            report = t.done.result(timeout=30)
            out[rid] = ("ok", report.num_bytes, report.wire_s > 0)
        except Exception as e:
            out[rid] = (type(e).__name__, 0, False)
    results.put(out)
    time.sleep(0.5)  # the end headers leave after the last chunk
    sender.close()


class Collector:
    def __init__(self):
        self.chunks: list[tuple[int, object, torch.Tensor]] = []
        self.headers: list[SegmentHeader] = []
        self.failed: list[str] = []
        self.tokens: list[tuple[int, int, int]] = []  # (reservation, token, chunks landed before)
        self.logprobs: list = []  # each token's
        self.event = threading.Event()

    def on_group(self, peer, headers):
        self.headers.extend(headers)
        return [h.reservation_id for h in headers]

    def on_chunk(self, peer, rid, desc, data, stream):
        self.chunks.append((rid, desc, data.clone()))
        self.event.set()

    def on_first_token(self, peer, rid, token):
        self.tokens.append((rid, token.token_id, len(self.chunks)))
        self.logprobs.append(token.logprobs)

    def on_peer_failed(self, peer, error, epoch):
        self.failed.append(peer)
        self.event.set()


@pytest.fixture
def receiver():
    col = Collector()
    port = free_port()
    rx = KVReceiver(
        "decode-a",
        "127.0.0.1",
        port,
        torch.device("cpu"),
        col,
        timeout_s=3,
        first_epoch=0,
        connect_timeout_s=CONNECT_S,
    )
    yield rx, col, port
    rx.close()


def start_sender(port: int, script, exit_after_chunks=None):
    ctx = mp.get_context("spawn")
    epochs, results = ctx.Queue(), ctx.Queue()
    args = (port, epochs, script, results, exit_after_chunks)
    proc = ctx.Process(target=sender_main, args=args)
    proc.start()
    assert results.get(timeout=120) == "ready"
    return proc, epochs, results


def wait_until(predicate, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_groups_land_bit_identical_in_wire_order_and_ends_close_the_streams(receiver):
    rx, col, port = receiver
    step1 = [(segment(100, 0, 2), False), (segment(101, 3, 4, per_chunk=3), False)]
    # A later step of 100, split by heads (how a tensor-parallel sender would send).
    step2 = [(segment(100, 2, 5, heads=(0, 1)), False), (segment(100, 2, 5, heads=(1, 2)), False)]
    script = [("group", step1), ("group", step2), ("end", 101), ("end", 100)]
    proc, epochs, results = start_sender(port, script)
    epoch = rx.expect("prefill-a", 100)
    rx.expect("prefill-a", 101)
    epochs.put(epoch)
    report = results.get(timeout=60)
    proc.join(30)
    expected = []
    for _, group in script[:2]:
        headers = [h for h, _ in group]
        expected += [(headers[i].reservation_id, desc) for i, desc in wire_order(headers)]
    wait_until(lambda: len(col.chunks) == len(expected))
    assert [(rid, desc) for rid, desc, _ in col.chunks] == expected  # the order of the rule
    for rid, desc, data in col.chunks:
        assert torch.equal(data, chunk_bytes(rid, desc))  # bit-identical
    units = {100: 4 * 2 * 2 + 4 * 3 * 2, 101: 4 * 1 * 2}
    assert report == {rid: ("ok", n * UNIT, True) for rid, n in units.items()}
    # Both streams ended: no receive is posted for them any more.
    wait_until(lambda: not rx._peers["prefill-a", 0].awaiting)
    assert [h.reservation_id for h in col.headers if h.is_end] == [101, 100]
    assert col.failed == []


def test_groups_past_a_header_block_filling_it_and_of_one_segment_land_in_order(receiver):
    """A group's headers travel as a block of HEADER_BLOCK rows and one more
    message for the rest (protocol.py): the group past the block, then one of
    exactly a block and one of a single segment, land in order on one channel."""
    rx, col, port = receiver
    big = [(segment(200 + i, i, i + 1, per_chunk=4), False) for i in range(HEADER_BLOCK + 3)]
    full = [(segment(300 + i, i, i + 1), False) for i in range(HEADER_BLOCK)]
    single = [(segment(400, 0, 2), False)]
    groups = [big, full, single]
    rids = [h.reservation_id for group in groups for h, _ in group]
    script = [("group", g) for g in groups] + [("end", rid) for rid in rids]
    proc, epochs, results = start_sender(port, script)
    epoch = rx.expect("prefill-a", rids[0])
    for rid in rids[1:]:
        rx.expect("prefill-a", rid)
    epochs.put(epoch)
    report = results.get(timeout=60)
    proc.join(30)
    expected = []
    for group in groups:
        headers = [h for h, _ in group]
        expected += [(headers[i].reservation_id, desc) for i, desc in wire_order(headers)]
    wait_until(lambda: len(col.chunks) == len(expected))
    assert [(rid, desc) for rid, desc, _ in col.chunks] == expected
    for rid, desc, data in col.chunks:
        assert torch.equal(data, chunk_bytes(rid, desc))
    assert all(r[0] == "ok" for r in report.values()) and sorted(report) == sorted(rids)
    wait_until(lambda: not rx._peers["prefill-a", 0].awaiting)
    assert [h.reservation_id for h in col.headers if not h.is_end] == rids
    assert col.failed == []


def test_a_group_whose_requests_are_all_gone_is_skipped_whole(receiver):
    rx, col, port = receiver
    script = [
        ("group", [(segment(7, 0, 3), True)]),  # cancelled before its headers left
        ("end", 7),
        ("group", [(segment(8, 0, 1), False)]),
        ("end", 8),
    ]
    proc, epochs, results = start_sender(port, script)
    epoch = rx.expect("prefill-a", 7)
    rx.expect("prefill-a", 8)
    epochs.put(epoch)
    report = results.get(timeout=60)
    proc.join(30)
    wait_until(lambda: not rx._peers["prefill-a", 0].awaiting)
    assert report[7][0] == "CancelledError" and report[8] == ("ok", 4 * 2 * UNIT, True)
    assert {rid for rid, _, _ in col.chunks} == {8}  # nothing of 7 was on the wire
    assert [h.reservation_id for h in col.headers] == [7, 8, 8]  # 7's end still came
    assert col.failed == []


def test_a_sender_dying_mid_group_fails_the_channel_then_the_next_epoch_works(receiver):
    rx, col, port = receiver
    script = [("group", [(segment(1, 0, 2, per_chunk=1), False)])]  # 4 chunks
    proc, epochs, _ = start_sender(port, script, exit_after_chunks=2)
    epochs.put(rx.expect("prefill-a", 1))
    wait_until(lambda: col.failed == ["prefill-a"], 30)
    proc.join(30)
    assert len(col.chunks) == 2  # what landed before the death was delivered
    assert not rx._peers["prefill-a", 0].awaiting  # the failure cleared the peer's expectations
    proc, epochs, results = start_sender(port, [("group", [(segment(2, 0, 1), False)])])
    epoch = rx.expect("prefill-a", 2)
    assert epoch == 1
    epochs.put(epoch)
    assert results.get(timeout=60) == {2: ("ok", 4 * 2 * UNIT, True)}
    proc.join(30)
    wait_until(lambda: any(rid == 2 for rid, _, _ in col.chunks))


def test_a_sender_that_comes_late_joins_and_none_fails_meanwhile(receiver):
    """The receiver joins a rendezvous only once its sender announced itself:
    a prefill node that starts sending long after the reservation (a busy one)
    is no failed channel, however short the connect timeout."""
    rx, col, port = receiver
    assert rx.expect("prefill-a", 100) == 0
    time.sleep(3 * CONNECT_S)  # nobody comes for a while
    assert col.failed == []
    script = [("group", [(segment(100, 0, 1), False)]), ("end", 100)]
    proc, epochs, results = start_sender(port, script)
    epochs.put(rx.epoch_of("prefill-a"))  # the same epoch: nothing failed
    assert results.get(timeout=60)[100][0] == "ok"
    proc.join(30)
    wait_until(lambda: len(col.chunks) == 2)
    wait_until(lambda: not rx._peers["prefill-a", 0].awaiting)
    assert col.failed == []


def test_a_channel_that_cannot_be_built_fails_within_the_connect_timeout():
    """Nobody joins the sender's rendezvous: its transfer fails within the
    connect timeout, not the (long) transfer timeout; a passed deadline fails
    before anything is sent."""
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    sender = KVSender("prefill-b", torch.device("cpu"), timeout_s=60, connect_timeout_s=1)
    dest = Destination("decode-x", "127.0.0.1", port, 0)
    late = TransferTicket("late", dest, time.monotonic() - 1, False)
    sender.open_group(dest, [OutgoingSegment(segment(1, 0, 1), late, True)])
    live = TransferTicket("live", dest, time.monotonic() + 30, False)
    start = time.monotonic()
    group = sender.open_group(dest, [OutgoingSegment(segment(2, 0, 1), live, True)])
    desc = segment(2, 0, 1).chunks()[0]
    sender.send_chunk(group, group.segments[0], desc, chunk_bytes(2, desc), None, 0.0, False)
    with pytest.raises(DeadlinePassed):
        late.done.result(timeout=30)
    with pytest.raises(TransferError, match="could not connect"):
        live.done.result(timeout=30)
    assert time.monotonic() - start < 10  # the transfer timeout is 60
    sender.close()
    del store


def test_a_sender_on_an_epoch_the_receiver_left_fails_at_once(receiver):
    """The receiver moved on (its prefill node's session broke): a transfer
    still naming the old epoch fails at once instead of waiting in a
    rendezvous nobody joins, and the next epoch works."""
    rx, col, port = receiver
    old = rx.expect("prefill-a", 300)
    rx.unexpect("prefill-a", 300)
    rx.reset("prefill-a")
    proc, epochs, results = start_sender(port, [("group", [(segment(301, 0, 1), False)])])
    epochs.put(old)
    start = time.monotonic()
    outcome = results.get(timeout=60)
    assert outcome[301][0] == "EpochLeft" and time.monotonic() - start < CONNECT_S + 4
    proc.join(30)
    script = [("group", [(segment(302, 0, 1), False)]), ("end", 302)]
    proc, epochs, results = start_sender(port, script)
    epochs.put(rx.expect("prefill-a", 302))
    assert results.get(timeout=60)[302][0] == "ok"
    proc.join(30)
    wait_until(lambda: not rx._peers["prefill-a", 0].awaiting)
    assert col.failed == []


def test_first_tokens_follow_their_groups_chunks_and_the_channel_stays_in_step(receiver):
    rx, col, port = receiver
    token = {"flags": FLAG_TOKEN, "cached_tokens": 32}
    with_logprobs = {"flags": FLAG_TOKEN | FLAG_LOGPROBS, "cached_tokens": 32, "top_logprobs": 3}
    group1 = [
        (SegmentHeader(20, 0, 2, 0, 4, 2, 0, 2, UNIT, **token), False),
        (segment(21, 0, 1), False),  # not its prompt's last segment: no token
        (SegmentHeader(22, 1, 3, 0, 4, 1, 0, 2, UNIT, **with_logprobs), False),
    ]
    group2 = [(segment(23, 0, 1), False)]
    script = [("group", group1), ("group", group2)] + [("end", r) for r in (20, 21, 22, 23)]
    proc, epochs, results = start_sender(port, script)
    epoch = rx.expect("prefill-a", 20)
    for rid in (21, 22, 23):
        rx.expect("prefill-a", rid)
    epochs.put(epoch)
    report = results.get(timeout=60)
    proc.join(30)
    wait_until(lambda: not rx._peers["prefill-a", 0].awaiting)
    chunks_1 = len(wire_order([h for h, _ in group1]))
    # In header order, each after every chunk of its group, and none for 21.
    assert col.tokens == [(20, first_token_of(20), chunks_1), (22, first_token_of(22), chunks_1)]
    assert [h.cached_tokens for h in col.headers if h.has_token] == [32, 32]
    assert col.logprobs == [None, (-0.5, 2, [1000, 1001, 1002], [-0.1, -0.1001, -0.1002])]
    # The next group landed in step, bit-identical.
    assert [rid for rid, _, _ in col.chunks][chunks_1:] == [23, 23]
    for rid, desc, data in col.chunks:
        assert torch.equal(data, chunk_bytes(rid, desc))
    assert all(r[0] == "ok" for r in report.values()) and col.failed == []


def test_a_restarted_receivers_epochs_are_newer_than_the_old_ones():
    """A prefill node takes a lower epoch than the newest it saw from a decode
    node for stale; a restarted decode node (a new receiver) must therefore
    name higher ones."""
    epochs = []
    for _ in range(2):
        rx = KVReceiver("decode-a", "127.0.0.1", free_port(), torch.device("cpu"), Collector())
        try:
            epochs.append(rx.epoch_of("prefill-a"))
            assert rx.epoch_of("prefill-a") == epochs[-1]  # one per peer, until it fails
        finally:
            rx.close()
    assert epochs[1] > epochs[0]
