"""The public Router service: validate, route, relay (thin; logic lives in frontend/routing)."""

from __future__ import annotations

import logging
import time
import uuid

import grpc

from common.tls import NO_TLS, TLSConfig, make_channel
from proto import internal_pb2, internal_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from router.frontend import Frontend
from router.policy import NoRoute
from router.routing import Routing
from router.stats import RequestTrace

logger = logging.getLogger(__name__)

# Channel states that mean the node itself is unreachable (not a failed request).
_UNREACHABLE = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


class RouterServicer(pdserve_pb2_grpc.RouterServicer):
    def __init__(self, frontend: Frontend, routing: Routing, tls: TLSConfig = NO_TLS) -> None:
        self.frontend = frontend
        self.routing = routing
        self.tls = tls  # for the calls to nodes (Decode, and the admin API's NodeControl)
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = make_channel(address, self.tls)
        return channel

    async def Generate(
        self, request: pdserve_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ):
        trace = RequestTrace(time.monotonic())
        stats = self.routing.stats
        client_id = request.request_id or uuid.uuid4().hex
        try:
            parsed = self.frontend.parse(request)
        except ValueError as e:
            stats.requests_by_status["INVALID_ARGUMENT"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            routed = await self.routing.route(parsed)
        except NoRoute as e:  # no usable node, or Redis unreachable
            stats.requests_by_status["UNAVAILABLE"] += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        route = routed.decision
        downstream = internal_pb2.DecodeRequest(
            # Unique downstream even when clients reuse ids: streams never cross.
            request_id=uuid.uuid4().hex,
            prompt_token_ids=parsed.prompt_token_ids,
            sampling=request.sampling,
            cache_salt=parsed.cache_salt,
        )
        if route.prefill is not None:
            downstream.prefill.node_id = route.prefill.node_id
            downstream.prefill.address = route.prefill.address
        dispatch = self.routing.dispatch(routed)
        channel = self.channel(route.decode.address)
        call = internal_pb2_grpc.DecodeNodeStub(channel).Decode(
            downstream, timeout=context.time_remaining()
        )
        status, usage, received = "CANCELLED", None, False
        try:
            async for response in call:
                received = True
                now = time.monotonic()
                response.request_id = client_id
                new_tokens = sum(len(d.token_ids) for d in response.deltas)
                if new_tokens and trace.first_token is None:
                    self.routing.inflight.first_token(dispatch)
                trace.on_tokens(new_tokens, now)
                if response.HasField("final"):
                    usage = response.final.usage
                    usage.time_to_first_token_ms = (
                        (trace.first_token - trace.start) * 1e3 if trace.first_token else 0.0
                    )
                yield response
            status = "OK"
            self.routing.inflight.succeeded(route.decode.node_id)
        except grpc.aio.AioRpcError as e:
            status = e.code().name
            if (
                e.code() is grpc.StatusCode.UNAVAILABLE
                and not received
                and channel.get_state() in _UNREACHABLE
            ):
                self.routing.inflight.failed(route.decode.node_id)
            await context.abort(e.code(), e.details() or str(e.code()))
        finally:
            call.cancel()  # a no-op once the stream ended; else the client left
            self.routing.inflight.finish(dispatch)
            stats.finished(
                trace,
                time.monotonic(),
                status,
                usage.prompt_tokens if usage else 0,
                usage.cached_tokens if usage else 0,
            )

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
