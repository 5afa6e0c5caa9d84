"""common/runtime/ports.py's free_port: where it looks and what it never returns."""

from __future__ import annotations

import socket

import pytest

from common.runtime import ports


def test_picks_differ_and_stay_below_the_ephemeral_range():
    low = ports._ephemeral_low()
    if low - ports.LOWEST_PICKED_PORT < 1000:
        pytest.skip(f"this host's ephemeral range starts at {low}: port 0 decides")
    picked = [ports.free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)  # none handed out twice before a bind
    assert all(ports.LOWEST_PICKED_PORT <= p < low for p in picked)


def test_a_port_someone_listens_on_is_never_picked(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        draws = iter([taken, taken])
        real = ports.random.randrange
        monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(draws, None) or real(a, b))
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 60000)
        got = ports.free_port()
        assert got != taken
        with socket.socket() as s:  # and it is bindable
            s.bind(("127.0.0.1", got))


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports.LOWEST_PICKED_PORT + 10)
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_block_is_free_below_the_range_and_shares_no_port_with_other_picks():
    low = ports._ephemeral_low()
    if low - ports.LOWEST_PICKED_PORT < 1000:
        pytest.skip(f"this host's ephemeral range starts at {low}")
    singles = {ports.free_port() for _ in range(50)}
    base = ports.free_port_block(6)
    block = set(range(base, base + 6))
    assert block.isdisjoint(singles)
    assert base >= ports.LOWEST_PICKED_PORT and base + 6 <= low
    for port in block:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert ports.free_port() not in block
