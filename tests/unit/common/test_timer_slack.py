"""The KV threads' polls and Linux's timer slack (common/kv_transfer/channel.py)."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest
import torch

from common.kv_transfer import channel, sender
from common.kv_transfer.channel import POLL_TIMER_SLACK_NS, tighten_timer_slack

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
_PR_GET_TIMERSLACK = 30


def slack_ns() -> int:
    """The calling thread's timer slack."""
    return ctypes.CDLL(None).prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)


def in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@linux_only
def test_the_slack_is_tightened_for_the_calling_thread_only():
    before, ok, after = in_thread(lambda: (slack_ns(), tighten_timer_slack(), slack_ns()))
    assert before > POLL_TIMER_SLACK_NS  # Linux's default, 50 us
    assert ok and after == POLL_TIMER_SLACK_NS
    # Thread-local: this thread and the next new one keep the default.
    assert slack_ns() == before
    assert in_thread(slack_ns) == before


def test_elsewhere_it_is_a_no_op(monkeypatch):
    monkeypatch.setattr(channel.sys, "platform", "darwin")
    assert tighten_timer_slack() is False


@linux_only
def test_a_kv_senders_thread_polls_with_the_tight_slack(monkeypatch):
    seen = []

    def tighten():
        ok = tighten_timer_slack()
        seen.append((threading.current_thread().name, ok, slack_ns()))
        return ok

    monkeypatch.setattr(sender, "tighten_timer_slack", tighten)
    kv = sender.KVSender("prefill-x", torch.device("cpu"), timeout_s=1)
    try:
        kv._link("decode-x", 0)  # starts the link's thread
    finally:
        kv.close()
    assert seen == [("kv-send-decode-x-0", True, POLL_TIMER_SLACK_NS)]


@linux_only
def test_a_kv_receivers_thread_polls_with_the_tight_slack(monkeypatch):
    from common.kv_transfer import receiver
    from pdserve.redis_server import free_port

    seen = []

    def tighten():
        ok = tighten_timer_slack()
        seen.append((threading.current_thread().name, ok, slack_ns()))
        return ok

    monkeypatch.setattr(receiver, "tighten_timer_slack", tighten)
    kv = receiver.KVReceiver(
        "decode-x", "127.0.0.1", free_port(), torch.device("cpu"), sink=None, timeout_s=1
    )
    try:
        kv.expect("prefill-y", 1)  # starts the peer's thread (no peer comes: it gives up)
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        kv.close()
    assert seen == [("kv-recv-prefill-y-0", True, POLL_TIMER_SLACK_NS)]
