"""Request migration: a stream whose decode node died after tokens reached the
client continues on another decode node, seamlessly.

The continuation is the same request with the tokens generated so far
appended to the prompt (the new node reuses any cached prefix of it), with
``max_tokens`` and ``min_tokens`` reduced by their number, and with
``resume_offset`` telling a seeded request how many draws of its generator
those tokens already made, so that it samples exactly what the first node
would have (a speculating node's generator, too, stands at one draw per
emitted token; docs/engine.md names the one exception, a draft model's
sampled proposals). The router stitches the new stream to the client:

* text the first node held back (a possible stop string's prefix, half a
  UTF-8 character) was never sent; the router decodes it from the tokens and
  sends it before the continuation's text;
* a stop string that begins in that held-back text and ends in the new text
  is one neither node can see; ``Seam`` finds it, truncates the text there and
  ends the stream as the first node would have;
* usage counts the original prompt and every generated token.

Where no decode node can take the continuation (the stream's node was the
only one), ``continuation_route`` waits a bounded time (--migration-wait)
for one to come back: a supervisor restarts a dead node within seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from proto import pdserve_pb2
from router.policy import NoRoute

logger = logging.getLogger(__name__)

# A migrated stream with no decode node to continue on reads Redis again this
# often, for up to --migration-wait, for one to come back.
MIGRATION_POLL_S = 0.25


@dataclass(slots=True)
class Seam:
    """Stop strings across a migration's seam (the router's only stop check)."""

    held: str
    stops: list[str]
    include_stop: bool
    pending: str = ""
    open: bool = False

    def __post_init__(self) -> None:
        self.pending = self.held
        # Only a match that starts in the held-back text is the router's to
        # find; once the text is this long, none can start there any more.
        self.open = bool(self.held)

    def feed(self, text: str, last: bool) -> tuple[str, str | None]:
        """New text from the continuation -> (text for the client, stop string hit)."""
        if not self.open:
            return text, None
        self.pending += text
        found = None
        for stop in self.stops:
            i = self.pending.find(stop)
            if 0 <= i < len(self.held) and (found is None or i < found[0]):
                found = (i, stop)
        if found is not None:
            i, stop = found
            self.open = False
            return self.pending[: i + (len(stop) if self.include_stop else 0)], stop
        longest = max((len(s) for s in self.stops), default=1)
        if last or len(self.pending) >= len(self.held) + longest - 1:
            self.open = False
            out, self.pending = self.pending, ""
            return out, None
        return "", None


@dataclass(slots=True)
class StreamProgress:
    """What the client has received of one request (n = 1) across its attempts."""

    prompt_len: int
    token_ids: list[int] = field(default_factory=list)
    # The text sent, in its pieces: joined only on a migration (``text``), not
    # copied whole on every message of every stream.
    texts: list[str] = field(default_factory=list)
    migrations: int = 0
    # Set while relaying a continuation: the generated tokens its prompt holds.
    resume_offset: int = 0
    seam: Seam | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def observe(self, response: pdserve_pb2.GenerateResponse) -> int:
        """Records what the client is sent; the number of new tokens."""
        before = len(self.token_ids)
        for delta in response.deltas:
            self.token_ids.extend(delta.token_ids)
            self.texts.append(delta.text)
        return len(self.token_ids) - before

    def sampling(self, original: pdserve_pb2.SamplingParams) -> pdserve_pb2.SamplingParams:
        """The sampling parameters of the current attempt (a continuation's are reduced)."""
        if not self.resume_offset:
            return original
        out = pdserve_pb2.SamplingParams()
        out.CopyFrom(original)
        k = self.resume_offset
        out.max_tokens = (original.max_tokens if original.HasField("max_tokens") else 16) - k
        if original.HasField("min_tokens"):
            out.min_tokens = max(0, original.min_tokens - k)
        # The prompt was truncated already; the continuation's must stay whole.
        out.ClearField("truncate_prompt_tokens")
        return out

    def rewrite(self, response: pdserve_pb2.GenerateResponse) -> bool:
        """Stitch a continuation's message into the client's stream, in place;
        True when the router itself ends the stream here (a stop string across the seam)."""
        if not self.resume_offset:
            return False
        last = response.HasField("final")
        stop = None
        if self.seam is not None:
            if response.deltas:
                response.deltas[0].text, stop = self.seam.feed(response.deltas[0].text, last)
            elif last:
                text, stop = self.seam.feed("", last)
                if text:
                    response.deltas.add(index=0, text=text)
        if last or stop is not None:
            final = response.final
            if stop is not None:
                del final.completions[:]
                final.completions.add(
                    index=0, finish_reason=pdserve_pb2.FINISH_REASON_STOP, stop_string=stop
                )
            final.usage.prompt_tokens = self.prompt_len
            # Every token the client got, from each node (observe runs after this).
            final.usage.completion_tokens = len(self.token_ids) + sum(
                len(d.token_ids) for d in response.deltas
            )
        return stop is not None


def migratable(error: grpc.aio.AioRpcError, progress: StreamProgress, params, limit: int) -> bool:
    """Whether a stream that failed after its first token may continue elsewhere:
    its decode node is gone or stalled (UNAVAILABLE), the request is one
    stream (n = 1, no prompt logprobs) and it has migrations left."""
    return (
        error.code() is grpc.StatusCode.UNAVAILABLE
        and params.n == 1
        and params.prompt_logprobs is None
        and progress.migrations < limit
        and bool(progress.token_ids)
        and (params.max_tokens is None or len(progress.token_ids) < params.max_tokens)
    )


def held_back(tokenizer, token_ids: list[int], sent: str, skip_special_tokens: bool) -> str:
    """Text of ``token_ids`` that the node held back (never sent): decoded
    here, less a trailing incomplete character, which the next node completes."""
    if tokenizer is None:
        return ""
    full = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens).rstrip("\ufffd")
    return full[len(sent) :] if full.startswith(sent) else ""


async def continuation_route(routing, parsed, avoid, client_id: str, deadline: float | None):
    """A migrated stream's route. With no decode node to take it now (the
    only one died), read Redis again every MIGRATION_POLL_S for up to
    --migration-wait (within the client's deadline) for one to come back:
    a restarted node registers within seconds. NoRoute once that is over."""
    wait_s = routing.config.migration_wait_s
    end = time.monotonic() + wait_s
    if deadline is not None:
        end = min(end, deadline)
    try:
        return await routing.route(parsed, avoid)
    except NoRoute as no_route:
        if time.monotonic() >= end:
            raise
        logger.info(
            "request %s: no decode node can take the stream now (%s); waiting up to "
            "%.1f s (--migration-wait) for one to come back",
            client_id,
            no_route,
            end - time.monotonic(),
        )
    began = time.monotonic()
    while True:
        await asyncio.sleep(MIGRATION_POLL_S)
        try:
            routed = await routing.route(parsed, avoid)
        except NoRoute as no_route:
            if time.monotonic() < end:
                continue
            raise NoRoute(
                f"no decode node came back within {time.monotonic() - began:.1f} s "
                f"(--migration-wait): {no_route}"
            ) from None
        logger.info(
            "request %s: decode node %s takes the stream after %.1f s",
            client_id,
            routed.decision.decode.node_id,
            time.monotonic() - began,
        )
        return routed
