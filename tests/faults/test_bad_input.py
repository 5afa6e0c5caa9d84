"""Property-based fuzzing of GenerateRequest at the router's edge (hypothesis).

Whatever a client sends -- over-long prompts, huge max_tokens, negative or
out-of-vocabulary ids anywhere, NaN or infinite or out-of-range sampling
values, huge n, empty prompts, odd strings -- the router's Frontend either
returns a request every node can run, or raises ValueError with a message
(which the service turns into INVALID_ARGUMENT). Nothing else, ever.
test_bad_input_live.py sends the same requests to a live cluster.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from proto import pdserve_pb2
from router.frontend import Frontend

MAX_LEN = 256


@pytest.fixture(scope="module")
def frontend(demo_model_dir):
    return Frontend(EngineConfig.from_kwargs(str(demo_model_dir), max_model_len=MAX_LEN))


V = 49152  # the demo model's vocabulary

# Each field is mostly valid and sometimes not, so that most examples carry
# one or two faults (and some none): a fault must be caught on its own, not
# only behind another one.
any_int = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([-1, 0, 1, V - 1, V, V + 1, MAX_LEN, MAX_LEN + 1, 2**31, 2**32]),
)
any_float = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-2.0, -1.0, 0.0, 1e-9, 0.5, 1.0, 2.0, 2.0001, 1e308]),
)
text = st.text(max_size=64)
token = st.integers(0, V - 1)


def pair(good, bad=any_int):
    return good, bad


# name -> (valid values, faulty values). Each example breaks at most one of
# them (sometimes none), so that every check is reached on its own, not only
# behind another fault.
FIELDS = {
    "n": pair(st.integers(1, 3), st.one_of(any_int, st.integers(257, 10**6))),
    "top_k": pair(st.integers(-1, 50)),
    "seed": pair(st.integers(0, 2**31)),
    "max_tokens": pair(st.integers(1, 64), st.one_of(any_int, st.just(2**62))),
    "min_tokens": pair(st.integers(0, 4)),
    "logprobs": pair(st.integers(0, 5)),
    "truncate_prompt_tokens": pair(st.integers(1, MAX_LEN)),
    "temperature": pair(st.floats(0, 2), any_float),
    "top_p": pair(st.floats(0.01, 1), any_float),
    "min_p": pair(st.floats(0, 1), any_float),
    "presence_penalty": pair(st.floats(-2, 2), any_float),
    "frequency_penalty": pair(st.floats(-2, 2), any_float),
    "repetition_penalty": pair(st.floats(0.1, 2), any_float),
}
LISTS = {
    "stop": pair(text.filter(bool), st.just("")),
    "stop_token_ids": pair(token),
    "allowed_token_ids": pair(token),
}
INPUT_FAULTS = ["prompt", "token_ids", "chat", "logit_bias", "no_input"]
FAULTS = [None, None, None, *FIELDS, *LISTS, *INPUT_FAULTS]


@st.composite
def sampling(draw, fault, max_tokens: int | None = None) -> pdserve_pb2.SamplingParams:
    s = pdserve_pb2.SamplingParams()
    for name, (good, bad) in FIELDS.items():
        if name == fault:
            setattr(s, name, draw(bad))
        elif name == "max_tokens" and max_tokens is not None:
            s.max_tokens = draw(st.integers(1, max_tokens))
        elif draw(st.booleans()):
            setattr(s, name, draw(good))
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if draw(st.booleans()):
            setattr(s, name, draw(st.booleans()))
    for name, (good, bad) in LISTS.items():
        values = draw(st.lists(good, max_size=2))
        if name == fault:
            values.append(draw(bad))
        getattr(s, name).extend(values)
    bias = draw(st.dictionaries(token, st.floats(-100, 100), max_size=2))
    if fault == "logit_bias":
        bias[draw(any_int)] = draw(any_float)
    for k, v in bias.items():
        s.logit_bias[k] = v
    return s


@st.composite
def requests(
    draw, max_tokens: int | None = None, max_len: int = MAX_LEN
) -> pdserve_pb2.GenerateRequest:
    """Mostly valid GenerateRequests, each with at most one fault.

    For live clusters, where decoding costs time: ``max_tokens``, unless it is
    the fault, is always set and at most this (unset, it would be 16);
    ``max_len``, the max_model_len that prompt lengths aim at.
    """
    fault = draw(st.sampled_from(FAULTS))
    r = pdserve_pb2.GenerateRequest(sampling=draw(sampling(fault, max_tokens)))
    kind = fault if fault in ("prompt", "token_ids", "chat", "no_input") else None
    kind = kind or draw(st.sampled_from(["prompt", "token_ids", "chat"]))
    if kind == "prompt":
        bad = st.sampled_from(["", "word " * max_len])
        r.prompt = draw(bad if fault == "prompt" else text.filter(str.strip))
    elif kind == "token_ids":
        good = st.lists(token, min_size=1, max_size=max_len // 2)
        bad = st.one_of(
            st.lists(any_int, max_size=8), st.lists(token, min_size=max_len, max_size=max_len + 8)
        )
        r.token_ids.ids.extend(draw(bad if fault == "token_ids" else good))
        r.token_ids.SetInParent()
    elif kind == "chat":
        count = draw(st.just(0) if fault == "chat" else st.integers(1, 3))
        for _ in range(count):
            r.chat.messages.add(role=draw(st.sampled_from(["user", "system"])), content=draw(text))
        r.chat.SetInParent()
    if draw(st.booleans()):
        r.cache_salt = draw(text)
    return r


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(request=requests())
def test_the_frontend_accepts_a_runnable_request_or_says_why(frontend, request):
    try:
        parsed = frontend.parse(request)
    except ValueError as e:
        assert str(e).strip(), "an empty error message helps nobody"
        return
    v = frontend.config.model_config.vocab_size
    ids = parsed.prompt_token_ids
    assert 0 < len(ids) < MAX_LEN and all(0 <= t < v for t in ids)
    p = parsed.params
    assert 1 <= p.n <= frontend.config.max_num_seqs  # a huge n would never fit a node
    assert p.max_tokens is None or p.max_tokens >= 1
    for value in (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty):
        assert math.isfinite(value)
    assert math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0
    assert all(0 <= t < v for t in p.stop_token_ids or [])
    assert all(0 <= t < v for t in p.allowed_token_ids or [])
    assert all(0 <= t < v and math.isfinite(b) for t, b in (p.logit_bias or {}).items())
    assert len(parsed.block_hashes.primary) == len(ids) // frontend.block_size
