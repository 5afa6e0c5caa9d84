"""Protobuf <-> engine objects. The only place that knows both; servicers stay thin.

Errors in what a client sent surface as ValueError naming the field, which the
servicers turn into INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from engine.sequence import FinishReason, Logprob
from proto import pdserve_pb2

_SCALARS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "include_stop_str_in_output",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "prompt_logprobs",
    "disable_spec_decode",
)
_FINISH = {
    FinishReason.STOP: pdserve_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: pdserve_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pdserve_pb2.FINISH_REASON_ABORT,
}


def prefill_reply_timings(resp, usage) -> None:
    """A Prefill reply's own figures into a request's ``usage.timing``."""
    usage.timing.prefill_queue_ms = resp.queue_ms
    usage.timing.prefill_compute_ms = resp.compute_ms
    usage.timing.kv_transfer_ms = resp.transfer_ms
    usage.timing.prefill_node_ms = resp.node_ms


def token_ids_of(repeated) -> list[int]:
    """A message's repeated token ids as a list. A slice builds the list in one C
    call, in half the time of ``list()``, which walks the field id by id (on
    every request, on each node;
    docs/lab/2026-11-27-prefill-hop-same-gpu-baseline.md)."""
    return repeated[:]


def sampling_params_from_proto(
    msg: pdserve_pb2.SamplingParams, output_kind: RequestOutputKind = RequestOutputKind.DELTA
) -> SamplingParams:
    """SamplingParams from the wire; unset fields keep vLLM's defaults, except
    max_tokens: unset on the wire means up to the context left, which the
    InputProcessor resolves (engine/input_processor.py), not SamplingParams' 16."""
    kwargs: dict = {"output_kind": output_kind, "max_tokens": None}
    for name in _SCALARS:
        if msg.HasField(name):
            value = getattr(msg, name)
            kwargs[name] = (
                int(value) if isinstance(value, int) and not isinstance(value, bool) else value
            )
    if msg.stop:
        kwargs["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(msg.allowed_token_ids)
    if msg.bad_words:
        kwargs["bad_words"] = list(msg.bad_words)
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_proto(msg.structured_outputs)
    return SamplingParams(**kwargs)


def structured_outputs_from_proto(msg: pdserve_pb2.StructuredOutputs) -> StructuredOutputsParams:
    """The engine's spec; ValueError (naming the field) when no kind is set."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError(
            "structured_outputs sets no kind: set one of json_schema, regex, choice, "
            "grammar, json_object, structural_tag"
        )
    if kind == "json_object" and not msg.json_object:
        raise ValueError("structured_outputs.json_object must be true when set")
    value = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    name = "json" if kind == "json_schema" else kind
    return StructuredOutputsParams(
        **{name: value}, disable_any_whitespace=msg.disable_any_whitespace
    )


def structured_outputs_to_proto(so: StructuredOutputsParams) -> pdserve_pb2.StructuredOutputs:
    """The wire form of an engine spec (json as its text)."""
    msg = pdserve_pb2.StructuredOutputs(disable_any_whitespace=so.disable_any_whitespace)
    kind = so.kind
    if kind == "json":
        msg.json_schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
    elif kind == "choice":
        msg.choice.choices.extend(so.choice)
    else:
        setattr(msg, kind, getattr(so, kind))
    return msg


def token_logprobs_to_proto(token_id: int, entry: dict[int, Logprob]) -> pdserve_pb2.TokenLogprobs:
    """The chosen token and the top candidates (best first; the chosen one may be among them)."""
    chosen = entry[token_id]
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return pdserve_pb2.TokenLogprobs(
        token_id=token_id,
        logprob=chosen.logprob,
        rank=chosen.rank or 0,
        top=[
            pdserve_pb2.TopLogprob(token_id=t, logprob=lp.logprob, text=lp.decoded_token or "")
            for t, lp in ranked
        ],
    )


@dataclass(slots=True)
class StreamState:
    """What a decode node's stream of one request has said so far."""

    completion_tokens: int = 0
    finished: dict[int, pdserve_pb2.Completion] = field(default_factory=dict)


def output_to_responses(
    out: RequestOutput, request_id: str, state: StreamState, usage: pdserve_pb2.Usage
) -> list[pdserve_pb2.GenerateResponse]:
    """One engine DELTA output -> at most one message: the completions' new output
    and, when the request is done, the Final."""
    response = pdserve_pb2.GenerateResponse(request_id=request_id)
    if out.prompt_logprobs:  # a DELTA output carries them once, with the first token
        response.prompt_logprobs.extend(prompt_logprobs_to_proto(out))
    for c in out.outputs:
        if c.token_ids or c.text:
            delta = response.deltas.add(index=c.index, text=c.text, token_ids=c.token_ids)
            if c.logprobs:
                delta.logprobs.extend(
                    token_logprobs_to_proto(t, e)
                    for t, e in zip(c.token_ids, c.logprobs, strict=True)
                )
            state.completion_tokens += len(c.token_ids)
        if c.finish_reason is not None and c.index not in state.finished:
            done = pdserve_pb2.Completion(
                index=c.index, finish_reason=_FINISH[FinishReason(c.finish_reason)]
            )
            if isinstance(c.stop_reason, str):
                done.stop_string = c.stop_reason
            elif isinstance(c.stop_reason, int):
                done.stop_token_id = c.stop_reason
            state.finished[c.index] = done
    if out.finished:
        response.final.completions.extend(state.finished[i] for i in sorted(state.finished))
        response.final.usage.CopyFrom(usage)
        response.final.usage.prompt_tokens = len(out.prompt_token_ids)
        response.final.usage.completion_tokens = state.completion_tokens
    if not response.deltas and not response.HasField("final") and not response.prompt_logprobs:
        return []
    return [response]


def prompt_logprobs_to_proto(out: RequestOutput) -> list[pdserve_pb2.TokenLogprobs]:
    """The prompt's logprobs from its second token on (the first has none)."""
    return [
        token_logprobs_to_proto(token, entry)
        for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True)
        if entry is not None
    ]
