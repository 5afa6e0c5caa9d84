"""The public Router service: validate, route, relay (thin; logic lives in frontend/routing)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_server import CLIENT_OPTIONS
from common.runtime.reliability import FAILED_NODE_KEY as _FAILED_NODE_KEY
from common.tls import NO_TLS, TLSConfig, make_channel
from common.tracing import TRACEPARENT_KEY, Span, Tracing
from common.wire import prefill_reply_timings
from proto import internal_pb2, pdserve_pb2, pdserve_pb2_grpc
from router.access_log import AccessEntry, log_access
from router.dispatch import PrefillDispatcher, failed_by_prefill
from router.frontend import Frontend, ParsedRequest
from router.migration import Seam, StreamProgress, continuation_route, held_back, migratable
from router.models import BASE_MODEL, ModelChoice, ModelNotFound
from router.node_session import NodeSession
from router.policy import NoRoute
from router.reasoning_output import ReasoningOutput
from router.relay import node_messages
from router.routing import Routing
from router.stats import RequestTrace
from router.tool_calls import ToolCallOutput, ToolCallsFailed

logger = logging.getLogger(__name__)

# A stream silent for router.relay.SILENCE_CHECK_S has its decode node probed
# (grpc.health.v1 Check); a node that does not answer within PROBE_TIMEOUT_S is
# taken for stalled. One probe per node serves every silent stream on it for PROBE_TTL_S.
PROBE_TIMEOUT_S = 2.0
PROBE_TTL_S = 1.0
# How long the old connection to a restarted node's address may finish what is
# on it before it is closed (its process is gone: nothing should be).
OLD_CHANNEL_GRACE_S = 5.0
# A client whose deadline passes cancels its stream; our copy of the deadline
# (its grpc-timeout counted from when the call arrived) ends this much later at
# most, so a cancel this close to it is the deadline's doing.
DEADLINE_SLACK_S = 0.25
_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED


def out_of_time(deadline: float | None) -> bool:
    """Whether a client's deadline (time.monotonic(); None: never) is all but over."""
    return deadline is not None and deadline - DEADLINE_SLACK_S <= time.monotonic()


class RequestFailed(Exception):
    """A request refused or failed, as a gRPC status: each encoding reports it its own way."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class RouterServicer(pdserve_pb2_grpc.RouterServicer):
    def __init__(
        self,
        frontend: Frontend,
        routing: Routing,
        tls: TLSConfig = NO_TLS,
        access_log: bool = True,
        tracing: Tracing | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        self.frontend = frontend
        # The gRPC API's tool calls (router/tool_calls.py): --tool-call-parser;
        # its reasoning split (router/reasoning_output.py): --reasoning-parser.
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.tracing = tracing or Tracing.off()
        self.access_log = access_log  # one INFO line per request (router/access_log.py)
        self.routing = routing
        self.tls = tls  # for the calls to nodes (Decode, and the admin API's NodeControl)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._sessions: dict[str, NodeSession] = {}  # by decode node address
        # Disaggregated requests' Prefills, sent from here (router/dispatch.py).
        self.dispatcher = PrefillDispatcher(self.channel)
        # Per node address: when its last liveness probe started, and the probe.
        self._probes: dict[str, tuple[float, asyncio.Future]] = {}
        self._closing: set[asyncio.Future] = set()  # old channels of restarted nodes
        routing.restarted.append(self.forget_connections)

    def forget_connections(self, node) -> None:
        """``node`` restarted: the next call to its address opens a new
        connection (and session). The old one may be in gRPC's reconnect
        backoff after the refused connects of the restart, and would fail
        calls at once for up to its backoff (router/routing.py)."""
        address = node.address
        self._sessions.pop(address, None)
        self.dispatcher.forget(address)
        self._probes.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            closing = asyncio.ensure_future(channel.close(grace=OLD_CHANNEL_GRACE_S))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    def channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = make_channel(address, self.tls, CLIENT_OPTIONS)
        return channel

    def session(self, node) -> NodeSession:
        """The router's DecodeSession with this decode node (router/node_session.py)."""
        session = self._sessions.get(node.address)
        if session is None:
            channel = self.channel(node.address)
            session = self._sessions[node.address] = NodeSession(channel, node.node_id)
        return session

    async def Generate(
        self, request: pdserve_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ):
        traceparent = dict(context.invocation_metadata() or ()).get(TRACEPARENT_KEY, "")
        try:
            calls = ToolCallOutput.of(request, self.tool_call_parser)
        except ToolCallsFailed as e:
            await context.abort(e.code, str(e))
        reasoning = ReasoningOutput.of(request, self.reasoning_parser)
        try:
            async with contextlib.aclosing(
                self.generate(request, context.time_remaining(), traceparent)
            ) as responses:
                async for response in responses:
                    if reasoning is not None:  # first: the calls are in the answer alone
                        reasoning.observe(response)
                    if calls is not None:
                        calls.observe(response)
                    yield response
        except RequestFailed as e:
            await context.abort(e.code, e.details)

    async def generate(
        self,
        request: pdserve_pb2.GenerateRequest,
        timeout_s: float | None,
        traceparent: str = "",
        prompt_ids: list[int] | None = None,
    ):
        """The one request path of both encodings (gRPC Generate, the OpenAI HTTP API):
        validate, route, relay, retry. Yields the responses; raises RequestFailed.
        ``traceparent``: the client's W3C trace context, if it sent one;
        ``prompt_ids``: an empty list, filled with the prompt's token ids (as
        the nodes compute it: templated, truncated) before the first response
        (the HTTP API's return_token_ids; GenerateResponse does not carry them)."""
        trace = RequestTrace(time.monotonic())
        span = self.tracing.start("request", traceparent, trace.start)
        client_id = request.request_id or uuid.uuid4().hex
        # The routing read goes out before the request is checked, where the
        # prompt's hashes are known first: the checks run during its round trip.
        model = await self._model(request, span)
        early = self.frontend.early(request, model)
        started = self.routing.start_view(early.block_hashes) if early is not None else None
        parsed = self._checked(request, early, model, span)
        deadline = None if timeout_s is None else trace.start + timeout_s
        progress = StreamProgress(len(parsed.prompt_token_ids))
        state = _Request(client_id, trace, deadline, progress, parsed, span)
        try:
            async for response in self._attempts(request, state, early, started):
                if prompt_ids is not None and not prompt_ids:
                    # The checks may parse the request again (a new context
                    # length): the prompt the nodes got is known by now.
                    prompt_ids.extend(state.original.prompt_token_ids)
                yield response
        finally:
            self._finished(state)

    async def _model(self, request, span) -> ModelChoice:
        """The model ``request.model`` names (RequestFailed: NOT_FOUND naming it)."""
        try:
            return await self.routing.model(request.model)
        except ModelNotFound as e:
            self.routing.stats.requests_by_status[grpc.StatusCode.NOT_FOUND.name] += 1
            span.end(attributes={"pdserve.status": grpc.StatusCode.NOT_FOUND.name})
            raise RequestFailed(grpc.StatusCode.NOT_FOUND, str(e)) from None

    def _checked(self, request, early, model, span) -> ParsedRequest:
        """The request, validated (RequestFailed: INVALID_ARGUMENT naming the
        problem, or RESOURCE_EXHAUSTED where this router relays its limit)."""
        stats = self.routing.stats
        try:
            parsed = self.parse(request, early, count=False, model=model)
        except RequestFailed as e:
            failed = e
        else:
            limit = self.routing.config.max_in_flight
            if self.routing.inflight.in_flight < limit:
                return parsed
            failed = RequestFailed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this router relays {limit} requests already (--max-in-flight); try again later",
            )
        stats.requests_by_status[failed.code.name] += 1
        span.end(attributes={"pdserve.status": failed.code.name})
        raise failed from None

    async def _attempts(self, request, state: _Request, early, started):
        """The request's attempts until one succeeds, retried elsewhere while
        nothing reached the client, migrated where its decode node failed mid-stream."""
        stats = self.routing.stats
        parsed, original, progress = state.original, state.original, state.progress
        avoid: dict[str, int] = {}  # node id -> started_ms of the process that failed this
        failure: grpc.aio.AioRpcError | None = None  # the last attempt's
        attempt = -1
        while (attempt := attempt + 1) < self.routing.config.max_attempts:
            if attempt:
                stats.retries += 1
            if started is not None and parsed.block_hashes is not early.block_hashes:
                started = None  # the checks changed the prompt: read it anew
            continuing = attempt == 0 and progress.migrations > 0
            routed = await self._route(parsed, avoid, started, failure, state, continuing)
            started = None  # one read per decision: retries read again
            if parsed.max_model_len != self.frontend.max_model_len and not progress.migrations:
                # That read taught the router another context length (the first
                # read after the nodes registered, or changed theirs): the checks
                # run again against it, as a node would run them.
                state.status = grpc.StatusCode.INVALID_ARGUMENT
                parsed = original = state.original = self.parse(
                    request, None, count=False, model=parsed.model
                )
                state.status = grpc.StatusCode.CANCELLED
            decision = routed.decision
            state.nodes = (
                decision.prefill.node_id if decision.prefill else "",
                decision.decode.node_id,
            )
            tried = _Attempt(self, routed, parsed, request, state)
            async for response in tried.relay():
                yield response
            state.status, state.usage = tried.status, tried.usage
            state.attempts += 1
            if tried.error is None:
                return
            failure = tried.error
            if out_of_time(state.deadline):
                # The client's deadline ended it (a node's abort at that instant
                # may arrive first): no other attempt can finish, no node is at fault.
                state.status = _DEADLINE
                raise RequestFailed(_DEADLINE, "Deadline Exceeded")
            if tried.received and self.migrate(original, progress, failure, routed, state):
                parsed = self.frontend.continuation(original, progress.token_ids)
                failed = routed.decision.decode
                avoid = {failed.node_id: failed.started_ms}
                attempt = -1  # the continuation has its own tries
                continue
            if tried.received or not tried.retry_elsewhere(avoid):
                raise RequestFailed(failure.code(), failure.details() or str(failure.code()))
            logger.info(
                "request %s: attempt %d failed before its first token (%s: %s); retrying",
                state.client_id,
                attempt + 1,
                failure.code().name,
                failure.details(),
            )
        raise RequestFailed(failure.code(), f"{failure.details()} (after {attempt + 1} attempts)")

    async def _route(self, parsed, avoid, started, failure, state: _Request, continuing: bool):
        """The nodes for the next attempt (RequestFailed where none is left);
        a migrated stream's continuation may wait for a decode node to come back."""
        try:
            if continuing:
                return await continuation_route(
                    self.routing, parsed, avoid, state.client_id, state.deadline
                )
            routed = await self.routing.route(parsed, avoid, started)
        except NoRoute as no_route:  # no usable node, or Redis unreachable
            if failure is not None:  # every node left failed: say how the last did
                raise RequestFailed(failure.code(), failure.details() or str(no_route)) from None
            state.status = grpc.StatusCode.UNAVAILABLE
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, str(no_route)) from None
        return routed

    def _finished(self, state: _Request) -> None:
        """The request's end in the stats, the access log and its span."""
        trace, usage, now = state.trace, state.usage, time.monotonic()
        if state.status is grpc.StatusCode.CANCELLED and out_of_time(state.deadline):
            # The client's deadline ended it, not the client: count it as such.
            state.status = _DEADLINE
        stats = self.routing.stats
        if state.progress.migrations:
            ok = state.status is grpc.StatusCode.OK
            stats.migrations["completed" if ok else "failed"] += 1
        prompt = usage.prompt_tokens if usage else len(state.original.prompt_token_ids)
        cached = usage.cached_tokens if usage else 0
        stats.finished(trace, now, state.status.name, usage.prompt_tokens if usage else 0, cached)
        ttft_ms = (trace.first_token - trace.start) * 1e3 if trace.first_token else None
        entry = AccessEntry(
            state.client_id,
            state.status.name,
            prompt,
            cached,
            usage.completion_tokens if usage else trace.tokens,
            ttft_ms,
            (now - trace.start) * 1e3,
            *state.nodes,
            prefill_ms=usage.timing.prefill_node_ms if usage else 0.0,
        )
        if self.access_log:
            log_access(entry)
        state.span.end(now, entry.attributes(state.attempts, state.progress.migrations))

    def parse(
        self, request, early, count: bool = True, model: ModelChoice = BASE_MODEL
    ) -> ParsedRequest:
        """The request checked (router/frontend.py), or RequestFailed(INVALID_ARGUMENT)."""
        try:
            parsed = self.frontend.parse(request, early, model)
        except ValueError as e:
            if count:  # else the request's end counts it
                self.routing.stats.requests_by_status[grpc.StatusCode.INVALID_ARGUMENT.name] += 1
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if count and (so := parsed.params.structured_outputs) is not None:
            self.routing.stats.structured_by_kind[so.kind] += 1
        return parsed

    def migrate(self, parsed, progress: StreamProgress, failure, routed, state) -> bool:
        """Set ``progress`` up for a continuation on another decode node, if allowed."""
        stats = self.routing.stats
        if not migratable(failure, progress, parsed.params, self.routing.config.max_migrations):
            if progress.token_ids and failure.code() is grpc.StatusCode.UNAVAILABLE:
                stats.migrations["refused"] += 1
            return False
        stats.migrations["started"] += 1
        progress.migrations += 1
        progress.resume_offset = len(progress.token_ids)
        held = held_back(
            self.frontend.tokenizer,
            progress.token_ids,
            progress.text,
            parsed.params.skip_special_tokens,
        )
        stops = parsed.params.stop_strings
        progress.seam = Seam(held, stops, parsed.params.include_stop_str_in_output)
        logger.info(
            "request %s: decode node %s failed after %d tokens (%s); continuing the stream "
            "on a decode node (move %d of at most %d)",
            state.client_id,
            routed.decision.decode.node_id,
            progress.resume_offset,
            failure.details(),
            progress.migrations,
            self.routing.config.max_migrations,
        )
        return True

    async def node_responsive(self, address: str) -> bool:
        """Whether the node at ``address`` answers a health check in time.

        Any answer counts (a draining node says NOT_SERVING and still finishes
        its streams); no answer -- a SIGSTOPped or wedged process, a partition
        -- does not. It asks the node itself, so it works while Redis is down.
        """
        now = time.monotonic()
        probe = self._probes.get(address)
        if probe is None or now - probe[0] > PROBE_TTL_S:
            probe = (now, asyncio.ensure_future(self._probe(address)))
            self._probes[address] = probe
        return await asyncio.shield(probe[1])

    async def _probe(self, address: str) -> bool:
        stub = health_pb2_grpc.HealthStub(self.channel(address))
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            return e.code() not in (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNAVAILABLE,
            )
        return True

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()
        await self.dispatcher.close()
        for channel in self._channels.values():
            await channel.close()
        for closing in list(self._closing):
            await closing


@dataclass(slots=True)
class _Request:
    """One client request across its attempts: what its end reports (the
    stats, the access log line, its span)."""

    client_id: str
    trace: RequestTrace
    deadline: float | None  # time.monotonic() at which the client gives up; None: never
    progress: StreamProgress
    original: ParsedRequest
    span: Span
    status: grpc.StatusCode = grpc.StatusCode.CANCELLED
    usage: pdserve_pb2.Usage | None = None
    nodes: tuple[str, str] = ("", "")  # (prefill, decode) of the last attempt
    attempts: int = 0


class _Attempt:
    """One try at a request: its stream from the chosen decode node (and its
    Prefill to the chosen prefill node), relayed."""

    def __init__(self, servicer, routed, parsed, request, state: _Request) -> None:
        self.servicer = servicer
        self.progress = state.progress  # the client's stream so far (router/migration.py)
        self.routing = servicer.routing
        self.routed = routed
        self.parsed = parsed
        self.request = request
        self.client_id = state.client_id
        self.deadline = state.deadline  # time.monotonic() at which the client gives up; None: never
        self.trace = state.trace
        self.traceparent = state.span.traceparent  # the router's span, for the nodes' own
        self.received = False
        self.status = grpc.StatusCode.CANCELLED
        self.usage = None
        self.error: grpc.aio.AioRpcError | None = None
        self.prefill_reply: asyncio.Future | None = None  # the Prefill's, where there is one

    def downstream(self, command: internal_pb2.SessionCommand) -> internal_pb2.DecodeRequest:
        """The request to the decode node, built inside its start command (no copy)."""
        route = self.routed.decision
        downstream = command.start.request
        # Unique downstream even when clients reuse ids: streams never cross.
        downstream.request_id = uuid.uuid4().hex
        downstream.prompt_token_ids.extend(self.parsed.prompt_token_ids)
        # Its max_tokens resolved by the router (router/frontend.py), and for a
        # migrated request's continuation reduced by the tokens it has.
        downstream.sampling.CopyFrom(self.progress.sampling(self.parsed.sampling))
        downstream.cache_salt = self.parsed.cache_salt
        downstream.resume_offset = self.progress.resume_offset
        downstream.traceparent = self.traceparent
        model = self.parsed.model
        if model.lora_name:  # both nodes apply it (common/sessions/prefill.py copies it)
            downstream.lora.name = model.lora_name
            downstream.lora.digest = model.lora_digest
        if route.prefill is not None:
            downstream.prefill.node_id = route.prefill.node_id
            downstream.prefill.address = route.prefill.address
            downstream.prefill.tensor_parallel_size = route.prefill.tensor_parallel_size
        return downstream

    async def relay(self):
        route = self.routed.decision
        command = internal_pb2.SessionCommand()
        downstream = self.downstream(command)
        dispatch = self.routing.dispatch(self.routed)
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        call = None
        try:
            session = self.servicer.session(route.decode)
            if route.prefill is not None:
                self.prefill_reply = self.servicer.dispatcher.send(
                    route.prefill, downstream, route.decode, timeout
                )
            call = await session.start(command, timeout)
            if self.prefill_reply is not None:
                self.prefill_reply.add_done_callback(lambda f: self.prefill_ended(f, call))
            node = route.decode
            messages = node_messages(
                call,
                node.node_id,
                lambda: self.servicer.node_responsive(node.address),
                # A stop string across a migration's seam ends the stream at a message:
                # keep the node's messages apart while the seam is open.
                coalesce=lambda: self.progress.seam is None or not self.progress.seam.open,
            )
            async with contextlib.aclosing(messages):
                async for response in messages:
                    seam_stop = self.relayed(response, dispatch)
                    yield response
                    if seam_stop:
                        break  # a stop string across a migration's seam ended it
            self.status = grpc.StatusCode.OK
            self.routing.inflight.succeeded(route.decode.node_id)
        except grpc.aio.AioRpcError as e:
            self.status = e.code()
            self.error = e
            if e.code() is grpc.StatusCode.UNAVAILABLE and self.decode_unreachable():
                # Dead or partitioned, mid-stream or not: others avoid it until
                # it answers again or its heartbeat expires.
                self.routing.inflight.failed(route.decode.node_id)
        finally:
            if call is not None:
                call.cancel()  # a no-op once the stream ended; else the client left
            reply = self.prefill_reply
            if reply is not None and not reply.done() and self.status is not grpc.StatusCode.OK:
                reply.cancel()  # the session cancels it on the node
            self.routing.inflight.finish(dispatch)

    def relayed(self, response: pdserve_pb2.GenerateResponse, dispatch) -> bool:
        """A node's message made the client's, in place (its id, a migration's
        seam, the Final's figures); True where a stop string across the seam ends it."""
        self.received = True
        now, trace = time.monotonic(), self.trace
        response.request_id = self.client_id
        seam_stop = self.progress.rewrite(response)  # text only: same tokens
        new_tokens = self.progress.observe(response)
        if new_tokens and trace.first_token is None:
            self.routing.inflight.first_token(dispatch)
        trace.on_tokens(new_tokens, now)
        if response.HasField("final"):
            self.usage = response.final.usage
            self.reply_timings()
            ttft_s = trace.first_token - trace.start if trace.first_token else 0.0
            self.usage.time_to_first_token_ms = ttft_s * 1e3
        return seam_stop

    def reply_timings(self) -> None:
        """The Prefill's own figures onto the Final, where its reply came by
        now (it comes about when the first token does); nothing waits for it."""
        reply = self.prefill_reply
        if reply is not None and reply.done() and not reply.cancelled() and not reply.exception():
            prefill_reply_timings(reply.result(), self.usage)

    def prefill_ended(self, reply: asyncio.Future, call) -> None:
        """The Prefill failing before the decode node's first message ends the
        request on the decode node with its status, the prefill node at fault."""
        if reply.cancelled() or reply.exception() is None or self.received:
            return
        error = reply.exception()
        timed_out = isinstance(error, grpc.aio.AioRpcError) and error.code() is _DEADLINE
        if timed_out and out_of_time(self.deadline):
            return  # the client's own deadline: the decode node ends the request so too
        call.fail(failed_by_prefill(error, self.routed.decision.prefill.node_id))

    def decode_unreachable(self) -> bool:
        # A decode node answers UNAVAILABLE itself only to name a failed prefill
        # node (in the trailing metadata); any other UNAVAILABLE is the
        # transport's (refused, reset) or the router's (it stopped answering).
        return _FAILED_NODE_KEY not in dict(self.error.trailing_metadata() or ())

    def retry_elsewhere(self, avoid: dict[str, int]) -> bool:
        """Whether the failure allows another attempt (nothing was sent to the
        client, the cause is a node, not the request); adds the node at fault
        to ``avoid``, with the started_ms of its process."""
        code = self.error.code()
        route = self.routed.decision
        failed = dict(self.error.trailing_metadata() or ()).get(_FAILED_NODE_KEY)
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
            return False
        if failed:  # the decode node is fine; its prefill node failed
            prefill = route.prefill
            avoid[failed] = prefill.started_ms if prefill and prefill.node_id == failed else 0
            if code is grpc.StatusCode.UNAVAILABLE:
                self.routing.inflight.failed(failed)
        else:
            avoid[route.decode.node_id] = route.decode.started_ms
        return True
