"""A disaggregated request's Prefill sent by a synchronous client, as the router
sends it with ``--prefill-dispatch router`` (benchmarks/disagg_ttft.py's direct
path): the router's own PrefillDispatcher on an event loop of its own thread."""

from __future__ import annotations

import asyncio
import threading

import grpc

from router.dispatch import PrefillDispatcher


class ClientDispatch:
    """The router's PrefillDispatcher (router/dispatch.py) driven from this
    synchronous client: its session with the prefill node on an event loop of
    its own thread."""

    def __init__(self, prefill) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.prefill = prefill
        self.dispatcher = self._call(self._start())

    async def _start(self):
        channels: dict = {}
        dispatcher = PrefillDispatcher(
            lambda address: channels.setdefault(address, grpc.aio.insecure_channel(address))
        )
        await dispatcher.session(self.prefill).open()
        return dispatcher

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def send(self, request, decode_id: str):
        """Send ``request``'s Prefill (its reservation id set in it before this
        returns; the write goes on meanwhile); a concurrent future of its reply."""

        async def start():
            session = self.dispatcher.session(self.prefill)
            return self.dispatcher.send(session, request, decode_id, 600.0)

        async def wait(reply):
            return await reply

        reply = self._call(start())
        return asyncio.run_coroutine_threadsafe(wait(reply), self.loop)

    def close(self) -> None:
        self._call(self.dispatcher.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
