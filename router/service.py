"""The public Router service: validate, route, relay (thin; logic lives in frontend/policy)."""

from __future__ import annotations

import logging
import time
import uuid

import grpc

from common.cluster import Cluster
from proto import internal_pb2, internal_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from router.frontend import Frontend
from router.policy import NoRoute, choose_route

logger = logging.getLogger(__name__)


class RouterServicer(pdserve_pb2_grpc.RouterServicer):
    def __init__(self, frontend: Frontend, cluster: Cluster, remote_prefill: bool = True) -> None:
        self.frontend = frontend
        self.cluster = cluster
        self.remote_prefill = remote_prefill
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> internal_pb2_grpc.DecodeNodeStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return internal_pb2_grpc.DecodeNodeStub(channel)

    async def Generate(
        self, request: pdserve_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ):
        start = time.monotonic()
        client_id = request.request_id or uuid.uuid4().hex
        try:
            parsed = self.frontend.parse(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            candidates = await self.cluster.candidates(parsed.block_hashes)
        except Exception as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cluster state is unavailable: {e}")
        # A request that must be prefilled where it is decoded goes without a prefill node.
        remote = (
            self.remote_prefill and parsed.params.n == 1 and parsed.params.prompt_logprobs is None
        )
        try:
            route = choose_route(
                candidates, self.frontend.model_id, self.frontend.block_size, remote
            )
        except NoRoute as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
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
        call = self._stub(route.decode.address).Decode(downstream, timeout=context.time_remaining())
        first_token_ms = None
        try:
            async for response in call:
                response.request_id = client_id
                if first_token_ms is None and any(d.token_ids for d in response.deltas):
                    first_token_ms = (time.monotonic() - start) * 1e3
                if response.HasField("final"):
                    response.final.usage.time_to_first_token_ms = first_token_ms or 0.0
                yield response
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or str(e.code()))
        finally:
            call.cancel()  # a no-op once the stream ended; else the client left

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
