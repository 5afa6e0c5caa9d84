"""common/runtime/event_loop.py: which loop a server process gets, and the fallback without uvloop."""

from __future__ import annotations

import argparse
import asyncio
import sys

import pytest

from common.runtime.event_loop import (
    ASYNCIO,
    AUTO,
    UVLOOP,
    add_event_loop_argument,
    loop_factory,
    run,
)


def test_asyncio_choice_is_the_standard_loop():
    factory, name = loop_factory(ASYNCIO)
    assert factory is None and name == ASYNCIO

    async def loop_type():
        return type(asyncio.get_running_loop()).__module__

    assert run(loop_type, ASYNCIO).startswith("asyncio")


def test_auto_without_uvloop_falls_back_and_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import fails as if not installed
    factory, name = loop_factory(AUTO)
    assert factory is None and "not installed" in name
    with pytest.raises(ValueError, match="uvloop is not installed"):
        loop_factory(UVLOOP)


def test_uvloop_when_installed():
    uvloop = pytest.importorskip("uvloop")
    factory, name = loop_factory(AUTO)
    assert factory is uvloop.new_event_loop and name.startswith(UVLOOP)

    async def loop_type():
        return type(asyncio.get_running_loop()).__module__

    assert run(loop_type, UVLOOP).startswith("uvloop")


def test_flag_and_environment(monkeypatch):
    with pytest.raises(ValueError, match="must be one of"):
        loop_factory("trio")
    monkeypatch.setenv("PDSERVE_EVENT_LOOP", ASYNCIO)
    p = argparse.ArgumentParser()
    add_event_loop_argument(p)
    assert p.parse_args([]).event_loop == ASYNCIO
    assert p.parse_args(["--event-loop", UVLOOP]).event_loop == UVLOOP
