"""router/frontend.py: what Frontend.early gives before the checks is what parse checks.

The router hashes a prompt and starts its routing read before it validates
the request (service.py); parse must then produce the same ids and hashes as
without that head start, and refuse the same requests with the same message.
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from proto import pdserve_pb2
from router.frontend import Frontend


@pytest.fixture(scope="module")
def frontend(demo_model_dir):
    return Frontend(EngineConfig.from_kwargs(str(demo_model_dir), max_model_len=1024))


def request(**kw) -> pdserve_pb2.GenerateRequest:
    sampling = pdserve_pb2.SamplingParams(**kw.pop("sampling", {"max_tokens": 4}))
    return pdserve_pb2.GenerateRequest(sampling=sampling, **kw)


CASES = {
    "token ids": request(token_ids=pdserve_pb2.TokenIds(ids=list(range(1, 70)))),
    "salted": request(token_ids=pdserve_pb2.TokenIds(ids=list(range(1, 70))), cache_salt="t"),
    "text": request(prompt="The capital of France is a city whose name has five letters. " * 3),
    "out of vocabulary": request(token_ids=pdserve_pb2.TokenIds(ids=[5, 10**9])),
    "bad sampling and ids": request(
        token_ids=pdserve_pb2.TokenIds(ids=[10**9]), sampling={"temperature": -1.0}
    ),
    "too long for max_tokens": request(
        token_ids=pdserve_pb2.TokenIds(ids=[7] * 100), sampling={"max_tokens": 1000}
    ),
    "empty": request(token_ids=pdserve_pb2.TokenIds(ids=[])),
}


@pytest.mark.parametrize("name", CASES)
def test_parse_with_the_head_start_equals_parse_without(frontend, name):
    req = CASES[name]
    early = frontend.early(req)
    assert early is not None
    try:
        plain = frontend.parse(req)
    except ValueError as e:
        with pytest.raises(ValueError) as info:
            frontend.parse(req, early)
        assert str(info.value) == str(e)
        return
    fast = frontend.parse(req, early)
    assert fast.prompt_token_ids == plain.prompt_token_ids
    assert fast.block_hashes == plain.block_hashes and fast.block_hashes is early.block_hashes
    assert fast.params == plain.params and fast.cache_salt == plain.cache_salt


def test_no_head_start_where_the_checks_may_change_the_prompt(frontend):
    truncated = request(
        token_ids=pdserve_pb2.TokenIds(ids=list(range(1, 70))),
        sampling={"max_tokens": 4, "truncate_prompt_tokens": 20},
    )
    chat = request(chat=pdserve_pb2.ChatMessages(messages=[{"role": "user", "content": "hi"}]))
    assert frontend.early(truncated) is None  # the checks cut the prompt first
    assert frontend.early(chat) is None  # its template's errors come after sampling's
    assert frontend.early(request()) is None  # no input at all
    assert len(frontend.parse(truncated).prompt_token_ids) == 20
