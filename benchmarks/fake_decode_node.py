"""A fake decode node for the router's benchmark (router_relay.py) and the
event-loop tests: a real gRPC server in its own process, registered in
Redis like a node, that serves the internal DecodeNode API with no model
behind it: every request gets ``max_tokens`` one-token messages, one per
interval, the last with its Final."""

from __future__ import annotations

import asyncio
import time

NODE_ID = "fake-decode-0"


class TokenTicks:
    """Ticks shared by every stream of the fake node, on a fixed cadence: each
    stream's next token waits for the next tick, so all of them leave in the same
    loop turn, as an engine step hands its outputs over together (and a
    DecodeSession sends them as one message). Tick k is due at the first
    tick's time + k intervals, whenever its waiters come: a clock whose next
    tick was scheduled by its first waiter ran slow by that waiter's delay on a
    loaded host (up to a few ms an interval)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._origin: float | None = None
        self._ticks: dict[int, asyncio.Future] = {}

    async def tick(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._origin is None:
            self._origin = now
        k = int((now - self._origin) // self.interval_s) + 1
        due = self._ticks.get(k)
        if due is None:
            due = self._ticks[k] = loop.create_future()
            loop.call_at(self._origin + k * self.interval_s, self._fire, k)
        await asyncio.shield(due)

    def _fire(self, k: int) -> None:
        self._ticks.pop(k).set_result(None)


class FakeWorker:
    """What DecodeWorker.decode streams, with no engine behind it: max_tokens
    one-token messages (16 unset), one per ``interval_s``, the last with its Final;
    with ``lockstep`` every stream's tokens leave together on TokenTicks
    (the first one too: a request joins the next step)."""

    def __init__(self, interval_s: float = 0.0, lockstep: bool = False) -> None:
        self.interval_s = interval_s
        self.clock = TokenTicks(interval_s) if lockstep and interval_s > 0 else None

    async def decode(self, request, deadline):
        from proto import pdserve_pb2

        n = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
        for i in range(n):
            if self.clock is not None:
                await self.clock.tick()
            response = pdserve_pb2.GenerateResponse(request_id=request.request_id)
            response.deltas.add(index=0, text=" tok", token_ids=[100 + i % 1000])
            if i == n - 1:
                response.final.completions.add(
                    index=0, finish_reason=pdserve_pb2.FINISH_REASON_LENGTH
                )
                response.final.usage.prompt_tokens = len(request.prompt_token_ids)
                response.final.usage.completion_tokens = n
            yield response
            if self.interval_s and self.clock is None:
                await asyncio.sleep(self.interval_s)  # one engine step


def fake_servicer(worker):
    """A DecodeNode servicer around ``worker`` (DecodeWorker.decode's contract):
    DecodeSession through the real node's session code. It does not check the
    caller's protocol version, so that a router of another tree
    (``router_relay.py --compare-tree``) can be measured against it."""
    from decode_node.session import DecodeSession
    from proto import internal_pb2_grpc

    class Servicer(internal_pb2_grpc.DecodeNodeServicer):
        async def DecodeSession(self, request_iterator, context):
            async for batch in DecodeSession(worker).run(request_iterator):
                yield batch

    return Servicer()


async def fake_node(
    redis_url: str, port: int, model_id: str, block_size: int, interval_s: float, lockstep: bool
) -> None:
    import grpc

    from common.cluster.state import Cluster, NodeInfo, NodeRole
    from proto import internal_pb2_grpc

    server = grpc.aio.server()
    internal_pb2_grpc.add_DecodeNodeServicer_to_server(
        fake_servicer(FakeWorker(interval_s, lockstep)), server
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    cluster = Cluster.from_url(redis_url)
    info = NodeInfo(
        NODE_ID,
        NodeRole.DECODE,
        f"127.0.0.1:{port}",
        model_id,
        block_size,
        kv_blocks_total=1 << 20,
        kv_blocks_free=1 << 20,
        max_num_seqs=4096,
    )
    while True:
        await cluster.heartbeat(info)
        await asyncio.sleep(0.5)


def wait_routable(address: str, timeout_s: float = 60) -> None:
    """Until a one-token request goes through (the router has seen the node)."""
    from proto.client import generate

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            for _ in generate(address, token_ids=[1, 2, 3], max_tokens=1, timeout=5):
                pass
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
