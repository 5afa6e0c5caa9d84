"""A request sent straight to the nodes as the router sends it, by a
synchronous client (benchmarks/disagg_ttft.py's direct path): the router's
own NodeSession with the decode node and, for a disaggregated request, its
PrefillDispatcher's Prefill to the prefill node beside it, on an event loop of
the client's own thread."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from proto import internal_pb2, pdserve_pb2
from router.dispatch import PrefillDispatcher
from router.node_session import NodeSession


class DirectClient:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._sessions: dict[str, NodeSession] = {}
        self.dispatcher = self._call(self._dispatcher())

    async def _dispatcher(self) -> PrefillDispatcher:
        return PrefillDispatcher(self._channel)

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address)
        return self._channels[address]

    def _call(self, coro, timeout: float = 600):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def generate(
        self,
        decode: internal_pb2.NodeRef,
        prefill: internal_pb2.NodeRef | None,
        ids: list[int],
        sampling: pdserve_pb2.SamplingParams,
        request_id: str,
    ) -> tuple[float, pdserve_pb2.Final, internal_pb2.PrefillResponse | None]:
        """(TTFT in ms from the send, the Final, the Prefill's reply or None)."""
        return self._call(self._generate(decode, prefill, ids, sampling, request_id))

    async def _generate(self, decode, prefill, ids, sampling, request_id):
        session = self._sessions.get(decode.address)
        if session is None:
            session = NodeSession(self._channel(decode.address), decode.node_id)
            self._sessions[decode.address] = session
        command = internal_pb2.SessionCommand()
        request = command.start.request
        request.request_id = request_id
        request.prompt_token_ids.extend(ids)
        request.sampling.CopyFrom(sampling)
        start = time.perf_counter()
        reply = None
        if prefill is not None:
            request.prefill.CopyFrom(prefill)
            reply = self.dispatcher.send(prefill, request, decode, 600.0)
        call = await session.start(command, 600.0)
        ttft, final = None, None
        while (response := await call.read()) is not grpc.aio.EOF:
            if ttft is None and any(d.token_ids for d in response.deltas):
                ttft = (time.perf_counter() - start) * 1e3
            if response.HasField("final"):
                final = response.final
        return ttft, final, (await reply if reply is not None else None)

    def close(self) -> None:
        async def close():
            await self.dispatcher.close()
            for session in self._sessions.values():
                await session.close()
            for channel in self._channels.values():
                await channel.close()

        self._call(close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
